"""Parallelism beyond one axis: tuple data axes (HSDP with `fsdp_axis`) and tensor
parallelism from `param_rules`, each against single-device training written in
plain Equinox/optax on the same global data."""

import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P
from reference import max_diff

import eqxdist as ed

OPTIMIZER = optax.adamw(1e-2, weight_decay=0.1)
MEGATRON = (
    (r"\.up\.weight$", P("model", None)),  # column-parallel: output features
    (r"\.up\.bias$", P("model")),
    (r"\.down\.weight$", P(None, "model")),  # row-parallel: input features
)


class Net(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.up = eqx.nn.Linear(16, 64, key=k1)
        self.down = eqx.nn.Linear(64, 16, key=k2)
        self.head = eqx.nn.Linear(16, 4, key=k3)

    def __call__(self, x):
        return self.head(x + self.down(jax.nn.gelu(self.up(x))))


def loss_fn(model, batch, key):
    del key
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


def _batches(steps=3, rows=32, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(rows, 16)).astype(np.float32),
            "y": rng.integers(0, 4, size=rows).astype(np.int32),
        }
        for _ in range(steps)
    ]


def hsdp_batches():
    """The global batches of the multi-process test (32 rows, 16 per process)."""
    return _batches(steps=3, rows=32, seed=7)


def _reference(model, batches):
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = OPTIMIZER.init(params)
    for batch in batches:
        grads = eqx.filter_grad(lambda m, b=batch: loss_fn(m, b, None)[0])(model)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        params = eqx.filter(model, eqx.is_inexact_array)
    return model


@pytest.fixture(scope="module")
def reference():
    return _reference(Net(jax.random.key(0)), _batches())


def _train(step):
    state = ed.TrainState.create(Net(jax.random.key(0)), OPTIMIZER, jax.random.key(1))
    for batch in _batches():
        state, metrics = step(state, batch)
    return state, metrics


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_replica_and_data_axes(reference, strategy, axis_types):
    mesh = ed.create_device_mesh({"replica": 2, "data": 4}, axis_types=axis_types)
    step = ed.make_train_step(
        loss_fn,
        OPTIMIZER,
        mesh,
        strategy=strategy,
        data_axis=("replica", "data"),
        min_weight_size=64,
    )
    state, metrics = _train(step)
    assert max_diff(state.model, reference) < 1e-5
    if strategy == "fsdp":
        # HSDP: sharded over "data" (4 ways), replicated over "replica".
        spec = step.state_specs(state).model.up.weight
        assert spec == P(None, "data") or spec == P("data", None)
        assert state.model.up.weight.sharding.spec == spec
        shard = state.model.up.weight.addressable_shards[0].data
        assert shard.size == state.model.up.weight.size // 4
    expected = float(np.mean([loss_fn(reference, b, None)[0] for b in _batches()[-1:]]))
    assert np.isfinite(float(metrics["loss"].compute())) and expected > 0


# A mixed mesh: the data axis Explicit, the model axis Auto.
MIXED = (AxisType.Explicit, AxisType.Auto)


@pytest.mark.parametrize("axis_types", ["auto", "explicit", MIXED])
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_megatron_rules(reference, strategy, axis_types):
    mesh = ed.create_device_mesh({"data": 4, "model": 2}, axis_types=axis_types)
    step = ed.make_train_step(
        loss_fn,
        OPTIMIZER,
        mesh,
        strategy=strategy,
        param_rules=MEGATRON,
        min_weight_size=64,
    )
    state, _ = _train(step)
    assert max_diff(state.model, reference) < 1e-5
    specs = step.state_specs(state)
    up, down = specs.model.up.weight, specs.model.down.weight
    if strategy == "dp":
        assert up == P("model", None) and down == P(None, "model")
        assert specs.model.head.weight == P()
    else:
        assert up == P("model", "data") and down == P("data", "model")
        # A ruled + FSDP leaf holds 1/8 of its bytes per device.
        leaf = state.model.up.weight
        assert leaf.addressable_shards[0].data.nbytes * 8 == leaf.nbytes
    assert specs.model.up.bias == P("model")
    # Optimizer state follows its parameters, placed that way.
    mu = state.opt_state[0].mu
    assert specs.opt_state[0].mu.up.weight == up
    assert mu.up.weight.sharding.spec == up
    assert state.model.down.weight.sharding.spec == down


def test_rules_with_tuple_axes_and_eval(reference):
    mesh = ed.create_device_mesh({"replica": 2, "data": 2, "model": 2})
    layout = dict(
        strategy="fsdp",
        data_axis=("replica", "data"),
        param_rules=MEGATRON,
        min_weight_size=64,
    )
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh, **layout)
    state, _ = _train(step)
    assert max_diff(state.model, reference) < 1e-5

    def eval_fn(model, batch, mask):
        logits = jax.vmap(model)(batch["x"])
        return {"accuracy": ed.metrics.Accuracy().update(logits, batch["y"], mask)}

    evaluate = ed.make_eval_step(eval_fn, mesh, **layout)
    batch = _batches(steps=1, rows=13, seed=5)[0]
    got = float(evaluate(state, batch)["accuracy"].compute())
    logits = jax.vmap(reference)(batch["x"])
    assert got == pytest.approx(np.mean(np.argmax(logits, -1) == batch["y"]))


def test_rule_mistakes():
    mesh = ed.create_device_mesh({"data": 4, "model": 2})
    state = ed.TrainState.create(Net(jax.random.key(0)), OPTIMIZER, jax.random.key(1))
    batch = _batches(steps=1)[0]

    def make(rules, **kw):
        return ed.make_train_step(loss_fn, OPTIMIZER, mesh, param_rules=rules, **kw)

    with pytest.raises(ValueError, match=r"'tensor'.*not an axis of the mesh"):
        make([(r"up", P("tensor"))])
    with pytest.raises(ValueError, match=r"names the data axis 'data'"):
        make([(r"up", P("data"))])
    with pytest.raises(ValueError, match=r"not a valid regular expression"):
        make([(r"up[", P("model"))])
    with pytest.raises(TypeError, match=r"param_rules"):
        make([(r"up",)])
    with pytest.raises(ValueError, match=r"pattern 'attention' matches no array"):
        make([(r"attention", P("model"))]).state_specs(state)
    with pytest.raises(
        ValueError,
        match=r"dimension 0 of \.head\.weight .*size 3, not divisible by the 4",
    ):
        ed.make_train_step(
            loss_fn,
            OPTIMIZER,
            ed.create_device_mesh({"data": 2, "model": 4}),
            data_axis="data",
            param_rules=[(r"head\.weight", P("model"))],
        ).state_specs(
            ed.TrainState.create(
                eqx.tree_at(
                    lambda n: n.head,
                    Net(jax.random.key(0)),
                    eqx.nn.Linear(16, 3, key=jax.random.key(2)),
                ),
                OPTIMIZER,
                jax.random.key(1),
            )
        )
    with pytest.raises(ValueError, match=r"more entries than the leaf has dim"):
        make([(r"up\.bias", P(None, "model"))]).state_specs(state)
    with pytest.raises(ValueError, match=r"`fsdp_axis`='model' is not one of the data"):
        make((), strategy="fsdp", fsdp_axis="model")
    with pytest.raises(ValueError, match=r"only applies to strategy='fsdp'"):
        make((), fsdp_axis="data")
    with pytest.raises(ValueError, match=r"'batch' is not an axis of the mesh"):
        ed.make_train_step(loss_fn, OPTIMIZER, mesh, data_axis=("data", "batch"))
    # The step itself reports rule mistakes before compiling.
    with pytest.raises(ValueError, match=r"matches no array"):
        make([(r"nothing", P("model"))])(state, batch)


@pytest.mark.slow
def test_hsdp_across_processes(tmp_path):
    """2 processes x 4 devices, the replica axis across processes, each passing
    its own rows: the same parameters as 1 process x 8 devices."""
    scripts = Path(__file__).parents[1] / "mp_scripts"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "eqxdist.launch",
            "-n",
            "2",
            "-d",
            "4",
            str(scripts / "mp_hsdp.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    mesh = ed.create_device_mesh({"replica": 2, "data": 4})
    for strategy in ("dp", "fsdp"):
        step = ed.make_train_step(
            loss_fn,
            OPTIMIZER,
            mesh,
            strategy=strategy,
            data_axis=("replica", "data"),
            min_weight_size=64,
        )
        state = ed.TrainState.create(
            Net(jax.random.key(0)), OPTIMIZER, jax.random.key(1)
        )
        for batch in hsdp_batches():
            state, _ = step(state, batch)
        saved = np.load(tmp_path / f"{strategy}.npz")
        leaves = jax.tree_util.tree_flatten_with_path(
            eqx.filter(state.model, eqx.is_array)
        )[0]
        assert len(saved.files) == len(leaves)
        for path, leaf in leaves:
            np.testing.assert_allclose(
                saved[jax.tree_util.keystr(path)], np.asarray(leaf), atol=1e-6
            )


def test_shard_batch_over_tuple_axes(rng):
    mesh = ed.create_device_mesh({"replica": 2, "data": 4})
    sharding = ed.create_data_parallel_sharding(mesh, ("replica", "data"))
    assert sharding.spec == P(("replica", "data"))
    x = rng.normal(size=(16, 3)).astype(np.float32)
    placed = ed.shard_batch({"x": x}, sharding)["x"]
    # Row block i lives on the i-th device in mesh order (replica-major).
    for i, device in enumerate(mesh.devices.flat):
        (shard,) = [s for s in placed.addressable_shards if s.device == device]
        np.testing.assert_array_equal(shard.data, x[2 * i : 2 * i + 2])
    with pytest.raises(ValueError, match=r"'batch' is not an axis of the mesh"):
        ed.create_data_parallel_sharding(mesh, ("replica", "batch"))


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(16, 64, key=k1)
        self.down = eqx.nn.Linear(64, 16, key=k2)

    def __call__(self, x, *, key=None):
        return x + self.down(jax.nn.gelu(self.up(x)))


class Deep(eqx.Module):
    body: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(self.body(x))


def _deep_loss(model, batch, key):
    del key
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]
    ).mean(), {}


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_stacked_layers_with_megatron_rules(strategy):
    """Scan over layers composes with tensor-parallel rules: the layer axis stays
    whole, the rule takes its dimension, FSDP another."""
    blocks = [Block(k) for k in jax.random.split(jax.random.key(0), 3)]
    head = eqx.nn.Linear(16, 4, key=jax.random.key(9))
    reference = Deep(eqx.nn.Sequential(blocks), head)
    model = Deep(ed.Stacked(blocks), head)
    rules = (
        (r"\.up\.weight$", P(None, "model", None)),
        (r"\.up\.bias$", P(None, "model")),
        (r"\.down\.weight$", P(None, None, "model")),
    )
    mesh = ed.create_device_mesh({"data": 4, "model": 2})
    step = ed.make_train_step(
        _deep_loss,
        OPTIMIZER,
        mesh,
        strategy=strategy,
        param_rules=rules,
        min_weight_size=64,
    )
    state = ed.TrainState.create(model, OPTIMIZER, jax.random.key(1))
    params = eqx.filter(reference, eqx.is_inexact_array)
    opt_state = OPTIMIZER.init(params)
    for batch in _batches():
        state, _ = step(state, batch)
        grads = eqx.filter_grad(lambda m, b=batch: _deep_loss(m, b, None)[0])(reference)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        reference = eqx.apply_updates(reference, updates)
        params = eqx.filter(reference, eqx.is_inexact_array)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *reference.body.layers)
    np.testing.assert_allclose(
        state.model.body.layers.up.weight, stacked.up.weight, atol=1e-5
    )
    np.testing.assert_allclose(
        state.model.head.weight, reference.head.weight, atol=1e-5
    )
    spec = step.state_specs(state).model.body.layers.up.weight
    expected = (
        P(None, "model", "data") if strategy == "fsdp" else P(None, "model", None)
    )
    assert spec == expected


def test_bf16_with_rules_compiles_and_matches_dp():
    """XLA:CPU aborts compiling bf16 collectives of rule axes unless its
    all-reduce promotion pass is skipped (the layout's compiler options)."""
    sgd = optax.sgd(0.1)
    results = []
    for mesh, kw in [
        (
            ed.create_device_mesh({"data": 4, "model": 2}),
            {"strategy": "fsdp", "param_rules": MEGATRON},
        ),
        (ed.create_data_parallel_mesh(), {"strategy": "dp"}),
    ]:
        step = ed.make_train_step(
            loss_fn, sgd, mesh, min_weight_size=64, compute_dtype=jnp.bfloat16, **kw
        )
        state = ed.TrainState.create(Net(jax.random.key(0)), sgd, jax.random.key(1))
        for batch in _batches():
            state, _ = step(state, batch)
        assert state.model.up.weight.dtype == jnp.float32
        results.append(state.model)
    assert max_diff(*results) < 5e-3


def _all_gathers(hlo):
    """Result element counts of the all-gathers in compiled HLO text."""
    counts = []
    for match in re.finditer(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo):
        counts.append(int(np.prod([int(d) for d in match[1].split(",") if d])))
    return counts


def test_fsdp_gather_keeps_tensor_parallel_shards():
    # Under FSDP x TP each device gathers its "model" shard of a ruled weight over
    # "data", never the whole weight: an all-gather over the data axis inside
    # shard_map would be partitioned by XLA with its operand replicated over
    # "model", so every device would hold (and multiply) whole weights.
    mesh = ed.create_device_mesh({"data": 4, "model": 2})
    step = ed.make_train_step(
        loss_fn,
        OPTIMIZER,
        mesh,
        strategy="fsdp",
        param_rules=MEGATRON,
        min_weight_size=64,
    )
    state = ed.TrainState.create(Net(jax.random.key(0)), OPTIMIZER, jax.random.key(1))
    hlo = step.lower(state, _batches(steps=1)[0]).compile().as_text()
    gathered = _all_gathers(hlo)
    assert gathered, "FSDP gathers the sharded weights"
    ruled = state.model.up.weight.size  # 64 x 16, also the size of down.weight
    assert max(gathered) <= ruled // 2, gathered
    # Each ruled weight is gathered once, as its "model" half (the head is too
    # small to be sharded).
    assert gathered == [ruled // 2, ruled // 2]


@pytest.mark.parametrize("fsdp_gather", ["step", "minibatch"])
def test_megatron_rules_with_accumulation(reference, fsdp_gather):
    # Ruled leaves are gathered at the shard_map boundary; accumulation in either
    # gather mode still gives the single-device update.
    mesh = ed.create_device_mesh({"data": 4, "model": 2})
    step = ed.make_train_step(
        loss_fn,
        OPTIMIZER,
        mesh,
        strategy="fsdp",
        param_rules=MEGATRON,
        min_weight_size=64,
        num_minibatches=2,
        fsdp_gather=fsdp_gather,
    )
    state, _ = _train(step)
    assert max_diff(state.model, reference) < 1e-5
