"""FSDP's collectives, inside `jax.shard_map`: keep a device's shard of each
parameter (`shard_params`), all-gather the shards with a reduce-scatter gradient
(`gather_params`, `gather_tree`, `gather_leaf`) and average the gradients not
averaged yet (`sync_gradients`).

All layouts come from the one rule of `fsdp_specs`; the functions here act on
a parameter pytree together with its specs.
"""

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._utils import check_axis_bound, is_array, path_str, typecheck
from .rules import fsdp_specs, is_spec_leaf, sharded_dim, spec_axes


def _spec_leaves(
    tree: Any, specs: Any, caller: str, argument: str
) -> tuple[list[Any], list[Any], Any]:
    """Flatten `tree` and `specs` side by side, with a clear error when they differ.

    `specs` leads (a `PartitionSpec` or `None` per leaf), so `tree` may hold `None`
    where `specs` has a spec: gradients of non-differentiable leaves are `None`."""
    spec_def: Any
    with_path, spec_def = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=is_spec_leaf
    )
    try:
        leaves = spec_def.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{caller}: `specs` do not match the structure of `{argument}`; build "
            f"them from the same tree (e.g. with `fsdp_specs`). Details: {e}"
        ) from None
    spec_leaves = [s for _, s in with_path]
    paths = [path_str(p) for p, _ in with_path]
    for path, leaf, spec in zip(paths, leaves, spec_leaves, strict=True):
        if not is_array(leaf):
            continue
        if not isinstance(spec, P):
            raise ValueError(
                f"{caller}: `{argument}` leaf {path} is an array of shape "
                f"{jnp.shape(leaf)} but its spec is {spec!r}; expected a "
                "PartitionSpec."
            )
        if len(spec) > jnp.ndim(leaf):
            raise ValueError(
                f"{caller}: spec {spec} of leaf {path} has {len(spec)} entries but "
                f"the leaf has shape {jnp.shape(leaf)}; expected at most "
                f"{jnp.ndim(leaf)}."
            )
    return leaves, spec_leaves, spec_def


@typecheck
def shard_params(
    params: PyTree[Any], axis_name: str = "data", min_weight_size: int = 2**18
) -> tuple[PyTree[Any], PyTree[Any]]:
    """Keep only this device's shard of each large parameter, inside `jax.shard_map`.

    For parameters that arrive replicated (the same full value on every device), e.g.
    freshly initialised ones. Each leaf is split as `fsdp_specs` says; this device
    keeps the block at its index along `axis_name`.

    **Arguments:**

    - `params`: a pytree of replicated arrays (an Equinox model works; non-array
      leaves pass through).
    - `axis_name`: the mesh axis to shard over.
    - `min_weight_size`: leaves with at most this many elements stay whole.

    **Returns:**

    `(local_shards, specs)`: the local pytree and the `PartitionSpec`s (of the full
    parameters) that `gather_params`, `sync_gradients` and `out_specs` take.

    **Raises:**

    `ValueError` if `axis_name` is not bound (called outside `shard_map`).

    !!! Example

        ```python
        def init(params):
            shards, specs = ed.shard_params(params, "data", min_weight_size=2**4)
            return shards
        ```
    """
    (name,) = check_axis_bound(axis_name, "shard_params")
    size = jax.lax.axis_size(name)
    specs = fsdp_specs(params, size, axis_name=name, min_weight_size=min_weight_size)
    index = jax.lax.axis_index(name)

    def split(x: Any, spec: Any) -> Any:
        dim = sharded_dim(spec, name) if is_array(x) else None
        if dim is None:
            return x
        block = x.shape[dim] // size
        return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=dim)

    return jax.tree.map(split, params, specs), specs


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x: jax.Array, dim: int, axis_name: str) -> jax.Array:
    full: jax.Array = jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)
    return full


def _gather_fwd(x: jax.Array, dim: int, axis_name: str) -> tuple[jax.Array, None]:
    return _gather(x, dim, axis_name), None


def scatter_mean(g: jax.Array, dim: int, axis_name: str) -> jax.Array:
    """Inside `shard_map`: the mean over `axis_name` of every device's `g`, each
    device keeping its block along `dim` (a reduce-scatter)."""
    size = jax.lax.axis_size(axis_name)
    scattered = jax.lax.psum_scatter(g, axis_name, scatter_dimension=dim, tiled=True)
    mean: jax.Array = scattered / size
    return mean


def _gather_bwd(dim: int, axis_name: str, _: None, g: jax.Array) -> tuple[jax.Array]:
    # Each device's cotangent is its own gradient of the full parameter; summing
    # them onto the owning shard and dividing gives the data-parallel mean.
    return (scatter_mean(g, dim, axis_name),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather_leaf(x: jax.Array, dim: int, axis_name: str) -> jax.Array:
    """All-gather one shard along `dim`; gradient: mean over the axis, scattered."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return _gather(x, dim, axis_name)
    full: jax.Array = jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)
    return full


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_all(xs: list[jax.Array], dims: tuple[int, ...], axis_name: str) -> Any:
    return [
        jax.lax.all_gather(x, axis_name, axis=d, tiled=True)
        for x, d in zip(xs, dims, strict=True)
    ]


def _gather_all_fwd(
    xs: list[jax.Array], dims: tuple[int, ...], axis_name: str
) -> tuple[Any, None]:
    return _gather_all(xs, dims, axis_name), None


def _gather_all_bwd(
    dims: tuple[int, ...], axis_name: str, _: None, gs: list[jax.Array]
) -> tuple[list[jax.Array]]:
    # The gradients of all the leaves in one reduce-scatter per dtype: each full
    # gradient as rows of the device blocks of its sharded dimension, the rows of
    # every leaf side by side, so that device i's block of every leaf lands on
    # device i. One collective instead of one per leaf matters where each costs a
    # synchronisation of every device (XLA:CPU, which combines no reduce-scatters).
    size = jax.lax.axis_size(axis_name)
    moved = [jnp.moveaxis(g, d, 0) for g, d in zip(gs, dims, strict=True)]
    rows = [m.reshape(size, -1) for m in moved]
    out: list[Any] = [None] * len(gs)
    for dtype in sorted({r.dtype for r in rows}, key=str):
        which = [i for i, r in enumerate(rows) if r.dtype == dtype]
        flat = jnp.concatenate([rows[i] for i in which], axis=1)
        mean = scatter_mean(flat, 0, axis_name)[0]
        ends = list(itertools.accumulate(rows[i].shape[1] for i in which))
        for i, part in zip(which, jnp.split(mean, ends[:-1]), strict=True):
            block = part.reshape(moved[i].shape[0] // size, *moved[i].shape[1:])
            out[i] = jnp.moveaxis(block, 0, dims[i])
    return (out,)


_gather_all.defvjp(_gather_all_fwd, _gather_all_bwd)


# The largest full gradient `gather_tree(combined=True)` puts into the combined
# reduce-scatter. Combining saves a synchronisation of every device per leaf but
# copies the leaf's full gradient into one buffer: a win for small leaves (a
# transformer's), a loss for large ones, whose own reduce-scatters already take
# far longer than the synchronisation and whose copies double the temporaries
# (measured in docs/benchmarks.md, "FSDP on the transformer").
COMBINE_MAX_BYTES = 2**20


def gather_tree(
    params: PyTree[Any],
    specs: PyTree[Any],
    axis_name: str,
    *,
    combined: bool,
) -> PyTree[Any]:
    """`gather_params`; `combined=True` reduce-scatters the gradients of the
    floating-point leaves of at most `COMBINE_MAX_BYTES` together (one collective
    per dtype, which needs their full gradients at once: for a step that holds them
    all anyway, as one that gathers once per step does)."""
    size = jax.lax.axis_size(axis_name)
    leaves, spec_leaves, spec_def = _spec_leaves(
        params, specs, "gather_params", "params"
    )
    out = list(leaves)
    together: list[tuple[int, int]] = []
    for i, (leaf, spec) in enumerate(zip(leaves, spec_leaves, strict=True)):
        dim = sharded_dim(spec, axis_name) if is_array(leaf) else None
        if dim is None:
            continue
        small = leaf.size * size * leaf.dtype.itemsize <= COMBINE_MAX_BYTES
        if combined and small and jnp.issubdtype(leaf.dtype, jnp.inexact):
            together.append((i, dim))
        else:
            out[i] = gather_leaf(leaf, dim, axis_name)
    if together:
        full = _gather_all(
            [leaves[i] for i, _ in together], tuple(d for _, d in together), axis_name
        )
        for (i, _), x in zip(together, full, strict=True):
            out[i] = x
    return jax.tree.unflatten(spec_def, out)


@typecheck
def gather_params(
    params: PyTree[Any], specs: PyTree[Any], axis_name: str = "data"
) -> PyTree[Any]:
    """All-gather every parameter that `specs` shards over `axis_name`, inside
    `jax.shard_map`, so the model can run with full weights.

    The backward pass is a reduce-scatter divided by the axis size: each shard
    receives the *mean* over devices of the gradient of its block, exactly what a
    data-parallel step gets from `lax.pmean` of full gradients. So an FSDP step needs
    no further reduction for sharded leaves (see `sync_gradients`).

    **Arguments:**

    - `params`: this device's shards (as returned by `shard_params`, or the inside
      of a `shard_map` whose `in_specs` are `specs`). Non-array leaves pass through.
    - `specs`: the `PartitionSpec` of each leaf's *full* array, e.g. from
      `fsdp_specs`. A leaf may be sharded on any dimension.
    - `axis_name`: the mesh axis to gather over.

    **Returns:**

    `params` with every leaf sharded over `axis_name` gathered to full size.

    **Raises:**

    `ValueError` if `axis_name` is not bound, or if `specs` do not match `params`
    (structure, or a spec with more entries than its leaf has dimensions).

    !!! Example

        ```python
        def loss(shards, x):
            model = ed.gather_params(shards, specs)
            return jnp.mean(model(x) ** 2)
        ```
    """
    (name,) = check_axis_bound(axis_name, "gather_params")
    return gather_tree(params, specs, name, combined=False)


def unsynced_axes(spec: Any, axis_names: tuple[str, ...]) -> tuple[str, ...]:
    """The axes of `axis_names` over which the gradient of a leaf laid out by
    `spec` is still a per-device value (`sync_gradients` averages over them): the
    ones `spec` does not shard over, whose gather already averaged."""
    names = spec_axes(spec)
    return tuple(a for a in axis_names if a not in names)


@typecheck
def sync_gradients(
    grads: PyTree[Any],
    specs: PyTree[Any],
    axis_names: str | Sequence[str] = ("data",),
) -> PyTree[Any]:
    """Average gradients across devices where they are not averaged yet, inside
    `jax.shard_map` (with `check_vma=False`, as in the training steps).

    Gradients of replicated leaves are per-device values and are `pmean`-ed over all
    of `axis_names`; gradients of leaves sharded over some of the names (which
    `gather_params` already averaged over those) are `pmean`-ed over the others only.

    **Arguments:**

    - `grads`: the gradient pytree; `None` leaves (non-differentiable parameters)
      and other non-array leaves pass through.
    - `specs`: the parameters' `PartitionSpec`s (as for `gather_params`).
    - `axis_names`: every mesh axis the batch is split over.

    **Raises:**

    `ValueError` if an axis is not bound or `specs` do not match `grads`.

    !!! Example

        ```python
        grads = ed.sync_gradients(grads, specs, ("data",))
        ```
    """
    axis_names = check_axis_bound(
        axis_names if isinstance(axis_names, str) else tuple(axis_names),
        "sync_gradients",
    )
    leaves, spec_leaves, spec_def = _spec_leaves(
        grads, specs, "sync_gradients", "grads"
    )

    def sync(g: Any, spec: Any) -> Any:
        if not is_array(g):
            return g
        rest = unsynced_axes(spec, axis_names)
        return jax.lax.pmean(g, rest) if rest else g

    out = [sync(g, s) for g, s in zip(leaves, spec_leaves, strict=True)]
    return jax.tree.unflatten(spec_def, out)
