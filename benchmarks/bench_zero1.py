"""ZeRO-1 against data parallelism: step time and optimizer memory per device.

The UvA tutorial's classifier (784 -> 512 -> 10, bf16 compute, dropout, batch 128
in 4 minibatches, adamw; the model of `bench_train.py`) on 8 simulated CPU devices,
one process: `make_train_step(..., strategy="dp")` against `strategy="zero1"` (the
tutorial's `min_weight_size=2**4`). Timing is interleaved: every repeat times both
for `--steps` steps (the order alternating), at most 8 steps in flight; the table
gives median milliseconds per step, the median of the per-repeat ratios
zero1 / dp with their spread, the optimizer-state bytes device 0 holds and the
collectives of each compiled step.

    python benchmarks/bench_zero1.py [--repeats 7] [--steps 40]

The script sets up 8 simulated CPU devices itself (before importing JAX) unless
`XLA_FLAGS` already sets a device count. `run()` returns the figures for other
scripts.
"""

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import optax

import eqxdist as ed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _tutorial

ed.simulate_cpu_devices(8)  # before JAX starts its backend

STRATEGIES = ("dp", "zero1")


def _optimizer_bytes(state: ed.TrainState) -> int:
    """Bytes of optimizer state device 0 holds."""
    leaves = jax.tree.leaves(eqx.filter(state.opt_state, eqx.is_array))
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)


def _setup(strategy: str, mesh: Any) -> tuple[Callable[[], Any], dict[str, Any]]:
    optimizer = optax.adamw(_tutorial.LEARNING_RATE)
    step = ed.make_train_step(
        _tutorial.loss_fn,
        optimizer,
        mesh,
        strategy=strategy,
        num_minibatches=_tutorial.NUM_MINIBATCHES,
        min_weight_size=2**4,
    )
    model = _tutorial.Classifier(jax.random.key(_tutorial.SEED))
    state = step.place_state(ed.TrainState.create(model, optimizer, jax.random.key(3)))
    batch = ed.shard_batch(
        _tutorial.make_batch(jax.random.key(2)), ed.create_data_parallel_sharding(mesh)
    )
    facts = {
        "optimizer_bytes": _optimizer_bytes(state),
        "collectives": ed.count_collectives(step.lower(state, batch).compile()),
    }
    holder = [state]

    def call() -> Any:
        holder[0], metrics = step(holder[0], batch)
        return metrics["loss"][0]

    return call, facts


def _time(call: Callable[[], Any], steps: int) -> float:
    """Seconds per step (the step itself bounds the steps in flight)."""
    start = time.perf_counter()
    last = None
    for _ in range(steps):
        last = call()
    jax.block_until_ready(last)
    return (time.perf_counter() - start) / steps


def run(*, repeats: int = 7, steps: int = 40) -> dict[str, Any]:
    """Time dp and zero1 interleaved; the medians, the ratio and its spread, and
    each strategy's optimizer bytes per device and collectives."""
    if len(jax.devices()) < 8:
        raise RuntimeError(
            "bench_zero1 needs 8 devices; set XLA_FLAGS="
            "--xla_force_host_platform_device_count=8 before importing JAX."
        )
    mesh = ed.create_data_parallel_mesh(8)
    calls, facts = {}, {}
    for strategy in STRATEGIES:
        calls[strategy], facts[strategy] = _setup(strategy, mesh)
        _time(calls[strategy], 10)  # compile and warm up
    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for r in range(repeats):
        for strategy in STRATEGIES[r % 2 :] + STRATEGIES[: r % 2]:
            times[strategy].append(_time(calls[strategy], steps))
    ratios = [z / d for z, d in zip(times["zero1"], times["dp"], strict=True)]
    return {
        "ms_per_step": {s: 1e3 * statistics.median(t) for s, t in times.items()},
        "ratio": statistics.median(ratios),
        "ratio_spread": (min(ratios), max(ratios)),
        **{f"{s}_{k}": v for s, f in facts.items() for k, v in f.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats")
    parser.add_argument("--steps", type=int, default=40, help="steps per timing")
    args = parser.parse_args()
    out = run(repeats=args.repeats, steps=args.steps)
    print("| strategy | ms/step (median) | optimizer bytes/device | collectives |")
    print("|---|---|---|---|")
    for s in STRATEGIES:
        print(
            f"| {s} | {out['ms_per_step'][s]:.3f} | {out[f'{s}_optimizer_bytes']:,} "
            f"| {out[f'{s}_collectives']} |"
        )
    low, high = out["ratio_spread"]
    print(
        f"\nzero1 / dp step time: {out['ratio']:.3f} (per-repeat {low:.3f}-{high:.3f}, "
        f"{args.repeats} interleaved repeats of {args.steps} steps); optimizer bytes "
        f"per device: {out['zero1_optimizer_bytes'] / out['dp_optimizer_bytes']:.3f}x"
    )


if __name__ == "__main__":
    main()
