"""Ring attention in the device view: each device holds its chunk of the queries,
keys and values (in the balanced order of `order.py`); the key/value chunks (with
their segment ids) go round the context axis with `ppermute`, one step per device,
and each step's block is folded into the output with an online softmax.

The gradient is a `jax.custom_vjp` that goes round the ring again: the key/value
chunks travel with the gradients of their keys and values, each block's gradients
computed from the whole rows' statistics (`blocks.backward`), so a device holds
O(its chunk) between the passes (autodiff through the loop would keep every
step's chunk and probabilities).

Under a causal mask the balanced order makes every step after the first a block
of half the size: keys of an earlier device's chunk are seen whole by this
device's queries but only their first half (its early chunk) matters; keys of a
later device's chunk are seen only by this device's late half of queries. The
first step (its own chunk) is causal within the chunk, as the chunk's positions
increase.

Queries and keys of different lengths (T != S) are each in the balanced order of
their own sequence, and `causal` is JAX's `is_causal` (`jnp.tril` of `(T, S)`,
top-left: query `t` attends keys `s <= t`): the half-block shortcut assumes chunks
of one length, so there every step computes its whole block under the mask of the
positions in the whole sequences of its queries and keys.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from . import blocks
from .order import balanced_positions

QuerySegments = Int[Array, " T"] | None
KeySegments = Int[Array, " S"] | None


def _rotate(x: Any, axis: str, size: int) -> Any:
    """Send every device's `x` to the next device of the ring."""
    ring = [(i, (i + 1) % size) for i in range(size)]
    return jax.lax.ppermute(x, axis, ring)


def _segment_mask(
    q_seg: QuerySegments, kv_seg: KeySegments
) -> Bool[Array, "T S"] | None:
    if q_seg is None or kv_seg is None:
        return None
    return q_seg[:, None] == kv_seg[None, :]


class _At(NamedTuple):
    """Where a step of the ring stands: the device whose keys this device holds
    (`source`), this device (`index`), and the number of devices (`size`)."""

    source: Any
    index: Any
    size: int


def _at(step: Any, axis: str) -> _At:
    size, index = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    return _At((index - step) % size, index, size)


def _mask(
    q_seg: QuerySegments, kv_seg: KeySegments, length: tuple[int, int], at: _At | None
) -> Bool[Array, "T S"] | None:
    """The mask of this device's queries against the keys of device `at.source`:
    same segments and, unless `at` is `None` (not causal), JAX's causal mask on
    the positions in the whole sequences (query at `t` attends keys at `s <= t`,
    for queries and keys of one length or not)."""
    mask = _segment_mask(q_seg, kv_seg)
    if at is None:
        return mask
    q_pos = balanced_positions(length[0], at.index, at.size)
    k_pos = balanced_positions(length[1], at.source, at.size)
    causal = q_pos[:, None] >= k_pos[None, :]
    return causal if mask is None else mask & causal


def _half(x: Any, which: int) -> Any:
    """The first (0) or second (1) half of `x` along its first dimension (`None`
    stays `None`)."""
    if x is None:
        return None
    half = x.shape[0] // 2
    return x[:half] if which == 0 else x[half:]


def _pad(x: Array, which: int, fill: float) -> Array:
    """`x`, the `which` half of something twice as long, padded with `fill` in the
    other half."""
    other = jnp.full_like(x, fill)
    return jnp.concatenate([x, other] if which == 0 else [other, x])


def _whole_block(causal: bool, q: Array, k: Array) -> bool:
    """Whether a step computes its whole block: not causal, or causal over
    queries and keys of different lengths (no half of the block is masked
    whole)."""
    return not causal or q.shape[0] != k.shape[0]


def _block_forward(
    q: Array,
    kv: tuple[Any, ...],
    q_seg: QuerySegments,
    scale: float,
    causal: bool,
    at: _At,
) -> tuple[Array, Array]:
    """A step after the first: this device's queries against the keys of device
    `at.source`, earlier in the ring than this one or later; under `causal` (and
    chunks of one length) only the half of the block that the mask keeps."""
    k, v, kv_seg = kv
    if _whole_block(causal, q, k):
        mask = _mask(q_seg, kv_seg, (q.shape[0], k.shape[0]), at if causal else None)
        return blocks.forward(q, k, v, mask, scale)

    def from_earlier() -> tuple[Array, Array]:
        mask = _segment_mask(q_seg, _half(kv_seg, 0))
        return blocks.forward(q, _half(k, 0), _half(v, 0), mask, scale)

    def from_later() -> tuple[Array, Array]:
        mask = _segment_mask(_half(q_seg, 1), kv_seg)
        out, lse = blocks.forward(_half(q, 1), k, v, mask, scale)
        return _pad(out, 1, 0.0), _pad(lse, 1, blocks.NEG)

    earlier = at.source < at.index
    out: tuple[Array, Array] = jax.lax.cond(earlier, from_earlier, from_later)
    return out


def _block_backward(
    q: Array,
    kv: tuple[Any, ...],
    q_seg: QuerySegments,
    scale: float,
    causal: bool,
    at: _At,
    rows: tuple[Array, Array, Array],
) -> tuple[Array, Array, Array]:
    """The gradients of `_block_forward`'s block: `rows` is `(d_out, lse, delta)`
    of this device's queries."""
    k, v, kv_seg = kv
    if _whole_block(causal, q, k):
        mask = _mask(q_seg, kv_seg, (q.shape[0], k.shape[0]), at if causal else None)
        return blocks.backward(q, k, v, mask, scale, *rows)

    def from_earlier() -> tuple[Array, Array, Array]:
        mask = _segment_mask(q_seg, _half(kv_seg, 0))
        d_q, d_k, d_v = blocks.backward(q, _half(k, 0), _half(v, 0), mask, scale, *rows)
        return d_q, _pad(d_k, 0, 0.0), _pad(d_v, 0, 0.0)

    def from_later() -> tuple[Array, Array, Array]:
        mask = _segment_mask(_half(q_seg, 1), kv_seg)
        half_rows = [_half(r, 1) for r in rows]
        d_q, d_k, d_v = blocks.backward(_half(q, 1), k, v, mask, scale, *half_rows)
        return _pad(d_q, 1, 0.0), d_k, d_v

    earlier = at.source < at.index
    grads: tuple[Array, Array, Array] = jax.lax.cond(earlier, from_earlier, from_later)
    return grads


def _around(
    carry: Any, kv: Any, axis: str, step_fn: Callable[[Any, Any, Any], Any]
) -> Any:
    """`carry = step_fn(carry, kv, step)` for the steps `1 ... cp - 1` of the ring,
    `kv` (this device's own at step 0) rotated one device on before each step. A
    `lax.scan` (one compiled step, whatever `cp`) in which the next step's `kv`
    is sent while this step's block is computed."""
    size = jax.lax.axis_size(axis)
    if size == 1:
        return carry
    kv = _rotate(kv, axis, size)

    def body(state: Any, step: Any) -> tuple[Any, None]:
        carry, kv = state
        coming = _rotate(kv, axis, size)
        return (step_fn(carry, kv, step), coming), None

    steps = jnp.arange(1, size - 1)
    (carry, kv), _ = jax.lax.scan(body, (carry, kv), steps)
    return step_fn(carry, kv, size - 1)  # the last step sends nothing on


def _forward(
    q: Array,
    k: Array,
    v: Array,
    q_seg: QuerySegments,
    kv_seg: KeySegments,
    causal: bool,
    scale: float,
    axis: str,
) -> tuple[Float[Array, "T H D"], Float[Array, "T H"]]:
    lengths = (q.shape[0], k.shape[0])
    own = _mask(q_seg, kv_seg, lengths, _at(0, axis) if causal else None)

    def step(carry: Any, kv: Any, step: Any) -> Any:
        block = _block_forward(q, kv, q_seg, scale, causal, _at(step, axis))
        return _merge(carry, block)

    first = blocks.forward(q, k, v, own, scale)
    out: tuple[Array, Array] = _around(first, (k, v, kv_seg), axis, step)
    return out


def _merge(
    carry: tuple[Array, Array], block: tuple[Array, Array]
) -> tuple[Array, Array]:
    """The online softmax: two `(output, log-sum-exp)` of blocks weighted by
    their shares of the row's total."""
    (out, lse), (block_out, block_lse) = carry, block
    total = jnp.logaddexp(lse, block_lse)
    merged = out * jnp.exp(lse - total)[..., None]
    merged = merged + block_out * jnp.exp(block_lse - total)[..., None]
    return merged, total


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def ring_attention(
    q: Float[Array, "T H D"],
    k: Float[Array, "S K D"],
    v: Float[Array, "S K D"],
    q_seg: QuerySegments,
    kv_seg: KeySegments,
    causal: bool,
    scale: float,
    axis: str,
) -> Float[Array, "T H D"]:
    """Exact attention of this device's queries over the keys and values of every
    device of `axis` (bound), each device holding its chunk."""
    out, _ = _forward(q, k, v, q_seg, kv_seg, causal, scale, axis)
    return out.astype(q.dtype)


def _ring_fwd(
    q: Array,
    k: Array,
    v: Array,
    q_seg: QuerySegments,
    kv_seg: KeySegments,
    causal: bool,
    scale: float,
    axis: str,
) -> tuple[Array, tuple[Any, ...]]:
    out, lse = _forward(q, k, v, q_seg, kv_seg, causal, scale, axis)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_seg, kv_seg, out, lse)


def _ring_bwd(
    causal: bool, scale: float, axis: str, saved: tuple[Any, ...], d_out: Array
) -> tuple[Any, ...]:
    """Round the ring again: the gradients of each device's keys and values travel
    with them, each step adding its block's share, and a last step takes them
    home."""
    q, k, v, q_seg, kv_seg, out, lse = saved
    size = jax.lax.axis_size(axis)
    f32 = jnp.float32
    delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)
    rows = (d_out, lse, delta)
    lengths = (q.shape[0], k.shape[0])
    own = _mask(q_seg, kv_seg, lengths, _at(0, axis) if causal else None)
    d_q, d_k, d_v = blocks.backward(q, k, v, own, scale, *rows)

    def step(carry: Any, kv: Any, step: Any) -> Any:
        d_q, d_kv = carry
        grads = _block_backward(q, kv, q_seg, scale, causal, _at(step, axis), rows)
        d_kv = (d_kv[0] + grads[1], d_kv[1] + grads[2])
        return d_q + grads[0], _rotate(d_kv, axis, size)

    d_kv = _rotate((d_k, d_v), axis, size) if size > 1 else (d_k, d_v)
    d_q, (d_k, d_v) = _around((d_q, d_kv), (k, v, kv_seg), axis, step)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
