"""How `python -m eqxdist.launch` starts each process:

    python -u .../eqxdist/_launch/child.py SCRIPT ARGS...

runs SCRIPT exactly as `python SCRIPT ARGS...` would (same `sys.argv`, `__file__`,
`sys.path[0]` and tracebacks), except that once the process has joined a
multi-process run, a failing exit -- an uncaught exception or `sys.exit(n)` with
`n` non-zero -- ends it at once with that status. Python's normal exit would first
run the exit handlers, and JAX's waits in a barrier for the other processes, which
are stuck in a collective waiting for this one, so the launcher would never learn of
the failure.

It is run by path rather than with `-m`, and imports only the standard library, so
that nothing (eqxdist, JAX) is imported before the script's own first lines: a
script may set environment variables that JAX reads when it is imported.
"""

import builtins
import os
import runpy
import sys
import types
import zipfile
from importlib.machinery import SourceFileLoader
from typing import NoReturn


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
