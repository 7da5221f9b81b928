"""The options of what a training step computes, validated once: minibatches,
the compute dtype and the step statistics (`StepOptions`). Where the arrays live
is the layout's (`_layout.options`); donation and the bound on steps in flight
are the compiled-step cache's (`compiled.CompiledStep`)."""

import dataclasses
from typing import Any

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
    - `skip_nonfinite`: leave the state as it was after a non-finite step."""

    view: str = "device"
    num_minibatches: int = 1
    use_scan: bool = True
    compute_dtype: Any = None
    step_info: bool = False
    skip_nonfinite: bool = False

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
    ) -> "StepOptions":
        check_view(view, caller)
        check_num_minibatches(num_minibatches, caller)
        return cls(
            view,
            num_minibatches,
            use_scan,
            check_compute_dtype(compute_dtype, caller),
            step_info,
            skip_nonfinite,
        )


def check_view(view: str, caller: str) -> None:
    if view not in VIEWS:
        raise ValueError(
            f"{caller}: unknown view {view!r}; use 'device' (the loss runs once per "
            "device, on that device's rows) or 'global' (it runs once on the whole "
            "global batch, as on one device)."
        )
