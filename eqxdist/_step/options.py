"""The options of what a training step computes, validated once: minibatches,
the compute dtype, the step statistics, what the backward pass keeps of the
model's `Stacked` blocks (`StepOptions`); and how it runs (`ExecutionOptions`:
donation, the bound on steps in flight, the minibatch loop). Where the arrays
live is the layout's (`_layout.options`)."""

import dataclasses
from typing import Any

from .._layout.remat import UNSET, check_remat, check_unroll
from .._utils import check_compute_dtype
from .accumulate import check_num_minibatches

VIEWS = ("device", "global")
"""How `loss_fn` sees the batch: once per device on that device's rows inside
`jax.shard_map` (`"device"`), or once on the whole global batch, as on one device,
with XLA partitioning the computation (`"global"`)."""


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """- `view`: `"device"` or `"global"` (`VIEWS`).
    - `num_minibatches`: gradient accumulation steps per call (>= 1).
    - `use_scan`: the minibatches as one `lax.scan` (else unrolled).
    - `compute_dtype`: the dtype trained floating-point parameters are cast to
      before the loss (`None`: none).
    - `step_info`: compute the gradient, update and parameter norms.
    - `skip_nonfinite`: leave the state as it was after a non-finite step.
    - `remat`: what the backward pass keeps of every `Stacked`'s blocks, in
      normal form (`UNSET`: each its own).
    - `unroll`: every `Stacked` as a Python loop (`True`) or a scan (`False`);
      `None`: each as built."""

    view: str = "device"
    num_minibatches: int = 1
    use_scan: bool = True
    compute_dtype: Any = None
    step_info: bool = False
    skip_nonfinite: bool = False
    remat: Any = UNSET
    unroll: bool | None = None

    @classmethod
    def parse(
        cls,
        caller: str,
        *,
        view: str,
        num_minibatches: int,
        use_scan: bool,
        compute_dtype: Any,
        step_info: bool,
        skip_nonfinite: bool,
        remat: Any = None,
        unroll: Any = None,
    ) -> "StepOptions":
        check_view(view, caller)
        check_num_minibatches(num_minibatches, caller)
        check_unroll(unroll, caller, optional=True)
        return cls(
            view,
            num_minibatches,
            use_scan,
            check_compute_dtype(compute_dtype, caller),
            step_info,
            skip_nonfinite,
            UNSET if remat is None else check_remat(remat, caller),
            unroll,
        )


def check_view(view: str, caller: str) -> None:
    if view not in VIEWS:
        raise ValueError(
            f"{caller}: unknown view {view!r}; use 'device' (the loss runs once per "
            "device, on that device's rows) or 'global' (it runs once on the whole "
            "global batch, as on one device)."
        )


EXECUTION_DEFAULTS: dict[str, Any] = {
    "donate": True,
    "use_scan": True,
    "max_steps_in_flight": 8,
}
"""How a train step runs, rarely changed: `make_train_step`'s keywords."""


@dataclasses.dataclass(frozen=True)
class ExecutionOptions:
    """- `donate`: reuse the buffers of the state the step returned last.
    - `use_scan`: the minibatches as one `lax.scan` (else unrolled; see
      `accumulate_gradients`).
    - `max_steps_in_flight`: at most this many steps queued before the step
      waits for the oldest (XLA's CPU collectives deadlock when a loop that
      never blocks queues too many); `None`: unbounded."""

    donate: bool = True
    use_scan: bool = True
    max_steps_in_flight: int | None = 8

    @classmethod
    def parse(cls, caller: str, settings: dict[str, Any]) -> "ExecutionOptions":
        for name in ("donate", "use_scan"):
            if not isinstance(settings[name], bool):
                raise TypeError(
                    f"{caller}: `{name}` must be True or False; got {settings[name]!r}."
                )
        bound = settings["max_steps_in_flight"]
        if bound is not None and (
            isinstance(bound, bool) or not isinstance(bound, int) or bound < 1
        ):
            raise ValueError(
                f"{caller}: `max_steps_in_flight` must be >= 1 or None; got {bound}."
            )
        return cls(settings["donate"], settings["use_scan"], bound)
