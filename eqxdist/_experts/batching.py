"""`jax.vmap` of the grouped products. `jax.lax.ragged_dot` batches only when
all of its operands are batched, and under `jax.vmap(moe)` the experts are not.

- forward (`merged=True`): a batch of token sets routed to the same experts is
  one larger token set; one call on all of them, outputs split back.
- backward (`merged=False`): the experts' gradient of each element must stay
  its own (`jax.vmap(jax.grad(...))` asks for per-sequence gradients, and under
  `jax.grad(jax.vmap(...))` JAX sums them), so the elements go one at a time
  (`jax.lax.map`), each with the same work as its share of a merged call.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

# fn(tokens, experts) -> outputs: `tokens` a pytree of arrays with a leading
# token axis; with `merged`, outputs `(per_token, None)`.
TokenFn = Callable[[Any, Any], Any]


def _batched(tree: Any, batched: Any, size: int) -> Any:
    return jax.tree.map(
        lambda x, b: x if b else jnp.broadcast_to(x, (size, *x.shape)), tree, batched
    )


def _merge(tree: Any, size: int, batched: Any) -> Any:
    """Each leaf's batch of `size` token sets as one set (the batch axis merged
    into the token axis), an unbatched leaf repeated for each."""
    return jax.tree.map(
        lambda x: x.reshape(size * x.shape[1], *x.shape[2:]),
        _batched(tree, batched, size),
    )


def one_token_set(fn: TokenFn, *, merged: bool) -> TokenFn:
    """`fn`, batched as the module says."""

    @custom_vmap
    def wrapped(tokens: Any, experts: Any) -> Any:
        return fn(tokens, experts)

    @wrapped.def_vmap
    def rule(size: int, in_batched: Any, tokens: Any, experts: Any) -> Any:
        tokens_batched, experts_batched = in_batched
        if merged and not any(jax.tree.leaves(experts_batched)):
            per_token, _ = wrapped(_merge(tokens, size, tokens_batched), experts)
            per_token = jax.tree.map(
                lambda y: y.reshape(size, y.shape[0] // size, *y.shape[1:]), per_token
            )
            return (per_token, None), (jax.tree.map(lambda _: True, per_token), None)
        tokens = _batched(tokens, tokens_batched, size)
        if any(jax.tree.leaves(experts_batched)):
            # A vmapped ensemble: each element has experts of its own.
            pairs = (tokens, _batched(experts, experts_batched, size))
            out = jax.lax.map(lambda a: wrapped(*a), pairs)
        else:
            out = jax.lax.map(lambda t: wrapped(t, experts), tokens)
        return out, jax.tree.map(lambda _: True, out)

    return wrapped
