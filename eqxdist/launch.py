"""Run a script as N cooperating JAX processes on this machine, each with its own CPU
devices: a local stand-in for a cluster's launcher (`srun`, `mpirun`, a TPU pod).

    python -m eqxdist.launch --num-processes 2 --devices-per-process 4 train.py

Each process gets `EQXDIST_COORDINATOR` (a free loopback port),
`EQXDIST_NUM_PROCESSES`, `EQXDIST_PROCESS_ID`, `JAX_PLATFORMS=cpu` and
`XLA_FLAGS=--xla_force_host_platform_device_count=D`; the script calls
`eqxdist.initialize_distributed()` to join the others. Output lines are prefixed with
the process index (`[0] ...`). When a process exits with a non-zero status the others
are killed at once and the launcher exits with that status. A process that has joined
the run ends at once when it fails (an uncaught exception, or `sys.exit(n)` with `n`
non-zero) instead of first waiting at its exit for the others, which wait for it.
Ctrl-C (or SIGTERM to the launcher) is passed on to the processes, which are killed
if still running `--grace-period` seconds later.
"""

import argparse
import contextlib
import ctypes
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, NoReturn, cast

from ._distributed import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
# gloo prints "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of
# connected peer ranks is : 7" per device whenever devices first talk to each
# other, from several threads at once (so lines arrive cut and mixed). A line made
# only of such pieces says nothing the user needs.
_GLOO_PIECES = re.compile(
    rb"^(?:\[Gloo\] Rank |\d+|is connected to|peer ranks\.|Expected number of "
    rb"connected peer ranks is :|\s)+$"
)


def _is_gloo_noise(line: bytes) -> bool:
    return (b"[Gloo] Rank" in line or b"peer ranks" in line) and bool(
        _GLOO_PIECES.match(line)
    )


_PR_SET_PDEATHSIG = 1
# Runs each script as `python SCRIPT` would, but ends a failing process at once
# (`sys.exit(3)` included, which skips the exception hook `initialize_distributed`
# installs).
_CHILD = Path(__file__).with_name("_launch_child.py")


class _Stopped(Exception):
    """The launcher itself was asked to stop (SIGTERM/SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _child_env(
    port: int, num_processes: int, process_id: int, devices: int
) -> dict[str, str]:
    env = dict(os.environ)
    flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env.update(
        {
            COORDINATOR_ENV: f"127.0.0.1:{port}",
            NUM_PROCESSES_ENV: str(num_processes),
            PROCESS_ID_ENV: str(process_id),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join(flags),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A `preexec_fn` that makes Linux kill the child if the launcher is killed
    outright (SIGKILL, so it cannot clean up); `None` elsewhere."""
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork, not in the child

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return hook


def _forward(
    stream: IO[bytes], out: IO[bytes], prefix: bytes, lock: threading.Lock
) -> None:
    for line in iter(stream.readline, b""):
        if _is_gloo_noise(line):
            continue
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def _wait(
    proc: "subprocess.Popen[bytes]", index: int, exits: "queue.Queue[int]"
) -> None:
    proc.wait()
    exits.put(index)


def _signal_groups(procs: Sequence["subprocess.Popen[bytes]"], signum: int) -> None:
    # Each child leads its own process group, so this reaches its children too.
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)


def _stop(procs: Sequence["subprocess.Popen[bytes]"], first: int, grace: float) -> None:
    """Send `first` to every process group, SIGKILL what is left after `grace`."""
    _signal_groups([p for p in procs if p.poll() is None], first)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.02)
    # Also reaches grandchildren whose parent already exited.
    _signal_groups(procs, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def _status(returncode: int) -> int:
    # Killed by a signal: report it the way a shell does (128 + signal number).
    return 128 - returncode if returncode < 0 else returncode


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m eqxdist.launch",
        description=(
            "Run SCRIPT as NUM_PROCESSES JAX processes on this machine, each with "
            "DEVICES_PER_PROCESS CPU devices, wired together through a free loopback "
            "port. The script calls eqxdist.initialize_distributed() first."
        ),
    )
    parser.add_argument("--num-processes", "-n", type=int, required=True)
    parser.add_argument("--devices-per-process", "-d", type=int, default=1)
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="coordinator port on 127.0.0.1 (default: a free one)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=5.0,
        help="after Ctrl-C or SIGTERM, seconds the processes get to exit before "
        "they are killed (default: 5)",
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments for the script"
    )
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        parser.error(f"--num-processes must be >= 1, got {args.num_processes}")
    if args.devices_per_process < 1:
        parser.error(
            f"--devices-per-process must be >= 1, got {args.devices_per_process}"
        )
    if args.grace_period < 0:
        parser.error(f"--grace-period must be >= 0, got {args.grace_period}")
    if not Path(args.script).is_file():
        parser.error(f"script {args.script!r} not found")
    return args


def _raise_stopped(signum: int, frame: object) -> NoReturn:
    raise _Stopped(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Launch the processes and wait for them; returns the exit status (0 if all
    succeeded, else the first non-zero one, 128 + N for a process killed by signal N,
    130 after Ctrl-C)."""
    args = _parse(argv)
    port = _free_port() if args.port is None else args.port
    command = [sys.executable, "-u", str(_CHILD), args.script, *args.script_args]
    stdout, stderr = sys.stdout.buffer, sys.stderr.buffer
    locks = {id(stdout): threading.Lock(), id(stderr): threading.Lock()}
    exits: queue.Queue[int] = queue.Queue()
    # Signal handlers can only be set from the main thread.
    previous = (
        {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGHUP)}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    preexec = _die_with_parent_hook()
    procs: list[subprocess.Popen[bytes]] = []
    threads: list[threading.Thread] = []
    status = 0
    try:
        for i in range(args.num_processes):
            procs.append(
                subprocess.Popen(
                    command,
                    env=_child_env(
                        port, args.num_processes, i, args.devices_per_process
                    ),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            )
        for i, proc in enumerate(procs):
            prefix = f"[{i}] ".encode()
            pipes = (cast(IO[bytes], proc.stdout), cast(IO[bytes], proc.stderr))
            for source, out in zip(pipes, (stdout, stderr), strict=True):
                threads.append(
                    threading.Thread(
                        target=_forward,
                        args=(source, out, prefix, locks[id(out)]),
                        daemon=True,
                    )
                )
            threads.append(
                threading.Thread(target=_wait, args=(proc, i, exits), daemon=True)
            )
        for thread in threads:
            thread.start()
        remaining = len(procs)
        while remaining:
            try:
                index = exits.get(timeout=0.5)
            except queue.Empty:
                continue
            remaining -= 1
            code = procs[index].returncode
            if code != 0:
                status = _status(code)
                print(
                    f"eqxdist.launch: process {index} exited with status {status}; "
                    "stopping the others.",
                    file=sys.stderr,
                    flush=True,
                )
                # SIGKILL at once: the others cannot finish without this process,
                # and JAX catches SIGTERM (to let jobs checkpoint on preemption),
                # so they would only sit in a collective until killed.
                _stop(procs, signal.SIGKILL, 0.0)
                break
        else:
            _stop(procs, signal.SIGKILL, 0.0)  # stray grandchildren only
    except KeyboardInterrupt:
        print("eqxdist.launch: interrupted; stopping.", file=sys.stderr, flush=True)
        _stop(procs, signal.SIGINT, args.grace_period)
        status = 130
    except _Stopped as stop:
        _stop(procs, signal.SIGTERM, args.grace_period)
        status = 128 + stop.signum
    finally:
        if any(p.poll() is None for p in procs):  # an error in the launcher itself
            _stop(procs, signal.SIGKILL, 0.0)
        for s, handler in previous.items():
            signal.signal(s, handler)
        for thread in threads:
            thread.join(timeout=5.0)
    return status


if __name__ == "__main__":
    sys.exit(main())
