import warnings
from contextlib import nullcontext

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed

OPS = {
    "mean": (ed.reduce_mean, np.mean),
    "sum": (ed.reduce_sum, np.sum),
    "max": (ed.reduce_max, np.max),
    "min": (ed.reduce_min, np.min),
}


def per_device(fn, mesh, *args, out_specs=P()):
    """Run `fn` on each device's rows of the global `args` (split along axis 0),
    placed first (on a mesh with Explicit axes `shard_map` checks, not moves)."""
    placed = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in args]
    return jax.jit(
        jax.shard_map(
            fn, mesh=mesh, in_specs=(P("data"),) * len(args), out_specs=out_specs
        )
    )(*placed)


@pytest.fixture
def data(rng):
    # 8 devices x (2 rows of 3): each device's metric is computed from its rows.
    return rng.normal(size=(16, 3)).astype(np.float32)


@pytest.mark.parametrize("op", list(OPS))
def test_collective_matches_numpy_on_global_data(op, data, axis_types):
    mesh8 = ed.create_data_parallel_mesh(axis_types=axis_types)
    reduce, np_reduce = OPS[op]

    def step(x):
        return reduce(
            {"loss": jnp.mean(x), "nested": {"vec": x.sum(0), "pair": (x[0, 0], 7)}},
            "data",
        )

    # A Python number in a sum warns (see the tests of the warning below).
    with (
        pytest.warns(UserWarning, match="NOT summed") if op == "sum" else nullcontext()
    ):
        out = per_device(step, mesh8, data)
    per_dev = data.reshape(8, 2, 3)
    np.testing.assert_allclose(out["loss"], np_reduce(per_dev.mean((1, 2))), rtol=1e-6)
    np.testing.assert_allclose(
        out["nested"]["vec"], np_reduce(per_dev.sum(1), axis=0), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        out["nested"]["pair"][0], np_reduce(per_dev[:, 0, 0]), rtol=1e-6
    )
    assert out["nested"]["pair"][1] == 7  # non-array leaf passes through


def test_non_array_leaves_pass_through_collective_mode(mesh8):
    class Holder(eqx.Module):
        value: jax.Array
        name: str = eqx.field(static=True)

    def step(x):
        tree = {
            "m": Holder(x.sum(), "h"),
            "s": "text",
            "n": None,
            "f": 3.5,
            "fn": jnp.tanh,
        }
        out = ed.reduce_sum(tree)
        assert out["s"] == "text" and out["n"] is None and out["f"] == 3.5
        assert out["fn"] is jnp.tanh
        assert isinstance(out["m"], Holder) and out["m"].name == "h"
        return out["m"].value

    x = np.arange(8.0)
    with pytest.warns(UserWarning, match=r"\['f'\] is the Python float 3.5"):
        assert float(per_device(step, mesh8, x)) == x.sum()


@pytest.mark.parametrize("op", list(OPS))
def test_global_mode_reduces_all_elements(op, data, axis_types):
    mesh8 = ed.create_data_parallel_mesh(axis_types=axis_types)
    reduce, np_reduce = OPS[op]
    sharded = jax.device_put(data, NamedSharding(mesh8, P("data")))
    tree = {"x": sharded, "scalar": jnp.float32(2.5), "name": "acc", "count": 3}
    eager = reduce(tree, axis_name=None)
    jitted = jax.jit(lambda t: reduce(t, axis_name=None))(
        {"x": sharded, "scalar": jnp.float32(2.5)}
    )
    for out in (eager, jitted):
        np.testing.assert_allclose(out["x"], np_reduce(data), rtol=1e-5)
        assert out["scalar"] == 2.5  # 0-d arrays pass through
    assert eager["name"] == "acc" and eager["count"] == 3


def test_multiple_axes(mesh8):
    mesh = ed.create_hybrid_mesh(4, 2)
    x = np.arange(8.0).reshape(4, 2)
    out = jax.shard_map(
        lambda v: (
            ed.reduce_sum(v.sum(), ("data", "model")),
            ed.reduce_sum(v, "model"),
        ),
        mesh=mesh,
        in_specs=P("data", "model"),
        out_specs=(P(), P("data")),
    )(x)
    assert float(out[0]) == x.sum()
    np.testing.assert_array_equal(out[1], x.sum(1, keepdims=True))


def test_reduce_custom_per_key_ops(data, mesh8):
    def step(x):
        return ed.reduce_custom(
            {
                "loss": jnp.mean(x),
                "samples": jnp.int32(x.shape[0]),
                "grad_norm": jnp.max(jnp.abs(x)),
                "low": jnp.min(x),
                "raw": {"a": x.sum(), "b": x.max()},
                "untouched": jnp.float32(1.0),
            },
            {"samples": "sum", "grad_norm": "max", "low": "min", "raw": "sum"},
        )

    out = per_device(step, mesh8, data)
    per_dev = data.reshape(8, 2, 3)
    np.testing.assert_allclose(out["loss"], data.mean(), rtol=1e-5)
    assert int(out["samples"]) == 16
    np.testing.assert_allclose(out["grad_norm"], np.abs(data).max())
    np.testing.assert_allclose(out["low"], data.min())
    # The op applies to the whole subtree under a key.
    np.testing.assert_allclose(out["raw"]["a"], data.sum(), rtol=1e-5)
    np.testing.assert_allclose(out["raw"]["b"], per_dev.max((1, 2)).sum(), rtol=1e-5)
    assert float(out["untouched"]) == 1.0  # default op is mean


def test_reduce_custom_none_leaves_value_and_default_is_mean(data, mesh8):
    out = per_device(
        lambda x: ed.reduce_custom({"a": x.sum(), "b": x.sum(0)}, {"b": None}),
        mesh8,
        data,
        out_specs={"a": P(), "b": P("data")},
    )
    np.testing.assert_allclose(out["a"], data.reshape(8, -1).sum(1).mean(), rtol=1e-5)
    # "b" stayed per-device: gathering the untouched values gives each device's sum.
    np.testing.assert_allclose(
        out["b"], data.reshape(8, 2, 3).sum(1).ravel(), rtol=1e-5
    )
    out = per_device(lambda x: ed.reduce_custom({"a": x.sum()}), mesh8, data)
    np.testing.assert_allclose(out["a"], data.reshape(8, -1).sum(1).mean(), rtol=1e-5)


def test_reduce_custom_global_mode(data, mesh8):
    sharded = jax.device_put(data, NamedSharding(mesh8, P("data")))
    with pytest.raises(ValueError, match="not bound"):
        ed.reduce_custom({"x": sharded})
    out = ed.reduce_custom(
        {"x": sharded, "y": sharded, "z": sharded},
        {"x": "sum", "y": "max", "z": None},
        axis_name=None,
    )
    np.testing.assert_allclose(out["x"], data.sum(), rtol=1e-5)
    np.testing.assert_allclose(out["y"], data.max())
    assert out["z"] is sharded


def test_reduce_custom_errors():
    with pytest.raises(ValueError, match=r"unknown reduction 'avg' for 'loss'.*'mean'"):
        ed.reduce_custom({"loss": jnp.ones(2)}, {"loss": "avg"}, axis_name=None)
    with pytest.raises(ValueError, match=r"\['lsos'\].*not keys of `metrics`.*'loss'"):
        ed.reduce_custom({"loss": jnp.ones(2)}, {"lsos": "sum"}, axis_name=None)
    with pytest.raises(TypeError):
        ed.reduce_custom([jnp.ones(2)], axis_name=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fn",
    [
        ed.reduce_mean,
        ed.reduce_sum,
        ed.reduce_max,
        ed.reduce_min,
        ed.all_gather,
        ed.reduce_custom,
    ],
)
def test_unbound_axis_is_a_clear_value_error(fn):
    with pytest.raises(ValueError, match=r"axis 'data' is not bound.*shard_map"):
        fn({"loss": jnp.ones(())})


def test_unbound_axis_inside_shard_map_over_other_axis(mesh8):
    with pytest.raises(ValueError, match="axis 'batch' is not bound"):
        per_device(lambda x: ed.reduce_mean(x.sum(), "batch"), mesh8, np.ones(8))


@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather_is_returnable_with_replicated_out_specs(tiled, data, mesh8):
    def step(x):
        return ed.all_gather({"loss": jnp.mean(x), "rows": x}, tiled=tiled)

    out = per_device(step, mesh8, data)  # out_specs=P(), check_vma=True (default)
    per_dev = data.reshape(8, 2, 3)
    np.testing.assert_allclose(out["loss"], per_dev.mean((1, 2)), rtol=1e-6)
    expected_rows = data if tiled else per_dev
    np.testing.assert_array_equal(out["rows"], expected_rows)


def test_all_gather_keeps_non_arrays_and_works_without_vma(mesh8):
    def step(x):
        out = ed.all_gather({"v": x.sum(), "tag": "t"})
        assert out["tag"] == "t"
        return out["v"]

    x = np.arange(8.0)
    out = jax.shard_map(
        step, mesh=mesh8, in_specs=P("data"), out_specs=P(), check_vma=False
    )(x)
    np.testing.assert_array_equal(out, x)


def test_collect_from_devices(data, mesh8):
    gathered = per_device(
        lambda x: ed.all_gather({"loss": jnp.mean(x), "n": {"rows": x.sum(1)}}),
        mesh8,
        data,
    )
    gathered = {**gathered, "step": jnp.int32(3), "name": "run", "nested": {"z": 1}}
    collected = ed.collect_from_devices(gathered)
    per_dev = data.reshape(8, 2, 3)
    assert isinstance(collected["loss"], list) and len(collected["loss"]) == 8
    np.testing.assert_allclose(
        np.array(collected["loss"]), per_dev.mean((1, 2)), rtol=1e-6
    )
    assert isinstance(collected["n"]["rows"], list)
    np.testing.assert_allclose(collected["n"]["rows"][3], per_dev[3].sum(1), rtol=1e-6)
    assert int(collected["step"]) == 3  # 0-d unchanged
    assert collected["name"] == "run" and collected["nested"] == {"z": 1}


def test_distributed_metrics_module(data, mesh8):
    dm = ed.compat.DistributedMetrics()
    assert dm.axis_name == "data"

    def step(x):
        m = {"v": jnp.mean(x)}
        return (
            dm.reduce_mean(m),
            dm.reduce_sum(m),
            dm.reduce_max(m),
            dm.reduce_min(m),
            dm.reduce_custom(m, {"v": "sum"}),
            dm.all_gather(m),
        )

    mean, total, hi, lo, custom, gathered = per_device(step, mesh8, data)
    per_dev = data.reshape(8, -1).mean(1)
    np.testing.assert_allclose(mean["v"], per_dev.mean(), rtol=1e-5)
    np.testing.assert_allclose(total["v"], per_dev.sum(), rtol=1e-5)
    np.testing.assert_allclose(hi["v"], per_dev.max())
    np.testing.assert_allclose(lo["v"], per_dev.min())
    np.testing.assert_allclose(custom["v"], per_dev.sum(), rtol=1e-5)
    np.testing.assert_allclose(gathered["v"], per_dev, rtol=1e-6)
    assert len(dm.collect_from_devices(gathered)["v"]) == 8

    global_dm = ed.compat.DistributedMetrics(axis_name=None)
    sharded = jax.device_put(data, NamedSharding(mesh8, P("data")))
    np.testing.assert_allclose(
        global_dm.reduce_sum({"x": sharded})["x"], data.sum(), rtol=1e-5
    )
    # A per-call axis_name overrides the object's.
    np.testing.assert_allclose(
        dm.reduce_max({"x": sharded}, axis_name=None)["x"], data.max()
    )
    with pytest.raises(ValueError, match="global mode"):
        global_dm.all_gather({"x": sharded})


def test_one_device_reductions_are_identity(mesh1):
    x = np.arange(6.0).reshape(2, 3)

    def step(v):
        return (
            ed.reduce_mean(v),
            ed.reduce_sum(v),
            ed.reduce_max(v),
            ed.all_gather(v),
            ed.all_gather(v, tiled=True),
        )

    mean, total, hi, gathered, tiled = jax.shard_map(
        step, mesh=mesh1, in_specs=P("data"), out_specs=P()
    )(x)
    for out in (mean, total, hi, tiled):
        np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(gathered, x[None])


def test_collectives_under_vmap_with_a_named_axis():
    # datarax-style: collectives over a `vmap` axis rather than a mesh axis.
    tree = {"loss": jnp.array([1.0, 3.0]), "g": {"w": jnp.array([[2.0], [4.0]])}}
    gathered = jax.vmap(lambda t: ed.all_gather(t, "batch"), axis_name="batch")(tree)
    np.testing.assert_array_equal(gathered["loss"], [[1.0, 3.0], [1.0, 3.0]])
    assert gathered["g"]["w"].shape == (2, 2, 1)
    tiled = jax.vmap(lambda t: ed.all_gather(t, "batch", tiled=True), axis_name="batch")
    np.testing.assert_array_equal(tiled(tree)["loss"], [[1.0, 3.0], [1.0, 3.0]])
    mean = jax.vmap(lambda t: ed.reduce_mean(t, "batch"), axis_name="batch")(tree)
    np.testing.assert_array_equal(mean["loss"], [2.0, 2.0])


def test_python_number_in_a_collective_sum_warns_and_passes_through(mesh8):
    # The trap: `lax.psum` multiplies a Python number by the axis size, as a count
    # must be summed; `reduce_sum` passes it through (as every non-array leaf) and
    # says so, at the line that called it.
    def step(x):
        n = x.shape[0]  # this device's rows, as a Python int
        return ed.reduce_sum(
            {"correct": (jnp.sum(x > 0), n), "array_n": jnp.asarray(n)}
        )

    x = np.arange(-4.0, 12.0)  # 2 rows per device, 11 positive
    with pytest.warns(UserWarning) as record:
        out = per_device(step, mesh8, x)
    assert [w.filename for w in record] == [__file__]
    message = str(record[0].message)
    for part in [
        "reduce_sum: `metrics` leaf ['correct'][1] is the Python int 2",
        "NOT summed over 'data' (8 devices)",
        "`jax.lax.psum` would give 16",
        "`jnp.asarray(2)`",
    ]:
        assert part in message, message
    # The result is what the contract says: the number unchanged, arrays summed.
    assert int(out["correct"][0]) == 11 and int(out["correct"][1]) == 2
    assert int(out["array_n"]) == 16


def test_unsummed_number_warning_is_once_per_call_site(mesh8):
    def step(x):
        return ed.reduce_sum({"x": x.sum(), "n": 4})

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        for rows in (8, 16):  # traced twice: the same call site, the same leaf
            per_device(step, mesh8, np.ones(rows))
    assert len(record) == 1 and "['n'] is the Python int 4" in str(record[0].message)


def test_unsummed_number_warning_names_reduce_custom_and_methods(mesh8):
    def step(x):
        dm = ed.compat.DistributedMetrics()
        custom = ed.reduce_custom(
            {"n": {"rows": 2, "x": x.sum()}, "lr": 0.1, "m": 3},
            {"n": "sum", "m": "max"},
        )
        return custom, dm.reduce_sum({"k": 2.5})

    with pytest.warns(UserWarning) as record:
        custom, method = per_device(step, mesh8, np.ones(16))
    messages = [str(w.message) for w in record]
    assert len(messages) == 2, messages  # "lr" is averaged and "m" maximised: no trap
    assert (
        "reduce_custom: `metrics` leaf ['n']['rows'] is the Python int 2"
        in (messages[0])
    )
    assert "reduce_sum: `metrics` leaf ['k'] is the Python float 2.5" in messages[1]
    assert {w.filename for w in record} == {__file__}
    assert custom["n"]["rows"] == 2 and float(custom["lr"]) == pytest.approx(0.1)
    assert float(method["k"]) == 2.5


def test_no_unsummed_number_warning_where_nothing_is_lost(mesh8):
    def step(x):
        tree = {"flag": True, "none": None, "name": "acc", "x": x.sum(), "n": 3}
        for reduce in (ed.reduce_mean, ed.reduce_max, ed.reduce_min):
            reduce(tree)
        out = ed.reduce_sum({"flag": True, "none": None, "name": "acc", "x": x.sum()})
        return out["x"]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        per_device(step, mesh8, np.ones(8))
        # Global mode reduces each array itself: no device axis, nothing to sum.
        ed.reduce_sum({"x": jnp.ones(4), "n": 3}, axis_name=None)
