"""Pipeline parallelism over the layers of a `Stacked`: `Pipeline` (the public
configuration) and the layout of which leaves are split over the stage axis
(`StagePlan`, `stage_spec`); `schedules` holds every schedule's table, `engine`
runs it (GPipe and circular through `stages`, 1F1B through
`_step.one_f_one_b`).

**Layout.** The `Stacked`'s leaves keep their natural shape `(L, ...)`; their
layer axis is sharded over the stage axis (P stages of L/P consecutive layers),
so a state saved under a pipeline restores under any other layout. The other
dimensions follow the FSDP rule and `param_rules` as in the other strategies;
a stage's layers enter the step gathered over the data axes (XLA gathers them
at the `shard_map` boundary, once per step). The rest of the model is laid out
as without a pipeline and replicated over the stage axis.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from ..._utils import not_in_mesh, path_str
from ..stacked import Stacked
from . import schedules

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved", "zb-h1")
# The schedules whose stages hold `repeats` chunks of layers each.
CHUNKED = ("circular", "interleaved")


class Pipeline(eqx.Module):
    """Pipeline parallelism over the layers of a model's `ed.Stacked`, passed as
    `ed.Layout(mesh, pipeline=ed.Pipeline(...))` (or v0.4's
    `make_train_step(..., pipeline=...)`).

    The `Stacked`'s L layers are split over the mesh axis `axis`: P stages of
    L/P consecutive layers (with `repeats` R > 1, the circular schedule: stage p
    holds chunks of L/(P R) layers, p, p + P, ...). Each device's rows (of each
    minibatch) are cut into `microbatches` microbatches that flow through the
    stages, activations passed on with `ppermute` (`all_to_all` on XLA:CPU).
    What comes before and after the `Stacked` (embeddings, head, loss) runs as
    in the other strategies, replicated over the stage axis. The data axes of
    the step split the batch as usual (data parallelism, FSDP or ZeRO-1 over
    them).

    **Arguments:**

    - `axis`: the mesh axis of the stages (not a data axis).
    - `microbatches`: microbatches per device and minibatch; it must divide the
      rows each device gets (of each minibatch).
    - `schedule`: `"gpipe"` (every microbatch forward, then every one backward;
      activations of all M microbatches kept per stage), `"circular"` (GPipe
      over R repeats of the ring, `repeats > 1`, M >= P: the bubble shrinks from
      (P - 1)/(M + P - 1) to (P - 1)/(R M + P - 1)), `"1f1b"` (one forward,
      one backward, each backward split into the input's gradient, B, and the
      weights', W, right after it: at most P microbatches' activations alive
      per stage; the loss after the stack runs once per microbatch, in either
      view), `"interleaved"` (interleaved 1F1B over R >= 2 chunks per stage,
      held as the circular schedule holds them: 1F1B's order over R M
      microbatch-chunks, a smaller bubble) or `"zb-h1"` (zero bubble: each
      backward split into B and W, the W passes deferred into the slots where
      1F1B would idle; at most P microbatches alive per stage, as 1F1B). See
      `table` and `idle_fraction` (the bubble of the compiled loop, run in
      lockstep).
    - `repeats`: R, the chunks per stage of `"circular"` and `"interleaved"`.
    - `where`: `where(model)` returns the `Stacked` to pipeline (as for
      `eqx.tree_at`); `None`: the model's only `Stacked`.

    **Raises:**

    `ValueError` for an unknown schedule, `microbatches < 1`, `repeats < 1`, or
    a schedule and `repeats` that do not go together; when the step is built,
    for an `axis` not in the mesh or among the data axes; when it is first
    called, for a model without (or, without `where`, with several) `Stacked`,
    layers not divisible by stages x repeats, or rows not divisible by the
    microbatches.

    !!! Example

        ```python
        mesh = ed.create_device_mesh({"stage": 4, "data": 2})
        layout = ed.Layout(mesh, pipeline=ed.Pipeline("stage", microbatches=8))
        step = ed.make_train_step(loss_fn, optimizer, layout)
        ```
    """

    axis: str = eqx.field(static=True)
    microbatches: int = eqx.field(static=True)
    schedule: str = eqx.field(static=True)
    repeats: int = eqx.field(static=True)
    where: Callable[[Any], Any] | None = eqx.field(static=True)

    def __init__(
        self,
        axis: str = "stage",
        microbatches: int | None = None,
        *,
        schedule: str = "gpipe",
        repeats: int = 1,
        where: Callable[[Any], Any] | None = None,
    ) -> None:
        caller = "Pipeline"
        if not isinstance(axis, str) or not axis:
            raise TypeError(f"{caller}: `axis` is a mesh axis name; got {axis!r}.")
        if microbatches is None:
            raise ValueError(
                f"{caller}: `microbatches` is required: how many microbatches each "
                "device's rows are cut into, e.g. Pipeline('stage', microbatches=8) "
                "(at least the number of stages keeps every stage busy)."
            )
        for name, value in (("microbatches", microbatches), ("repeats", repeats)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"{caller}: `{name}` must be an int; got {value!r}.")
            if value < 1:
                raise ValueError(f"{caller}: `{name}` must be >= 1; got {value}.")
        _check_schedule(caller, schedule, repeats)
        if where is not None and not callable(where):
            raise TypeError(
                f"{caller}: `where` is a function `where(model)` returning the "
                f"Stacked to pipeline; got {where!r}."
            )
        self.axis = axis
        self.microbatches = int(microbatches)
        self.schedule = schedule
        self.repeats = int(repeats)
        self.where = where

    def table(self, stages: int) -> list[list[tuple[str, int, int] | None]]:
        """The schedule the step runs on `stages` stages (the size of the mesh
        axis `axis`): one row per time slot, one entry per stage, `("F" | "B" |
        "W" | "BW", microbatch, chunk)` or `None` (idle). `"BW"` is a backward
        computing both gradients; `"zb-h1"` splits it into B (the input's
        gradient) and W (the weights')."""
        return schedules.table(self, stages)

    def idle_fraction(self, stages: int) -> float:
        """The idle slots of `table(stages)` over all slots, F, B and W one
        slot and BW two, each entry as soon as its inputs are there."""
        return schedules.idle_fraction(self, stages)

    def check_mesh(self, mesh: Mesh, data_axes: tuple[str, ...], caller: str) -> None:
        """A `ValueError` for a stage axis not in `mesh`, or among the data axes."""
        if self.axis not in mesh.axis_names:
            message = f"{caller}: the pipeline's axis {not_in_mesh(self.axis, mesh)}"
            if message.endswith("."):  # no axis of a close name
                message += (
                    " Name the mesh's stage axis in ed.Pipeline(axis, ...), or build "
                    f"the mesh with one, e.g. ed.create_device_mesh({{{self.axis!r}: "
                    "2, 'data': 4})."
                )
            raise ValueError(message)
        if self.axis in data_axes:
            raise ValueError(
                f"{caller}: the pipeline's axis {self.axis!r} is also a data axis "
                f"({data_axes}); the batch is split over the data axes and the "
                "layers over the stage axis: name different axes."
            )


def _check_schedule(caller: str, schedule: Any, repeats: int) -> None:
    """A `ValueError` for an unknown schedule or one `repeats` does not fit."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"{caller}: unknown schedule {schedule!r}; use 'gpipe', 'circular' "
            "(with repeats > 1), '1f1b', 'interleaved' (with repeats > 1) or "
            "'zb-h1'."
        )
    if schedule in CHUNKED and repeats == 1:
        raise ValueError(
            f"{caller}: schedule={schedule!r} needs repeats > 1 (each stage "
            f"holds `repeats` chunks of layers); got repeats=1. Pass e.g. "
            f"ed.Pipeline(..., schedule={schedule!r}, repeats=2), or use "
            f"{'gpipe' if schedule == 'circular' else '1f1b'!r}."
        )
    if schedule not in CHUNKED and repeats > 1:
        raise ValueError(
            f"{caller}: repeats={repeats} is for the schedules whose stages hold "
            f"several chunks of layers ('circular', 'interleaved'); got "
            f"schedule={schedule!r}. Pass one of them, or repeats=1."
        )


def with_data_axis(mesh: Mesh, data_axis: Any, other_axes: bool) -> Mesh:
    """`mesh`, or, where a step splits over `other_axes` (a pipeline's stages, a
    context axis) a mesh without the data axis (`{"stage": 8}`, `{"context": 8}`),
    the same devices with a trailing data axis of size 1: the rows are not
    split, every device holds all of them."""
    if not other_axes or not isinstance(data_axis, str) or data_axis in mesh.axis_names:
        return mesh
    types = (*mesh.axis_types, jax.sharding.AxisType.Auto)
    return Mesh(
        mesh.devices[..., None], (*mesh.axis_names, data_axis), axis_types=types
    )


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """A `Pipeline` resolved against a model structure and a mesh.

    - `pipeline`: the configuration.
    - `stages`: P, the size of the stage axis.
    - `leaves`: per leaf of `jax.tree.leaves(model)`, whether it is a leaf of
      the pipelined `Stacked` (its layer axis sharded over the stage axis).
    - `num_layers`: L.
    """

    pipeline: Pipeline
    stages: int
    leaves: tuple[bool, ...]
    num_layers: int

    @property
    def axis(self) -> str:
        return self.pipeline.axis

    def where(self, model: Any) -> Stacked:
        found: Stacked = _find_stacked(model, self.pipeline.where, "train step")
        return found


def _is_stacked(x: Any) -> bool:
    return isinstance(x, Stacked)


def _find_stacked(model: Any, where: Callable[[Any], Any] | None, caller: str) -> Any:
    if where is not None:
        try:
            found = where(model)
        except Exception as e:  # whatever `where` raises on the model
            raise ValueError(
                f"{caller}: the pipeline's `where` does not select a part of the "
                f"model ({type(e).__name__}: {e}); write it as for `eqx.tree_at`, "
                "e.g. `where=lambda model: model.blocks`."
            ) from None
        if not isinstance(found, Stacked):
            raise ValueError(
                f"{caller}: the pipeline's `where` returns a "
                f"{type(found).__name__}, not an ed.Stacked; the pipeline splits "
                "the layers of a Stacked over its stages."
            )
        return found
    found_all = [
        x for x in jax.tree.leaves(model, is_leaf=_is_stacked) if _is_stacked(x)
    ]
    if len(found_all) != 1:
        what = "no ed.Stacked" if not found_all else f"{len(found_all)} ed.Stacked"
        raise ValueError(
            f"{caller}: the model holds {what}; a pipeline splits the layers of one "
            "Stacked over its stages. Hold the blocks in an ed.Stacked (e.g. "
            "`ed.Stacked([Block(k) for k in keys])`) and, if there are several, "
            "pass `Pipeline(..., where=lambda model: model.blocks)`."
        )
    return found_all[0]


def where_fn(pipeline: Pipeline) -> Callable[[Any], Any]:
    """`where` as `eqx.tree_at` takes it (the default: the only `Stacked`)."""
    if pipeline.where is not None:
        return pipeline.where
    return lambda model: _find_stacked(model, None, "pipeline")


def stage_plan(pipeline: Pipeline, mesh: Mesh, model: Any, caller: str) -> StagePlan:
    """`pipeline` against `model`: which leaves are the pipelined `Stacked`'s,
    checked to split evenly over the stages (and repeats)."""
    stacked = _find_stacked(model, pipeline.where, caller)
    where = where_fn(pipeline)
    falses = jax.tree.map(lambda _: False, model)
    marked = eqx.tree_at(
        where, falses, replace=jax.tree.map(lambda _: True, where(falses))
    )
    leaves = tuple(bool(x) for x in jax.tree.leaves(marked))
    stages = int(mesh.shape[pipeline.axis])
    layers = stacked.num_layers
    split = stages * pipeline.repeats
    if layers % split:
        raise ValueError(
            f"{caller}: the pipelined Stacked has {layers} layers, not divisible by "
            f"{stages} stages x {pipeline.repeats} repeats = {split}; use a number "
            f"of layers that is a multiple of {split} (or fewer stages or repeats)."
        )
    return StagePlan(pipeline, stages, leaves, layers)


def stage_spec(spec: P | None, axis: str, path: str, caller: str) -> P:
    """A pipelined `Stacked` leaf's spec: its layer axis (dimension 0) over the
    stage `axis`, the rest as `spec` says (the FSDP rule, `param_rules`)."""
    entries = tuple(spec or ())
    if entries and entries[0] is not None:
        raise ValueError(
            f"{caller}: a rule shards dimension 0 of {path}, the layer axis of the "
            f"pipelined Stacked, which is split over the stage axis {axis!r}; start "
            "the spec with None."
        )
    return P(axis, *entries[1:])


def staged(plan: Any, stages: StagePlan, model: Any, caller: str) -> Any:
    """The pipeline's change to a model plan (`plan.ModelPlan`, the part's
    `apply_to_plan`): the pipelined `Stacked`'s leaves split over the stage
    axis on their layer axis. The step's `shard_map`, manual over the stage
    axis too, gives each stage its layers, whole over the data axes (XLA
    gathers an FSDP shard at the boundary, once per step); their gradients
    leave it as sums over the data axes (`sum_gradients`' all-reduce)."""
    with_path, structure = jax.tree_util.tree_flatten_with_path(model)
    treedef: Any = structure
    paths = [path_str(p) for p, _ in with_path]

    def update(tree: Any, value: Any) -> Any:
        if tree is None:
            return None
        # Flattened as the model is (`treedef`): a `None` field of the model (a
        # Linear without bias) is a node there, not a spec leaf.
        leaves = treedef.flatten_up_to(tree)
        new = [
            value(s, path) if staged and s is not None else s
            for s, staged, path in zip(leaves, stages.leaves, paths, strict=True)
        ]
        return jax.tree.unflatten(treedef, new)

    axis = stages.axis
    return dataclasses.replace(
        plan,
        specs=update(plan.specs, lambda s, path: stage_spec(s, axis, path, caller)),
        manual=update(plan.manual, lambda s, path: P(axis)),
        gather=update(plan.gather, lambda s, path: P()),
        scatter=update(plan.scatter, lambda s, path: P(axis)),
        stages=stages,
    )
