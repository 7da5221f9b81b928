"""The options of a step's layout, each validated once, in one place: the
strategy, the data axes and tensor-parallel rules, and how FSDP (and ZeRO-1)
shard and gather (`FsdpOptions`).

An option the chosen strategy does not use is an error, never silently ignored:
`fsdp_gather` under `"dp"` says nothing, so a user who sets it is told instead of
training something else than they think."""

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh, PartitionSpec as P

from .._utils import AxisName, axis_names, check_axis_in_mesh, check_min_weight_size
from .partitioned import LINEAR_MODES
from .pipeline import Pipeline
from .remat import UNSET, check_remat, check_unroll
from .rules import DEFAULT_LAYOUT, check_layout, spec_axes

STRATEGIES = ("dp", "fsdp", "zero1")
"""`"dp"`: everything replicated over the data axes; `"fsdp"`: parameters and
their optimizer state sharded over `fsdp_axis`; `"zero1"`: only the optimizer
state sharded."""

FSDP_GATHERS = ("step", "minibatch")
"""`make_train_step(fsdp_gather=...)`: gather once per step, or per minibatch."""

# Which strategies each FSDP option means something under.
_APPLIES = {
    "fsdp_axis": ("fsdp", "zero1"),
    "fsdp_layout": ("fsdp", "zero1"),
    "fsdp_gather": ("fsdp",),
    "fsdp_linears": ("fsdp",),
}


@dataclasses.dataclass(frozen=True)
class FsdpOptions:
    """How FSDP shards and gathers (ZeRO-1: how it shards the optimizer state).

    - `axis`: the data axis leaves are sharded over (`None`: the last data axis).
    - `min_weight_size`: leaves this small or smaller stay replicated.
    - `layout`: the FSDP rule's dimension, `"leading"` or `"largest"`.
    - `gather`: with minibatches, gather once per `"step"` or per `"minibatch"`.
    - `linears`: how `eqx.nn.Linear` layers run, `"auto"`, `"gather"` or
      `"partition"` (`_layout.partitioned`).
    """

    axis: str | None = None
    min_weight_size: int = 2**18
    layout: str = DEFAULT_LAYOUT
    gather: str = "step"
    linears: str = "auto"


@dataclasses.dataclass(frozen=True)
class LayoutOptions:
    """Where a step keeps its arrays: `strategy` over the `data_axes`,
    tensor-parallel `param_rules` over the other axes, and the `fsdp` options.
    Build it with `parse`, which checks everything against the mesh."""

    strategy: str
    data_axes: tuple[str, ...]
    param_rules: tuple[tuple[str, P], ...]
    fsdp: FsdpOptions
    pipeline: Pipeline | None = None
    remat: Any = UNSET
    context_axis: str | None = None
    unroll: bool | None = None

    @classmethod
    def parse(
        cls,
        caller: str,
        mesh: Mesh,
        *,
        strategy: str,
        data_axis: AxisName,
        param_rules: Sequence[tuple[str, P]] = (),
        min_weight_size: int = 2**18,
        fsdp_axis: str | None = None,
        fsdp_layout: str | None = None,
        fsdp_gather: str | None = None,
        fsdp_linears: str | None = None,
        pipeline: Pipeline | None = None,
        remat: Any = UNSET,
        context_axis: str | None = None,
        unroll: Any = None,
    ) -> "LayoutOptions":
        """The options of `caller`'s keyword arguments (`None`: not given, the
        default), or a `ValueError` naming the argument, the value and what to
        pass instead."""
        if strategy not in STRATEGIES:
            raise ValueError(
                f"{caller}: unknown strategy {strategy!r}; use one of "
                f"{list(STRATEGIES[:2])} (parameters replicated or sharded) or "
                f"{STRATEGIES[2]!r} (only the optimizer state sharded)."
            )
        data_axes = axis_names(data_axis)
        if not data_axes:
            raise ValueError(f"{caller}: `data_axis` is empty; name a mesh axis.")
        if len(set(data_axes)) != len(data_axes):
            raise ValueError(f"{caller}: `data_axis`={data_axis!r} repeats an axis.")
        for axis in data_axes:
            check_axis_in_mesh(mesh, axis, caller, "data_axis")
        check_min_weight_size(min_weight_size, caller)
        if fsdp_layout is not None:
            check_layout(fsdp_layout, caller, "fsdp_layout")
        _check_choice(caller, "fsdp_gather", fsdp_gather, FSDP_GATHERS)
        _check_choice(caller, "fsdp_linears", fsdp_linears, LINEAR_MODES)
        given = {
            "fsdp_axis": fsdp_axis,
            "fsdp_layout": fsdp_layout,
            "fsdp_gather": fsdp_gather,
            "fsdp_linears": fsdp_linears,
        }
        for name, value in given.items():
            if value is not None and strategy not in _APPLIES[name]:
                uses = " or ".join(repr(s) for s in _APPLIES[name])
                raise ValueError(
                    f"{caller}: `{name}`={value!r} is given but strategy is "
                    f"{strategy!r}; it only applies to strategy={uses}. Leave it out "
                    "(or choose that strategy)."
                )
        if fsdp_axis is not None and fsdp_axis not in data_axes:
            raise ValueError(
                f"{caller}: `fsdp_axis`={fsdp_axis!r} is not one of the data axes "
                f"{data_axes}; parameters are sharded over one of the axes the "
                "batch is split over."
            )
        if pipeline is not None:
            _check_pipeline(caller, mesh, pipeline, data_axes, param_rules)
        if context_axis is not None:
            _check_context_axis(caller, mesh, context_axis, data_axes, pipeline)
            _check_rules_spare(caller, param_rules, context_axis, "context axis")
        remat = _check_stack_options(caller, remat, unroll)
        defaults = FsdpOptions()
        fsdp = FsdpOptions(
            axis=fsdp_axis,
            min_weight_size=min_weight_size,
            layout=fsdp_layout or defaults.layout,
            gather=fsdp_gather or defaults.gather,
            linears=fsdp_linears or defaults.linears,
        )
        return cls(
            strategy,
            data_axes,
            tuple(param_rules),
            fsdp,
            pipeline,
            remat,
            context_axis,
            unroll,
        )


def _check_stack_options(caller: str, remat: Any, unroll: Any) -> Any:
    """The options a step sets on every `Stacked`: `remat` in its normal form
    (`UNSET`: not given), `unroll` checked to be `None` or a bool."""
    check_unroll(unroll, caller, optional=True)
    return remat if remat is UNSET else check_remat(remat, caller)


def _check_context_axis(
    caller: str,
    mesh: Mesh,
    context_axis: Any,
    data_axes: tuple[str, ...],
    pipeline: Pipeline | None,
) -> None:
    """A `ValueError` for a context axis that is not one axis of `mesh` apart
    from the data axes and the pipeline's stage axis."""
    if not isinstance(context_axis, str):
        raise TypeError(
            f"{caller}: `context_axis` must be the name of one mesh axis (a str); "
            f"got {context_axis!r}."
        )
    check_axis_in_mesh(mesh, context_axis, caller, "context_axis")
    taken = {a: "a data axis" for a in data_axes}
    if pipeline is not None:
        taken[pipeline.axis] = "the pipeline's stage axis"
    if context_axis in taken:
        raise ValueError(
            f"{caller}: `context_axis`={context_axis!r} is also {taken[context_axis]}"
            f"; rows are split over the data axes, sequences over the context "
            "axis: name different axes (e.g. jax.make_mesh((2, 4), ('data', "
            "'context')))."
        )


_CHOICES = {
    "fsdp_gather": "'step' (gather once per step) or 'minibatch' (gather per "
    "minibatch: less memory, one all-gather and reduce-scatter per minibatch)",
    "fsdp_linears": "'auto' (per layer, whichever moves fewer elements), 'gather' "
    "(always gather the weights) or 'partition' (partition every layer that can "
    "be)",
}


def _check_choice(caller: str, name: str, value: Any, valid: Sequence[str]) -> None:
    if value is not None and value not in valid:
        raise ValueError(f"{caller}: unknown {name} {value!r}; use {_CHOICES[name]}.")


def _check_pipeline(
    caller: str,
    mesh: Mesh,
    pipeline: Any,
    data_axes: tuple[str, ...],
    param_rules: Sequence[tuple[str, P]],
) -> None:
    if not isinstance(pipeline, Pipeline):
        raise TypeError(
            f"{caller}: `pipeline` must be an ed.Pipeline (e.g. "
            f"ed.Pipeline('stage', microbatches=8)); got {pipeline!r}."
        )
    pipeline.check_mesh(mesh, data_axes, caller)
    _check_rules_spare(caller, param_rules, pipeline.axis, "pipeline's stage axis")


_WHY_SPARE = {
    "pipeline's stage axis": "the stages split the Stacked's layers, rules shard "
    "within them over other axes.",
    "context axis": "the sequence is split over it and the parameters are "
    "replicated over it. Shard them over other axes.",
}


def _check_rules_spare(
    caller: str, param_rules: Sequence[tuple[str, P]], axis: str, what: str
) -> None:
    """A `ValueError` for a tensor-parallel rule that names `axis` (`what`)."""
    for pattern, spec in param_rules:
        if axis in spec_axes(spec):
            raise ValueError(
                f"{caller}: param_rules ({pattern!r}: {spec}) name the {what} "
                f"{axis!r}; {_WHY_SPARE[what]}"
            )


def check_schedule_context(
    caller: str, pipeline: Pipeline | None, context_axis: str | None
) -> None:
    """A `ValueError` for the 1F1B schedule with a context axis (a training step;
    an evaluation runs the pipeline's forward pass, with no such limit).

    1F1B runs, in the same slot, a forward pass on one stage and a backward pass
    on another (`lax.switch` on the stage): their ring attention's `ppermute`s
    over the context axis are collectives that only some devices reach, and XLA
    pairs them with the schedule's own `ppermute` over the stage axis, so a
    stage receives the wrong activations and training is silently wrong. GPipe
    and the circular schedule run the same program on every stage."""
    if pipeline is None or context_axis is None or pipeline.schedule != "1f1b":
        return
    raise ValueError(
        f"{caller}: pipeline=ed.Pipeline(..., schedule='1f1b') with "
        f"context_axis={context_axis!r} is not supported: 1F1B runs forward and "
        "backward passes on different stages at once, and the ring attention's "
        f"collectives over {context_axis!r} inside them do not pair up across "
        "stages (the gradients would be wrong). Use schedule='gpipe' or "
        "schedule='circular' (with repeats > 1) with a context axis, or drop "
        "context_axis to keep 1F1B."
    )
