import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxdist as ed


def test_mapping_and_pairs_give_ordered_auto_axes():
    mesh = ed.create_device_mesh({"data": 4, "model": 2})
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    np.testing.assert_array_equal(
        np.vectorize(lambda d: d.id)(mesh.devices),
        np.arange(8).reshape(4, 2),
    )
    pairs = ed.create_device_mesh([("model", 2), ("data", 4)])
    assert pairs.axis_names == ("model", "data")
    assert dict(pairs.shape) == {"model": 2, "data": 4}


def test_minus_one_takes_the_remaining_devices():
    assert dict(ed.create_device_mesh({"data": -1}).shape) == {"data": 8}
    assert dict(ed.create_device_mesh({"data": -1, "model": 2}).shape) == {
        "data": 4,
        "model": 2,
    }
    assert dict(ed.create_hybrid_mesh(2, -1).shape) == {"data": 2, "model": 4}


def test_uses_the_first_devices_when_fewer_are_asked_for():
    mesh = ed.create_device_mesh({"data": 3})
    assert [d.id for d in mesh.devices.flat] == [0, 1, 2]
    devices = jax.devices()[4:]
    mesh = ed.create_device_mesh({"data": 2}, devices=devices)
    assert [d.id for d in mesh.devices.flat] == [4, 5]


def test_auto_axes_accept_unsharded_inputs_in_shard_map():
    mesh = ed.create_data_parallel_mesh()
    x = np.arange(16.0)  # a plain NumPy array, not placed on the mesh
    f = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v.sum(), "data"),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
        )
    )
    assert float(f(x)) == x.sum()


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ({}, "empty"),
        ([], "empty"),
        ({"data": 0}, "size of axis 'data' is 0"),
        ({"data": -2}, "size of axis 'data' is -2"),
        ({"data": -1, "model": -1}, "more than one axis has size -1"),
        ({"data": -1, "model": 3}, "not divisible by the product"),
        ([("data", 2), ("data", 2)], r"duplicate axis names \['data'\]"),
        ({"": 2}, "non-empty strings"),
        ({"data": 16}, "Not enough devices.*16.*8"),
        ({"data": 4, "model": 4}, "Not enough devices.*16.*8"),
    ],
)
def test_invalid_shapes_raise_value_error(shape, match):
    with pytest.raises(ValueError, match=match):
        ed.create_device_mesh(shape)


def test_empty_device_list_is_a_value_error():
    with pytest.raises(ValueError, match="`devices` is empty"):
        ed.create_device_mesh({"data": -1}, devices=[])


@pytest.mark.parametrize("shape", [{"data": 2.0}, {"data": "2"}, [("data", True)]])
def test_non_int_sizes_raise_type_error(shape):
    with pytest.raises(TypeError):
        ed.create_device_mesh(shape)


def test_not_a_shape_raises_type_error():
    with pytest.raises(TypeError):
        ed.create_device_mesh(8)  # type: ignore[arg-type]


def test_data_and_model_parallel_meshes():
    assert dict(ed.create_data_parallel_mesh().shape) == {"data": 8}
    assert dict(ed.create_data_parallel_mesh(4).shape) == {"data": 4}
    assert dict(ed.create_data_parallel_mesh(2, axis_name="batch").shape) == {
        "batch": 2
    }
    assert dict(ed.create_model_parallel_mesh().shape) == {"model": 8}
    assert dict(ed.create_hybrid_mesh().shape) == {"data": 1, "model": 1}
    assert dict(ed.create_hybrid_mesh(4, 2, data_axis="d", model_axis="m").shape) == {
        "d": 4,
        "m": 2,
    }
    # No silent truncation when more devices are asked for than exist.
    with pytest.raises(ValueError, match="Not enough devices"):
        ed.create_data_parallel_mesh(9)
    with pytest.raises(ValueError, match="Not enough devices"):
        ed.create_hybrid_mesh(4, 4)


def test_get_mesh_info():
    info = ed.get_mesh_info(ed.create_hybrid_mesh(4, 2))
    assert info["total_devices"] == 8
    assert info["axes"] == {"data": 4, "model": 2}
    assert list(info["axes"]) == ["data", "model"]
    assert info["process_count"] == 1
    assert info["local_devices"] == 8
    assert info["platform"] == "cpu"


def test_device_mesh_manager():
    manager = ed.compat.DeviceMeshManager()
    assert manager.num_devices == 8
    assert dict(manager.create_device_mesh({"data": -1}).shape) == {"data": 8}
    assert dict(manager.create_data_parallel_mesh().shape) == {"data": 8}
    assert dict(manager.create_model_parallel_mesh(2).shape) == {"model": 2}
    assert dict(manager.create_hybrid_mesh(2, 4).shape) == {"data": 2, "model": 4}
    assert manager.get_mesh_info(manager.create_hybrid_mesh(2, 2))["total_devices"] == 4

    assert manager.devices == jax.devices()  # the list it was given (default all)

    small = ed.compat.DeviceMeshManager(jax.devices()[:2])
    assert small.num_devices == 2
    assert small.devices == jax.devices()[:2]
    # A call's own devices override the manager's.
    other = small.create_device_mesh([("data", 2)], devices=jax.devices()[6:])
    assert [d.id for d in other.devices.flat] == [6, 7]
    assert dict(small.create_data_parallel_mesh().shape) == {"data": 2}
    with pytest.raises(ValueError, match="Not enough devices.*4.*2"):
        small.create_data_parallel_mesh(4)
    with pytest.raises(ValueError, match="empty"):
        ed.compat.DeviceMeshManager([])


def test_mesh_on_one_device_runs_collectives():
    mesh = ed.create_data_parallel_mesh(1)
    x = jnp.arange(4.0)
    out = jax.shard_map(
        lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
    )(x)
    np.testing.assert_array_equal(out, x)
    placed = jax.device_put(x, NamedSharding(mesh, P("data")))
    assert placed.sharding.num_devices == 1


def _run_fresh(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )


@pytest.mark.slow
def test_simulate_cpu_devices_in_a_fresh_process():
    ok = _run_fresh(
        "import eqxdist as ed, jax; ed.simulate_cpu_devices(4); "
        "print(jax.device_count(), ed.create_data_parallel_mesh().size)"
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["4", "4"]
    late = _run_fresh(
        "import eqxdist as ed, jax; jax.numpy.ones(1); ed.simulate_cpu_devices(4)"
    )
    assert late.returncode != 0
    assert "already started with 1 device, so 4" in late.stderr


@pytest.mark.slow
def test_simulate_cpu_devices_keeps_an_existing_flag():
    before = os.environ["XLA_FLAGS"]
    # The flag conftest set wins, and the call says so; nothing changes.
    with pytest.warns(UserWarning, match="which wins: JAX will have 8 CPU devices"):
        ed.simulate_cpu_devices(2)
    assert os.environ["XLA_FLAGS"] == before and jax.device_count() == 8
    with pytest.raises(ValueError, match="`count` must be >= 1"):
        ed.simulate_cpu_devices(0)


def test_axis_types_of_the_builders():
    explicit, auto = AxisType.Explicit, AxisType.Auto
    assert ed.create_device_mesh({"data": 8}, axis_types="explicit").axis_types == (
        explicit,
    )
    assert ed.create_data_parallel_mesh(axis_types="explicit").axis_types == (explicit,)
    assert ed.create_model_parallel_mesh(4, axis_types="explicit").axis_types == (
        explicit,
    )
    mixed = ed.create_hybrid_mesh(4, 2, axis_types=(explicit, auto))
    assert mixed.axis_types == (explicit, auto)
    assert ed.create_hybrid_mesh(4, 2).axis_types == (auto, auto)
    manager = ed.compat.DeviceMeshManager()
    assert manager.create_device_mesh(
        {"data": 2, "model": 4}, axis_types="explicit"
    ).axis_types == (explicit, explicit)
    # The mesh JAX's own builder gives, device for device.
    ours = ed.create_device_mesh({"data": 4, "model": 2}, axis_types="explicit")
    theirs = jax.make_mesh((4, 2), ("data", "model"))
    assert theirs.axis_types == ours.axis_types
    assert ours.axis_names == theirs.axis_names


@pytest.mark.parametrize(
    ("axis_types", "match"),
    [
        ("manual", r"`axis_types`='manual' is not a kind of axis.*'auto', 'explicit'"),
        ((AxisType.Explicit,), r"`axis_types` has 1 entries for the 2 axes"),
    ],
)
def test_axis_types_mistakes(axis_types, match):
    with pytest.raises(ValueError, match=match):
        ed.create_device_mesh({"data": 4, "model": 2}, axis_types=axis_types)


def _lowered(mesh, strategy, options, state, batch):
    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["x"])
        return jnp.mean((logits - batch["y"]) ** 2), {}

    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh, strategy=strategy, **options)
    return step, step.lower(state, batch).as_text()


OPTIMIZER = optax.adam(1e-2)
STRATEGIES = {
    # name: (mesh shape, strategy, options)
    "dp": ({"data": 8}, "dp", {}),
    "fsdp": ({"data": 8}, "fsdp", {"min_weight_size": 16}),
    "zero1": ({"data": 8}, "zero1", {"min_weight_size": 16}),
    "hsdp": (
        {"replica": 2, "data": 4},
        "fsdp",
        {"min_weight_size": 16, "data_axis": ("replica", "data")},
    ),
    "fsdp_tp": (
        {"data": 4, "model": 2},
        "fsdp",
        {"min_weight_size": 16, "param_rules": [(r"layers\[0\]\.weight", P("model"))]},
    ),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_explicit_mesh_under_set_mesh_compiles_the_auto_program(name):
    """The mesh `jax.make_mesh` builds, inside `jax.set_mesh(mesh)`: every
    strategy's step lowers to the program of an Auto mesh, byte for byte, and
    trains to the same parameters bit for bit, returned on the caller's mesh."""
    shape, strategy, options = STRATEGIES[name]
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(16, 8)).astype(np.float32),
        "y": rng.normal(size=(16, 4)).astype(np.float32),
    }
    models = []
    texts = []
    for kind in ("auto", "explicit"):
        mesh = jax.make_mesh(
            tuple(shape.values()),
            tuple(shape),
            axis_types=(AxisType.Auto if kind == "auto" else AxisType.Explicit,)
            * len(shape),
        )
        state = ed.TrainState.create(
            eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0)), OPTIMIZER, jax.random.key(1)
        )
        with jax.set_mesh(mesh):
            step, text = _lowered(mesh, strategy, options, state, batch)
            state, _ = step(state, batch)
        texts.append(text)
        models.append(state.model)
        weight = state.model.layers[0].weight
        assert weight.sharding.mesh == mesh  # the caller's mesh, its types
    assert texts[0] == texts[1]
    for a, b in zip(
        jax.tree.leaves(models[0]), jax.tree.leaves(models[1]), strict=True
    ):
        if eqx.is_array(a):
            assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_simulate_cpu_devices_warns_when_xla_flags_set_another_count():
    code = (
        "import os, warnings; os.environ['XLA_FLAGS'] = "
        "'--xla_force_host_platform_device_count=2'\n"
        "import eqxdist as ed, jax\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    ed.simulate_cpu_devices(8)\n"
        "print(jax.device_count(), str(caught[0].message))"
    )
    out = _run_fresh(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("2 simulate_cpu_devices(8): XLA_FLAGS already sets")
    assert "JAX will have 2 CPU devices, not 8" in out.stdout
