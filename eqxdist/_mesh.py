"""Building device meshes: named axes over the devices of every process, and
simulated CPU devices for running multi-device code on one machine."""

import functools
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from ._distributed import COORDINATOR_ENV
from ._jax import backends_are_initialized
from ._utils import plural, typecheck

MeshShape = Mapping[str, int] | Sequence[tuple[str, int]]
AxisTypes = str | tuple[AxisType, ...]
"""The `axis_types` of the mesh builders: `"auto"`, `"explicit"` or one
`AxisType` per axis."""

_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


@typecheck
def simulate_cpu_devices(count: int = 8) -> None:
    """Split the host CPU into `count` XLA devices, to run multi-device code (and
    its tests) on a laptop or a CI machine without accelerators.

    Call it before JAX starts its backend, i.e. before the first array is created
    or `jax.devices()` is called (importing `jax` or `eqxdist` is fine). It sets
    `--xla_force_host_platform_device_count` in `XLA_FLAGS`, unless that flag is
    already set (by you, or by `python -m eqxdist.launch` for each process), which
    then wins (with a `UserWarning` when it sets another count outside the
    launcher).

    **Raises:**

    `ValueError` if `count < 1`; `RuntimeError` if the backend has already started
    with another device count, when the flag could no longer take effect.

    !!! Example

        ```python
        import eqxdist as ed

        ed.simulate_cpu_devices(8)
        mesh = ed.create_data_parallel_mesh()  # Mesh('data': 8)
        ```
    """
    if count < 1:
        raise ValueError(f"simulate_cpu_devices: `count` must be >= 1; got {count}.")
    flags = os.environ.get("XLA_FLAGS", "")
    found = _DEVICE_COUNT_FLAG.search(flags)
    if found:
        # Under `python -m eqxdist.launch` the launcher's count per process is
        # the one meant; anywhere else a different count is worth a word.
        if int(found.group(1)) != count and COORDINATOR_ENV not in os.environ:
            warnings.warn(
                f"simulate_cpu_devices({count}): XLA_FLAGS already sets "
                f"--xla_force_host_platform_device_count={found.group(1)}, which "
                f"wins: JAX will have {found.group(1)} CPU devices, not {count}. "
                "Unset that flag to simulate this count.",
                stacklevel=2,
            )
        return
    if backends_are_initialized():
        if jax.device_count() == count:
            return
        raise RuntimeError(
            f"simulate_cpu_devices: JAX has already started with "
            f"{plural(jax.device_count(), 'device')}, so {count} can no longer be "
            "simulated; "
            "call it before creating any array (or set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={count} before starting Python)."
        )
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={count}".strip()
    )


def _parse_shape(mesh_shape: Any) -> list[tuple[str, int]]:
    if isinstance(mesh_shape, Mapping):
        pairs = list(mesh_shape.items())
    elif isinstance(mesh_shape, Sequence) and not isinstance(mesh_shape, str):
        pairs = []
        for item in mesh_shape:
            if not (isinstance(item, Sequence) and len(item) == 2):
                raise TypeError(
                    "create_device_mesh: `mesh_shape` as a sequence must hold "
                    f"(name, size) pairs; got the item {item!r}."
                )
            pairs.append((item[0], item[1]))
    else:
        raise TypeError(
            "create_device_mesh: `mesh_shape` must be a mapping such as "
            f'{{"data": 4, "model": 2}} or a sequence of (name, size) pairs; '
            f"got {mesh_shape!r}."
        )
    if not pairs:
        raise ValueError(
            "create_device_mesh: `mesh_shape` is empty; give at least one axis, "
            'e.g. {"data": -1}.'
        )
    names = [name for name, _ in pairs]
    for name, size in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(
                "create_device_mesh: axis names must be non-empty strings; got "
                f"{name!r} in {names}."
            )
        if isinstance(size, bool) or not isinstance(size, int | np.integer):
            raise TypeError(
                f"create_device_mesh: the size of axis {name!r} must be an int; got "
                f"{size!r} of type {type(size).__name__}."
            )
        if size == 0 or size < -1:
            raise ValueError(
                f"create_device_mesh: the size of axis {name!r} is {size}; sizes must "
                "be positive, or -1 for 'all remaining devices'."
            )
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"create_device_mesh: duplicate axis names {duplicates} in {names}; each "
            "axis needs its own name."
        )
    if sum(size == -1 for _, size in pairs) > 1:
        raise ValueError(
            f"create_device_mesh: more than one axis has size -1 in {dict(pairs)}; at "
            "most one axis can take 'all remaining devices'."
        )
    return [(name, int(size)) for name, size in pairs]


def _axis_types(
    axis_types: AxisTypes, names: tuple[str, ...], caller: str
) -> tuple[AxisType, ...]:
    if isinstance(axis_types, str):
        if axis_types not in _AXIS_TYPES:
            raise ValueError(
                f"{caller}: `axis_types`={axis_types!r} is not a kind of axis; use "
                f"{list(_AXIS_TYPES)} or a tuple of jax.sharding.AxisType, one per "
                "axis."
            )
        return (_AXIS_TYPES[axis_types],) * len(names)
    if len(axis_types) != len(names):
        raise ValueError(
            f"{caller}: `axis_types` has {len(axis_types)} entries for the "
            f"{len(names)} axes {names}; give one AxisType per axis."
        )
    return tuple(axis_types)


def _check_devices(devices: Sequence[Any], caller: str) -> None:
    """`TypeError` for an entry that is not a `jax.Device`; `ValueError` for a device
    listed twice (a mesh would put it at two positions and mis-shard arrays)."""
    seen: dict[Any, int] = {}
    for i, device in enumerate(devices):
        if not isinstance(device, jax.Device):
            raise TypeError(
                f"{caller}: `devices[{i}]` is {device!r} of type "
                f"{type(device).__name__}; expected a `jax.Device` (from "
                "`jax.devices()`)."
            )
        if device in seen:
            raise ValueError(
                f"{caller}: `devices` lists {device} twice (at positions "
                f"{seen[device]} and {i}); each device may appear once."
            )
        seen[device] = i


@typecheck
def create_device_mesh(
    mesh_shape: MeshShape,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: AxisTypes = "auto",
) -> Mesh:
    """Build a `jax.sharding.Mesh` with named axes.

    **Arguments:**

    - `mesh_shape`: the axes in order, as a mapping `{"data": 4, "model": 2}` or a
      sequence of `(name, size)` pairs. One size may be `-1`, meaning "all the
      devices the other axes leave".
    - `devices`: the devices to use, default `jax.devices()` (every process's devices
      in a multi-process run). The first `prod(sizes)` of them are used, in order.
    - `axis_types`: `"auto"` (the default: `AxisType.Auto` axes, so `jax.jit` and
      `jax.shard_map` accept unsharded inputs and XLA decides the sharding of
      every intermediate), `"explicit"` (`AxisType.Explicit` axes, what
      `jax.make_mesh` builds by default: arrays carry their sharding in their
      type), or a tuple of `AxisType`s, one per axis. Every eqxdist function
      takes either kind, with the same results.

    **Returns:**

    The mesh.

    **Raises:**

    `ValueError` for an empty shape, a size of 0 or below -1, several `-1`s, a `-1`
    that does not divide the device count, empty or duplicate names, more devices
    than available ("Not enough devices"), or `axis_types` of the wrong length or
    an unknown name; `TypeError` for a non-int size.

    !!! Example

        ```python
        mesh = ed.create_device_mesh({"data": -1, "model": 2})  # 4 x 2 on 8 devices
        ```
    """
    pairs = _parse_shape(mesh_shape)
    available = list(jax.devices() if devices is None else devices)
    if not available:
        raise ValueError("create_device_mesh: `devices` is empty; pass some devices.")
    _check_devices(available, "create_device_mesh")
    known = math.prod(size for _, size in pairs if size != -1)
    if any(size == -1 for _, size in pairs):
        if len(available) % known != 0:
            raise ValueError(
                f"create_device_mesh: cannot resolve -1 in {dict(pairs)}: the "
                f"{len(available)} available devices are not divisible by the product "
                f"of the other sizes ({known})."
            )
        pairs = [
            (name, len(available) // known if size == -1 else size)
            for name, size in pairs
        ]
    needed = math.prod(size for _, size in pairs)
    if needed > len(available):
        raise ValueError(
            f"create_device_mesh: Not enough devices: mesh {dict(pairs)} needs "
            f"{plural(needed, 'device')} but only {len(available)} "
            f"{'is' if len(available) == 1 else 'are'} available."
        )
    grid = np.empty(needed, dtype=object)
    grid[:] = available[:needed]
    names = tuple(name for name, _ in pairs)
    return Mesh(
        grid.reshape([size for _, size in pairs]),
        names,
        axis_types=_axis_types(axis_types, names, "create_device_mesh"),
    )


def _one_axis_mesh(
    num_devices: int | None,
    axis_name: str,
    devices: Sequence[jax.Device] | None,
    axis_types: AxisTypes,
) -> Mesh:
    return create_device_mesh(
        {axis_name: -1 if num_devices is None else num_devices},
        devices=devices,
        axis_types=axis_types,
    )


@typecheck
def create_data_parallel_mesh(
    num_devices: int | None = None,
    *,
    axis_name: str = "data",
    devices: Sequence[jax.Device] | None = None,
    axis_types: AxisTypes = "auto",
) -> Mesh:
    """A 1-D mesh for data parallelism (and FSDP) over `num_devices` devices (default:
    all of them) with the axis `axis_name`. `axis_types` and errors as
    `create_device_mesh`.

    !!! Example

        ```python
        mesh = ed.create_data_parallel_mesh()  # Mesh('data': 8)
        ```
    """
    return _one_axis_mesh(num_devices, axis_name, devices, axis_types)


@typecheck
def create_model_parallel_mesh(
    num_devices: int | None = None,
    *,
    axis_name: str = "model",
    devices: Sequence[jax.Device] | None = None,
    axis_types: AxisTypes = "auto",
) -> Mesh:
    """A 1-D mesh for model (tensor) parallelism over `num_devices` devices (default:
    all of them) with the axis `axis_name`. `axis_types` and errors as
    `create_device_mesh`."""
    return _one_axis_mesh(num_devices, axis_name, devices, axis_types)


@typecheck
def create_hybrid_mesh(
    data_parallel_size: int = 1,
    model_parallel_size: int = 1,
    *,
    data_axis: str = "data",
    model_axis: str = "model",
    devices: Sequence[jax.Device] | None = None,
    axis_types: AxisTypes = "auto",
) -> Mesh:
    """A 2-D `(data_axis, model_axis)` mesh of `data_parallel_size x
    model_parallel_size` devices; either size may be `-1` ("the rest").
    `axis_types` as `create_device_mesh`.

    !!! Example

        ```python
        mesh = ed.create_hybrid_mesh(-1, 2)  # Mesh('data': 4, 'model': 2) on 8 devices
        ```
    """
    return create_device_mesh(
        [(data_axis, data_parallel_size), (model_axis, model_parallel_size)],
        devices=devices,
        axis_types=axis_types,
    )


@typecheck
def get_mesh_info(mesh: Mesh) -> dict[str, Any]:
    """Describe a mesh, for logging.

    **Returns:**

    A dict with `"total_devices"` (int), `"axes"` (axis name -> size, in mesh order),
    `"axis_names"`, `"process_count"` (processes the mesh spans),
    `"local_devices"` (devices of this process in the mesh) and `"platform"`.
    """
    devices = list(mesh.devices.flat)
    return {
        "total_devices": int(mesh.size),
        "axes": {name: int(size) for name, size in mesh.shape.items()},
        "axis_names": tuple(mesh.axis_names),
        "process_count": len({d.process_index for d in devices}),
        "local_devices": sum(d.process_index == jax.process_index() for d in devices),
        "platform": devices[0].platform,
    }


# -- the meshes JAX builds ------------------------------------------------------------
#
# `jax.make_mesh` builds `Explicit` axes (JAX 0.9+): arrays carry their sharding in
# their type, and every operation must know its output's sharding, which a loss
# written for one device (`x @ w` on a weight sharded over a model axis) does not
# say. eqxdist's steps place arrays on the caller's mesh, so that what they return
# works in the caller's own Explicit-mode code, but compute on the same devices
# with every axis `Auto`, where XLA's partitioner decides, as it does for a mesh
# `create_device_mesh` builds: the same program on either kind.


def explicit_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes of `mesh` whose type is `Explicit`."""
    return tuple(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == AxisType.Explicit
    )


@functools.cache
def compute_mesh(mesh: Mesh, with_auto_axis: bool = False) -> Mesh:
    """The mesh a step computes on: `mesh`'s devices and axis names, every axis
    `Auto` (`mesh` itself when it is so already); `with_auto_axis` adds a trailing
    `Auto` axis of size 1. One object per argument."""
    if not with_auto_axis and not explicit_axes(mesh):
        return mesh
    devices, names = mesh.devices, tuple(mesh.axis_names)
    if with_auto_axis:
        devices, names = devices[..., None], (*names, "_eqxdist_auto")
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def retyped(args: Any, mesh: Mesh) -> Any:
    """`args` of a `jax.jit` whose arguments live on `mesh`, traced with a
    `compute_mesh(mesh, ...)` as the context mesh (`jax.set_mesh` around the
    call): arrays typed by `mesh` retyped for the context (unsharded over its
    `Auto` axes: no data moves, the layout stays the one `jit` was given). Not
    needed, and not done, where the context is `mesh` itself.

    Unlike `jax.sharding.auto_axes` this adds no sharding constraint (results
    take `jit`'s `out_shardings`), so an Explicit mesh compiles the very program
    an Auto mesh does."""
    if jax.sharding.get_abstract_mesh() == mesh.abstract_mesh:
        return args

    def retype(x: Any) -> Any:
        return jax.sharding.reshard(x, P()) if isinstance(x, jax.Array) else x

    return jax.tree.map(retype, args)
