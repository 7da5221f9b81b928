"""Fine-tune a Llama-shaped checkpoint with LoRA, read and written as safetensors.

1. Writes a small Llama-shaped checkpoint in Hugging Face's tensor names
   (`model.layers.0.self_attn.q_proj.weight`, ...) to OUT/base, or reads the one
   given by `--checkpoint` (a directory of `model.safetensors` or shards with
   their index, in those names and the sizes the flags give).
2. Loads it into an Equinox Llama whose layers are one `ed.Stacked`
   (`ed.load_safetensors`, `names=` mapping Hugging Face's names onto the
   model's), straight into the layout `--layout` chooses on 8 simulated CPU
   devices: `fsdp` (parameters sharded 8 ways), `tensor` (FSDP over 4 devices x
   Megatron rules over 2) or `pipeline` (a 1F1B pipeline of 2 stages x FSDP over 4).
   Each process reads only the slices its devices hold.
3. Checks its logits against a reference forward pass written in NumPy.
4. Adds LoRA adapters to the attention's query and value projections
   (`ed.lora`), trains only them (`ed.lora_trainable`) with `ed.train_loop` on
   byte-level windows of examples/data/public_domain.txt, the loss falling.
5. Merges the adapters (`ed.merge_lora`), writes the merged model back in Hugging
   Face's names to OUT/merged, loads it again and checks the logits are the
   fine-tuned model's.

    python examples/finetune_lora.py --layout tensor --steps 30
"""

import argparse
import math
import sys
from pathlib import Path

import eqxdist as ed

if __name__ == "__main__":
    ed.simulate_cpu_devices(8)

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

CORPUS = Path(__file__).resolve().parent / "data" / "public_domain.txt"
VOCAB = 256  # bytes
EPS = 1e-5

# Hugging Face's Llama names for the model's default ones (`layers.3.wq.weight`).
HF_NAMES = [
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.w([qkvo])\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (
        r"layers\.(\d+)\.mlp_norm\.weight",
        r"model.layers.\1.post_attention_layernorm.weight",
    ),
    (r"layers\.(\d+)\.w_(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"head\.weight", "lm_head.weight"),
]


def rope(x: jax.Array) -> jax.Array:
    """Rotary positions on `(seq, heads, head_dim)`, Hugging Face's rotate-half form."""
    seq, _, dim = x.shape
    inv = 1.0 / 10000 ** (jnp.arange(0, dim, 2) / dim)
    angles = jnp.arange(seq)[:, None] * inv[None]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, None]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, None]
    half = jnp.concatenate([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * cos + half * sin


class RMSNorm(eqx.Module):
    weight: jax.Array

    def __init__(self, dim: int) -> None:
        self.weight = jnp.ones(dim)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.weight * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS)


class Block(eqx.Module):
    attn_norm: RMSNorm
    wq: eqx.nn.Linear
    wk: eqx.nn.Linear
    wv: eqx.nn.Linear
    wo: eqx.nn.Linear
    mlp_norm: RMSNorm
    w_gate: eqx.nn.Linear
    w_up: eqx.nn.Linear
    w_down: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, hidden: int, heads: int, key: jax.Array) -> None:
        ks = jax.random.split(key, 7)
        lin = lambda i, o, k: eqx.nn.Linear(i, o, use_bias=False, key=k)  # noqa: E731
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (lin(dim, dim, k) for k in ks[:4])
        self.w_gate, self.w_up = lin(dim, hidden, ks[4]), lin(dim, hidden, ks[5])
        self.w_down = lin(hidden, dim, ks[6])
        self.heads = heads

    def __call__(self, x: jax.Array) -> jax.Array:
        seq, dim = x.shape
        h = jax.vmap(self.attn_norm)(x)
        q, k, v = (
            jax.vmap(w)(h).reshape(seq, self.heads, -1)
            for w in (self.wq, self.wk, self.wv)
        )
        q, k = rope(q), rope(k)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim // self.heads)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), -1)
        x = x + jax.vmap(self.wo)(
            jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, dim)
        )
        h = jax.vmap(self.mlp_norm)(x)
        gated = jax.nn.silu(jax.vmap(self.w_gate)(h)) * jax.vmap(self.w_up)(h)
        return x + jax.vmap(self.w_down)(gated)


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    layers: ed.Stacked
    norm: RMSNorm
    head: eqx.nn.Linear

    def __init__(self, dim: int, hidden: int, heads: int, depth: int, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, dim, key=k1)
        blocks = [Block(dim, hidden, heads, k) for k in jax.random.split(k2, depth)]
        self.layers = ed.Stacked(blocks)
        self.norm = RMSNorm(dim)
        self.head = eqx.nn.Linear(dim, VOCAB, use_bias=False, key=k3)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.layers(jax.vmap(self.embed)(tokens))
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def write_checkpoint(directory: Path, dim: int, hidden: int, depth: int) -> None:
    """A Llama-shaped checkpoint as `transformers` writes one (float32, HF names)."""
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.normal(size=shape) / math.sqrt(shape[-1])).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": w(VOCAB, dim),
        "lm_head.weight": w(VOCAB, dim),
    }
    tensors["model.norm.weight"] = np.ones(dim, np.float32)
    for i in range(depth):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            tensors[p + f"self_attn.{n}_proj.weight"] = w(dim, dim)
        tensors[p + "mlp.gate_proj.weight"] = w(hidden, dim)
        tensors[p + "mlp.up_proj.weight"] = w(hidden, dim)
        tensors[p + "mlp.down_proj.weight"] = w(dim, hidden)
        tensors[p + "input_layernorm.weight"] = np.ones(dim, np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(dim, np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def numpy_logits(t: dict, tokens: np.ndarray, heads: int, depth: int) -> np.ndarray:
    """The reference forward pass of one sequence, in NumPy from the tensors."""

    def norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS)

    def rot(x: np.ndarray) -> np.ndarray:
        seq, _, d = x.shape
        a = np.arange(seq)[:, None] / 10000 ** (np.arange(0, d, 2) / d)
        a = np.concatenate([a, a], -1)[:, None]
        half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * np.cos(a) + half * np.sin(a)

    x = t["model.embed_tokens.weight"][tokens]
    seq, dim = x.shape
    for i in range(depth):
        p = f"model.layers.{i}."
        h = norm(x, t[p + "input_layernorm.weight"])
        q, k, v = (
            (h @ t[p + f"self_attn.{n}_proj.weight"].T).reshape(seq, heads, -1)
            for n in "qkv"
        )
        s = np.einsum("qhd,khd->hqk", rot(q), rot(k)) / math.sqrt(dim // heads)
        s = np.where(np.tril(np.ones((seq, seq), bool)), s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, v).reshape(seq, dim)
        x = x + o @ t[p + "self_attn.o_proj.weight"].T
        h = norm(x, t[p + "post_attention_layernorm.weight"])
        g = h @ t[p + "mlp.gate_proj.weight"].T
        u = h @ t[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ t[p + "mlp.down_proj.weight"].T
    return norm(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


@eqx.filter_jit
def forward(model: Llama, tokens: jax.Array) -> jax.Array:
    return model(tokens)


def make_layout(name: str) -> ed.Layout:
    if name == "fsdp":
        return ed.Layout(
            ed.create_data_parallel_mesh(), strategy="fsdp", min_weight_size=2**10
        )
    if name == "tensor":
        return ed.Layout(
            ed.create_device_mesh({"data": 4, "model": 2}),
            strategy="fsdp",
            min_weight_size=2**10,
            param_rules=[  # Megatron: q/k/v, gate/up by output; o, down by input
                (r"\.w([qkv]|_gate|_up)\.weight", P(None, "model", None)),
                (r"\.w(o|_down)\.weight", P(None, None, "model")),
            ],
        )
    return ed.Layout(
        ed.create_device_mesh({"stage": 2, "data": 4}),
        strategy="fsdp",
        min_weight_size=2**10,
        pipeline=ed.Pipeline("stage", 2, schedule="1f1b"),
    )


def loss_fn(model: Llama, batch: dict, key: jax.Array) -> tuple:
    logits = jax.vmap(model)(batch["tokens"][:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["tokens"][:, 1:]
    )
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses.mean(-1))}


def windows(seq: int, rows: int):
    """Step `s`'s batch: `rows` random byte windows of the corpus (a function of
    the step, so a resumed run sees the same stream)."""
    data = np.frombuffer(CORPUS.read_bytes(), np.uint8).astype(np.int32)

    def batch(step: int) -> dict:
        starts = np.random.default_rng(step).integers(0, len(data) - seq - 1, rows)
        return {"tokens": np.stack([data[s : s + seq + 1] for s in starts])}

    return batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="a Llama checkpoint (HF names)")
    parser.add_argument("--out", type=Path, default=Path("finetune_lora_out"))
    parser.add_argument(
        "--layout", choices=["fsdp", "tensor", "pipeline"], default="tensor"
    )
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    shape = (args.dim, args.hidden, args.heads, args.depth)
    base = args.checkpoint
    if base is None:
        base = args.out / "base"
        write_checkpoint(base, args.dim, args.hidden, args.depth)
        print(f"wrote a Llama-shaped checkpoint to {base}")
    layout = make_layout(args.layout)
    print(layout.describe())
    like = eqx.filter_eval_shape(Llama, *shape, jax.random.key(0))
    model = ed.load_safetensors(base, like, names=HF_NAMES, layout=layout)
    tokens = np.frombuffer(CORPUS.read_bytes()[: args.seq_len], np.uint8).astype(
        np.int32
    )
    from safetensors.numpy import load_file  # the reference reads the files itself

    ref = {}
    for file in sorted(Path(base).glob("*.safetensors")):
        ref.update(load_file(file))
    expected = numpy_logits(ref, tokens, args.heads, args.depth)
    drift = float(np.max(np.abs(np.asarray(forward(model, tokens)) - expected)))
    print(f"logits vs the NumPy reference: max |diff| {drift:.1e}")
    assert drift < 1e-3, drift

    model = ed.lora(
        model, rank=args.rank, where=r"layers\.w[qv]$", key=jax.random.key(1)
    )
    optimizer = optax.adam(3e-3)
    step = ed.make_train_step(loss_fn, optimizer, layout)
    state = ed.TrainState.create(
        model, optimizer, jax.random.key(2), trainable=ed.lora_trainable(model)
    )
    result = ed.train_loop(
        step,
        state,
        windows(args.seq_len, args.batch),
        args.steps,
        log_every=max(1, args.steps // 4),
    )
    state = result.state
    losses = [values["loss"] for _, values in result.logs]
    print(f"loss: {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < losses[0], losses

    merged = ed.merge_lora(state.model)
    ed.save_safetensors(args.out / "merged", merged, names=HF_NAMES)
    again = ed.load_safetensors(
        args.out / "merged", like, names=HF_NAMES, layout=layout
    )
    tuned = np.asarray(forward(state.model, tokens))
    reloaded = np.asarray(forward(again, tokens))
    diff = float(np.max(np.abs(tuned - reloaded)))
    print(f"merged, written and reloaded: max |diff| {diff:.1e}")
    assert np.allclose(tuned, reloaded, atol=1e-4)


if __name__ == "__main__":
    main(sys.argv[1:])
