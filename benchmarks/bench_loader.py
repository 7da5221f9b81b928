"""What feeding a training loop through `ed.BatchLoader` costs.

1. Throughput: the same MLP training loop (8 simulated CPU devices) fed by
   `BatchLoader.iterate` from a source that costs about half a step per batch
   (a sleep, as a disk or a decoder would), against the loop over batches placed on
   the devices beforehand. With the read-ahead the source's cost hides behind the
   steps; the goal is >= 0.95x the pre-placed throughput. The two loops run
   interleaved, `--repeats` times each, and the best of each is compared.
2. Host overhead: `loader.batch(step)` from an in-memory source (no sleep), against
   the NumPy gather and `jax.device_put` of the same rows done by hand.

    python benchmarks/bench_loader.py [--steps 20] [--repeats 3]
"""

import argparse
import itertools
import os
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

ROWS, FEATURES, CLASSES, BATCH = 8192, 256, 16, 512


class SlowSource:
    """In-memory rows that cost `delay` seconds per read."""

    def __init__(self, data: dict[str, np.ndarray], delay: float) -> None:
        self.data, self.delay = data, delay

    def __len__(self) -> int:
        return len(self.data["y"])

    def __getitem__(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        time.sleep(self.delay)
        return {k: v[indices] for k, v in self.data.items()}


def loss_fn(model: Any, batch: dict[str, Any], key: Any) -> tuple[Any, Any]:
    del key
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {}


def timed_loop(step: Any, state: Any, batches: Any, steps: int) -> tuple[Any, float]:
    """Seconds per step of `steps` steps over `(step_number, batch)` pairs, in the
    steady state: the clock starts once the first batch is at hand (filling the
    read-ahead costs one read, once per run)."""
    batches = iter(batches)
    first = next(batches)
    start = time.perf_counter()
    for i, batch in itertools.chain([first], batches):
        state, _ = step(state, batch)
        if i + 1 == steps:
            break
    jax.block_until_ready(state)
    return state, (time.perf_counter() - start) / steps


def run(steps: int, repeats: int, width: int) -> dict[str, float]:
    mesh = ed.create_data_parallel_mesh()
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
        "y": rng.integers(0, CLASSES, ROWS).astype(np.int32),
    }
    optimizer = optax.adam(1e-3)
    model = eqx.nn.MLP(FEATURES, CLASSES, width, 3, key=jax.random.key(0))
    step = ed.make_train_step(loss_fn, optimizer, mesh)
    state = step.place_state(ed.TrainState.create(model, optimizer, jax.random.key(1)))
    plain = ed.BatchLoader(data, BATCH, mesh, prefetch=0)
    placed = [plain.batch(i) for i in range(steps)]
    state, step_time = timed_loop(step, state, enumerate(placed), steps)  # warm-up
    state, step_time = timed_loop(step, state, enumerate(placed), steps)
    source = SlowSource(data, delay=step_time / 2)

    best = {"pre-placed": float("inf"), "loader": float("inf")}
    for _ in range(repeats):
        state, t = timed_loop(step, state, enumerate(placed), steps)
        best["pre-placed"] = min(best["pre-placed"], t)
        with ed.BatchLoader(source, BATCH, mesh, prefetch=2) as loader:
            state, t = timed_loop(step, state, loader.iterate(), steps)
        best["loader"] = min(best["loader"], t)

    # Host overhead per batch, no sleep: the loader against the same work by hand.
    sharding = ed.create_data_parallel_sharding(mesh)
    reads = 200
    start = time.perf_counter()
    for i in range(reads):
        jax.block_until_ready(plain.batch(i))
    loader_batch = (time.perf_counter() - start) / reads
    start = time.perf_counter()
    for i in range(reads):
        rows = plain.indices(i)
        jax.block_until_ready(
            jax.device_put({k: v[rows] for k, v in data.items()}, sharding)
        )
    by_hand = (time.perf_counter() - start) / reads
    return {
        "step ms (pre-placed)": 1e3 * best["pre-placed"],
        "step ms (loader, source = half a step)": 1e3 * best["loader"],
        "source ms per batch": 1e3 * source.delay,
        "throughput vs pre-placed": best["pre-placed"] / best["loader"],
        "loader.batch ms (in memory)": 1e3 * loader_batch,
        "gather + device_put by hand ms": 1e3 * by_hand,
        "loader overhead ms per batch": 1e3 * (loader_batch - by_hand),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per timed loop")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024, help="MLP width")
    args = parser.parse_args()
    for name, value in run(args.steps, args.repeats, args.width).items():
        print(f"{name:40s} {value:8.3f}")


if __name__ == "__main__":
    main()
