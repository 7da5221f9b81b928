"""Checkpoints in one process with 8 devices: exact round trips, restoring under
another layout or device count, resuming training, interrupted saves and bad input.
(Saving and restoring across processes is in tests/test_distributed.py.)"""

import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from mp_scripts import common

import eqxdist as ed
from eqxdist._checkpoint import CheckpointNotFoundError

SCRIPTS = Path(__file__).parent / "mp_scripts"


def key_aware(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def assert_same_tree(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if eqx.is_array(y):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(key_aware(x)), key_aware(y))
        else:
            assert x is y or x == y


@pytest.fixture
def state(mesh8):
    """Every kind of leaf a state can have."""
    return {
        "w": jax.device_put(
            jnp.arange(128.0).reshape(16, 8), NamedSharding(mesh8, P("data"))
        ),
        "half": jnp.linspace(0, 1, 5, dtype=jnp.bfloat16),
        "count": jnp.int32(7),
        "key": jax.random.key(3),
        "keys": jax.device_put(
            jax.random.split(jax.random.key(4), 8), NamedSharding(mesh8, P("data"))
        ),
        "host": np.array([1.5, 2.5], np.float64),
        "activation": jax.nn.relu,
        "size": 3,
        "name": "mlp",
        "nothing": None,
    }


def test_round_trip_into_concrete_and_abstract_targets(tmp_path, state, mesh8):
    path = ed.save_checkpoint(tmp_path, state, step=3)
    assert path == tmp_path / "3" and ed.latest_step(tmp_path) == 3

    restored = ed.restore_checkpoint(tmp_path, state)
    assert_same_tree(restored, state)
    assert restored["w"].sharding == state["w"].sharding
    assert restored["keys"].sharding.spec == P("data")
    assert isinstance(restored["host"], np.ndarray)

    # Abstract leaves: a given sharding is used; without one, replicated.
    abstract = eqx.filter_eval_shape(lambda: state)
    abstract["host"] = np.zeros(2)  # (eval_shape makes float64 float32)
    abstract["w"] = jax.ShapeDtypeStruct(
        (16, 8), jnp.float32, sharding=NamedSharding(mesh8, P(None, "data"))
    )
    restored = ed.restore_checkpoint(tmp_path, abstract, step=3)
    for name in ("w", "half", "count", "key", "keys", "host"):
        np.testing.assert_array_equal(key_aware(restored[name]), key_aware(state[name]))
    assert restored["w"].sharding.spec == P(None, "data")
    assert restored["half"].sharding == NamedSharding(mesh8, P())
    assert restored["activation"] is jax.nn.relu and restored["name"] == "mlp"

    # Non-array leaves always come from the target.
    renamed = dict(state, name="other", size=5)
    assert ed.restore_checkpoint(tmp_path, renamed)["name"] == "other"


@pytest.mark.parametrize(
    ("saved", "restored"), [("replicate", "shard"), ("shard", "replicate")]
)
@pytest.mark.parametrize("devices", [8, 4])
def test_restore_under_another_strategy_and_device_count(
    tmp_path, saved, restored, devices
):
    model = eqx.nn.MLP(8, 4, 32, 2, key=jax.random.key(0))
    mesh = ed.create_data_parallel_mesh()
    ed.save_checkpoint(
        tmp_path, ed.shard_model_state(model, mesh, saved, min_weight_size=64), step=0
    )
    blank = eqx.nn.MLP(8, 4, 32, 2, key=jax.random.key(1))
    target_mesh = ed.create_data_parallel_mesh(devices)
    target = ed.shard_model_state(blank, target_mesh, restored, min_weight_size=64)
    got = ed.restore_checkpoint(tmp_path, target)
    assert_same_tree(got, model)
    for x, t in zip(jax.tree.leaves(got), jax.tree.leaves(target), strict=True):
        if eqx.is_array(t):
            assert x.sharding == t.sharding
    if restored == "shard":
        assert got.layers[1].weight.sharding.spec != P()


def test_resume_equals_the_uninterrupted_run(tmp_path, mesh8):
    step = ed.make_train_step(
        common.loss_fn,
        common.OPTIMIZER,
        mesh8,
        strategy="fsdp",
        min_weight_size=common.MIN_WEIGHT_SIZE,
    )
    full, full_metrics, _ = common.train(step, common.make_state(), 0, common.STEPS)

    half, first, _ = common.train(step, common.make_state(), 0, 2)
    ed.save_checkpoint(tmp_path, half, step=2)
    # A restarted job: nothing but the code and the checkpoint directory.
    abstract = eqx.filter_eval_shape(common.make_state)
    restored = ed.restore_checkpoint(tmp_path, abstract)
    assert int(restored.step) == 2
    resumed, rest, _ = common.train(step, restored, 2, common.STEPS)

    assert first + rest == full_metrics
    assert_same_tree(common.flat(resumed), common.flat(full))


def test_latest_step_skips_incomplete_and_foreign_entries(tmp_path):
    assert ed.latest_step(tmp_path / "not-yet") is None
    assert ed.latest_step(tmp_path) is None
    ed.save_checkpoint(tmp_path, {"w": jnp.zeros(3)}, step=1)
    ed.save_checkpoint(tmp_path, {"w": jnp.ones(3)}, step=5)
    torn = tmp_path / "9"  # a step directory whose save never finished
    torn.mkdir()
    (torn / "manifest.ocdbt").write_text("half written")
    (tmp_path / "12.orbax-checkpoint-tmp-1234").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "20").write_text("a file")
    assert ed.latest_step(tmp_path) == 5
    np.testing.assert_array_equal(
        ed.restore_checkpoint(tmp_path, {"w": jnp.zeros(3)})["w"], np.ones(3)
    )
    with pytest.raises(CheckpointNotFoundError, match=r"step 9 .* is incomplete"):
        ed.restore_checkpoint(tmp_path, {"w": jnp.zeros(3)}, step=9)
    # Saving that step again replaces the leftover.
    ed.save_checkpoint(tmp_path, {"w": jnp.full(3, 9.0)}, step=9)
    assert ed.latest_step(tmp_path) == 9


@pytest.mark.parametrize("where", ["orbax", "commit"])
def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, where):
    result = subprocess.run(
        [sys.executable, SCRIPTS / "crash_save.py", tmp_path, where],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 9, result.stderr
    assert any(entry.name.startswith("2") for entry in tmp_path.iterdir())
    assert ed.latest_step(tmp_path) == 1
    target = {"w": jnp.zeros(4)}
    np.testing.assert_array_equal(
        ed.restore_checkpoint(tmp_path, target)["w"], np.arange(4.0)
    )
    with pytest.raises(CheckpointNotFoundError, match="step 2"):
        ed.restore_checkpoint(tmp_path, target, step=2)
    ed.save_checkpoint(tmp_path, {"w": jnp.arange(4.0) + 10}, step=2)
    np.testing.assert_array_equal(
        ed.restore_checkpoint(tmp_path, target)["w"], np.arange(4.0) + 10
    )


# ------------------------------------------------------------------ bad input


def test_missing_directory_or_checkpoint(tmp_path):
    target = {"w": jnp.zeros(3)}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ed.restore_checkpoint(tmp_path / "nowhere", target)
    with pytest.raises(ValueError, match="no complete checkpoint in"):
        ed.restore_checkpoint(tmp_path, target)
    ed.save_checkpoint(tmp_path, target, step=4)
    with pytest.raises(ValueError, match=r"step 6 .* does not exist; the complete"):
        ed.restore_checkpoint(tmp_path, target, step=6)


def test_target_that_does_not_match(tmp_path, mesh8):
    ed.save_checkpoint(
        tmp_path, {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3, jnp.int32)}, step=0
    )
    cases = [
        ({"w": jnp.zeros((2, 3))}, r"saved leaves `target` has no array for: \['b'\]"),
        (
            {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3, jnp.int32), "c": jnp.ones(1)},
            r"array leaves not in the checkpoint: \['c'\]",
        ),
        (
            {"w": jnp.zeros((3, 2)), "b": jnp.zeros(3, jnp.int32)},
            r"leaf \['w'\] is float32\[3, 2\] in `target` but float32\[2, 3\]",
        ),
        (
            {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)},
            r"leaf \['b'\] is float32\[3\] in `target` but int32\[3\]",
        ),
        ({"w": jnp.zeros((2, 3)), "b": 0}, r"has no array for: \['b'\]"),
        (
            {
                "w": jax.ShapeDtypeStruct(
                    (2, 3), jnp.float32, sharding=NamedSharding(mesh8, P("data"))
                ),
                "b": jnp.zeros(3, jnp.int32),
            },
            r"sharding of `target` leaf \['w'\] does not fit its shape \[2, 3\]",
        ),
    ]
    for target, message in cases:
        with pytest.raises(ValueError, match=message):
            ed.restore_checkpoint(tmp_path, target)


def test_bad_save_arguments(tmp_path):
    state = {"w": jnp.zeros(2)}
    ed.save_checkpoint(tmp_path, state, step=0)
    with pytest.raises(ValueError, match="step 0 is already saved"):
        ed.save_checkpoint(tmp_path, state, step=0)
    with pytest.raises(ValueError, match="`step` must be >= 0; got -1"):
        ed.save_checkpoint(tmp_path, state, step=-1)
    with pytest.raises(TypeError, match="step"):
        ed.save_checkpoint(tmp_path, state, step=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        ed.save_checkpoint(tmp_path / "file", state, step=1)
