"""Pipeline parallelism: the layers of a model's `ed.Stacked` split over a stage
axis, the device's rows cut into microbatches that flow through the stages
(`_layout/pipeline/` runs the schedules)."""

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh, PartitionSpec as P

from ..pipeline import WRITTEN_OUT, Pipeline, pipelined, stage_plan, staged
from .base import LossView, Part
from .tensor import check_rules_spare


@dataclasses.dataclass(frozen=True)
class PipelinePart(Part):
    """The `pipeline`'s stages over its axis. Build it with `parse`."""

    pipeline: Pipeline

    @classmethod
    def parse(
        cls,
        caller: str,
        mesh: Mesh,
        pipeline: Any,
        data_axes: tuple[str, ...],
        param_rules: Sequence[tuple[str, P]],
    ) -> "PipelinePart":
        if not isinstance(pipeline, Pipeline):
            raise TypeError(
                f"{caller}: `pipeline` must be an ed.Pipeline (e.g. "
                f"ed.Pipeline('stage', microbatches=8)); got {pipeline!r}."
            )
        pipeline.check_mesh(mesh, data_axes, caller)
        check_rules_spare(caller, param_rules, pipeline.axis, "pipeline's stage axis")
        return cls(pipeline)

    def roles(self, mesh: Mesh) -> dict[str, str]:
        p = self.pipeline
        repeats = f", {p.repeats} repeats" if p.repeats > 1 else ""
        return {
            p.axis: f"pipeline ({p.schedule}, {p.microbatches} microbatches{repeats})"
        }

    def manual_axes(self) -> tuple[str, ...]:
        return (self.pipeline.axis,)

    def apply_to_plan(self, plan: Any, mesh: Mesh, model: Any, caller: str) -> Any:
        stages = stage_plan(self.pipeline, mesh, model, caller)
        return staged(plan, stages, model, caller)

    def for_loss(self, model: Any, view: LossView) -> Any:
        if view.stages is None or not view.pipelined:
            return model
        manual = view.data_axes if view.view == "global" else ()
        return pipelined(
            model, view.stages, manual, view.remat, view.marker, view.reads_layers
        )

    def row_multiple(self) -> int:
        return self.pipeline.microbatches

    def check_training(self, caller: str, context_axis: str | None) -> None:
        """A `ValueError` for a schedule whose backward is written out ("1f1b",
        "interleaved", "zb-h1") with a context axis (a training step; an
        evaluation runs the pipeline's forward pass, with no such limit).

        These schedules run, in the same slot, a forward pass on one stage and
        a backward pass on another (`lax.switch` on the stage): their ring attention's
        `ppermute`s over the context axis are collectives that only some devices
        reach, and XLA pairs them with the schedule's own `ppermute` over the
        stage axis, so a stage receives the wrong activations and training is
        silently wrong. GPipe and the circular schedule run the same program on
        every stage."""
        schedule = self.pipeline.schedule
        if context_axis is None or schedule not in WRITTEN_OUT:
            return
        raise ValueError(
            f"{caller}: pipeline=ed.Pipeline(..., schedule={schedule!r}) with "
            f"context_axis={context_axis!r} is not supported: {schedule!r} runs "
            "different passes (forward, backward) on different stages at once, and "
            f"the ring attention's collectives over {context_axis!r} inside them do "
            "not pair up across stages (the gradients would be wrong). Use "
            "schedule='gpipe' or schedule='circular' (with repeats > 1) with a "
            f"context axis, or drop context_axis to keep {schedule!r}."
        )
