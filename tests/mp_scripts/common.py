"""The training problem shared by the multi-process scripts and the tests that check
them against one process: a small MLP classifier, its data and a training loop.

Imported as `common` by the scripts (run under `python -m eqxdist.launch`) and as
`mp_scripts.common` by the tests (one process with 8 devices)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

import eqxdist as ed

GLOBAL_BATCH = 32
FEATURES = 16
CLASSES = 4
STEPS = 4
MIN_WEIGHT_SIZE = 64  # so FSDP shards the 32x16 and 32x32 weights
OPTIMIZER = optax.adam(1e-2)


def make_state() -> ed.TrainState:
    model = eqx.nn.MLP(FEATURES, CLASSES, 32, 2, key=jax.random.key(0))
    return ed.TrainState.create(model, OPTIMIZER, jax.random.key(1))


def loss_fn(model: Any, batch: dict[str, Any], key: Any) -> tuple[Any, Any]:
    # Input noise drawn from the per-device key, so the devices' keys matter.
    x = batch["x"] + 0.1 * jax.random.normal(key, batch["x"].shape)
    logits = jax.vmap(model)(x)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    accuracy = ed.metrics.Accuracy().update(logits, batch["y"])
    return losses.mean(), {"loss": (losses.sum(), x.shape[0]), "accuracy": accuracy}


def global_batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32),
            "y": rng.integers(0, CLASSES, GLOBAL_BATCH).astype(np.int32),
        }
        for _ in range(STEPS)
    ]


def local_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's rows of a global batch: process p holds the p-th block, so the
    global array `shard_batch` builds is the batch itself."""
    n, p = jax.process_count(), jax.process_index()
    per = GLOBAL_BATCH // n
    return {k: v[p * per : (p + 1) * per] for k, v in batch.items()}


def host(x: Any) -> np.ndarray:
    """The full value of a (possibly multi-process) array, on every process."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def flat(tree: Any) -> dict[str, np.ndarray]:
    """Every array leaf of `tree` as NumPy, keyed by its path."""
    return {
        ed._utils.path_str(path): host(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if eqx.is_array(leaf)
    }


def metric_values(metrics: dict[str, Any]) -> dict[str, float]:
    total, count = metrics["loss"]
    return {
        "loss": float(host(total) / host(count)),
        "accuracy": float(host(metrics["accuracy"].compute())),
    }


def train(
    step: Any, state: ed.TrainState, start: int, stop: int
) -> tuple[ed.TrainState, list[dict[str, float]], dict[str, Any]]:
    """Steps `start..stop-1` on this process's rows; returns the state, each step's
    metrics and the last step's raw metrics."""
    history, metrics = [], {}
    for batch in global_batches()[start:stop]:
        state, metrics = step(state, local_rows(batch))
        history.append(metric_values(metrics))
    return state, history, metrics
