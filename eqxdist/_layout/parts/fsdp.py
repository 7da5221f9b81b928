"""FSDP: parameters (and their optimizer state) sharded over one data axis by the
FSDP rule, gathered for the loss, their gradients reduce-scattered. Also where
the strategy is chosen (`sharding_part`): FSDP, ZeRO-1 (`zero1.py`) or neither,
and every FSDP option checked against it."""

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from ..._utils import check_min_weight_size
from ..partitioned import LINEAR_MODES
from ..rules import DEFAULT_LAYOUT, LAYOUTS, OUTPUTS, FsdpRule, check_layout
from .base import Part

STRATEGIES = ("dp", "fsdp", "zero1")
"""`"dp"`: everything replicated over the data axes; `"fsdp"`: parameters and
their optimizer state sharded over `fsdp_axis`; `"zero1"`: only the optimizer
state sharded."""

GLOBAL_VIEW_LAYOUT = OUTPUTS
"""The FSDP rule's dimension in the global view when `fsdp_layout` is not given
(the device view's is `rules.DEFAULT_LAYOUT`, `"leading"`): each `eqx.nn.Linear`
weight on its leading dimension, every other leaf on its largest, so that XLA's
partitioner splits a plain `x @ W` by `W`'s columns instead of gathering `W` and
an `eqx.nn.Linear` by its weight's rows (docs/guides/fsdp.md, "The default
placement in each view", measured by `benchmarks/bench_views.py`)."""

STEP_LAYOUTS = (*LAYOUTS, OUTPUTS)
"""The values of a layout's `fsdp_layout`."""

FSDP_GATHERS = ("step", "minibatch")
"""`fsdp_gather`: gather once per step, or per minibatch."""

# Which strategies each FSDP option means something under.
_APPLIES = {
    "fsdp_axis": ("fsdp", "zero1"),
    "fsdp_layout": ("fsdp", "zero1"),
    "fsdp_gather": ("fsdp",),
    "fsdp_linears": ("fsdp",),
}

_CHOICES = {
    "fsdp_gather": "'step' (gather once per step) or 'minibatch' (gather per "
    "minibatch: less memory, one all-gather and reduce-scatter per minibatch)",
    "fsdp_linears": "'auto' (per layer, whichever moves fewer elements), 'gather' "
    "(always gather the weights) or 'partition' (partition every layer that can "
    "be)",
}


@dataclasses.dataclass(frozen=True)
class FsdpOptions:
    """How FSDP shards and gathers (ZeRO-1: how it shards the optimizer state).

    - `axis`: the data axis leaves are sharded over (`None`: the last data axis).
    - `min_weight_size`: leaves this small or smaller stay replicated.
    - `layout`: the FSDP rule's dimension, `"leading"`, `"largest"` or
      `"outputs"` (`rules.OUTPUTS`; not given: `"leading"`, and `"outputs"` in a
      global view's step under `"fsdp"`, `Layout.for_view`).
    - `gather`: with minibatches, gather once per `"step"` or per `"minibatch"`.
    - `linears`: how `eqx.nn.Linear` layers run, `"auto"`, `"gather"` or
      `"partition"` (`_layout.partitioned`).
    """

    axis: str | None = None
    min_weight_size: int = 2**18
    layout: str = DEFAULT_LAYOUT
    gather: str = "step"
    linears: str = "auto"

    def rule(self, mesh: Mesh, data_axes: tuple[str, ...]) -> FsdpRule:
        axis = self.axis or data_axes[-1]
        return FsdpRule(axis, mesh.shape[axis], self.min_weight_size, self.layout)

    def describe(self, *names: str) -> str:
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in names)


@dataclasses.dataclass(frozen=True)
class FsdpPart(Part):
    """Parameters larger than `options.min_weight_size` sharded by `rule`."""

    rule: FsdpRule
    options: FsdpOptions

    def roles(self, mesh: Mesh) -> dict[str, str]:
        names = ("min_weight_size", "layout", "gather", "linears")
        return {self.rule.axis_name: f"fsdp ({self.options.describe(*names)})"}

    def plan_keywords(self, mesh: Mesh, model: Any, caller: str) -> dict[str, Any]:
        return {"fsdp": self.rule}


def _check_choice(caller: str, name: str, value: Any, valid: Sequence[str]) -> None:
    if value is not None and value not in valid:
        raise ValueError(f"{caller}: unknown {name} {value!r}; use {_CHOICES[name]}.")


def check_strategy(strategy: Any, caller: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(
            f"{caller}: unknown strategy {strategy!r}; use one of "
            f"{list(STRATEGIES[:2])} (parameters replicated or sharded) or "
            f"{STRATEGIES[2]!r} (only the optimizer state sharded)."
        )


def fsdp_options(
    caller: str,
    strategy: str,
    data_axes: tuple[str, ...],
    given: dict[str, Any],
) -> FsdpOptions:
    """The FSDP options of `given` (`fsdp_axis`, `fsdp_layout`, `fsdp_gather`,
    `fsdp_linears`, each `None` when not given, and `min_weight_size`): a
    `ValueError` naming the option for an unknown value, or for an option the
    `strategy` does not use (never silently ignored)."""
    check_min_weight_size(given["min_weight_size"], caller)
    if given["fsdp_layout"] is not None:
        check_layout(given["fsdp_layout"], caller, "fsdp_layout", STEP_LAYOUTS)
    _check_choice(caller, "fsdp_gather", given["fsdp_gather"], FSDP_GATHERS)
    _check_choice(caller, "fsdp_linears", given["fsdp_linears"], LINEAR_MODES)
    for name, uses in _APPLIES.items():
        value = given[name]
        if value is not None and strategy not in uses:
            which = " or ".join(repr(s) for s in uses)
            raise ValueError(
                f"{caller}: `{name}`={value!r} is given but strategy is "
                f"{strategy!r}; it only applies to strategy={which}. Leave it out "
                "(or choose that strategy)."
            )
    axis = given["fsdp_axis"]
    if axis is not None and axis not in data_axes:
        raise ValueError(
            f"{caller}: `fsdp_axis`={axis!r} is not one of the data axes "
            f"{data_axes}; parameters are sharded over one of the axes the "
            "batch is split over."
        )
    defaults = FsdpOptions()
    return FsdpOptions(
        axis=axis,
        min_weight_size=given["min_weight_size"],
        layout=given["fsdp_layout"] or defaults.layout,
        gather=given["fsdp_gather"] or defaults.gather,
        linears=given["fsdp_linears"] or defaults.linears,
    )
