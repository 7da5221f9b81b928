"""Strategies over meshes of more than one axis: tuple data axes (HSDP with
`fsdp_axis`), tensor parallelism from `param_rules` and ZeRO-1 (`strategy="zero1"`,
parameters replicated as under dp, optimizer state sharded by the FSDP rule), each
against single-device training in plain Equinox/Optax (`reference.py`) on the same
global data."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
    ADAMW as OPTIMIZER,
    MP_SCRIPTS,
    ResidualMLP as Net,
    batches,
    hsdp_batches,
    launch,
    loss_fn,
)
from jax.sharding import AxisType, PartitionSpec as P
from reference import max_diff, train_one_device

import eqxdist as ed

MEGATRON = (
    (r"\.up\.weight$", P("model", None)),  # column-parallel: output features
    (r"\.up\.bias$", P("model")),
    (r"\.down\.weight$", P(None, "model")),  # row-parallel: input features
)


def _batches(steps=3, rows=32, seed=0):
    return batches(steps, rows, features=16, seed=seed)


@pytest.fixture(scope="module")
def single_device():
    """Single-device training: 3 steps, and the loss of the last one."""
    return train_one_device(Net(jax.random.key(0)), _batches(), OPTIMIZER, loss_fn)


@pytest.fixture(scope="module")
def reference(single_device):
    return single_device.model


def _train(step):
    state = ed.TrainState.create(Net(jax.random.key(0)), OPTIMIZER, jax.random.key(1))
    for batch in _batches():
        state, metrics = step(state, batch)
    return state, metrics


def _step(mesh, **options):
    """The train step of `loss_fn` over `mesh`, leaves of 64 elements and more
    sharded."""
    return ed.make_train_step(loss_fn, OPTIMIZER, mesh, min_weight_size=64, **options)


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_replica_and_data_axes(single_device, reference, strategy, axis_types):
    mesh = ed.create_device_mesh({"replica": 2, "data": 4}, axis_types=axis_types)
    step = _step(mesh, strategy=strategy, data_axis=("replica", "data"))
    state, metrics = _train(step)
    assert max_diff(state.model, reference) < 1e-5
    if strategy == "fsdp":
        # HSDP: sharded over "data" (4 ways), replicated over "replica".
        spec = step.state_specs(state).model.up.weight
        assert spec == P(None, "data") or spec == P("data", None)
        assert state.model.up.weight.sharding.spec == spec
        shard = state.model.up.weight.addressable_shards[0].data
        assert shard.size == state.model.up.weight.size // 4
    # The last step's loss, on the model before its update.
    expected = single_device.losses[-1]
    assert float(metrics["loss"].compute()) == pytest.approx(expected, rel=1e-5)


# A mixed mesh: the data axis Explicit, the model axis Auto.
MIXED = (AxisType.Explicit, AxisType.Auto)


@pytest.mark.parametrize("axis_types", ["auto", "explicit", MIXED])
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_megatron_rules(reference, strategy, axis_types):
    mesh = ed.create_device_mesh({"data": 4, "model": 2}, axis_types=axis_types)
    step = _step(mesh, strategy=strategy, param_rules=MEGATRON)
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
    its own rows: the same parameters as one device in plain Equinox and Optax
    (`harness.train_hsdp` on every row)."""
    result = launch(MP_SCRIPTS / "mp_hsdp.py", tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    model = Net(jax.random.key(0))
    want = train_one_device(model, hsdp_batches(), OPTIMIZER, loss_fn).model
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(want, eqx.is_array))[0]
    for strategy in ("dp", "fsdp"):
        saved = np.load(tmp_path / f"{strategy}.npz")
        assert len(saved.files) == len(leaves)
        for path, leaf in leaves:
            np.testing.assert_allclose(
                saved[jax.tree_util.keystr(path)],
                np.asarray(leaf),
                atol=1e-5,
                err_msg=f"{strategy}: {jax.tree_util.keystr(path)}",
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


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_stacked_layers_with_megatron_rules(strategy):
    """Scan over layers composes with tensor-parallel rules: the layer axis stays
    whole, the rule takes its dimension, FSDP another."""
    blocks = [Block(k) for k in jax.random.split(jax.random.key(0), 3)]
    head = eqx.nn.Linear(16, 4, key=jax.random.key(9))
    model = Deep(ed.Stacked(blocks), head)
    rules = (
        (r"\.up\.weight$", P(None, "model", None)),
        (r"\.up\.bias$", P(None, "model")),
        (r"\.down\.weight$", P(None, None, "model")),
    )
    mesh = ed.create_device_mesh({"data": 4, "model": 2})
    step = _step(mesh, strategy=strategy, param_rules=rules)
    state = ed.TrainState.create(model, OPTIMIZER, jax.random.key(1))
    for batch in _batches():
        state, _ = step(state, batch)
    reference = train_one_device(
        Deep(eqx.nn.Sequential(blocks), head), _batches(), OPTIMIZER, loss_fn
    ).model
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
    step = _step(mesh, strategy="fsdp", param_rules=MEGATRON)
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
    step = _step(
        mesh,
        strategy="fsdp",
        param_rules=MEGATRON,
        num_minibatches=2,
        fsdp_gather=fsdp_gather,
    )
    state, _ = _train(step)
    assert max_diff(state.model, reference) < 1e-5


# -- ZeRO-1 ----------------------------------------------------------------------

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


def _train_mlp(mesh, strategy, batches, **kw):
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
        "single": train_one_device(
            MLP(jax.random.key(0)), batches, OPTIMIZER, loss_fn
        ).model,
        "dp": _train_mlp(mesh, "dp", batches),
        "zero1": _train_mlp(mesh, "zero1", batches),
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
    single = train_one_device(MLP(jax.random.key(0)), batches, OPTIMIZER, loss_fn).model
    hsdp_mesh = ed.create_device_mesh({"replica": 2, "data": 4})
    step, hsdp = _train_mlp(
        hsdp_mesh, "zero1", batches, data_axis=("replica", "data"), fsdp_axis="data"
    )
    assert max_diff(hsdp.model, single) < 1e-5
    mu = hsdp.opt_state[0].mu.layers[1].weight
    assert step.state_specs(hsdp).opt_state[0].mu.layers[1].weight == P("data", None)
    assert mu.addressable_shards[0].data.shape == (16, 64)
    tp_mesh = ed.create_device_mesh({"data": 4, "model": 2})
    rule = [(r"layers\[1\]\.weight", P(None, "model"))]
    step, tp = _train_mlp(tp_mesh, "zero1", batches, param_rules=rule)
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
    want = train_one_device(model, batches, OPTIMIZER, loss_fn, trainable).model
    assert max_diff(state.model, want) < 1e-5
    assert max_diff(state.model.layers[1], model.layers[1]) == 0.0


def test_an_axis_not_in_the_mesh_suggests_the_close_name():
    """Every "axis not in the mesh" error goes through one helper: the mesh's
    axes, and the axis meant when the name is a typo of one; never advice to
    rename the mesh to the typo."""
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})

    def make(**kw):
        return ed.make_train_step(loss_fn, OPTIMIZER, mesh, **kw)

    with pytest.raises(ValueError) as info:
        make(pipeline=ed.Pipeline("stages", microbatches=2))
    message = str(info.value)
    assert message.startswith("make_train_step: the pipeline's axis 'stages'")
    assert "('stage', 'data')" in message and "did you mean 'stage'?" in message
    assert "{'stages'" not in message  # no mesh built around the typo
    # No close name: the mesh's axes, and both ways out.
    with pytest.raises(ValueError, match=r"'pipe' is not an axis.*Pipeline\(axis"):
        make(pipeline=ed.Pipeline("pipe", microbatches=2))
    for kw, name in [
        ({"data_axis": "dat"}, "`data_axis`='dat'"),
        ({"context_axis": "stag"}, "`context_axis`='stag'"),
        ({"param_rules": [("up", P("stge"))]}, "'stge'"),
    ]:
        with pytest.raises(ValueError) as info:
            make(**kw)
        assert name in str(info.value), str(info.value)
        assert re.search(r"did you mean '(data|stage)'\?", str(info.value))
    with pytest.raises(ValueError, match=r"`data_axis`='rows'.*\('stage', 'data'\)\."):
        ed.BatchLoader({"x": np.zeros((8, 2))}, 8, mesh, data_axis="rows")
