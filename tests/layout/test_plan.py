"""The model plan and the layout's state specs, checked on specs alone (nothing is
compiled): exact `PartitionSpec`s for dp, fsdp, HSDP, rules, `Stacked` and `FSDP`
modules and ZeRO-1, the shard_map boundary and gather specs, the cache, and the
optimizer states that cannot be laid out."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxdist as ed
from eqxdist._layout.layout import Layout


class MLP(eqx.Module):
    layers: list

    def __init__(self, key, width=64):
        k = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.Linear(32, width, key=k[0]),
            eqx.nn.Linear(width, width, key=k[1]),
            eqx.nn.Linear(width, 8, key=k[2]),
        ]


class StackNet(eqx.Module):
    body: ed.Stacked
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 5)
        self.body = ed.Stacked([eqx.nn.Linear(32, 32, key=k) for k in keys[:4]])
        self.head = eqx.nn.Linear(32, 8, key=keys[4])


def _layout(mesh, strategy="dp", **kw):
    options = dict(data_axis="data", min_weight_size=16)
    options.update(kw)
    caller = "make_train_step"
    return Layout.of(caller, mesh, {"strategy": strategy, **options})


def _weights(tree):
    return [layer.weight for layer in tree.layers]


@pytest.fixture(scope="module")
def tp_mesh():
    return ed.create_device_mesh({"data": 4, "model": 2})


def test_dp_plan(mesh8):
    model = MLP(jax.random.key(0))
    plan = _layout(mesh8).plan(model)
    assert jax.tree.leaves(plan.specs) == [P()] * 6
    assert jax.tree.leaves(plan.manual) == [P()] * 6
    assert plan.gather is None
    assert plan.gathered(model) is model


def test_fsdp_plan(mesh8):
    model = MLP(jax.random.key(0))
    plan = _layout(mesh8, "fsdp").plan(model)
    assert _weights(plan.specs) == [P("data", None)] * 3
    assert [layer.bias for layer in plan.specs.layers] == [P("data"), P("data"), P()]
    # Restricted to the data axes (trailing unsharded dimensions dropped).
    assert _weights(plan.manual) == [P("data")] * 3
    assert plan.gather == plan.manual
    largest = _layout(mesh8, "fsdp", fsdp_layout="largest").plan(model)
    assert _weights(largest.specs) == [
        P("data", None),
        P(None, "data"),
        P(None, "data"),
    ]


def test_hsdp_plan():
    mesh = ed.create_device_mesh({"replica": 2, "data": 4})
    model = MLP(jax.random.key(0))
    for fsdp_axis, other in (("data", "replica"), ("replica", "data")):
        layout = _layout(
            mesh, "fsdp", data_axis=("replica", "data"), fsdp_axis=fsdp_axis
        )
        plan = layout.plan(model)
        assert _weights(plan.specs)[0] == P(fsdp_axis, None)
        assert other not in str(jax.tree.leaves(plan.specs))
        assert _weights(plan.gather) == [P(fsdp_axis)] * 3
        assert layout.batch_spec == P(("replica", "data"))


def test_rules_plan(tp_mesh):
    rules = [(r"layers\[1\]\.weight", P("model", None)), (r"layers\[0\]", P("model"))]
    model = MLP(jax.random.key(0))
    dp = _layout(tp_mesh, param_rules=rules).plan(model)
    assert _weights(dp.specs) == [P("model"), P("model", None), P()]
    assert jax.tree.leaves(dp.manual) == [P()] * 6
    fsdp = _layout(tp_mesh, "fsdp", param_rules=rules).plan(model)
    assert _weights(fsdp.specs) == [
        P("model", "data"),
        P("model", "data"),
        P("data", None),
    ]
    # Leaves sharded over both a rule axis and fsdp_axis are gathered at the
    # shard_map boundary: unsharded inside, not gathered by the step.
    assert _weights(fsdp.manual) == [P(), P(), P("data")]
    assert _weights(fsdp.gather) == [P(), P(), P("data")]
    assert fsdp.specs.layers[0].bias == P("model")
    assert fsdp.manual.layers[2].bias == P()


def test_stacked_plan(tp_mesh):
    model = StackNet(jax.random.key(0))
    plan = _layout(tp_mesh, "fsdp").plan(model)
    assert plan.specs.body.layers.weight == P(None, "data", None)
    assert plan.specs.body.layers.bias == P(None, "data")
    # Stacked gathers its own leaves: the step leaves them to it.
    assert plan.gather.body.layers.weight == P()
    assert plan.manual.body.layers.weight == P(None, "data")
    ruled = _layout(
        tp_mesh, "fsdp", param_rules=[(r"body.*weight", P(None, "model"))]
    ).plan(model)
    assert ruled.specs.body.layers.weight == P(None, "model", "data")
    assert ruled.manual.body.layers.weight == P(None, None, "data")
    with pytest.raises(ValueError, match=r"make_train_step: .*the layer axis"):
        _layout(tp_mesh, "fsdp", param_rules=[(r"body", P("model"))]).plan(model)


def test_fsdp_module_plan(tp_mesh):
    inner = eqx.nn.Linear(32, 64, key=jax.random.key(1))
    model = {"block": ed.FSDP(inner, tp_mesh, min_weight_size=16, layout="leading")}
    plan = _layout(tp_mesh, "fsdp").plan(model)
    assert plan.specs["block"].module.weight == P("data", None)
    assert plan.gather["block"].module.weight == P()
    ruled = _layout(tp_mesh, "fsdp", param_rules=[(r"weight", P(None, "model"))]).plan(
        model
    )
    assert ruled.specs["block"].module.weight == P("data", "model")
    with pytest.raises(ValueError, match=r"already shards over 'data'"):
        _layout(tp_mesh, "fsdp", param_rules=[(r"weight", P("model"))]).plan(model)


def test_plan_is_computed_once_per_structure(mesh8):
    layout = _layout(mesh8, "fsdp")
    plan = layout.plan(MLP(jax.random.key(0)))
    assert layout.plan(MLP(jax.random.key(1))) is plan
    abstract = eqx.filter_eval_shape(MLP, jax.random.key(0))
    assert layout.plan(abstract) is plan
    wider = layout.plan(MLP(jax.random.key(0), width=128))
    assert wider is not plan
    assert wider.specs.layers[1].weight == P("data", None)


def test_zero1_state_specs(mesh8):
    state = ed.TrainState.create(
        MLP(jax.random.key(0)), optax.adamw(1e-3), jax.random.key(0)
    )
    layout = _layout(mesh8, "zero1")
    specs = layout.state_specs(state, optax.adamw(1e-3))
    fsdp = _layout(mesh8, "fsdp").state_specs(state, optax.adamw(1e-3))
    assert jax.tree.leaves(specs.model) == [P()] * 6
    assert specs.opt_state[0].mu == fsdp.opt_state[0].mu
    assert _weights(specs.opt_state[0].nu) == [P("data", None)] * 3
    assert specs.opt_state[0].count == P()
    plan = layout.plan(state.model)
    assert plan.gather is None
    # Gradients leave shard_map reduce-scattered as the optimizer state is sharded.
    assert _weights(plan.scatter) == [P("data")] * 3
    assert plan.grad_specs is plan.scatter
    assert _layout(mesh8).plan(state.model).grad_specs is not None


def test_zero1_with_rules(tp_mesh):
    state = ed.TrainState.create(
        MLP(jax.random.key(0)), optax.adam(1e-3), jax.random.key(0)
    )
    layout = _layout(
        tp_mesh, "zero1", param_rules=[(r"layers\[1\]\.weight", P("model", None))]
    )
    specs = layout.state_specs(state, optax.adam(1e-3))
    assert _weights(specs.model) == [P(), P("model", None), P()]
    assert _weights(specs.opt_state[0].mu) == [
        P("data", None),
        P("model", "data"),
        P("data", None),
    ]


def test_strategy_errors(mesh8):
    with pytest.raises(ValueError, match=r"unknown strategy 'zero3'.*'zero1'"):
        _layout(mesh8, "zero3")
    with pytest.raises(ValueError, match=r"it only applies to strategy='fsdp' or"):
        _layout(mesh8, "dp", fsdp_axis="data")


class Pair(eqx.Module):
    a: jax.Array
    b: jax.Array


def _pair():
    return Pair(jnp.ones((8, 8)), jnp.ones((8, 8)))


def test_unmappable_optimizer_state_is_a_clear_error(tp_mesh, mesh8):
    """An optimizer state Optax cannot map to the parameters is an error naming
    make_train_step and what to do, never a guess by shape (which gave the
    moments of `a` and `b`, same shape, different rules, one spec)."""

    def init(params):
        # One moment per parameter, but not in the parameters' tree structure.
        return (jnp.zeros_like(params.a), jnp.zeros_like(params.b))

    def update(updates, state, params=None):
        return updates, state

    optimizer = optax.GradientTransformation(init, update)
    state = ed.TrainState.create(_pair(), optimizer, jax.random.key(0))
    rules = [("a", P("model", None)), ("b", P(None, "model"))]
    step = ed.make_train_step(
        lambda m, b, k: (jnp.sum(m.a), {}), optimizer, tp_mesh, param_rules=rules
    )
    with pytest.raises(
        ValueError,
        match=r"make_train_step: cannot lay out the optimizer state .* with "
        r"param_rules: optax.tree_map_params.*strategy='dp' without param_rules",
    ):
        step.state_specs(state)
    # Adam's state is mapped leaf by leaf: each moment follows its own parameter.
    adam = ed.TrainState.create(_pair(), optax.adam(1e-3), jax.random.key(0))
    specs = ed.make_train_step(
        lambda m, b, k: (jnp.sum(m.a), {}), optax.adam(1e-3), tp_mesh, param_rules=rules
    ).state_specs(adam)
    assert specs.opt_state[0].mu.a == P("model", None)
    assert specs.opt_state[0].mu.b == P(None, "model")


def test_lbfgs_under_fsdp_is_a_clear_error(mesh8):
    lbfgs = optax.lbfgs()
    state = ed.TrainState.create(_pair(), lbfgs, jax.random.key(0))

    def loss_fn(model, batch, key):
        return jnp.sum(model.a * batch), {}

    fsdp = ed.make_train_step(loss_fn, lbfgs, mesh8, strategy="fsdp", min_weight_size=8)
    with pytest.raises(
        ValueError,
        match=r"make_train_step: .*ScaleByLBFGSState.*"
        r"strategy='fsdp'.*IndexError",
    ):
        fsdp.state_specs(state)
    with pytest.raises(ValueError, match="cannot lay out the optimizer state"):
        fsdp(state, jnp.ones((8, 8)))
    # Under dp without rules the state is replicated: no mapping needed.
    specs = ed.make_train_step(loss_fn, lbfgs, mesh8).state_specs(state)
    assert set(jax.tree.leaves(specs.opt_state)) == {P()}


def test_a_strategy_that_shards_nothing_says_so(mesh8):
    """FSDP (ZeRO-1) with every leaf at or under `min_weight_size` is data
    parallelism's layout; the user asked for sharding, so they are told."""
    model = MLP(jax.random.key(0))  # largest leaf: 64 x 64 = 4,096 elements
    state = ed.TrainState.create(model, optax.adam(1e-3), jax.random.key(0))
    for strategy, what in [("fsdp", "parameter"), ("zero1", "optimizer state")]:
        layout = _layout(mesh8, strategy, min_weight_size=2**18)
        with pytest.warns(UserWarning) as caught:
            specs = layout.state_specs(state, optax.adam(1e-3))
        message = str(caught[0].message)
        assert f"strategy='{strategy}' shards no {what} of this model" in message
        assert "largest array has 4,096 elements" in message
        assert "min_weight_size=262,144" in message and "2**11" in message
        assert all(s == P() for s in jax.tree.leaves(specs.model))
    # Sharded over a dimension that divides: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _layout(mesh8, "fsdp", min_weight_size=2**11).state_specs(
            state, optax.adam(1e-3)
        )
    # Large enough, but no dimension divisible by the devices: the reason named.
    odd = {"w": jnp.ones((33, 33))}
    with pytest.warns(UserWarning, match=r"no dimension of its arrays of more than"):
        _layout(mesh8, "fsdp", min_weight_size=16).plan(odd)
