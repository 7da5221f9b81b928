"""The all-to-all dispatch of expert parallelism (`MoE(dispatch="all_to_all")`):
each device sends each token-expert assignment to the device holding the
expert, that device runs its experts on what it got, and the outputs come back
the same way. Dropless with fixed sizes: `jax.lax.all_to_all` needs the same
buffer for every destination, so each is sized for the worst case (all of a
device's `T * k` assignments going to one device) and padded; a padded row
carries the expert id one past the holder's block, which the grouped products
leave out (`grouped_ffn`: in no tile, never computed), so the ids received are
the counts: the holder's work is the rows it got, rounded up to tiles, not the
buffer, and no counts need exchanging first. Under a capacity
(`MoE(capacity_factor=...)`) a destination's buffer is what the capacity lets
a device send it, `min(T * k, experts per device * C)`, no longer the
dropless worst case. (`ragged_all_to_all`, which sends only the rows used, is
not implemented by XLA:CPU in JAX 0.10.)

Against the all-gather dispatch (`dispatch.py`) it moves `n * T * k` rows each
way instead of `n * T` tokens and outputs, and routes only this device's tokens.
"""

from fractions import Fraction

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..._experts.grouped import Experts, grouped_ffn
from ..._experts.routing import Config, Routing, capacity
from ..._jaxpr import counted_scaled


def _slots(dest: Int[Array, " A"], size: int) -> Int[Array, " A"]:
    """Each assignment's row in its destination's buffer: how many assignments
    before it go to the same device (their order kept)."""
    hits = jax.nn.one_hot(dest, size, dtype=jnp.int32)
    before = jnp.cumsum(hits, axis=0) - hits
    slot: Array = jnp.take_along_axis(before, dest[:, None], axis=1)[:, 0]
    return slot


def _holders_out(
    rows: Float[Array, "R d"],
    ids: Int[Array, " R"],
    experts: Experts,
    config: Config,
    counted: Fraction,
) -> Float[Array, "R d"]:
    """Each received row through its expert of this device's block, ungated
    (the sender applies the gates); padded rows (id past the block) give 0.

    The grouped products count the received rows as assignments, of which a
    device holds its experts' share (`routed_flops`): with buffers of the
    senders' `T * k` rows that is the `T * k` each device routed. `counted`
    scales the count to it when the buffers are smaller (a capacity's)."""
    local = experts.w_in.shape[0]
    gates = (ids < local).astype(rows.dtype)[:, None]

    def ffn(rows: Array, ids: Array, gates: Array, experts: Experts) -> Array:
        routing = Routing(ids[:, None], gates)
        activation, num_experts = config.activation, config.num_experts
        return grouped_ffn(rows, routing, experts, activation, num_experts)

    if counted != 1:
        ffn = counted_scaled(ffn, counted)
    out: Array = ffn(rows, ids, gates, experts)
    return out


def _send(
    rows: Float[Array, "R d"], ids: Int[Array, " R"], *, largest: int, axis: str
) -> tuple[Float[Array, "R d"], Int[Array, " R"]]:
    """The rows and their expert ids to their devices in one `all_to_all`: the
    ids ride as one more column when the rows' dtype holds every id up to
    `largest` exactly (a few experts per device; a second exchange otherwise)."""
    exact = 2 ** (jnp.finfo(rows.dtype).nmant + 1)
    if largest >= exact:
        moved = jax.lax.all_to_all(rows, axis, 0, 0, tiled=True)
        return moved, jax.lax.all_to_all(ids, axis, 0, 0, tiled=True)
    column = jax.lax.stop_gradient(ids.astype(rows.dtype))[:, None]
    both = jax.lax.all_to_all(
        jnp.concatenate([rows, column], axis=1), axis, 0, 0, tiled=True
    )
    return both[:, :-1], jnp.round(both[:, -1]).astype(jnp.int32)


def exchanged(
    experts: Experts,
    routing: Routing,
    x: Float[Array, "T d"],
    config: Config,
    axis: str,
    call_tokens: int,
) -> Float[Array, "T d"]:
    """Different tokens on each device, routed here (`routing`): each assignment
    sent to its expert's device and its output sent back (two `all_to_all`s),
    combined with the gates here. Inside `jax.shard_map` over `axis`, `experts`
    this device's block; the gradients flow back through the same two
    exchanges. An assignment the capacity dropped (id `num_experts`) goes
    nowhere: its destination `size` is out of range, dropped by the scatter
    and read back as zeros.

    Each destination's buffer holds the most this device can send it:
    dropless, all of its `T * k` assignments; under a capacity of `C` per
    expert over the call's `call_tokens`, at most `C` per expert of the
    destination's block (no expert keeps more than `C` of the call's
    assignments, this device's among them), so `min(T * k, local * C)`."""
    size = jax.lax.axis_size(axis)
    local = experts.w_in.shape[0]
    tokens, k = routing.experts.shape
    flat = routing.experts.reshape(-1)
    dest = jnp.where(flat < config.num_experts, flat // local, size)
    slot = _slots(dest, size)
    limit = capacity(call_tokens, config)
    width = tokens * k if limit is None else min(tokens * k, local * limit)
    send = jnp.zeros((size, width, x.shape[1]), x.dtype)
    send = send.at[dest, slot].set(jnp.repeat(x, k, axis=0), mode="drop")
    ids = jnp.full((size, width), local, jnp.int32)
    ids = ids.at[dest, slot].set(flat % local, mode="drop")
    rows, got = _send(
        send.reshape(size * width, -1), ids.reshape(-1), largest=local, axis=axis
    )
    out = _holders_out(rows, got, experts, config, Fraction(tokens * k, width))
    back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)
    mine = back.reshape(size, width, -1).at[dest, slot].get(mode="fill", fill_value=0)
    mine = mine.reshape(tokens, k, -1)
    # A weighted sum, not an einsum: no matrix product for the FLOP count (the
    # one-device computation combines its outputs the same way).
    gates = routing.gates.astype(x.dtype)[:, :, None]
    combined: Array = jnp.sum(gates * mine, axis=1)
    return combined
