"""The global view (`make_train_step(..., view="global")`): the loss runs once on
the whole global batch, as on one device, on 8 simulated devices under every
layout, against single-device training in plain Equinox and Optax on the same
global batches (`reference.train_one_device`), float32 within 1e-5."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
    BNNet,
    batches,
    bn_loss,
    loss_fn,
    token_batch,
    token_losses,
    token_mlp,
)
from jax.sharding import PartitionSpec as P
from reference import max_diff, train_one_device

import eqxdist as ed

SGD = optax.sgd(0.1)

# name: (mesh shape, make_train_step options)
LAYOUTS = {
    "dp": ({"data": 8}, {}),
    "zero1": ({"data": 8}, {"strategy": "zero1", "min_weight_size": 16}),
    "fsdp": ({"data": 8}, {"strategy": "fsdp", "min_weight_size": 16}),
    "hsdp": (
        {"replica": 2, "data": 4},
        {"strategy": "fsdp", "min_weight_size": 16, "data_axis": ("replica", "data")},
    ),
    "fsdp_tp": (
        {"data": 4, "model": 2},
        {
            "strategy": "fsdp",
            "min_weight_size": 16,
            "param_rules": [(r"layers\[0\]\.weight", P("model", None))],
        },
    ),
}


def _step(layout, loss, optimizer=SGD, axis_types="auto", **kwargs):
    shape, options = LAYOUTS[layout]
    mesh = ed.create_device_mesh(shape, axis_types=axis_types)
    return ed.make_train_step(loss, optimizer, mesh, view="global", **options, **kwargs)


def _devices(layout):
    shape, options = LAYOUTS[layout]
    axes = options.get("data_axis", "data")
    axes = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([shape[a] for a in axes]))


def _mlp():
    return eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0))


def contrastive_loss(model, batch, key):
    """A loss over the whole batch: each row's embedding against every other
    row's (in-batch negatives), with noise of the batch's shape from the key."""
    z = jax.vmap(model)(batch["x"])
    z = z + 0.1 * jax.random.normal(key, z.shape)
    logits = z @ z.T
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.arange(z.shape[0])
    )
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


@pytest.mark.parametrize(
    ("layout", "n", "axis_types"),
    [(layout, 4, "auto") for layout in LAYOUTS]
    + [("dp", 1, "explicit"), ("fsdp", 4, "explicit"), ("fsdp_tp", 1, "explicit")],
)
def test_a_loss_over_the_whole_batch_equals_one_device(layout, n, axis_types):
    data = batches(steps=3)
    key = jax.random.key(1)
    want = train_one_device(
        _mlp(),
        data,
        SGD,
        contrastive_loss,
        minibatches=n,
        devices=_devices(layout),
        key=key,
    )
    step = _step(layout, contrastive_loss, axis_types=axis_types, num_minibatches=n)
    state = ed.TrainState.create(_mlp(), SGD, key)
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"].compute()))
    assert max_diff(state.model, want.model) < 1e-5
    np.testing.assert_allclose(losses, want.losses, rtol=1e-5)
    assert max_diff(state.model, _mlp()) > 1e-3  # it trained
    # The device view computes something else: a loss over each device's rows.
    device = ed.make_train_step(
        contrastive_loss, SGD, ed.create_data_parallel_mesh(), num_minibatches=n
    )
    other = ed.TrainState.create(_mlp(), SGD, key)
    for batch in data:
        other, _ = device(other, batch)
    assert max_diff(other.model, want.model) > 1e-4


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
def test_batchnorm_naming_its_vmap_axis_only_takes_the_whole_batch(layout):
    data = batches(steps=3)
    key = jax.random.key(3)

    def bn_loss(model, model_state, batch, key):
        logits, model_state = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(batch["x"], model_state)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return losses.mean(), {}, model_state

    model, model_state = eqx.nn.make_with_state(BNNet)(key, "batch")
    want = train_one_device(model, data, SGD, bn_loss, model_state=model_state)
    step = _step(layout, bn_loss)
    state = ed.TrainState.create(model, SGD, key, model_state=model_state)
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, want.model) < 1e-5
    assert max_diff(state.model_state, want.model_state) < 1e-5


def test_weighted_loss_step_info_and_a_skipped_step():
    """A `(loss_sum, weight)` loss over 4 minibatches: the token-weighted mean
    over the whole batch; the step statistics of the global gradient; a NaN row
    leaves the state bit-identical."""
    data = [token_batch(0), token_batch(1, empty=(5,), full=(0, 1))]

    def weighted(model, batch, key):
        mask = batch["mask"]
        loss_sum = jnp.sum(jnp.where(mask, token_losses(model, batch), 0.0))
        return (loss_sum, mask.sum()), {}

    def token_mean(model, batch, key):
        mask = batch["mask"]
        return jnp.sum(jnp.where(mask, token_losses(model, batch), 0.0)) / mask.sum()

    want = train_one_device(token_mlp(), data, SGD, token_mean)
    step = _step(
        "hsdp", weighted, num_minibatches=4, step_info=True, skip_nonfinite=True
    )
    state = ed.TrainState.create(token_mlp(), SGD, jax.random.key(0))
    for batch in data:
        out = step(state, batch)
        state, info = out.state, out.info
    assert max_diff(state.model, want.model) < 1e-5
    np.testing.assert_allclose(info["grad_norm"], optax.tree.norm(want.grads), 1e-5)
    np.testing.assert_allclose(info["update_norm"], optax.tree.norm(want.updates), 1e-5)
    assert float(info["skipped"]) == 0.0

    broken = dict(data[0], x=data[0]["x"].copy())
    broken["x"][3, 0, 0] = np.nan
    before = jax.device_get((state.model, state.opt_state))
    out = step(state, broken)
    assert float(out.info["skipped"]) == 1.0 and int(out.state.step) == 3
    after = jax.device_get((out.state.model, out.state.opt_state))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_frozen_leaves_init_state_cost_and_lower():
    data = batches(steps=2)
    every = jax.tree.map(eqx.is_inexact_array, _mlp())
    trainable = eqx.tree_at(lambda m: m.layers[0], every, False)
    want = train_one_device(_mlp(), data, SGD, loss_fn, trainable=trainable)
    step = _step("fsdp", loss_fn)
    state = step.init_state(
        lambda k: ed.TrainState.create(_mlp(), SGD, k, trainable=trainable),
        jax.random.key(0),
    )
    placed = step.place_state(
        ed.TrainState.create(_mlp(), SGD, jax.random.key(0), trainable=trainable)
    )
    assert (
        max_diff((state.model, state.opt_state), (placed.model, placed.opt_state))
        == 0.0
    )
    cost = step.cost(state, data[0])
    device_cost = ed.make_train_step(
        loss_fn, SGD, ed.create_data_parallel_mesh(), strategy="fsdp",
        min_weight_size=16,
    ).cost(placed, data[0])  # fmt: skip
    # The same matrix products, counted from the trace: the loss on all 32 rows
    # once, or on 4 rows on each of 8 devices.
    assert cost["model_flops"] == device_cost["model_flops"] > 0
    assert "all-gather" in step.lower(state, data[0]).compile().as_text()
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, want.model) < 1e-5
    assert max_diff(state.model.layers[0], _mlp().layers[0]) == 0.0


class XwMLP(eqx.Module):
    """An `eqx.nn.Linear` and a plain `x @ w` layer of its own, both 16 x 16."""

    linear: eqx.nn.Linear
    w: jax.Array
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.linear = eqx.nn.Linear(16, 16, key=k1)
        self.w = jax.random.normal(k2, (16, 16)) / 4
        self.head = eqx.nn.Linear(16, 4, key=k3)

    def __call__(self, x):
        return self.head(jnp.tanh(jnp.tanh(self.linear(x)) @ self.w))


def test_the_default_fsdp_placement_is_each_weights_output_features():
    """Under "fsdp" without `fsdp_layout` a global view's step shards each
    weight on its output features ("outputs": an `eqx.nn.Linear`'s leading
    dimension, any other leaf's largest, ties to the later one), where the
    device view's shards every leaf on its leading dimension
    (docs/guides/fsdp.md measures why); a given `fsdp_layout` is kept, and a
    global eval step of the same layout places the state as the train step
    does. The values are one device's."""
    model = XwMLP(jax.random.key(0))
    mesh = ed.create_data_parallel_mesh()
    layout = ed.Layout(mesh, strategy="fsdp", min_weight_size=16)
    state = ed.TrainState.create(model, SGD, jax.random.key(1))
    leading = ed.Layout(
        mesh, strategy="fsdp", min_weight_size=16, fsdp_layout="leading"
    )
    specs = {}
    for view, given in [("global", layout), ("device", layout), ("global", leading)]:
        step = ed.make_train_step(loss_fn, SGD, given, view=view)
        model_specs = step.state_specs(state).model
        specs[view, given is layout] = (model_specs.linear.weight, model_specs.w)
    # The Linear's (out, in) = (16, 16) weight and the (in, out) = (16, 16) `w`.
    assert specs["global", True] == (P("data", None), P(None, "data"))
    assert specs["device", True] == (P("data", None), P("data", None))
    assert specs["global", False] == specs["device", True]
    step = ed.make_train_step(loss_fn, SGD, layout, view="global")
    assert "fsdp_layout='outputs'" in repr(step.layout)
    assert layout.for_view("device") is layout
    evaluate = ed.make_eval_step(lambda model, batch, mask: {}, layout, view="global")
    assert evaluate.layout is step.layout

    data = batches(steps=2, features=16)
    want = train_one_device(model, data, SGD, loss_fn)
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, want.model) < 1e-5
    assert state.model.w.sharding.spec == P(None, "data")


def test_mesh_axes_in_a_global_loss_are_clear_errors():
    def collective(model, batch, key):
        loss = jnp.mean(jax.vmap(model)(batch["x"]))
        return jax.lax.pmean(loss, "data"), {}

    step = _step("dp", collective)
    state = ed.TrainState.create(_mlp(), SGD, jax.random.key(0))
    message = r"loss_fn uses the axis 'data', but in the global view .* no mesh axis"
    with pytest.raises(ValueError, match=message + r" bound.*view='device'"):
        step(state, batches(steps=1)[0])

    model, model_state = eqx.nn.make_with_state(BNNet)(
        jax.random.key(0), ("batch", "data")
    )
    step = _step("dp", bn_loss)
    state = ed.TrainState.create(model, SGD, jax.random.key(0), model_state=model_state)
    with pytest.raises(ValueError, match=r"BatchNorm's `axis_name` names only"):
        step(state, batches(steps=1)[0])
    with pytest.raises(ValueError, match=r"unknown view 'local'.*'device'.*'global'"):
        ed.make_train_step(bn_loss, SGD, ed.create_data_parallel_mesh(), view="local")
