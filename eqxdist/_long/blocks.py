"""One block of attention, the unit ring attention is made of: a device's queries
against one block of keys, forward (output and log-sum-exp) and backward (from the
statistics of the whole row), in float32 statistics whatever the inputs' dtype.

Shapes: queries `(T, H, D)`, keys and values `(S, K, D)` with `H % K == 0`
(grouped-query: each of the `K` key heads serves `G = H // K` query heads), a
boolean mask `(T, S)` or `None`.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

# What `jax.nn.dot_product_attention` puts in masked logits: large but finite, so a
# row with nothing to attend to stays finite, and exp(NEG - lse) is exactly 0.
NEG = float(-0.7 * np.finfo(np.float32).max)


def _logits(
    q: Float[Array, "T H D"],
    k: Float[Array, "S K D"],
    mask: Bool[Array, "T S"] | None,
    scale: float,
) -> Float[Array, "K G T S"]:
    heads, kv_heads = q.shape[1], k.shape[1]
    grouped = q.reshape(q.shape[0], kv_heads, heads // kv_heads, q.shape[2])
    logits = jnp.einsum(
        "tkgd,skd->kgts", grouped, k, preferred_element_type=jnp.float32
    )
    logits = logits * jnp.float32(scale)
    return logits if mask is None else jnp.where(mask, logits, NEG)


def _rows(x: Float[Array, "K G T"]) -> Float[Array, "T H"]:
    """`(K, G, T)` statistics as `(T, H)`, heads in `q`'s order."""
    return jnp.moveaxis(x, 2, 0).reshape(x.shape[2], -1)


def _grouped(x: Float[Array, "T H"], kv_heads: int) -> Float[Array, "K G T"]:
    return jnp.moveaxis(x.reshape(x.shape[0], kv_heads, -1), 0, 2)


def forward(
    q: Float[Array, "T H D"],
    k: Float[Array, "S K D"],
    v: Float[Array, "S K D"],
    mask: Bool[Array, "T S"] | None,
    scale: float,
) -> tuple[Float[Array, "T H D"], Float[Array, "T H"]]:
    """The block's attention output (float32) and each row's log-sum-exp of its
    logits (float32)."""
    logits = _logits(q, k, mask, scale)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("kgts,skd->tkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape[0], q.shape[1], v.shape[2]), _rows(lse)


def backward(
    q: Float[Array, "T H D"],
    k: Float[Array, "S K D"],
    v: Float[Array, "S K D"],
    mask: Bool[Array, "T S"] | None,
    scale: float,
    d_out: Float[Array, "T H D"],
    lse: Float[Array, "T H"],
    delta: Float[Array, "T H"],
) -> tuple[Float[Array, "T H D"], Float[Array, "S K D"], Float[Array, "S K D"]]:
    """The block's share of the gradients (float32) of a row-wise softmax over many
    blocks: `lse` is each row's log-sum-exp over all of them and `delta` its
    `sum(d_out * out)` for the whole output, so the block's probabilities and
    their gradients are the whole row's, restricted to this block."""
    kv_heads = k.shape[1]
    probs = jnp.exp(_logits(q, k, mask, scale) - _grouped(lse, kv_heads)[..., None])
    d_grouped = d_out.reshape(d_out.shape[0], kv_heads, -1, d_out.shape[2])
    # The probabilities meet the values' gradient in the inputs' dtype (as in
    # the forward pass); the logits' gradient stays float32, which keeps
    # bfloat16 gradients as close as `jax.nn.dot_product_attention`'s.
    f32 = jnp.float32
    d_v = jnp.einsum(
        "kgts,tkgd->skd", probs.astype(q.dtype), d_grouped, preferred_element_type=f32
    )
    d_probs = jnp.einsum("tkgd,skd->kgts", d_grouped, v, preferred_element_type=f32)
    d_logits = probs * (d_probs - _grouped(delta, kv_heads)[..., None]) * f32(scale)
    grouped_q = q.reshape(q.shape[0], kv_heads, -1, q.shape[2])
    d_q = jnp.einsum("kgts,skd->tkgd", d_logits, k, preferred_element_type=f32)
    d_k = jnp.einsum("kgts,tkgd->skd", d_logits, grouped_q, preferred_element_type=f32)
    return d_q.reshape(q.shape), d_k, d_v
