"""The experts' computation, dropless: the token-expert assignments sorted by
expert (stable), run through the experts by `tiles.py`'s loop over the active
tiles (the work is the assignments routed to these experts, the buffers the
worst case), then put back in token order and combined with their gates; its
gradient by the same tiles. No capacity: an expert takes every assignment it
gets, however many. `grouped_matmul` is one grouped product (tiles, or
`jax.lax.ragged_dot` when asked for)."""

import functools
from collections.abc import Callable
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._jaxpr import counted_as
from .batching import one_token_set
from .routing import Routing
from .tiles import tile_rows, tiled_ffn, tiled_ffn_grads, tiled_matmul, typed_like

METHODS = ("auto", "tiled", "ragged_dot")


class Experts(NamedTuple):
    """The experts' weights (all of them, or one device's contiguous block)."""

    w_in: Float[Array, "E d h"]
    w_gate: Float[Array, "E d h"] | None  # None: not gated
    w_out: Float[Array, "E h d"]


def grouped_matmul(
    x_sorted: Float[Array, "rows d"],
    w: Float[Array, "E d h"],
    group_sizes: Int[Array, " E"],
    *,
    method: str = "auto",
) -> Float[Array, "rows h"]:
    """Row i of group g (the rows sorted by group, `group_sizes[g]` of them)
    times `w[g]`; zeros for the rows past the groups.

    `method`: `"ragged_dot"` (`jax.lax.ragged_dot`, the fused kernel on GPU and
    TPU), `"tiled"` (each group padded to whole tiles, one batched product: on
    XLA:CPU `ragged_dot` is an order of magnitude slower) or `"auto"`, tiles
    on every backend: `ragged_dot` expands into a dense product over all groups
    on XLA:CPU (measured) and by default on XLA:GPU (openxla/xla#46002), and is
    taken only when asked for."""
    if method not in METHODS:
        raise ValueError(
            f"grouped_matmul: method={method!r}; expected one of {METHODS}. "
            "Pass 'auto' to choose by backend."
        )
    if method == "ragged_dot":
        return jax.lax.ragged_dot(x_sorted, w, group_sizes)
    return tiled_matmul(x_sorted, w, group_sizes)


def sorted_by_expert(
    ids: Int[Array, "..."], groups: int
) -> tuple[Int[Array, " A"], Int[Array, " A"], Int[Array, " groups"]]:
    """The assignments `ids` (flattened) in order of expert, stable: `order`
    (the assignment at each sorted place), `place` (its inverse) and the group
    sizes. Ids past the last group sort after the groups, left out of `sizes`:
    in no tile.

    A counting sort (each assignment's place is its group's start plus the
    assignments of its group before it, a cumulative sum over `groups + 1`
    columns): XLA:CPU's sort of the all-gathered assignments took most of an
    expert-parallel step (16k ids: ~1.5 ms a sort against ~0.2 for this). Above
    64 groups, `jnp.argsort`."""
    flat = ids.reshape(-1)
    if groups > 64:
        order = jnp.argsort(flat, stable=True)
        place = jnp.zeros_like(order).at[order].set(jnp.arange(order.size))
        return order, place, jnp.bincount(flat, length=groups).astype(jnp.int32)
    bucket = jnp.minimum(flat, groups)
    hits = jax.nn.one_hot(bucket, groups + 1, dtype=jnp.int32)
    counts = jnp.sum(hits, axis=0)
    before = jnp.cumsum(hits, axis=0) - hits
    rank = jnp.take_along_axis(before, bucket[:, None], axis=1)[:, 0]
    place = (jnp.cumsum(counts) - counts)[bucket] + rank
    order = (
        jnp.zeros_like(place).at[place].set(jnp.arange(place.size, dtype=place.dtype))
    )
    return order, place, counts[:groups]


def each_weight(fn: Callable[[Array, Array], Array], a: Experts, b: Experts) -> Experts:
    """`fn` of each pair of `a`'s and `b`'s weights (no gate where either has
    none): an experts' gradient cast like the experts, or summed into another."""
    gate = None if a.w_gate is None or b.w_gate is None else fn(a.w_gate, b.w_gate)
    return Experts(fn(a.w_in, b.w_in), gate, fn(a.w_out, b.w_out))


def _weights(experts: Experts) -> tuple[Array, Array | None, Array]:
    return experts.w_in, experts.w_gate, experts.w_out


def _ffn(
    x: Float[Array, "T d"],
    routing: Routing,
    experts: Experts,
    activation: Callable[[Array], Array],
    num_experts: int,
) -> Float[Array, "T d"]:
    tokens, k = routing.experts.shape
    tile = tile_rows(tokens * k, num_experts)
    order, _, sizes = sorted_by_expert(routing.experts, experts.w_in.shape[0])
    gates = routing.gates.reshape(-1)[order]
    out = tiled_ffn(x, order // k, gates, sizes, _weights(experts), activation,
                    tile=tile)  # fmt: skip
    return out.astype(x.dtype)


def routed_flops(
    x: Array, routing: Routing, experts: Experts, num_experts: int | None
) -> Fraction:
    """The model FLOPs of one forward of the expert products over these
    assignments: `2 * d_model * d_hidden` per product (`w_in`, `w_gate`,
    `w_out`) per assignment routed to these experts. With a block of
    `len(experts.w_in)` of `num_experts` experts (expert parallelism) the
    assignments here are, over the devices, that share of all of them: the
    count is the mean, exact once the devices' counts are added. Neither the
    tiles' padding nor the rows past the groups count; a dropped assignment
    (capacity) counts as routed: its count is known only when the step runs."""
    d, h = experts.w_in.shape[1:]
    products = 2 if experts.w_gate is None else 3
    groups = experts.w_in.shape[0]
    share = Fraction(groups, num_experts or groups)
    return 2 * d * h * products * routing.experts.size * share


def _ffn_grads(
    x: Array, routing: Routing, experts: Experts, activation: Callable[[Array], Array],
    num_experts: int, g: Array,
) -> tuple[Array, Array, Experts]:  # fmt: skip
    """`_ffn`'s gradient for the output cotangent `g`: (dx, dgates, dexperts),
    by the tiles `_ffn` ran."""
    tokens, k = routing.experts.shape
    tile = tile_rows(tokens * k, num_experts)
    order, place, sizes = sorted_by_expert(routing.experts, experts.w_in.shape[0])
    gates = routing.gates.reshape(-1)[order]
    dx, dgates, (dw_in, dw_gate, dw_out) = tiled_ffn_grads(
        x, order // k, gates, sizes, _weights(experts), activation, g, tile=tile
    )
    dgates = dgates[place].reshape(tokens, k)
    dexperts = each_weight(typed_like, Experts(dw_in, dw_gate, dw_out), experts)
    return typed_like(dx, x), typed_like(dgates, routing.gates), dexperts


def _forward(
    activation: Callable[[Array], Array], num_experts: int
) -> Callable[..., Any]:
    def forward(tokens: tuple[Array, Routing], experts: Experts) -> tuple[Array, None]:
        flops = routed_flops(*tokens, experts, num_experts)
        ffn = functools.partial(_ffn, activation=activation, num_experts=num_experts)
        return counted_as(ffn, flops)(*tokens, experts), None

    return one_token_set(forward, merged=True)


def _backward(
    activation: Callable[[Array], Array], num_experts: int
) -> Callable[..., Any]:
    def pulled(x: Array, routing: Routing, g: Array, experts: Experts) -> Any:
        return _ffn_grads(x, routing, experts, activation, num_experts, g)

    def backward(
        tokens: tuple[Array, Routing, Array], experts: Experts
    ) -> tuple[tuple[Array, Array], Experts]:
        x, routing, g = tokens
        # Two products per forward product (the inputs' and the weights'), as
        # autodiff counts a dense one; the hidden products the tiles recompute
        # are no model work.
        flops = 2 * routed_flops(x, routing, experts, num_experts)
        dx, dgates, dexperts = counted_as(pulled, flops)(x, routing, g, experts)
        return (dx, dgates), dexperts

    return one_token_set(backward, merged=False)


def grouped_ffn(
    x: Float[Array, "T d"],
    routing: Routing,
    experts: Experts,
    activation: Callable[[Array], Array],
    num_experts: int | None = None,
) -> Float[Array, "T d"]:
    """`sum_k gates[t, k] * expert_{experts[t, k]}(x[t])` for every token t; under
    `jax.vmap` (over token sets, e.g. sequences) and its gradient too.

    An assignment whose expert id is `len(experts.w_in)` (one past the last) is
    none of these experts' (another device's, or dropped by the capacity): it
    sits after the groups, in no tile (never computed, zeros out), and its gate
    must be 0.

    `num_experts`: the layer's experts on all devices (default: these), which
    with the assignments sets the tile (`tile_rows`) and the share of the
    model FLOPs counted here (`routed_flops`)."""
    return _grouped(x, routing, experts, activation, num_experts or len(experts.w_in))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(
    x: Array, routing: Routing, experts: Experts, activation: Callable[[Array], Array],
    num_experts: int,
) -> Array:  # fmt: skip
    y: Array = _forward(activation, num_experts)((x, routing), experts)[0]
    return y


def _grouped_fwd(
    x: Array, routing: Routing, experts: Experts, activation: Callable[[Array], Array],
    num_experts: int,
) -> tuple[Array, tuple[Array, Routing, Experts]]:  # fmt: skip
    y = _forward(activation, num_experts)((x, routing), experts)[0]
    return y, (x, routing, experts)


def _grouped_bwd(
    activation: Callable[[Array], Array],
    num_experts: int,
    saved: tuple[Array, Routing, Experts],
    g: Array,
) -> tuple[Array, Routing, Experts]:
    x, routing, experts = saved
    (dx, dgates), dexperts = _backward(activation, num_experts)(
        (x, routing, g), experts
    )
    ids = np.zeros(routing.experts.shape, jax.dtypes.float0)
    return dx, Routing(ids, dgates), dexperts  # type: ignore[arg-type]


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
