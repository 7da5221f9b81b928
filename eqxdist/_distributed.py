"""Multi-process start-up: joining JAX's multi-controller runtime (`jax.distributed`)
under `eqxdist.launch` or on a cluster JAX can detect; a barrier between processes."""

import atexit
import os
import sys
from types import TracebackType

import jax
from jax.experimental import multihost_utils

from ._jax import cluster_types, distributed_client
from ._utils import typecheck

# The environment `eqxdist.launch` gives each process (and that users may set by hand
# on a cluster JAX cannot detect).
COORDINATOR_ENV = "EQXDIST_COORDINATOR"
NUM_PROCESSES_ENV = "EQXDIST_NUM_PROCESSES"
PROCESS_ID_ENV = "EQXDIST_PROCESS_ID"
_LAUNCH_ENV = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)


def _env_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"initialize_distributed: environment variable {name}={value!r} is not an "
            "integer."
        ) from None


def _check_coordinator(coordinator: str) -> str:
    """`host:port` (`[v6 address]:port` too), the port in 1..65535."""
    host, colon, port = coordinator.strip().rpartition(":")
    problem = None
    if not colon or not host or host in ("[]",):
        problem = "has no host"
    elif not port.isascii() or not port.isdigit():
        problem = f"has port {port!r}, not a number"
    elif not 1 <= int(port) <= 65535:
        problem = f"has port {port}, outside 1..65535"
    elif any(c.isspace() for c in host) or "/" in host:
        problem = f"has host {host!r}, not a host name or address"
    if problem is not None:
        raise ValueError(
            f"initialize_distributed: {COORDINATOR_ENV}={coordinator!r} {problem}; "
            "expected 'host:port', e.g. '127.0.0.1:12355'."
        )
    return coordinator.strip()


def _launch_settings() -> tuple[str, int, int] | None:
    """(coordinator, num_processes, process_id) from the `EQXDIST_*` variables, or
    `None` when none of them is set."""
    present = {name: os.environ[name] for name in _LAUNCH_ENV if name in os.environ}
    if not present:
        return None
    missing = [name for name in _LAUNCH_ENV if name not in present]
    if missing:
        raise ValueError(
            f"initialize_distributed: {sorted(present)} set but {missing} not; set all "
            f"of {list(_LAUNCH_ENV)} (as `python -m eqxdist.launch` does) or none."
        )
    coordinator = _check_coordinator(present[COORDINATOR_ENV])
    num = _env_int(NUM_PROCESSES_ENV, present[NUM_PROCESSES_ENV])
    pid = _env_int(PROCESS_ID_ENV, present[PROCESS_ID_ENV])
    if num < 1 or not 0 <= pid < num:
        raise ValueError(
            f"initialize_distributed: need {NUM_PROCESSES_ENV} >= 1 and 0 <= "
            f"{PROCESS_ID_ENV} < {NUM_PROCESSES_ENV}; got {num} and {pid}."
        )
    return coordinator, num, pid


def detected_cluster() -> str | None:
    """The name of the multi-process cluster environment JAX detects here (SLURM with
    several tasks, Open MPI, Cloud TPU pods, Kubernetes jobs), or `None`.

    This is the same search `jax.distributed.initialize()` does without arguments;
    an environment reporting a single process counts as none, so a plain
    `python train.py` inside a one-task allocation stays a plain process."""
    # Reading JAX's own registry of detectors means eqxdist recognises exactly
    # the clusters `jax.distributed.initialize()` would.
    for env in cluster_types():
        # Opt-in detectors (mpi4py) only run when asked for by name.
        if env.opt_in_only_method or not env.is_env_present():
            continue
        if env.get_process_count() > 1:
            name: str = env.__name__
            return name
    return None


_exit_hooks_installed = False


def _use_gloo_on_cpu() -> None:
    # Cross-process collectives between CPU devices need an implementation; keep one
    # the user chose (e.g. "mpi"), otherwise use gloo, which needs nothing installed.
    if getattr(jax.config, "jax_cpu_collectives_implementation", None) is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _exit_at_once_on_uncaught_exception() -> None:
    # After an uncaught exception, Python's exit runs JAX's `distributed.shutdown`,
    # which waits in a barrier for every other process -- up to 5 minutes, since the
    # others are stuck in a collective waiting for this one. Print the traceback and
    # leave straight away instead, so launchers and schedulers see the failure.
    previous = sys.excepthook

    def hook(
        kind: type[BaseException], error: BaseException, tb: TracebackType | None
    ) -> None:
        previous(kind, error, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = hook


# How long a process at its normal exit waits for the others to reach theirs.
_EXIT_WAIT_SECONDS = 30


def _drain_before_exit() -> None:
    # Runs before JAX's own exit handler (atexit is last-in, first-out). Steps are
    # dispatched asynchronously: a script may end while collectives are still
    # queued, and tearing the runtime down under them leaves the other processes
    # spinning forever. A last collective on every device drains those queues.
    # It runs only once every process is here: this may also be a failing process
    # (`sys.exit(3)` skips the exception hook; `eqxdist.launch` catches it, other
    # launchers do not) whose peers are stuck in a collective waiting for it, and a
    # collective would then wait for them without end. The coordinator's barrier
    # gives up instead.
    client = distributed_client()
    if client is not None:
        try:
            client.wait_at_barrier("eqxdist_exit", _EXIT_WAIT_SECONDS * 1000)
        except jax.errors.JaxRuntimeError:
            print(
                f"eqxdist: process {jax.process_index()}: the processes did not all "
                f"reach their exit within {_EXIT_WAIT_SECONDS} s of each other (one "
                "failed, waits for another or is slow); exiting without the final "
                "drain.",
                file=sys.stderr,
                flush=True,
            )
            return
    barrier("eqxdist_exit")


@typecheck
def initialize_distributed() -> None:
    """Join the other processes of a multi-process run; call it first thing in a
    script, before anything else touches JAX.

    - Under `python -m eqxdist.launch` (the `EQXDIST_COORDINATOR`,
      `EQXDIST_NUM_PROCESSES` and `EQXDIST_PROCESS_ID` environment variables are
      set), calls `jax.distributed.initialize` with those values.
    - On a cluster JAX detects itself (SLURM with several tasks, Open MPI, Cloud TPU
      pods, Kubernetes jobs), calls `jax.distributed.initialize()` and lets JAX read
      the cluster's settings.
    - Otherwise (a plain single process) does nothing, and in particular does not
      start JAX's backend.

    If `jax.distributed` is already initialised (you called
    `jax.distributed.initialize` yourself), that is kept and only the exit
    behaviours below are added.

    CPU devices talk to other processes through gloo (unless
    `jax_cpu_collectives_implementation` is already set). Afterwards
    `jax.devices()` lists every process's devices, so meshes span all of them.

    In a multi-process run it also registers two exit behaviours:

    - an uncaught exception ends the process right after its traceback is printed
      (exit status 1), instead of waiting up to 5 minutes in JAX's shutdown barrier
      for processes that will never get there; the launcher or scheduler then
      stops the others;
    - a normal exit first waits for every process's queued computations (one last
      collective), so a script may end without blocking on its last step's
      results. That collective runs only once every process has reached its
      exit; when they do not all get there within 30 s of each other, it is
      skipped (this process may be the failing one: the hook above does not see
      `sys.exit(n)`, which only `eqxdist.launch` turns into an immediate exit).

    **Raises:**

    `ValueError` if the `EQXDIST_*` variables are only partly set or malformed.

    !!! Example

        ```python
        import eqxdist as ed

        ed.initialize_distributed()  # no-op when run as plain `python train.py`
        mesh = ed.create_data_parallel_mesh()  # all devices of all processes
        ```
    """
    launch = _launch_settings()
    if jax.distributed.is_initialized():
        pass  # by the user, say with their own arguments: keep that
    elif launch is not None:
        coordinator, num_processes, process_id = launch
        _use_gloo_on_cpu()
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            # Listen only where we were told to (loopback under the launcher),
            # not on every interface.
            coordinator_bind_address=coordinator,
            cluster_detection_method="deactivate",
        )
    elif detected_cluster() is not None:
        _use_gloo_on_cpu()
        jax.distributed.initialize()
    else:
        return  # before anything starts JAX's backend
    global _exit_hooks_installed
    if jax.process_count() > 1 and not _exit_hooks_installed:
        _exit_at_once_on_uncaught_exception()
        atexit.register(_drain_before_exit)
        _exit_hooks_installed = True


def barrier(name: str) -> None:
    """Wait until every process reaches `barrier(name)`; a no-op in a single process.
    All processes must call it with the same names in the same order."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
