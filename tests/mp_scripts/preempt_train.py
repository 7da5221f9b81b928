"""A training loop that survives preemption, run by
tests/checkpoint/test_checkpoint.py (one plain process) and
tests/launch/test_launch.py (under `eqxdist.launch`, and as
SLURM-style processes started by hand):

    preempt_train.py CKPT OUT STEPS [save-first|check-first] [no-pause]
        [signal-on-resume|signal-before-manager]

Resumes from the latest checkpoint in CKPT if there is one, trains the `common`
problem (data parallel, a different batch per step) up to STEPS, and saves when
preempted: on SIGTERM to any process every process stops at the same step, saves
it and exits with status 0. A run that reaches STEPS writes the final state to OUT
(`.npz`, from process 0). Each save carries `metadata` (written by process 0); a
resumed run checks, on every process, that it reads back the step's own.

The loop saves, then asks `reached_preemption` (`save-first`, the default), or asks
first and saves only when preempted (`check-first`, Orbax's shape: with the long
interval nothing else saves). Each step pauses 0.3 s, so that a signal sent once
a step is printed lands before the run ends; `no-pause` leaves that out, for the
runs no signal is sent to (an uninterrupted reference, a rerun to the end).

`signal-on-resume`: a resumed run's process 0 sends itself SIGTERM right after
restoring, and every process waits 3 s before its first step, so that the
preemption notice (JAX's notifier looks for the signal once a second) reaches
every process before any asks about a step of the loop: a preemption during the
restore and the compilation, the longest part of a resumed run's start.
`signal-before-manager`: the same, before a run that has a checkpoint to
resume from opens its `CheckpointManager` (a preemption while the model is
built)."""

import os
import signal
import sys
import time

import eqxdist as ed

ed.initialize_distributed()

import common  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

directory, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = sys.argv[4:]
order = "check-first" if "check-first" in options else "save-first"
pause = 0.0 if "no-pause" in options else 0.3
mesh = ed.create_data_parallel_mesh()
train_step = ed.make_train_step(common.loss_fn, common.OPTIMIZER, mesh, strategy="dp")


def batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    rows = {
        "x": rng.normal(size=(common.GLOBAL_BATCH, common.FEATURES)),
        "y": rng.integers(0, common.CLASSES, common.GLOBAL_BATCH),
    }
    return common.local_rows(
        {"x": rows["x"].astype(np.float32), "y": rows["y"].astype(np.int32)}
    )


def preempt_self(option: str) -> None:
    if option in options:
        if jax.process_index() == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3.0)


if ed.latest_step(directory) is not None:
    preempt_self("signal-before-manager")
with ed.CheckpointManager(directory, save_interval_steps=1000, async_save=True) as m:
    start = m.latest_step() or 0
    state = common.make_state()
    if start:
        state = m.restore(eqx.filter_eval_shape(common.make_state))
        saved = m.metadata()
        if saved != {"next_step": start}:
            raise SystemExit(f"wrong metadata at step {start}: {saved}")
        print(f"resumed at {start}", flush=True)
        preempt_self("signal-on-resume")
    for step in range(start, steps):
        state, _ = train_step(state, batch(step))
        jax.block_until_ready(state)
        print(f"pid {os.getpid()} step {step + 1}", flush=True)
        time.sleep(pause)
        metadata = {"next_step": step + 1}
        if order == "save-first":
            m.save(step + 1, state, metadata=metadata)
        if m.reached_preemption(step + 1):
            if order == "check-first":
                m.save(step + 1, state, force=True, metadata=metadata)
            print(f"preempted at {step + 1}", flush=True)
            break
    else:
        arrays = common.flat(state)
        if jax.process_index() == 0:
            np.savez(out, **arrays)
