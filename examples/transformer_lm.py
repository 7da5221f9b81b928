"""Train a character-level transformer language model: FSDP with tensor, pipeline,
context or expert parallelism.

A small decoder-only transformer written in plain Equinox (`_transformer.py`: token
and position embeddings, pre-LayerNorm blocks of causal self-attention and an MLP)
learns to continue the public-domain text in `examples/data/public_domain.txt`
(Shakespeare's sonnets and US founding documents, see `examples/data/README.md`), on
8 simulated CPU devices arranged as a `{"data": 4, "model": 2}` mesh.

The training sequences have variable length, as real documents do: each window
holds a random number of real characters in `[--min-len, --seq-len]` (drawn once
per window from the seed, so the stream is the same after a resume), padded at
the end to `--seq-len` with a pad token and marked by a boolean mask. Causal
attention needs no change for end padding (no real position attends to a later
one); the padded positions are left out of the loss by the mask. The loss is
token-weighted: `loss_fn` returns `(loss_sum, real_tokens)` and the step
minimises the summed loss over the real tokens of the whole global batch, however
unevenly they fall across devices and minibatches.

The state is built straight into its sharded layout (`step.init_state`):

- the batch is split 4 ways over `"data"`, and parameters (with their Adam moments)
  are sharded 4 ways over it too (`strategy="fsdp"`);
- the attention and MLP weights are also split 2 ways over `"model"` in the Megatron
  layout (`param_rules`): query/key/value and the MLP's first layer column-wise
  (by output features), the attention output and the MLP's second layer row-wise
  (by input features), so each device holds 1/8 of them.

With `--pipeline-parallel N` the blocks are one `ed.Stacked` and the mesh is
`{"stage": N, "data": 8 / N}`: each stage holds N-th of the blocks (sharded over
`"data"` too, FSDP), each device's rows are cut into `--microbatches`
microbatches that flow through the stages, and embeddings, head and loss run as
before. `--schedule` is any of `ed.Pipeline`'s: `1f1b` (the default, as the
pipeline guide advises: at most N microbatches' activations alive per stage),
`gpipe`, `zb-h1` (zero bubble), and with `--repeats R > 1` `circular` or
`interleaved`; with `--context-parallel` the default is `gpipe` (the schedules
whose backward is written out do not go with a context axis). `--remat` chooses
what the backward pass keeps of each block.

With `--experts E` each block's MLP is an `ed.MoE` of E experts (top `--top-k`
per token), its auxiliary losses added to the loss and shown as `aux_loss`;
`--expert-parallel` splits the experts over the `"data"` axis.

With `--context-parallel N` every sequence is split over the N devices of a
`"context"` axis (`{"data": 8 / N, "context": N}`): each device holds two chunks
of each of its rows (balanced for causal attention), finds their positions with
`ed.context_positions`, and attention (`ed.attention`, on one device
`jax.nn.dot_product_attention`) passes keys and values round the ring, so no
device holds a whole sequence. It composes with `--pipeline-parallel` (`{"stage",
"data", "context"}`: each stage's blocks run ring attention over its own
`"context"` devices). `--chunked-loss C` computes the head's logits C
rows at a time (`ed.linear_cross_entropy`), never all of them.

The loss function is written for one device and full-size arrays; eqxdist places
everything and XLA partitions the computation. The loop is `eqxdist.train_loop`:
the script prints the layout, a progress bar with the loss, perplexity, gradient
norm (`step_info=True`), tokens/s (and MFU on a GPU or TPU), writes them with the
real-token count of each logged step to OUT/metrics.jsonl and TensorBoard, then
prints held-out perplexity and a sample of generated text. Last, it trains the
same model for `--compare-steps` steps from the fresh state twice, in the main
run's layout and under plain data parallelism (8 devices, so every device sees
other rows and other numbers of real tokens), on the same batches, and checks
that both give the same parameters: an equal-weight mean of per-device losses
would not.

    python examples/transformer_lm.py [--steps 600] [--d-model 64] [--layers 2] [--bf16]
    python examples/transformer_lm.py --pipeline-parallel 2 --microbatches 4 \
        --schedule 1f1b --layers 4 [--remat full]
    python examples/transformer_lm.py --pipeline-parallel 2 --schedule interleaved \
        --repeats 2 --layers 4
    python examples/transformer_lm.py --experts 4 --top-k 2 --expert-parallel
    python examples/transformer_lm.py --context-parallel 8 --seq-len 16384 \
        --batch-size 1 --min-len 8192 --chunked-loss 4096 --compare-steps 0
    python examples/transformer_lm.py --pipeline-parallel 2 --context-parallel 2 \
        --layers 4
"""

import argparse
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
from _transformer import (
    MEGATRON_RULES,
    MOE_MEGATRON_RULES,
    STACKED_MEGATRON_RULES,
    STACKED_MOE_MEGATRON_RULES,
    TransformerLM,
)

import eqxdist as ed

DATA = Path(__file__).resolve().parent / "data" / "public_domain.txt"


def _size(text: str) -> int | None:
    """An axis size, or `None` for "auto"."""
    return None if text == "auto" else int(text)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--steps", type=int, default=600, help="training steps")
    add("--batch-size", type=int, default=32, help="global batch (sequences)")
    add(
        "--seq-len",
        type=int,
        default=64,
        help="positions per training sequence (real characters + padding)",
    )
    add(
        "--min-len",
        type=int,
        default=16,
        help="fewest real characters (predicted targets) in a training sequence; "
        "each has a random number in [min-len, seq-len]",
    )
    add("--d-model", type=int, default=64, help="width of the residual stream")
    add("--heads", type=int, default=4, help="attention heads")
    add("--layers", type=int, default=2, help="transformer blocks")
    add("--mlp-ratio", type=int, default=4, help="MLP hidden width / d-model")
    add(
        "--experts",
        type=int,
        default=0,
        help="a mixture of N experts (ed.MoE, dropless) in place of each block's "
        "MLP, its auxiliary losses in the loss (0: dense MLPs)",
    )
    add("--top-k", type=int, default=2, help="experts per token (with --experts)")
    add(
        "--expert-parallel",
        action="store_true",
        help='the experts split over the "data" axis (ed.Layout(expert_axis=)): '
        "each device holds experts / data-parallel of them, tokens travel",
    )
    add("--lr", type=float, default=1e-2, help="peak adamw learning rate")
    add("--minibatches", type=int, default=1, help="gradient accumulation steps")
    add(
        "--bf16",
        action="store_true",
        help="compute in bfloat16 (float32 parameters and optimizer state): what "
        "a GPU or TPU runs at its peak",
    )
    add(
        "--data-parallel",
        type=_size,
        default="auto",
        help='size of the "data" axis (auto: the rest of 8 devices: 4, or 8 / N '
        "with --pipeline-parallel N)",
    )
    add(
        "--tensor-parallel",
        type=_size,
        default="auto",
        help='size of the "model" axis (auto: 2, or 1 with --pipeline-parallel)',
    )
    add(
        "--pipeline-parallel",
        type=int,
        default=1,
        help='size of the "stage" axis: the blocks (an ed.Stacked) split into N '
        "pipeline stages (1: no pipeline)",
    )
    add(
        "--microbatches",
        type=_size,
        default="auto",
        help="pipeline microbatches per device and minibatch (auto: 2 x the stages)",
    )
    add(
        "--schedule",
        choices=("1f1b", "gpipe", "zb-h1", "circular", "interleaved"),
        default=argparse.SUPPRESS,  # its default depends on --context-parallel
        help="pipeline schedule (ed.Pipeline): 1f1b (one forward one backward), "
        "gpipe (all forwards then all backwards), zb-h1 (zero bubble: 1f1b with "
        "each backward split in two), circular (gpipe over --repeats rounds of "
        "the ring), interleaved (1f1b over --repeats chunks per stage) "
        "(default: 1f1b; gpipe with --context-parallel)",
    )
    add(
        "--repeats",
        type=int,
        default=1,
        help="chunks of layers per stage of the circular and interleaved schedules",
    )
    add(
        "--context-parallel",
        type=int,
        default=1,
        help='size of the "context" axis: every sequence split over N devices '
        "(ring attention through ed.attention; 1: whole sequences)",
    )
    add(
        "--chunked-loss",
        type=int,
        default=0,
        help="rows per chunk of ed.linear_cross_entropy: the logits computed chunk "
        "by chunk, never whole (0: whole logits, Optax's loss)",
    )
    add(
        "--remat",
        choices=("none", "full", "dots", "offload"),
        default="none",
        help="what the backward pass keeps of each block: everything, its input, "
        "matrix products, its input in host memory (not none: --stacked)",
    )
    add(
        "--stacked",
        action="store_true",
        help="hold the blocks in one ed.Stacked, scanned over the layers (implied "
        "by --pipeline-parallel > 1 and --remat)",
    )
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
        help="steps trained again from the fresh state, in the main layout and "
        "under plain data parallelism, to check that they agree "
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
    return resolve_parallelism(parser, parser.parse_args())


def resolve_parallelism(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.Namespace:
    """The axis sizes of the mesh ("auto": 8 devices in all), the pipeline
    (`args.pipeline`, `None` without stages) and whether the blocks are stacked;
    a usage error for options that do not go together."""
    stages, context = args.pipeline_parallel, args.context_parallel
    if stages < 1 or context < 1:
        parser.error("--pipeline-parallel and --context-parallel must be >= 1")
    if args.seq_len % (2 * context):
        parser.error(
            f"--seq-len {args.seq_len} must be a multiple of 2 x --context-parallel "
            f"= {2 * context} (each device holds two chunks of every sequence)"
        )
    if args.tensor_parallel is None:
        args.tensor_parallel = 1 if stages > 1 or context > 1 else 2
    if args.data_parallel is None:
        if 8 % (stages * args.tensor_parallel * context):
            parser.error(
                "--pipeline-parallel x --tensor-parallel x --context-parallel must "
                "divide 8"
            )
        args.data_parallel = 8 // (stages * args.tensor_parallel * context)
    args.pipeline = None
    given = getattr(args, "schedule", None)
    args.schedule = given or ("gpipe" if context > 1 else "1f1b")
    if stages == 1:
        if (args.microbatches, given, args.repeats) != (None, None, 1):
            parser.error(
                "--microbatches, --schedule and --repeats configure a pipeline: "
                "add --pipeline-parallel N (N > 1)"
            )
    else:
        micro = args.microbatches or 2 * stages
        try:
            args.pipeline = ed.Pipeline(
                "stage", micro, schedule=args.schedule, repeats=args.repeats
            )
        except ValueError as e:
            parser.error(str(e))
        if context > 1 and args.schedule in ("1f1b", "interleaved", "zb-h1"):
            # make_train_step refuses the pair: these stages run forward and
            # backward passes at once, whose ring collectives do not pair up.
            parser.error(
                f"--schedule {args.schedule} does not go with --context-parallel "
                "> 1: use --schedule gpipe or circular (with --repeats > 1)"
            )
        rows = args.batch_size // (args.data_parallel * args.minibatches)
        if rows % micro:
            parser.error(
                f"--microbatches {micro} must divide each device's {rows} rows "
                "(--batch-size / (data-parallel x --minibatches))"
            )
        if args.layers % (stages * args.repeats):
            parser.error(
                f"--layers {args.layers} must be a multiple of --pipeline-parallel "
                f"x --repeats = {stages * args.repeats}"
            )
    if args.experts < 0 or (args.experts and not 1 <= args.top_k <= args.experts):
        parser.error("--experts must be >= 0 and --top-k in [1, --experts]")
    if args.expert_parallel and not args.experts:
        parser.error(
            "--expert-parallel splits the experts of each block over the data "
            "axis: add --experts N (a multiple of the data-parallel size, "
            f"{args.data_parallel})"
        )
    if args.expert_parallel and args.experts % args.data_parallel:
        parser.error(
            f"--expert-parallel splits --experts over the {args.data_parallel} "
            "devices of the data axis: give --experts a multiple of it"
        )
    args.stacked = args.stacked or stages > 1 or args.remat != "none"
    return args


ARGS = parse_args()
COMPUTE_DTYPE = jnp.bfloat16 if ARGS.bf16 else None
# Before JAX starts its backend: one CPU device per mesh position.
ed.simulate_cpu_devices(
    ARGS.pipeline_parallel
    * ARGS.data_parallel
    * ARGS.tensor_parallel
    * ARGS.context_parallel
)
# The mesh axis the sequences are split over (`None`: whole sequences).
CONTEXT = "context" if ARGS.context_parallel > 1 else None


def token_metrics(
    model: TransformerLM,
    batch: dict[str, jax.Array],
    mask: jax.Array,
    context_axis: str | None = CONTEXT,
) -> tuple[tuple[jax.Array, jax.Array], ed.MetricCollection]:
    """The summed next-token loss of this device's `batch` (rows of `inputs` and
    `targets`, or with `--context-parallel` their chunks) where `mask` (`(rows,
    length)`, True on real targets) is True, with the number of real targets;
    and the loss, perplexity and real-token count as `Metric`s, which the steps
    reduce across devices."""
    inputs, targets = batch["inputs"], batch["targets"]
    # With a context axis a device holds two chunks of each sequence (the step
    # balances them): their positions in the whole sequence.
    positions = (
        None
        if context_axis is None
        else ed.context_positions(inputs.shape[1], context_axis)
    )
    weights = mask.astype(jnp.float32)
    count = weights.sum()
    # Each sequence's weighted MoE auxiliary losses (0 without experts), as a
    # per-token term: the step divides the sums by the real tokens.
    hidden, aux = jax.vmap(lambda t: model.hidden_and_aux(t, positions))(inputs)
    aux_sum = jnp.sum(aux * weights.sum(axis=1))
    if ARGS.chunked_loss:
        head = model.head
        loss_sum, _ = ed.linear_cross_entropy(
            hidden.astype(jnp.float32), head.weight.astype(jnp.float32), targets,
            bias=head.bias.astype(jnp.float32), weights=weights,
            chunk_size=ARGS.chunked_loss,
        )  # fmt: skip
        # The token mean as a weighted mean of one value per device.
        mean = jnp.where(count > 0, loss_sum / jnp.maximum(count, 1.0), 0.0)
        loss = ed.metrics.Mean().update(mean[None], count[None])
        # Perplexity is exp of the token-weighted mean NLL, the state it keeps
        # (`nll`): that mean is the loss here, as the logits it reads are never
        # whole.
        perplexity = eqx.tree_at(lambda p: p.nll, ed.metrics.Perplexity(), loss)
        metrics = {"loss": loss, "perplexity": perplexity}
    else:
        # The softmax in float32 whatever the compute dtype (`--bf16`).
        logits = jax.vmap(jax.vmap(model.head))(hidden).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        loss_sum = jnp.sum(jnp.where(mask, losses, 0.0))
        metrics = {
            "loss": ed.metrics.Mean().update(losses, weights),
            "perplexity": ed.metrics.Perplexity().update(logits, targets, mask),
        }
    metrics["real_tokens"] = ed.metrics.Sum().update(mask.sum())
    if ARGS.experts:
        metrics["aux_loss"] = ed.metrics.Mean().update(aux)
    return (loss_sum + aux_sum, count), ed.MetricCollection(metrics)


def loss_fn(model: TransformerLM, batch: dict[str, jax.Array], key: Any) -> Any:
    """Token-weighted: the summed loss of this device's real tokens and their
    number; the step divides the global sum by the global count."""
    del key  # no dropout: every layout follows the same trajectory
    return token_metrics(model, batch, batch["mask"])


def whole_sequence_loss(model: TransformerLM, batch: Any, key: Any) -> Any:
    """`loss_fn` of a step without a context axis (the data-parallel check)."""
    del key
    return token_metrics(model, batch, batch["mask"], context_axis=None)


def eval_fn(model: TransformerLM, batch: dict[str, jax.Array], rows: jax.Array) -> Any:
    """Held-out metrics of this device's rows; `rows` is False on the rows
    `make_eval_step` padded."""
    mask = batch["mask"] & rows[:, None]
    return token_metrics(model, batch, mask)[1]


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
    """The training windows of a token file on disk, one every `stride` tokens,
    of variable length: window `i` holds `lengths[i] + 1` real tokens (inputs and
    next-token targets), `lengths[i]` in `[min_len, seq_len]`, then `pad_id` up
    to `seq_len + 1`. A map-style source for `ed.BatchLoader`, which asks for the
    rows of each batch (only this process's) and shuffles them every epoch;
    `np.memmap` reads only those.

    Each row is `{"inputs", "targets": (seq_len,) int32, "mask": (seq_len,)
    bool}`, the targets the inputs shifted by one, `mask` True on the real
    targets (every leaf of one length: a context axis splits them alike). The
    lengths are drawn once from `seed`, so row `i` is a pure function of `(i,
    seed)`: every process and every resumed run reads the same rows."""

    def __init__(
        self, path: Path, seq_len: int, stride: int, min_len: int, pad_id: int
    ) -> None:
        self.tokens = np.memmap(path, dtype=np.uint8, mode="r")
        self.seq_len, self.stride, self.pad_id = seq_len, stride, pad_id
        self.count = (len(self.tokens) - seq_len - 1) // stride + 1
        rng = np.random.default_rng([ARGS.seed, 1])
        self.lengths = rng.integers(min_len, seq_len + 1, size=self.count)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices)
        starts = indices * self.stride
        rows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
        rows = rows.astype(np.int32)
        mask = np.arange(self.seq_len) < self.lengths[indices][:, None]
        rows[:, 1:][~mask] = self.pad_id  # padding at the end only
        return {"inputs": rows[:, :-1], "targets": rows[:, 1:], "mask": mask}


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
    `make_eval_step` pads and masks. They are whole (every target real); a
    sequence longer than the held-out text reads it round again."""
    window = ARGS.seq_len + 1
    rows = max(1, (len(held_out) - 1) // ARGS.seq_len)
    held_out = np.resize(held_out, max(len(held_out), window))
    starts = np.arange(rows) * ARGS.seq_len
    tokens = held_out[starts[:, None] + np.arange(window)]
    mask = np.ones((rows, ARGS.seq_len), dtype=bool)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


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


def make_optimizer() -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, ARGS.lr, max(1, ARGS.steps // 10), max(ARGS.steps, 2)
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)
    )


def new_model(vocab_size: int, key: jax.Array, context_axis: str | None) -> Any:
    return TransformerLM(
        vocab_size,
        d_model=ARGS.d_model,
        heads=ARGS.heads,
        layers=ARGS.layers,
        mlp_ratio=ARGS.mlp_ratio,
        max_len=ARGS.seq_len,
        key=key,
        stacked=ARGS.stacked,
        context_axis=context_axis,
        experts=ARGS.experts,
        top_k=ARGS.top_k,
    )


def initial_state(
    step: ed.TrainStep,
    vocab_size: int,
    optimizer: optax.GradientTransformation,
    context_axis: str | None = CONTEXT,
) -> ed.TrainState:
    """The fresh state built under `jit` straight into `step`'s layout, each
    device drawing only its shard of every parameter (and of the Adam moments):
    no device ever holds the whole model."""

    def init_fn(model_key: jax.Array, state_key: jax.Array) -> ed.TrainState:
        model = new_model(vocab_size, model_key, context_axis)
        return ed.TrainState.create(model, optimizer, state_key)

    return step.init_state(init_fn, jax.random.key(ARGS.seed), jax.random.key(1))


def describe_layout(step: ed.TrainStep, state: ed.TrainState) -> None:
    blocks = step.state_specs(state).model.blocks
    if isinstance(blocks, ed.Stacked):
        specs = blocks.layers
        print(
            "layout of the stacked blocks (PartitionSpec of each weight, layer first):"
        )
    else:
        specs = blocks[0]
        print("layout of block 0 (PartitionSpec of each weight):")
    if isinstance(specs.mlp, ed.MoE):
        mlp = [
            ("mlp.router.weight", specs.mlp.router.weight),
            ("mlp.w_in", specs.mlp.w_in),
            ("mlp.w_out", specs.mlp.w_out),
        ]
    else:
        mlp = [
            ("mlp.up.weight", specs.mlp.up.weight),
            ("mlp.up.bias", specs.mlp.up.bias),
            ("mlp.down.weight", specs.mlp.down.weight),
        ]
    for name, spec in [
        ("attn.query.weight", specs.attn.query.weight),
        ("attn.out.weight", specs.attn.out.weight),
        *mlp,
        ("norm1.weight", specs.norm1.weight),
    ]:
        print(f"  {name:<18} {spec}")


def layout_name() -> str:
    """The main run's layout, in words."""
    names = [] if ARGS.pipeline is None else [f"{ARGS.schedule} pipeline"]
    if CONTEXT is not None:
        names.append("context-parallel")
    names.append("FSDP")
    if ARGS.tensor_parallel > 1:
        names.append("TP")
    return " x ".join(names)


def main_layout() -> ed.Layout:
    """The main run's layout: FSDP x TP on `{"data", "model"}`, or with a
    pipeline `{"stage", "data"}` (and "model" if --tensor-parallel), and a
    context axis with --context-parallel. One value, shared by the train step,
    the evaluation step and the loaders."""
    axes = {"data": ARGS.data_parallel, "model": ARGS.tensor_parallel}
    if ARGS.pipeline is not None:
        axes = {"stage": ARGS.pipeline_parallel, **axes}
    if CONTEXT is not None:
        axes[CONTEXT] = ARGS.context_parallel
    if ARGS.tensor_parallel == 1 and (ARGS.pipeline or CONTEXT):
        del axes["model"]
    layout: dict[str, Any] = {
        "strategy": "fsdp",
        "min_weight_size": ARGS.min_weight_size,
    }
    if "model" in axes:
        layout["param_rules"] = {
            (False, False): MEGATRON_RULES,
            (True, False): STACKED_MEGATRON_RULES,
            (False, True): MOE_MEGATRON_RULES,
            (True, True): STACKED_MOE_MEGATRON_RULES,
        }[ARGS.stacked, bool(ARGS.experts)]
    if ARGS.expert_parallel:
        layout["expert_axis"] = "data"
    if ARGS.pipeline is not None:
        layout["pipeline"] = ARGS.pipeline
    if CONTEXT is not None:
        layout["context_axis"] = CONTEXT
    return ed.Layout(ed.create_device_mesh(axes), **layout)


def describe_pipeline() -> None:
    pipeline, stages = ARGS.pipeline, ARGS.pipeline_parallel
    if pipeline is not None:
        rows = ARGS.batch_size // (ARGS.data_parallel * ARGS.minibatches)
        print(
            f"pipeline: {pipeline.schedule}, {stages} stages of "
            f"{ARGS.layers // stages} block(s), repeats {pipeline.repeats}, "
            f"{pipeline.microbatches} microbatches of {rows // pipeline.microbatches} "
            f"rows per device: idle fraction {pipeline.idle_fraction(stages):.2f} "
            f"(ed.Pipeline.idle_fraction); remat {ARGS.remat}"
        )
    elif ARGS.remat != "none":
        print(f"remat {ARGS.remat}")


def train_main(
    source: Windows, vocab: str, held_out: dict[str, np.ndarray]
) -> tuple[ed.TrainStep, Any]:
    """The main run, one `train_loop` from step 0 (or with --resume from the
    latest checkpoint); returns its step."""
    layout = main_layout()
    mesh = layout.mesh
    optimizer = make_optimizer()
    step = ed.make_train_step(
        loss_fn,
        optimizer,
        layout,
        num_minibatches=ARGS.minibatches,
        compute_dtype=COMPUTE_DTYPE,
        step_info=True,  # logs grad_norm, update_norm and param_norm
        remat=None if ARGS.remat == "none" else ARGS.remat,
    )
    evaluate = ed.make_eval_step(eval_fn, layout, compute_dtype=COMPUTE_DTYPE)
    state = initial_state(step, len(vocab) + 1, optimizer)  # + the pad token
    num_params = sum(
        x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))
    )
    print(
        f"model: {ARGS.layers} blocks, d_model {ARGS.d_model}, {ARGS.heads} heads, "
        f"{num_params:,} parameters; mesh {dict(mesh.shape)}"
    )
    print(layout)  # every mesh axis and its roles
    describe_pipeline()
    describe_layout(step, state)
    print(f"train state bytes per device: {state_bytes(state):,}")
    out = Path(ARGS.out)
    if not ARGS.resume:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    start = time.perf_counter()
    with (
        ed.BatchLoader(source, ARGS.batch_size, layout, seed=ARGS.seed) as loader,
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
        result = ed.train_loop(
            step, state, loader, ARGS.steps, writer=writer, checkpoints=manager,
            log_every=ARGS.log_every, stop_at=ARGS.stop_at,
            # Positions computed, padding included (what the devices work on).
            tokens_per_step=ARGS.batch_size * ARGS.seq_len,
            show=(
                "loss", "perplexity", *(("aux_loss",) if ARGS.experts else ()),
                "grad_norm", "tokens_per_sec", "mfu",
            ),
        )  # fmt: skip
    report(result, evaluate(result.state, held_out).compute(), held_out, start)
    if ARGS.sample_chars > 0:
        print("sample: " + repr(generate(result.state.model, vocab, "Shall I ")))
    return step


def report(
    result: ed.LoopResult, held: Any, held_out: dict[str, Any], start: float
) -> None:
    """Held-out loss and perplexity, and the throughput of the last log point."""
    loss, perplexity = float(held["loss"]), float(held["perplexity"])
    print(
        f"trained to step {result.step} in {time.perf_counter() - start:.1f}s; "
        f"held-out loss {loss:.4f}, perplexity "
        f"{perplexity:.3f} ({len(held_out['inputs'])} sequences)"
    )
    logs = [values for _, values in result.logs]
    if logs and "tokens_per_sec" in logs[-1]:
        positions = ARGS.batch_size * ARGS.seq_len
        real = sum(v["real_tokens"] for v in logs) / len(logs) / positions
        mfu = logs[-1].get("mfu")
        kind = jax.devices()[0].device_kind
        print(
            f"throughput: {logs[-1]['tokens_per_sec']:,.0f} tokens/s "
            f"({real * logs[-1]['tokens_per_sec']:,.0f} real, {100 * real:.0f}% of "
            "positions), "
            + (
                f"MFU {100 * mfu:.1f}%"
                if mfu is not None
                else f"MFU n/a (the peak FLOP/s of a {kind!r} device is unknown: "
                "ed.mfu knows GPUs and TPUs)"
            )
        )
    if logs:
        print(f"last grad_norm {logs[-1]['grad_norm']:.4f}")


def generate(model: TransformerLM, vocab: str, prompt: str) -> str:
    """A sampled continuation of `prompt` (temperature 0.8), on one device."""
    # The trained arrays in a model whose attention runs on one device.
    single = new_model(len(vocab) + 1, jax.random.key(0), None)
    model = jax.tree.unflatten(jax.tree.structure(single), jax.tree.leaves(model))
    model = jax.device_put(model, jax.devices()[0])
    index = {c: i for i, c in enumerate(vocab)}
    window = np.zeros(ARGS.seq_len, dtype=np.int32)
    tokens = [index[c] for c in prompt if c in index]

    @eqx.filter_jit
    def next_token(model: TransformerLM, window: Any, pos: Any, key: Any) -> Any:
        # Causal: the logits at `pos` ignore the zeros after it. The pad token
        # (the last logit) is never a real character.
        return jax.random.categorical(key, model(window)[pos, :-1] / 0.8)

    text = prompt
    keys = jax.random.split(jax.random.key(ARGS.seed), ARGS.sample_chars)
    for key in keys:
        recent = tokens[-ARGS.seq_len :]
        window[: len(recent)] = recent
        token = int(next_token(model, window, jnp.asarray(len(recent) - 1), key))
        tokens.append(token)
        text += vocab[token]
    return text


def first_steps(step: ed.TrainStep, source: Windows, vocab: str) -> Any:
    """The parameters of `--compare-steps` steps of `step` from the fresh state,
    on a loader of its layout's batches: a short run of its own, so that the main run
    stays one `train_loop` (a fresh --out trains from step 0 and a resumed run is
    checked too)."""
    state = initial_state(step, len(vocab) + 1, make_optimizer())
    loader = ed.BatchLoader(source, ARGS.batch_size, step.layout, seed=ARGS.seed)
    for i in range(ARGS.compare_steps):
        state, _ = step(state, loader.batch(i))
    return host_params(state.model)


def compare_with_dp(source: Windows, vocab: str, expected: list[np.ndarray]) -> bool:
    """Plain data parallelism (every device holds the whole state, 8-way batch
    split) on the same batches (a loader on this mesh gives the same global
    batches), from the same initial state. The devices now hold other rows, with
    other numbers of real tokens, than in the main run: the parameters agree
    only because the loss is weighted by the global token count."""
    mesh = ed.create_data_parallel_mesh()
    optimizer = make_optimizer()
    step = ed.make_train_step(
        whole_sequence_loss,
        optimizer,
        mesh,
        strategy="dp",
        num_minibatches=ARGS.minibatches,
        compute_dtype=COMPUTE_DTYPE,
    )
    state = initial_state(step, len(vocab) + 1, optimizer, context_axis=None)
    loader = ed.BatchLoader(source, ARGS.batch_size, mesh, seed=ARGS.seed)
    for i in range(ARGS.compare_steps):
        state, _ = step(state, loader.batch(i))
    got = host_params(state.model)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True))
    # bfloat16 rounds the activations of the two layouts differently.
    tolerance = 2e-2 if ARGS.bf16 else 1e-5
    agree = diff < tolerance
    print(
        f"DP ({mesh.size} devices) vs {layout_name()} after {ARGS.compare_steps} "
        "steps: "
        f"max |param diff| {diff:.2e} (tolerance {tolerance:g}): "
        + ("parameters agree" if agree else "parameters DISAGREE")
    )
    return agree


def main() -> None:
    train, held_out, vocab = load_text()
    if ARGS.compare_steps > ARGS.steps:
        sys.exit("--compare-steps must not exceed --steps")
    if not 1 <= ARGS.min_len <= ARGS.seq_len:
        sys.exit(
            f"--min-len must be in [1, --seq-len={ARGS.seq_len}]; got {ARGS.min_len}"
        )
    print(
        f"text: {len(train):,} training / {len(held_out):,} held-out characters, "
        f"vocabulary of {len(vocab)} + a pad token"
    )
    source = Windows(
        token_file(train),
        ARGS.seq_len,
        max(1, ARGS.seq_len // 8),
        ARGS.min_len,
        pad_id=len(vocab),
    )
    step = train_main(source, vocab, held_out_batch(held_out))
    if ARGS.compare_steps > 0:
        snapshot = first_steps(step, source, vocab)
        if not compare_with_dp(source, vocab, snapshot):
            sys.exit(1)


if __name__ == "__main__":
    main()
