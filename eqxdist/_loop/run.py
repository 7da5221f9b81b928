"""One run of `train_loop`: the steps in order, with the log points,
evaluations, checkpoints, profile and watchdog around them, and the
`LoopResult` it returns. `loop.py` checks the arguments and builds the run."""

import collections
import dataclasses
import signal
import statistics
import threading
import time
from collections.abc import Callable, Generator
from types import FrameType, TracebackType
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checkpoint import CheckpointManager
from .._step.eval_step import EvalStep
from .._step.train_step import TrainStep
from .flops import mfu, peak_flops
from .pieces import Progress, Watchdog, compute, learning_rate, merge, scalars
from .steps import StepsInTurn
from .writers import Writer


@dataclasses.dataclass
class LoopResult:
    """What `train_loop` returns.

    - `state`: the state after the last step run.
    - `step`: its step number (`int(state.step)`).
    - `metrics`: the last step's metrics, as the step returned them.
    - `logs`: `(step, values)` of every log point (host numbers).
    - `evals`: `(step, metrics)` of every evaluation (the computed metrics, host
      arrays, including values of any rank such as a confusion matrix).
    - `start_step`: the step the run started (or resumed) from.
    - `preempted`: whether it stopped because the job is being preempted.
    - `seconds_per_step`: median wall-clock time per step between log points
      (timed from the end of the first step, which compiles); NaN when fewer
      than two log points ran (a run resumed at its last step runs none).
    - `interrupted`: whether it stopped because of Ctrl-C (SIGINT), having saved
      the step it stopped at.
    """

    state: Any
    step: int
    metrics: Any
    logs: list[tuple[int, dict[str, float]]]
    evals: list[tuple[int, dict[str, Any]]]
    start_step: int
    preempted: bool
    seconds_per_step: float
    interrupted: bool = False


def _batch_stream(batches: Any, start: int) -> Generator[Any, None, None]:
    """Batches from step `start` on: `batches.iterate(start)` (an
    `ed.BatchLoader`, yielding `(step, batch)`), or `batches(step)`."""
    if hasattr(batches, "iterate"):
        inner = batches.iterate(start)
        try:
            for _, batch in inner:
                yield batch
        finally:
            inner.close()  # stops the loader's reading thread
    else:
        step = start
        while True:
            yield batches(step)
            step += 1


class _Logger:
    """Log points: the values of step `s` are fetched at the next log point (when
    step `s` is long done), so logging never waits for the devices."""

    def __init__(self, run: "Run") -> None:
        self.run = run
        self.pending: tuple[int, dict[str, Any]] | None = None
        self.last: tuple[int, float] | None = None
        self.intervals: list[float] = []
        self.logs: list[tuple[int, dict[str, float]]] = []

    def values(self, s: int, state: Any, metrics: Any, info: Any) -> dict[str, Any]:
        run = self.run
        values = scalars(metrics)
        rate = learning_rate(state.opt_state)
        if rate is not None:  # a copy: the next step donates the optimizer state
            values["learning_rate"] = jnp.copy(rate)
        values.update(scalars(info or {}))
        now = time.perf_counter()
        if self.last is not None and s > self.last[0]:
            seconds = (now - self.last[1]) / (s - self.last[0])
            self.intervals.append(seconds)
            values["steps_per_sec"] = 1.0 / seconds
            for name, per_step in (
                ("examples_per_sec", run.examples_per_step),
                ("tokens_per_sec", run.tokens_per_step),
            ):
                if per_step:
                    values[name] = per_step / seconds
            if run.flops_per_step:
                util = mfu(run.flops_per_step, seconds, run.devices)
                if util is not None:
                    values["mfu"] = util
        self.last = (s, now)
        return values

    def log(self, s: int, state: Any, metrics: Any, info: Any) -> None:
        self.emit()
        self.pending = (s, self.values(s, state, metrics, info))

    def emit(self) -> None:
        if self.pending is None:
            return
        s, pending = self.pending
        self.pending = None
        fetched = jax.device_get(list(pending.values()))  # one fetch, names in order
        values = {k: float(v) for k, v in zip(pending, fetched, strict=True)}
        self.logs.append((s, values))
        if self.run.writer is not None:
            self.run.writer.write(s, values)
        self.run.progress.update(s, _shown(values, self.run.show))

    def seconds_per_step(self) -> float:
        times = self.intervals
        return statistics.median(times) if times else float("nan")


def _shown(values: dict[str, float], show: tuple[str, ...]) -> dict[str, float]:
    """The values `show` names, in logged order: a name matches a value of that
    name under any prefix, so that `"loss"` shows each part's loss (`disc/loss`,
    `gen/loss`) of a loop over a model's parts, as it shows a single step's."""
    return {
        k: v
        for k, v in values.items()
        if any(k == name or k.endswith(f"/{name}") for name in show)
    }


@dataclasses.dataclass
class Run:
    step: TrainStep | StepsInTurn
    writer: Writer | None
    progress: Progress
    show: tuple[str, ...]
    tokens_per_step: int | None
    devices: list[Any]
    eval_step: EvalStep | None
    eval_batches: Any
    checkpoints: CheckpointManager | None
    metadata: Callable[[int], dict[str, Any]] | None
    # Known once the first batch is there.
    examples_per_step: int | None = None
    flops_per_step: float | None = None

    def evaluate(self, s: int, state: Any) -> tuple[int, dict[str, Any]]:
        batches = self.eval_batches
        if not isinstance(batches, list | tuple):
            batches = [batches]
        total: Any = None
        for batch in batches:
            metrics = self.eval_step(state, batch)  # type: ignore[misc]
            total = metrics if total is None else merge(total, metrics)
        computed = compute(total)
        values = scalars(computed)
        if self.writer is not None:
            self.writer.write(s, {f"eval_{k}": v for k, v in values.items()})
        text = "  ".join(f"{k} {float(v):.4f}" for k, v in values.items())
        self.progress.print(f"step {s}  held-out  {text}")
        return s, jax.device_get(computed)

    def save(self, s: int, state: Any, *, force: bool) -> None:
        assert self.checkpoints is not None
        meta = {"loader_step": s, **(self.metadata(s) if self.metadata else {})}
        self.checkpoints.save(s, state, force=force, metadata=meta)


class _Interrupts:
    """Ctrl-C during a loop with checkpoints: the first SIGINT is taken as a
    preemption (the loop saves the step it is at and stops, on every process of a
    multi-process run), a second raises `KeyboardInterrupt` at once. Only where
    Python's own handler is installed (not where SIGINT is ignored or a handler
    of the user's is set), and only in the main thread, where handlers live."""

    def __init__(self, checkpoints: CheckpointManager | None) -> None:
        self.checkpoints = checkpoints
        self.received = False
        self._installed = False

    def __enter__(self) -> "_Interrupts":
        if (
            self.checkpoints is not None
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.received = True
        assert self.checkpoints is not None
        self.checkpoints.request_preemption()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _rows(batch: Any) -> int | None:
    leaves = [x for x in jax.tree.leaves(batch) if hasattr(x, "shape") and x.shape]
    return int(leaves[0].shape[0]) if leaves else None


def auto_flops(
    step: TrainStep | StepsInTurn, state: Any, batch: Any, devices: list[Any]
) -> Any:
    """The step's model FLOPs (`TrainStep.cost`), only where `mfu` can use them (a
    known device: the cost analysis compiles the step once more)."""
    if any(peak_flops(d) is None for d in devices):
        return None
    abstract = eqx.filter_eval_shape(lambda s: s, state)
    return step.cost(abstract, batch)["model_flops"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When the loop does what: the steps `start + 1 .. end`, and the options of
    `train_loop` that say what happens at which step."""

    start: int
    end: int
    flops: float | int | str | None
    log_every: int
    eval_every: int | None
    timeout: float | int | None
    profile: tuple[int, int] | None
    profile_dir: Any
    exit_on_preemption: bool
    max_in_flight: int

    def evaluates(self, s: int) -> bool:
        return s == self.end or (
            self.eval_every is not None and s % self.eval_every == 0
        )


def run_loop(run: Run, state: Any, batches: Any, plan: Schedule) -> LoopResult:
    """Run the steps `plan.start + 1 .. plan.end`, with Ctrl-C taken as a
    preemption where `run` checkpoints; the progress display closed after."""
    if plan.start and plan.start < plan.end:
        run.progress.print(f"resumed at step {plan.start}")
    elif plan.start >= plan.end and run.progress.total:
        run.progress.print(
            f"already at step {plan.start} of {run.progress.total}: nothing to run"
        )
    try:
        with _Interrupts(run.checkpoints) as interrupts:
            return _run_steps(run, state, batches, plan, interrupts)
    finally:
        run.progress.close()


def _run_steps(
    run: Run, state: Any, batches: Any, plan: Schedule, interrupts: _Interrupts
) -> LoopResult:
    logger = _Logger(run)
    evals: list[tuple[int, dict[str, Any]]] = []
    watchdog: Watchdog | None = None
    metrics: Any = None
    preempted, profiling, s = False, False, plan.start
    stream = _batch_stream(batches, plan.start)
    in_flight: collections.deque[Any] = collections.deque()
    try:
        for s in range(plan.start + 1, plan.end + 1):  # `s`: the step number after
            batch = next(stream)
            if s == plan.start + 1:
                run.examples_per_step = _rows(batch)
                run.flops_per_step = (
                    auto_flops(run.step, state, batch, run.devices)
                    if plan.flops == "auto"
                    else plan.flops  # type: ignore[assignment]
                )
            if plan.profile is not None and s - 1 == plan.profile[0]:
                jax.profiler.start_trace(str(plan.profile_dir))
                profiling = True
            out = run.step(state, batch)
            state, metrics = out
            in_flight.append(metrics)
            if len(in_flight) > plan.max_in_flight:
                jax.block_until_ready(in_flight.popleft())
            if profiling and plan.profile is not None and s == plan.profile[1]:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
                profiling = False
            run.progress.advance(s)
            if s == plan.start + 1:  # throughput is timed from here: compiled
                logger.last = (s, time.perf_counter())
            if s % plan.log_every == 0 or s == plan.end:
                logger.log(s, state, metrics, out.info)
            if run.eval_step is not None and plan.evaluates(s):
                # Another program's collectives must not interleave with queued
                # steps' (XLA's CPU collectives can deadlock); it waits anyway.
                jax.block_until_ready(metrics)
                logger.emit()
                evals.append(run.evaluate(s, state))
            if run.checkpoints is not None:
                # `save` saves whatever the interval once preemption is signalled;
                # `reached_preemption` is False at a step `save` did not save.
                run.save(s, state, force=s == plan.end)
                preempted = run.checkpoints.reached_preemption(s)
                if preempted:
                    break
            if watchdog is not None:
                watchdog.beat()
            elif plan.timeout is not None:  # after the first step, which compiles
                watchdog = Watchdog(plan.timeout)
    finally:
        stream.close()
        if profiling:
            jax.profiler.stop_trace()
        if watchdog is not None:
            watchdog.close()
    logger.emit()
    if run.writer is not None:
        run.writer.flush()
    interrupted = preempted and interrupts.received
    if preempted:
        _announce_stop(run, plan, s, interrupted)
    return LoopResult(
        state, s, metrics, logger.logs, evals, plan.start,
        preempted and not interrupted, logger.seconds_per_step(), interrupted,
    )  # fmt: skip


def _announce_stop(run: Run, plan: Schedule, s: int, interrupted: bool) -> None:
    """After a preemption (or Ctrl-C) saved step `s`: wait for the save, say so,
    and exit if the loop is to."""
    assert run.checkpoints is not None
    run.checkpoints.wait_until_finished()
    why = "interrupted (Ctrl-C)" if interrupted else "preempted"
    exiting = ", exiting" if plan.exit_on_preemption else ""
    run.progress.print(f"{why}: saved step {s}{exiting}")
    if plan.exit_on_preemption:
        # 128 + SIGINT, as a shell reports a process Ctrl-C ended.
        raise SystemExit(130 if interrupted else 0)
