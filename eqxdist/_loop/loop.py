"""`train_loop`: the loop around a train step, made of the pieces in `pieces`,
`writers` and `flops` (each usable alone): its arguments checked, the state it
starts from, and the run (`run.py`) built from them."""

import os
from collections.abc import Callable, Mapping
from typing import Any

from .._checkpoint import CheckpointManager
from .._step.eval_step import EvalStep
from .._step.state import TrainState
from .._step.train_step import TrainStep
from .._utils import typecheck
from .pieces import Progress, enable_compilation_cache
from .run import LoopResult, Run, Schedule, run_loop
from .steps import StepsInTurn
from .writers import Writer, resume_writer


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
    run = Run(
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
    schedule = Schedule(
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
    return run_loop(run, state, batches, schedule)


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
