"""A transformer training step on the accelerators at hand: eqxdist against a
hand-written `eqx.filter_jit` step, with model FLOP utilisation.

The other benchmarks simulate 8 CPU devices; this one runs on whatever devices
JAX's default backend has (one GPU, a TPU slice, or the CPU for `--quick`). The
decoder-only transformer of `examples/transformer_lm.py` (`examples/_transformer.py`)
trains with adamw on random tokens, computing in bfloat16 with float32
parameters and optimizer state, under these variants, side by side in this
process:

- `hand-written`: `eqx.filter_jit` of `eqx.filter_value_and_grad` of the mean loss
  over the global batch plus the optax update, the parameters cast to bfloat16
  inside the loss, the batch split over the devices by a `NamedSharding` and the
  state donated: the step a user writes without eqxdist, and the reference of
  the ratios;
- `eqxdist`: `ed.make_train_step(..., compute_dtype=jnp.bfloat16)` (data parallel);
- `eqxdist +info+skip`: the same with `step_info=True, skip_nonfinite=True` (the
  global gradient, update and parameter norms, and the non-finite check);
- `eqxdist fsdp` (more than one device only): parameters and optimizer state
  sharded over the devices.

Timing is interleaved: every repeat times each variant for `--steps` steps (their
order rotating), blocking at the end of each; the table gives the median
milliseconds per step, the median (min-max) of the per-repeat ratios to the
hand-written step, and MFU: the step's matrix-product FLOPs
(`TrainStep.cost(...)["model_flops"]`, the same for every variant) over the
median step time and the devices' peak dense bfloat16 FLOP/s (`ed.mfu`; none on
CPU). XLA's own cost analysis of the compiled steps is printed beside it: on a
GPU it leaves out the products XLA hands to cuBLAS.

    python benchmarks/bench_accelerator.py [--quick] [--d-model 1024] [--layers 8]
"""

import argparse
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


def loss_fn(model: TransformerLM, batch: dict[str, jax.Array], key: Any) -> Any:
    del key
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1]).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


def _hand_written(
    model: Any, optimizer: Any, mesh: Any, batch: Any
) -> tuple[Callable[[], Any], Any]:
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

    # Equinox's `Compiled` wraps JAX's (its `compiled`), which has the cost analysis.
    lowered = step.lower(global_batch, params, opt_state)  # type: ignore[attr-defined]
    return run, lowered.compile().compiled


def _eqxdist(
    model: Any, optimizer: Any, mesh: Any, batch: Any, **options: Any
) -> tuple[Callable[[], Any], dict[str, float]]:
    step = ed.make_train_step(
        loss_fn, optimizer, mesh, compute_dtype=jnp.bfloat16, **options
    )
    state = step.place_state(ed.TrainState.create(model, optimizer, jax.random.key(2)))
    cost = step.cost(state, batch)
    holder = {"state": state}

    def run() -> Any:
        holder["state"], *rest = step(holder["state"], batch)
        return rest[0]

    return run, cost


def run(config: dict[str, int], *, repeats: int, steps: int) -> list[dict[str, Any]]:
    devices = jax.devices()
    mesh = ed.create_data_parallel_mesh()
    model = benchmark_model(config, jax.random.key(0))
    tokens = jax.random.randint(
        jax.random.key(1), (config["batch"], config["seq_len"] + 1), 0, config["vocab"]
    )
    batch = {"tokens": np.asarray(tokens)}
    optimizer = optax.adamw(1e-4)
    hand, compiled = _hand_written(model, optimizer, mesh, batch)
    hand_xla = float(compiled.cost_analysis()["flops"]) * len(devices)
    plain, cost = _eqxdist(model, optimizer, mesh, batch)
    flops = cost["model_flops"]
    variants: dict[str, Callable[[], Any]] = {
        HAND: hand,
        "eqxdist": plain,
        "eqxdist +info+skip": _eqxdist(
            model, optimizer, mesh, batch, step_info=True, skip_nonfinite=True
        )[0],
    }
    if len(devices) > 1:
        variants["eqxdist fsdp"] = _eqxdist(
            model, optimizer, mesh, batch, strategy="fsdp"
        )[0]
    names = list(variants)
    for name in names:  # compile, and again for outputs placed unlike the inputs
        for _ in range(2):
            jax.block_until_ready(variants[name]())
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            for _ in range(steps):
                out = variants[name]()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / steps)
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    rows = []
    for name in names:
        ratios = [t / h for t, h in zip(times[name], times[HAND], strict=True)]
        seconds = statistics.median(times[name])
        rows.append(
            {
                "variant": name,
                "ms": 1e3 * seconds,
                "ratio": statistics.median(ratios),
                "spread": (min(ratios), max(ratios)),
                "mfu": ed.mfu(flops, seconds, devices),
                "tokens_per_sec": config["batch"] * config["seq_len"] / seconds,
                "flops": flops,
                "xla_flops": (hand_xla, cost["flops"]),
                "params": params,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model (CPU check)")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="global sequences")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats")
    parser.add_argument("--steps", type=int, default=10, help="steps per timing")
    args = parser.parse_args()
    config = {
        "d_model": args.d_model,
        "heads": args.heads,
        "layers": args.layers,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "vocab": args.vocab,
    }
    repeats, steps = args.repeats, args.steps
    if args.quick:
        config.update(d_model=64, heads=4, layers=2, seq_len=32, batch=8)
        repeats, steps = 3, 3
    devices = jax.devices()
    print(
        f"devices: {len(devices)} x {devices[0].device_kind} "
        f"({devices[0].platform}); jax {jax.__version__}; config {config}"
    )
    rows = run(config, repeats=repeats, steps=steps)
    hand_xla, eqxdist_xla = rows[0]["xla_flops"]
    print(
        f"parameters {rows[0]['params']:,}; FLOPs per step: model "
        f"{rows[0]['flops']:.3e} (TrainStep.cost's model_flops, for MFU), XLA's "
        f"cost analysis {hand_xla:.3e} (hand-written), {eqxdist_xla:.3e} (eqxdist); "
        f"{repeats} repeats of {steps} steps"
    )
    print(f"{'variant':<20} {'ms/step':>9} {'vs hand':>8} {'spread':>13} {'MFU':>6}")
    for row in rows:
        low, high = row["spread"]
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        print(
            f"{row['variant']:<20} {row['ms']:>9.2f} {row['ratio']:>8.3f} "
            f"{low:>6.3f}-{high:<6.3f} {mfu:>6}  {row['tokens_per_sec']:,.0f} tok/s"
        )


if __name__ == "__main__":
    main()
