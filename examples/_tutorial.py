"""The UvA scaling tutorial's classifier, loss and data, in Equinox.

Shared by `examples/data_parallel.py`, `examples/fsdp.py` and the benchmarks. The
model is the tutorial's: Dense(784 -> 512), SiLU, dropout 0.1, Dense(512 -> 10),
computing in bfloat16 with float32 parameters (Flax's `nn.Dense(dtype=bf16)`), and
LeCun-normal kernels with zero biases (Flax's initialisers).
"""

import argparse
import operator
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqxdist as ed

BATCH_SIZE = 128
INPUT_SIZE = 784
HIDDEN_SIZE = 512
NUM_CLASSES = 10
DROPOUT_RATE = 0.1
LEARNING_RATE = 1e-3
NUM_MINIBATCHES = 4
SEED = 42


def add_tutorial_arguments(parser: argparse.ArgumentParser) -> None:
    """The run's settings, defaulting to the tutorial's."""
    parser.add_argument(
        "--steps", type=int, default=15, help="steps whose metrics are averaged"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=BATCH_SIZE,
        help="global batch size: a multiple of the devices x --minibatches",
    )
    parser.add_argument(
        "--minibatches",
        type=int,
        default=NUM_MINIBATCHES,
        help="gradient accumulation: minibatches per step",
    )
    parser.add_argument(
        "--lr", type=float, default=LEARNING_RATE, help="adamw learning rate"
    )
    parser.add_argument(
        "--min-weight-size",
        type=int,
        default=2**4,
        help="FSDP replicates parameters this small (the tutorial's 2**4)",
    )
    parser.add_argument(
        "--seed", type=int, default=SEED, help="seed of the model, dropout and data"
    )


def parse_args(description: str) -> argparse.Namespace:
    """Parse the tutorial's settings (see `add_tutorial_arguments`)."""
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_tutorial_arguments(parser)
    return parser.parse_args()


class Dense(eqx.Module):
    """`x @ kernel + bias` computed in `dtype` (parameters stay float32)."""

    kernel: Float[Array, "in out"]
    bias: Float[Array, " out"]
    dtype: Any = eqx.field(static=True)

    def __init__(self, in_size: int, out_size: int, *, dtype: Any, key: PRNGKeyArray):
        self.kernel = jax.nn.initializers.lecun_normal()(key, (in_size, out_size))
        self.bias = jnp.zeros(out_size)
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        return x.astype(self.dtype) @ self.kernel.astype(self.dtype) + self.bias.astype(
            self.dtype
        )


class Classifier(eqx.Module):
    """The tutorial's `DPClassifier`/`FSDPClassifier` (the two differ only in how
    Flax shards them; here the strategy is the train step's business)."""

    input_dense: Dense
    output_dense: Dense
    dropout: eqx.nn.Dropout

    def __init__(
        self,
        key: PRNGKeyArray,
        *,
        input_size: int = INPUT_SIZE,
        hidden_size: int = HIDDEN_SIZE,
        num_classes: int = NUM_CLASSES,
        dropout_rate: float = DROPOUT_RATE,
        dtype: Any = jnp.bfloat16,
    ):
        k1, k2 = jax.random.split(key)
        self.input_dense = Dense(input_size, hidden_size, dtype=dtype, key=k1)
        self.output_dense = Dense(hidden_size, num_classes, dtype=dtype, key=k2)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        """Logits (float32); dropout is on when a `key` is given (training)."""
        x = jax.nn.silu(self.input_dense(x))
        x = self.dropout(x, key=key, inference=key is None)
        return self.output_dense(x).astype(jnp.float32)


Batch = dict[str, Array]


def loss_fn(
    model: Classifier, batch: Batch, key: PRNGKeyArray | None
) -> tuple[Array, dict[str, tuple[Array, int]]]:
    """Mean cross-entropy; metrics as `(sum, count)` pairs, as in the tutorial.

    `key` is already different on every device (the train step folds it over the
    data axis), so each device draws its own dropout masks."""
    logits = model(batch["inputs"], key=key)
    labels = batch["labels"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = jnp.argmax(logits, axis=-1) == labels
    size = batch["inputs"].shape[0]
    metrics = {"loss": (losses.sum(), size), "accuracy": (correct.sum(), size)}
    return losses.mean(), metrics


def make_batch(
    key: PRNGKeyArray, batch_size: int = BATCH_SIZE
) -> dict[str, Float[Array, "b d"] | Int[Array, " b"]]:
    """The tutorial's fixed batch: standard-normal inputs, uniform random labels."""
    inputs_key, labels_key = jax.random.split(key)
    return {
        "inputs": jax.random.normal(inputs_key, (batch_size, INPUT_SIZE)),
        "labels": jax.random.randint(labels_key, (batch_size,), 0, NUM_CLASSES),
    }


def setup(
    strategy: str,
    args: argparse.Namespace,
    mesh: Any,
    *,
    dropout_rate: float = DROPOUT_RATE,
    dtype: Any = jnp.bfloat16,
    wrap: Callable[[Classifier], Any] | None = None,
) -> tuple[ed.TrainStep, ed.TrainState, dict[str, Array]]:
    """The tutorial's run: model (passed through `wrap`, if given), adamw, the
    fixed batch, and the train step."""
    init_key, data_key, state_key = jax.random.split(jax.random.key(args.seed), 3)
    optimizer = optax.adamw(args.lr)
    model = Classifier(init_key, dropout_rate=dropout_rate, dtype=dtype)
    if wrap is not None:
        model = wrap(model)
    state = ed.TrainState.create(model, optimizer, state_key)
    step = ed.make_train_step(
        loss_fn,
        optimizer,
        mesh,
        strategy=strategy,
        num_minibatches=args.minibatches,
        min_weight_size=args.min_weight_size,
    )
    return step, state, make_batch(data_key, args.batch_size)


def train(
    step: ed.TrainStep,
    state: ed.TrainState,
    batch: dict[str, Array],
    steps: int,
    label: str,
) -> ed.TrainState:
    """`steps` steps on the fixed batch, then one more; prints the metrics summed
    over the first `steps` (averaged by `print_metrics`) and those of the last."""
    totals = None
    for _ in range(steps):
        state, metrics = step(state, batch)
        totals = (
            metrics if totals is None else jax.tree.map(operator.add, totals, metrics)
        )
    ed.print_metrics(totals, f"{label} - Metrics of steps 1-{steps}")
    state, final = step(state, batch)
    ed.print_metrics(final, f"{label} - Final metrics (step {steps + 1})")
    return state


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between the arrays of two models."""
    pairs = zip(
        jax.tree.leaves(eqx.filter(a, eqx.is_array)),
        jax.tree.leaves(eqx.filter(b, eqx.is_array)),
        strict=True,
    )
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


def print_layout(tree: Any, title: str) -> None:
    """One line per array leaf: its path, global shape and `PartitionSpec`."""
    print(title)
    for path, x in jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array)):
        print(f"  {jax.tree_util.keystr(path):36} {x.shape!s:12} {x.sharding.spec}")


def print_specs(specs: Any, title: str) -> None:
    """One line per `PartitionSpec` of a pytree of specs: its path and the spec."""
    print(title)
    for path, spec in jax.tree_util.tree_leaves_with_path(specs):
        print(f"  {jax.tree_util.keystr(path):36} {spec}")


def bytes_per_device(state: ed.TrainState) -> int:
    """Bytes of parameters and optimizer state held by device 0."""
    leaves = jax.tree.leaves(eqx.filter((state.model, state.opt_state), eqx.is_array))
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)
