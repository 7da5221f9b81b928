"""The decoder-only transformer of `transformer_lm.py` and its Megatron-layout
tensor-parallel rules, shared with `benchmarks/bench_parallel.py`.

Plain Equinox: token and position embeddings, pre-LayerNorm blocks of causal
self-attention and an MLP, a final LayerNorm and a linear head. Nothing in it
knows about devices; `make_train_step(..., param_rules=MEGATRON_RULES)` places it.
With `stacked=True` the blocks are one `ed.Stacked` (scanned, what a pipeline's
stages split; `STACKED_MEGATRON_RULES` are the same rules with the layer axis
first).
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import eqxdist as ed


class CausalSelfAttention(eqx.Module):
    """Multi-head causal self-attention through `ed.attention`: on one device
    `jax.nn.dot_product_attention` (cuDNN's fused kernel on a GPU in bfloat16);
    with `context_axis` a mesh axis the sequence is split over, ring attention
    over it (the device's chunks in the balanced order)."""

    query: eqx.nn.Linear
    key: eqx.nn.Linear
    value: eqx.nn.Linear
    out: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    context_axis: str | None = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        key: jax.Array,
        context_axis: str | None = None,
    ) -> None:
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.query = eqx.nn.Linear(d_model, d_model, key=kq)
        # No key bias: it adds the same score to every key of a query, which the
        # softmax cancels, so its gradient is exactly zero in theory and rounding
        # noise in practice (which Adam would scale up into real updates).
        self.key = eqx.nn.Linear(d_model, d_model, use_bias=False, key=kk)
        self.value = eqx.nn.Linear(d_model, d_model, key=kv)
        self.out = eqx.nn.Linear(d_model, d_model, key=ko)
        self.num_heads = num_heads
        self.context_axis = context_axis

    def __call__(self, x: jax.Array) -> jax.Array:
        length, d_model = x.shape
        head_dim = d_model // self.num_heads

        def heads(layer: eqx.nn.Linear) -> jax.Array:
            return jax.vmap(layer)(x).reshape(length, self.num_heads, head_dim)

        q, k, v = heads(self.query), heads(self.key), heads(self.value)
        mixed = ed.attention(
            q, k, v, causal=True, scale=1 / math.sqrt(head_dim),
            context_axis=self.context_axis,
        )  # fmt: skip
        return jax.vmap(self.out)(mixed.reshape(length, d_model))


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d_model: int, hidden: int, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(d_model, hidden, key=k1)
        self.down = eqx.nn.Linear(hidden, d_model, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x)))


# The weights of an MoE block's auxiliary losses in the training loss.
AUX_WEIGHTS = {"load_balance_loss": 1e-2, "router_z_loss": 1e-3}


class Block(eqx.Module):
    """Attention and an MLP, or with `experts` a mixture of `experts` MLPs
    (`ed.MoE`, `top_k` per token): then it returns `(x, aux)`, its weighted
    auxiliary losses (`AUX_WEIGHTS`), which an `ed.Stacked` stacks over the
    layers."""

    norm1: eqx.nn.LayerNorm
    attn: CausalSelfAttention
    norm2: eqx.nn.LayerNorm
    mlp: MLP | ed.MoE

    def __init__(
        self,
        d_model: int,
        heads: int,
        hidden: int,
        key: jax.Array,
        context_axis: str | None = None,
        experts: int = 0,
        top_k: int = 2,
    ) -> None:
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, k1, context_axis)
        self.norm2 = eqx.nn.LayerNorm(d_model)
        if experts:
            self.mlp = ed.MoE(d_model, hidden, experts, top_k=top_k, key=k2)
        else:
            self.mlp = MLP(d_model, hidden, k2)

    def __call__(self, x: jax.Array) -> Any:
        x = x + self.attn(jax.vmap(self.norm1)(x))
        h = jax.vmap(self.norm2)(x)
        if not isinstance(self.mlp, ed.MoE):
            return x + self.mlp(h)
        y, aux = self.mlp(h)  # all of the sequence's tokens at once
        return x + y, sum(w * aux[name] for name, w in AUX_WEIGHTS.items())


class TransformerLM(eqx.Module):
    """Decoder-only transformer: `tokens (length,) -> logits (length, vocab)`.
    Its blocks are a list, or with `stacked=True` one `ed.Stacked` of the same
    blocks (the same parameters, on a leading layer axis). With `context_axis`
    its attention runs over a sequence split over that mesh axis: call it on a
    device's chunk with the chunk's `positions` (`ed.context_positions`)."""

    token_embed: eqx.nn.Embedding
    position_embed: jax.Array
    blocks: list[Block] | ed.Stacked
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self,
        vocab: int,
        *,
        d_model: int,
        heads: int,
        layers: int,
        mlp_ratio: int,
        max_len: int,
        key: jax.Array,
        stacked: bool = False,
        context_axis: str | None = None,
        experts: int = 0,
        top_k: int = 2,
    ) -> None:
        keys = jax.random.split(key, layers + 3)
        self.token_embed = eqx.nn.Embedding(vocab, d_model, key=keys[0])
        self.position_embed = 0.02 * jax.random.normal(keys[1], (max_len, d_model))
        blocks = [
            Block(d_model, heads, mlp_ratio * d_model, k, context_axis, experts, top_k)
            for k in keys[3:]
        ]
        self.blocks = ed.Stacked(blocks) if stacked else blocks
        self.norm = eqx.nn.LayerNorm(d_model)
        self.head = eqx.nn.Linear(d_model, vocab, key=keys[2])

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None
    ) -> jax.Array:
        return jax.vmap(self.head)(self.hidden(tokens, positions))

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None) -> Any:
        """What the head reads: `(length, d_model)` (for a chunked loss)."""
        return self.hidden_and_aux(tokens, positions)[0]

    def hidden_and_aux(
        self, tokens: jax.Array, positions: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """`hidden` and the weighted auxiliary losses of the MoE blocks, summed
        over the layers (0 without experts)."""
        if positions is None:
            positions = jnp.arange(len(tokens))
        x = jax.vmap(self.token_embed)(tokens) + self.position_embed[positions]
        aux = jnp.zeros((), x.dtype)
        if isinstance(self.blocks, list):
            for block in self.blocks:
                out = block(x)
                if isinstance(out, tuple):
                    x, aux = out[0], aux + out[1]
                else:
                    x = out
        else:  # the Stacked (or what a step makes of it: its pipeline's stages)
            out = self.blocks(x)
            x, aux = (out[0], out[1].sum()) if isinstance(out, tuple) else (out, aux)
        return jax.vmap(self.norm)(x), aux


def benchmark_model(
    config: dict[str, int], key: jax.Array, stacked: bool = False
) -> TransformerLM:
    """The benchmarks' transformer: `config` names `vocab`, `d_model`, `heads`,
    `layers` and `seq_len`; the MLP is 4 times as wide as the residual stream."""
    return TransformerLM(
        config["vocab"],
        d_model=config["d_model"],
        heads=config["heads"],
        layers=config["layers"],
        mlp_ratio=4,
        max_len=config["seq_len"],
        key=key,
        stacked=stacked,
    )


# Tensor parallelism in the Megatron layout: paths are inside the model, as
# `jax.tree_util.keystr` writes them (".blocks[0].attn.query.weight"); eqx.nn.Linear
# weights are (out_features, in_features). Column-parallel layers split their output
# features (and bias), so each device computes some of the heads / hidden units;
# row-parallel layers split their input features, consuming those shards and
# summing the partial outputs. Everything else (embeddings, LayerNorms, head,
# row-parallel biases) is replicated over "model".
MEGATRON_RULES = (
    (r"\.attn\.(query|key|value)\.weight$", P("model", None)),
    (r"\.attn\.(query|value)\.bias$", P("model")),
    (r"\.attn\.out\.weight$", P(None, "model")),
    (r"\.mlp\.up\.weight$", P("model", None)),
    (r"\.mlp\.up\.bias$", P("model")),
    (r"\.mlp\.down\.weight$", P(None, "model")),
)

STACKED_MEGATRON_RULES = tuple(
    (pattern, P(None, *spec)) for pattern, spec in MEGATRON_RULES
)

# With `ed.MoE` blocks: attention as above; inside each expert, `d_hidden` split
# over "model" (w_in and w_gate column-parallel, w_out row-parallel), the expert
# dimension left to `expert_axis`.
MOE_MEGATRON_RULES = (
    *MEGATRON_RULES[:3],
    (r"\.mlp\.w_(in|gate)$", P(None, None, "model")),
    (r"\.mlp\.w_out$", P(None, "model", None)),
)
STACKED_MOE_MEGATRON_RULES = tuple(
    (pattern, P(None, *spec)) for pattern, spec in MOE_MEGATRON_RULES
)
"""`MEGATRON_RULES` for `stacked=True`: the leaves of the `Stacked` have the layer
axis first (".blocks.layers.attn.query.weight" is `(layers, out, in)`), which
stays unsharded (or, under a pipeline, goes over the stage axis)."""
