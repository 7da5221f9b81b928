"""ZeRO-1: the parameters as the other parts say, their optimizer state sharded
over one data axis by the FSDP rule; each device updates its share and the new
parameters are gathered back."""

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from ..._utils import flatten_up_to
from ..plan import warn_if_unsharded
from ..rules import FsdpRule
from .base import Part
from .fsdp import FsdpOptions


@dataclasses.dataclass(frozen=True)
class Zero1Part(Part):
    """The optimizer state of leaves larger than `options.min_weight_size`
    sharded by `rule`."""

    rule: FsdpRule
    options: FsdpOptions

    def roles(self, mesh: Mesh) -> dict[str, str]:
        names = ("min_weight_size", "layout")
        return {
            self.rule.axis_name: f"zero1 (optimizer state; "
            f"{self.options.describe(*names)})"
        }

    def plan_keywords(self, mesh: Mesh, model: Any, caller: str) -> dict[str, Any]:
        return {"zero1": self.rule}

    def optimizer_specs(self, model: Any, param_specs: Any, caller: str) -> Any:
        """Each trained parameter's spec (`None` at the others) sharded by the
        FSDP rule, as FSDP would shard the parameter."""
        leaves = jax.tree.leaves(model)
        specs = [
            None if s is None else self.rule.spec(tuple(x.shape), s)
            for x, s in zip(leaves, flatten_up_to(model, param_specs), strict=True)
        ]
        warn_if_unsharded(
            specs,
            [x for x, s in zip(leaves, specs, strict=True) if s is not None],
            self.rule,
            caller,
            "strategy='zero1'",
            "optimizer state",
        )
        return jax.tree.unflatten(jax.tree.structure(model), specs)
