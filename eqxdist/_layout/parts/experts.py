"""Expert parallelism: every `ed.MoE`'s expert weights split over an axis on
their expert dimension (`num_experts / size` experts per device), the router
replicated. The part places the weights (`apply_to_plan`) and gives the loss
each `MoE` as an `ExpertParallel` (`for_loss`; `_layout/experts`: the same
layer, with the axis), which sends each token to the devices holding its
experts: the `MoE` itself knows no axis. The axis may be a data axis (the
usual case: each device's own tokens travel) or an axis of its own (the tokens
replicated over it)."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from ..._experts import expert_leaves
from ..._utils import path_str
from ..experts import with_expert_axis
from ..rules import spec_axes
from .base import LossView, Part, check_axis_keyword
from .tensor import check_rules_spare


@dataclasses.dataclass(frozen=True)
class ExpertPart(Part):
    """The experts over `axis` (`size` devices); `tokens_split`: it is one of
    the `data_axes`, each device's tokens its own. Build it with `parse`."""

    axis: str
    size: int
    data_axes: tuple[str, ...]

    @property
    def tokens_split(self) -> bool:
        return self.axis in self.data_axes

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
        return cls(expert_axis, size, data_axes)

    def roles(self, mesh: Mesh) -> dict[str, str]:
        return {self.axis: f"experts (split {self.size} ways)"}

    def manual_axes(self) -> tuple[str, ...]:
        # A data axis is manual already; an axis of its own becomes so.
        return () if self.tokens_split else (self.axis,)

    def apply_to_plan(self, plan: Any, mesh: Mesh, model: Any, caller: str) -> Any:
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
        return _with_experts(plan, self, model, leaves, caller)

    def for_loss(self, model: Any, view: LossView) -> Any:
        return with_expert_axis(model, self.axis, tokens_split=self.tokens_split)


def _with_experts(
    plan: Any, part: ExpertPart, model: Any, experts: tuple[bool, ...], caller: str
) -> Any:
    """`plan` (`plan.ModelPlan`) with every expert weight (`experts`, per leaf)
    split over the experts' axis on its expert dimension, entering the step's
    `shard_map` as that shard and never gathered (each device computes with its
    experts, the tokens travel): the strategy's FSDP shard of it is dropped, a
    tensor rule's other dimensions and a pipeline's layer axis kept (the
    pipeline's part applies its change first). Its gradient leaves the map as
    the shard's, averaged over the axis by the layer (`_experts`); ZeRO-1 keeps
    it there."""
    axis, data_axes = part.axis, part.data_axes
    with_path, structure = jax.tree_util.tree_flatten_with_path(model)
    treedef: Any = structure
    leaves = [x for _, x in with_path]
    paths = [path_str(p) for p, _ in with_path]

    def entries(spec: P | None, ndim: int) -> list[Any]:
        return [*(spec or ()), *[None] * (ndim - len(spec or ()))]

    def expert_spec(spec: P | None, x: Any, path: str, manual: bool) -> P:
        dim = np.ndim(x) - 3
        out = entries(spec, np.ndim(x))
        if out[dim] is not None and not set(spec_axes(P(out[dim]))) <= set(data_axes):
            raise ValueError(
                f"{caller}: param_rules shard dimension {dim} (the experts) of the "
                f"expert weight {path} as {spec}; the expert axis {axis!r} splits "
                "that dimension. Shard the others (e.g. d_hidden over 'model')."
            )
        for d, entry in enumerate(out):
            names = spec_axes(P(entry))
            if names & set(data_axes) or (manual and d != 0):
                out[d] = None  # no FSDP shard; in the map only the stages' axis
        out[dim] = axis
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    def update(tree: Any, manual: bool, flat: bool = False) -> Any:
        if tree is None:
            return None
        specs = treedef.flatten_up_to(tree)
        new = [
            (P() if flat else expert_spec(s, x, path, manual))
            if expert and s is not None
            else s
            for s, x, path, expert in zip(specs, leaves, paths, experts, strict=True)
        ]
        return jax.tree.unflatten(treedef, new)

    return dataclasses.replace(
        plan,
        specs=update(plan.specs, manual=False),
        manual=update(plan.manual, manual=True),
        gather=update(plan.gather, manual=True, flat=True),
        scatter=update(plan.scatter, manual=True),
    )
