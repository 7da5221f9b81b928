"""Routing: each token's `top_k` experts and gates from the router's logits, and
the auxiliary values a loss adds (load balance, router z-loss) or a user logs
(tokens per expert)."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

ROUTERS = ("softmax", "sigmoid")


class Config(NamedTuple):
    """What an `MoE` computes besides its arrays (its static fields)."""

    num_experts: int
    top_k: int
    router: str  # one of `ROUTERS`
    activation: Callable[[Array], Array]


class Routing(NamedTuple):
    """Each token's experts and the weights of their outputs in its result."""

    experts: Int[Array, "T k"]
    gates: Float[Array, "T k"]


class Routed(NamedTuple):
    routing: Routing
    logits: Float[Array, "T E"]
    probs: Float[Array, "T E"]


def route(
    router: Float[Array, "E d"], x: Float[Array, "T d"], config: Config
) -> Routed:
    """The router's logits `x @ router.T` (an `eqx.nn.Linear` weight, no bias), its
    probabilities, and each token's `top_k` experts by probability with gates
    `p_topk / sum(p_topk)`."""
    logits = x @ router.T
    probs = (
        jax.nn.softmax(logits, axis=-1)
        if config.router == "softmax"
        else jax.nn.sigmoid(logits)
    )
    chosen, experts = jax.lax.top_k(probs, config.top_k)
    gates = chosen / jnp.sum(chosen, axis=-1, keepdims=True)
    return Routed(Routing(experts.astype(jnp.int32), gates), logits, probs)


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
    assignments that went to e, P_e e's mean probability), `router_z_loss`
    (`mean(logsumexp(logits)**2)`) and `tokens_per_expert`."""
    counts = tokens_per_expert(routed.routing.experts, num_experts)
    # The counts come from a top-k, which has no gradient: the loss reaches the
    # router through P_e, as in Switch Transformer.
    fraction = counts / routed.routing.experts.size
    mean_prob = jnp.mean(routed.probs, axis=0)
    z = jax.nn.logsumexp(routed.logits, axis=-1)
    return {
        "load_balance_loss": num_experts * jnp.sum(fraction * mean_prob),
        "router_z_loss": jnp.mean(z**2),
        "tokens_per_expert": counts,
    }
