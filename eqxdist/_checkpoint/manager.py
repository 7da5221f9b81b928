"""`CheckpointManager`: periodic, asynchronous, retained checkpoints and preemption
handling for a training loop, on Orbax's own `CheckpointManager`."""

import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import jax
from jaxtyping import PyTree

from .. import _jax
from .._utils import Closing, check_not_consumed, typecheck
from . import files
from .api import CheckpointNotFoundError, latest_step, restore_checkpoint
from .writer import Writer, check_step, orbax

# Set once a manager of this process asked JAX's preemption sync point about a
# step of its loop: from then on that step is the one JAX goes by, and a manager
# opened later (another directory, mid-run) must not move it back.
_ASKED_SYNC_POINT = threading.Event()


def _uses_jax_preemption_service() -> bool:
    # Under `jax.distributed` JAX itself catches SIGTERM and agrees with the other
    # processes on the step to stop at (its preemption sync point).
    return bool(jax.distributed.is_initialized())


class CheckpointManager(Closing):
    """Checkpoints for a training loop: saves every `save_interval_steps` steps,
    keeps the newest `max_to_keep`, optionally writes in the background, and saves
    and stops cleanly when the job is preempted (SIGTERM). Built on Orbax's
    `CheckpointManager`; the directories are those of `save_checkpoint`, so
    `restore_checkpoint` and `latest_step` read them too, with the same guarantees
    (atomic saves, checksums checked on restore, saves of one step never mixed).

    **Arguments:**

    - `directory`: the run's checkpoint directory (created if missing; on a
      cluster, a file system every process can see). Leftovers of saves that died
      (temporary directories of this host's dead processes) are removed.
    - `max_to_keep`: after each completed save, only the newest `max_to_keep`
      steps remain; `None` keeps all.
    - `save_interval_steps`: `save(step, ...)` saves when `step` is a multiple of
      it (or when forced, or on preemption).
    - `async_save`: `save` returns once the arrays are copied off the devices and
      the files are written in the background (so the next train step may donate
      the saved state); `wait_until_finished()` waits for the write.

    Every method must be called by every process of a multi-process run, in the
    same order. In a single process, the manager installs a SIGTERM handler
    (restored by `close()`); under `jax.distributed` (`eqxdist.launch`, SLURM,
    ...) JAX's own preemption sync point is used, so `reached_preemption(step)`
    becomes `True` at the same step on every process. The loop below (save, then
    check) and Orbax's (check, then `save(..., force=True)` and stop) both stop
    at a saved step wherever the signal lands.
    `save(..., metadata={...})` keeps a JSON dict with the step (e.g. the data
    loader's position); `metadata(step)` reads it back.

    **Raises:**

    `ValueError`/`TypeError` for a `directory` that is a file, a `max_to_keep`
    below 1 or a `save_interval_steps` below 1.

    !!! Example

        ```python
        with ed.CheckpointManager("ckpt", max_to_keep=3, save_interval_steps=100,
                                  async_save=True) as manager:
            start = manager.latest_step() or 0
            if start:
                state = manager.restore(abstract_state)
            for step in range(start, num_steps):
                state, metrics = train_step(state, batches[step])
                manager.save(step + 1, state)
                if manager.reached_preemption(step + 1):
                    break  # saved above; exit with status 0, rerun to resume
        ```
    """

    @typecheck
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = False,
    ):
        caller = "CheckpointManager"
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(
                f"{caller}: `max_to_keep` must be >= 1 or None (keep all); got "
                f"{max_to_keep}."
            )
        if save_interval_steps < 1:
            raise ValueError(
                f"{caller}: `save_interval_steps` must be >= 1; got "
                f"{save_interval_steps}."
            )
        self.directory = Path(directory).absolute()
        files.check_root(self.directory, caller)
        self.save_interval_steps = save_interval_steps
        self._writer = Writer(
            self.directory,
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            async_save=async_save,
            caller=caller,
        )
        self._sigterm = threading.Event()
        self._previous_handler: Any = None
        self._preempted_at: int | None = None
        # The step of the latest `save` call if that call did not save: a signal
        # seen after it must not stop the loop at this (unsaved) step.
        self._unsaved_step: int | None = None
        self._closed = False
        if _uses_jax_preemption_service():
            self._record_resumed_step()
        elif threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _record_resumed_step(self) -> None:
        """Tell JAX's preemption sync point the step this run resumes from.

        JAX's protocol stops every process at one past the largest step any
        process last asked about, and a process that has asked nothing counts as
        step 0. A resumed run asks about its first step (`latest + 1`) only after
        restoring and compiling, which take the longest: a SIGTERM meanwhile set
        the stop at step 1, which the run had passed, and the run trained to its
        end without saving (seen in the test's SLURM-style segment under
        load). Asked `latest` now, on every process alike, the protocol stops
        them at `latest + 1`, the loop's first step. A notice that came before
        this manager opened has set the stop at step 1 on every process (none
        had asked about a step): asked about step 1 first, the manager sees it,
        and the loop stops at its first step too. Only before this process's
        loop asked about a step of its own (see `_ASKED_SYNC_POINT`)."""
        if _ASKED_SYNC_POINT.is_set():
            return
        sync, start = _jax.preemption_sync_manager(), self.latest_step() or 0
        if sync is None or start == 0:  # a fresh run asks about step 1 itself
            return
        if sync.reached_sync_point(1) or sync.reached_sync_point(start):
            self._preempted_at = start

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._sigterm.set()

    def request_preemption(self) -> None:
        """Act as if SIGTERM arrived (`train_loop` routes Ctrl-C here): the next
        `save` saves whatever the interval, and `reached_preemption` turns true
        at the step it saves. In a single process this manager's own flag; under
        `jax.distributed` a SIGTERM to this process, which JAX's preemption
        notifier catches and passes on, so that every process stops at the same
        step."""
        if _uses_jax_preemption_service():
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self._sigterm.set()

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise ValueError(
                f"CheckpointManager.{method}: the manager of {str(self.directory)!r} "
                "is closed; create a new one."
            )

    def _preemption_signalled(self, step: int) -> bool:
        """Whether the job is being preempted at `step` (the same step on every
        process under `jax.distributed`); stays `True` for later steps."""
        if self._preempted_at is not None and step >= self._preempted_at:
            return True
        if _uses_jax_preemption_service():
            _ASKED_SYNC_POINT.set()
            reached = bool(orbax().utils.reached_preemption(step))
        else:
            reached = self._sigterm.is_set()
        if reached:
            self._preempted_at = step
        return reached

    @typecheck
    def reached_preemption(self, step: int) -> bool:
        """Whether the job is being preempted and the loop should stop at `step`.

        `True` once any process received SIGTERM, unless this very `step` was
        already passed to `save` and not saved (the signal landed between the two
        calls). Either shape of loop then loses nothing and stops wherever the
        signal lands:

        - save, then check (`save(step, state)`; `if reached_preemption(step):
          break`): `save` saves whatever the interval once the signal is in, so
          the check is `True` right after a save. A signal that lands after a
          `save` that did not save leaves this step's check `False`; the loop
          trains one more step, which `save` saves, and stops there.
        - check, then save, Orbax's own shape (`if reached_preemption(step):
          save(step, state, force=True); break`, with or without a periodic
          `save` after the check): the check is `True` at the first step after
          the signal, and the loop saves that step itself.

        The step the loop stops at is the newest saved step, and a rerun resumes
        from it.

        It turns `True` at the same step on every process (JAX's preemption sync
        point under `jax.distributed`; the signal itself in a single process) and
        stays `True` for later steps. Call it at every step, from every process.
        """
        self._check_open("reached_preemption")
        step = check_step(step, "CheckpointManager.reached_preemption")
        if not self._preemption_signalled(step):
            return False
        # Every process passes the same steps to `save`, and `save` decides
        # alike on all of them, so this answer is the same on every process too.
        return self._unsaved_step != step

    @typecheck
    def save(
        self,
        step: int,
        state: PyTree[Any],
        *,
        force: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Save `state` as `step` if `step` is a multiple of `save_interval_steps`,
        `force` is set, or the job is being preempted (see `reached_preemption`).

        **Arguments:**

        - `step`, `state`: as for `save_checkpoint`.
        - `force`: save whatever the interval.
        - `metadata`: a JSON-serialisable dict saved with the step (the data
          loader's position, the configuration, ...), part of the same atomic
          commit and covered by the same checksums; `metadata(step)` reads it
          back. In a multi-process run process 0's is saved.

        **Returns:**

        Whether it saved. With `async_save=True` the files are still being written
        when it returns; a crash meanwhile leaves the earlier checkpoints intact.

        **Raises:**

        - `ValueError` if `step` is already saved in the directory (or another
          save of it finished first), or if `state` was consumed (donated) by an
          earlier train step.
        - `TypeError`/`ValueError` for `metadata` that JSON does not give back
          exactly (checked before anything is written).
        - The error of a save that failed (a full disk, a directory that cannot be
          written), with a note naming its step; an asynchronous save's error is
          raised by the next `save`, `wait_until_finished` or `close`. The failed
          save's temporary files are removed.
        """
        self._check_open("save")
        caller = "CheckpointManager.save"
        step = check_step(step, caller)
        check_not_consumed(state, caller)
        if metadata is not None:
            metadata = files.check_user_metadata(metadata, caller)
        # Orbax decides (interval, preemption under jax.distributed, nothing
        # newer than the latest step); the single-process SIGTERM is ours.
        preempted = self._preemption_signalled(step)
        if not (force or preempted or self._writer.should_save(step)):
            self._unsaved_step = step
            return False
        self._unsaved_step = None
        self._writer.save(step, state, caller, metadata)
        return True

    @typecheck
    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The `metadata` saved with `step` (default: the latest complete step);
        `{}` for a step saved without. Waits for pending saves first.

        **Raises:**

        - `CheckpointNotFoundError` if there is no such complete step.
        - `ValueError` naming the step if its files were changed after the save.
        """
        self._check_open("metadata")
        caller = "CheckpointManager.metadata"
        self._writer.wait(caller)
        complete = self.all_steps()
        if step is None and complete:
            step = complete[-1]
        elif step is not None:
            step = check_step(step, caller)
        if step is None or step not in complete:
            raise CheckpointNotFoundError(
                f"{caller}: no complete checkpoint of step {step} in "
                f"{str(self.directory)!r}; the complete steps are {complete}."
            )
        return files.user_metadata(self.directory / str(step), step, caller)

    @typecheck
    def restore(self, target: PyTree[Any], *, step: int | None = None) -> PyTree[Any]:
        """`restore_checkpoint(directory, target, step=step)`, once pending saves
        have finished."""
        self._check_open("restore")
        self._writer.wait("CheckpointManager.restore")
        return restore_checkpoint(self.directory, target, step=step)

    def latest_step(self) -> int | None:
        """The newest complete step, or `None`."""
        return latest_step(self.directory)

    def all_steps(self) -> list[int]:
        """Every complete step in the directory, in increasing order."""
        return files.complete_steps(self.directory)

    def wait_until_finished(self) -> None:
        """Block until the pending asynchronous save (if any) is committed; raise its
        error if it failed."""
        self._writer.wait("CheckpointManager.wait_until_finished")

    def close(self) -> None:
        """Wait for pending saves and release the manager (and the SIGTERM handler
        it installed). Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.wait("CheckpointManager.close")
        finally:
            self._writer.close()
            if self._previous_handler is not None:
                signal.signal(signal.SIGTERM, self._previous_handler)
