"""Writing checkpoints through Orbax's `CheckpointManager`, which does the saving,
the asynchronous writes, retention, save intervals and the preemption sync point.

eqxdist adds, by configuring it rather than by re-implementing any of that:

- a temporary directory per save (`<step>.orbax-checkpoint-tmp-<host>-<pid>-<hex>`,
  the same on every process of a run), so that two saves of one step never write
  into one directory;
- a lock on the directory from the check that the step is free to the commit
  (`files.DirectoryLock`), so that of two saves of one step the later one finds it
  saved and gets a clear error instead of Orbax deleting and replacing it; where
  no lock can be taken, the first to commit wins and the other gets a clear error;
- the marker with the checksums, written into the temporary directory just before
  Orbax's atomic rename (see `files`);
- a step listing that only counts our complete steps (so odd entries under the
  directory are never steps, and retention never deletes them).
"""

import importlib
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import jax
import numpy as np
from jax.experimental import multihost_utils

from .._utils import check_array_leaves, is_array, is_key_array, path_str
from . import files

_TOKEN_BYTES = 512


def orbax() -> Any:
    # Imported on first use: Orbax takes a second or two to import, and most
    # programs that import eqxdist never save a checkpoint.
    import orbax.checkpoint as ocp

    return ocp


class SaveCollisionError(ValueError):
    """Another save of the same step committed first."""


def _agreed_token() -> str:
    """A name for this save's temporary directory, the same on every process:
    process 0's host and pid (so a later manager can tell a dead save's leftover)
    and a random part (so two saves never share it)."""
    token = f"{files.host_name()}-{os.getpid()}-{secrets.token_hex(6)}"
    if jax.process_count() == 1:
        return token
    # Every process saves, in the same order, so all of them reach this collective.
    raw = np.zeros(_TOKEN_BYTES, np.uint8)
    encoded = token.encode()[:_TOKEN_BYTES]
    raw[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    agreed = np.asarray(multihost_utils.broadcast_one_to_all(raw))
    return bytes(agreed).rstrip(b"\0").decode()


class _Current:
    """The save being started (read by `TemporaryPath.from_final`, which Orbax may
    call from a thread of its own). One at a time: `_current_lock`."""

    root: Path | None = None
    token: str = ""
    metadata: dict[str, Any] | None = None
    lock: files.DirectoryLock | None = None


_current = _Current()
_current_lock = threading.Lock()


def _temporary_path_class() -> Any:
    base: Any = orbax().path.atomicity.AtomicRenameTemporaryPath

    class TemporaryPath(base):  # type: ignore[misc]
        """Orbax's atomic rename, into a temporary directory of this save's own,
        with our marker written into it just before the rename."""

        marker: dict[str, Any] | None = None
        lock: files.DirectoryLock | None = None

        @classmethod
        def from_final(cls, final_path: Any, **kwargs: Any) -> Any:
            root = _current.root
            if root is None or Path(final_path).parent != root:
                return super().from_final(final_path, **kwargs)  # an item directory
            step = int(Path(final_path).name)
            tmp = root / files.temporary_name(step, _current.token)
            path = cls(type(final_path)(tmp), final_path, **kwargs)
            path.marker, path.lock = _current.metadata, _current.lock
            return path

        async def finalize(self) -> None:
            if self.marker is None:
                await super().finalize()
                return
            try:
                await self._commit(self.marker)
            finally:
                if self.lock is not None:
                    self.lock.release()  # the step is visible (or failed): next!

        async def _commit(self, marker: dict[str, Any]) -> None:
            tmp, final = Path(self.get()), Path(self.get_final())
            files.write_marker(tmp, marker)
            leftover = final.is_dir() and not final.is_symlink()
            if leftover and files.step_of(final) is None:
                files.remove(final)  # an interrupted v0.1 save of this step
            try:
                await super().finalize()
            except OSError as e:
                if not files.is_collision(e):
                    raise
                raise SaveCollisionError(
                    f"checkpoint step {final.name} in {str(final.parent)!r} was saved "
                    "at the same time by another save, which finished first; this "
                    "save was discarded and the step holds the other save's state, "
                    "whole."
                ) from None
            files.fsync_directory(final.parent)

    return TemporaryPath


class _StepNames:
    """Orbax's step naming (`str(step)`), listing only our complete steps."""

    def build_name(self, step: int) -> str:
        return str(step)

    def find_all(self, base_path: Any) -> Iterator[Any]:
        step_lib = orbax().path.step
        for step in files.complete_steps(Path(base_path)):
            yield step_lib.Metadata(step=step, path=base_path / str(step))

    def find_step(self, base_path: Any, step: int) -> Any:
        if step not in files.complete_steps(Path(base_path)):
            raise ValueError(f"No complete checkpoint of step {step} in {base_path}.")
        return orbax().path.step.Metadata(step=step, path=base_path / str(step))


def _savable(x: Any) -> Any:
    """`x` as Orbax should write it: a global `jax.Array` as it is (every process
    writes its own shards); anything else (NumPy values, in a multi-process run also
    arrays on this process's devices only) as a host value, written by process 0."""
    if isinstance(x, jax.Array) and (
        jax.process_count() == 1 or not x.is_fully_addressable
    ):
        return x
    return np.asarray(x)


def flatten(
    state: Any, step: int, caller: str, user_metadata: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arrays Orbax writes (`leaf0`, `leaf1`, ...) and the marker's contents."""
    check_array_leaves(state, caller, "state")
    entries: list[dict[str, Any]] = []
    arrays: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not is_array(leaf):
            continue
        entry: dict[str, Any] = {
            "path": path_str(path),
            "shape": list(leaf.shape),
            "dtype": str(leaf.dtype),
        }
        if is_key_array(leaf):
            # Orbax stores numbers: keep the key's bits and its implementation.
            entry["prng_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
            entry["key_data_shape"] = list(leaf.shape)
        arrays[f"leaf{len(entries)}"] = _savable(leaf)
        entries.append(entry)
    metadata = {
        "format": files.FORMAT,
        "version": files.VERSION,
        "step": step,
        "process_count": jax.process_count(),
        "leaves": entries,
        "metadata": user_metadata,
    }
    return arrays, metadata


def check_step(step: Any, caller: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise TypeError(
            f"{caller}: `step` must be an int; got {step!r} of type "
            f"{type(step).__name__}."
        )
    if step < 0:
        raise ValueError(f"{caller}: `step` must be >= 0; got {step}.")
    return int(step)


class Writer:
    """One Orbax `CheckpointManager` on `root`, configured as described above."""

    def __init__(
        self,
        root: Path,
        *,
        max_to_keep: int | None,
        save_interval_steps: int,
        async_save: bool,
        caller: str,
    ):
        ocp = orbax()
        policies = ocp.checkpoint_managers
        self.root = root
        if jax.process_index() == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(
                    f"{caller}: cannot create the checkpoint directory "
                    f"{str(root)!r}: {e.strerror or e}. Pass a directory that can "
                    "be created and written."
                ) from None
            for leftover in files.leftovers(root):
                files.remove(leftover)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_decision_policy=policies.AnySavePolicy(
                [
                    policies.FixedIntervalPolicy(save_interval_steps),
                    policies.PreemptionCheckpointingPolicy(),
                ]
            ),
            step_name_format=_StepNames(),
            temporary_path_class=_temporary_path_class(),
            enable_async_checkpointing=async_save,
            # Orbax's own clean-up removes every temporary directory, a concurrent
            # save's included; `files.leftovers` only takes those of dead saves.
            cleanup_tmp_directories=False,
            save_root_metadata=False,
        )
        self.manager = ocp.CheckpointManager(root, options=options)
        # The pending save's step, token and Orbax operation id.
        self._last: tuple[int, str, str] | None = None
        # Held by process 0 from a save's check until its commit (or failure).
        self._lock: files.DirectoryLock | None = None

    def should_save(self, step: int) -> bool:
        return bool(self.manager.should_save(step))

    def check_can_save(self, step: int, caller: str) -> None:
        files.check_root(self.root, caller)
        target = self.root / str(step)
        if files.step_of(target) is not None:
            raise ValueError(
                f"{caller}: step {step} is already saved in {str(target)!r}; save "
                "under another step, or delete that directory first."
            )
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            raise ValueError(
                f"{caller}: {str(target)!r} exists and is not a checkpoint directory "
                "(a file or a symlink); remove it or save under another step."
            )

    def save(
        self,
        step: int,
        state: Any,
        caller: str,
        user_metadata: dict[str, Any] | None = None,
    ) -> None:
        """Start saving `state` as `step` (all processes, same order); returns when
        Orbax's `save` does (at once for async saves, once committed otherwise)."""
        ocp = orbax()
        self.check_can_save(step, caller)  # early, before any work
        arrays, metadata = flatten(state, step, caller, user_metadata or {})
        # An earlier asynchronous save's failure is reported as its own.
        self.wait(caller)
        if jax.process_index() == 0:
            self._lock = files.DirectoryLock(self.root)
        try:
            # Again, under the lock: another run may have committed the step
            # since, and Orbax would delete it (see `files.DirectoryLock`).
            self.check_can_save(step, caller)
            token = _agreed_token()
        except BaseException:
            self._release()
            raise
        with _current_lock:
            _current.root, _current.token = self.root, token
            _current.metadata, _current.lock = metadata, self._lock
            try:
                self.manager.save(step, args=ocp.args.PyTreeSave(arrays), force=True)
            except BaseException as e:
                self._fail(e, caller, (step, token, _operation_id()))
            finally:
                _current.root, _current.metadata, _current.lock = None, None, None
        self._last = (step, token, _operation_id())

    def wait(self, caller: str) -> None:
        """Wait for the pending save; if it failed, clean up after it and raise."""
        try:
            self.manager.wait_until_finished()
        except BaseException as e:
            self._fail(e, caller, self._last)
        self._last = None
        self._release()  # the commit released it; this covers a skipped one

    def close(self) -> None:
        try:
            self.manager.close()
        finally:
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _fail(
        self, error: BaseException, caller: str, save: tuple[int, str, str] | None
    ) -> NoReturn:
        """Release what the failed `save` holds: Orbax's threads waiting for it
        (they keep the process from exiting) and its temporary directory."""
        self._last = None
        self._release()
        if save is None:
            self._reraise(error, caller)
        step, token, operation = save
        _release_waiting_threads(operation)
        if jax.process_index() == 0:
            files.remove(self.root / files.temporary_name(step, token))
        if not isinstance(error, SaveCollisionError):
            error.add_note(
                f"{caller}: saving step {step} in {str(self.root)!r} failed; the "
                "step was not saved (earlier steps are intact)."
            )
        self._reraise(error, caller)

    @staticmethod
    def _reraise(error: BaseException, caller: str) -> NoReturn:
        if isinstance(error, SaveCollisionError):
            raise SaveCollisionError(f"{caller}: {error}") from None
        raise error


def _orbax_futures(module: str) -> Any:
    """A module of Orbax's internal `futures` package (its signalling threads), or
    `None` in a version that lays it out otherwise."""
    try:
        return importlib.import_module(f"orbax.checkpoint._src.futures.{module}")
    except ImportError:
        return None


def _operation_id() -> str:
    """Orbax's id of the save it started last (its signals are named by it)."""
    synchronization = _orbax_futures("synchronization")
    generator = getattr(synchronization, "OperationIdGenerator", None)
    if generator is None:
        return ""
    return str(generator.get_current_operation_id())


def _release_waiting_threads(operation: str) -> None:
    """Orbax's background threads of a save wait for signals from each other (up to
    `coordination_timeout`, 5 minutes) and a part that fails sends none, so its
    waiting threads would hold the process at exit: cancel them and send what they
    wait for."""
    future = _orbax_futures("future")
    thread_class = getattr(future, "_SignalingThread", None)
    if future is None or thread_class is None or not operation:
        return
    for thread in threading.enumerate():
        if (
            isinstance(thread, thread_class)
            and thread.is_alive()
            and getattr(thread, "_operation_id", None) == operation
        ):
            thread.cancel()
            future.set_signals(thread._receive_signals, operation_id=operation)
