"""Expert parallelism: every `ed.MoE`'s expert weights split over an axis on
their expert dimension (`num_experts / size` experts per device), the router
replicated; the layer sends each token to the devices holding its experts
(`_experts`). The axis may be a data axis (the usual case: each device's own
tokens travel) or an axis of its own (the tokens replicated over it)."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from ..._experts.moe import expert_leaves, with_expert_axis
from ..._utils import path_str
from ..plan import ExpertPlan
from .base import LossView, Part, check_axis_keyword
from .tensor import check_rules_spare


@dataclasses.dataclass(frozen=True)
class ExpertPart(Part):
    """The experts over `axis` (`size` devices); `tokens_split`: it is a data
    axis, each device's tokens its own. Build it with `parse`."""

    axis: str
    size: int
    tokens_split: bool

    @classmethod
    def parse(
        cls,
        caller: str,
        mesh: Mesh,
        expert_axis: Any,
        data_axes: tuple[str, ...],
        taken: dict[str, str],
        param_rules: Sequence[tuple[str, P]],
    ) -> "ExpertPart":
        check_axis_keyword(caller, mesh, expert_axis, "expert_axis")
        other = {a: what for a, what in taken.items() if a not in data_axes}
        if expert_axis in other:
            raise ValueError(
                f"{caller}: `expert_axis`={expert_axis!r} is also {other[expert_axis]}"
                "; spread the experts over a data axis (the usual case) or an axis "
                "of their own."
            )
        check_rules_spare(caller, param_rules, expert_axis, "expert axis")
        size = int(mesh.shape[expert_axis])
        return cls(expert_axis, size, expert_axis in data_axes)

    def roles(self, mesh: Mesh) -> dict[str, str]:
        return {self.axis: f"experts (split {self.size} ways)"}

    def manual_axes(self) -> tuple[str, ...]:
        # A data axis is manual already; an axis of its own becomes so.
        return () if self.tokens_split else (self.axis,)

    def plan_keywords(self, mesh: Mesh, model: Any, caller: str) -> dict[str, Any]:
        leaves = expert_leaves(model)
        with_path = jax.tree_util.tree_flatten_with_path(model)[0]
        for (path, x), expert in zip(with_path, leaves, strict=True):
            count = np.shape(x)[np.ndim(x) - 3] if expert else 0
            if expert and count % self.size:
                raise ValueError(
                    f"{caller}: the expert weight {path_str(path)} of shape "
                    f"{np.shape(x)} has {count} experts, not divisible by the "
                    f"{self.size} devices of expert_axis={self.axis!r}; use a "
                    f"multiple of {self.size} experts or a smaller axis."
                )
        return {"experts": ExpertPlan(self.axis, leaves)}

    def for_loss(self, model: Any, view: LossView) -> Any:
        return with_expert_axis(model, self.axis, tokens_split=self.tokens_split)
