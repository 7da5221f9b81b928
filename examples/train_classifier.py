"""Train a digit classifier with data parallelism and FSDP on 8 simulated CPU devices.

The main job of eqxdist's README. It trains the same Equinox MLP on scikit-learn's
bundled digits data set (8x8 images, 10 classes; no download) three ways: on one
device (the reference), data parallel (`"dp"`) and fully sharded (`"fsdp"`) over 8
devices, each step built by `eqxdist.make_train_step`. It prints a progress bar,
per-epoch train and held-out metrics computed with eqxdist's `Metric`s, and a summary
table: held-out accuracy, per-device bytes of the train state, step time, and whether
the strategies ended with the same parameters.

    python examples/train_classifier.py [--epochs 12] [--plot curves.png]
"""

import argparse
import sys
import time
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

import eqxdist as ed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=12, help="passes over the data")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch")
    parser.add_argument(
        "--minibatches", type=int, default=2, help="gradient accumulation steps"
    )
    parser.add_argument("--hidden", type=int, default=256, help="hidden layer width")
    parser.add_argument("--lr", type=float, default=1e-3, help="adamw learning rate")
    parser.add_argument(
        "--min-weight-size",
        type=int,
        default=2**10,
        help="FSDP shards parameters with more elements than this",
    )
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--plot", metavar="FILE.png", help="write the loss curves (needs matplotlib)"
    )
    return parser.parse_args()


ARGS = parse_args()
ed.simulate_cpu_devices(ARGS.devices)  # before JAX starts its backend


def load_digits(seed: int) -> tuple[np.ndarray, ...]:
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        sys.exit("This example needs scikit-learn: pip install -e '.[examples]'")
    data = sk_load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    mean, std = x[n_test:].mean(0), x[n_test:].std(0) + 1e-3
    x = (x - mean) / std
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


class MLP(eqx.Module):
    layers: list[eqx.nn.Linear]

    def __init__(self, in_size: int, hidden: int, out_size: int, key: jax.Array):
        keys = jax.random.split(key, 3)
        sizes = [in_size, hidden, hidden, out_size]
        self.layers = [
            eqx.nn.Linear(a, b, key=k)
            for a, b, k in zip(sizes[:-1], sizes[1:], keys, strict=True)
        ]

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def loss_fn(model: MLP, batch: dict[str, jax.Array], key: jax.Array) -> Any:
    del key  # no dropout here, so every strategy follows the same trajectory
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    metrics = ed.MetricCollection({"loss": ed.Mean(), "accuracy": ed.Accuracy()})
    metrics = metrics.update(loss=(losses,), accuracy=(logits, batch["y"]))
    return losses.mean(), metrics


def eval_fn(model: MLP, batch: dict[str, jax.Array], mask: jax.Array) -> Any:
    """Held-out metrics of this device's rows; `mask` is False on the rows
    `make_eval_step` padded, so they count for nothing."""
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    metrics = ed.MetricCollection({"loss": ed.Mean(), "accuracy": ed.Accuracy()})
    return metrics.update(
        loss={"values": losses, "weights": mask},
        accuracy=(logits, batch["y"], mask),
    )


@eqx.filter_jit
def merge(a: ed.Metric, b: ed.Metric) -> ed.Metric:
    return a.merge(b)


def state_bytes_per_device(state: ed.TrainState) -> int:
    """Bytes of parameters + optimizer state held by the first device."""
    device = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves((state.model, state.opt_state)):
        if isinstance(leaf, jax.Array):
            total += sum(
                s.data.nbytes for s in leaf.addressable_shards if s.device == device
            )
    return total


class Progress:
    """A one-line progress bar on a terminal; one line per epoch otherwise."""

    def __init__(self, name: str, total: int):
        self.name, self.total, self.done = name, total, 0
        self.tty = sys.stdout.isatty()

    def advance(self, steps: int, note: str) -> None:
        self.done += steps
        width = 24
        filled = width * self.done // self.total
        bar = "#" * filled + "." * (width - filled)
        line = f"{self.name:>6} [{bar}] {self.done:4d}/{self.total} steps  {note}"
        if self.tty:
            print("\r" + line, end="", flush=True)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.tty:
            print()


def train(strategy: str, mesh: Any, data: tuple[np.ndarray, ...]) -> dict[str, Any]:
    x_train, y_train, x_test, y_test = data
    model = MLP(x_train.shape[1], ARGS.hidden, 10, jax.random.key(ARGS.seed))
    optimizer = optax.adamw(ARGS.lr)
    state = ed.TrainState.create(model, optimizer, jax.random.key(ARGS.seed + 1))
    step = ed.make_train_step(
        loss_fn,
        optimizer,
        mesh,
        strategy="fsdp" if strategy == "fsdp" else "dp",
        num_minibatches=ARGS.minibatches,
        min_weight_size=ARGS.min_weight_size,
    )
    layout = {
        "strategy": "fsdp" if strategy == "fsdp" else "dp",
        "min_weight_size": ARGS.min_weight_size,
    }
    # Any number of rows: the held-out set (359) is not a multiple of 8 devices.
    evaluate = ed.make_eval_step(eval_fn, mesh, **layout)
    held_out = {"x": x_test, "y": y_test}

    steps_per_epoch = len(x_train) // ARGS.batch_size
    progress = Progress(strategy, ARGS.epochs * steps_per_epoch)
    order_rng = np.random.default_rng(ARGS.seed)
    history: dict[str, list[float]] = {"train_loss": [], "test_loss": []}
    epoch_times = []
    for epoch in range(ARGS.epochs):
        order = order_rng.permutation(len(x_train))
        start = time.perf_counter()
        epoch_metrics = None
        for i in range(steps_per_epoch):
            rows = order[i * ARGS.batch_size : (i + 1) * ARGS.batch_size]
            state, metrics = step(state, {"x": x_train[rows], "y": y_train[rows]})
            epoch_metrics = (
                metrics if epoch_metrics is None else merge(epoch_metrics, metrics)
            )
        train_values = epoch_metrics.compute()  # blocks: the epoch's steps are done
        epoch_times.append((time.perf_counter() - start) / steps_per_epoch)
        test_values = evaluate(state, held_out).compute()
        history["train_loss"].append(float(train_values["loss"]))
        history["test_loss"].append(float(test_values["loss"]))
        train_loss, train_acc = train_values["loss"], train_values["accuracy"]
        test_loss, test_acc = test_values["loss"], test_values["accuracy"]
        progress.advance(
            steps_per_epoch,
            f"epoch {epoch + 1:2d}  train loss {train_loss:.4f} acc {train_acc:.4f}"
            f" | held-out loss {test_loss:.4f} acc {test_acc:.4f}",
        )
    progress.close()
    return {
        "state": state,
        "history": history,
        "test_accuracy": float(test_values["accuracy"]),
        "state_bytes": state_bytes_per_device(state),
        # The first epoch includes compilation; report the median of the rest.
        "step_ms": 1e3 * float(np.median(epoch_times[1:] or epoch_times)),
    }


def max_param_diff(a: ed.TrainState, b: ed.TrainState) -> float:
    diffs = jax.tree.map(
        lambda p, q: float(np.max(np.abs(np.asarray(p) - np.asarray(q)))),
        eqx.filter(a.model, eqx.is_array),
        eqx.filter(b.model, eqx.is_array),
    )
    return max(jax.tree.leaves(diffs))


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install -e '.[examples]'")
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, result in results.items():
        epochs = range(1, len(result["history"]["train_loss"]) + 1)
        ax.plot(epochs, result["history"]["train_loss"], label=f"{name} train")
        ax.plot(epochs, result["history"]["test_loss"], "--", label=f"{name} held-out")
    ax.set_xlabel("epoch")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title("digits MLP: 1 device vs DP vs FSDP on 8 (the curves coincide)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    data = load_digits(ARGS.seed)
    print(
        f"digits: {len(data[0])} train / {len(data[2])} held-out examples, "
        f"{len(jax.devices())} devices, batch {ARGS.batch_size}, "
        f"{ARGS.minibatches} minibatches, {ARGS.epochs} epochs"
    )
    meshes = {
        "single": ed.create_data_parallel_mesh(1),
        "dp": ed.create_data_parallel_mesh(),
        "fsdp": ed.create_data_parallel_mesh(),
    }
    results = {name: train(name, mesh, data) for name, mesh in meshes.items()}

    reference = results["single"]["state"]
    print()
    print(
        f"{'strategy':<9}{'devices':>8}{'held-out acc':>14}{'state bytes/dev':>17}"
        f"{'step ms':>9}{'max |param - single|':>22}"
    )
    for name, result in results.items():
        diff = max_param_diff(result["state"], reference)
        print(
            f"{name:<9}{meshes[name].size:>8}{result['test_accuracy']:>14.4f}"
            f"{result['state_bytes']:>17,}{result['step_ms']:>9.2f}{diff:>22.2e}"
        )
    worst = max(max_param_diff(r["state"], reference) for r in results.values())
    agree = worst < 1e-4
    print(
        f"\nparameters of single/dp/fsdp agree: {'yes' if agree else 'NO'} "
        f"(max abs diff {worst:.2e}, tolerance 1e-4)"
    )
    if ARGS.plot:
        plot(results, ARGS.plot)
    if not agree:
        sys.exit(1)


if __name__ == "__main__":
    main()
