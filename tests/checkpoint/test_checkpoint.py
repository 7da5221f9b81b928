"""Checkpoints in one process with 8 devices: exact round trips, restoring under
another layout or device count, resuming training, interrupted saves and bad input.
(Saving and restoring across processes is in tests/launch/test_launch.py.)"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import v0_1_checkpoint
from jax.sharding import NamedSharding, PartitionSpec as P
from mp_scripts import common

import eqxdist as ed
from eqxdist import CheckpointNotFoundError
from eqxdist._checkpoint.files import DirectoryLock

SCRIPTS = Path(__file__).parent.parent / "mp_scripts"


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
    ("saved", "restored", "devices", "kinds"),
    [
        (saved, restored, devices, ("auto", "auto"))
        for saved, restored in [("replicate", "shard"), ("shard", "replicate")]
        for devices in [8, 4]
    ]
    # Saved from one kind of mesh axes, restored into the other.
    + [
        ("shard", "shard", 8, ("auto", "explicit")),
        ("shard", "replicate", 4, ("explicit", "auto")),
    ],
)
def test_restore_under_another_strategy_and_device_count(
    tmp_path, saved, restored, devices, kinds
):
    model = eqx.nn.MLP(8, 4, 32, 2, key=jax.random.key(0))
    mesh = ed.create_data_parallel_mesh(axis_types=kinds[0])
    ed.save_checkpoint(
        tmp_path, ed.shard_model_state(model, mesh, saved, min_weight_size=64), step=0
    )
    blank = eqx.nn.MLP(8, 4, 32, 2, key=jax.random.key(1))
    target_mesh = ed.create_data_parallel_mesh(devices, axis_types=kinds[1])
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
    with pytest.raises(ValueError, match="is a file"):
        ed.latest_step(tmp_path / "file")


def test_saving_a_consumed_state_is_a_clear_error(tmp_path, mesh8):
    state = {"w": jax.device_put(jnp.ones(8), NamedSharding(mesh8, P("data")))}
    state["w"].delete()  # as a donating train step does
    with pytest.raises(ValueError, match=r"consumed by an earlier step .*\['w'\]"):
        ed.save_checkpoint(tmp_path, state, step=0)
    with (
        ed.CheckpointManager(tmp_path) as manager,
        pytest.raises(ValueError, match="consumed"),
    ):
        manager.save(1, state)


# ------------------------------------------------------------ CheckpointManager


def test_manager_interval_retention_and_the_functions_on_its_directory(tmp_path):
    with ed.CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=3) as m:
        saved = [m.save(s, {"w": jnp.full(4, float(s))}) for s in range(1, 11)]
        assert saved == [s % 3 == 0 for s in range(1, 11)]
        assert m.save(10, {"w": jnp.full(4, 10.0)}, force=True)
        assert m.all_steps() == [9, 10] and m.latest_step() == 10
        np.testing.assert_array_equal(
            m.restore({"w": jnp.zeros(4)}, step=9)["w"], np.full(4, 9.0)
        )
    # The plain functions read (and write) the manager's directory, and back.
    assert ed.latest_step(tmp_path) == 10
    np.testing.assert_array_equal(
        ed.restore_checkpoint(tmp_path, {"w": jnp.zeros(4)})["w"], np.full(4, 10.0)
    )
    ed.save_checkpoint(tmp_path, {"w": jnp.full(4, 12.0)}, step=12)
    with ed.CheckpointManager(tmp_path, max_to_keep=2) as m:
        assert m.all_steps() == [9, 10, 12]
        m.save(13, {"w": jnp.full(4, 13.0)})
        assert m.all_steps() == [12, 13]
    with pytest.raises(ValueError, match="closed"):
        m.save(14, {"w": jnp.zeros(4)})


def test_async_save_is_not_changed_by_a_donating_step(tmp_path, mesh8):
    step = ed.make_train_step(
        common.loss_fn, common.OPTIMIZER, mesh8, min_weight_size=64, donate=True
    )
    state, _, _ = common.train(step, common.make_state(), 0, 1)
    # (Host views of `state`'s own buffers would keep the step from donating them.)
    want = common.flat(ed._utils.map_arrays(lambda x: x.copy(), state))
    with ed.CheckpointManager(tmp_path, async_save=True) as manager:
        assert manager.save(1, state)
        # Donates `state`'s buffers at once, while the files are being written.
        after, _, _ = common.train(step, state, 1, 3)
        assert any(x.is_deleted() for x in jax.tree.leaves(state) if eqx.is_array(x))
        manager.wait_until_finished()
        restored = manager.restore(eqx.filter_eval_shape(common.make_state))
    got = common.flat(restored)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    # (The run went on: the later state differs from the saved one.)
    later = common.flat(after)
    assert any(not np.array_equal(later[name], want[name]) for name in want)


def test_manager_rejects_bad_arguments(tmp_path):
    with pytest.raises(
        ValueError, match=r"`max_to_keep` must be >= 1 or None \(keep all\); got 0"
    ):
        ed.CheckpointManager(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="`save_interval_steps` must be >= 1; got 0"):
        ed.CheckpointManager(tmp_path, save_interval_steps=0)
    with pytest.raises(TypeError, match="save_interval_steps"):
        ed.CheckpointManager(tmp_path, save_interval_steps=1.5)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        ed.CheckpointManager(tmp_path / "f")
    with ed.CheckpointManager(tmp_path / "c") as manager:
        with pytest.raises(TypeError, match="parameter 'step'"):
            manager.save("3", {"w": jnp.zeros(2)})
        manager.save(3, {"w": jnp.zeros(2)})
        with pytest.raises(ValueError, match="step 3 is already saved"):
            manager.save(3, {"w": jnp.zeros(2)}, force=True)


# ------------------------------------------------------------ integrity on disk


def data_files(location):
    return sorted(
        (p for p in (location / "default").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_files_are_detected_on_restore(tmp_path, damage):
    state = {"w": jnp.arange(4096.0), "b": jnp.ones(3)}
    location = ed.save_checkpoint(tmp_path, state, step=7)
    victim = data_files(location)[-1]  # the largest: array bytes
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        victim.unlink()
    name = str(victim.relative_to(location))
    with pytest.raises(ValueError, match=rf"step 7 .* corrupted: file '{name}'"):
        ed.restore_checkpoint(tmp_path, state)


def test_a_corrupted_description_is_detected(tmp_path):
    location = ed.save_checkpoint(tmp_path, {"w": jnp.ones(3)}, step=2)
    (location / "eqxdist_checkpoint.json").write_text('{"format": "eqx')
    with pytest.raises(ValueError, match=r"step 2 .* eqxdist_checkpoint.json cannot"):
        ed.restore_checkpoint(tmp_path, {"w": jnp.ones(3)})


def test_odd_entries_are_ignored_or_clear_errors(tmp_path):
    ed.save_checkpoint(tmp_path, {"w": jnp.full(3, 4.0)}, step=4)
    (tmp_path / "20").write_text("a file")
    (tmp_path / "30").symlink_to(tmp_path / "4")
    shutil.copytree(tmp_path / "4", tmp_path / "007")
    shutil.copytree(tmp_path / "4", tmp_path / "\u0663")  # ARABIC-INDIC DIGIT THREE
    shutil.copytree(tmp_path / "4", tmp_path / "step_9")
    assert ed.latest_step(tmp_path) == 4
    with pytest.raises(
        CheckpointNotFoundError, match=r"step 7 .* complete steps .*\[4\]"
    ):
        ed.restore_checkpoint(tmp_path, {"w": jnp.zeros(3)}, step=7)
    with pytest.raises(ValueError, match="20' exists and is not a checkpoint dir"):
        ed.save_checkpoint(tmp_path, {"w": jnp.zeros(3)}, step=20)
    with ed.CheckpointManager(tmp_path, max_to_keep=1) as manager:
        assert manager.all_steps() == [4]
        manager.save(5, {"w": jnp.zeros(3)})
        assert manager.all_steps() == [5]
    # Retention removed step 4 and nothing that is not a step of ours.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["5", "20", "30", "007", "\u0663", "step_9"]
    )


def _ready_racer(value):
    """A `save_race.py` process that has built its state and waits for the
    directory of a trial."""
    racer = subprocess.Popen(
        [sys.executable, SCRIPTS / "save_race.py", value],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert racer.stdout.readline() == "ready\n"
    return racer


def _go(racer, directory):
    racer.stdin.write(f"{directory}\n")
    racer.stdin.flush()


@pytest.mark.slow
def test_concurrent_saves_of_one_step_are_never_mixed(tmp_path):
    # Two racing processes, each running every trial (their start paid once).
    racers = [_ready_racer(value) for value in ("1", "2")]
    try:
        for trial in range(4):
            directory = tmp_path / str(trial)
            for racer in racers:  # both go at once
                _go(racer, directory)
            lines = sorted(racer.stdout.readline().strip() for racer in racers)
            assert lines[0].startswith("lost:") and lines[1] == "saved", lines
            assert "step 5" in lines[0]
            target = {name: jnp.zeros((512, 1024)) for name in ("a", "b", "c")}
            values = {
                float(np.unique(np.asarray(v)).item())
                for v in ed.restore_checkpoint(directory, target).values()
            }
            assert len(values) == 1, f"a mixed checkpoint: {values}"
            assert not [p for p in directory.iterdir() if "tmp" in p.name]
    finally:
        outputs = [r.communicate(timeout=120) for r in racers]
    for racer, (_, err) in zip(racers, outputs, strict=True):
        assert racer.returncode == 0, err


@pytest.mark.slow
def test_a_step_committed_while_a_save_waits_is_kept(tmp_path):
    # Orbax deletes an existing step directory before saving it; a step another run
    # commits after our check must not be deleted: the check and the commit happen
    # under one lock on the directory, and the waiting save is told the step is
    # saved.
    directory, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    directory.mkdir()
    state = {name: jnp.full((512, 1024), 1.0) for name in ("a", "b", "c")}
    ed.save_checkpoint(elsewhere, state, step=5)
    lock = DirectoryLock(directory)  # as another run's save holds it
    try:
        racer = _ready_racer("2")
        _go(racer, directory)
        time.sleep(3)  # the racer checks that step 5 is free, then waits
        (elsewhere / "5").rename(directory / "5")  # the other run's commit
        assert racer.poll() is None, racer.communicate()
    finally:
        lock.release()
    out, err = racer.communicate(timeout=120)
    assert racer.returncode == 0, err
    assert out.startswith("lost:") and "step 5 is already saved" in out, out
    restored = ed.restore_checkpoint(directory, jax.tree.map(jnp.zeros_like, state))
    assert all(bool((v == 1.0).all()) for v in restored.values())
    assert not [p for p in directory.iterdir() if "tmp" in p.name]


# ------------------------------------------------------------------- real kills


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_at_any_moment_of_a_save_keeps_a_whole_checkpoint(tmp_path, mode):
    for delay in (0.0, 0.13, 0.41):
        loop = subprocess.Popen(
            [sys.executable, SCRIPTS / "save_loop.py", tmp_path, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for line in loop.stdout:
            if line.startswith("step") and int(line.split()[1]) % 3 == 0:
                break
        time.sleep(delay)
        loop.kill()
        loop.wait()
        step = ed.latest_step(tmp_path)
        assert step is not None
        target = {"w": jnp.zeros((1024, 1024)), "s": jnp.int32(0)}
        restored = ed.restore_checkpoint(tmp_path, target)
        assert int(restored["s"]) == step
        np.testing.assert_array_equal(np.unique(np.asarray(restored["w"])), [step])
    # The next manager removes what the killed saves left.
    with ed.CheckpointManager(tmp_path, max_to_keep=2) as manager:
        assert not [p for p in tmp_path.iterdir() if ".orbax-checkpoint-tmp" in p.name]
        last = manager.latest_step()
        assert manager.save(last + 1, {"w": jnp.zeros((1024, 1024)), "s": jnp.int32(0)})


@pytest.mark.slow
def test_sigterm_saves_and_the_rerun_resumes_bit_exactly(tmp_path, cached_env):
    script = SCRIPTS / "preempt_train.py"
    steps = "10"
    full = subprocess.run(
        [
            *(sys.executable, script, tmp_path / "full", tmp_path / "full.npz"),
            *(steps, "no-pause"),  # no signal comes: no pause for one
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=cached_env,
    )
    assert full.returncode == 0, full.stderr
    ckpt = tmp_path / "ckpt"
    run = subprocess.Popen(
        [sys.executable, script, ckpt, tmp_path / "resumed.npz", steps],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cached_env,
    )
    for line in run.stdout:
        if line.split()[-2:] == ["step", "3"]:
            run.send_signal(signal.SIGTERM)
            break
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    stopped = int(out.split("preempted at ")[1].split()[0])
    assert 3 <= stopped < 10 and ed.latest_step(ckpt) == stopped
    assert not (tmp_path / "resumed.npz").exists()
    rerun = subprocess.run(
        [sys.executable, script, ckpt, tmp_path / "resumed.npz", steps, "no-pause"],
        capture_output=True,
        text=True,
        timeout=300,
        env=cached_env,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert f"resumed at {stopped}" in rerun.stdout
    want, got = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_checkpoints_written_by_v0_1_still_restore(tmp_path):
    # v0.1's layout: the arrays directly in <step>/, a marker without checksums.
    v0_1_checkpoint(tmp_path)
    assert ed.latest_step(tmp_path) == 3
    restored = ed.restore_checkpoint(tmp_path, {"w": np.zeros(4)})
    np.testing.assert_array_equal(restored["w"], np.arange(4.0))
    with ed.CheckpointManager(tmp_path) as manager:  # and a manager carries on
        manager.save(4, {"w": np.ones(4)})
        assert manager.all_steps() == [3, 4]


@pytest.mark.slow
def test_a_new_manager_removes_the_leftovers_of_dead_saves_only(tmp_path):
    from eqxdist._checkpoint.files import host_name

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    host = host_name()
    names = {
        "dead": f"3.orbax-checkpoint-tmp-{host}-{dead.stdout.strip()}-ab12",
        "live": f"4.orbax-checkpoint-tmp-{host}-{os.getpid()}-cd34",
        "other host, recent": "5.orbax-checkpoint-tmp-elsewhere-1-ef56",
        "other host, old": "6.orbax-checkpoint-tmp-elsewhere-1-0789",
        "orbax's own": "7.orbax-checkpoint-tmp",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "data").write_bytes(b"x" * 1000)
    old = time.time() - 2 * 3600
    for path in (tmp_path / names["other host, old"]).rglob("*"):
        os.utime(path, (old, old))
    os.utime(tmp_path / names["other host, old"], (old, old))
    ed.CheckpointManager(tmp_path).close()
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {names["live"], names["other host, recent"]}
