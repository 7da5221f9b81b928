"""Data parallelism: the batch's rows split over the data axes, the loss and the
gradients added up over them. Every layout has this part."""

import dataclasses
from typing import Any

from jax.sharding import Mesh, PartitionSpec as P

from ..._utils import AxisName, axis_names, check_axis_in_mesh
from .base import Part


@dataclasses.dataclass(frozen=True)
class DataPart(Part):
    """The rows over `axes` (in mesh order when several: HSDP's replicas and
    shards). Build it with `parse`."""

    axes: tuple[str, ...]

    @classmethod
    def parse(cls, mesh: Mesh, data_axis: AxisName, caller: str) -> "DataPart":
        """`data_axis` checked against `mesh`: a `ValueError` naming it when it is
        empty, repeats an axis or names one the mesh lacks."""
        axes = axis_names(data_axis)
        if not axes:
            raise ValueError(f"{caller}: `data_axis` is empty; name a mesh axis.")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{caller}: `data_axis`={data_axis!r} repeats an axis.")
        for axis in axes:
            check_axis_in_mesh(mesh, axis, caller, "data_axis")
        return cls(axes)

    @property
    def rows(self) -> Any:
        """The spec entry of the rows: the axis, or the tuple of axes."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def roles(self, mesh: Mesh) -> dict[str, str]:
        return {axis: "data" for axis in self.axes}

    def manual_axes(self) -> tuple[str, ...]:
        return self.axes

    def reduce_axes(self) -> tuple[str, ...]:
        return self.axes

    def leaf_spec(self, ndim: int, spec: P) -> P:
        return spec if ndim == 0 else P(self.rows)

    def plan_keywords(self, mesh: Mesh, model: Any, caller: str) -> dict[str, Any]:
        return {"data_axes": self.axes}
