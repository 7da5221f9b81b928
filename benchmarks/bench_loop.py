"""What `ed.train_loop` costs over a bare `for` loop around the same train step.

The same MLP train step (8 simulated CPU devices, batches already on the
devices) runs `--steps` steps in a bare loop (`state, metrics = step(state,
batch)`, one wait at the end) and through `train_loop` with a JSONL writer and a
log point every 10 steps (loss, learning rate, throughput), no progress bar. The
two run interleaved, `--repeats` times each; the ratio of the medians of the
per-step times is the loop's overhead (goal <= 1.02).

    python benchmarks/bench_loop.py [--steps 200] [--repeats 5] [--max-in-flight 2]
"""

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import equinox as eqx
import jax
import numpy as np
import optax

import eqxdist as ed

FEATURES, WIDTH, CLASSES, BATCH = 256, 512, 16, 512


def loss_fn(model: Any, batch: Any, key: Any) -> Any:
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each loop")
    parser.add_argument(
        "--max-in-flight", type=int, default=2, help="train_loop's max_in_flight"
    )
    args = parser.parse_args()

    mesh = ed.create_data_parallel_mesh()
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
    step = ed.make_train_step(loss_fn, optimizer, mesh)
    model = eqx.nn.MLP(FEATURES, CLASSES, WIDTH, 2, key=jax.random.key(0))
    state = step.place_state(ed.TrainState.create(model, optimizer, jax.random.key(1)))
    rng = np.random.default_rng(0)
    sharding = ed.create_data_parallel_sharding(mesh)
    batches = [
        ed.shard_batch(
            {
                "x": rng.normal(size=(BATCH, FEATURES)).astype(np.float32),
                "y": rng.integers(0, CLASSES, BATCH).astype(np.int32),
            },
            sharding,
        )
        for _ in range(8)
    ]

    def bare() -> float:
        s = step.place_state(state)
        start = time.perf_counter()
        for i in range(args.steps):
            s, metrics = step(s, batches[i % 8])
        jax.block_until_ready((s, metrics))
        return (time.perf_counter() - start) / args.steps

    def loop() -> float:
        with (
            tempfile.TemporaryDirectory() as out,
            ed.JsonlWriter(f"{out}/metrics.jsonl") as writer,
        ):
            start = time.perf_counter()
            result = ed.train_loop(
                step, state, lambda i: batches[i % 8], args.steps, writer=writer,
                log_every=10, progress=False, flops_per_step=None,
                max_in_flight=args.max_in_flight,
            )  # fmt: skip
            jax.block_until_ready(result.state)
            return (time.perf_counter() - start) / args.steps

    bare(), loop()  # compile, warm up
    times: dict[str, list[float]] = {"bare": [], "loop": []}
    for _ in range(args.repeats):
        times["bare"].append(bare())
        times["loop"].append(loop())
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}")
    for name, t in medians.items():
        print(f"{name:>5}: {1e3 * t:.3f} ms/step (median of {args.repeats})")
    print(f"loop / bare: {medians['loop'] / medians['bare']:.3f} (goal <= 1.02)")


if __name__ == "__main__":
    main()
