"""Run a script as N cooperating JAX processes on this machine, each with its own CPU
devices: a local stand-in for a cluster's launcher (`srun`, `mpirun`, a TPU pod).

    python -m eqxdist.launch --num-processes 2 --devices-per-process 4 train.py

Each process gets `EQXDIST_COORDINATOR` (a free loopback port, or `--port`),
`EQXDIST_NUM_PROCESSES`, `EQXDIST_PROCESS_ID`, `JAX_PLATFORMS=cpu` and
`XLA_FLAGS=--xla_force_host_platform_device_count=D`; the script calls
`eqxdist.initialize_distributed()` to join the others. Output lines are prefixed with
the process index (`[0] ...`). When a process exits with a non-zero status the others
are killed at once and the launcher exits with that status. A process that has joined
the run ends at once when it fails (an uncaught exception, or `sys.exit(n)` with `n`
non-zero) instead of first waiting at its exit for the others, which wait for it.
Ctrl-C (or SIGTERM to the launcher) is passed on to the processes, which are killed
if still running `--grace-period` seconds later (default 30: time to save a
checkpoint on preemption); if they all exit with status 0, so does the launcher.
When a process has exited (even with status 0) and another has not
`--exit-timeout` seconds later (default 60), the rest are killed and the launcher
exits with status 124 naming the process that hung. The launcher's last line names
the first process that failed.

Runs are kept apart: a run holds its port (a lock per port, and the port must be
free of any listener) so that a second launcher on that port fails at once with an
error naming it, instead of joining the first run's coordinator. Every process the
scripts start is stopped with the run, also when the launcher itself is killed
outright (a parent-death signal for the scripts, and a watchdog process that kills
their process groups when the launcher's end of a pipe closes).
"""

import argparse
import contextlib
import ctypes
import fcntl
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, cast

from .._distributed import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV

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
_CHILD = Path(__file__).with_name("child.py")
_WATCHDOG = Path(__file__).with_name("watchdog.py")
# Status of a run stopped because a process did not exit (as `timeout` uses).
_HUNG_STATUS = 124
# File descriptors the launcher holds per process: two pipe ends it reads, and a
# margin for the three threads and Python itself.
_FDS_PER_PROCESS = 4
_FD_MARGIN = 64


class _Stopped(Exception):
    """The launcher itself was asked to stop (SIGTERM/SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _PortTaken(Exception):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _check_no_listener(port: int) -> None:
    """Raise `_PortTaken` if something listens on `port` (another run's JAX
    coordinator, any server). SO_REUSEADDR: a port left only in TIME_WAIT by an
    earlier run is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise _PortTaken(f"port {port} is in use ({e.strerror})") from None


def _hold_port(port: int) -> IO[bytes]:
    """Lock `port` for this run (released when the launcher exits, however it
    exits); `_PortTaken` if another launcher holds it or something listens on it.
    The coordinator only binds the port once process 0 has started JAX, seconds
    later: the lock keeps a second launcher out in between."""
    path = Path(tempfile.gettempdir()) / f"eqxdist-launch-port-{port}.lock"
    lock = open(path, "ab")  # noqa: SIM115 (held for the whole run)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise _PortTaken(
            f"port {port} is used by another eqxdist.launch run on this machine "
            f"(it holds {path})"
        ) from None
    try:
        _check_no_listener(port)
    except _PortTaken:
        lock.close()
        raise
    return lock


def _hold_free_port() -> tuple[int, IO[bytes]]:
    for _ in range(20):
        port = _free_port()
        with contextlib.suppress(_PortTaken):
            return port, _hold_port(port)
    raise RuntimeError("eqxdist.launch: found no free port on 127.0.0.1.")


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
    parser.add_argument(
        "--num-processes",
        "-n",
        type=int,
        required=True,
        help=f"number of processes, 1..{_max_processes()} on this machine",
    )
    parser.add_argument("--devices-per-process", "-d", type=int, default=1)
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="coordinator port on 127.0.0.1, 1..65535 (default: a free one); "
        "refused if another run or server uses it",
    )
    parser.add_argument(
        "--exit-timeout",
        type=float,
        default=60.0,
        help="once a process has exited, seconds the others get to exit before "
        "they are killed and the run fails naming them (default: 60)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="after Ctrl-C or SIGTERM, seconds the processes get to exit (e.g. to "
        "save a checkpoint on preemption) before they are killed (default: 30)",
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments for the script"
    )
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        parser.error(f"--num-processes must be >= 1, got {args.num_processes}")
    limit = _max_processes()
    if args.num_processes > limit:
        parser.error(
            f"--num-processes {args.num_processes} is more than this machine allows "
            f"the launcher ({limit}: open-file and process limits, `ulimit -n` and "
            "`ulimit -u`)"
        )
    if args.port is not None and not 1 <= args.port <= 65535:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if not args.exit_timeout > 0:
        parser.error(f"--exit-timeout must be > 0, got {args.exit_timeout}")
    if args.devices_per_process < 1:
        parser.error(
            f"--devices-per-process must be >= 1, got {args.devices_per_process}"
        )
    if args.grace_period < 0:
        parser.error(f"--grace-period must be >= 0, got {args.grace_period}")
    if not Path(args.script).is_file():
        parser.error(f"script {args.script!r} not found")
    return args


def _max_processes() -> int:
    """How many processes the launcher can run: it holds `_FDS_PER_PROCESS` file
    descriptors per process, and the user may only have so many processes."""
    import resource

    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = 4096
    if files != resource.RLIM_INFINITY:
        limit = min(limit, max(1, (files - _FD_MARGIN) // _FDS_PER_PROCESS))
    processes = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if processes != resource.RLIM_INFINITY:
        limit = min(limit, max(1, processes // 2))
    return limit


def _stop_once() -> Callable[[int, object], None]:
    """A handler that raises `_Stopped` the first time only: schedulers repeat
    SIGTERM (and `timeout`, `srun` pass theirs on), and a second one must not
    interrupt the launcher while it stops the run."""
    stopping = False

    def handler(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise _Stopped(signum)

    return handler


def _start_watchdog() -> "subprocess.Popen[bytes]":
    return subprocess.Popen(
        [sys.executable, str(_WATCHDOG)],
        stdin=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C in the terminal is for the launcher
    )


def _hung(procs: Sequence["subprocess.Popen[bytes]"]) -> list[int]:
    return [i for i, p in enumerate(procs) if p.poll() is None]


def _run(args: argparse.Namespace, port: int) -> int:
    command = [sys.executable, "-u", str(_CHILD), args.script, *args.script_args]
    stdout, stderr = sys.stdout.buffer, sys.stderr.buffer
    locks = {id(stdout): threading.Lock(), id(stderr): threading.Lock()}
    exits: queue.Queue[int] = queue.Queue()
    # Signal handlers can only be set from the main thread.
    handler = _stop_once()
    previous = (
        {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    preexec = _die_with_parent_hook()
    watchdog = _start_watchdog()
    watched = cast(IO[bytes], watchdog.stdin)
    procs: list[subprocess.Popen[bytes]] = []
    threads: list[threading.Thread] = []
    status = 0
    summary = ""  # the launcher's last line
    try:
        for i in range(args.num_processes):
            try:
                proc = subprocess.Popen(
                    command,
                    env=_child_env(
                        port, args.num_processes, i, args.devices_per_process
                    ),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            except OSError as e:
                status = 1
                summary = (
                    f"could not start process {i} of {args.num_processes} ({e}); "
                    "stopped the others. Run fewer processes."
                )
                _stop(procs, signal.SIGKILL, 0.0)
                return status
            procs.append(proc)
            watched.write(f"{proc.pid}\n".encode())
            watched.flush()
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
        first: tuple[int, int, float] | None = None  # index, status, time
        while remaining:
            try:
                index = exits.get(timeout=0.1)
            except queue.Empty:
                if first is not None and (
                    time.monotonic() - first[2] > args.exit_timeout
                ):
                    hung = _hung(procs)
                    status = _HUNG_STATUS
                    summary = (
                        f"process{'es' if len(hung) > 1 else ''} "
                        f"{', '.join(map(str, hung))} did not exit within "
                        f"{args.exit_timeout:g} s (--exit-timeout) of process "
                        f"{first[0]}, which exited with status {first[1]}; killed "
                        f"{'them' if len(hung) > 1 else 'it'}."
                    )
                    _stop(procs, signal.SIGKILL, 0.0)
                    break
                continue
            remaining -= 1
            code = _status(cast(int, procs[index].returncode))
            if first is None:
                first = (index, code, time.monotonic())
            if code != 0:
                status = code
                others = [i for i in range(len(procs)) if i != index]
                summary = f"process {index} failed first (exit status {code})" + (
                    f"; stopped process{'es' if len(others) > 1 else ''} "
                    f"{', '.join(map(str, others))}."
                    if others
                    else "."
                )
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
        summary = "interrupted (Ctrl-C); stopped every process."
    except _Stopped as stop:
        _stop(procs, signal.SIGTERM, args.grace_period)
        name = signal.Signals(stop.signum).name
        if all(p.returncode == 0 for p in procs):
            # A preempted run that saved and stopped cleanly (see
            # `CheckpointManager.reached_preemption`) succeeded.
            summary = f"received {name}; every process exited with status 0."
        else:
            status = 128 + stop.signum
            summary = f"received {name}; passed it on and stopped every process."
    finally:
        if any(p.poll() is None for p in procs):  # an error in the launcher itself
            _stop(procs, signal.SIGKILL, 0.0)
        for s, kept in previous.items():
            signal.signal(s, kept)
        for thread in threads:
            thread.join(timeout=5.0)
        with contextlib.suppress(OSError):
            watched.close()  # the watchdog kills what is left of every group
        with contextlib.suppress(subprocess.TimeoutExpired):
            watchdog.wait(timeout=5.0)
        if summary:
            print(f"eqxdist.launch: {summary}", file=sys.stderr, flush=True)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Launch the processes and wait for them; returns the exit status (0 if all
    succeeded, else the first non-zero one, 128 + N for a process killed by signal N,
    130 after Ctrl-C, 124 when a process did not exit within `--exit-timeout`, 2
    for bad arguments or a port in use)."""
    args = _parse(argv)
    try:
        if args.port is None:
            port, lock = _hold_free_port()
        else:
            port, lock = args.port, _hold_port(args.port)
    except _PortTaken as e:
        print(
            f"eqxdist.launch: {e}; pass another --port, or none to use a free one.",
            file=sys.stderr,
            flush=True,
        )
        return 2
    try:
        return _run(args, port)
    finally:
        lock.close()


if __name__ == "__main__":
    sys.exit(main())
