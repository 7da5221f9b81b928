"""A transformer training step on the accelerators at hand: the choices a user
makes with eqxdist, each against a hand-written `eqx.filter_jit` step, with model
FLOP utilisation.

The other benchmarks simulate 8 CPU devices; this one runs on whatever devices
JAX's default backend has (one GPU, a TPU slice, or the CPU for `--tiny`). The
decoder-only transformer of `examples/transformer_lm.py` (`examples/_transformer.py`;
by default 350M parameters: d_model 1024 x 24 layers, 16 heads, 2048 tokens,
batch 16, vocabulary 32768) trains with adamw on random tokens, computing in
bfloat16 with float32 parameters and optimizer state. The hand-written step,
always run, is `eqx.filter_jit` of `eqx.filter_value_and_grad` of the mean loss
over the global batch plus the optax update, the parameters cast to bfloat16
inside the loss, the batch split over the devices by a `NamedSharding` and the
state donated: the step a user writes without eqxdist, and the reference of the
ratios. `--variants` chooses among (default: all; `fsdp` only on several
devices):

- `list`: `ed.make_train_step(..., compute_dtype=jnp.bfloat16)` (data
  parallel), the blocks a Python list;
- `stacked`: the blocks an `ed.Stacked` (a `jax.lax.scan`: XLA's while loop);
- `unroll`: the `ed.Stacked` with `unroll=True` (a Python loop, no while loop);
- `dots`, `full`: the unrolled `Stacked` with `remat="dots"` / `"full"`;
- `chunked`: list blocks, the loss `ed.linear_cross_entropy` on the bfloat16
  hidden states and head (`--chunk-size` rows at a time) in place of whole
  logits;
- `batch2`: list blocks on twice the batch (its ratio is per token);
- `info`: list blocks with `step_info=True, skip_nonfinite=True`;
- `fsdp`: list blocks, parameters and optimizer state sharded over the devices.

Each variant is compiled (and run twice) in turn, its first call's seconds
printed (`compile s`: tracing and compiling). Timing is then interleaved: every
repeat times each variant for `--steps` steps (their order rotating), blocking
at the end of each; the table gives the median milliseconds per step, the median
(min-max) of the per-repeat ratios to the hand-written step (per token), the
model TFLOP/s and MFU: the step's matrix-product FLOPs
(`TrainStep.cost(...)["model_flops"]` of the plain loss, per row, times the
variant's rows) over the median step time and the devices' peak dense bfloat16
FLOP/s (`ed.mfu`; none on CPU). `--budget` bounds the whole run: a variant
whose compile would not fit is skipped (and says so), and the repeats shrink to
the time left.

    python benchmarks/bench_accelerator.py [--tiny] [--variants list,unroll]
        [--d-model 1024] [--layers 24] [--seq-len 2048] [--batch 16]
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _transformer import TransformerLM, benchmark_model

HAND = "hand-written"
START = time.perf_counter()


@dataclasses.dataclass(frozen=True)
class Variant:
    """One choice: how the blocks are held (`stacked`, with the `Stacked`'s
    `unroll` and `remat` given as the step's options), the other
    `make_train_step` options, the loss (`chunked`) and the batch's size."""

    label: str
    stacked: bool = False
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    chunked: bool = False
    batch_times: int = 1
    several_devices: bool = False


VARIANTS = {
    "list": Variant("list blocks"),
    "stacked": Variant("Stacked (scan)", stacked=True, options={"unroll": False}),
    "unroll": Variant("Stacked unroll", stacked=True, options={"unroll": True}),
    "dots": Variant(
        "unroll remat=dots", stacked=True, options={"unroll": True, "remat": "dots"}
    ),
    "full": Variant(
        "unroll remat=full", stacked=True, options={"unroll": True, "remat": "full"}
    ),
    "chunked": Variant("chunked loss bf16", chunked=True),
    "batch2": Variant("batch x2", batch_times=2),
    "info": Variant("+info+skip", options={"step_info": True, "skip_nonfinite": True}),
    "fsdp": Variant("fsdp", options={"strategy": "fsdp"}, several_devices=True),
}


def loss_fn(model: TransformerLM, batch: dict[str, jax.Array], key: Any) -> Any:
    del key
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1]).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


def chunked_loss_fn(chunk_size: int) -> Callable[..., Any]:
    """The mean loss as `ed.linear_cross_entropy` computes it: the head's logits
    `chunk_size` rows at a time, in the compute dtype (bfloat16)."""

    def loss(model: TransformerLM, batch: dict[str, jax.Array], key: Any) -> Any:
        del key
        tokens = batch["tokens"]
        hidden = jax.vmap(model.hidden)(tokens[:, :-1])
        total, count = ed.linear_cross_entropy(
            hidden,
            model.head.weight,
            tokens[:, 1:],
            bias=model.head.bias,
            chunk_size=chunk_size,
        )
        return (total, count), {}

    return loss


def _hand_written(
    model: Any, optimizer: Any, mesh: Any, batch: Any
) -> Callable[[], Any]:
    replicated = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P("data"))
    params = eqx.filter_shard(model, replicated)
    opt_state = optimizer.init(eqx.filter(params, eqx.is_array))
    global_batch = jax.device_put(batch, rows)

    def mean_loss(params: Any, batch: Any) -> Any:
        compute = jax.tree.map(
            lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, params
        )
        return loss_fn(compute, batch, None)[0]

    @eqx.filter_jit(donate="all-except-first")
    def step(batch: Any, params: Any, opt_state: Any) -> Any:
        loss, grads = eqx.filter_value_and_grad(mean_loss)(params, batch)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(params, eqx.is_array)
        )
        return eqx.apply_updates(params, updates), opt_state, loss

    holder = {"params": params, "opt_state": opt_state}

    def run() -> Any:
        holder["params"], holder["opt_state"], loss = step(
            global_batch, holder["params"], holder["opt_state"]
        )
        return loss

    return run


class Setup:
    """What every variant shares: the configuration, the mesh, the optimizer,
    the models (list blocks, and the same parameters stacked) and the batches."""

    def __init__(self, config: dict[str, int], chunk_size: int) -> None:
        self.config, self.chunk_size = config, chunk_size
        self.devices = jax.devices()
        self.mesh = ed.create_data_parallel_mesh()
        self.optimizer = optax.adamw(1e-4)
        self.model = benchmark_model(config, jax.random.key(0))
        self._stacked: Any = None
        shape = (2 * config["batch"], config["seq_len"] + 1)
        tokens = np.asarray(
            jax.random.randint(jax.random.key(1), shape, 0, config["vocab"])
        )
        self.batches = {n: {"tokens": tokens[: n * config["batch"]]} for n in (1, 2)}
        self.flops_per_row: float | None = None

    def stacked_model(self) -> Any:
        if self._stacked is None:
            self._stacked = benchmark_model(
                self.config, jax.random.key(0), stacked=True
            )
        return self._stacked

    def eqxdist(self, variant: Variant) -> Callable[[], Any]:
        """`variant`'s step, its state placed, as a call of one step."""
        loss = chunked_loss_fn(self.chunk_size) if variant.chunked else loss_fn
        step = ed.make_train_step(
            loss,
            self.optimizer,
            self.mesh,
            compute_dtype=jnp.bfloat16,
            **variant.options,
        )
        model = self.stacked_model() if variant.stacked else self.model
        state = ed.TrainState.create(model, self.optimizer, jax.random.key(2))
        state = step.place_state(state)
        batch = self.batches[variant.batch_times]
        if self.flops_per_row is None and not variant.chunked:
            rows = batch["tokens"].shape[0]
            self.flops_per_row = step.cost(state, batch)["model_flops"] / rows
        holder = {"state": state}

        def run() -> Any:
            holder["state"], *rest = step(holder["state"], batch)
            return rest[0]

        return run


def _warm(run: Callable[[], Any]) -> tuple[float, float]:
    """Compile and run twice (again for outputs placed unlike the inputs): the
    first call's seconds, and one step's seconds after that."""
    start = time.perf_counter()
    jax.block_until_ready(run())
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(run())
    return first, time.perf_counter() - start


def build(setup: Setup, names: list[str], budget: float) -> tuple[dict, dict, dict]:
    """The hand-written step and each named variant, compiled in turn while the
    budget lasts (a variant whose compile would not fit, judging by the slowest
    so far, is skipped: the repeats need a fifth of the budget)."""
    hand = _hand_written(setup.model, setup.optimizer, setup.mesh, setup.batches[1])
    runs: dict[str, Callable[[], Any]] = {HAND: hand}
    first, step_s = _warm(hand)
    compile_s, step_times = {HAND: first}, {HAND: step_s}
    print(f"{HAND}: first call {first:.1f} s", flush=True)
    for name in names:
        slowest = max(compile_s.values())
        if time.perf_counter() - START + slowest > 0.8 * budget:
            print(
                f"{name}: skipped, its compile would not fit in --budget {budget:.0f} s"
            )
            continue
        runs[name] = setup.eqxdist(VARIANTS[name])
        compile_s[name], step_times[name] = _warm(runs[name])
        print(f"{name}: first call {compile_s[name]:.1f} s", flush=True)
    return runs, compile_s, step_times


def time_steps(
    runs: dict[str, Callable[[], Any]], *, repeats: int, steps: int
) -> dict[str, list[float]]:
    """Seconds per step of every variant in each of `repeats` rounds, the order
    rotating from round to round."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            for _ in range(steps):
                out = runs[name]()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / steps)
    return times


def rows_of(setup: Setup, times: dict[str, list[float]], compile_s: dict) -> list[dict]:
    batch, seq = setup.config["batch"], setup.config["seq_len"]
    rows = []
    for name, seconds_each in times.items():
        times_batch = 1 if name == HAND else VARIANTS[name].batch_times
        ratios = [
            t / times_batch / h for t, h in zip(seconds_each, times[HAND], strict=True)
        ]
        seconds = statistics.median(seconds_each)
        flops = (setup.flops_per_row or 0.0) * batch * times_batch
        rows.append(
            {
                "variant": name if name == HAND else VARIANTS[name].label,
                "ms": 1e3 * seconds,
                "ratio": statistics.median(ratios),
                "spread": (min(ratios), max(ratios)),
                "tflops": flops / seconds / 1e12,
                "mfu": ed.mfu(flops, seconds, setup.devices) if flops else None,
                "tokens_per_sec": batch * times_batch * seq / seconds,
                "compile_s": compile_s[name],
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'variant':<20} {'ms/step':>9} {'vs hand':>8} {'spread':>13} "
        f"{'TFLOP/s':>8} {'MFU':>6} {'compile s':>9}  tokens/s"
    )
    for row in rows:
        low, high = row["spread"]
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        print(
            f"{row['variant']:<20} {row['ms']:>9.2f} {row['ratio']:>8.3f} "
            f"{low:>6.3f}-{high:<6.3f} {row['tflops']:>8.3f} {mfu:>6} "
            f"{row['compile_s']:>9.1f}  {row['tokens_per_sec']:,.0f}"
        )


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tiny", "--quick", action="store_true", help="tiny model (a CPU check)"
    )
    parser.add_argument(
        "--variants",
        default="all",
        help=f"comma-separated, of {','.join(VARIANTS)} (default: all)",
    )
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16, help="global sequences")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-size", type=int, default=4096, help="`chunked` rows")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    parser.add_argument("--steps", type=int, default=5, help="steps per timing")
    parser.add_argument(
        "--budget", type=float, default=330.0, help="seconds for the whole run"
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    return parser.parse_args()


def _names(given: str, devices: int) -> list[str]:
    names = list(VARIANTS) if given == "all" else [n for n in given.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    # FSDP over one device is data parallelism again.
    return [n for n in names if devices > 1 or not VARIANTS[n].several_devices]


def main() -> None:
    args = _arguments()
    config = {
        "d_model": args.d_model,
        "heads": args.heads,
        "layers": args.layers,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "vocab": args.vocab,
    }
    repeats, steps = args.repeats, args.steps
    if args.tiny:
        config.update(d_model=64, heads=4, layers=2, seq_len=32, batch=8, vocab=256)
        repeats, steps = 3, 3
    devices = jax.devices()
    print(
        f"devices: {len(devices)} x {devices[0].device_kind} "
        f"({devices[0].platform}); jax {jax.__version__}; config {config}"
    )
    setup = Setup(config, min(args.chunk_size, config["batch"] * config["seq_len"]))
    names = _names(args.variants, len(devices))
    runs, compile_s, step_times = build(setup, names, args.budget)
    # The repeats fit in what is left of the budget.
    left = args.budget - (time.perf_counter() - START)
    per_repeat = steps * sum(step_times.values())
    repeats = max(1, min(repeats, int(left // max(per_repeat, 1e-9))))
    times = time_steps(runs, repeats=repeats, steps=steps)
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(setup.model, eqx.is_array)))
    flops = (setup.flops_per_row or 0.0) * config["batch"]
    print(
        f"parameters {params:,}; model FLOPs per step (batch {config['batch']}) "
        f"{flops:.3e} (TrainStep.cost's model_flops); {repeats} repeats of {steps} "
        f"steps; {time.perf_counter() - START:.0f} s in all"
    )
    rows = rows_of(setup, times, compile_s)
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps({"config": config, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
