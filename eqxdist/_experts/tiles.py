"""The experts' feed-forward by tiles whose work is the rows routed (the
megablox idea, in plain JAX): the rows sorted by expert, each expert's group
cut into tiles of `tile` rows (its last one partial), and a loop over the
active tiles only, `sum_g ceil(sizes[g] / tile)` of them, a traced count: the
buffers are sized for the worst case (dropless), the work is not. Rows past
the groups (another device's assignments, the padding of a receive buffer)
are in no tile: never computed, zeros out.

`tiled_ffn` runs a tile's whole gated MLP (the three products, the activation
and the gates) in one iteration; `tiled_ffn_grads` its gradient, over the same
tiles (the hidden units recomputed per tile: nothing of the worst-case size is
saved). `tiled_matmul` is one grouped product by the same tiles, with its own
gradient (`jax.custom_vjp`: a loop with a traced count is not
reverse-differentiable). `recording()` lets a test or a benchmark read how
many tiles each loop ran.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

# Rows per tile when none is given (`tile_rows` chooses one for a layer).
TILE = 64


def tile_rows(assignments: int, num_experts: int) -> int:
    """The tile for `assignments` rows (the buffer's; under expert parallelism
    the worst case, `n` devices' worth) of a layer of `num_experts` experts
    (all devices'): half the mean group (`assignments / num_experts`, the
    same on one device and sharded), a power of two in [8, 64]. Measured on
    XLA:CPU (d 64, h 128; 256 and 2048 rows, 8 and 32 experts; tiles 8 to 128,
    forward and backward against the dense MLP of the same active FLOPs):
    smaller tiles pay the loop's per-tile cost, larger ones the padding (under
    one tile per group)."""
    half = max(assignments // (2 * max(num_experts, 1)), 1)
    return int(min(max(1 << (half.bit_length() - 1), 8), 64))


_RECORDS: list[list[dict[str, Any]]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """While a computation is traced inside it, each tile loop reports, when it
    runs, a dict: `kind` ("forward", "backward", "matmul", "matmul_grad"),
    `tiles` (the iterations run), `sizes` (the group sizes), `tile`, `rows`
    (the buffer's rows). Off (no callback in the program) outside."""
    records: list[dict[str, Any]] = []
    _RECORDS.append(records)
    try:
        yield records
    finally:
        # The callbacks run when the computation does, after the call that
        # dispatched it returned: wait for them before the list is read.
        jax.effects_barrier()
        _RECORDS.remove(records)


def _record(kind: str, tiles: Array, sizes: Array, tile: int, rows: int) -> None:
    if not _RECORDS:
        return
    sinks = list(_RECORDS)

    def note(tiles: Any, sizes: Any) -> None:
        for sink in sinks:
            sink.append({"kind": kind, "tiles": int(tiles), "sizes": np.asarray(sizes),
                         "tile": tile, "rows": rows})  # fmt: skip

    jax.debug.callback(note, tiles, sizes)


class _Tiles(NamedTuple):
    """Tile j (of a static `ceil(rows / tile) + groups`, the first `active`
    active): rows `[start[j], start[j] + valid[j])` of group `expert[j]`."""

    start: Int[Array, " tiles"]
    valid: Int[Array, " tiles"]
    expert: Int[Array, " tiles"]
    active: Int[Array, ""]


def _count_le(ends: Int[Array, " n"], v: Int[Array, " m"]) -> Int[Array, " m"]:
    """`jnp.searchsorted(ends, v, side="right")` for sorted `ends`: how many of
    them are <= each of `v`, by comparisons. `jnp.searchsorted` itself fails in
    JAX 0.10 inside a `shard_map` over some of the mesh's axes (the global view's
    expert axis beside data, tensor, context or stage axes: an internal
    `AssertionError` on the varying axes); the groups here are few."""
    return jnp.sum(ends[None, :] <= v[:, None], axis=1, dtype=jnp.int32)


def _tiles(sizes: Int[Array, " E"], rows: int, tile: int) -> _Tiles:
    groups = sizes.shape[0]
    sizes = sizes.astype(jnp.int32)
    # Each group wastes less than one tile: at most ceil(rows / tile) + groups.
    bound = -(-rows // tile) + groups
    counts = -(-sizes // tile)
    tile_end = jnp.cumsum(counts)
    row_start = jnp.cumsum(sizes) - sizes
    j = jnp.arange(bound, dtype=jnp.int32)
    g = jnp.minimum(_count_le(tile_end, j), groups - 1)
    within = (j - (tile_end - counts)[g]) * tile
    valid = jnp.clip(sizes[g] - within, 0, tile)
    return _Tiles(row_start[g] + within, valid, g, tile_end[-1])


def varying_like(x: Array, *like: Any) -> Array:
    """`x` typed as varying over every manual axis any of `like` varies over
    (under `shard_map(check_vma=True)` a loop's carry must keep its type)."""
    axes: set[str] = set()
    for a in jax.tree.leaves(like):
        axes |= set(jax.typeof(a).manual_axis_type.varying)
    axes -= set(jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def typed_like(d: Array, like: Array) -> Array:
    """A gradient `d` summed over the manual axes it varies over and its primal
    `like` does not (what JAX's own transpose of the implicit cast does, under
    `shard_map(check_vma=True)`), and cast to its dtype."""
    extra = set(jax.typeof(d).manual_axis_type.varying)
    extra -= set(jax.typeof(like).manual_axis_type.varying)
    if extra:
        d = jax.lax.psum(d, tuple(sorted(extra)))
    return d.astype(like.dtype)


def _padded(x: Array, tile: int) -> Array:
    """`x` with `tile` zero rows after it: a tile's slice never runs off it."""
    return jnp.pad(x, ((0, tile), *[(0, 0)] * (x.ndim - 1)))


def _rows(x: Array, t: _Tiles, j: Array, tile: int) -> Array:
    """Tile j's rows of the padded `x`, zeros past its group."""
    block = jax.lax.dynamic_slice_in_dim(x, t.start[j], tile)
    keep = jnp.arange(tile) < t.valid[j]
    return jnp.where(keep.reshape(-1, *[1] * (x.ndim - 1)), block, 0)


def _put(buf: Array, value: Array, t: _Tiles, j: Array, tile: int) -> Array:
    """`value` written over tile j's rows of `buf`, the rows past its group
    (the next group's) kept."""
    old = jax.lax.dynamic_slice_in_dim(buf, t.start[j], tile)
    keep = (jnp.arange(tile) < t.valid[j]).reshape(-1, *[1] * (buf.ndim - 1))
    new = jnp.where(keep, value.astype(buf.dtype), old)
    return jax.lax.dynamic_update_slice_in_dim(buf, new, t.start[j], 0)


def _add(buf: Array, value: Array, g: Array) -> Array:
    """`buf[g] += value` (an expert's gradient)."""
    old = jax.lax.dynamic_index_in_dim(buf, g, keepdims=False)
    new: Array = jax.lax.dynamic_update_index_in_dim(
        buf, old + value.astype(buf.dtype), g, 0
    )
    return new


def counted_loop(count: Array, body: Callable[[Array, Any], Any], init: Any) -> Any:
    """`body(j, state)` for j in `[0, count)`, a traced count: a `while_loop`;
    `(count, state)` (the tile loops here, the all-to-all dispatch's rounds)."""

    def step(carry: Any) -> Any:
        j, state = carry
        return j + 1, body(j, state)

    zero = jnp.zeros((), jnp.int32)
    return jax.lax.while_loop(lambda c: c[0] < count, step, (zero, init))


def _expert_weights(
    weights: tuple[Array, Array | None, Array], g: Array
) -> tuple[Array, Array | None, Array]:
    """Expert g's `(w_in, w_gate, w_out)` (`w_gate` `None` without a gate)."""
    w_in, w_gate, w_out = (
        None if w is None else jax.lax.dynamic_index_in_dim(w, g, keepdims=False)
        for w in weights
    )
    assert w_in is not None and w_out is not None
    return w_in, w_gate, w_out


def _ffn_tiles(
    src: Array, gates: Array, sizes: Array, tile: int
) -> tuple[_Tiles, Array, Array]:
    """The tiles of the rows sorted by group, and the rows' tokens and gates
    padded by a tile (what `tiled_ffn` and its gradient loop over)."""
    return _tiles(sizes, src.shape[0], tile), _padded(src, tile), _padded(gates, tile)


def _gather(
    x: Array, src: Array, t: _Tiles, j: Array, tile: int
) -> tuple[Array, Array]:
    """Tile j's token indices (0 past its group) and their rows of `x` (zeros
    past its group)."""
    idx = jax.lax.dynamic_slice_in_dim(src, t.start[j], tile)
    keep = jnp.arange(tile) < t.valid[j]
    idx = jnp.where(keep, idx, 0)
    return idx, jnp.where(keep[:, None], x[idx], 0)


def tiled_ffn(
    x: Float[Array, "N d"],
    src: Int[Array, " rows"],
    gates: Float[Array, " rows"],
    sizes: Int[Array, " E"],
    weights: tuple[Array, Array | None, Array],
    activation: Callable[[Array], Array],
    *,
    tile: int = TILE,
) -> Float[Array, "N d"]:
    """The rows sorted by group (`sizes[g]` of group g, then rows in no group),
    row i being token `src[i]` of `x`: each row's `gates[i] * ((act(x w_in[g]) *
    x w_gate[g]) w_out[g])` (no `w_gate`: `act(x w_in[g])`) added to its
    token's output; the rows past the groups add nothing. The tokens are
    gathered and the outputs added tile by tile: nothing of the buffer's size
    is read or written but the zeros out. Not differentiable by JAX: its
    gradient is `tiled_ffn_grads`."""
    t, sp, gp = _ffn_tiles(src, gates, sizes, tile)
    dtype = jnp.result_type(x, gates, *(w for w in weights if w is not None))
    out = varying_like(jnp.zeros((x.shape[0], weights[2].shape[-1]), dtype),
                   x, src, gates, sizes, weights)  # fmt: skip

    def body(j: Array, out: Array) -> Array:
        w_in, w_gate, w_out = _expert_weights(weights, t.expert[j])
        idx, xs = _gather(x, sp, t, j, tile)
        hidden = activation(xs @ w_in)
        if w_gate is not None:
            hidden = hidden * (xs @ w_gate)
        y = (hidden @ w_out) * _rows(gp, t, j, tile)[:, None]
        return out.at[idx].add(y.astype(dtype))

    ran, out = counted_loop(t.active, body, out)
    _record("forward", ran, sizes, tile, src.shape[0])
    summed: Array = out
    return summed


def tiled_ffn_grads(
    x: Float[Array, "N d"],
    src: Int[Array, " rows"],
    gates: Float[Array, " rows"],
    sizes: Int[Array, " E"],
    weights: tuple[Array, Array | None, Array],
    activation: Callable[[Array], Array],
    g: Float[Array, "N d"],
    *,
    tile: int = TILE,
) -> tuple[Array, Array, tuple[Array, Array | None, Array]]:
    """The gradient of `sum(tiled_ffn(x, src, gates, ...) * g)`: `(dx, dgates,
    (dw_in, dw_gate, dw_out))`, over the same tiles (eight products a tile, the
    two hidden ones recomputed); `dgates` zero for the rows past the groups."""
    t, sp, gp = _ffn_tiles(src, gates, sizes, tile)
    like = (x, src, gates, sizes, weights, g)
    zeros = lambda a: varying_like(jnp.zeros_like(a), *like)  # noqa: E731
    init = (
        zeros(x),
        zeros(gp),
        tuple(None if w is None else zeros(w) for w in weights),
    )

    def body(j: Array, carry: Any) -> Any:
        dx, dgates, dws = carry
        e = t.expert[j]
        w_in, w_gate, w_out = _expert_weights(weights, e)
        idx, xs = _gather(x, sp, t, j, tile)
        cs = jnp.where((jnp.arange(tile) < t.valid[j])[:, None], g[idx], 0)
        gs = _rows(gp, t, j, tile)[:, None]
        pre = xs @ w_in
        act, act_pull = jax.vjp(activation, pre)
        lin = None if w_gate is None else xs @ w_gate
        hidden = act if lin is None else act * lin
        up = cs @ w_out.T  # the ungated output's cotangent, through w_out
        dgates = _put(dgates, jnp.sum(hidden * up, axis=1), t, j, tile)
        dhidden = up * gs
        d_out = hidden.T @ (cs * gs)
        if lin is None or w_gate is None:
            (dpre,) = act_pull(dhidden)
            dxs = dpre @ w_in.T
            d_gate = None
        else:
            (dpre,) = act_pull(dhidden * lin)
            dlin = dhidden * act
            dxs = dpre @ w_in.T + dlin @ w_gate.T
            d_gate = xs.T @ dlin
        d_in = xs.T @ dpre
        dw_in, dw_gate, dw_out = dws
        dws = (_add(dw_in, d_in, e),
               None if d_gate is None else _add(dw_gate, d_gate, e),
               _add(dw_out, d_out, e))  # fmt: skip
        return dx.at[idx].add(dxs.astype(dx.dtype)), dgates, dws

    ran, (dx, dgates, dws) = counted_loop(t.active, body, init)
    rows = src.shape[0]
    _record("backward", ran, sizes, tile, rows)
    return dx, dgates[:rows], dws


def _matmul(x: Array, w: Array, sizes: Array, tile: int) -> Array:
    rows = x.shape[0]
    t = _tiles(sizes, rows, tile)
    xp = _padded(x, tile)
    out = varying_like(jnp.zeros((rows + tile, w.shape[-1]), x.dtype), x, w, sizes)

    def body(j: Array, out: Array) -> Array:
        y = _rows(xp, t, j, tile) @ w[t.expert[j]]
        return _put(out, y, t, j, tile)

    ran, out = counted_loop(t.active, body, out)
    _record("matmul", ran, sizes, tile, rows)
    result: Array = out[:rows]
    return result


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled_matmul(x: Array, w: Array, sizes: Array, tile: int) -> Array:
    return _matmul(x, w, sizes, tile)


def _tiled_matmul_fwd(
    x: Array, w: Array, sizes: Array, tile: int
) -> tuple[Array, tuple[Array, Array, Array]]:
    return _matmul(x, w, sizes, tile), (x, w, sizes)


def _tiled_matmul_bwd(
    tile: int, saved: tuple[Array, Array, Array], g: Array
) -> tuple[Array, Array, Any]:
    x, w, sizes = saved
    rows = x.shape[0]
    t = _tiles(sizes, rows, tile)
    xp, gp = _padded(x, tile), _padded(g, tile)
    init = (varying_like(jnp.zeros_like(xp), x, w, sizes, g),
            varying_like(jnp.zeros_like(w), x, w, sizes, g))  # fmt: skip

    def body(j: Array, carry: Any) -> Any:
        dx, dw = carry
        e = t.expert[j]
        xs, gs = _rows(xp, t, j, tile), _rows(gp, t, j, tile)
        dxs = gs @ w[e].T
        return _put(dx, dxs, t, j, tile), _add(dw, xs.T @ gs, e)

    ran, (dx, dw) = counted_loop(t.active, body, init)
    _record("matmul_grad", ran, sizes, tile, rows)
    return dx[:rows], dw, np.zeros(sizes.shape, jax.dtypes.float0)


_tiled_matmul.defvjp(_tiled_matmul_fwd, _tiled_matmul_bwd)


def tiled_matmul(
    x: Float[Array, "rows d"],
    w: Float[Array, "E d h"],
    sizes: Int[Array, " E"],
    *,
    tile: int = TILE,
) -> Float[Array, "rows h"]:
    """`jax.lax.ragged_dot(x, w, sizes)` computed by the active tiles of `tile`
    rows: row i of group g times `w[g]`, zeros for the rows past the groups;
    its gradient loops over the same tiles."""
    return _tiled_matmul(x, w, sizes.astype(jnp.int32), tile)
