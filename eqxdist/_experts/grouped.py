"""The experts' computation, dropless: the token-expert assignments sorted by
expert and run through grouped matrix products (`grouped_matmul`: tiles on CPU,
`jax.lax.ragged_dot` elsewhere), then put back in token order and combined with
their gates. No capacity: an expert takes every assignment it gets, however
many."""

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
from .tiles import tiled_matmul

METHODS = ("auto", "tiled", "ragged_dot")


class Experts(NamedTuple):
    """The experts' weights (all of them, or one device's contiguous block)."""

    w_in: Float[Array, "E d h"]
    w_gate: Float[Array, "E d h"] | None  # None: not gated
    w_out: Float[Array, "E h d"]


def _tile_rows(rows: int, groups: int) -> int:
    """Half a mean group, a power of two in [16, 128]: the padding (under half a
    tile per group) stays near a quarter of the rows, and the tiles big enough
    for a fast product. Measured on XLA:CPU (d 64, h 128; rows 512 to 8192,
    8 to 64 groups)."""
    half = max(rows // (2 * max(groups, 1)), 1)
    return int(min(max(1 << (half.bit_length() - 1), 16), 128))


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
    when JAX's default backend is the CPU at trace time."""
    if method not in METHODS:
        raise ValueError(
            f"grouped_matmul: method={method!r}; expected one of {METHODS}. "
            "Pass 'auto' to choose by backend."
        )
    if method == "auto":
        method = "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
    if method == "ragged_dot":
        return jax.lax.ragged_dot(x_sorted, w, group_sizes)
    tile = _tile_rows(x_sorted.shape[0], w.shape[0])
    return tiled_matmul(x_sorted, w, group_sizes, tile=tile)


def _ffn(
    x: Float[Array, "T d"],
    routing: Routing,
    experts: Experts,
    activation: Callable[[Array], Array],
) -> Float[Array, "T d"]:
    tokens, k = routing.experts.shape
    groups = experts.w_in.shape[0]
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]
    # Ids past the last group are dropped by `length`: they belong to no group.
    sizes = jnp.bincount(flat, length=groups).astype(jnp.int32)
    hidden = activation(grouped_matmul(rows, experts.w_in, sizes))
    if experts.w_gate is not None:
        hidden = hidden * grouped_matmul(rows, experts.w_gate, sizes)
    out = grouped_matmul(hidden, experts.w_out, sizes)
    out = out * routing.gates.reshape(-1)[order][:, None]
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.size))
    combined: Array = out[back].reshape(tokens, k, -1).sum(axis=1)
    return combined.astype(x.dtype)


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


def _forward(
    activation: Callable[[Array], Array], num_experts: int | None
) -> Callable[..., Any]:
    def forward(tokens: tuple[Array, Routing], experts: Experts) -> tuple[Array, None]:
        flops = routed_flops(*tokens, experts, num_experts)
        ffn = functools.partial(_ffn, activation=activation)
        return counted_as(ffn, flops)(*tokens, experts), None

    return one_token_set(forward, merged=True)


def _backward(
    activation: Callable[[Array], Array], num_experts: int | None
) -> Callable[..., Any]:
    def pulled(x: Array, routing: Routing, g: Array, experts: Experts) -> Any:
        _, pull = jax.vjp(
            lambda x, gates, experts: _ffn(
                x, Routing(routing.experts, gates), experts, activation
            ),
            x, routing.gates, experts,
        )  # fmt: skip
        return pull(g)

    def backward(
        tokens: tuple[Array, Routing, Array], experts: Experts
    ) -> tuple[tuple[Array, Array], Experts]:
        x, routing, g = tokens
        # Two products per forward product (the inputs' and the weights'), as
        # autodiff counts a dense one; the forward recomputed here is no model
        # work.
        flops = 2 * routed_flops(x, routing, experts, num_experts)
        dx, dgates, dexperts = counted_as(pulled, flops)(x, routing, g, experts)
        return (dx, dgates), dexperts

    return one_token_set(backward, merged=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
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
    sits after the groups, where `grouped_matmul` gives zeros, and its gate
    must be 0. `num_experts`: how many experts there are in all when `experts`
    is one device's block of them (None: these are all), for the model FLOP
    count (`routed_flops`)."""
    y: Array = _forward(activation, num_experts)((x, routing), experts)[0]
    return y


def _grouped_fwd(
    x: Array,
    routing: Routing,
    experts: Experts,
    activation: Callable[[Array], Array],
    num_experts: int | None,
) -> tuple[Array, tuple[Array, Routing, Experts]]:
    y = _forward(activation, num_experts)((x, routing), experts)[0]
    return y, (x, routing, experts)


def _grouped_bwd(
    activation: Callable[[Array], Array],
    num_experts: int | None,
    saved: tuple[Array, Routing, Experts],
    g: Array,
) -> tuple[Array, Routing, Experts]:
    x, routing, experts = saved
    backward = _backward(activation, num_experts)
    (dx, dgates), dexperts = backward((x, routing, g), experts)
    ids = np.zeros(routing.experts.shape, jax.dtypes.float0)
    return dx, Routing(ids, dgates), dexperts  # type: ignore[arg-type]


grouped_ffn.defvjp(_grouped_fwd, _grouped_bwd)
