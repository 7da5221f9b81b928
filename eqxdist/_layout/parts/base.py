"""The protocol of a layout's parts: what the train step, the evaluation step and
the loader ask of a layout, each question answered by the parts it concerns.

A `Layout` (`_layout.layout`) holds one part per parallelism it uses — data
(always), FSDP or ZeRO-1, tensor rules, a pipeline, a context axis — and answers
every question by asking its parts in that order: a question no part has
anything to say about keeps its neutral answer (no axes, the spec unchanged,
the model unchanged). A new parallelism is one more part, in one module."""

import dataclasses
from typing import Any

from jax.sharding import Mesh, PartitionSpec as P

from ..._utils import check_axis_in_mesh


def check_axis_keyword(caller: str, mesh: Mesh, value: Any, keyword: str) -> str:
    """A part's keyword naming one mesh axis: a `TypeError` unless a str, a
    `ValueError` (the mesh's axes, a close name) unless an axis of `mesh`."""
    if not isinstance(value, str):
        raise TypeError(
            f"{caller}: `{keyword}` must be the name of one mesh axis (a str); "
            f"got {value!r}."
        )
    check_axis_in_mesh(mesh, value, caller, keyword)
    return value


@dataclasses.dataclass(frozen=True)
class LossView:
    """What the loss sees of the model is asked with these: the model's stage
    plan (`None` without a pipeline), the step's view, the `remat` the step
    sets on every `Stacked` (`remat.UNSET`: their own), the marker 1F1B records
    the stack's calls with, whether to run the pipeline's schedule at all, and
    the data axes (a global view's schedule is manual over them), and whether
    the loss reads the pipelined stack's layers outside it (the device view then
    gives it every stage's: `_layout.all_layers`)."""

    stages: Any
    view: str
    remat: Any
    marker: Any
    pipelined: bool
    data_axes: tuple[str, ...]
    reads_layers: bool = False


class Part:
    """One parallelism's answers; every method's default is the neutral answer.

    - `roles(mesh)`: `{axis: role}` for `Layout.describe`.
    - `manual_axes()`: the axes a device view's `shard_map` is manual over.
    - `reduce_axes()`: the axes the loss, the gradients and the metrics add up
      over.
    - `leaf_spec(ndim, spec)`: the spec of a batch leaf of rank `ndim`, given
      the spec the parts before this one gave it.
    - `plan_keywords(mesh, model, caller)`: what this part tells `plan_model`
      about where the model's leaves live (data, FSDP, ZeRO-1 and tensor
      rules: the plan every leaf gets).
    - `apply_to_plan(plan, mesh, model, caller)`: the plan with this part's own
      change applied (the pipeline's stage axis on the pipelined layers, the
      experts' axis on the expert weights), in the order of the parts: the
      plan never branches on a parallelism.
    - `optimizer_specs(model, param_specs, caller)`: the specs the optimizer
      state follows, given each trained parameter's.
    - `compiler_passes(model, compute_dtype)`: XLA:CPU passes to disable.
    - `for_loss(model, view)`: the model as the loss sees it.
    - `device_batch(batch)`: inside a device view, the device's block of the
      batch as the loss sees it.
    - `check_batch(batch, caller)`: a `ValueError` for a batch this part cannot
      split.
    - `row_multiple()`: each device's rows must be a multiple of this.
    """

    def roles(self, mesh: Mesh) -> dict[str, str]:
        return {}

    def manual_axes(self) -> tuple[str, ...]:
        return ()

    def reduce_axes(self) -> tuple[str, ...]:
        return ()

    def leaf_spec(self, ndim: int, spec: P) -> P:
        return spec

    def plan_keywords(self, mesh: Mesh, model: Any, caller: str) -> dict[str, Any]:
        return {}

    def apply_to_plan(self, plan: Any, mesh: Mesh, model: Any, caller: str) -> Any:
        return plan

    def optimizer_specs(self, model: Any, param_specs: Any, caller: str) -> Any:
        return param_specs

    def compiler_passes(self, model: Any, compute_dtype: Any) -> tuple[str, ...]:
        return ()

    def for_loss(self, model: Any, view: LossView) -> Any:
        return model

    def device_batch(self, batch: Any) -> Any:
        return batch

    def check_batch(self, batch: Any, caller: str) -> None:
        return None

    def row_multiple(self) -> int:
        return 1
