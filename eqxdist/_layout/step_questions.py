"""What a training or evaluation step asks its `Layout` (`StepQuestions`,
which `Layout` inherits): the step never looks a parallelism's part up by its
type, so a part's answer changes in the part and here, never in the step."""

from typing import Any

from .parts.base import LossView, Part
from .parts.context import ContextPart
from .parts.fsdp import FsdpOptions, FsdpPart
from .parts.pipeline import PipelinePart
from .pipeline import WRITTEN_OUT

__all__ = ["FsdpOptions", "StepQuestions"]


class StepQuestions:
    """The step's questions, answered from the layout's `parts` (its
    `data_axes` and `for_loss` are the layout's own)."""

    parts: tuple[Part, ...]
    data_axes: tuple[str, ...]

    def part(self, kind: type[Any]) -> Any:
        """This layout's part of `kind` (e.g. `PipelinePart`), or `None`."""
        return next((p for p in self.parts if isinstance(p, kind)), None)

    def for_loss(self, model: Any, view: LossView) -> Any:
        """The model as a step's loss sees it (every part's `for_loss`)."""
        for part in self.parts:
            model = part.for_loss(model, view)
        return model

    @property
    def context_axis(self) -> str | None:
        """The axis the sequences are split over (`None` without one)."""
        context = self.part(ContextPart)
        return None if context is None else str(context.axis)

    @property
    def loss_per_microbatch(self) -> bool:
        """Whether a training step runs the loss once per microbatch (a
        pipeline whose backward is written out: 1F1B, interleaved, ZB-H1),
        whichever the view, rather than once on the rows it is given."""
        pipeline = self.part(PipelinePart)
        return pipeline is not None and pipeline.pipeline.schedule in WRITTEN_OUT

    @property
    def fsdp_options(self) -> FsdpOptions:
        """How FSDP gathers and runs `Linear`s (the defaults without FSDP:
        nothing is gathered then)."""
        fsdp = self.part(FsdpPart)
        return FsdpOptions() if fsdp is None else fsdp.options

    def check_training(self, caller: str) -> None:
        """A `ValueError` from each part that cannot train as laid out (a
        written-out pipeline schedule with a context axis)."""
        pipeline = self.part(PipelinePart)
        if pipeline is not None:
            pipeline.check_training(caller, self.context_axis)

    def loss_view(
        self,
        model: Any,
        *,
        stages: Any,
        view: str,
        remat: Any,
        marker: Any,
        pipelined: bool,
        reads_layers: bool,
    ) -> Any:
        """The model as a step's loss sees it (`for_loss`, every part's):
        `stages` the model's stage plan, `view` the step's, `remat` the one the
        step sets on every `Stacked`, `marker` the one a written-out schedule
        records the stack's calls with, `pipelined` whether to run the
        pipeline's schedule, `reads_layers` whether the loss reads the
        pipelined stack's layers outside it."""
        seen = LossView(
            stages, view, remat, marker, pipelined, self.data_axes, reads_layers
        )
        return self.for_loss(model, seen)
