"""Equinox and Optax staples the train step must take as a single-device loop does:
`eqx.nn.BatchNorm(mode="ema")` (a bool flag in the model state),
`optax.MultiSteps`, transformations that read Optax's extra argument `value`
(`optax.contrib.reduce_on_plateau`); and the batches the step must refuse.

Each value test compares with plain single-device Equinox/Optax training on the
same global data."""

import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import max_diff

import eqxdist as ed


class EmaNet(eqx.Module):
    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, key, axis_name, mode):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(8, 16, key=k1)
        self.bn = eqx.nn.BatchNorm(16, axis_name=axis_name, momentum=0.9, mode=mode)
        self.l2 = eqx.nn.Linear(16, 4, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(jax.nn.relu(self.l1(x)), state)
        return self.l2(h), state


def bn_loss(model, model_state, batch, key):
    del key
    logits, model_state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(batch["x"], model_state)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}, model_state


def mlp_loss(model, batch, key):
    del key
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {}


def batches(rows=32, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(rows, 8)).astype(np.float32),
            "y": rng.integers(0, 4, size=rows).astype(np.int32),
        }
        for _ in range(steps)
    ]


def global_minibatches(batch, n, devices):
    """The rows minibatch m sees across the devices: each device's m-th block."""

    def split(x):
        per = x.reshape(devices, n, -1, *x.shape[1:])
        return [per[:, m].reshape(-1, *x.shape[1:]) for m in range(n)]

    parts = {k: split(v) for k, v in batch.items()}
    return [{k: parts[k][m] for k in batch} for m in range(n)]


def reference(model, model_state, data, optimizer, n=1, devices=8):
    """Plain single-device training: minibatches in order, mean gradient, the
    mean loss passed as Optax's `value`."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)

    @jax.jit
    def grads_of(params, model_state, mb):
        def loss(p, s):
            if model_state is None:
                return mlp_loss(eqx.combine(p, static), mb, None)[0], None
            value, _, s = bn_loss(eqx.combine(p, static), s, mb, None)
            return value, s

        return jax.value_and_grad(loss, has_aux=True)(params, model_state)

    for batch in data:
        grads, losses = [], []
        for mb in global_minibatches(batch, n, devices):
            (value, model_state), g = grads_of(params, model_state, mb)
            grads.append(g)
            losses.append(value)
        mean = jax.tree.map(lambda *g: sum(g) / n, *grads)
        updates, opt_state = optimizer.update(
            mean, opt_state, params, value=sum(losses) / n
        )
        params = eqx.apply_updates(params, updates)
    return eqx.combine(params, static), model_state, opt_state


SETUPS = {
    # name: (mesh shape, data axes, strategy)
    "single": ({"data": 1}, ("data",), "dp"),
    "dp": ({"data": 8}, ("data",), "dp"),
    "fsdp": ({"data": 8}, ("data",), "fsdp"),
    "hsdp": ({"replica": 2, "data": 4}, ("replica", "data"), "fsdp"),
}


@pytest.mark.parametrize("mode", ["ema", "legacy"])
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_batchnorm_ema_matches_single_device(setup, mode):
    shape, axes, strategy = SETUPS[setup]
    if mode == "legacy" and setup != "dp":
        pytest.skip("legacy is ema: one layout is enough")
    mesh = ed.create_device_mesh(shape)
    devices = int(np.prod(list(shape.values())))
    optimizer = optax.adam(1e-2)
    key = jax.random.key(3)
    with pytest.warns(UserWarning) if mode == "legacy" else _nothing():
        model, model_state = eqx.nn.make_with_state(EmaNet)(key, ("batch", *axes), mode)
    ref_model, ref_state = eqx.nn.make_with_state(EmaNet)(key, "batch", "ema")
    data = batches()
    ref_model, ref_state, _ = reference(
        ref_model, ref_state, data, optimizer, n=2, devices=devices
    )

    step = ed.make_train_step(
        bn_loss,
        optimizer,
        mesh,
        strategy=strategy,
        data_axis=axes,
        num_minibatches=2,
        min_weight_size=16,
    )
    state = ed.TrainState.create(
        model, optimizer, jax.random.key(0), model_state=model_state
    )
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, ref_model) < 1e-5
    assert max_diff(state.model_state, ref_state) < 1e-5
    flags = [x for x in jax.tree.leaves(state.model_state) if x.dtype == jnp.bool_]
    assert flags == [False]  # the running statistics were started
    if strategy == "fsdp":
        assert not state.model.l1.weight.sharding.is_fully_replicated


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _mlp():
    return eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(1))


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_multisteps_matches_single_device(mesh8, strategy):
    optimizer = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    data = batches(steps=4)
    ref_model, _, _ = reference(_mlp(), None, data, optimizer)

    step = ed.make_train_step(
        mlp_loss, optimizer, mesh8, strategy=strategy, min_weight_size=16
    )
    state = ed.TrainState.create(_mlp(), optimizer, jax.random.key(0))
    models = []
    for batch in data:
        state, _ = step(state, batch)
        models.append(jax.device_get(state.model))
    assert max_diff(state.model, ref_model) < 1e-5
    # Every other step applies the accumulated update.
    assert max_diff(models[0], _mlp()) == 0.0
    assert max_diff(models[1], _mlp()) > 1e-4
    assert max_diff(models[2], models[1]) == 0.0


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_reduce_on_plateau_gets_the_loss(mesh8, strategy):
    # A large step on fresh batches: the loss does not improve every step, so
    # the plateau scale drops only if the step passes the loss as `value`.
    optimizer = optax.chain(
        optax.sgd(2.0),
        optax.contrib.reduce_on_plateau(factor=0.5, patience=0, cooldown=0),
    )
    data = batches(steps=5)
    ref_model, _, ref_opt = reference(_mlp(), None, data, optimizer)
    assert float(ref_opt[1].scale) < 1.0

    step = ed.make_train_step(
        mlp_loss, optimizer, mesh8, strategy=strategy, min_weight_size=16
    )
    state = ed.TrainState.create(_mlp(), optimizer, jax.random.key(0))
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, ref_model) < 1e-5
    assert float(state.opt_state[1].scale) == float(ref_opt[1].scale)
    assert float(state.opt_state[1].best_value) == pytest.approx(
        float(ref_opt[1].best_value), rel=1e-6
    )


def test_not_an_optimizer(mesh8):
    with pytest.raises(TypeError, match=r"make_train_step: `optimizer` must be"):
        ed.make_train_step(mlp_loss, object(), mesh8)
    with pytest.raises(TypeError, match=r"TrainState.create: `optimizer` must be"):
        ed.TrainState.create(_mlp(), object(), jax.random.key(0))


def test_batch_leaves_with_different_rows(mesh8):
    step = ed.make_train_step(mlp_loss, optax.sgd(0.1), mesh8)
    state = ed.TrainState.create(_mlp(), optax.sgd(0.1), jax.random.key(0))
    batch = batches()[0]
    bad = {"x": batch["x"], "y": batch["y"][:16]}
    with pytest.raises(ValueError, match=r"\['x'\]: 32, \['y'\]: 16"):
        step(state, bad)


def test_string_labels_after_good_steps(mesh8):
    step = ed.make_train_step(mlp_loss, optax.sgd(0.1), mesh8)
    state = ed.TrainState.create(_mlp(), optax.sgd(0.1), jax.random.key(0))
    batch = batches()[0]
    state, _ = step(state, batch)
    state, _ = step(state, batch)
    labels = np.array([f"c{i}" for i in batch["y"]])
    with pytest.raises(TypeError, match=r"batch` leaf \['y'\] is a NumPy array of"):
        step(state, {"x": batch["x"], "y": labels})
    objects = batch["y"].astype(object)
    with pytest.raises(TypeError, match=r"batch` leaf \['y'\] is a NumPy array of"):
        step(state, {"x": batch["x"], "y": objects})


def test_empty_batch(mesh8):
    step = ed.make_train_step(mlp_loss, optax.sgd(0.1), mesh8)
    state = ed.TrainState.create(_mlp(), optax.sgd(0.1), jax.random.key(0))
    batch = batches()[0]
    empty = {k: v[:0] for k, v in batch.items()}
    with pytest.raises(ValueError, match="train step: the batch has 0 rows"):
        step(state, empty)
    state, _ = step(state, batch)
    with pytest.raises(ValueError, match="train step: the batch has 0 rows"):
        step(state, empty)


@pytest.mark.slow
def test_fsdp_min_weight_size_not_an_int():
    """Outside the test run's type checking, as a user runs it."""
    code = textwrap.dedent(
        """
        import eqxdist as ed
        ed.simulate_cpu_devices(8)
        import numpy as np
        try:
            ed.FSDP({"w": np.ones((8, 8), np.float32)},
                    ed.create_data_parallel_mesh(), min_weight_size="x")
        except TypeError as e:
            print(e)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "FSDP: `min_weight_size` must be an int" in proc.stdout
    assert "got str 'x'" in proc.stdout


# -- optimizers whose state holds optax.MaskedNode ----------------------------------


def _masked_optimizers():
    def is_matrix(params):
        return jax.tree.map(lambda x: x.ndim == 2, params)

    def groups(params):
        return jax.tree.map(lambda x: "matrix" if x.ndim == 2 else "vector", params)

    return {
        # Weight decay on the matrices only.
        "masked": optax.chain(
            optax.masked(optax.add_decayed_weights(0.1), is_matrix), optax.adam(1e-2)
        ),
        # One learning rate per group.
        "multi_transform": optax.multi_transform(
            {"matrix": optax.adam(1e-2), "vector": optax.sgd(0.1, momentum=0.9)},
            groups,
        ),
        "muon": optax.contrib.muon(1e-2),
    }


LAYOUTS = {
    # name: (mesh shape, make_train_step options)
    "fsdp": ({"data": 8}, {"strategy": "fsdp"}),
    "zero1": ({"data": 8}, {"strategy": "zero1"}),
    "hsdp": (
        {"replica": 2, "data": 4},
        {"strategy": "fsdp", "data_axis": ("replica", "data")},
    ),
    "fsdp_tp": (
        {"data": 4, "model": 2},
        {
            "strategy": "fsdp",
            "param_rules": [
                (r"layers\[0\]\.weight", jax.sharding.PartitionSpec("model"))
            ],
        },
    ),
}


@pytest.mark.parametrize(
    ("optimizer", "layout"),
    [("muon", layout) for layout in LAYOUTS]
    + [("multi_transform", "fsdp_tp"), ("multi_transform", "zero1")]
    + [("masked", "hsdp")],
)
def test_masked_optimizer_states_are_laid_out_and_train(optimizer, layout):
    optimizer = _masked_optimizers()[optimizer]
    shape, options = LAYOUTS[layout]
    data = batches()
    ref_model, _, ref_opt = reference(_mlp(), None, data, optimizer)

    step = ed.make_train_step(
        mlp_loss,
        optimizer,
        ed.create_device_mesh(shape),
        min_weight_size=16,
        **options,
    )
    state = ed.TrainState.create(_mlp(), optimizer, jax.random.key(0))
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, ref_model) < 1e-5
    assert max_diff(state.opt_state, ref_opt) < 1e-5
    # Each state leaf of the (16, 8) weight is laid out as the weight's share of
    # it (its optimizer state under zero1), masked nodes kept where they are.
    specs = step.state_specs(state)
    weight = specs.model.layers[0].weight
    assert "data" in str(weight) or layout == "zero1"
    state_specs = [
        s
        for s, x in zip(
            jax.tree.leaves(specs.opt_state, is_leaf=lambda s: s is None),
            jax.tree.leaves(state.opt_state, is_leaf=lambda s: s is None),
            strict=True,
        )
        if x is not None and x.shape == (16, 8)
    ]
    assert state_specs and all("data" in str(s) for s in state_specs)
    assert jax.tree.structure(specs.opt_state, is_leaf=lambda s: s is None) == (
        jax.tree.structure(state.opt_state, is_leaf=lambda s: s is None)
    )
