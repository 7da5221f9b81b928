"""Global sums of squares and finiteness sums of sharded or replicated pytrees,
with each device reading only its own share of every leaf.

`step_info`'s norms and `skip_nonfinite`'s check read every gradient, update and
parameter. On global arrays, a leaf replicated over the data axes (every leaf under
data parallelism) would be read whole by every device: as many extra passes over
the model as the optimizer update makes, for three scalars. Here each of the
devices that hold the same copy of a leaf reads a different slice of it, and one
all-reduce of a few scalars adds the parts up, so a device reads about
1/(number of copies) of each leaf.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array

from ._rules import is_spec_leaf, spec_axes
from ._utils import is_array


def _sums(x: Array, finish: Callable[[Array], Array] | None = None) -> Array:
    """`[sum of squares, sum of x * 0]` of `finish(x)` in float32: the second is 0
    when every element is finite and NaN otherwise. Two reductions of `x` itself,
    each with its product fused in (stacking the products first writes both out
    in full, then reads them back)."""
    if finish is not None:
        x = finish(x)
    x32 = x.astype(jnp.float32)  # not flattened: that would regather rule axes
    return jnp.stack([jnp.sum(x32 * x32), jnp.sum(x32 * 0.0)])


def _taken(spec: P | None, ndim: int) -> set[int]:
    return {d for d, e in enumerate(tuple(spec or ())[:ndim]) if e is not None}


def _share(
    x: Array,
    spec: P | None,
    manual: P | None,
    axes: tuple[str, ...],
    mesh: Mesh,
    finish: Callable[[Array], Array] | None = None,
) -> Array:
    """Inside `shard_map` (manual over `axes`): this device's part of the sums of
    leaf `finish(x)`, laid out by `manual` over the data axes and by `spec` over
    the others. The devices holding the same copy of `x` (those along the data
    axes `manual` does not shard over) each take an equal slice of its largest
    dimension no axis shards; the first also takes the remainder. `finish`, an
    elementwise function, is applied to the slices only."""
    copies = tuple(a for a in axes if a not in spec_axes(manual))
    count = math.prod(mesh.shape[a] for a in copies)
    if count == 1:
        return _sums(x, finish)
    index = jax.lax.axis_index(copies)
    taken = _taken(spec, x.ndim) | _taken(manual, x.ndim)
    free = [d for d in range(x.ndim) if d not in taken and x.shape[d] >= count]
    if not free:  # small or fully sharded elsewhere: one copy adds it up
        return jnp.where(index == 0, _sums(x, finish), 0.0)
    dim = max(free, key=lambda d: (x.shape[d], -d))  # contiguous slabs
    size = x.shape[dim] // count
    part = _sums(jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=dim), finish)
    rest = x.shape[dim] - size * count
    if rest:
        tail = jax.lax.slice_in_dim(x, size * count, x.shape[dim], axis=dim)
        part = part + jnp.where(index == 0, _sums(tail, finish), 0.0)
    return part


def local_sums(
    tree: Any,
    specs: Any,
    manual: Any,
    axes: tuple[str, ...],
    mesh: Mesh,
    finish: Any = None,
) -> Array:
    """Inside `shard_map`: this device's share of `tree`'s (sum of squares,
    finiteness sum); `specs` are the leaves' model specs (for the axes XLA
    handles) and `manual` their specs over the data `axes` (`None` where a leaf
    is not an array). `jax.lax.psum` over `axes` gives the global sums.

    `finish`, a tree like `specs` with an elementwise function (or `None`) at
    each array leaf: the sums are those of `finish(leaf)`, applied to the slices
    each device reads."""
    total = jnp.zeros((2,), jnp.float32)
    if finish is None:
        finish = jax.tree.map(lambda s: None, specs, is_leaf=is_spec_leaf)

    def share(s: P | None, m: P | None, f: Any, x: Any) -> Array | None:
        return _share(x, s, m, axes, mesh, f) if is_array(x) else None

    leaves = jax.tree.leaves(
        jax.tree.map(share, specs, manual, finish, tree, is_leaf=is_spec_leaf)
    )
    for part in leaves:
        total = total + part
    return total


def global_sums(
    tree: Any, specs: Any, manual: Any, axes: tuple[str, ...], mesh: Mesh
) -> Array:
    """On global arrays: `tree`'s (sum of squares, finiteness sum), every device
    reading its share (`local_sums`, which takes `specs` and `manual`) and one
    all-reduce adding them."""

    def per_device(local: Any) -> Array:
        total: Array = jax.lax.psum(local_sums(local, specs, manual, axes, mesh), axes)
        return total

    sums: Array = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(manual,),
        out_specs=P(),
        axis_names=frozenset(axes),
        check_vma=False,
    )(tree)
    return sums
