"""Data parallelism's helpers: placing batches and model state on a mesh, a
different random key per device, and all-reducing gradients."""

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray, PyTree

from ._utils import (
    AxisName,
    axis_names,
    check_array_leaves,
    check_axis_bound,
    check_axis_in_mesh,
    is_array,
    map_arrays,
    path_str,
    plural,
    strong_types,
    typecheck,
)


@typecheck
def create_data_parallel_sharding(
    mesh: Mesh, data_axis: AxisName = "data"
) -> NamedSharding:
    """The sharding that splits arrays along their first (batch) dimension over
    `data_axis`: `NamedSharding(mesh, P(data_axis))`. A tuple of axes splits the
    rows over all of them, in mesh order (e.g. `("replica", "data")` for HSDP).

    **Raises:**

    `ValueError` naming the mesh's axes if an axis of `data_axis` is not one of
    them.
    """
    for axis in axis_names(data_axis):
        check_axis_in_mesh(mesh, axis, "create_data_parallel_sharding", "data_axis")
    return NamedSharding(mesh, P(data_axis))


def local_shard_count(sharding: NamedSharding, global_shards: int) -> int:
    # How many distinct row blocks this process's devices hold: with one row per
    # shard, that is the number of distinct row indices among addressable devices.
    index_map = sharding.addressable_devices_indices_map((global_shards,))
    return len({index[0].start for index in index_map.values() if index})


@typecheck
def shard_batch(batch: PyTree[Any], sharding: NamedSharding) -> PyTree[Any]:
    """Place a batch on the mesh, split along its leading (batch) dimension.

    **Arguments:**

    - `batch`: any pytree. Array leaves (`jax.Array` or `np.ndarray`) of rank >= 1 are
      split along axis 0 over the mesh axes of `sharding.spec[0]`; 0-d arrays are
      replicated; other leaves pass through.
    - `sharding`: usually `create_data_parallel_sharding(mesh)`.

    **Returns:**

    The batch as global `jax.Array`s. In a multi-process run each process passes
    *its own* rows: the leading size of the result is the sum over processes.

    **Raises:**

    `ValueError` naming the leaf path, its leading size and the shard count when the
    leading size does not divide evenly.

    !!! Example

        ```python
        sharding = ed.create_data_parallel_sharding(mesh)
        batch = ed.shard_batch({"x": np.ones((128, 784)), "y": labels}, sharding)
        ```
    """
    mesh = sharding.mesh
    batch_axes = sharding.spec[0] if len(sharding.spec) else None
    row_sharding = NamedSharding(mesh, P(batch_axes))
    replicated = NamedSharding(mesh, P())
    total = math.prod(mesh.shape[a] for a in axis_names(batch_axes or ()))
    local = total if row_sharding.is_fully_addressable else None
    if local is None:
        local = local_shard_count(row_sharding, total)

    check_array_leaves(batch, "shard_batch", "batch")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
    arrays, shardings, positions = [], [], []
    for i, (path, leaf) in enumerate(leaves):
        if not is_array(leaf):
            continue
        if np.ndim(leaf) == 0:
            target = replicated
        else:
            rows = np.shape(leaf)[0]
            if rows % local:
                scope = "this process's" if local != total else "the"
                raise ValueError(
                    f"shard_batch: leaf {path_str(path)} has leading dimension {rows},"
                    f" which is not divisible by {scope} {plural(local, 'shard')} "
                    f"along {batch_axes!r}; make the batch size a multiple of {local}."
                )
            target = row_sharding
        arrays.append(leaf)
        shardings.append(target)
        positions.append(i)

    if row_sharding.is_fully_addressable:
        placed = jax.device_put(arrays, shardings)
    else:
        placed = [
            jax.make_array_from_process_local_data(s, np.asarray(a))
            for a, s in zip(arrays, shardings, strict=True)
        ]
    out = [leaf for _, leaf in leaves]
    for i, array in zip(positions, placed, strict=True):
        out[i] = array
    return jax.tree_util.tree_unflatten(treedef, out)


def _put_global(x: Any, sharding: NamedSharding) -> Any:
    """`device_put` onto a sharding that spans several processes.

    JAX refuses to move an array committed to one local device (or a PRNG key)
    onto devices of other processes, so the host value is put instead: every
    process holds the same value, as it does for freshly built state."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _put_global(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x), sharding)


# A copy keeps its input's sharding; jitted once, for every tree structure.
_copy = jax.jit(functools.partial(jax.tree.map, jnp.copy))


def place(tree: Any, specs: Any, mesh: Mesh, *, copy: bool = False) -> Any:
    """Put every array leaf of `tree` on `mesh` with its `PartitionSpec` in `specs` (a
    pytree of `tree`'s structure with `None` at non-array leaves, as `fsdp_specs`
    returns); other leaves are kept, so an `eqx.Module` stays one.

    Partitioning first keeps `None` nodes of `tree` (e.g. `Linear(use_bias=False)`)
    aligned with those of `specs`. `copy=True` gives the result buffers of its own,
    so that donating it never deletes the caller's arrays (replicating a
    single-device array otherwise reuses that device's buffer). Works when `mesh`
    spans several processes, each passing the same values."""
    arrays, static = eqx.partition(strong_types(tree), is_array)
    shardings = jax.tree.map(lambda _, s: NamedSharding(mesh, s), arrays, specs)
    if mesh.is_multi_process:
        placed = jax.tree.map(_put_global, arrays, shardings)
    else:
        placed = jax.device_put(arrays, shardings)
    return eqx.combine(_copy(placed) if copy else placed, static)


@typecheck
def replicate_params(params: PyTree[Any], mesh: Mesh) -> PyTree[Any]:
    """Put a full copy of every array leaf of `params` on every device of `mesh`
    (`P()`); non-array leaves pass through, so an `eqx.Module` stays one."""
    check_array_leaves(params, "replicate_params", "params")
    return place(
        params, jax.tree.map(lambda x: P() if is_array(x) else None, params), mesh
    )


@typecheck
def fold_rng_over_axis(key: PRNGKeyArray, axis_name: AxisName) -> Array:
    """A different key on each device along `axis_name`, inside `jax.shard_map`.

    Folds the device's index along `axis_name` into `key`, so that e.g. dropout
    masks differ between the devices that hold different parts of a batch, while
    devices that differ only along other axes (say, a model axis) agree.

    **Arguments:**

    - `key`: a PRNG key (typed `jax.random.key` or raw `uint32[2]`), the same on
      every device.
    - `axis_name`: the mesh axis (or axes) to vary over.

    !!! Example

        ```python
        def loss_fn(model, batch, key):
            key = ed.fold_rng_over_axis(key, "data")  # per-device dropout key
            ...
        ```
    """
    names = check_axis_bound(axis_name, "fold_rng_over_axis")
    return jax.random.fold_in(key, jax.lax.axis_index(names))


_GRADIENT_REDUCTIONS = {"mean": jax.lax.pmean, "sum": jax.lax.psum}


@typecheck
def all_reduce_gradients(
    gradients: PyTree[Any],
    reduce_type: str = "mean",
    axis_name: AxisName = "data",
) -> PyTree[Any]:
    """Average (`"mean"`) or sum (`"sum"`) every array leaf of `gradients` across the
    devices of `axis_name`, inside `jax.shard_map`: the gradient all-reduce of data
    parallelism.

    **Raises:**

    `ValueError` ("Unsupported reduce_type") for any other `reduce_type`, and the
    unbound-axis `ValueError` of `reduce_mean` outside `shard_map`.

    !!! Note

        Under `shard_map(..., check_vma=True)` (JAX's default), the gradient of a
        *replicated* parameter taken inside the map is already summed over the axis
        by JAX. Call this on gradients of per-device (varying) values, or under
        `check_vma=False`, as the training steps of eqxdist do.
    """
    if reduce_type not in _GRADIENT_REDUCTIONS:
        raise ValueError(
            f"all_reduce_gradients: Unsupported reduce_type {reduce_type!r}; use "
            f"{list(_GRADIENT_REDUCTIONS)}."
        )
    names = check_axis_bound(axis_name, "all_reduce_gradients")
    check_array_leaves(gradients, "all_reduce_gradients", "gradients", keys="reduced")
    reduce = _GRADIENT_REDUCTIONS[reduce_type]
    return map_arrays(lambda g: reduce(g, names), gradients)
