"""What `train_loop` runs each loop step: one train step, or several in turn on
one state (`StepsInTurn`: the parts of a GAN, an actor and a critic), their
metrics kept apart by name."""

from collections.abc import Mapping
from typing import Any

from .._step.output import StepOutput
from .._step.state import TrainState
from .._step.train_step import TrainStep


class StepsInTurn:
    """`steps` (`{name: TrainStep}`) called in order on one state each loop step,
    as one step: `(state, {name: metrics})`, with `{name: info}` as `.info` where
    a step has statistics. Each step advances `state.step`, so a loop step
    advances it by `len(steps)`."""

    def __init__(self, steps: Mapping[str, TrainStep], caller: str) -> None:
        if not steps or not all(isinstance(s, TrainStep) for s in steps.values()):
            raise TypeError(
                f"{caller}: `step` is a train step, or a dict of train steps run in "
                f"turn each loop step (e.g. {{'disc': step_d, 'gen': step_g}}); got "
                f"{dict(steps)!r}."
            )
        self.steps = dict(steps)
        first = next(iter(self.steps.values()))
        self.mesh = first.mesh
        self.place_state = first.place_state
        self.state_specs = first.state_specs

    def cost(self, state: TrainState, batch: Any) -> dict[str, float]:
        """The steps' model FLOPs added up (`TrainStep.cost`'s `"model_flops"`)."""
        flops = sum(s.cost(state, batch)["model_flops"] for s in self.steps.values())
        return {"model_flops": float(flops)}

    def __call__(self, state: TrainState, batch: Any) -> StepOutput:
        metrics: dict[str, Any] = {}
        info: dict[str, Any] = {}
        for name, step in self.steps.items():
            out = step(state, batch)
            state, metrics[name] = out
            if out.info is not None:
                info[name] = out.info
        return StepOutput(state, metrics, info or None)
