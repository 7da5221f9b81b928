"""The keywords of a layout (`LAYOUT_KEYWORDS`), each checked once, in one place,
into the layout's parts (`parse_parts`): every error about where arrays live is
raised here, when the `Layout` is built, naming the keyword and the value.

An option the chosen strategy does not use is an error, never silently ignored:
`fsdp_gather` under `"dp"` says nothing, so a user who sets it is told instead of
training something else than they think."""

from typing import Any

from jax.sharding import Mesh

from .parts.base import Part
from .parts.context import ContextPart
from .parts.data import DataPart
from .parts.experts import ExpertPart
from .parts.fsdp import FsdpPart, check_strategy, fsdp_options
from .parts.pipeline import PipelinePart
from .parts.tensor import TensorPart
from .parts.zero1 import Zero1Part
from .rules import ParamRules

LAYOUT_DEFAULTS: dict[str, Any] = {
    "strategy": "dp",
    "data_axis": "data",
    "param_rules": (),
    "min_weight_size": 2**18,
    "fsdp_axis": None,
    "fsdp_layout": None,
    "fsdp_gather": None,
    "fsdp_linears": None,
    "pipeline": None,
    "context_axis": None,
    "expert_axis": None,
}
"""Every keyword of `ed.Layout` and its default (`None`: not given)."""

LAYOUT_KEYWORDS = frozenset(LAYOUT_DEFAULTS)


def parse_parts(caller: str, mesh: Mesh, keywords: dict[str, Any]) -> tuple[Part, ...]:
    """The parts of a layout of `keywords` (every one of `LAYOUT_DEFAULTS`) over
    `mesh`, in the order a layout asks them: data, FSDP or ZeRO-1, tensor rules,
    pipeline, context. A `ValueError`/`TypeError` naming `caller`, the keyword
    and the value for anything that does not fit."""
    strategy = keywords["strategy"]
    check_strategy(strategy, caller)
    data = DataPart.parse(mesh, keywords["data_axis"], caller)
    fsdp = fsdp_options(caller, strategy, data.axes, keywords)
    rules = keywords["param_rules"]
    if not isinstance(rules, list | tuple):
        raise TypeError(
            f"{caller}: `param_rules` must be a list or tuple of (pattern, "
            f"PartitionSpec) pairs; got {type(rules).__name__} {rules!r}."
        )
    parts: list[Part] = [data]
    if strategy == "fsdp":
        parts.append(FsdpPart(fsdp.rule(mesh, data.axes), fsdp))
    elif strategy == "zero1":
        parts.append(Zero1Part(fsdp.rule(mesh, data.axes), fsdp))
    if rules:
        parts.append(TensorPart(ParamRules(rules, mesh, data.axes, caller)))
    taken = {axis: "a data axis" for axis in data.axes}
    if keywords["pipeline"] is not None:
        pipeline = PipelinePart.parse(
            caller, mesh, keywords["pipeline"], data.axes, rules
        )
        parts.append(pipeline)
        taken[pipeline.pipeline.axis] = "the pipeline's stage axis"
    if keywords["context_axis"] is not None:
        context = ContextPart.parse(
            caller, mesh, keywords["context_axis"], taken, rules
        )
        parts.append(context)
        taken[context.axis] = "the context axis"
    if keywords["expert_axis"] is not None:
        parts.append(
            ExpertPart.parse(
                caller, mesh, keywords["expert_axis"], data.axes, taken, rules
            )
        )
    return tuple(parts)
