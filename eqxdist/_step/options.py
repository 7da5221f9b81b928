"""The options of what a training step computes, validated once: minibatches,
the compute dtype and the step statistics (`StepOptions`). Where the arrays live
is the layout's (`_layout.options`); donation and the bound on steps in flight
are the compiled-step cache's (`compiled.CompiledStep`)."""

import dataclasses
from typing import Any

from .._utils import check_compute_dtype
from .accumulate import check_num_minibatches


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """- `num_minibatches`: gradient accumulation steps per call (>= 1).
    - `use_scan`: the minibatches as one `lax.scan` (else unrolled).
    - `compute_dtype`: the dtype trained floating-point parameters are cast to
      before the loss (`None`: none).
    - `step_info`: compute the gradient, update and parameter norms.
    - `skip_nonfinite`: leave the state as it was after a non-finite step."""

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
        num_minibatches: int,
        use_scan: bool,
        compute_dtype: Any,
        step_info: bool,
        skip_nonfinite: bool,
    ) -> "StepOptions":
        check_num_minibatches(num_minibatches, caller)
        return cls(
            num_minibatches,
            use_scan,
            check_compute_dtype(compute_dtype, caller),
            step_info,
            skip_nonfinite,
        )
