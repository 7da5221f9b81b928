import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed


def test_create_data_parallel_sharding(mesh8):
    sharding = ed.create_data_parallel_sharding(mesh8)
    assert isinstance(sharding, NamedSharding)
    assert sharding.spec == P("data") and sharding.mesh == mesh8
    hybrid = ed.create_hybrid_mesh(4, 2)
    assert ed.create_data_parallel_sharding(hybrid, "model").spec == P("model")
    with pytest.raises(ValueError, match=r"'batch' is not an axis.*\('data',\)"):
        ed.create_data_parallel_sharding(mesh8, "batch")


def test_shard_batch_values_and_shardings(axis_types, rng):
    mesh8 = ed.create_data_parallel_mesh(axis_types=axis_types)
    sharding = ed.create_data_parallel_sharding(mesh8)
    batch = {
        "inputs": rng.normal(size=(16, 5)).astype(np.float32),  # NumPy leaf
        "labels": jnp.arange(16),  # JAX leaf
        "nested": [np.ones((8, 2, 2), np.int32), {"w": jnp.zeros(24)}],
        "scale": np.float32(0.5),  # 0-d
        "name": "train",
        "count": 16,
        "nothing": None,
    }
    out = ed.shard_batch(batch, sharding)
    for key in ("inputs", "labels"):
        assert isinstance(out[key], jax.Array)
        assert out[key].sharding.is_equivalent_to(sharding, out[key].ndim)
        np.testing.assert_array_equal(out[key], batch[key])
        # Each device holds its own contiguous block of rows.
        shard_rows = {
            s.device.id: np.asarray(s.data) for s in out[key].addressable_shards
        }
        np.testing.assert_array_equal(shard_rows[3], np.asarray(batch[key])[6:8])
    np.testing.assert_array_equal(out["nested"][0], batch["nested"][0])
    assert out["nested"][0].sharding.spec == P("data")
    assert out["nested"][1]["w"].sharding.spec == P("data")
    assert out["scale"].sharding.spec == P() and float(out["scale"]) == 0.5
    assert out["scale"].sharding.is_fully_replicated
    assert out["name"] == "train" and out["count"] == 16 and out["nothing"] is None


def test_shard_batch_feeds_shard_map(mesh8, rng):
    x = rng.normal(size=(16, 4)).astype(np.float32)
    batch = ed.shard_batch({"x": x}, ed.create_data_parallel_sharding(mesh8))
    total = jax.jit(
        jax.shard_map(
            lambda b: ed.reduce_sum(b["x"].sum()),
            mesh=mesh8,
            in_specs=(P("data"),),
            out_specs=P(),
        )
    )(batch)
    np.testing.assert_allclose(total, x.sum(), rtol=1e-5)


def test_shard_batch_indivisible_names_leaf_and_sizes(mesh8):
    sharding = ed.create_data_parallel_sharding(mesh8)
    with pytest.raises(
        ValueError, match=r"\['batch'\]\['labels'\].*leading dimension 12.*8 shards"
    ):
        ed.shard_batch(
            {"batch": {"inputs": np.ones((16, 2)), "labels": np.ones(12)}}, sharding
        )


def test_shard_batch_on_hybrid_mesh_and_one_device(rng):
    hybrid = ed.create_hybrid_mesh(4, 2)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    out = ed.shard_batch(x, ed.create_data_parallel_sharding(hybrid))
    assert out.sharding.spec == P("data")
    np.testing.assert_array_equal(out, x)
    # 6 rows are fine for the 2 devices of the "model" axis, not the 4 of "data".
    ed.shard_batch(np.ones(6), ed.create_data_parallel_sharding(hybrid, "model"))
    with pytest.raises(ValueError, match="4 shards"):
        ed.shard_batch(np.ones(6), ed.create_data_parallel_sharding(hybrid))

    one = ed.create_data_parallel_mesh(1)
    out = ed.shard_batch({"x": x[:3]}, ed.create_data_parallel_sharding(one))
    np.testing.assert_array_equal(out["x"], x[:3])  # any size divides by 1


class MLP(eqx.Module):
    layers: list[eqx.nn.Linear]
    activation: object = eqx.field(static=True)
    tag: str = "mlp"

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Linear(64, 128, key=k1), eqx.nn.Linear(128, 10, key=k2)]
        self.activation = jax.nn.relu


def test_shard_model_state_replicate_keeps_module_type(axis_types):
    mesh8 = ed.create_data_parallel_mesh(axis_types=axis_types)
    model = MLP(jax.random.key(0))
    placed = ed.shard_model_state(model, mesh8)
    assert type(placed) is MLP
    assert placed.activation is jax.nn.relu and placed.tag == "mlp"
    for before, after in zip(
        jax.tree.leaves(model), jax.tree.leaves(placed), strict=True
    ):
        if eqx.is_array(before):
            assert after.sharding.spec == P() and after.sharding.is_fully_replicated
            np.testing.assert_array_equal(after, before)
        else:
            assert after is before
    replicated = ed.replicate_params({"w": np.ones((3, 3)), "lr": 0.1}, mesh8)
    assert replicated["w"].sharding.spec == P() and replicated["lr"] == 0.1


def test_placement_keeps_none_nodes_and_non_arrays_aligned(mesh8):
    # `None` nodes (a Linear without bias, an optax EmptyState) come before arrays.
    key = jax.random.key(0)
    tree = {
        "a": None,
        "lin": eqx.nn.Linear(16, 8, use_bias=False, key=key),
        "name": "x",
        "w": jnp.arange(16.0),
    }
    for placed in (
        ed.replicate_params(tree, mesh8),
        ed.shard_model_state(tree, mesh8),
        ed.shard_model_state(tree, mesh8, "shard", min_weight_size=8),
    ):
        assert placed["a"] is None and placed["lin"].bias is None
        assert placed["name"] == "x"
        np.testing.assert_array_equal(placed["w"], tree["w"])
        np.testing.assert_array_equal(placed["lin"].weight, tree["lin"].weight)
    sharded = ed.shard_model_state(tree, mesh8, "shard", min_weight_size=8)
    assert sharded["w"].sharding.spec == P("data")
    assert sharded["lin"].weight.sharding.spec == P(None, "data")  # (8, 16)


def test_shard_model_state_shard_uses_the_fsdp_rule(axis_types):
    mesh8 = ed.create_data_parallel_mesh(axis_types=axis_types)
    model = MLP(jax.random.key(0))
    placed = ed.shard_model_state(model, mesh8, "shard", min_weight_size=100)
    assert type(placed) is MLP and placed.activation is jax.nn.relu
    w0, b0 = placed.layers[0].weight, placed.layers[0].bias
    w1, b1 = placed.layers[1].weight, placed.layers[1].bias
    assert w0.sharding.spec == P("data", None)  # (128, 64): 128 is the largest
    assert b0.sharding.spec == P("data")  # (128,) > 100 elements
    assert w1.sharding.spec == P(None, "data")  # (10, 128): 10 does not divide by 8
    assert b1.sharding.spec == P()  # 10 elements: too small
    assert w0.addressable_shards[0].data.shape == (16, 64)
    for before, after in zip(
        jax.tree.leaves(model), jax.tree.leaves(placed), strict=True
    ):
        if eqx.is_array(before):
            np.testing.assert_array_equal(after, before)
    # Default min_weight_size (2**18) replicates everything this small.
    default = ed.shard_model_state(model, mesh8, "shard")
    assert all(
        x.sharding.spec == P() for x in jax.tree.leaves(default) if eqx.is_array(x)
    )


def test_shard_model_state_axis_choice_and_errors():
    hybrid = ed.create_hybrid_mesh(4, 2)
    state = {"w": np.ones((8, 6), np.float32)}
    first = ed.shard_model_state(state, hybrid, "shard", min_weight_size=0)
    assert first["w"].sharding.spec == P("data", None)  # the mesh's first axis
    model_axis = ed.shard_model_state(
        state, hybrid, "shard", axis_name="model", min_weight_size=0
    )
    assert model_axis["w"].sharding.spec == P("model", None)
    with pytest.raises(ValueError, match="unknown param_sharding 'fsdp'"):
        ed.shard_model_state(state, hybrid, "fsdp")
    with pytest.raises(ValueError, match=r"'pipe' is not an axis.*\('data', 'model'\)"):
        ed.shard_model_state(state, hybrid, "shard", axis_name="pipe")


def test_fsdp_specs_rule():
    tree = {
        "small": jnp.zeros((4, 4)),
        "tie": jnp.zeros((16, 16)),  # equal dims: the later one
        "largest": jnp.zeros((8, 24, 16)),
        "odd": jnp.zeros((7, 9)),  # nothing divisible by 8
        "skip_largest": jnp.zeros((12, 32, 9)),  # 12 % 8 != 0, take 32
        "abstract": jax.ShapeDtypeStruct((64, 3), jnp.float32),
        "meta": "x",
        "scalar": jnp.zeros(()),
    }
    specs = ed.fsdp_specs(tree, 8, min_weight_size=16)
    assert specs["small"] == P()
    assert specs["tie"] == P(None, "data")
    assert specs["largest"] == P(None, "data", None)
    assert specs["odd"] == P()
    assert specs["skip_largest"] == P(None, "data", None)
    assert specs["abstract"] == P("data", None)
    assert specs["meta"] is None
    assert specs["scalar"] == P()
    # size <= min_weight_size is replicated (the boundary is inclusive).
    assert ed.fsdp_specs(jnp.zeros((4, 4)), 2, min_weight_size=16) == P()
    just_over = ed.fsdp_specs(jnp.zeros((4, 4)), 2, axis_name="x", min_weight_size=15)
    assert just_over == P(None, "x")
    with pytest.raises(ValueError, match="axis_size"):
        ed.fsdp_specs(tree, 0)


def test_all_reduce_gradients_matches_numpy(mesh8, rng):
    g = rng.normal(size=(8, 3)).astype(np.float32)

    def step(x):
        grads = {"w": x[0], "b": x[0, 0], "name": "g"}
        return (
            ed.all_reduce_gradients(grads)["w"],
            ed.all_reduce_gradients(grads, "sum")["b"],
        )

    mean, total = jax.shard_map(step, mesh=mesh8, in_specs=P("data"), out_specs=P())(g)
    np.testing.assert_allclose(mean, g.mean(0), rtol=1e-5)
    np.testing.assert_allclose(total, g[:, 0].sum(), rtol=1e-5)


def test_all_reduce_gradients_errors(mesh8):
    with pytest.raises(ValueError, match="Unsupported reduce_type 'max'"):
        ed.all_reduce_gradients({"w": jnp.ones(2)}, reduce_type="max")
    with pytest.raises(ValueError, match="not bound"):
        ed.all_reduce_gradients({"w": jnp.ones(2)})


def test_data_parallel_module(mesh8, rng):
    dp = ed.compat.DataParallel()
    sharding = dp.create_data_parallel_sharding(mesh8)
    assert sharding.spec == P("data")
    x = rng.normal(size=(16, 2)).astype(np.float32)
    batch = dp.shard_batch({"x": x}, sharding)
    np.testing.assert_array_equal(batch["x"], x)
    state = dp.shard_model_state(
        {"w": np.ones((16, 2))}, mesh8, "shard", min_weight_size=0
    )
    assert state["w"].sharding.spec == P("data", None)
    assert dp.replicate_params({"w": np.ones(2)}, mesh8)["w"].sharding.spec == P()
    out = jax.shard_map(
        lambda v: dp.all_reduce_gradients({"g": v.sum(0)}, reduce_type="sum"),
        mesh=mesh8,
        in_specs=P("data"),
        out_specs=P(),
    )(x)
    np.testing.assert_allclose(out["g"], x.sum(0), rtol=1e-5)
    with pytest.raises(ValueError, match="Unsupported reduce_type"):
        dp.all_reduce_gradients({"g": jnp.ones(1)}, reduce_type="prod")

    other = ed.compat.DataParallel(data_axis="batch")
    batch_mesh = ed.create_data_parallel_mesh(axis_name="batch")
    assert other.create_data_parallel_sharding(batch_mesh).spec == P("batch")
    with pytest.raises(ValueError, match="'batch' is not an axis"):
        other.create_data_parallel_sharding(mesh8)


def test_fold_rng_over_axis_per_device_keys():
    mesh = ed.create_hybrid_mesh(4, 2)
    key = jax.random.key(0)
    fold = jax.jit(
        jax.shard_map(
            lambda k: jax.random.key_data(ed.fold_rng_over_axis(k, "data"))[None],
            mesh=mesh,
            in_specs=P(),
            out_specs=P(("data", "model")),
        )
    )
    out = np.asarray(fold(key)).reshape(4, 2, -1)
    for i in range(4):
        expected = jax.random.key_data(jax.random.fold_in(key, i))
        np.testing.assert_array_equal(out[i, 0], expected)
        np.testing.assert_array_equal(out[i, 1], expected)  # same along "model"
    assert len({tuple(out[i, 0]) for i in range(4)}) == 4  # different along "data"
    with pytest.raises(ValueError, match="not bound"):
        ed.fold_rng_over_axis(key, "data")
    with pytest.raises(TypeError):
        ed.fold_rng_over_axis("not a key", "data")  # type: ignore[arg-type]
