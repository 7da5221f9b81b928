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

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array

from .._layout.rules import is_spec_leaf, spec_axes
from .._utils import is_array

SQUARES = "squares"
"""The sum of squares of a tree's elements (`step_info`'s norms)."""
NONFINITE = "nonfinite"
"""The sum of `x * 0` over a tree's elements: 0 when every element is finite, NaN
otherwise (`skip_nonfinite`'s check)."""


def _sums(
    x: Array, kinds: tuple[str, ...], finish: Callable[[Array], Array] | None = None
) -> dict[str, Array]:
    """The sums `kinds` names (`SQUARES`, `NONFINITE`) of `finish(x)`, in
    float32. One reduction of `x` itself per kind, each with its product fused
    in (stacking the products first writes them out in full, then reads them
    back); only the kinds a caller reads, as each is a pass over its slice."""
    if finish is not None:
        x = finish(x)
    x32 = x.astype(jnp.float32)  # not flattened: that would regather rule axes
    products = {SQUARES: lambda: x32 * x32, NONFINITE: lambda: x32 * 0.0}
    return {kind: jnp.sum(products[kind]()) for kind in kinds}


def _first_only(index: Array, sums: dict[str, Array]) -> dict[str, Array]:
    return {k: jnp.where(index == 0, v, 0.0) for k, v in sums.items()}


def _add(a: dict[str, Array], b: dict[str, Array]) -> dict[str, Array]:
    return {k: a[k] + b[k] for k in a}


def _taken(spec: P | None, ndim: int) -> set[int]:
    return {d for d, e in enumerate(tuple(spec or ())[:ndim]) if e is not None}


def _share(
    x: Array,
    spec: P | None,
    manual: P | None,
    axes: tuple[str, ...],
    mesh: Mesh,
    kinds: tuple[str, ...],
    finish: Callable[[Array], Array] | None = None,
) -> dict[str, Array]:
    """Inside `shard_map` (manual over `axes`): this device's part of the sums
    `kinds` of leaf `finish(x)`, laid out by `manual` over the data axes and by
    `spec` over the others. The devices holding the same copy of `x` (those along
    the data axes `manual` does not shard over) each take an equal slice of its
    largest dimension no axis shards; the first also takes the remainder.
    `finish`, an elementwise function, is applied to the slices only."""
    copies = tuple(a for a in axes if a not in spec_axes(manual))
    count = math.prod(mesh.shape[a] for a in copies)
    if count == 1:
        return _sums(x, kinds, finish)
    index = jax.lax.axis_index(copies)
    taken = _taken(spec, x.ndim) | _taken(manual, x.ndim)
    free = [d for d in range(x.ndim) if d not in taken and x.shape[d] >= count]
    if not free:  # small or fully sharded elsewhere: one copy adds it up
        return _first_only(index, _sums(x, kinds, finish))
    dim = max(free, key=lambda d: (x.shape[d], -d))  # contiguous slabs
    size = x.shape[dim] // count
    part = _sums(
        jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=dim), kinds, finish
    )
    rest = x.shape[dim] - size * count
    if rest:
        tail = jax.lax.slice_in_dim(x, size * count, x.shape[dim], axis=dim)
        part = _add(part, _first_only(index, _sums(tail, kinds, finish)))
    return part


def local_sums(
    tree: Any,
    specs: Any,
    manual: Any,
    axes: tuple[str, ...],
    mesh: Mesh,
    kinds: tuple[str, ...],
    finish: Any = None,
) -> dict[str, Array]:
    """Inside `shard_map`: this device's share of `tree`'s sums `kinds`
    (`SQUARES`, `NONFINITE`), a dict by kind; `specs` are the leaves' model specs
    (for the axes XLA handles) and `manual` their specs over the data `axes`
    (`None` where a leaf is not an array). `jax.lax.psum` over `axes` gives the
    global sums.

    `finish`, a tree like `specs` with an elementwise function (or `None`) at
    each array leaf: the sums are those of `finish(leaf)`, applied to the slices
    each device reads."""
    total = {kind: jnp.zeros((), jnp.float32) for kind in kinds}
    if finish is None:
        finish = jax.tree.map(lambda s: None, specs, is_leaf=is_spec_leaf)

    parts: list[dict[str, Array]] = []  # a list: the model may hold dicts itself

    def share(s: P | None, m: P | None, f: Any, x: Any) -> None:
        if is_array(x):
            parts.append(_share(x, s, m, axes, mesh, kinds, f))

    jax.tree.map(share, specs, manual, finish, tree, is_leaf=is_spec_leaf)
    for part in parts:
        total = _add(total, part)
    return total


def global_sums(
    tree: Any,
    specs: Any,
    manual: Any,
    axes: tuple[str, ...],
    mesh: Mesh,
    kinds: tuple[str, ...],
) -> dict[str, Array]:
    """On global arrays: `tree`'s sums `kinds`, every device reading its share
    (`local_sums`, which takes `specs` and `manual`) and one all-reduce adding
    them."""

    def per_device(local: Any) -> dict[str, Array]:
        total: dict[str, Array] = jax.lax.psum(
            local_sums(local, specs, manual, axes, mesh, kinds), axes
        )
        return total

    sums: dict[str, Array] = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(manual,),
        out_specs=P(),
        axis_names=frozenset(axes),
        check_vma=False,
    )(tree)
    return sums


@dataclasses.dataclass(frozen=True)
class TreeSums:
    """`global_sums` of trees laid out as `specs` (over the rule axes) and
    `manual` (over the data `axes`) on `mesh`: `sums(tree)`."""

    specs: Any
    manual: Any
    axes: tuple[str, ...]
    mesh: Mesh
    kinds: tuple[str, ...]

    def __call__(self, tree: Any) -> dict[str, Array]:
        return global_sums(
            tree, self.specs, self.manual, self.axes, self.mesh, self.kinds
        )
