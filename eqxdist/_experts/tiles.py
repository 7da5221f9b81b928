"""A tiled grouped matrix product in plain JAX (the megablox idea): each
expert's group of sorted rows padded to whole tiles of `tile` rows, so every
tile belongs to one expert; one batched product of the tiles with their
experts' weights; the padding dropped. Dropless: no row is dropped, the padding
rows are zeros and discarded. Its gradient is JAX's autodiff of the gathers and
the product. On XLA:CPU this is much faster than `jax.lax.ragged_dot`."""

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class _Tiling(NamedTuple):
    """Where the rows go: `slot[i]`, row i's place in the padded rows (out of
    range for a row past the groups); `source[p]`, the row padded place p holds
    (out of range for padding); `expert[j]`, tile j's expert."""

    slot: Int[Array, " rows"]
    source: Int[Array, " padded"]
    expert: Int[Array, " tiles"]


def _count_le(ends: Int[Array, " n"], v: Int[Array, " m"]) -> Int[Array, " m"]:
    """`jnp.searchsorted(ends, v, side="right")` for sorted `ends`: how many of
    them are <= each of `v`, by comparisons. `jnp.searchsorted` itself fails in
    JAX 0.10 inside a `shard_map` over some of the mesh's axes (the global view's
    expert axis beside data, tensor, context or stage axes: an internal
    `AssertionError` on the varying axes); the groups here are few."""
    return jnp.sum(ends[None, :] <= v[:, None], axis=1, dtype=jnp.int32)


def _tiling(sizes: Int[Array, " E"], rows: int, tile: int) -> _Tiling:
    groups = sizes.shape[0]
    # Static bound: each group wastes less than one tile, so the rows in whole
    # tiles need at most ceil(rows / tile) + groups of them; the rest pad.
    tiles = -(-rows // tile) + groups
    counts = -(-sizes // tile)  # tiles per group
    tile_end = jnp.cumsum(counts)
    tile_start = tile_end - counts
    row_end = jnp.cumsum(sizes)
    row_start = row_end - sizes
    i = jnp.arange(rows)
    group = _count_le(row_end, i)  # `groups`: past them
    g = jnp.minimum(group, groups - 1)
    slot = jnp.where(group < groups, tile_start[g] * tile + i - row_start[g], -1)
    expert = jnp.minimum(_count_le(tile_end, jnp.arange(tiles)), groups - 1)
    p = jnp.arange(tiles * tile)
    offset = p - tile_start[expert[p // tile]] * tile
    e = expert[p // tile]
    source = jnp.where(
        (offset < sizes[e]) & (p // tile < tile_end[-1]), row_start[e] + offset, -1
    )
    return _Tiling(slot, source, expert)


def _take(x: Array, index: Array) -> Array:
    """`x[index]` with zeros where `index` is -1 (padding, or past the groups)."""
    valid = index >= 0
    rows = x[jnp.where(valid, index, 0)]
    return jnp.where(valid[:, None], rows, jnp.zeros((), x.dtype))


def tiled_matmul(
    x: Float[Array, "rows d"],
    w: Float[Array, "E d h"],
    sizes: Int[Array, " E"],
    *,
    tile: int,
) -> Float[Array, "rows h"]:
    """`jax.lax.ragged_dot(x, w, sizes)` computed by tiles of `tile` rows: row
    i of group g times `w[g]`, zeros for the rows past the groups."""
    rows, d = x.shape
    tiling = _tiling(sizes.astype(jnp.int32), rows, tile)
    padded = _take(x, tiling.source).reshape(-1, tile, d)
    out = jnp.einsum("tbd,tdh->tbh", padded, w[tiling.expert])
    return _take(out.reshape(-1, w.shape[-1]), tiling.slot)
