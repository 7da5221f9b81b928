"""ZeRO-1 (`strategy="zero1"`): parameters replicated as under dp, optimizer state
sharded over `fsdp_axis` by the FSDP rule. Against dp and against plain
single-device Optax training on the same global data, 8 simulated devices."""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from reference import max_diff

import eqxdist as ed

OPTIMIZER = optax.adamw(1e-2, weight_decay=0.1)
MIN_WEIGHT_SIZE = 64


class MLP(eqx.Module):
    layers: list

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.Linear(16, 64, key=k[0]),
            eqx.nn.Linear(64, 64, key=k[1]),
            eqx.nn.Linear(64, 4, key=k[2]),
        ]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)


def loss_fn(model, batch, key):
    del key
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


def _batches(steps=3, rows=32):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(rows, 16)).astype(np.float32),
            "y": rng.integers(0, 4, size=rows).astype(np.int32),
        }
        for _ in range(steps)
    ]


def _single_device(model, batches):
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = OPTIMIZER.init(params)
    for batch in batches:
        grads = eqx.filter_grad(lambda m, b=batch: loss_fn(m, b, None)[0])(model)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        params = eqx.filter(model, eqx.is_inexact_array)
    return model


def _train(mesh, strategy, batches, **kw):
    step = ed.make_train_step(
        loss_fn,
        OPTIMIZER,
        mesh,
        strategy=strategy,
        min_weight_size=MIN_WEIGHT_SIZE,
        **kw,
    )
    state = ed.TrainState.create(MLP(jax.random.key(0)), OPTIMIZER, jax.random.key(1))
    for batch in batches:
        state, _ = step(state, batch)
    return step, jax.block_until_ready(state)


@pytest.fixture(scope="module", params=["auto", "explicit"])
def trained(request):
    mesh = ed.create_data_parallel_mesh(axis_types=request.param)
    batches = _batches()
    return {
        "single": _single_device(MLP(jax.random.key(0)), batches),
        "dp": _train(mesh, "dp", batches),
        "zero1": _train(mesh, "zero1", batches),
    }


def test_zero1_trains_as_dp_and_single_device(trained):
    _, dp = trained["dp"]
    _, zero1 = trained["zero1"]
    assert max_diff(zero1.model, dp.model) < 1e-5
    assert max_diff(zero1.model, trained["single"]) < 1e-5
    assert max_diff(zero1.opt_state, dp.opt_state) < 1e-5
    assert int(zero1.step) == 3


def _bytes_per_device(tree):
    """Bytes of `tree`'s arrays on device 0 (every device holds as much here)."""
    return sum(
        x.addressable_shards[0].data.nbytes
        for x in jax.tree.leaves(tree)
        if eqx.is_array(x)
    )


def test_zero1_shards_the_optimizer_state_only(trained):
    step, zero1 = trained["zero1"]
    _, dp = trained["dp"]
    # Parameters are replicated, as under dp.
    for x in jax.tree.leaves(eqx.filter(zero1.model, eqx.is_array)):
        assert x.sharding.is_fully_replicated
    # Every moment of a leaf above min_weight_size is split in 8 on device 0.
    adam = 0  # optax.adamw: chain(scale_by_adam, add_decayed_weights, ...)
    for moments in ("mu", "nu"):
        z = getattr(zero1.opt_state[adam], moments)
        d = getattr(dp.opt_state[adam], moments)
        big = [
            (a, b)
            for a, b in zip(jax.tree.leaves(z), jax.tree.leaves(d), strict=True)
            if a.size > MIN_WEIGHT_SIZE
        ]
        assert len(big) == 3  # the weights; biases of <= 64 elements stay whole
        for a, b in big:
            assert a.addressable_shards[0].data.size * 8 == b.size
            assert b.addressable_shards[0].data.shape == b.shape
        assert _bytes_per_device([a for a, _ in big]) * 8 == _bytes_per_device(
            [b for _, b in big]
        )
    specs = step.state_specs(zero1)
    assert specs.opt_state[adam].mu.layers[1].weight == P("data", None)
    assert specs.opt_state[adam].mu.layers[2].bias == P()  # 4 elements: replicated
    assert set(jax.tree.leaves(specs.model)) == {P()}


def test_zero1_with_hsdp_axes_and_rules():
    """ZeRO-1 over `fsdp_axis="data"` of a (replica, data) mesh, and with a
    tensor-parallel rule on a (data, model) mesh: single-device parameters."""
    batches = _batches()
    single = _single_device(MLP(jax.random.key(0)), batches)
    hsdp_mesh = ed.create_device_mesh({"replica": 2, "data": 4})
    step, hsdp = _train(
        hsdp_mesh, "zero1", batches, data_axis=("replica", "data"), fsdp_axis="data"
    )
    assert max_diff(hsdp.model, single) < 1e-5
    mu = hsdp.opt_state[0].mu.layers[1].weight
    assert step.state_specs(hsdp).opt_state[0].mu.layers[1].weight == P("data", None)
    assert mu.addressable_shards[0].data.shape == (16, 64)
    tp_mesh = ed.create_device_mesh({"data": 4, "model": 2})
    rule = [(r"layers\[1\]\.weight", P(None, "model"))]
    step, tp = _train(tp_mesh, "zero1", batches, param_rules=rule)
    assert max_diff(tp.model, single) < 1e-5
    specs = step.state_specs(tp)
    assert specs.model.layers[1].weight == P(None, "model")
    assert specs.opt_state[0].mu.layers[1].weight == P("data", "model")


def test_eval_step_accepts_zero1(trained, mesh8):
    _, zero1 = trained["zero1"]

    def eval_fn(model, batch, mask):
        logits = jax.vmap(model)(batch["x"])
        return {"accuracy": ed.metrics.Accuracy().update(logits, batch["y"], mask)}

    batch = _batches(steps=1, rows=20)[0]
    metrics = ed.make_eval_step(eval_fn, mesh8, strategy="zero1")(zero1, batch)
    logits = jax.vmap(trained["single"])(batch["x"])
    expected = np.mean(np.argmax(logits, -1) == batch["y"])
    assert float(metrics["accuracy"].compute()) == pytest.approx(expected)


def test_zero1_errors(mesh8):
    with pytest.raises(ValueError, match=r"make_train_step: unknown strategy 'zero2'"):
        ed.make_train_step(loss_fn, OPTIMIZER, mesh8, strategy="zero2")
    with pytest.raises(ValueError, match=r"`fsdp_axis`='model' is not one of the data"):
        ed.make_train_step(
            loss_fn,
            OPTIMIZER,
            ed.create_device_mesh({"data": 4, "model": 2}),
            strategy="zero1",
            fsdp_axis="model",
        )


def test_zero1_with_frozen_leaves(mesh8):
    """Frozen leaves get no optimizer state and no gradient to scatter."""
    batches = _batches(steps=2)
    model = MLP(jax.random.key(0))
    trainable = eqx.tree_at(
        lambda m: m.layers[1], jax.tree.map(lambda _: True, model), replace=False
    )
    step = ed.make_train_step(
        loss_fn, OPTIMIZER, mesh8, strategy="zero1", min_weight_size=MIN_WEIGHT_SIZE
    )
    state = ed.TrainState.create(
        model, OPTIMIZER, jax.random.key(1), trainable=trainable
    )
    for batch in batches:
        state, _ = step(state, batch)
    trained, frozen = eqx.partition(model, trainable)
    opt_state = OPTIMIZER.init(trained)
    for batch in batches:
        grads = eqx.filter_grad(
            lambda t, b=batch: loss_fn(eqx.combine(t, frozen), b, None)[0]
        )(trained)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, trained)
        trained = eqx.apply_updates(trained, updates)
    assert max_diff(state.model, eqx.combine(trained, frozen)) < 1e-5
    assert max_diff(state.model.layers[1], model.layers[1]) == 0.0
