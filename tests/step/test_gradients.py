"""The gradient phase of a step on any Equinox model: model state (BatchNorm, its
"batch" and "ema" modes), frozen parameters, bf16 compute and FSDP accumulation,
each against single-device training in plain Equinox/Optax (`reference.py`, not
through eqxdist) on the same global data."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import ADAMW as OPTIMIZER, BNNet, batches, bn_loss, counted_loss
from reference import max_diff, train_one_device

import eqxdist as ed


def _batches(steps=3):
    return batches(steps, rows=64)


def _bn_single_device(data, optimizer, n, devices, mode="batch", **options):
    """A `BNNet` trained on one device: `n` minibatches as on `devices` devices."""
    model, model_state = eqx.nn.make_with_state(BNNet)(jax.random.key(3), "batch", mode)
    return train_one_device(
        model,
        data,
        optimizer,
        bn_loss,
        model_state=model_state,
        minibatches=n,
        devices=devices,
        **options,
    )


def _bn_step(model, model_state, data, optimizer, mesh, **options):
    """`model` trained by a step of `bn_loss`: the state and the last metrics."""
    step = ed.make_train_step(bn_loss, optimizer, mesh, min_weight_size=16, **options)
    state = ed.TrainState.create(
        model, optimizer, jax.random.key(0), model_state=model_state
    )
    for batch in data:
        state, metrics = step(state, batch)
    return state, metrics


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
@pytest.mark.parametrize("n", [1, 2])
def test_batchnorm_matches_single_device(axis_types, strategy, n):
    mesh8 = ed.create_data_parallel_mesh(axis_types=axis_types)
    key = jax.random.key(3)
    model, model_state = eqx.nn.make_with_state(BNNet)(key, ("batch", "data"))
    batches = _batches()
    want = _bn_single_device(batches, OPTIMIZER, n, devices=8)
    ref_model, ref_state = want.model, want.model_state

    options = {"strategy": strategy, "num_minibatches": n}
    state, metrics = _bn_step(model, model_state, batches, OPTIMIZER, mesh8, **options)
    assert max_diff(state.model, ref_model) < 1e-5
    assert max_diff(state.model_state, ref_state) < 1e-5
    # The running statistics moved (they are not the initial zeros/ones), and the
    # model state comes back replicated.
    means = [x for x in jax.tree.leaves(state.model_state) if x.ndim == 1]
    assert any(float(jnp.abs(m).max()) > 1e-3 for m in means)
    for leaf in jax.tree.leaves(state.model_state):
        assert leaf.sharding.is_fully_replicated
    if strategy == "fsdp":
        assert not state.model.l1.weight.sharding.is_fully_replicated
    assert np.isfinite(float(metrics["loss"].compute()))


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
        model, model_state = eqx.nn.make_with_state(BNNet)(key, ("batch", *axes), mode)
    data = batches()
    want = _bn_single_device(data, optimizer, 2, devices, mode="ema", value=True)
    ref_model, ref_state = want.model, want.model_state

    options = {"strategy": strategy, "data_axis": axes, "num_minibatches": 2}
    state, _ = _bn_step(model, model_state, data, optimizer, mesh, **options)
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


def test_model_state_nonfloat_leaves_from_first_device(mesh8):
    """A per-device counter: floats are averaged, integers taken from device 0."""

    def loss(model, model_state, batch, key):
        del key
        index = jax.lax.axis_index("data")
        new = {"count": model_state["count"] + index, "avg": model_state["avg"] + index}
        return jnp.mean(jax.vmap(model)(batch["x"])), {}, new

    model = eqx.nn.Linear(8, 1, key=jax.random.key(0))
    state = ed.TrainState.create(
        model,
        optax.sgd(0.1),
        jax.random.key(0),
        model_state={"count": jnp.int32(5), "avg": jnp.float32(1.0)},
    )
    step = ed.make_train_step(loss, optax.sgd(0.1), mesh8)
    state, _ = step(state, _batches(steps=1)[0])
    assert int(state.model_state["count"]) == 5  # device 0 added 0
    assert float(state.model_state["avg"]) == pytest.approx(1.0 + 3.5)


def _mlp_step(mesh, optimizer=OPTIMIZER, **options):
    """A step of `counted_loss`, leaves of 16 elements and more sharded."""
    return ed.make_train_step(
        counted_loss, optimizer, mesh, min_weight_size=16, **options
    )


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_frozen_leaves_never_change(mesh8, strategy):
    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(1))
    trainable = jax.tree.map(lambda _: False, model)
    trainable = eqx.tree_at(lambda m: m.layers[-1], trainable, True)
    state = ed.TrainState.create(
        model, OPTIMIZER, jax.random.key(0), trainable=trainable
    )
    # No optimizer state for frozen leaves.
    mu = state.opt_state[0].mu
    assert mu.layers[0].weight is None and mu.layers[-1].weight is not None
    step = _mlp_step(mesh8, strategy=strategy)
    batches = _batches()
    for batch in batches:
        state, _ = step(state, batch)
    for frozen_layer in state.model.layers[:-1]:
        original = model.layers[state.model.layers.index(frozen_layer)]
        np.testing.assert_array_equal(frozen_layer.weight, original.weight)
        np.testing.assert_array_equal(frozen_layer.bias, original.bias)
    if strategy == "fsdp":  # frozen leaves are placed and sharded like the rest
        assert not state.model.layers[0].weight.sharding.is_fully_replicated

    # The trainable head matches plain optax on one device.
    want = train_one_device(model, batches, OPTIMIZER, counted_loss, trainable)
    assert max_diff(state.model, want.model) < 1e-5


def test_frozen_leaves_are_inputs_not_constants(mesh8):
    model = eqx.nn.MLP(8, 4, 256, 1, key=jax.random.key(1))
    trainable = eqx.tree_at(
        lambda m: m.layers[0], jax.tree.map(lambda _: True, model), False
    )
    state = ed.TrainState.create(
        model, OPTIMIZER, jax.random.key(0), trainable=trainable
    )
    step = ed.make_train_step(counted_loss, OPTIMIZER, mesh8)
    hlo = step.lower(state, _batches(steps=1)[0]).as_text()
    # A 256x8 frozen weight baked in would appear as a large constant.
    assert not re.search(r"constant\(.*\{.{2000,}", hlo)
    n_params = len(jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    compiled = step.lower(state, _batches(steps=1)[0]).compile()
    assert compiled.as_text().count("parameter(") >= n_params


def test_bf16_compute_close_to_bf16_reference(mesh8):
    # SGD: Adam would turn tiny bf16 rounding differences into full-size steps.
    opt = optax.sgd(0.1)
    model = eqx.nn.MLP(8, 4, 32, 2, key=jax.random.key(2))
    batches = _batches()
    for strategy in ["dp", "fsdp"]:
        step = _mlp_step(
            mesh8, optimizer=opt, strategy=strategy, compute_dtype=jnp.bfloat16
        )
        state = ed.TrainState.create(model, opt, jax.random.key(0))
        for batch in batches:
            state, _ = step(state, batch)
        # float32 master weights and optimizer state.
        for leaf in jax.tree.leaves(
            eqx.filter((state.model, state.opt_state), eqx.is_inexact_array)
        ):
            assert leaf.dtype == jnp.float32

        def bf16_loss(p, batch, key):
            cast = jax.tree.map(
                lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, p
            )
            return counted_loss(cast, batch, key)

        params = train_one_device(model, batches, opt, bf16_loss).model
        diff = max_diff(state.model, params)
        print(strategy, diff, max_diff(params, model))
        assert diff < 5e-3
        f32 = _mlp_step(mesh8, optimizer=opt, strategy=strategy)
        s32 = ed.TrainState.create(model, opt, jax.random.key(0))
        for batch in batches:
            s32, _ = f32(s32, batch)
        # bf16 differs from float32 training (the cast is real).
        assert max_diff(state.model, s32.model) > 1e-6


def test_bf16_fsdp_gathers_move_bf16(mesh8):
    model = eqx.nn.MLP(8, 4, 64, 2, key=jax.random.key(2))
    state = ed.TrainState.create(model, OPTIMIZER, jax.random.key(0))
    step = _mlp_step(mesh8, strategy="fsdp", compute_dtype=jnp.bfloat16)
    # The program JAX hands to XLA (XLA:CPU itself computes bf16 collectives in
    # float32; GPU and TPU keep them bf16).
    text = step.lower(state, _batches(steps=1)[0]).as_text()
    collectives = [line for line in text.splitlines() if "stablehlo.all_gather" in line]
    assert len(collectives) >= 4
    for line in collectives:
        assert "xbf16>" in line and "xf32>" not in line, line


def _collectives(compiled):
    """All-gathers and reduce-scatters executed per step."""
    counts = ed.count_collectives(compiled)
    return counts["all-gather"] + counts["reduce-scatter"]


def test_fsdp_accumulation_gathers_once(mesh8):
    model = eqx.nn.MLP(8, 4, 64, 2, key=jax.random.key(2))
    state = ed.TrainState.create(model, OPTIMIZER, jax.random.key(0))
    batch = _batches(steps=1)[0]
    counts = {}
    for n, gather in [(1, "step"), (4, "step"), (4, "minibatch")]:
        step = _mlp_step(mesh8, strategy="fsdp", num_minibatches=n, fsdp_gather=gather)
        compiled = step.lower(state, batch).compile()
        counts[n, gather] = _collectives(compiled)
        scatters = ed.count_collectives(compiled)["reduce-scatter"]
        # Gathering once per step, the gradients of all (float32) leaves leave in
        # one reduce-scatter; per minibatch, one per leaf and minibatch.
        assert scatters == 1 if gather == "step" else scatters > n
    assert counts[1, "step"] > 0
    assert counts[4, "step"] <= counts[1, "step"]
    assert counts[4, "minibatch"] > counts[4, "step"]


@pytest.mark.parametrize("gather", ["step", "minibatch"])
def test_fsdp_accumulation_values(mesh8, gather):
    model = eqx.nn.MLP(8, 4, 64, 2, key=jax.random.key(2))
    batches = _batches()
    results = []
    for strategy, n in [("dp", 1), ("fsdp", 4)]:
        fsdp = {"fsdp_gather": gather} if strategy == "fsdp" else {}
        step = _mlp_step(mesh8, strategy=strategy, num_minibatches=n, **fsdp)
        state = ed.TrainState.create(model, OPTIMIZER, jax.random.key(0))
        for batch in batches:
            state, metrics = step(state, batch)
        results.append((state.model, metrics))
    assert max_diff(results[0][0], results[1][0]) < 1e-5
    np.testing.assert_allclose(
        results[0][1]["loss"][0], results[1][1]["loss"][0], rtol=1e-5
    )


def test_train_state_mistakes(mesh8):
    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(1))
    # (Under the jaxtyping hook of the test run its annotation check answers first.)
    with pytest.raises(TypeError, match=r"step"):
        ed.TrainState(model, None, 0, jax.random.key(0))
    with pytest.raises(ValueError, match=r"selects no floating-point array"):
        ed.TrainState.create(model, OPTIMIZER, jax.random.key(0), trainable=False)
    state = ed.TrainState.create(model, optax.adam(1e-3), jax.random.key(0))
    step = ed.make_train_step(
        counted_loss, optax.chain(optax.clip(1.0), optax.adam(1e-3)), mesh8
    )
    with pytest.raises(ValueError, match=r"not what this step's optimizer makes"):
        step(state, _batches(steps=1)[0])

    def string_metrics(model, batch, key):
        return counted_loss(model, batch, key)[0], {"name": "resnet"}

    state = ed.TrainState.create(model, OPTIMIZER, jax.random.key(0))
    with pytest.raises(TypeError, match=r"metrics leaf \['name'\] is a str"):
        ed.make_train_step(string_metrics, OPTIMIZER, mesh8)(
            state, _batches(steps=1)[0]
        )
    with pytest.raises(ValueError, match=r"unknown fsdp_gather 'layer'"):
        ed.make_train_step(counted_loss, OPTIMIZER, mesh8, fsdp_gather="layer")
    with pytest.raises(TypeError, match=r"`compute_dtype` must be a floating-point"):
        ed.make_train_step(counted_loss, OPTIMIZER, mesh8, compute_dtype=jnp.int8)

    def no_state(model, model_state, batch, key):
        return counted_loss(model, batch, key)

    state = ed.TrainState.create(
        model, OPTIMIZER, jax.random.key(0), model_state={"a": jnp.zeros(2)}
    )
    with pytest.raises(TypeError, match=r"\(loss, metrics, new_model_state\)"):
        ed.make_train_step(no_state, OPTIMIZER, mesh8)(state, _batches(steps=1)[0])
