"""One attempt at a launched run: start the processes, pass their output on, wait
for them, stop them all when one fails, hangs or the launcher is told to stop, and
say what happened in an `Outcome` (the command line and restarts are in `cli`)."""

import argparse
import contextlib
import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

from .._distributed import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV

# Read by the scripts: how many times the launcher has restarted the job.
RESTART_COUNT_ENV = "EQXDIST_RESTART_COUNT"
# The pipe on which a process hears that the launcher passed a SIGTERM on (`child`).
CONTROL_FD_ENV = "EQXDIST_LAUNCH_CONTROL_FD"
STOP_NOTICE = b"stop\n"
# Sent to a process that has not exited within `--exit-timeout`: `child` registers
# `faulthandler` for it, which prints every thread's Python stack to stderr from the
# signal handler itself (the process may be stuck in C code holding the GIL, where
# no Python thread could run). A real-time signal, because schedulers send SIGUSR1
# and SIGUSR2 to scripts that may handle them (SLURM's preemption warning).
STACKS_SIGNAL = signal.SIGRTMIN + 2
# How long a hung process is given to print its stacks before it is killed.
_STACKS_WAIT = 1.0

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
# gloo prints "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of
# connected peer ranks is : 7" per device whenever devices first talk to each
# other, from several threads at once (so lines arrive cut and mixed). A line made
# only of such pieces says nothing the user needs.
_GLOO_PIECES = re.compile(
    rb"^(?:\[Gloo\] Rank |\d+|is connected to|peer ranks\.|Expected number of "
    rb"connected peer ranks is :|\s)+$"
)
_PR_SET_PDEATHSIG = 1
# Runs each script as `python SCRIPT` would, but ends a failing process at once
# (`sys.exit(3)` included, which skips the exception hook `initialize_distributed`
# installs).
_CHILD = Path(__file__).with_name("child.py")
_WATCHDOG = Path(__file__).with_name("watchdog.py")
# Status of a run stopped because a process did not exit (as `timeout` uses).
HUNG_STATUS = 124


class Stopped(Exception):
    """The launcher itself was asked to stop (SIGTERM/SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended: the launcher's exit `status`, its last line
    (`summary`, empty after a success) and, when a restart may help, what failed."""

    status: int
    summary: str = ""
    failure: str | None = None


class StopRequest:
    """The first SIGTERM, SIGHUP or SIGINT the launcher receives. The signal
    handler (`handler`) only records it, and the launcher raises `Stopped` (or
    `KeyboardInterrupt` for SIGINT, as Python's own handler would) where that is
    safe (`check`, between waits): raised from the handler, the exception could
    land inside `queue.Queue.get` while it releases its lock, leaving the lock
    broken and a `RuntimeError` in place of the stop. Only the first signal
    counts: schedulers repeat SIGTERM (and `timeout`, `srun` pass theirs on), and a
    second one must not interrupt the launcher while it stops the run."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.raised = False

    def handler(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    def check(self) -> None:
        """Raise `Stopped` (`KeyboardInterrupt` for SIGINT) if a signal came and
        has not been raised yet."""
        if self.signum is not None and not self.raised:
            self.raised = True
            if self.signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Stopped(self.signum)


def _is_gloo_noise(line: bytes) -> bool:
    return (b"[Gloo] Rank" in line or b"peer ranks" in line) and bool(
        _GLOO_PIECES.match(line)
    )


def xla_flags_with_devices(flags: str, devices: int) -> str:
    """`flags` (an `XLA_FLAGS` value) with its CPU device count replaced by
    `devices`, every other flag kept: what a process the launcher starts gets."""
    kept = _DEVICE_COUNT_FLAG.sub("", flags).split()
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def child_env(
    port: int, num_processes: int, process_id: int, devices: int, restart: int = 0
) -> dict[str, str]:
    env = dict(os.environ)
    flags = xla_flags_with_devices(env.get("XLA_FLAGS", ""), devices)
    env.update(
        {
            COORDINATOR_ENV: f"127.0.0.1:{port}",
            NUM_PROCESSES_ENV: str(num_processes),
            PROCESS_ID_ENV: str(process_id),
            RESTART_COUNT_ENV: str(restart),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": flags,
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


def _give_time(procs: Sequence["subprocess.Popen[bytes]"], seconds: float) -> None:
    """Give `procs` up to `seconds` to exit: return once all have, or then."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.02)


def stop(
    procs: Sequence["subprocess.Popen[bytes]"],
    first: int,
    grace: float,
    notices: Sequence[int] = (),
) -> None:
    """Send `first` to every process group (and a stop notice down each pipe of
    `notices`), SIGKILL what is left after `grace`."""
    _signal_groups([p for p in procs if p.poll() is None], first)
    for fd in notices:
        with contextlib.suppress(OSError):  # that process has already ended
            os.write(fd, STOP_NOTICE)
    _give_time(procs, grace)
    # Also reaches grandchildren whose parent already exited.
    _signal_groups(procs, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def _status(returncode: int) -> int:
    # Killed by a signal: report it the way a shell does (128 + signal number).
    return 128 - returncode if returncode < 0 else returncode


def _some(indices: Sequence[int]) -> str:
    """`process 1` or `processes 0, 2`."""
    plural = "es" if len(indices) > 1 else ""
    return f"process{plural} {', '.join(map(str, indices))}"


class Job:
    """The processes of one attempt, the threads that pass their output on and the
    watchdog that stops them should the launcher be killed outright."""

    def __init__(
        self,
        args: argparse.Namespace,
        port: int,
        restart: int,
        stop_request: StopRequest | None = None,
    ):
        self.stop_request = stop_request or StopRequest()
        self.num_processes: int = args.num_processes
        self.command = [
            *(sys.executable, "-u", str(_CHILD), args.script),
            *args.script_args,
        ]
        self.env = [
            child_env(port, args.num_processes, i, args.devices_per_process, restart)
            for i in range(args.num_processes)
        ]
        self.exit_timeout: float = args.exit_timeout
        self.grace: float = args.grace_period
        self.procs: list[subprocess.Popen[bytes]] = []
        self.notices: list[int] = []  # write ends of the control pipes
        self.threads: list[threading.Thread] = []
        self.exits: queue.Queue[int] = queue.Queue()
        self.watchdog = subprocess.Popen(
            [sys.executable, str(_WATCHDOG)],
            stdin=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C in the terminal is for the launcher
        )

    def run(self) -> Outcome:
        """Start, wait, stop; the outcome's summary is printed last."""
        outcome = Outcome(1)  # an error in the launcher itself propagates
        try:
            outcome = self._start() or self._wait_for_exits()
        except KeyboardInterrupt:
            print("eqxdist.launch: interrupted; stopping.", file=sys.stderr, flush=True)
            stop(self.procs, signal.SIGINT, self.grace)
            outcome = Outcome(130, "interrupted (Ctrl-C); stopped every process.")
        except Stopped as stopped:
            outcome = self._stopped(stopped.signum)
        finally:
            self._close()
            if outcome.summary:
                print(f"eqxdist.launch: {outcome.summary}", file=sys.stderr, flush=True)
        return outcome

    def _start(self) -> Outcome | None:
        """Start every process and the threads that watch them; an `Outcome` if a
        process could not be started."""
        preexec = _die_with_parent_hook()
        for i in range(self.num_processes):
            read, write = os.pipe()
            self.notices.append(write)
            env = dict(self.env[i], **{CONTROL_FD_ENV: str(read)})
            try:
                proc = subprocess.Popen(
                    self.command,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=preexec,
                    pass_fds=(read,),
                )
            except OSError as e:
                stop(self.procs, signal.SIGKILL, 0.0)
                return Outcome(
                    1,
                    f"could not start process {i} of {self.num_processes} ({e}); "
                    "stopped the others. Run fewer processes.",
                )
            finally:
                os.close(read)
            self.procs.append(proc)
            watched = cast(IO[bytes], self.watchdog.stdin)
            watched.write(f"{proc.pid}\n".encode())
            watched.flush()
        self._watch()
        return None

    def _watch(self) -> None:
        stdout, stderr = sys.stdout.buffer, sys.stderr.buffer
        locks = {id(stdout): threading.Lock(), id(stderr): threading.Lock()}
        for i, proc in enumerate(self.procs):
            prefix = f"[{i}] ".encode()
            pipes = (cast(IO[bytes], proc.stdout), cast(IO[bytes], proc.stderr))
            for source, out in zip(pipes, (stdout, stderr), strict=True):
                self.threads.append(
                    threading.Thread(
                        target=_forward,
                        args=(source, out, prefix, locks[id(out)]),
                        daemon=True,
                    )
                )
            self.threads.append(
                threading.Thread(target=_wait, args=(proc, i, self.exits), daemon=True)
            )
        for thread in self.threads:
            thread.start()

    def _wait_for_exits(self) -> Outcome:
        """Wait until every process has exited with status 0, one fails, or one
        outlives the first exit by `exit_timeout`."""
        remaining = len(self.procs)
        first: tuple[int, int, float] | None = None  # index, status, time
        while remaining:
            self.stop_request.check()
            try:
                index = self.exits.get(timeout=0.1)
            except queue.Empty:
                if (
                    first is not None
                    and time.monotonic() - first[2] > self.exit_timeout
                ):
                    return self._hung(first[0], first[1])
                continue
            remaining -= 1
            code = _status(cast(int, self.procs[index].returncode))
            if first is None:
                first = (index, code, time.monotonic())
            if code != 0:
                return self._failed(index, code)
        stop(self.procs, signal.SIGKILL, 0.0)  # stray grandchildren only
        return Outcome(0)

    def _failed(self, index: int, code: int) -> Outcome:
        print(
            f"eqxdist.launch: process {index} exited with status {code}; "
            "stopping the others.",
            file=sys.stderr,
            flush=True,
        )
        # SIGKILL at once: the others cannot finish without this process, and JAX
        # catches SIGTERM (to let jobs checkpoint on preemption), so they would
        # only sit in a collective until killed.
        stop(self.procs, signal.SIGKILL, 0.0)
        others = [i for i in range(len(self.procs)) if i != index]
        summary = f"process {index} failed first (exit status {code})" + (
            f"; stopped {_some(others)}." if others else "."
        )
        return Outcome(code, summary, f"process {index} exited with status {code}")

    def _hung(self, first: int, code: int) -> Outcome:
        hung = [i for i, p in enumerate(self.procs) if p.poll() is None]
        # Where a process hangs is what the user needs to fix it: ask each for its
        # stacks (printed with its prefix, before the summary) before killing it.
        for i in hung:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[i].pid, STACKS_SIGNAL)
        _give_time(self.procs, _STACKS_WAIT)
        stop(self.procs, signal.SIGKILL, 0.0)
        late = f"{_some(hung)} did not exit within {self.exit_timeout:g} s"
        them, their = ("them", "their") if len(hung) > 1 else ("it", "its")
        summary = (
            f"{late} (--exit-timeout) of process {first}, which exited with status "
            f"{code}; killed {them} ({their} Python stacks are printed above)."
        )
        return Outcome(HUNG_STATUS, summary, f"{late} of process {first}")

    def _stopped(self, signum: int) -> Outcome:
        """The launcher received SIGTERM or SIGHUP: pass SIGTERM on (and the stop
        notice, see `child`), give the processes the grace period to exit."""
        stop(self.procs, signal.SIGTERM, self.grace, self.notices)
        name = signal.Signals(signum).name
        if self.procs and all(p.returncode == 0 for p in self.procs):
            # A preempted run that saved and stopped cleanly (see
            # `CheckpointManager.reached_preemption`) succeeded.
            return Outcome(0, f"received {name}; every process exited with status 0.")
        return Outcome(
            128 + signum, f"received {name}; passed it on and stopped every process."
        )

    def _close(self) -> None:
        if any(p.poll() is None for p in self.procs):  # an error in the launcher
            stop(self.procs, signal.SIGKILL, 0.0)
        for thread in self.threads:
            thread.join(timeout=5.0)
        for fd in self.notices:
            os.close(fd)
        with contextlib.suppress(OSError):
            # The watchdog kills what is left of every group.
            cast(IO[bytes], self.watchdog.stdin).close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.watchdog.wait(timeout=5.0)
