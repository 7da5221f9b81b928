"""Tensor parallelism from rules: `param_rules` shard the leaves they match over
the mesh's other axes, and XLA partitions the computation over them."""

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh, PartitionSpec as P

from ..rules import ParamRules, spec_axes
from .base import Part

_WHY_SPARE = {
    "pipeline's stage axis": "the stages split the Stacked's layers, rules shard "
    "within them over other axes.",
    "context axis": "the sequence is split over it and the parameters are "
    "replicated over it. Shard them over other axes.",
    "expert axis": "the experts are split over it; shard the experts' other "
    "dimensions over other axes.",
}


def check_rules_spare(
    caller: str, param_rules: Sequence[tuple[str, P]], axis: str, what: str
) -> None:
    """A `ValueError` for a rule that names `axis`, which another part (`what`)
    has taken."""
    for pattern, spec in param_rules:
        if axis in spec_axes(spec):
            raise ValueError(
                f"{caller}: param_rules ({pattern!r}: {spec}) name the {what} "
                f"{axis!r}; {_WHY_SPARE[what]}"
            )


@dataclasses.dataclass(frozen=True)
class TensorPart(Part):
    """The checked `rules` (`ParamRules`)."""

    rules: ParamRules

    def roles(self, mesh: Mesh) -> dict[str, str]:
        count: dict[str, int] = {}
        for _, spec in self.rules.rules:
            for axis in spec_axes(spec):
                count[axis] = count.get(axis, 0) + 1
        return {
            axis: f"tensor rules ({n} rule{'s' if n > 1 else ''})"
            for axis, n in count.items()
        }

    def plan_keywords(self, mesh: Mesh, model: Any, caller: str) -> dict[str, Any]:
        return {"rules": self.rules}

    def compiler_passes(self, model: Any, compute_dtype: Any) -> tuple[str, ...]:
        # XLA:CPU's all-reduce promotion aborts the process compiling the
        # bfloat16 collectives of tensor-parallel rules.
        return () if compute_dtype is None else ("all-reduce-promotion",)
