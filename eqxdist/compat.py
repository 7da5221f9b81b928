"""Object forms of the module functions, for code ported from object-style APIs
(Artifex's `DeviceMeshManager` and `DataParallel`, datarax's
`DistributedMetrics`; see docs/migration.md): `ed.compat.DataParallel()`. Each
class binds one default (a device list, a data axis, a metric axis) and its
methods call the module functions of the same names. New code calls the
functions directly."""

__all__ = ["DataParallel", "DeviceMeshManager", "DistributedMetrics"]

from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding

from ._data_parallel import (
    all_reduce_gradients,
    create_data_parallel_sharding,
    replicate_params,
    shard_batch,
)
from ._layout.fsdp import shard_model_state
from ._mesh import (
    AxisTypes,
    MeshShape,
    _check_devices,
    create_data_parallel_mesh,
    create_device_mesh,
    create_hybrid_mesh,
    create_model_parallel_mesh,
    get_mesh_info,
)
from ._reductions import (
    all_gather,
    collect_from_devices,
    reduce_custom,
    reduce_max,
    reduce_mean,
    reduce_min,
    reduce_sum,
)
from ._utils import AxisName


class DeviceMeshManager(eqx.Module):
    """The mesh functions over a fixed list of devices.

    `DeviceMeshManager(devices=None)` holds `devices` (default `jax.devices()`); its
    methods are the module-level mesh functions, placing meshes on those devices (a
    method's own `devices=` argument overrides them for one call).

    !!! Example

        ```python
        manager = ed.compat.DeviceMeshManager()
        mesh = manager.create_hybrid_mesh(4, 2)
        manager.get_mesh_info(mesh)["axes"]  # {"data": 4, "model": 2}
        ```
    """

    _devices: tuple[jax.Device, ...] = eqx.field(static=True)

    def __init__(self, devices: Sequence[jax.Device] | None = None):
        self._devices = tuple(jax.devices() if devices is None else devices)
        if not self._devices:
            raise ValueError("DeviceMeshManager: `devices` is empty.")
        _check_devices(self._devices, "DeviceMeshManager")

    @property
    def devices(self) -> list[jax.Device]:
        """The devices meshes are built from, in order."""
        return list(self._devices)

    @property
    def num_devices(self) -> int:
        """How many devices this manager can place meshes on."""
        return len(self._devices)

    def _pick(self, devices: Sequence[jax.Device] | None) -> Sequence[jax.Device]:
        return self._devices if devices is None else devices

    def create_device_mesh(
        self,
        mesh_shape: MeshShape,
        *,
        devices: Sequence[jax.Device] | None = None,
        axis_types: AxisTypes = "auto",
    ) -> Mesh:
        """`create_device_mesh` over this manager's devices."""
        return create_device_mesh(
            mesh_shape, devices=self._pick(devices), axis_types=axis_types
        )

    def create_data_parallel_mesh(
        self,
        num_devices: int | None = None,
        *,
        axis_name: str = "data",
        devices: Sequence[jax.Device] | None = None,
        axis_types: AxisTypes = "auto",
    ) -> Mesh:
        """`create_data_parallel_mesh` over this manager's devices."""
        return create_data_parallel_mesh(
            num_devices,
            axis_name=axis_name,
            devices=self._pick(devices),
            axis_types=axis_types,
        )

    def create_model_parallel_mesh(
        self,
        num_devices: int | None = None,
        *,
        axis_name: str = "model",
        devices: Sequence[jax.Device] | None = None,
        axis_types: AxisTypes = "auto",
    ) -> Mesh:
        """`create_model_parallel_mesh` over this manager's devices."""
        return create_model_parallel_mesh(
            num_devices,
            axis_name=axis_name,
            devices=self._pick(devices),
            axis_types=axis_types,
        )

    def create_hybrid_mesh(
        self,
        data_parallel_size: int = 1,
        model_parallel_size: int = 1,
        *,
        data_axis: str = "data",
        model_axis: str = "model",
        devices: Sequence[jax.Device] | None = None,
        axis_types: AxisTypes = "auto",
    ) -> Mesh:
        """`create_hybrid_mesh` over this manager's devices."""
        return create_hybrid_mesh(
            data_parallel_size,
            model_parallel_size,
            data_axis=data_axis,
            model_axis=model_axis,
            devices=self._pick(devices),
            axis_types=axis_types,
        )

    def get_mesh_info(self, mesh: Mesh) -> dict[str, Any]:
        """`get_mesh_info`."""
        return get_mesh_info(mesh)


class DataParallel(eqx.Module):
    """The data-parallel helpers bound to one data axis.

    `DataParallel(data_axis="data")`; each method takes the arguments of the
    module-level function of the same name, with the axis defaulting to `data_axis`.

    !!! Example

        ```python
        dp = ed.compat.DataParallel()
        batch = dp.shard_batch(batch, dp.create_data_parallel_sharding(mesh))
        ```
    """

    data_axis: str = eqx.field(default="data", static=True)

    def __check_init__(self) -> None:
        if not isinstance(self.data_axis, str) or not self.data_axis:
            raise TypeError(
                f"DataParallel: `data_axis` must be a mesh axis name (a non-empty "
                f"str); got {self.data_axis!r}."
            )

    def create_data_parallel_sharding(
        self, mesh: Mesh, data_axis: str | None = None
    ) -> NamedSharding:
        """`create_data_parallel_sharding` over `data_axis` (default this object's)."""
        return create_data_parallel_sharding(mesh, data_axis or self.data_axis)

    def shard_batch(self, batch: Any, sharding: NamedSharding) -> Any:
        """`shard_batch`."""
        return shard_batch(batch, sharding)

    def shard_model_state(
        self,
        state: Any,
        mesh: Mesh,
        param_sharding: str = "replicate",
        *,
        axis_name: str | None = None,
        min_weight_size: int = 2**18,
    ) -> Any:
        """`shard_model_state`; `"shard"` shards over this object's `data_axis` unless
        `axis_name` is given."""
        return shard_model_state(
            state,
            mesh,
            param_sharding,
            axis_name=axis_name or self.data_axis,
            min_weight_size=min_weight_size,
        )

    def replicate_params(self, params: Any, mesh: Mesh) -> Any:
        """`replicate_params`."""
        return replicate_params(params, mesh)

    def all_reduce_gradients(
        self,
        gradients: Any,
        reduce_type: str = "mean",
        axis_name: AxisName | None = None,
    ) -> Any:
        """`all_reduce_gradients` over `axis_name` (default this object's axis)."""
        return all_reduce_gradients(gradients, reduce_type, axis_name or self.data_axis)


class _UseOwnAxis:
    """Sentinel default: 'use the axis name this object was built with'."""

    def __repr__(self) -> str:
        return "<own axis_name>"


OWN_AXIS = _UseOwnAxis()


class DistributedMetrics(eqx.Module):
    """The metric reductions bound to one `axis_name`.

    `DistributedMetrics(axis_name="data")`; `axis_name=None` selects global mode for
    every method. Each method also accepts `axis_name=` to override it for one call.

    !!! Example

        ```python
        dm = ed.compat.DistributedMetrics()
        metrics = dm.reduce_custom({"loss": loss, "n": n}, {"n": "sum"})
        ```
    """

    axis_name: AxisName | None = eqx.field(default="data", static=True)

    def _axis(self, override: AxisName | _UseOwnAxis | None) -> AxisName | None:
        return self.axis_name if isinstance(override, _UseOwnAxis) else override

    def reduce_mean(
        self, metrics: Any, axis_name: AxisName | _UseOwnAxis | None = OWN_AXIS
    ) -> Any:
        """`reduce_mean` over this object's axis."""
        return reduce_mean(metrics, self._axis(axis_name))

    def reduce_sum(
        self, metrics: Any, axis_name: AxisName | _UseOwnAxis | None = OWN_AXIS
    ) -> Any:
        """`reduce_sum` over this object's axis."""
        return reduce_sum(metrics, self._axis(axis_name))

    def reduce_max(
        self, metrics: Any, axis_name: AxisName | _UseOwnAxis | None = OWN_AXIS
    ) -> Any:
        """`reduce_max` over this object's axis."""
        return reduce_max(metrics, self._axis(axis_name))

    def reduce_min(
        self, metrics: Any, axis_name: AxisName | _UseOwnAxis | None = OWN_AXIS
    ) -> Any:
        """`reduce_min` over this object's axis."""
        return reduce_min(metrics, self._axis(axis_name))

    def reduce_custom(
        self,
        metrics: Mapping[str, Any],
        reduce_fn: Mapping[str, str | None] | None = None,
        axis_name: AxisName | _UseOwnAxis | None = OWN_AXIS,
    ) -> dict[str, Any]:
        """`reduce_custom` over this object's axis."""
        return reduce_custom(metrics, reduce_fn, self._axis(axis_name))

    def all_gather(
        self,
        metrics: Any,
        axis_name: AxisName | _UseOwnAxis = OWN_AXIS,
        *,
        tiled: bool = False,
    ) -> Any:
        """`all_gather` over this object's axis (which must not be `None`)."""
        axis = self._axis(axis_name)
        if axis is None:
            raise ValueError(
                "DistributedMetrics.all_gather: this object has axis_name=None "
                "(global mode), but gathering needs a mesh axis; pass axis_name=..."
            )
        return all_gather(metrics, axis, tiled=tiled)

    def collect_from_devices(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """`collect_from_devices`."""
        return collect_from_devices(metrics)
