"""Routing: each token's `top_k` experts and gates from the router's logits (in
the router's dtype), the assignments an expert's capacity drops, and the
auxiliary values a loss adds (load balance, router z-loss) or a user logs
(tokens per expert, the dropped fraction)."""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

ROUTERS = ("softmax", "sigmoid")


class Config(NamedTuple):
    """What an `MoE` computes besides its arrays (its static fields)."""

    num_experts: int
    top_k: int
    router: str  # one of `ROUTERS`
    activation: Callable[[Array], Array]
    normalize_gates: bool = True
    router_dtype: Any = None  # None: the input's
    capacity_factor: float | None = None  # None: dropless


class Routing(NamedTuple):
    """Each token's experts and the weights of their outputs in its result. An
    assignment dropped by the capacity has expert id `num_experts` (one past the
    last: no expert's, as `grouped_ffn` reads it) and gate 0."""

    experts: Int[Array, "T k"]
    gates: Float[Array, "T k"]


class Routed(NamedTuple):
    routing: Routing
    logits: Float[Array, "T E"]
    probs: Float[Array, "T E"]
    chosen: Int[Array, "T k"]  # the router's choice, before the capacity
    dropped_fraction: Float[Array, ""]


def capacity(tokens: int, config: Config) -> int | None:
    """The assignments one expert takes out of a call of `tokens` tokens:
    `ceil(capacity_factor * tokens * top_k / num_experts)`, None when dropless."""
    if config.capacity_factor is None:
        return None
    share = config.capacity_factor * tokens * config.top_k / config.num_experts
    return math.ceil(share)


def kept(
    experts: Int[Array, "T k"], num_experts: int, limit: int
) -> Bool[Array, "T k"]:
    """Which assignments their expert takes when each takes at most `limit`: by
    choice rank (every token's first choice before any second), then token order
    (GShard's and Switch's priority). A running count per expert of the
    assignments before each one in that order, by a sum of one-hots (a scatter
    would need its output's sharding under an Explicit mesh axis)."""
    tokens, k = experts.shape
    ordered = experts.T.reshape(-1)  # choice rank major, then token
    hits = jax.nn.one_hot(ordered, num_experts, dtype=jnp.int32)
    before = jnp.cumsum(hits, axis=0) - hits
    place = jnp.take_along_axis(before, ordered[:, None], axis=1)[:, 0]
    keep: Array = (place < limit).reshape(k, tokens).T
    return keep


def _dropping(experts: Array, gates: Array, config: Config) -> tuple[Array, ...]:
    limit = capacity(experts.shape[0], config)
    if limit is None:
        return experts, gates, jnp.zeros((), jnp.float32)

    def keeping(e: Array) -> Array:
        return kept(e, config.num_experts, limit)

    if jax.sharding.get_abstract_mesh().explicit_axes:
        # The running count runs along the tokens, which an Explicit mesh axis
        # may split: left to XLA's partitioner, typed as the choices are.
        spec = jax.typeof(experts).sharding.spec
        keep = jax.sharding.auto_axes(keeping, out_sharding=spec)(experts)
    else:
        keep = keeping(experts)
    dropped = 1 - jnp.mean(keep.astype(jnp.float32))
    # The kept gates are not renormalised: a dropped assignment only removes
    # its expert's share (its token keeps the residual's value in a block).
    ids = jnp.where(keep, experts, config.num_experts).astype(jnp.int32)
    return ids, jnp.where(keep, gates, jnp.zeros((), gates.dtype)), dropped


def route(
    router: Float[Array, "E d"], x: Float[Array, "T d"], config: Config
) -> Routed:
    """The router's logits `x @ router.T` (an `eqx.nn.Linear` weight, no bias) in
    `config.router_dtype` (both cast to it; None: `x`'s dtype), its
    probabilities, each token's `top_k` experts by probability with gates
    `p_topk / sum(p_topk)` (`normalize_gates`) or `p_topk`, and the assignments
    past an expert's capacity dropped (`Routing`)."""
    dtype = x.dtype if config.router_dtype is None else config.router_dtype
    # In bf16 the top-k of close probabilities is decided by rounding: float32
    # routing picks other experts for a few percent of tokens (E 64, k 8).
    logits = x.astype(dtype) @ router.astype(dtype).T
    probs = (
        jax.nn.softmax(logits, axis=-1)
        if config.router == "softmax"
        else jax.nn.sigmoid(logits)
    )
    chosen, experts = jax.lax.top_k(probs, config.top_k)
    experts = experts.astype(jnp.int32)
    gates = chosen
    if config.normalize_gates:
        gates = chosen / jnp.sum(chosen, axis=-1, keepdims=True)
    ids, gates, dropped = _dropping(experts, gates, config)
    return Routed(Routing(ids, gates), logits, probs, experts, dropped)


def tokens_per_expert(experts: Int[Array, "T k"], num_experts: int) -> Array:
    """`(num_experts,)` int32: how many token-expert assignments each expert got."""
    # A sum of one-hots, not `bincount`'s scatter: a sum reduces tokens sharded
    # over an Explicit mesh axis, where a scatter needs its output's sharding.
    counts: Array = jnp.sum(
        jax.nn.one_hot(experts, num_experts, dtype=jnp.int32), (0, 1)
    )
    return counts


def aux_values(routed: Routed, num_experts: int) -> dict[str, Any]:
    """`load_balance_loss` (`E * sum_e f_e P_e`: f_e the fraction of this call's
    assignments that the router sent to e, P_e e's mean probability),
    `router_z_loss` (`mean(logsumexp(logits)**2)`), `tokens_per_expert` (the
    router's choices, before the capacity) and `dropped_fraction` (the share of
    the assignments the capacity dropped; 0.0 when dropless)."""
    counts = tokens_per_expert(routed.chosen, num_experts)
    # The counts come from a top-k, which has no gradient: the loss reaches the
    # router through P_e, as in Switch Transformer.
    fraction = counts / routed.chosen.size
    mean_prob = jnp.mean(routed.probs.astype(jnp.float32), axis=0)
    z = jax.nn.logsumexp(routed.logits.astype(jnp.float32), axis=-1)
    return {
        "load_balance_loss": num_experts * jnp.sum(fraction * mean_prob),
        "router_z_loss": jnp.mean(z**2),
        "tokens_per_expert": counts,
        "dropped_fraction": routed.dropped_fraction,
    }
