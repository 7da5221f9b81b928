"""Run every eqxdist benchmark in one process and print one table.

- `bench_train`: training-step time of eqxdist's DP and FSDP steps against a
  hand-written `jax.jit(shard_map)` step, Equinox's own GSPMD route
  (`eqx.filter_jit` + `eqx.filter_shard`, DP and FSDP) and the Flax-linen
  tutorial's step (ratios measured side by side, interleaved, in this process);
  the tutorial's classifier, a tiny MLP and a deep MLP (8 x 1024^2).
- `bench_memory`: per-device bytes of the train state, and peak memory of a deep MLP
  under DP / FSDP / per-block FSDP / per-block FSDP with rematerialised gathers (from
  `compiled.memory_analysis()`: deterministic).
- `bench_metrics`: syncing a 16-metric collection and a realistic evaluation
  collection: collectives and bytes (from the compiled HLO: deterministic) and time,
  against one collective per state (torchmetrics/d9d style) and gather-then-reduce
  (CLU style).
- `bench_fsdp_accumulation`: FSDP with 4 minibatches (gather once per step, the
  default, and per minibatch) against a hand-written gather-once FSDP step; step
  time ratios and collectives per step.
- `bench_fsdp_layout`: a deep MLP under FSDP: the tutorial's layout against the
  leading-dimension layout, per-block `FSDP`, `FSDPSequential` (prefetch) and
  `Stacked` (scan over layers); step time, compile time against depth, memory.
- `bench_parallel`: a small transformer under DP, FSDP, FSDP x TP and HSDP against
  hand-written `jax.jit` steps with the same shardings and (DP, FSDP) Equinox's
  GSPMD route; time, memory, collectives.
- `bench_checkpoint`: the cost of checkpoint checksums per GiB.

    python benchmarks/run_all.py [--quick]

Needs the `bench` extra (Flax) for the tutorial-style baseline. Sets up 8 simulated
CPU devices itself unless `XLA_FLAGS` already sets a device count.
"""

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_checkpoint
import bench_fsdp_accumulation
import bench_fsdp_layout
import bench_memory
import bench_metrics
import bench_parallel
import bench_train
import jax


def _rows(quick: bool) -> list[tuple[str, str, str, str, str]]:
    """(benchmark, case, variant, figure, ratio) rows of the combined table."""
    out = []
    repeats, steps = (3, 20) if quick else (11, 60)
    # The deep MLP's steps are ~20x the tutorial's: fewer of them.
    train_rows = bench_train.run(
        models=("tutorial", "tiny"), repeats=repeats, steps=steps
    ) + bench_train.run(
        models=("deep",), repeats=3 if quick else 5, steps=4 if quick else 8
    )
    for r in train_rows:
        flax = f", {r['vs_flax']:.2f}x flax" if "vs_flax" in r else ""
        low, high = r["vs_best_spread"]
        out.append(
            (
                "train step",
                f"{r['model']} model",
                r["variant"],
                f"{r['ms_per_step']:.3f} ms/step",
                f"{r['vs_hand_written']:.2f}x hand-written{flax}, "
                f"{r['vs_best']:.2f}x {r['best']} ({low:.2f}-{high:.2f})",
            )
        )
    for r in bench_memory.run(depth=8 if quick else 16):
        if "bytes_per_device" in r:
            out.append(
                (
                    "train state",
                    r["case"],
                    r["variant"],
                    f"{r['bytes_per_device']:,} B/device",
                    f"{r['fraction_of_dp']:.4f} of dp",
                )
            )
        else:
            out.append(
                (
                    "peak memory",
                    r["case"],
                    r["variant"],
                    f"{r['total_MiB']:.1f} MiB/device",
                    f"{r['all_gathers']} all-gathers",
                )
            )
    rounds, calls = (3, 20) if quick else (5, 40)
    for r in bench_metrics.run(rounds=rounds, calls=calls):
        out.append(
            (
                "metric sync",
                f"{r['metrics']} metrics",
                r["strategy"],
                f"{r['compiled']} collectives, {r['sent_bytes']} B sent",
                f"{r['time_us']:.0f} us = {r['time_vs_grouped']:.2f}x grouped",
            )
        )
    for r in bench_fsdp_accumulation.run(
        repeats=3 if quick else 7, steps=10 if quick else 20
    ):
        lo, hi = r["spread"]
        out.append(
            (
                "fsdp accumulation",
                f"{r['model']} model, 4 minibatches",
                r["variant"],
                f"{r['ms_per_step']:.2f} ms/step, {r['collectives']} collectives",
                f"{r['vs_hand_written']:.2f}x hand-written ({lo:.2f}-{hi:.2f})",
            )
        )
    depth, width = (4, 512) if quick else (8, 1024)
    for name, figures, hlo in bench_fsdp_layout.run(
        depth=depth,
        width=width,
        rows=64,
        repeats=3 if quick else 5,
        steps=4 if quick else 8,
        remat=False,
    ):
        out.append(("fsdp layout", f"deep MLP {depth}x{width}^2", name, figures, hlo))
    for r in bench_parallel.run(repeats=3 if quick else 9, steps=8):
        out.append(
            (
                "transformer step",
                f"{r['layout']} on "
                + " x ".join(f"{k} {v}" for k, v in r["mesh"].items()),
                "eqxdist",
                f"{r['ms_eqxdist']:.2f} ms/step, {r['state_bytes_placed']:,} B/device "
                f"state (predicted {r['state_bytes_predicted']:,})",
                f"{r['ratio_hand_gathered']:.2f}x hand-written (gathered), "
                f"{r['ratio_hand']:.2f}x hand-written (plain)"
                + (f", {r['ratio_gspmd']:.2f}x gspmd" if "ratio_gspmd" in r else ""),
            )
        )
    for name, value in bench_checkpoint.run(64 if quick else 256, 3).items():
        out.append(("checkpoint", "sharded state", name, f"{value:.3f}", ""))
    return out


def _format(rows: list[tuple[str, ...]]) -> str:
    header = ("benchmark", "case", "variant", "figure", "ratio")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer repeats and a shallower deep MLP"
    )
    args = parser.parse_args()
    rows: list[Any] = _rows(args.quick)
    device = jax.devices()[0]
    print(
        f"eqxdist benchmarks, {datetime.date.today()}, jax {jax.__version__}, "
        f"{jax.device_count()} x {device.platform} devices ({device.device_kind}), "
        f"{platform.machine()} with {os.cpu_count()} cores"
    )
    print(_format(rows))


if __name__ == "__main__":
    main()
