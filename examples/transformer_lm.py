"""Train a character-level transformer language model with FSDP x tensor parallelism.

A small decoder-only transformer written in plain Equinox (`_transformer.py`: token
and position embeddings, pre-LayerNorm blocks of causal self-attention and an MLP)
learns to continue the public-domain text in `examples/data/public_domain.txt`
(Shakespeare's sonnets and US founding documents, see `examples/data/README.md`), on
8 simulated CPU devices arranged as a `{"data": 4, "model": 2}` mesh:

- the batch is split 4 ways over `"data"`, and parameters (with their Adam moments)
  are sharded 4 ways over it too (`strategy="fsdp"`);
- the attention and MLP weights are also split 2 ways over `"model"` in the Megatron
  layout (`param_rules`): query/key/value and the MLP's first layer column-wise
  (by output features), the attention output and the MLP's second layer row-wise
  (by input features), so each device holds 1/8 of them.

The loss function is written for one device and full-size arrays; eqxdist places
everything and XLA partitions the computation. The loop is `eqxdist.train_loop`:
the script prints the layout, a progress bar with the loss, perplexity, tokens/s
(and MFU on a GPU or TPU), writes them to OUT/metrics.jsonl and TensorBoard, then
prints held-out perplexity and a sample of generated text. Last, it trains the
same model under plain data parallelism for a few steps on the same batches and
checks that both give the same parameters.

    python examples/transformer_lm.py [--steps 600] [--d-model 64] [--layers 2]
"""

import argparse
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _transformer import MEGATRON_RULES, TransformerLM

import eqxdist as ed

DATA = Path(__file__).resolve().parent / "data" / "public_domain.txt"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--steps", type=int, default=600, help="training steps")
    add("--batch-size", type=int, default=32, help="global batch (sequences)")
    add("--seq-len", type=int, default=64, help="characters per training sequence")
    add("--d-model", type=int, default=64, help="width of the residual stream")
    add("--heads", type=int, default=4, help="attention heads")
    add("--layers", type=int, default=2, help="transformer blocks")
    add("--mlp-ratio", type=int, default=4, help="MLP hidden width / d-model")
    add("--lr", type=float, default=1e-2, help="peak adamw learning rate")
    add("--minibatches", type=int, default=1, help="gradient accumulation steps")
    add("--data-parallel", type=int, default=4, help='size of the "data" axis')
    add("--tensor-parallel", type=int, default=2, help='size of the "model" axis')
    add(
        "--min-weight-size",
        type=int,
        default=2**10,
        help="FSDP shards parameters with more elements than this",
    )
    add("--log-every", type=int, default=25, help="steps between log points")
    add(
        "--out",
        default="runs/transformer_lm",
        help="directory for metrics.jsonl and TensorBoard logs (OUT/tensorboard)",
    )
    add(
        "--compare-steps",
        type=int,
        default=8,
        help="steps of the plain data-parallel run checked against FSDP x TP "
        "(0 skips the check)",
    )
    add(
        "--sample-chars",
        type=int,
        default=200,
        help="characters of text to generate at the end (0: none)",
    )
    add("--seed", type=int, default=0, help="random seed (model and batch order)")
    add("--save-every", type=int, default=100, help="steps between checkpoints")
    add(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in OUT/checkpoints (the loader "
        "continues the exact stream of batches)",
    )
    add(
        "--stop-at",
        type=int,
        default=None,
        help="stop at this step (saved), to try --resume",
    )
    return parser.parse_args()


ARGS = parse_args()
# Before JAX starts its backend: one CPU device per mesh position.
ed.simulate_cpu_devices(ARGS.data_parallel * ARGS.tensor_parallel)


HAS_PERPLEXITY = hasattr(ed, "Perplexity")


def token_metrics(
    logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None
) -> tuple[jax.Array, ed.MetricCollection]:
    """Per-token losses, and the loss (and perplexity, when eqxdist has the metric)
    as `Metric`s, which the steps reduce across devices."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    metrics: dict[str, ed.Metric] = {"loss": ed.Mean().update(losses, weights)}
    if HAS_PERPLEXITY:
        mask = None if weights is None else weights.astype(bool)
        metrics["perplexity"] = ed.Perplexity().update(logits, targets, mask)
    return losses, ed.MetricCollection(metrics)


def loss_fn(model: TransformerLM, batch: dict[str, jax.Array], key: Any) -> Any:
    del key  # no dropout: every layout follows the same trajectory
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    losses, metrics = token_metrics(logits, tokens[:, 1:])
    return losses.mean(), metrics


def eval_fn(model: TransformerLM, batch: dict[str, jax.Array], mask: jax.Array) -> Any:
    """Held-out metrics of this device's rows; `mask` is False on the rows
    `make_eval_step` padded."""
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    weights = jnp.broadcast_to(mask[:, None], tokens[:, 1:].shape)
    return token_metrics(logits, tokens[:, 1:], weights.astype(jnp.float32))[1]


def perplexity(values: dict[str, Any]) -> float:
    if "perplexity" in values:
        return float(values["perplexity"])
    return math.exp(float(values["loss"]))  # exp of the token-weighted mean NLL


# -- data --------------------------------------------------------------------------


def load_text() -> tuple[np.ndarray, np.ndarray, str]:
    """The text as integer tokens, split 90/10 into train and held-out, and the
    vocabulary (every character that occurs)."""
    text = DATA.read_text(encoding="ascii")
    vocab = "".join(sorted(set(text)))
    ids = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    lookup = np.zeros(256, dtype=np.int32)
    lookup[np.frombuffer(vocab.encode("ascii"), dtype=np.uint8)] = np.arange(len(vocab))
    tokens = lookup[ids]
    split = int(0.9 * len(tokens))
    return tokens[:split], tokens[split:], vocab


class Windows:
    """The training windows of `seq_len + 1` tokens (inputs and next-token
    targets) of a token file on disk, every `stride` tokens: a map-style source
    for `ed.BatchLoader`, which asks for the rows of each batch (only this
    process's) and shuffles them every epoch. `np.memmap` reads only those."""

    def __init__(self, path: Path, seq_len: int, stride: int) -> None:
        self.tokens = np.memmap(path, dtype=np.uint8, mode="r")
        self.window, self.stride = seq_len + 1, stride
        self.count = (len(self.tokens) - self.window) // stride + 1

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        starts = np.asarray(indices) * self.stride
        rows = self.tokens[starts[:, None] + np.arange(self.window)]
        return {"tokens": rows.astype(np.int32)}


def token_file(train: np.ndarray) -> Path:
    """The training tokens written to OUT/train_tokens.u8 (one byte each), as a
    data set too large for memory would be stored."""
    path = Path(ARGS.out) / "train_tokens.u8"
    path.parent.mkdir(parents=True, exist_ok=True)
    disk = np.memmap(path, dtype=np.uint8, mode="w+", shape=train.shape)
    disk[:] = train
    disk.flush()
    return path


def held_out_batch(held_out: np.ndarray) -> dict[str, np.ndarray]:
    """Non-overlapping windows of the held-out text: any number of rows, which
    `make_eval_step` pads and masks."""
    window = ARGS.seq_len + 1
    rows = (len(held_out) - 1) // ARGS.seq_len
    starts = np.arange(rows) * ARGS.seq_len
    return {"tokens": held_out[starts[:, None] + np.arange(window)]}


# -- training ----------------------------------------------------------------------


def host_params(model: Any) -> list[np.ndarray]:
    """The model's arrays, gathered to the host."""
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


def state_bytes(state: ed.TrainState) -> int:
    """Bytes of parameters + optimizer state held by the first device."""
    device = jax.devices()[0]
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves((state.model, state.opt_state))
        if isinstance(leaf, jax.Array)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def new_state(vocab: int) -> tuple[ed.TrainState, optax.GradientTransformation]:
    model = TransformerLM(
        vocab,
        d_model=ARGS.d_model,
        heads=ARGS.heads,
        layers=ARGS.layers,
        mlp_ratio=ARGS.mlp_ratio,
        max_len=ARGS.seq_len,
        key=jax.random.key(ARGS.seed),
    )
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, ARGS.lr, max(1, ARGS.steps // 10), max(ARGS.steps, 2)
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)
    )
    return ed.TrainState.create(model, optimizer, jax.random.key(1)), optimizer


def describe_layout(step: ed.TrainStep, state: ed.TrainState) -> None:
    specs = step.state_specs(state).model.blocks[0]
    print("layout of block 0 (PartitionSpec of each weight):")
    for name, spec in [
        ("attn.query.weight", specs.attn.query.weight),
        ("attn.out.weight", specs.attn.out.weight),
        ("mlp.up.weight", specs.mlp.up.weight),
        ("mlp.up.bias", specs.mlp.up.bias),
        ("mlp.down.weight", specs.mlp.down.weight),
        ("norm1.weight", specs.norm1.weight),
    ]:
        print(f"  {name:<18} {spec}")


def train_fsdp_tp(
    source: Windows, vocab: str, held_out: dict[str, np.ndarray]
) -> list[np.ndarray] | None:
    """The main run; returns the parameters after `--compare-steps` steps (or
    `None` when resuming past them)."""
    mesh = ed.create_device_mesh(
        {"data": ARGS.data_parallel, "model": ARGS.tensor_parallel}
    )
    layout: dict[str, Any] = {
        "strategy": "fsdp",
        "param_rules": MEGATRON_RULES,
        "min_weight_size": ARGS.min_weight_size,
    }
    state, optimizer = new_state(len(vocab))
    step = ed.make_train_step(
        loss_fn, optimizer, mesh, num_minibatches=ARGS.minibatches, **layout
    )
    evaluate = ed.make_eval_step(eval_fn, mesh, **layout)
    num_params = sum(
        x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))
    )
    print(
        f"model: {ARGS.layers} blocks, d_model {ARGS.d_model}, {ARGS.heads} heads, "
        f"{num_params:,} parameters; mesh {dict(mesh.shape)}"
    )
    describe_layout(step, state)
    out = Path(ARGS.out)
    if not ARGS.resume:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    snapshot, start = None, time.perf_counter()
    with (
        ed.BatchLoader(source, ARGS.batch_size, mesh, seed=ARGS.seed) as loader,
        ed.CheckpointManager(
            out / "checkpoints", max_to_keep=2, save_interval_steps=ARGS.save_every
        ) as manager,
        ed.MultiWriter(
            [
                ed.JsonlWriter(out / "metrics.jsonl", append=ARGS.resume),
                ed.TensorBoardWriter(out / "tensorboard"),
            ]
        ) as writer,
    ):
        run = {
            "writer": writer,
            "checkpoints": manager,
            "log_every": ARGS.log_every,
            "tokens_per_step": ARGS.batch_size * ARGS.seq_len,
            "show": ("loss", "perplexity", "tokens_per_sec", "mfu"),
        }
        fresh = manager.latest_step() is None
        if fresh and ARGS.compare_steps > 0:
            # Stop once to keep the parameters for the data-parallel check.
            first = ed.train_loop(
                step, state, loader, ARGS.steps, **run, stop_at=ARGS.compare_steps
            )
            snapshot = host_params(first.state.model)
        result = ed.train_loop(
            step, state, loader, ARGS.steps, **run, stop_at=ARGS.stop_at
        )
    state, seconds = result.state, time.perf_counter() - start
    held = evaluate(state, held_out).compute()
    print(
        f"trained to step {result.step} in {seconds:.1f}s; held-out loss "
        f"{float(held['loss']):.4f}, perplexity {perplexity(held):.3f} "
        f"({len(held_out['tokens'])} sequences)"
    )
    if result.logs and "tokens_per_sec" in result.logs[-1][1]:
        last = result.logs[-1][1]
        util = f", MFU {100 * last['mfu']:.1f}%" if "mfu" in last else ""
        print(f"throughput: {last['tokens_per_sec']:,.0f} tokens/s{util}")
    print(f"train state bytes per device: {state_bytes(state):,}")
    if ARGS.sample_chars > 0:
        print("sample: " + repr(generate(state.model, vocab, "Shall I ")))
    return snapshot


def generate(model: TransformerLM, vocab: str, prompt: str) -> str:
    """A sampled continuation of `prompt` (temperature 0.8), on one device."""
    model = jax.device_put(model, jax.devices()[0])
    index = {c: i for i, c in enumerate(vocab)}
    window = np.zeros(ARGS.seq_len, dtype=np.int32)
    tokens = [index[c] for c in prompt if c in index]

    @eqx.filter_jit
    def next_token(model: TransformerLM, window: Any, pos: Any, key: Any) -> Any:
        # Causal: the logits at `pos` ignore the zeros after it.
        return jax.random.categorical(key, model(window)[pos] / 0.8)

    text = prompt
    keys = jax.random.split(jax.random.key(ARGS.seed), ARGS.sample_chars)
    for key in keys:
        recent = tokens[-ARGS.seq_len :]
        window[: len(recent)] = recent
        token = int(next_token(model, window, jnp.asarray(len(recent) - 1), key))
        tokens.append(token)
        text += vocab[token]
    return text


def compare_with_dp(source: Windows, vocab: str, expected: list[np.ndarray]) -> bool:
    """Plain data parallelism (every device holds the whole state, 8-way batch
    split) on the same batches (a loader on this mesh gives the same global
    batches), from the same initial state."""
    mesh = ed.create_data_parallel_mesh()
    state, optimizer = new_state(len(vocab))
    step = ed.make_train_step(
        loss_fn, optimizer, mesh, strategy="dp", num_minibatches=ARGS.minibatches
    )
    loader = ed.BatchLoader(source, ARGS.batch_size, mesh, seed=ARGS.seed)
    for i in range(ARGS.compare_steps):
        state, _ = step(state, loader.batch(i))
    got = host_params(state.model)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True))
    agree = diff < 1e-5
    print(
        f"DP ({mesh.size} devices) vs FSDP x TP after {ARGS.compare_steps} steps: "
        f"max |param diff| {diff:.2e} (tolerance 1e-5): "
        + ("parameters agree" if agree else "parameters DISAGREE")
    )
    return agree


def main() -> None:
    train, held_out, vocab = load_text()
    if ARGS.compare_steps > ARGS.steps:
        sys.exit("--compare-steps must not exceed --steps")
    print(
        f"text: {len(train):,} training / {len(held_out):,} held-out characters, "
        f"vocabulary of {len(vocab)}"
    )
    source = Windows(token_file(train), ARGS.seq_len, max(1, ARGS.seq_len // 8))
    snapshot = train_fsdp_tp(source, vocab, held_out_batch(held_out))
    if snapshot is None and ARGS.compare_steps > 0:
        print("resumed past --compare-steps: no data-parallel check in this run")
    if snapshot is not None and not compare_with_dp(source, vocab, snapshot):
        sys.exit(1)


if __name__ == "__main__":
    main()
