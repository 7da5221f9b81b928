"""Run scripts each in a fresh Python process, without paying each one's start:
`python fresh_pythons.py < runs` imports eqxdist (so JAX and Equinox) once, before
JAX starts a backend, then forks one child per line of stdin, a JSON list `[out,
script, *args]`. The child runs `python script *args` as Python would (`sys.argv`,
`sys.path[0]` the script's folder, `__name__ == "__main__"`, a namespace of its own),
its output (stdout and stderr) to the file `out`; the parent prints one JSON line
per run, `{"out": ..., "status": ...}`, in order. Tests call `run_fresh`.

A child is as fresh as a new interpreter for what the tests check with it (a docs
page's set-up, an example's `--help` and argument errors): no JAX backend (so no
devices) exists yet, no `XLA_FLAGS` is set (the caller leaves them out), and the
script's own imports must bind every name it uses. What it saves is the
interpreter's start and the imports, about 2 s per run."""

import json
import os
import runpy
import subprocess
import sys
import threading
import traceback
from pathlib import Path

from stated_output import readers_env

ROOT = Path(__file__).resolve().parent.parent


def run_fresh(runs: list[list[str]], folder: Path) -> list[tuple[int, str]]:
    """`python *run` for each of `runs` (a script and its arguments), each in a
    fresh Python as described above, from the repository root, in a reader's
    environment (`stated_output.readers_env`); each run's exit status and output
    (stdout then stderr, as written), its output file in `folder`."""
    outs = [str(folder / f"run_{i}.out") for i in range(len(runs))]
    ran = subprocess.run(
        [sys.executable, __file__],
        cwd=ROOT,
        env=readers_env(),
        input="".join(
            json.dumps([o, *r]) + "\n" for o, r in zip(outs, runs, strict=True)
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    status = {r["out"]: r["status"] for r in map(json.loads, ran.stdout.splitlines())}
    return [(status[o], Path(o).read_text()) for o in outs]


def _child(out: str, argv: list[str]) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    status = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:  # as the interpreter ends on it
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no atexit handlers of the parent's, no pytest


def main() -> None:
    import eqxdist  # noqa: F401  (imported once, for every child)
    from eqxdist._jax import backends_are_initialized

    # Forking is safe only while this process runs one thread and no backend
    # exists (a backend's threads would not survive into the children).
    assert threading.active_count() == 1, threading.enumerate()
    assert not backends_are_initialized()
    for line in sys.stdin:
        if not line.strip():
            continue
        out, *argv = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(out, argv)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"out": out, "status": code}), flush=True)


if __name__ == "__main__":
    main()
