"""The training problem shared by the multi-process scripts and the tests that check
them against one process: a small MLP classifier, its data and a training loop.

Imported as `common` by the scripts (run under `python -m eqxdist.launch`) and as
`mp_scripts.common` by the tests (one process with 8 devices)."""

import os
import subprocess
import sys
from pathlib import Path
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

# The rows, batches and meshes of `BatchLoader` across processes (mp_loader.py).
LOADER_ROWS, LOADER_BATCH, LOADER_SEED = 40, 16, 3
LOADER_DATA = {
    "x": np.arange(LOADER_ROWS * 3, dtype=np.float32).reshape(LOADER_ROWS, 3),
    "y": np.arange(LOADER_ROWS, dtype=np.int32),
}
LOADER_MESHES = {
    "data": ({"data": 8}, "data"),
    "replica_data": ({"replica": 2, "data": 4}, ("replica", "data")),
    # The model axis spans the processes: both hold every row.
    "model_data": ({"model": 2, "data": 4}, "data"),
}


def make_state() -> ed.TrainState:
    model = eqx.nn.MLP(FEATURES, CLASSES, 32, 2, key=jax.random.key(0))
    return ed.TrainState.create(model, OPTIMIZER, jax.random.key(1))


def make_step(mesh: Any, strategy: str = "dp") -> Any:
    """The train step of `loss_fn` over `mesh` (FSDP shards leaves of
    `MIN_WEIGHT_SIZE` elements and more)."""
    return ed.make_train_step(
        loss_fn, OPTIMIZER, mesh, strategy=strategy, min_weight_size=MIN_WEIGHT_SIZE
    )


def record_pids(out: Path) -> None:
    """Append this process's id to `out/pids`, and on process 0 also that of a
    child it starts (asleep), so that a test can check none outlives the
    launcher."""
    pids = [str(os.getpid())]
    if jax.process_index() == 0:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        pids.append(str(child.pid))
    with open(out / "pids", "a") as f:
        f.write("\n".join(pids) + "\n")


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
