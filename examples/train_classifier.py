"""Train a small CNN on scikit-learn's digits with eqxdist, on 8 simulated CPU devices.

The main job of eqxdist's README. The same Equinox CNN (two convolutions with
BatchNorm, dropout, a linear head) is trained four ways, each with
`eqxdist.make_train_step`: on one device (the reference), data parallel (`dp`) and
fully sharded (`fsdp`) over 8 devices, and once more on one device with the rows
of each minibatch in another order (`reorder`: the floating-point noise floor the
others are measured against), with gradient accumulation and, optionally,
bfloat16 compute. It reads the training rows through `eqxdist.BatchLoader` (the
batch of a step depends only on the seed and the step). Every epoch it evaluates on
a held-out set of 359 examples (not a multiple of 8) with `eqxdist.make_eval_step` —
accuracy, macro-F1, loss — and saves a checkpoint with `eqxdist.CheckpointManager`
whose metadata holds the loader's position (`--resume` continues the exact stream
where a run stopped). Ctrl-C or SIGTERM saves the step the run is at and exits
(a second Ctrl-C stops at once); `--resume` continues from the latest checkpoint,
and the logs drop what an interrupted run wrote past it, so no step is logged
twice. It shows a progress bar (steps/s, ETA, live loss), writes every log
point's metrics to a JSONL file and TensorBoard, prints a summary table (held-out
metrics, per-device state bytes, step time, parameter agreement) and the
confusion matrix, and with `--plot` draws the loss curves and the confusion
matrix.

    python examples/train_classifier.py [--epochs 10] [--bf16] [--plot out.png]
"""

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqxdist as ed

STRATEGIES = ("single", "dp", "fsdp", "reorder")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=10, help="passes over the data")
    parser.add_argument(
        "--batch-size", type=int, default=128, help="global batch (rows per step)"
    )
    parser.add_argument(
        "--minibatches", type=int, default=2, help="gradient accumulation steps"
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="adamw learning rate")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout rate")
    parser.add_argument(
        "--bf16", action="store_true", help="compute in bfloat16 (float32 weights)"
    )
    parser.add_argument(
        "--min-weight-size",
        type=int,
        default=2**8,
        help="FSDP shards parameters with more elements than this",
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=list(STRATEGIES),
        choices=STRATEGIES,
        help="which runs to do",
    )
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--log-every", type=int, default=5, help="steps between log points"
    )
    parser.add_argument(
        "--out",
        default="runs/train_classifier",
        help="directory for checkpoints and metrics.jsonl (OUT/<strategy>/) and "
        "TensorBoard logs (OUT/tensorboard/)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue each strategy from its latest checkpoint in --out",
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        metavar="EPOCHS",
        help="stop after this many epochs in this run (to try --resume)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="write loss curves and the confusion matrix (needs matplotlib)",
    )
    return parser.parse_args()


ARGS = parse_args()
# Before JAX starts its backend: overlap collectives with compute when a GPU is
# present (does nothing on CPU), and simulate the CPU devices.
ed.enable_gpu_collective_overlap()
ed.simulate_cpu_devices(ARGS.devices)


# -- data -------------------------------------------------------------------------


def load_digits(seed: int) -> tuple[np.ndarray, ...]:
    """Digits as (N, 1, 8, 8) float32 images, standardised; 20% held out."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        sys.exit("this example needs scikit-learn: pip install -e '.[examples]'")
    x, y = sk_load_digits(return_X_y=True)
    x = (x.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = y.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    mean, std = x[n_test:].mean(), x[n_test:].std()
    x = (x - mean) / std
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


class Digits:
    """The training rows as a map-style source for `ed.BatchLoader`: row `i` is
    image `x[i]`, label `y[i]` and its own index `i`, from which the loss derives
    the row's dropout key."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        index = indices.astype(np.int32)
        return {"x": self.x[indices], "y": self.y[indices], "index": index}


class Batches:
    """The loader's batches for one strategy, each row tagged with its step, so
    that the loss draws the same dropout mask for the same example at the same
    step on every strategy. One device gets the rows in the order that gives it
    the same minibatches (the same sets of examples, so the same BatchNorm
    statistics) as 8 devices, where minibatch m is the m-th block of every
    device's rows; the noise-floor run ("reorder") also permutes the rows within
    each minibatch, which changes nothing but floating-point rounding.
    `ed.train_loop` calls `iterate(start_step)` (the loader reads ahead in a
    thread) and saves the step it reached as the checkpoint's `loader_step`."""

    def __init__(self, loader: ed.BatchLoader, strategy: str) -> None:
        self.loader, self.strategy = loader, strategy

    def iterate(self, start_step: int) -> Iterator[tuple[int, dict[str, jax.Array]]]:
        for step, batch in self.loader.iterate(start_step):
            yield step, self.finish(step, batch)

    def finish(self, step: int, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        rows = self.loader.global_batch_size
        steps = np.full(rows, step, np.int32)
        batch = {**batch, "step": jax.device_put(steps, self.loader.sharding)}
        if self.strategy not in ("single", "reorder"):
            return batch
        n, devices = ARGS.minibatches, ARGS.devices
        order = np.arange(rows).reshape(devices, n, -1).transpose(1, 0, 2).reshape(-1)
        if self.strategy == "reorder":
            per, rng = rows // n, np.random.default_rng(step)
            order = order[
                np.concatenate([m * per + rng.permutation(per) for m in range(n)])
            ]
        return {k: v[order] for k, v in batch.items()}


# -- the model --------------------------------------------------------------------


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array, dropout: float):
        k1, k2, k3 = jax.random.split(key, 3)
        # BatchNorm over the vmapped rows of every device: the statistics of the
        # whole (global) minibatch, whatever the number of devices.
        axes = ("batch", "data")
        self.conv1 = eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1)
        self.bn1 = eqx.nn.BatchNorm(16, axis_name=axes, mode="batch", momentum=0.9)
        self.conv2 = eqx.nn.Conv2d(16, 32, 3, padding=1, key=k2)
        self.bn2 = eqx.nn.BatchNorm(32, axis_name=axes, mode="batch", momentum=0.9)
        self.dropout = eqx.nn.Dropout(dropout)
        self.head = eqx.nn.Linear(32 * 4 * 4, 10, key=k3)

    def __call__(self, x: jax.Array, state: Any, key: Any) -> tuple[jax.Array, Any]:
        x, state = self.bn1(jax.nn.relu(self.conv1(x)), state)
        x, state = self.bn2(jax.nn.relu(self.conv2(x)), state)
        x = x.reshape(32, 4, 2, 4, 2).mean(axis=(2, 4))  # 2x2 average pooling
        x = self.dropout(x.reshape(-1), key=key, inference=key is None)
        return self.head(x).astype(jnp.float32), state


def loss_fn(model: CNN, model_state: Any, batch: Any, key: Any) -> Any:
    # Not `key`, which differs between devices and minibatches: each row's dropout
    # key comes from (seed, step, example), the same for every strategy.
    del key
    seed = jax.random.key(ARGS.seed)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(seed, s), i))(
        batch["step"], batch["index"]
    )
    logits, model_state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None)
    )(batch["x"], model_state, keys)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    metrics = ed.MetricCollection(
        {"loss": ed.metrics.Mean(), "accuracy": ed.metrics.Accuracy()}
    )
    metrics = metrics.update(loss=(losses,), accuracy=(logits, batch["y"]))
    return losses.mean(), metrics, model_state


def eval_fn(model: CNN, model_state: Any, batch: Any, mask: jax.Array) -> Any:
    """Held-out metrics of this device's rows; `mask` is False on the rows
    `make_eval_step` padded, so they count for nothing."""
    inference = eqx.nn.inference_mode(model)
    logits, _ = jax.vmap(inference, in_axes=(0, None, None), out_axes=(0, None))(
        batch["x"], model_state, None
    )
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    metrics = ed.MetricCollection(
        {
            "loss": ed.metrics.Mean(),
            "accuracy": ed.metrics.Accuracy(),
            "macro_f1": ed.metrics.F1Score(10, average="macro"),
            "confusion": ed.metrics.ConfusionMatrix(10),
        }
    )
    return metrics.update(
        loss={"values": losses, "weights": mask},
        accuracy=(logits, batch["y"], mask),
        macro_f1=(logits, batch["y"], mask),
        confusion=(logits, batch["y"], mask),
    )


# -- training on the loop -----------------------------------------------------


# What, beside the loader's position (`loader_step`), defines the data stream: saved
# in every checkpoint's metadata and checked on `--resume`.
STREAM = {"seed": ARGS.seed, "batch_size": ARGS.batch_size}


def check_stream(manager: ed.CheckpointManager) -> int:
    """The step a resumed run continues from; exits when its checkpoint was
    written with another data stream, which could not continue exactly."""
    latest = manager.latest_step()
    if latest is None:
        return 0
    saved = manager.metadata(latest)
    if {k: saved.get(k) for k in STREAM} != STREAM:
        sys.exit(
            f"--resume: {manager.directory} step {latest} was trained on the data "
            f"stream {saved}; this run asks for {STREAM}: pass the same --seed "
            "and --batch-size, or start afresh without --resume."
        )
    return int(saved["loader_step"])


def train(strategy: str, data: tuple[np.ndarray, ...]) -> dict[str, Any]:
    one_device = strategy in ("single", "reorder")
    mesh = ed.create_data_parallel_mesh(1 if one_device else None)
    layout = {
        "strategy": "fsdp" if strategy == "fsdp" else "dp",
        "min_weight_size": ARGS.min_weight_size,
        "compute_dtype": jnp.bfloat16 if ARGS.bf16 else None,
    }
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=ARGS.lr)
    step = ed.make_train_step(
        loss_fn, optimizer, mesh, num_minibatches=ARGS.minibatches, **layout
    )
    # Any number of rows: the held-out set (359) is not a multiple of 8 devices.
    evaluate = ed.make_eval_step(eval_fn, mesh, **layout)
    model, model_state = eqx.nn.make_with_state(CNN)(
        jax.random.key(ARGS.seed), ARGS.dropout
    )
    state = ed.TrainState.create(
        model, optimizer, jax.random.key(ARGS.seed + 1), model_state=model_state
    )
    # The global batch of step s depends only on (seed, s), on 1 device or 8.
    loader = ed.BatchLoader(
        Digits(data[0], data[1]), ARGS.batch_size, mesh, seed=ARGS.seed
    )
    steps_per_epoch = loader.steps_per_epoch
    out = Path(ARGS.out) / strategy
    if not ARGS.resume:  # a fresh run: the previous one's checkpoints and logs go
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(Path(ARGS.out) / "tensorboard" / strategy, ignore_errors=True)
    stop = None if ARGS.stop_after is None else ARGS.stop_after * steps_per_epoch
    with (
        loader,
        ed.CheckpointManager(out, save_interval_steps=steps_per_epoch) as manager,
        ed.MultiWriter(
            [
                ed.JsonlWriter(out / "metrics.jsonl", append=ARGS.resume),
                ed.TensorBoardWriter(Path(ARGS.out) / "tensorboard" / strategy),
            ]
        ) as writer,
    ):
        start = check_stream(manager) if ARGS.resume else 0
        result = ed.train_loop(
            step, state, Batches(loader, strategy), ARGS.epochs * steps_per_epoch,
            writer=writer, log_every=ARGS.log_every, checkpoints=manager,
            resume=ARGS.resume, metadata=lambda s: STREAM,
            stop_at=start + stop if stop else None,
            eval_step=evaluate, eval_batches={"x": data[2], "y": data[3]},
            eval_every=steps_per_epoch, name=f"{strategy:>6}",
            show=("loss", "accuracy"),
        )  # fmt: skip
        # Parameters after the first epoch, where rounding has not grown yet.
        first = manager.restore(result.state, step=steps_per_epoch)
    test = (
        result.evals[-1][1]
        if result.evals
        else evaluate(result.state, {"x": data[2], "y": data[3]}).compute()
    )
    return {
        "state": result.state,
        "first_epoch": first,
        "devices": mesh.size,
        "epochs": result.step // steps_per_epoch,
        "test": test,
        "state_bytes": state_bytes_per_device(result.state),
        # None: no step ran (a --resume of a finished run).
        "step_ms": None
        if result.step == result.start_step
        else (1e3 * result.seconds_per_step),
    }


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


def max_param_diff(a: ed.TrainState, b: ed.TrainState) -> float:
    pairs = zip(
        jax.tree.leaves(eqx.filter((a.model, a.model_state), eqx.is_array)),
        jax.tree.leaves(eqx.filter((b.model, b.model_state), eqx.is_array)),
        strict=True,
    )
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q)))) for p, q in pairs)


def history(strategy: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, train loss) and (step, held-out loss) from the run's JSONL log."""
    train, held_out = [], []
    for line in (Path(ARGS.out) / strategy / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            train.append((row["step"], row["loss"]))
        if "eval_loss" in row:
            held_out.append((row["step"], row["eval_loss"]))
    return train, held_out


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install -e '.[examples]'")
    fig, (curves, matrix) = plt.subplots(1, 2, figsize=(11, 4))
    for name in results:
        train, held_out = history(name)
        for rows, style, label in (
            (train, "-", "train"),
            (held_out, "o--", "held-out"),
        ):
            steps, losses = np.array(rows).T
            curves.plot(steps, losses, style, ms=3, label=f"{name} {label}")
    curves.set_xlabel("step")
    curves.set_ylabel("cross-entropy loss")
    curves.set_title(" vs ".join(results) + " (the curves coincide)")
    curves.legend(fontsize=8)
    confusion = np.asarray(next(iter(results.values()))["test"]["confusion"])
    matrix.imshow(confusion, cmap="Blues")
    for (i, j), count in np.ndenumerate(confusion):
        matrix.text(j, i, int(count), ha="center", va="center", fontsize=7)
    matrix.set_xlabel("predicted")
    matrix.set_ylabel("true")
    matrix.set_title("held-out confusion matrix")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def agreement(results: dict[str, dict[str, Any]]) -> bool:
    """Whether the strategies trained the same model. Float sums in another order
    round differently and Adam amplifies the difference step after step, so after
    ~100 steps the parameters of one device and 8 differ by ~1e-3 although every
    step computes the same thing; reordering the rows on one device ("reorder")
    does the same. So the parameters are compared after the first epoch, where a
    wrong gradient would show and rounding has not grown, and at the end the
    held-out metrics are; the noise floor is printed beside."""
    names = [n for n in results if n != "reorder"]
    ref = results[names[0]]
    bf16 = ARGS.bf16
    early = max(
        max_param_diff(results[n]["first_epoch"], ref["first_epoch"]) for n in names
    )
    final = max(max_param_diff(results[n]["state"], ref["state"]) for n in names)
    tolerance, metric_tolerance = (2e-2, 2e-2) if bf16 else (1e-4, 6e-3)
    metrics_diff = max(
        abs(float(results[n]["test"][k]) - float(ref["test"][k]))
        for n in names
        for k in ("accuracy", "macro_f1", "loss")
    )
    agree = early < tolerance and metrics_diff <= metric_tolerance
    epochs = ref["epochs"]  # trained so far (`--stop-after`, `--resume`)
    floors = ("", "")
    if "reorder" in results:
        floors = tuple(
            f" (reordering rows on one device: "
            f"{max_param_diff(results['reorder'][k], ref[k]):.2e})"
            for k in ("first_epoch", "state")
        )
    print(
        f"\nparameters of {'/'.join(names)} agree: {'yes' if agree else 'NO'} (after "
        f"epoch 1: max abs diff {early:.2e}{floors[0]}, tolerance {tolerance:g})\n"
        f"after epoch {epochs}: max abs diff {final:.2e}{floors[1]}: rounding "
        "noise amplified by Adam; held-out accuracy, macro-F1 and loss differ by at "
        f"most {metrics_diff:.1e} (tolerance {metric_tolerance:g})"
    )
    return agree


def main() -> None:
    data = load_digits(ARGS.seed)
    print(
        f"digits: {len(data[0])} train / {len(data[2])} held-out examples, "
        f"{len(jax.devices())} devices, batch {ARGS.batch_size} in "
        f"{ARGS.minibatches} minibatches, {ARGS.epochs} epochs"
        + (", bfloat16 compute" if ARGS.bf16 else "")
    )
    results = {name: train(name, data) for name in ARGS.strategies}
    print(f"metrics: {ARGS.out}/<strategy>/metrics.jsonl, {ARGS.out}/tensorboard")
    first = next(iter(results))
    reference = results[first]["state"]
    print()
    header = (
        f"{'strategy':<9}{'devices':>8}{'epochs':>7}{'acc':>8}{'macro-F1':>10}"
        f"{'loss':>8}{'state B/dev':>13}{'step ms':>9}{'max |Δ| vs ' + first:>18}"
    )
    print(header)
    print("-" * len(header))
    for name, result in results.items():
        test = result["test"]
        ms = result["step_ms"]
        print(
            f"{name:<9}{result['devices']:>8}{result['epochs']:>7}"
            f"{test['accuracy']:>8.4f}{test['macro_f1']:>10.4f}{test['loss']:>8.4f}"
            f"{result['state_bytes']:>13,}{'-' if ms is None else f'{ms:.2f}':>9}"
            f"{max_param_diff(result['state'], reference):>18.2e}"
        )
    if any(r["step_ms"] is None for r in results.values()):
        print("(step ms -: the run was complete already; nothing trained)")
    if "reorder" in results:
        print("(reorder: one device, each minibatch's rows in another order)")
    print("\nheld-out confusion matrix (rows: true digit, columns: predicted):")
    print(np.asarray(results[first]["test"]["confusion"]))
    agree = agreement(results) if len(results) > 1 else True
    if ARGS.plot:
        plot(results, ARGS.plot)
    if not agree:
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        # Ctrl-C outside the loop (loading, compiling) or a second one inside it;
        # a first one inside the loop saves and exits by itself.
        print(
            f"interrupted; {ARGS.out}/<strategy>/ keeps the latest checkpoint: "
            "--resume continues from it",
            file=sys.stderr,
        )
        sys.exit(130)  # 128 + SIGINT, as for the loop's own exit
