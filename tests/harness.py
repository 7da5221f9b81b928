"""What the tests share: small models with their losses and batches
(classification, BatchNorm, tokens), the layouts of the step's tests, a
`shard_map` over the data axis, the metric tests' one-update, merged and synced
runs, a checkpoint as eqxdist 0.1 wrote it and the multi-process launcher. The
single-device references the tests compare with are `reference.py`'s."""

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import eqxdist as ed

ADAMW = optax.adamw(1e-2, weight_decay=0.1)
MP_SCRIPTS = Path(__file__).resolve().parent / "mp_scripts"

# -- classification: rows of features, one of 4 classes each ------------------------


def batch(rng: np.random.Generator, rows: int = 32, features: int = 8) -> dict:
    """`rows` rows of normal `"x"` features and `"y"` labels in [0, 4)."""
    return {
        "x": rng.normal(size=(rows, features)).astype(np.float32),
        "y": rng.integers(0, 4, size=rows).astype(np.int32),
    }


def batches(steps: int = 3, rows: int = 32, features: int = 8, seed: int = 0) -> list:
    """`steps` batches (`batch`) drawn in turn from one generator of `seed`."""
    rng = np.random.default_rng(seed)
    return [batch(rng, rows, features) for _ in range(steps)]


def hsdp_batches() -> list:
    """The global batches of the HSDP tests, in one process and across two
    (tests/mp_scripts/mp_hsdp.py): 32 rows, 16 per process."""
    return batches(steps=3, rows=32, features=16, seed=7)


def train_hsdp(strategy: str, rows: slice = slice(None)) -> Any:
    """`ResidualMLP` trained by `strategy` over both axes of a `{"replica": 2,
    "data": 4}` mesh on `rows` of each of `hsdp_batches()`: all of them in one
    process, each process's own half across two."""
    mesh = ed.create_device_mesh({"replica": 2, "data": 4})
    step = ed.make_train_step(
        loss_fn,
        ADAMW,
        mesh,
        strategy=strategy,
        data_axis=("replica", "data"),
        min_weight_size=64,
    )
    state = ed.TrainState.create(
        ResidualMLP(jax.random.key(0)), ADAMW, jax.random.key(1)
    )
    for batch in hsdp_batches():
        state, _ = step(state, {k: v[rows] for k, v in batch.items()})
    return state


def cross_entropy(model: Any, batch: dict) -> jax.Array:
    """Each row's cross-entropy of `model` (called on one row, vmapped)."""
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def loss_fn(model: Any, batch: dict, key: Any) -> tuple:
    """The mean cross-entropy, its metric the rows' `Mean`."""
    del key
    losses = cross_entropy(model, batch)
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


def counted_loss(model: Any, batch: dict, key: Any) -> tuple:
    """The mean cross-entropy, its metrics `(loss sum, rows)` and the accuracy."""
    del key
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    metrics = {
        "loss": (losses.sum(), batch["x"].shape[0]),
        "accuracy": ed.metrics.Accuracy().update(logits, batch["y"]),
    }
    return losses.mean(), metrics


class ResidualMLP(eqx.Module):
    """16 features to 4 classes through a residual 16 -> 64 -> 16 block, whose
    `up` and `down` weights the tensor-parallel tests shard over `"model"`."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.up = eqx.nn.Linear(16, 64, key=k1)
        self.down = eqx.nn.Linear(64, 16, key=k2)
        self.head = eqx.nn.Linear(16, 4, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(x + self.down(jax.nn.gelu(self.up(x))))


class BNNet(eqx.Module):
    """8 features to 4 classes with a `BatchNorm` over `axis_name` (a model state;
    `mode="ema"` adds a bool flag to it)."""

    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, key: jax.Array, axis_name: Any, mode: str = "batch"):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(8, 16, key=k1)
        self.bn = eqx.nn.BatchNorm(16, axis_name=axis_name, momentum=0.9, mode=mode)
        self.l2 = eqx.nn.Linear(16, 4, key=k2)

    def __call__(self, x: jax.Array, state: Any) -> tuple:
        h, state = self.bn(jax.nn.relu(self.l1(x)), state)
        return self.l2(h), state


def bn_loss(model: Any, model_state: Any, batch: dict, key: Any) -> tuple:
    """`BNNet`'s mean cross-entropy over the vmapped axis `"batch"`."""
    del key
    logits, model_state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(batch["x"], model_state)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}, model_state


# -- tokens: rows of TOKENS tokens, some of them padding ----------------------------

TOKENS = 6  # tokens per row
TOKEN_ROWS = 32  # 4 rows per device

# name: (mesh shape, data axes, strategy, param_rules)
STEP_LAYOUTS = {
    "dp": ({"data": 8}, "data", "dp", ()),
    "fsdp": ({"data": 8}, "data", "fsdp", ()),
    "hsdp": ({"replica": 2, "data": 4}, ("replica", "data"), "fsdp", ()),
    "fsdp_tp": (
        {"data": 4, "model": 2},
        "data",
        "fsdp",
        (
            (r"layers\[0\]\.weight", P("model", None)),
            (r"layers\[1\]\.weight", P(None, "model")),
        ),
    ),
}


def make_layout_step(
    setup: str, loss_fn: Any, optimizer: Any, axis_types: Any = "auto", **kwargs: Any
) -> Any:
    """A train step laid out as `STEP_LAYOUTS[setup]`, leaves of 16 elements and
    more sharded."""
    shape, axes, strategy, rules = STEP_LAYOUTS[setup]
    return ed.make_train_step(
        loss_fn,
        optimizer,
        ed.create_device_mesh(shape, axis_types=axis_types),
        strategy=strategy,
        data_axis=axes,
        param_rules=rules,
        min_weight_size=16,
        **kwargs,
    )


def token_mlp(key: int = 0) -> eqx.nn.MLP:
    """4 features per token to 3 classes."""
    return eqx.nn.MLP(4, 3, 32, 1, key=jax.random.key(key))


def token_batch(seed: int, empty: Sequence[int] = (0,), full: Sequence[int] = (3,)):
    """Rows of TOKENS tokens, a random number of them real; every row of the
    devices in `empty` has none, every row of those in `full` all TOKENS."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, TOKENS + 1, size=TOKEN_ROWS)
    # Very uneven minibatches.
    lengths[:TOKEN_ROWS:4] = rng.integers(0, 2, size=TOKEN_ROWS // 4)
    for d in empty:
        lengths[4 * d : 4 * d + 4] = 0
    for d in full:
        lengths[4 * d : 4 * d + 4] = TOKENS
    return {
        "x": rng.normal(size=(TOKEN_ROWS, TOKENS, 4)).astype(np.float32),
        "y": rng.integers(0, 3, size=(TOKEN_ROWS, TOKENS)).astype(np.int32),
        "mask": np.arange(TOKENS)[None, :] < lengths[:, None],
    }


def token_losses(model: Any, batch: dict) -> jax.Array:
    """Each token's cross-entropy, padding included."""
    logits = jax.vmap(jax.vmap(model))(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def token_weighted_loss(model: Any, batch: dict, key: Any) -> tuple:
    """The pair `(loss sum, real tokens)`: the step's token-weighted mean."""
    del key
    mask = batch["mask"]
    loss_sum = jnp.sum(jnp.where(mask, token_losses(model, batch), 0.0))
    return (loss_sum, mask.sum()), {"tokens": ed.metrics.Sum().update(mask)}


def token_mean_loss(model: Any, batch: dict, key: Any) -> tuple:
    """The mean over rows of each row's mean over all its tokens."""
    del key
    losses = token_losses(model, batch).mean(axis=1)
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


# -- shard_map ----------------------------------------------------------------------


def over_data(
    fn: Callable, mesh: Any, specs: Any, out_specs: Any = None, check_vma: bool = False
) -> Callable:
    """`fn(arrays, rows)` under `jax.shard_map` over `mesh`: the arrays laid out
    by `specs`, the rows split over `"data"`; its result laid out by `specs` (or
    `out_specs`)."""
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(specs, P("data")),
        out_specs=specs if out_specs is None else out_specs,
        check_vma=check_vma,
    )


# -- metrics: one update, merged updates, synced across devices ---------------------


# The aggregations that take a `nan_strategy`.
AGGREGATIONS = (
    ed.metrics.Sum,
    ed.metrics.Mean,
    ed.metrics.Max,
    ed.metrics.Min,
    ed.metrics.Std,
)


def smap(mesh: Any, fn: Callable, in_specs: Any, out_specs: Any = P()) -> Callable:
    """`fn` jitted under `jax.shard_map` over `mesh`."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def assert_same_tree(a: Any, b: Any) -> None:
    """`a` and `b` have one structure and equal leaves of equal dtypes."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_matches(computed: dict, expected: dict, rtol: float = 1e-5) -> None:
    """`computed` has `expected`'s names and its values within `rtol`."""
    assert set(computed) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(computed[name], want, rtol=rtol, err_msg=name)


def one_and_merged(
    collection: Callable, update: Callable, data: Sequence, parts: Any = None
) -> tuple:
    """In one jitted program (compiling is what makes metric tests slow): the
    computed values of a fresh `collection()` updated with all of `data`, and of
    one merged from two updated with `data`'s two `parts` (an index into each
    array; by default the first and second half of the rows).
    `update(metrics, *arrays)` gives the updated metrics."""
    if parts is None:
        half = len(data[0]) // 2
        parts = (slice(0, half), slice(half, None))

    @jax.jit
    def run(*d: Any) -> tuple:
        first, second = (update(collection(), *(x[p] for x in d)) for p in parts)
        return update(collection(), *d).compute(), first.merge(second).compute()

    return run(*data)


def synced(
    mesh: Any,
    collection: Callable,
    update: Callable,
    data: Sequence,
    rows: Sequence = (slice(None),),
    in_specs: Any = P("data"),
    compute: bool = False,
) -> Any:
    """`data` split over `mesh`'s `"data"` axis (`in_specs`), each device updating
    a fresh `collection()` with its share, one update per slice of `rows`: the
    metrics reduced over the devices (`reduce("data")`), or, with `compute`,
    synced (`sync("data")`) and computed on each device."""

    def per_device(*d: Any) -> Any:
        metrics = collection()
        for r in rows:
            metrics = update(metrics, *(x[r] for x in d))
        return metrics.sync("data").compute() if compute else metrics.reduce("data")

    return smap(mesh, per_device, in_specs)(*data)


# -- checkpoints --------------------------------------------------------------------


def v0_1_checkpoint(directory: Path) -> None:
    """Step 3 of `{"w": np.arange(4.0)}` in `directory` as eqxdist 0.1 saved it:
    the arrays directly in `<step>/`, a marker without checksums."""
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        checkpointer.save(directory / "3", {"leaf0": np.arange(4.0)})
    marker = {
        "format": "eqxdist-checkpoint",
        "version": 1,
        "step": 3,
        "process_count": 1,
        "leaves": [{"path": "['w']", "shape": [4], "dtype": "float64"}],
    }
    (directory / "3" / "eqxdist_checkpoint.json").write_text(json.dumps(marker))


# -- processes ----------------------------------------------------------------------


def launch(
    script: str | Path, *args: Any, timeout: float = 240
) -> subprocess.CompletedProcess:
    """`python -m eqxdist.launch -n 2 -d 4 script args...`: two processes of four
    simulated devices, their output captured."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "eqxdist.launch",
            "-n",
            "2",
            "-d",
            "4",
            str(script),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- pipeline parallelism (tests/layout/test_pipeline.py, mp_scripts/mp_pipeline.py)

PIPE_WIDTH = 16
MP_SCHEDULES = ("gpipe", "interleaved", "zb-h1")
"""The schedules mp_pipeline.py runs across two processes (`train_pipeline`)."""


class PipeBlock(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, key: Any) -> None:
        self.linear = eqx.nn.Linear(PIPE_WIDTH, PIPE_WIDTH, key=key)
        self.norm = eqx.nn.LayerNorm(PIPE_WIDTH)

    def __call__(self, x: Any) -> Any:
        return x + jnp.tanh(self.linear(self.norm(x)))


class PipeNet(eqx.Module):
    """An embedding, a `Stacked` of residual blocks and a head: what runs before
    and after a pipeline's stages, and the stages."""

    embed: eqx.nn.Linear
    blocks: ed.Stacked
    head: eqx.nn.Linear

    def __init__(self, layers: int = 16, key: Any = None, remat: Any = None) -> None:
        k1, k2, k3 = jax.random.split(jax.random.key(0) if key is None else key, 3)
        self.embed = eqx.nn.Linear(8, PIPE_WIDTH, key=k1)
        blocks = [PipeBlock(k) for k in jax.random.split(k2, layers)]
        self.blocks = ed.Stacked(blocks, remat=remat)
        self.head = eqx.nn.Linear(PIPE_WIDTH, 4, key=k3)

    def __call__(self, x: Any) -> Any:
        return self.head(self.blocks(jax.nn.relu(self.embed(x))))


def pipe_loss(model: Any, batch: dict, key: Any) -> tuple:
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


def pipe_batches(steps: int = 3, rows: int = 32, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(rows, 8)).astype(np.float32),
            "y": rng.integers(0, 4, rows).astype(np.int32),
            "mask": (rng.random(rows) < 0.7).astype(np.float32),
        }
        for _ in range(steps)
    ]


def train_pipeline(schedule: str) -> Any:
    """`PipeNet` trained 3 steps by a pipeline of `schedule` over `{"stage": 2,
    "data": 4}` (4 microbatches; AdamW) across two processes (mp_pipeline.py),
    where the stage axis spans the processes and both pass every row (the data
    axis is within each)."""
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    repeats = 2 if schedule in ("circular", "interleaved") else 1
    pipeline = ed.Pipeline("stage", 4, schedule=schedule, repeats=repeats)
    step = ed.make_train_step(pipe_loss, ADAMW, mesh, pipeline=pipeline)
    state = ed.TrainState.create(PipeNet(), ADAMW, jax.random.key(1))
    for batch in pipe_batches():
        state, _ = step(state, batch)
    return state


# -- expert parallelism (tests/experts/, mp_scripts/experts.py) ----------------------

MOE_D, MOE_H, MOE_E = 8, 16, 8  # width, expert hidden width, experts


class MoENet(eqx.Module):
    """An embedding, one `ed.MoE` (top-2 of `MOE_E` experts) and a head."""

    embed: eqx.nn.Linear
    moe: ed.MoE
    head: eqx.nn.Linear

    def __init__(self, key: Any, gated: bool = True) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(6, MOE_D, key=k1)
        self.moe = ed.MoE(MOE_D, MOE_H, MOE_E, top_k=2, key=k2, gated=gated)
        self.head = eqx.nn.Linear(MOE_D, 4, key=k3)


def router_probs(moe: Any, x: Any) -> Any:
    """`ed.MoE`'s router probabilities of tokens `x` (T, d), in plain JAX."""
    logits = x @ moe.router.weight.T
    if moe.router_kind == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jax.nn.softmax(logits, axis=-1)


def every_expert(moe: Any, x: Any) -> Any:
    """Every token of `x` (T, d) through every expert of `moe`, in plain JAX:
    (T, E, d), the dense references' products."""
    hidden = moe.activation(jnp.einsum("td,edh->teh", x, moe.w_in))
    if moe.gated:
        hidden = hidden * jnp.einsum("td,edh->teh", x, moe.w_gate)
    return jnp.einsum("teh,ehd->ted", hidden, moe.w_out)


def normal_array(shape: tuple[int, ...], seed: int) -> Any:
    """A float32 array of standard normal draws from generator `seed`."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


# The one MoE layer of the experts' value tests (test_moe, test_router_options):
# d_model, d_hidden, tokens, and the tolerance against its plain-JAX reference.
LAYER_D, LAYER_H, LAYER_T = 4, 6, 16
LAYER_TOL = {"rtol": 1e-5, "atol": 1e-5}


def layer_tokens(seed: int = 1, shape: tuple[int, ...] = (LAYER_T, LAYER_D)) -> Any:
    """The layer's input tokens, normal draws from generator `seed`."""
    return normal_array(shape, seed)


def output_weights(shape: tuple[int, ...], seed: int = 7) -> Any:
    """A fixed random weighting of a layer's outputs: a loss no symmetry can
    fake."""
    return normal_array(shape, seed)


def assert_trees_close(a: Any, b: Any, **tol: float) -> None:
    """The array leaves of `a` and `b` pairwise within `tol` (`LAYER_TOL` by
    default)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **(tol or LAYER_TOL))


def moe_forward(model: MoENet, x: Any) -> tuple:
    """The logits of rows `x` (all of them routed together) and the MoE's aux."""
    h = jax.vmap(model.embed)(x)
    y, aux = model.moe(h)
    return jax.vmap(model.head)(h + y), aux


def moe_loss(model: MoENet, batch: dict, key: Any) -> tuple:
    """Cross-entropy plus the MoE's load-balancing and router-z losses."""
    logits, aux = moe_forward(model, batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    loss = ce.mean() + 0.01 * aux["load_balance_loss"] + 1e-3 * aux["router_z_loss"]
    return loss, {"ce": (ce.sum(), ce.shape[0])}


def train_experts(rows: slice = slice(None)) -> Any:
    """`MoENet` trained 2 steps (AdamW) with its experts split over the data axis
    of `{"data": 8}` and FSDP sharding the rest, on `rows` of each 32-row batch:
    each process's own half across two processes (mp_scripts/experts.py), where
    the data axis, and so the experts, span the processes."""
    layout = ed.Layout(
        ed.create_device_mesh({"data": 8}),
        expert_axis="data",
        strategy="fsdp",
        min_weight_size=16,
    )
    step = ed.make_train_step(moe_loss, ADAMW, layout)
    state = ed.TrainState.create(MoENet(jax.random.key(0)), ADAMW, jax.random.key(1))
    for b in batches(steps=2, rows=32, features=6, seed=11):
        state, _ = step(state, {k: v[rows] for k, v in b.items()})
    return state
