"""The all-to-all dispatch of expert parallelism (`MoE(dispatch="all_to_all")`):
each device sends each token-expert assignment to the device holding the
expert, that device runs its experts on what it got, and the outputs come back
the same way.

Dropless, and sized by what is routed, in rounds. `jax.lax.all_to_all` needs
the same buffer for every destination, and the dropless worst case (all of a
device's `T * k` assignments to one device) is `n` times the balanced share:
buffers of that size made the copies cost more than the experts
(`ragged_all_to_all`, which sends only the rows used, is not implemented by
XLA:CPU in JAX 0.10). So the counts go first (one small `all_gather` of
every device's assignments per expert, `n x E` integers: what each device
gets, and the most any device sends one destination), and the rows then go
in rounds of `chunk` rows per destination, a `while_loop` of `ceil(most /
chunk)` rounds, the same on every device. `chunk` is the balanced share and
a half (`_chunk`): balanced routing, and the imbalance of a router in
training, take one round, a lopsided one more rounds, and no assignment is
ever dropped. Each round the holder runs its experts on the rows it got (the
tiles of `tiles.py`: the work is the rows received, rounded up to tiles) and
sends the outputs back. A holder knows each row's expert from the counts
(each sender's rows come sorted by expert), so no ids travel with the rows;
the gates do, as one more column: the holder applies them, and the outputs
come back gated and are added to their tokens.

Under a capacity (`MoE(capacity_factor=...)`) no destination gets more than
`min(T * k, experts per device * C)` rows from a device (no expert keeps more
than `C` of the call's assignments, this device's among them), and no round
is larger than that.

The gradient (`jax.custom_vjp`: a loop with a traced count is not
reverse-differentiable) runs the forward's rounds (its plan saved, no counts
gathered again): each assignment's cotangent goes to the holder (its token
and gate too after the first round, whose rows the holder kept), which
returns the token's and the gate's cotangents and keeps its experts'
gradient.

Against the all-gather dispatch (`dispatch.py`) it moves each device's
`T * k` rows (half as many again under balanced routing) each way instead of
`n * T` tokens and outputs, and routes only this device's tokens.
"""

import functools
from collections.abc import Callable
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..._experts.grouped import Experts, each_weight, routed_flops, sorted_by_expert
from ..._experts.routing import Config, Routing, capacity
from ..._experts.tiles import (
    counted_loop,
    tile_rows,
    tiled_ffn,
    tiled_ffn_grads,
    typed_like,
    varying_like,
)
from ..._jaxpr import counted_as


class _How(NamedTuple):
    """What shapes a call's rounds (static: a `custom_vjp`'s fixed argument)."""

    axis: str
    chunk: int  # rows per destination per round
    tile: int  # rows per tile of the holder's grouped products
    num_experts: int
    activation: Callable[[Array], Array]


class _Plan(NamedTuple):
    """A call's assignments sorted by expert (so by destination, then the
    destination's expert), and what each device sends and receives."""

    order: Int[Array, " A"]  # the assignment at each sorted place
    starts: Int[Array, " n"]  # the first sorted place of each destination's rows
    counts: Int[Array, " n"]  # rows to each destination
    ends: Int[Array, "n local"]  # per source: its rows to my experts, cumulated
    rounds: Int[Array, ""]  # the same on every device


def _chunk(assignments: int, size: int, most: int) -> int:
    """Rows per destination per round: a device's balanced share of its
    `assignments` and a half, never more than `most`, what one destination can
    get at all (then one round always does). A round is two all-to-alls each
    way, so the share leaves room for a router's imbalance: `bench_experts.py`'s
    routers in training sent one destination up to 1.4x the mean, and with a
    quarter took 1.5 to 2 rounds a layer over 60 steps (1.0 with a half after
    the first steps), for a fifth more rows sent, all padding."""
    share = -(-assignments // size)
    return max(min(-(-share * 3 // 2), most), 1)


def _plan(ids: Int[Array, "T k"], local: int, how: _How) -> _Plan:
    """The call's plan; its one collective, an `all_gather` of every device's
    rows per expert (`n x E` counts), gives each device what it receives and
    every device the same number of rounds (a collective costs more than its
    few bytes: on 8 CPU devices a rendezvous of their threads)."""
    size = jax.lax.axis_size(how.axis)
    order, _, sizes = sorted_by_expert(ids, how.num_experts)
    everyone = jax.lax.all_gather(sizes.reshape(size, local), how.axis)
    counts = jnp.sum(everyone, axis=2)  # [source, destination]
    mine = counts[jax.lax.axis_index(how.axis)]
    got = everyone[:, jax.lax.axis_index(how.axis)]  # [source, my expert]
    rounds = -(-jnp.max(counts) // how.chunk)
    return _Plan(order, jnp.cumsum(mine) - mine, mine, jnp.cumsum(got, axis=1),
                 rounds)  # fmt: skip


def _incoming(plan: _Plan, r: Array, chunk: int) -> tuple[Array, Array, Array]:
    """Round r's rows from each source sorted by this device's expert: the
    received row at each sorted place, each received row's sorted place, and
    the group sizes. A source's rows come sorted by expert, so a row's expert
    is how many of the source's cumulative counts are at or below its place;
    rows past a source's count (`local`) sort after the groups, in no tile."""
    local = plan.ends.shape[1]
    within = r * chunk + jnp.arange(chunk)
    expert = jnp.sum(plan.ends[:, None, :] <= within[None, :, None], axis=2)
    return sorted_by_expert(expert, local)


def _send(rows: Array, axis: str) -> Array:
    """`[n, chunk, ...]` rows, block i to device i; what each device sent here,
    block i from device i."""
    size, chunk = rows.shape[:2]
    flat = rows.reshape(size * chunk, *rows.shape[2:])
    moved: Array = jax.lax.all_to_all(flat, axis, 0, 0, tiled=True)
    return moved.reshape(rows.shape)


def _round_rows(
    plan: _Plan, r: Array, k: int, chunk: int
) -> tuple[Array, Array, Array]:
    """Round r's rows to each destination (`[n, chunk]`): their assignments
    and tokens, one past the last (`A`, `T`) where there is none (a scatter
    there is dropped), and which are rows. A destination's rows are a run of
    the sorted assignments, from its start."""
    within = r * chunk + jnp.arange(chunk)
    valid = within[None, :] < plan.counts[:, None]
    at = jnp.minimum(plan.starts[:, None] + within[None, :], plan.order.size - 1)
    which = plan.order[at]
    which = jnp.where(valid, which, plan.order.size)
    token = jnp.where(valid, which // k, plan.order.size // k)
    return which, token, valid


def _rows_out(
    x: Array, gates: Array, which: Array, token: Array, valid: Array, axis: str
) -> Array:
    """The rows a round sends: each assignment's token and, as one more
    column, its gate (the holder applies it, and takes its gradient)."""
    gate = gates.reshape(-1).astype(x.dtype)[jnp.minimum(which, gates.size - 1)]
    both = jnp.concatenate([x[jnp.minimum(token, x.shape[0] - 1)], gate[..., None]],
                           axis=-1)  # fmt: skip
    return _send(jnp.where(valid[..., None], both, 0), axis)


def _outputs(
    x: Array, gates: Array, ids: Array, experts: Experts, plan: _Plan, how: _How
) -> tuple[Float[Array, "T d"], Array]:
    """The combined output of each token (each round's outputs, gated by the
    holder, added to their tokens), and the rows the first round received
    (what the gradient's first round reads again instead of receiving them)."""
    k, d = ids.shape[1], x.shape[1]
    weights = (experts.w_in, experts.w_gate, experts.w_out)

    def body(r: Array, state: tuple[Any, ...]) -> tuple[Any, ...]:
        combined, first = state
        which, token, valid = _round_rows(plan, r, k, how.chunk)
        rows = _rows_out(x, gates, which, token, valid, how.axis)
        order, _, sizes = _incoming(plan, r, how.chunk)
        flat = rows.reshape(-1, d + 1)
        # The tiles read the gates in sorted order.
        out: Array = tiled_ffn(flat[:, :d], order, flat[order, d], sizes, weights,
                               how.activation, tile=how.tile)  # fmt: skip
        back = _send(out.astype(x.dtype).reshape(*rows.shape[:2], d), how.axis)
        combined = combined.at[token.reshape(-1)].add(back.reshape(-1, d), mode="drop")
        return combined, jnp.where(r == 0, rows, first)

    like = (x, gates, ids, weights)
    combined = varying_like(jnp.zeros_like(x), *like)
    first = varying_like(jnp.zeros((plan.counts.size, how.chunk, d + 1), x.dtype),
                         *like)  # fmt: skip
    out: tuple[Array, Array] = counted_loop(plan.rounds, body, (combined, first))[1]
    return out


def _grads(
    x: Array, gates: Array, ids: Array, g: Array, experts: Experts, plan: _Plan,
    first: Array, how: _How,
) -> tuple[Array, Array, Experts]:  # fmt: skip
    """For the combined output's cotangent `g`: the tokens', the gates' and
    the experts' gradients, by the forward's rounds (its `plan`; its first
    round's rows kept, not sent again)."""
    k, d = ids.shape[1], x.shape[1]
    weights = (experts.w_in, experts.w_gate, experts.w_out)

    def body(r: Array, state: tuple[Any, ...]) -> tuple[Any, ...]:
        dx, dgates, dws = state
        which, token, valid = _round_rows(plan, r, k, how.chunk)
        rows = jax.lax.cond(
            r == 0,
            lambda: first,
            lambda: _rows_out(x, gates, which, token, valid, how.axis),
        )
        cot = g.astype(x.dtype)[jnp.minimum(token, x.shape[0] - 1)]
        cot = _send(jnp.where(valid[..., None], cot, 0), how.axis)
        order, place, sizes = _incoming(plan, r, how.chunk)
        flat = rows.reshape(-1, d + 1)
        # The tiles read the gates, and give their gradients, in sorted order.
        drows, dgate, dw = tiled_ffn_grads(
            flat[:, :d], order, flat[order, d], sizes, weights, how.activation,
            cot.reshape(-1, d), tile=how.tile,
        )  # fmt: skip
        dgate = dgate[place].astype(x.dtype)
        both = jnp.concatenate([drows.astype(x.dtype), dgate[:, None]], axis=-1)
        back = _send(both.reshape(*rows.shape[:2], d + 1), how.axis)
        dx = dx.at[token.reshape(-1)].add(back[..., :d].reshape(-1, d), mode="drop")
        dgates = dgates.at[which.reshape(-1)].set(
            back[..., d].reshape(-1).astype(dgates.dtype), mode="drop"
        )
        summed = each_weight(lambda a, b: a + b.astype(a.dtype), dws, Experts(*dw))
        return dx, dgates, summed

    like = (x, gates, ids, g, weights, first)
    dx = varying_like(jnp.zeros_like(x), *like)
    dgates = varying_like(jnp.zeros((ids.size,), gates.dtype), *like)
    zeros = each_weight(
        lambda w, _: varying_like(jnp.zeros_like(w), *like), experts, experts
    )
    dx, dgates, dws = counted_loop(plan.rounds, body, (dx, dgates, zeros))[1]
    return dx, dgates.reshape(ids.shape), each_weight(typed_like, dws, experts)


def _flops(x: Array, gates: Array, ids: Array, experts: Experts) -> Fraction:
    """The model FLOPs of a forward: each of this device's assignments through
    one expert, dropped ones too (`routed_flops`, the count a device's own,
    whichever device holds the expert: no share to take)."""
    return routed_flops(x, Routing(ids, gates), experts, None)


def _forward(x: Array, gates: Array, ids: Array, experts: Experts, how: _How) -> Any:
    """The combined output, and what the gradient reads again: the plan and
    the rows the first round received."""

    def run(x: Array, gates: Array, ids: Array, experts: Experts) -> Any:
        plan = _plan(ids, experts.w_in.shape[0], how)
        combined, first = _outputs(x, gates, ids, experts, plan, how)
        return combined, (plan, first)

    return counted_as(run, _flops(x, gates, ids, experts))(x, gates, ids, experts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _exchange(x: Array, gates: Array, ids: Array, experts: Experts, how: _How) -> Array:
    combined: Array = _forward(x, gates, ids, experts, how)[0]
    return combined


def _exchange_fwd(
    x: Array, gates: Array, ids: Array, experts: Experts, how: _How
) -> tuple[Array, tuple[Any, ...]]:
    combined, (plan, first) = _forward(x, gates, ids, experts, how)
    return combined, (x, gates, ids, experts, plan, first)


def _exchange_bwd(how: _How, saved: tuple[Any, ...], g: Array) -> tuple[Any, ...]:
    x, gates, ids, experts, plan, first = saved

    def pull(x: Array, gates: Array, ids: Array, g: Array, experts: Experts,
             plan: _Plan, first: Array) -> Any:  # fmt: skip
        dx, dgates, dexperts = _grads(x, gates, ids, g, experts, plan, first, how)
        return typed_like(dx, x), typed_like(dgates, gates), dexperts

    # Two products per forward product (the inputs' and the weights'), as
    # autodiff counts a dense one; the hidden products the tiles recompute are
    # no model work.
    flops = 2 * _flops(x, gates, ids, experts)
    dx, dgates, dexperts = counted_as(pull, flops)(
        x, gates, ids, g, experts, plan, first
    )
    return dx, dgates, np.zeros(ids.shape, jax.dtypes.float0), dexperts


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def exchanged(
    experts: Experts,
    routing: Routing,
    x: Float[Array, "T d"],
    config: Config,
    axis: str,
    call_tokens: int,
) -> Float[Array, "T d"]:
    """Different tokens on each device, routed here (`routing`): each assignment
    sent to its expert's device and its output sent back, in rounds
    (`all_to_all`s), combined with the gates here. Inside `jax.shard_map` over
    `axis`, `experts` this device's block; the gradient takes the same rounds.
    An assignment the capacity dropped (id `num_experts`) goes nowhere: it
    sorts after every destination's rows, its output zero.

    A round sends each destination at most `_chunk` rows; no destination gets
    more than this device's `T * k` assignments, nor, under a capacity of `C`
    per expert over the call's `call_tokens`, more than `C` per expert of the
    destination's block, `local * C`."""
    size = jax.lax.axis_size(axis)
    local = experts.w_in.shape[0]
    tokens, k = routing.experts.shape
    limit = capacity(call_tokens, config)
    most = tokens * k if limit is None else min(tokens * k, local * limit)
    how = _How(
        axis=axis,
        chunk=_chunk(tokens * k, size, most),
        # The tile of a layer's `n T k` assignments over its experts (the
        # holders' groups hold about `T k / local` rows each).
        tile=tile_rows(size * tokens * k, config.num_experts),
        num_experts=config.num_experts,
        activation=config.activation,
    )
    ids = routing.experts.astype(jnp.int32)
    return _exchange(x, routing.gates, ids, experts, how)
