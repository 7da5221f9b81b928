"""How `python -m eqxdist.launch` starts each process:

    python -u .../eqxdist/_launch/child.py SCRIPT ARGS...

runs SCRIPT exactly as `python SCRIPT ARGS...` would (same `sys.argv`, `__file__`,
`sys.path[0]` and tracebacks), except that once the process has joined a
multi-process run, a failing exit -- an uncaught exception or `sys.exit(n)` with
`n` non-zero -- ends it at once with that status. Python's normal exit would first
run the exit handlers, and JAX's waits in a barrier for the other processes, which
are stuck in a collective waiting for this one, so the launcher would never learn of
the failure.

A process that outlives another's exit by `--exit-timeout` receives `STACKS_SIGNAL`
(a real-time signal) before it is killed; `faulthandler` is registered for it and
prints every thread's Python stack to stderr, so the user sees where it hung.

When the launcher passes a SIGTERM on, it also writes a stop notice down a pipe
(`EQXDIST_LAUNCH_CONTROL_FD`). Under `jax.distributed` JAX's own handler catches
SIGTERM (its preemption notice) and the script runs on until it asks the preemption
sync point; a script that never asks it would ignore the signal. So on the notice,
a process that is still alive although its script set no SIGTERM handler (JAX's
caught the signal) and that has not asked the sync point
(`jax.experimental.multihost_utils.reached_preemption_sync_point`, which
`CheckpointManager` and Orbax call; noted by wrapping it when it is imported) ends
at once with status 143, as SIGTERM ends a plain Python process.

It is run by path rather than with `-m`, and imports only the standard library, so
that nothing (eqxdist, JAX) is imported before the script's own first lines: a
script may set environment variables that JAX reads when it is imported.
"""

import builtins
import faulthandler
import functools
import os
import runpy
import signal
import sys
import threading
import types
import zipfile
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec, PathFinder, SourceFileLoader
from typing import Any, NoReturn

_CONTROL_FD_ENV = "EQXDIST_LAUNCH_CONTROL_FD"  # `job.CONTROL_FD_ENV`
_SYNC_POINT_MODULE = "jax.experimental.multihost_utils"
_SIGTERM_STATUS = 128 + signal.SIGTERM
_STACKS_SIGNAL = signal.SIGRTMIN + 2  # `job.STACKS_SIGNAL`
# Set once the script has asked JAX's preemption sync point.
_asked_sync_point = threading.Event()


def _in_multi_process_run() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and bool(jax.distributed.is_initialized())


def _exit_status(stop: SystemExit) -> int:
    # Python's own rule: `None` is success, an integer is the status, anything else
    # is printed and means failure.
    if stop.code is None:
        return 0
    return stop.code if isinstance(stop.code, int) else 1


def _run(script: str) -> None:
    path = os.path.abspath(script)
    if zipfile.is_zipfile(path):  # an application archive: runpy puts it on sys.path
        del sys.path[0]
        runpy.run_path(script, run_name="__main__")
        return
    if not sys.flags.safe_path:
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path,
        __cached__=None,
        __builtins__=builtins,
        __loader__=SourceFileLoader("__main__", path),
        __annotations__={},
    )
    sys.modules["__main__"] = main
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec")
    exec(code, main.__dict__)


class _SyncPointWatcher:
    """A meta path finder that wraps `reached_preemption_sync_point` as JAX's
    module is loaded, before anything can take a reference to it."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: object = None
    ) -> ModuleSpec | None:
        if name != _SYNC_POINT_MODULE:
            return None
        spec = PathFinder.find_spec(name, path)
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_wrap(module: types.ModuleType) -> None:
            exec_module(module)
            original = getattr(module, "reached_preemption_sync_point", None)
            if callable(original):
                vars(module)["reached_preemption_sync_point"] = _noting(original)

        loader.exec_module = exec_and_wrap
        return spec


def _noting(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reached_preemption_sync_point(*args: Any, **kwargs: Any) -> Any:
        _asked_sync_point.set()
        return original(*args, **kwargs)

    return reached_preemption_sync_point


def _listen_for_stop(fd: int) -> None:
    """Wait for the launcher's stop notice (it follows a SIGTERM); end the process
    if nothing in it will act on that SIGTERM."""
    with os.fdopen(fd, "rb", buffering=0) as control:
        if not control.readline():  # closed: the run is over
            return
    # Still alive with Python's default disposition: the signal was caught outside
    # Python (by JAX). Python's table is not updated when C code sets a handler.
    if _asked_sync_point.is_set() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        return  # a preemption loop, or a handler (or SIG_IGN) of the script's
    print(
        "eqxdist.launch: SIGTERM: this process does not handle preemption (it never "
        "asked JAX's preemption sync point, e.g. CheckpointManager."
        "reached_preemption), so it ends now.",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(_SIGTERM_STATUS)


def _start_listening() -> None:
    fd = os.environ.pop(_CONTROL_FD_ENV, None)
    if fd is None:  # started by hand, not by the launcher
        return
    os.set_inheritable(int(fd), False)  # not for the script's own subprocesses
    # The launcher sends it to a process that outlives the others' exit by
    # `--exit-timeout`, before killing it.
    faulthandler.register(_STACKS_SIGNAL, file=sys.stderr, all_threads=True)
    sys.meta_path.insert(0, _SyncPointWatcher())
    threading.Thread(target=_listen_for_stop, args=(int(fd),), daemon=True).start()


def _script_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """`tb` without this file's frames, so that a traceback starts in the script as
    it does under `python SCRIPT`."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _fail(status: int) -> NoReturn:
    """End a failing process: at once in a multi-process run, else the way Python
    ends one (exit handlers included)."""
    if not _in_multi_process_run():
        sys.exit(status)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status & 0xFF)


def main() -> None:
    script = sys.argv[1]
    del sys.argv[0]  # the script sees `sys.argv == [SCRIPT, *ARGS]`
    _start_listening()
    try:
        _run(script)
    except SystemExit as stop:
        status = _exit_status(stop)
        if status == 0 or not _in_multi_process_run():
            raise  # Python's normal exit, printing a text code itself
        if not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
        _fail(status)
    except BaseException as error:
        # In a multi-process run, the hook `initialize_distributed` installs exits
        # here.
        error = error.with_traceback(_script_frames(error.__traceback__))
        sys.excepthook(type(error), error, error.__traceback__)
        _fail(130 if isinstance(error, KeyboardInterrupt) else 1)


if __name__ == "__main__":
    main()
