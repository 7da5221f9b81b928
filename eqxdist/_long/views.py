"""Which view a function of a sharded sequence or vocabulary is called in, and the
global view's `shard_map`.

- the *device view*: the mesh axis is bound (inside `jax.shard_map`, or a step's
  `view="device"` loss); the arrays are this device's blocks.
- the *global view*: the axis is not bound, but the context mesh
  (`jax.sharding.get_abstract_mesh()`, set by `jax.set_mesh` or a step's
  `view="global"`) has it; the arrays are whole, and the function shards itself
  over that one axis with `jax.shard_map`, leaving the mesh's other axes to
  XLA's partitioner (a batch stays sharded over the data axes).
"""

from collections.abc import Callable
from typing import Any, Literal

import jax


def is_bound(axis: str) -> bool:
    try:
        jax.lax.axis_size(axis)
    except NameError:
        return False
    return True


def check_bound(axis: str, caller: str, argument: str) -> None:
    """A `ValueError` naming `caller`, `argument` and the axis when `axis` is not
    bound (a device-view-only function called outside `jax.shard_map`)."""
    if not is_bound(axis):
        raise ValueError(
            f"{caller}: `{argument}`={axis!r} is not bound here; call it in the "
            f"device view, inside `jax.shard_map` over a mesh with an axis {axis!r} "
            "(or a step's loss with view='device')."
        )


def view_of(axis: str, caller: str, argument: str) -> Literal["device", "global"]:
    """`"device"` when `axis` is bound, `"global"` when the context mesh has it,
    else a `ValueError` saying both ways to call `caller`."""
    if is_bound(axis):
        return "device"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and axis in mesh.axis_names:
        return "global"
    axes = "no context mesh" if mesh.empty else f"the mesh axes {mesh.axis_names}"
    raise ValueError(
        f"{caller}: `{argument}`={axis!r} is neither bound (device view: call it "
        f"inside `jax.shard_map` over a mesh with an axis {axis!r}) nor an axis of "
        f"the context mesh (global view: call it under `jax.set_mesh(mesh)` for a "
        f"mesh with that axis, e.g. in a step); found {axes}. Name an axis of your "
        "mesh, or pass None for one device."
    )


def size_in_context(axis: str) -> int:
    """The size of `axis` in the context mesh (the global view)."""
    size: int = jax.sharding.get_abstract_mesh().shape[axis]
    return size


def run_global(
    body: Callable[..., Any], axis: str, args: tuple[Any, ...], out_sharding: Any
) -> Any:
    """`body(*args)`, the global view of a function: with `axis` `Auto`, so that
    `body` may reorder and split whole sequences over it and `shard_over` it. On
    a mesh whose `axis` is `Explicit` that is `jax.sharding.auto_axes`, the
    results typed as `out_sharding` (a `PartitionSpec` or a tree of them)."""
    if axis not in jax.sharding.get_abstract_mesh().explicit_axes:
        return body(*args)
    return jax.sharding.auto_axes(body, out_sharding=out_sharding)(*args)


def shard_over(
    fn: Callable[..., Any],
    axis: str,
    args: tuple[Any, ...],
    in_specs: tuple[Any, ...],
    out_specs: Any,
) -> Any:
    """`fn(*args)` in the device view of `axis` (the global view's way in, inside
    `run_global`): a `jax.shard_map` over `axis` alone, of the context mesh, the
    other axes left to XLA's partitioner."""
    mesh = jax.sharding.get_abstract_mesh()
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={axis}
    )
    return mapped(*args)
