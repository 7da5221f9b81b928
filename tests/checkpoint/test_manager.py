"""`CheckpointManager` beyond the basics: preemption at any point of the documented
loop, asynchronous saves that fail, and the metadata saved with a step."""

import json
import math
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxdist as ed

SCRIPTS = Path(__file__).parent.parent / "mp_scripts"


# ------------------------------------------------------------------ preemption


@pytest.mark.parametrize(
    "where", ["before save", "after save", "after reached_preemption"]
)
@pytest.mark.parametrize("signal_at", [4, 5])  # a step on the interval, and not
def test_sigterm_anywhere_in_the_documented_loop_loses_no_step(
    tmp_path, where, signal_at
):
    def train(w, step):  # a step whose result shows which step made it
        return w * 2.0 + step

    w = jnp.zeros(3)
    with ed.CheckpointManager(tmp_path, save_interval_steps=4) as manager:
        for i in range(20):
            w = train(w, i)
            if i + 1 == signal_at and where == "before save":
                signal.raise_signal(signal.SIGTERM)
            manager.save(i + 1, {"w": w})
            if i + 1 == signal_at and where == "after save":
                signal.raise_signal(signal.SIGTERM)
            if manager.reached_preemption(i + 1):
                break
            if i + 1 == signal_at and where == "after reached_preemption":
                signal.raise_signal(signal.SIGTERM)
        stopped = i + 1
    assert signal_at <= stopped <= signal_at + 1
    # The loop stopped at the newest saved step, and it holds the state it ended on.
    assert ed.latest_step(tmp_path) == stopped
    want = np.zeros(3, np.float32)
    for step in range(stopped):
        want = want * 2.0 + step
    restored = ed.restore_checkpoint(tmp_path, {"w": jnp.zeros(3)})
    np.testing.assert_array_equal(restored["w"], want)


@pytest.mark.parametrize("periodic_save", [False, True])
@pytest.mark.parametrize("where", ["before check", "after check", "after save"])
def test_sigterm_anywhere_in_orbaxs_loop_stops_at_once_and_loses_no_step(
    tmp_path, where, periodic_save
):
    # v0.2's contract and Orbax's shape: check first, and the loop saves the step
    # itself when preempted; with a long interval nothing else saves (v0.3's
    # check waited for a save since the signal, so this loop never stopped).
    def train(w, step):
        return w * 2.0 + step

    signal_at, w = 5, jnp.zeros(3)
    with ed.CheckpointManager(tmp_path, save_interval_steps=1000) as manager:
        for i in range(20):
            w = train(w, i)
            if i + 1 == signal_at and where == "before check":
                signal.raise_signal(signal.SIGTERM)
            if manager.reached_preemption(i + 1):
                assert manager.save(i + 1, {"w": w}, force=True)
                break
            if i + 1 == signal_at and where == "after check":
                signal.raise_signal(signal.SIGTERM)
            if periodic_save:
                manager.save(i + 1, {"w": w})
            if i + 1 == signal_at and where == "after save":
                signal.raise_signal(signal.SIGTERM)
        stopped = i + 1
    # The first check after the signal stops the loop.
    assert stopped == (signal_at if where == "before check" else signal_at + 1)
    # A periodic save after the check saves the signalled step as well.
    saved = [signal_at] if periodic_save and where == "after check" else []
    assert manager.all_steps() == [*saved, stopped]
    want = np.zeros(3, np.float32)
    for step in range(stopped):
        want = want * 2.0 + step
    restored = ed.restore_checkpoint(tmp_path, {"w": jnp.zeros(3)})
    np.testing.assert_array_equal(restored["w"], want)


# ------------------------------------------------------------ failing saves


@pytest.fixture
def files_over_1mib_fail():
    """Writes past 1 MiB fail (EFBIG) as on a full disk, for root too."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def big(step):
    # Random (incompressible) 4 MiB: its data file is larger than the limit.
    return {"w": jax.random.normal(jax.random.key(step), (1 << 20,))}


def test_failed_async_saves_leave_no_temporary_directories(
    tmp_path, files_over_1mib_fail
):
    manager = ed.CheckpointManager(tmp_path, async_save=True)
    manager.save(1, {"w": jnp.ones(4)})
    manager.wait_until_finished()
    assert manager.save(2, big(2))  # the write fails in the background...
    with pytest.raises(Exception, match="File too large") as error:
        manager.save(3, big(3))  # ...and is reported by the next call
    assert "saving step 2" in "".join(getattr(error.value, "__notes__", []))
    assert manager.save(4, big(4))
    with pytest.raises(Exception, match="File too large") as error:
        manager.close()
    assert "saving step 4" in "".join(getattr(error.value, "__notes__", []))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]
    restored = ed.restore_checkpoint(tmp_path, {"w": jnp.zeros(4)})
    np.testing.assert_array_equal(restored["w"], np.ones(4))


def test_a_failed_save_checkpoint_leaves_no_temporary_directory(
    tmp_path, files_over_1mib_fail
):
    with pytest.raises(Exception, match="File too large"):
        ed.save_checkpoint(tmp_path, big(1), step=1)
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_cannot_be_created_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    for make in (
        lambda d: ed.CheckpointManager(d),
        lambda d: ed.save_checkpoint(d, {"w": jnp.ones(2)}, step=1),
    ):
        with pytest.raises(ValueError, match="cannot create the checkpoint dir"):
            make(tmp_path / "file" / "ckpt")


@pytest.mark.slow
def test_a_failed_async_save_does_not_keep_the_process_from_exiting(tmp_path):
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, SCRIPTS / "save_fail.py", tmp_path / "ckpt"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    took = time.monotonic() - start
    assert run.returncode == 0, run.stderr
    assert "error: [Errno 13] Permission denied" in run.stdout, run.stdout
    assert "saving step 1" in run.stdout and "done" in run.stdout
    assert took < 60, f"the process took {took:.0f} s to exit"
    assert list((tmp_path / "ckpt").iterdir()) == []


# -------------------------------------------------------------------- metadata


def test_metadata_round_trip_latest_and_empty(tmp_path):
    first = {"position": {"step": 10, "epoch": 1}, "lr": 0.1, "tags": ["a", None]}
    second = {"position": {"step": 20, "epoch": 2}, "ok": True, "x": -1e-300}
    with ed.CheckpointManager(tmp_path) as manager:
        assert manager.save(10, {"w": jnp.ones(2)}, metadata=first)
        assert manager.save(20, {"w": jnp.ones(2)}, metadata=second)
        assert manager.metadata(10) == first and manager.metadata() == second
        assert manager.save(30, {"w": jnp.ones(2)})
        assert manager.metadata(30) == {} and manager.metadata() == {}
        assert manager.metadata(20) == second
        with pytest.raises(ed.CheckpointNotFoundError, match=r"step 25 .*\[10, 20"):
            manager.metadata(25)
    ed.save_checkpoint(tmp_path / "plain", {"w": jnp.ones(2)}, step=1)
    with ed.CheckpointManager(tmp_path / "plain") as manager:
        assert manager.metadata() == {}
        with pytest.raises(ed.CheckpointNotFoundError):
            ed.CheckpointManager(tmp_path / "empty").metadata()


@pytest.mark.parametrize(
    ("metadata", "error", "message"),
    [
        ([1, 2], TypeError, "parameter 'metadata'"),
        ({"n": np.int64(3)}, TypeError, "int64 is not JSON serializable"),
        ({"s": {1, 2}}, TypeError, "set is not JSON serializable"),
        ({"x": math.nan}, TypeError, "Out of range float"),
        ({"pair": (1, 2)}, ValueError, "tuples become lists"),
        ({3: "three"}, TypeError, "parameter 'metadata'"),
    ],
)
def test_metadata_that_json_does_not_keep_is_rejected_before_writing(
    tmp_path, metadata, error, message
):
    with ed.CheckpointManager(tmp_path) as manager:
        with pytest.raises(error, match=rf"(?s)CheckpointManager.save.*{message}"):
            manager.save(1, {"w": jnp.ones(2)}, metadata=metadata)
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "damage",
    [
        lambda m: m["metadata"].update(position=11),  # still valid JSON
        lambda m: m["metadata"].pop("position"),
        lambda m: m.pop("metadata"),
    ],
)
def test_corrupted_metadata_is_detected_naming_the_step(tmp_path, damage):
    with ed.CheckpointManager(tmp_path) as manager:
        manager.save(7, {"w": jnp.ones(2)}, metadata={"position": 10})
        marker_file = tmp_path / "7" / "eqxdist_checkpoint.json"
        marker = json.loads(marker_file.read_text())
        damage(marker)
        marker_file.write_text(json.dumps(marker))
        with pytest.raises(ValueError, match=r"step 7 .* corrupted"):
            manager.metadata()
        with pytest.raises(ValueError, match=r"step 7 .* corrupted"):
            manager.restore({"w": jnp.zeros(2)})


def test_metadata_with_async_saves(tmp_path):
    position = {"step": 1}
    with ed.CheckpointManager(tmp_path, async_save=True) as manager:
        for step in (1, 2, 3):
            position["step"] = step
            manager.save(step, {"w": jnp.full(2, float(step))}, metadata=position)
        # Saved as it was at `save`, not as the caller's dict is later.
        position["step"] = 99
        assert [manager.metadata(s) for s in (1, 2, 3)] == [
            {"step": 1},
            {"step": 2},
            {"step": 3},
        ]
