"""`train_loop`: the loop around a train step, made of the pieces in `pieces`,
`writers` and `flops` (each usable alone)."""

import collections
import dataclasses
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Generator, Mapping
from types import FrameType, TracebackType
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checkpoint import CheckpointManager
from .._step.eval_step import EvalStep
from .._step.state import TrainState
from .._step.train_step import TrainStep
from .._utils import typecheck
from .flops import mfu, peak_flops
from .pieces import (
    Progress,
    Watchdog,
    compute,
    enable_compilation_cache,
    learning_rate,
    merge,
    scalars,
)
from .steps import StepsInTurn
from .writers import Writer, resume_writer


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


def restore_latest(
    checkpoints: CheckpointManager, step: TrainStep | StepsInTurn, state: TrainState
) -> tuple[TrainState, dict[str, Any]]:
    """The latest checkpoint of `checkpoints` restored into `step`'s layout (with
    `state` giving the structure), and its metadata; `state` itself, placed, and
    `{}` when there is no checkpoint yet. (A hand-written loop that appends to
    its writers' files calls `writer.resume(step)` with the step it continues
    from, as `train_loop` does, so that no step is logged twice.)"""
    placed = step.place_state(state)
    latest = checkpoints.latest_step()
    if latest is None:
        return placed, {}
    return checkpoints.restore(placed, step=latest), checkpoints.metadata(latest)


class _Logger:
    """Log points: the values of step `s` are fetched at the next log point (when
    step `s` is long done), so logging never waits for the devices."""

    def __init__(self, run: "_Run") -> None:
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
class _Run:
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


def _auto_flops(
    step: TrainStep | StepsInTurn, state: Any, batch: Any, devices: list[Any]
) -> Any:
    """The step's model FLOPs (`TrainStep.cost`), only where `mfu` can use them (a
    known device: the cost analysis compiles the step once more)."""
    if any(peak_flops(d) is None for d in devices):
        return None
    abstract = eqx.filter_eval_shape(lambda s: s, state)
    return step.cost(abstract, batch)["model_flops"]


@typecheck
def train_loop(
    step: TrainStep | Mapping[str, TrainStep],
    state: TrainState,
    batches: Any,
    num_steps: int,
    *,
    writer: Writer | None = None,
    log_every: int = 10,
    eval_step: EvalStep | None = None,
    eval_batches: Any = None,
    eval_every: int | None = None,
    checkpoints: CheckpointManager | None = None,
    resume: bool = True,
    metadata: Callable[[int], dict[str, Any]] | None = None,
    stop_at: int | None = None,
    tokens_per_step: int | None = None,
    flops_per_step: float | int | str | None = "auto",
    progress: bool | None = None,
    name: str = "",
    show: tuple[str, ...] = ("loss",),
    watchdog_timeout: float | int | None = None,
    profile_steps: tuple[int, int] | None = None,
    profile_dir: str | os.PathLike[str] | None = None,
    compilation_cache_dir: str | os.PathLike[str] | None = None,
    exit_on_preemption: bool = True,
    max_in_flight: int = 2,
) -> LoopResult:
    """Run `step` from the state's step (or the latest checkpoint) to `num_steps`,
    logging, evaluating, checkpointing, watching and profiling along the way.

    A loop around `step(state, batch)` with the chores every run needs; each chore
    is also a piece of its own (`Progress`, `Watchdog`, the writers,
    `learning_rate`, `TrainStep.cost` and `mfu`, `enable_compilation_cache`,
    `restore_latest`) for a hand-written loop. Nothing in it waits for a step to
    finish except evaluation and checkpoints: logged values are fetched one log
    point later, when their step is done, and the train step bounds the steps in
    flight.

    **Arguments:**

    - `step`, `state`: the train step (`make_train_step`) and the state to start
      from (placed here; with `resume`, only its structure and placement matter).
      `step` may be a dict of steps run in turn on the state each loop step (a
      model's parts: `{"disc": step_d, "gen": step_g}`); their metrics are kept
      apart by name (`disc/loss`, `gen/loss`), and each advances `state.step`.
    - `batches`: an `ed.BatchLoader` (anything with `iterate(start_step)` yielding
      `(step, batch)`), or a function `batch(step) -> batch`; the batch of step
      `s` must depend only on `s`, so that a resumed run sees the same stream.
    - `num_steps`: the step to train up to (the value of `state.step` at the end;
      with a dict of steps, the loop steps, each of them one call of every step).
    - `writer`: where log points and evaluations go (`JsonlWriter`, `MultiWriter`,
      ...). Evaluation values are written with an `eval_` prefix.
    - `log_every`: steps between log points: the step's scalar metrics, the
      `learning_rate` the optimizer exposes (`optax.inject_hyperparams`), the step
      statistics of a step made with `step_info=True`, `steps_per_sec`,
      `examples_per_sec` (rows of the batch), `tokens_per_sec` (with
      `tokens_per_step`) and `mfu` (with FLOPs known, on a known device).
    - `eval_step`, `eval_batches`, `eval_every`: evaluate with
      `eval_step(state, batch)` over `eval_batches` (a batch or a list of batches,
      metrics merged) every `eval_every` steps and at the end; with
      `eval_every=None` (the default), at the end only.
    - `checkpoints`: a `CheckpointManager`: saves when its `save_interval_steps`
      says, at the end, on preemption and on Ctrl-C, with `{"loader_step": s,
      **metadata(s)}` as the checkpoint's metadata (`manager.metadata(step)`
      reads it back).
    - `resume`: start from the latest checkpoint of `checkpoints`, if any (from
      the state's step without one), and call `writer.resume(start)` (where the
      writer has it), so that a writer appending to an interrupted run's files
      forgets the steps after the checkpoint instead of logging them twice.
    - `stop_at`: stop at this step although the run goes to `num_steps` (to split
      a run; the progress bar still counts to `num_steps`).
    - `tokens_per_step`: tokens in a global batch, for `tokens_per_sec`.
    - `flops_per_step`: FLOPs of one step (all devices) for `mfu`; `"auto"` counts
      the step's matrix products (`TrainStep.cost`'s `"model_flops"`) when the
      devices' peak is known; `None`: no MFU.
    - `progress`, `name`, `show`: the `Progress` display (`None`: a bar on a
      terminal), its label and the logged values it shows; a name in `show`
      also matches that name under any prefix, so the default `("loss",)` shows
      every part's loss of a dict of steps (`disc/loss`, `gen/loss`).
    - `watchdog_timeout`: end the process with every thread's stack and status 1
      when no step completes for this many seconds (armed after the first step,
      which compiles). `None`: no watchdog.
    - `profile_steps`, `profile_dir`: capture a `jax.profiler` trace of the steps
      `start <= s < stop` into `profile_dir` (for TensorBoard or Perfetto).
    - `compilation_cache_dir`: a persistent compilation cache
      (`enable_compilation_cache`).
    - `max_in_flight`: steps dispatched ahead of the last completed one (the
      loop waits for older steps beyond it). Two keep an accelerator busy; more
      only queue work, and on CPU many queued multi-device steps starve XLA's
      collectives of threads.
    - `exit_on_preemption`: on preemption (SIGTERM; see
      `CheckpointManager.reached_preemption`) save, then exit the process with
      status 0; `False` returns with `preempted=True` instead. With
      `checkpoints`, Ctrl-C (SIGINT) is taken the same way: the loop saves the
      step it is at and exits with status 130 (`False`: returns with
      `interrupted=True`); a second Ctrl-C stops at once (`KeyboardInterrupt`).

    **Returns:**

    A `LoopResult`.
    """
    _check_arguments(
        num_steps=num_steps,
        log_every=log_every,
        max_in_flight=max_in_flight,
        eval_step=eval_step,
        eval_batches=eval_batches,
        eval_every=eval_every,
        profile_steps=profile_steps,
        profile_dir=profile_dir,
    )
    if compilation_cache_dir is not None:
        enable_compilation_cache(compilation_cache_dir)
    steps = StepsInTurn(step, "train_loop") if isinstance(step, Mapping) else step
    state, start = _starting_state(
        steps, state, checkpoints if resume else None, writer
    )
    end = num_steps if stop_at is None else min(num_steps, stop_at)
    run = _Run(
        step=steps,
        writer=writer,
        progress=Progress(num_steps, initial=start, name=name, bar=progress),
        show=show,
        tokens_per_step=tokens_per_step,
        devices=list(steps.mesh.devices.flat),
        eval_step=eval_step,
        eval_batches=eval_batches,
        checkpoints=checkpoints,
        metadata=metadata,
    )
    schedule = _Schedule(
        start=start,
        end=end,
        flops=flops_per_step,
        log_every=log_every,
        eval_every=eval_every,
        timeout=watchdog_timeout,
        profile=profile_steps,
        profile_dir=profile_dir,
        exit_on_preemption=exit_on_preemption,
        max_in_flight=max_in_flight,
    )
    if start and start < end:
        run.progress.print(f"resumed at step {start}")
    elif start >= end and num_steps:
        run.progress.print(f"already at step {start} of {num_steps}: nothing to run")
    try:
        with _Interrupts(checkpoints) as interrupts:
            return _run_steps(run, state, batches, schedule, interrupts)
    finally:
        run.progress.close()


def _starting_state(
    step: TrainStep | StepsInTurn,
    state: TrainState,
    checkpoints: CheckpointManager | None,
    writer: Writer | None,
) -> tuple[TrainState, int]:
    """The state a loop starts from, placed, and the step its data stream is at:
    the latest checkpoint's (the writer told, so it logs no step twice) when
    resuming from `checkpoints`, else `state`'s."""
    if checkpoints is None:
        state = step.place_state(state)
        per_loop_step = len(step.steps) if isinstance(step, StepsInTurn) else 1
        return state, int(state.step) // per_loop_step
    state, meta = restore_latest(checkpoints, step, state)
    start = int(meta.get("loader_step", int(state.step)))
    if writer is not None:
        resume_writer(writer, start)
    return state, start


def _check_arguments(
    *,
    num_steps: int,
    log_every: int,
    max_in_flight: int,
    eval_step: Any,
    eval_batches: Any,
    eval_every: int | None,
    profile_steps: Any,
    profile_dir: Any,
) -> None:
    """`train_loop`'s arguments that must fit together, or a `ValueError`."""
    if (
        min(log_every, max_in_flight) < 1
        or num_steps < 0
        or (eval_every is not None and eval_every < 1)
    ):
        raise ValueError(
            "train_loop: `log_every`, `eval_every` and `max_in_flight` must be >= 1 "
            f"and `num_steps` >= 0; got {log_every}, {eval_every}, {max_in_flight} "
            f"and {num_steps}."
        )
    if (eval_step is None) != (eval_batches is None) or (
        eval_every is not None and eval_step is None
    ):
        raise ValueError(
            "train_loop: `eval_step`, `eval_batches` and `eval_every` go together: "
            "evaluation needs `eval_step` and `eval_batches`, and `eval_every` "
            "(default None: at the end only) means nothing without them; got "
            f"eval_step={eval_step!r}, eval_batches of type "
            f"{type(eval_batches).__name__} and eval_every={eval_every!r}.",
        )
    if profile_steps is not None and profile_dir is None:
        raise ValueError("train_loop: `profile_steps` needs a `profile_dir`.")


@dataclasses.dataclass(frozen=True)
class _Schedule:
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


def _run_steps(
    run: _Run, state: Any, batches: Any, plan: _Schedule, interrupts: _Interrupts
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
                    _auto_flops(run.step, state, batch, run.devices)
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


def _announce_stop(run: _Run, plan: _Schedule, s: int, interrupted: bool) -> None:
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
