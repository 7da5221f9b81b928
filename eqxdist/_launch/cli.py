"""Run a script as N cooperating JAX processes on this machine, each with its own CPU
devices: a local stand-in for a cluster's launcher (`srun`, `mpirun`, a TPU pod).

    python -m eqxdist.launch --num-processes 2 --devices-per-process 4 train.py

Each process gets `EQXDIST_COORDINATOR` (a free loopback port, or `--port`),
`EQXDIST_NUM_PROCESSES`, `EQXDIST_PROCESS_ID`, `EQXDIST_RESTART_COUNT`,
`JAX_PLATFORMS=cpu` and `XLA_FLAGS=--xla_force_host_platform_device_count=D`; the
script calls `eqxdist.initialize_distributed()` to join the others. Output lines are
prefixed with the process index (`[0] ...`). When a process exits with a non-zero
status the others are killed at once and the launcher exits with that status. A
process that has joined the run ends at once when it fails (an uncaught exception,
or `sys.exit(n)` with `n` non-zero) instead of first waiting at its exit for the
others, which wait for it. When a process has exited (even with status 0) and
another has not `--exit-timeout` seconds later (default 60), each of the rest prints
its threads' Python stacks (where it hangs), is killed, and the launcher exits with
status 124 naming the process that hung. The launcher's last line names the first
process that failed.

Signals to the launcher:

- SIGTERM or SIGHUP: passed on to every process as SIGTERM (the preemption notice
  JAX and `CheckpointManager` listen for). A process that handles it -- one whose
  script set a SIGTERM handler of its own, or that has asked JAX's preemption sync
  point (`CheckpointManager.reached_preemption`, Orbax) -- gets `--grace-period`
  seconds (default 30) to save and exit. A process that does not handle it ends at
  once: with Python's default disposition the signal kills it, and in a script
  under `jax.distributed` that never asked the sync point (JAX's own handler would
  swallow the signal) the launcher's wrapper ends it with status 143. If every
  process then exits with status 0 (a preempted run that saved), the launcher exits
  0; otherwise it exits with 128 + the signal it received (143, 129), and whatever
  still runs after the grace period is killed.
- Ctrl-C (SIGINT): passed on as SIGINT, the same grace period, then status 130.
- A signal to the launcher also stops `--max-restarts`: nothing is restarted.

`--max-restarts N` (default 0): after a failed attempt (a process exited with a
non-zero status, or hung), the whole job is started again -- every process, on a
fresh port with a fresh coordinator -- up to N times, so a script that resumes from
its latest checkpoint recovers by itself. Each restart prints
`eqxdist.launch: restart 1 of N after process 1 exited with status 3.`, and the
scripts see the attempt in `EQXDIST_RESTART_COUNT` (0 for the first). A run whose
processes all exit with 0 (finished, or preempted and saved) is not restarted; after
the last allowed attempt the launcher exits with that attempt's status.

Runs are kept apart: a run holds its port (a lock per port, and the port must be
free of any listener) so that a second launcher on that port fails at once with an
error naming it, instead of joining the first run's coordinator. Every process the
scripts start is stopped with the run, also when the launcher itself is killed
outright (a parent-death signal for the scripts, and a watchdog process that kills
their process groups when the launcher's end of a pipe closes).
"""

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from .job import Job, Outcome, Stopped, StopRequest
from .ports import PortTaken, hold

# File descriptors the launcher holds per process: three pipe ends (output, errors,
# stop notices), and a margin for the three threads and Python itself.
_FDS_PER_PROCESS = 5
_FD_MARGIN = 64


def _parser() -> argparse.ArgumentParser:
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
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="after a failure, start the whole job again (every process, a fresh "
        "coordinator) up to this many times; the scripts see the count in "
        "EQXDIST_RESTART_COUNT (default: 0)",
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments for the script"
    )
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _parser()
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
    if args.max_restarts < 0:
        parser.error(
            f"--max-restarts must be >= 0 (0: never restart), got {args.max_restarts}"
        )
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


@contextlib.contextmanager
def _stop_signals() -> Iterator[StopRequest]:
    """SIGTERM and SIGHUP are recorded in the `StopRequest` yielded while the
    launcher runs, which raises `Stopped` (once) at its next check; so is SIGINT
    where Python's own handler would raise `KeyboardInterrupt` (not where the
    launcher was started with SIGINT ignored), and the check raises that. Signal
    handlers can only be set from the main thread."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    handler = request.handler
    signums = [signal.SIGTERM, signal.SIGHUP]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signums.append(signal.SIGINT)
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield request
    finally:
        for s, kept in previous.items():
            signal.signal(s, kept)


def _attempt(
    args: argparse.Namespace, restart: int, stop_request: StopRequest
) -> Outcome:
    """Run the job once on a port of its own (a fresh coordinator each time)."""
    try:
        port, lock = hold(args.port)
    except PortTaken as e:
        print(
            f"eqxdist.launch: {e}; pass another --port, or none to use a free one.",
            file=sys.stderr,
            flush=True,
        )
        return Outcome(2)
    try:
        return Job(args, port, restart, stop_request).run()
    finally:
        lock.close()


def _run_with_restarts(args: argparse.Namespace, stop_request: StopRequest) -> int:
    restart = 0
    while True:
        stop_request.check()  # a signal between attempts: no restart
        outcome = _attempt(args, restart, stop_request)
        if outcome.failure is None or restart == args.max_restarts:
            return outcome.status
        restart += 1
        print(
            f"eqxdist.launch: restart {restart} of {args.max_restarts} after "
            f"{outcome.failure}.",
            file=sys.stderr,
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Launch the processes and wait for them; returns the exit status (0 if all
    succeeded, else the first non-zero one, 128 + N for a process killed by signal N,
    130 after Ctrl-C, 128 + N after signal N to the launcher unless every process
    then exited with 0, 124 when a process did not exit within `--exit-timeout`, 2
    for bad arguments or a port in use). With `--max-restarts`, the status of the
    last attempt."""
    args = _parse(argv)
    try:
        with _stop_signals() as stop_request:
            return _run_with_restarts(args, stop_request)
    except KeyboardInterrupt:  # between two attempts: nothing is running
        print("eqxdist.launch: interrupted; not restarting.", file=sys.stderr)
        return 130
    except Stopped as stopped:
        name = signal.Signals(stopped.signum).name
        print(f"eqxdist.launch: received {name}; not restarting.", file=sys.stderr)
        return 128 + stopped.signum


if __name__ == "__main__":
    sys.exit(main())
