"""What a train step returns: `StepOutput`, the pair `(state, metrics)` with the
step statistics as `.info`."""

from typing import Any

from jaxtyping import Array


class StepOutput(tuple[Any, Any]):
    """What a train step returns: the pair `(state, metrics)`, whatever the step's
    options, with the step statistics of `step_info=True` as `.info` (a dict of
    replicated 0-d float32 arrays; `None` without `step_info`).

    !!! Example

        ```python
        state, metrics = step(state, batch)       # any step
        out = step(state, batch)                  # with step_info=True
        print(out.info["grad_norm"], out.state.step)
        ```
    """

    info: dict[str, Array] | None

    def __new__(
        cls, state: Any, metrics: Any, info: dict[str, Array] | None = None
    ) -> "StepOutput":
        output = super().__new__(cls, (state, metrics))
        output.info = info
        return output

    @property
    def state(self) -> Any:
        return self[0]

    @property
    def metrics(self) -> Any:
        return self[1]
