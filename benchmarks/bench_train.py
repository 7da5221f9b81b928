"""Training-step speed: eqxdist against hand-written, GSPMD and Flax steps.

For the UvA tutorial's classifier (784 -> 512 -> 10, bf16 compute, dropout, batch
128 in 4 minibatches, adamw), a tiny, dispatch-bound MLP (batch 64, one
minibatch) and a deep MLP (8 x 1024^2 `eqx.nn.Linear` + gelu blocks, batch 128,
one minibatch, adamw), on 8 simulated CPU devices, one process, side by side:

- `eqxdist dp` / `eqxdist fsdp`: `eqxdist.make_train_step(..., strategy=...)`
  (FSDP with the tutorial's `min_weight_size=2**4`).
- `hand-written`: `jax.jit(jax.shard_map(..., check_vma=False))` over the model's
  arrays, partitioned once, with the same model, loss, gradient accumulation and
  optimizer; the fastest a user could write by hand, and the reference of the
  ratios.
- `flax tutorial`: the tutorial's Flax-linen `train_step_dp` (its `TrainState`, its
  Python-loop gradient accumulation, metrics summed into the carried metrics), on
  current JAX (`jax.shard_map`, `check_vma=False`).
- `naive eqx`: `eqx.filter_jit` around `jax.shard_map` with JAX's default
  `check_vma=True`, filtering the state on every call.
- `gspmd dp` / `gspmd fsdp`: Equinox's own route, no `shard_map`:
  `eqx.filter_jit` over the global batch, parameters placed by `eqx.filter_shard`
  (replicated, or split over "data" on their largest divisible dimension) and the
  optimizer state placed like them (`optax.tree_map_params`); XLA's GSPMD
  partitions the step.

The Flax and naive variants run on the tutorial and tiny models only. Each row
also gives the ratio to the faster baseline of that model (hand-written or GSPMD).

Timing is interleaved: every repeat times each variant for `--steps` steps (the
order rotating), each with at most 8 steps in flight, and the table gives median
milliseconds per step and the median (min-max) of the per-repeat ratios.

    python benchmarks/bench_train.py [--repeats 7] [--steps 40]
    python benchmarks/bench_train.py --collectives [--models deep]  # no timing

The script sets up 8 simulated CPU devices itself (before importing JAX) unless
`XLA_FLAGS` already sets a device count. `run()` returns the rows for other scripts.
"""

import argparse
import collections
import functools
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _tutorial
import bench_fsdp_layout as _deep
import numpy as np

ed.simulate_cpu_devices(8)  # before JAX starts its backend

IN_FLIGHT = 8
TINY = {"batch": 64, "input": 32, "hidden": 32, "classes": 4, "minibatches": 1}
DEEP = {"depth": 8, "width": 1024, "batch": 128}
MODELS = ("tutorial", "tiny", "deep")
# Leaves smaller than this stay replicated under every FSDP variant.
MIN_WEIGHT_SIZE = 2**4


# -- the models -------------------------------------------------------------------


class TinyMLP(eqx.Module):
    """Flax's `FlaxTiny` in Equinox: the same Dense layers (`x @ kernel + bias`)."""

    hidden: _tutorial.Dense
    out: _tutorial.Dense

    def __init__(self, key: Any) -> None:
        k1, k2 = jax.random.split(key)
        self.hidden = _tutorial.Dense(
            TINY["input"], TINY["hidden"], dtype=jnp.float32, key=k1
        )
        self.out = _tutorial.Dense(
            TINY["hidden"], TINY["classes"], dtype=jnp.float32, key=k2
        )

    def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
        return self.out(jax.nn.relu(self.hidden(x)))


class FlaxClassifier(nn.Module):
    """The tutorial's `DPClassifier`."""

    hidden: int
    classes: int
    dropout_rate: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Dense(self.hidden, dtype=self.dtype, name="input_dense")(x)
        x = nn.silu(x)
        x = nn.Dropout(rate=self.dropout_rate, deterministic=not train)(x)
        x = nn.Dense(self.classes, dtype=self.dtype, name="output_dense")(x)
        return x.astype(jnp.float32)


class FlaxTiny(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        del train
        x = nn.relu(nn.Dense(TINY["hidden"])(x))
        return nn.Dense(TINY["classes"])(x)


def _cases() -> dict[str, dict[str, Any]]:
    key = jax.random.key(0)
    tiny_inputs, tiny_labels = jax.random.split(jax.random.key(1))
    return {
        "tutorial": {
            "model": _tutorial.Classifier(key),
            "flax": FlaxClassifier(
                _tutorial.HIDDEN_SIZE,
                _tutorial.NUM_CLASSES,
                _tutorial.DROPOUT_RATE,
                jnp.bfloat16,
            ),
            "batch": _tutorial.make_batch(jax.random.key(2)),
            "minibatches": _tutorial.NUM_MINIBATCHES,
            "loss": _tutorial.loss_fn,
        },
        "deep": {
            "model": _deep.Chain(tuple(_deep._blocks(DEEP["depth"], DEEP["width"]))),
            "flax": None,
            "batch": _deep._batch(DEEP["width"], DEEP["batch"]),
            "minibatches": 1,
            "loss": _deep._loss_fn,
        },
        "tiny": {
            "model": TinyMLP(key),
            "flax": FlaxTiny(),
            "batch": {
                "inputs": jax.random.normal(
                    tiny_inputs, (TINY["batch"], TINY["input"])
                ),
                "labels": jax.random.randint(
                    tiny_labels, (TINY["batch"],), 0, TINY["classes"]
                ),
            },
            "minibatches": TINY["minibatches"],
            "loss": _tutorial.loss_fn,
        },
    }


# -- the variants: each returns `step() -> token` (an output to block on) ----------


def _eqxdist(
    case: dict[str, Any], mesh: Any, strategy: str, linears: str = "auto"
) -> Callable[[], Any]:
    optimizer = optax.adamw(_tutorial.LEARNING_RATE)
    step = ed.make_train_step(
        case["loss"],
        optimizer,
        mesh,
        strategy=strategy,
        num_minibatches=case["minibatches"],
        min_weight_size=MIN_WEIGHT_SIZE,
        max_steps_in_flight=IN_FLIGHT,
        # Only FSDP takes the option (given under "dp", it is an error).
        fsdp_linears=linears if strategy == "fsdp" else None,
    )
    state = ed.TrainState.create(case["model"], optimizer, jax.random.key(3))
    batch = ed.shard_batch(case["batch"], ed.create_data_parallel_sharding(mesh))
    holder = [state]

    def call() -> Any:
        holder[0], metrics = step(holder[0], batch)
        return metrics["loss"][0]

    call.bounded = True  # type: ignore[attr-defined]
    call.lower = lambda: step.lower(holder[0], batch)  # type: ignore[attr-defined]
    return call


def _hand_written(case: dict[str, Any], mesh: Any) -> Callable[[], Any]:
    optimizer = optax.adamw(_tutorial.LEARNING_RATE)
    params, static = eqx.partition(case["model"], eqx.is_array)
    num_minibatches = case["minibatches"]

    def loss(model: Any, batch: Any, key: Any) -> Any:
        return case["loss"](model, batch, jax.random.fold_in(key, _index()))

    def step(params: Any, opt_state: Any, step: Any, key: Any, batch: Any) -> Any:
        # The same randomness as eqxdist's step: fold_in(key, step), per
        # minibatch, per device; the key itself is only read.
        grads, metrics = ed.accumulate_gradients(
            loss,
            eqx.combine(params, static),
            batch,
            jax.random.fold_in(key, step),
            num_minibatches,
        )
        grads = jax.tree.map(lambda g: jax.lax.pmean(g, "data"), grads)
        metrics = jax.tree.map(lambda m: jax.lax.psum(m, "data"), metrics)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, step + 1, metrics

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P(), P(), P("data")),
            out_specs=P(),
            check_vma=False,
        ),
        donate_argnums=(0, 1, 2),
    )
    holder = [
        _replicate(params, mesh),
        _replicate(optimizer.init(params), mesh),
        _replicate(jnp.zeros((), jnp.int32), mesh),
    ]
    key = _replicate(jax.random.key(3), mesh)
    batch = ed.shard_batch(case["batch"], ed.create_data_parallel_sharding(mesh))

    def call() -> Any:
        *holder[:], metrics = fn(*holder, key, batch)
        return metrics["loss"][0]

    call.lower = lambda: fn.lower(*holder, key, batch)  # type: ignore[attr-defined]
    return call


def _replicate(tree: Any, mesh: Any) -> Any:
    """A replicated copy (copied first: replicating a single-device array reuses
    its buffer, and the donating steps would delete the shared models' arrays)."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    arrays = jax.tree.map(jnp.copy, arrays)
    return eqx.combine(jax.device_put(arrays, NamedSharding(mesh, P())), static)


def _index() -> Any:
    return jax.lax.axis_index("data")


class FlaxState(train_state.TrainState):  # type: ignore[misc]
    rng: Any


def _flax_tutorial(case: dict[str, Any], mesh: Any) -> Callable[[], Any]:
    """The tutorial's `loss_fn`, `accumulate_gradients` (loop) and `train_step_dp`."""
    model = case["flax"]
    num_minibatches = case["minibatches"]
    batch = case["batch"]

    def loss_fn(params: Any, apply_fn: Any, batch: Any, rng: Any) -> Any:
        dropout_rng = jax.random.fold_in(rng, jax.lax.axis_index("data"))
        logits = apply_fn(
            {"params": params},
            batch["inputs"],
            train=True,
            rngs={"dropout": dropout_rng},
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        correct = jnp.equal(jnp.argmax(logits, axis=-1), batch["labels"])
        size = batch["inputs"].shape[0]
        return loss.mean(), {
            "loss": (loss.sum(), size),
            "accuracy": (correct.sum(), size),
        }

    def accumulate_gradients(state: Any, batch: Any, rng: Any) -> Any:
        size = batch["inputs"].shape[0] // num_minibatches
        rngs = jax.random.split(rng, num_minibatches)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        grads = metrics = None
        for i in range(num_minibatches):
            minibatch = jax.tree.map(lambda x, i=i: x[i * size : (i + 1) * size], batch)
            (_, step_metrics), step_grads = grad_fn(
                state.params, state.apply_fn, minibatch, rngs[i]
            )
            if grads is None:
                grads, metrics = step_grads, step_metrics
            else:
                grads = jax.tree.map(jnp.add, grads, step_grads)
                metrics = jax.tree.map(jnp.add, metrics, step_metrics)
        return jax.tree.map(lambda g: g / num_minibatches, grads), metrics

    def train_step(state: Any, metrics: Any, batch: Any) -> Any:
        rng, step_rng = jax.random.split(state.rng)
        grads, step_metrics = accumulate_gradients(state, batch, step_rng)
        grads = jax.tree.map(lambda g: jax.lax.pmean(g, "data"), grads)
        new_state = state.apply_gradients(grads=grads, rng=rng)
        step_metrics = jax.tree.map(lambda x: jax.lax.psum(x, "data"), step_metrics)
        # The step counter once more, as an output that is not donated to the
        # next call, to bound the steps in flight by (as eqxdist does).
        return new_state, jax.tree.map(jnp.add, metrics, step_metrics), new_state.step

    fn = jax.jit(
        jax.shard_map(
            train_step,
            mesh=mesh,
            in_specs=(P(), P(), P("data")),
            out_specs=(P(), P(), P()),
            check_vma=False,
        ),
        donate_argnames=("state", "metrics"),
    )
    init_rng, rng = jax.random.split(jax.random.PRNGKey(3))
    params = model.init({"params": init_rng}, batch["inputs"], train=False)["params"]
    state = FlaxState.create(
        apply_fn=model.apply,
        params=params,
        tx=optax.adamw(_tutorial.LEARNING_RATE),
        rng=rng,
    )
    state = _replicate(state, mesh)
    batch = ed.shard_batch(batch, ed.create_data_parallel_sharding(mesh))
    zero = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
    metrics = _replicate({"loss": zero, "accuracy": zero}, mesh)
    holder = [state, metrics]

    def call() -> Any:
        holder[0], holder[1], token = fn(holder[0], holder[1], batch)
        return token

    return call


def _naive(case: dict[str, Any], mesh: Any) -> Callable[[], Any]:
    """`eqx.filter_jit` + `jax.shard_map` (check_vma=True) on the whole state."""
    optimizer = optax.adamw(_tutorial.LEARNING_RATE)
    num_minibatches = case["minibatches"]
    size = mesh.shape["data"]

    def loss(model: Any, batch: Any, key: Any) -> Any:
        return case["loss"](model, batch, jax.random.fold_in(key, _index()))

    @eqx.filter_jit(donate="all-except-first")
    def step(batch: Any, state: ed.TrainState) -> Any:
        params, static = eqx.partition(state.model, eqx.is_array)

        def local(params: Any, key: Any, batch: Any) -> Any:
            grads, metrics = ed.accumulate_gradients(
                loss, eqx.combine(params, static), batch, key, num_minibatches
            )
            # check_vma=True has already summed replicated parameters' gradients.
            grads = jax.tree.map(lambda g: g / size, grads)
            return grads, jax.tree.map(lambda m: jax.lax.psum(m, "data"), metrics)

        key, step_key = jax.random.split(state.key)
        grads, metrics = jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P()
        )(params, step_key, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        model = eqx.apply_updates(state.model, updates)
        return ed.TrainState(model, opt_state, state.step + 1, key), metrics

    state = ed.TrainState.create(case["model"], optimizer, jax.random.key(3))
    holder = [_replicate(state, mesh)]
    batch = ed.shard_batch(case["batch"], ed.create_data_parallel_sharding(mesh))

    def call() -> Any:
        holder[0], metrics = step(batch, holder[0])
        return metrics["loss"][0]

    return call


def largest_dim_spec(x: Any, size: int, min_size: int = MIN_WEIGHT_SIZE) -> P:
    """FSDP as a GSPMD user writes it: the largest dimension divisible by `size`
    split over "data" (replicated if none, or if the leaf is small)."""
    if x.size < min_size:
        return P()
    for dim in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
        if x.shape[dim] % size == 0:
            return P(*([None] * dim), "data")
    return P()


def gspmd_shardings(
    optimizer: Any, params: Any, mesh: Any, *, fsdp: bool
) -> tuple[Any, Any]:
    """NamedShardings of the parameters (replicated, or `largest_dim_spec`) and of
    the optimizer state, laid out like its parameters (`optax.tree_map_params`)."""
    size = mesh.shape["data"]
    params_sh = jax.tree.map(
        lambda x: NamedSharding(mesh, largest_dim_spec(x, size) if fsdp else P()),
        params,
    )
    replicated = NamedSharding(mesh, P())
    opt_sh = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        optimizer.init(params),
        params_sh,
        transform_non_params=lambda _: replicated,
    )
    return params_sh, opt_sh


def _gspmd(case: dict[str, Any], mesh: Any, *, fsdp: bool) -> Callable[[], Any]:
    """Equinox's own route: `eqx.filter_jit` over the global batch, parameters and
    optimizer state placed by `eqx.filter_shard`, no `shard_map`: XLA's GSPMD
    partitions the computation. Minibatch `i` is rows `i::num_minibatches`, so that
    every minibatch stays split over all devices."""
    optimizer = optax.adamw(_tutorial.LEARNING_RATE)
    num_minibatches = case["minibatches"]
    # From host copies, so donation cannot delete the model the others start from.
    params, static = eqx.partition(case["model"], eqx.is_array)
    params = jax.tree.map(np.asarray, params)
    params_sh, opt_sh = gspmd_shardings(optimizer, params, mesh, fsdp=fsdp)
    grad_fn = jax.value_and_grad(
        lambda p, b, k: case["loss"](eqx.combine(p, static), b, k), has_aux=True
    )

    @eqx.filter_jit(donate="all-except-first")
    def step(batch: Any, params: Any, opt_state: Any, step: Any, key: Any) -> Any:
        minibatches = jax.tree.map(
            lambda x: jnp.swapaxes(x.reshape(-1, num_minibatches, *x.shape[1:]), 0, 1),
            batch,
        )
        key = jax.random.fold_in(key, step)

        def one(grads: Any, xs: Any) -> Any:
            i, minibatch = xs
            (_, metrics), g = grad_fn(params, minibatch, jax.random.fold_in(key, i))
            return jax.tree.map(jnp.add, grads, g), metrics

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, metrics = jax.lax.scan(
            one, zeros, (jnp.arange(num_minibatches), minibatches)
        )
        grads = jax.tree.map(lambda g: g / num_minibatches, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = eqx.filter_shard(eqx.apply_updates(params, updates), params_sh)
        opt_state = eqx.filter_shard(opt_state, opt_sh)
        metrics = jax.tree.map(lambda m: m.sum(0), metrics)
        return params, opt_state, step + 1, metrics

    params = eqx.filter_shard(params, params_sh)
    holder = [
        params,
        eqx.filter_shard(optimizer.init(params), opt_sh),
        _replicate(jnp.zeros((), jnp.int32), mesh),
    ]
    key = _replicate(jax.random.key(3), mesh)
    batch = ed.shard_batch(case["batch"], ed.create_data_parallel_sharding(mesh))

    def call() -> Any:
        *holder[:], metrics = step(batch, *holder, key)
        return metrics["loss"][0]

    call.lower = lambda: step.lower(batch, *holder, key)  # type: ignore[attr-defined]
    return call


VARIANTS: dict[str, Callable[[dict[str, Any], Any], Callable[[], Any]]] = {
    "hand-written": _hand_written,
    "eqxdist dp": functools.partial(_eqxdist, strategy="dp"),
    "eqxdist fsdp": functools.partial(_eqxdist, strategy="fsdp"),
    "eqxdist fsdp, gathered": functools.partial(
        _eqxdist, strategy="fsdp", linears="gather"
    ),
    "flax tutorial": _flax_tutorial,
    "naive eqx": _naive,
    "gspmd dp": functools.partial(_gspmd, fsdp=False),
    "gspmd fsdp": functools.partial(_gspmd, fsdp=True),
}
# Variants that only exist for some models (the Flax model is written for those).
ONLY = {"flax tutorial": ("tutorial", "tiny"), "naive eqx": ("tutorial", "tiny")}


def _time(call: Callable[[], Any], steps: int) -> float:
    """Seconds per step, at most IN_FLIGHT steps queued (eqxdist bounds its own)."""
    bounded = getattr(call, "bounded", False)
    queue: collections.deque[Any] = collections.deque()
    start = time.perf_counter()
    for _ in range(steps):
        queue.append(call())
        if not bounded and len(queue) > IN_FLIGHT:
            queue.popleft().block_until_ready()
    for token in queue:
        token.block_until_ready()
    return (time.perf_counter() - start) / steps


BASELINES = ("hand-written", "gspmd dp", "gspmd fsdp")


def _ratios(times: dict[str, list[float]], label: str, ref: str) -> list[float]:
    return [a / b for a, b in zip(times[label], times[ref], strict=True)]


def run(
    *,
    models: tuple[str, ...] = MODELS,
    repeats: int = 7,
    steps: int = 40,
) -> list[dict[str, Any]]:
    """Time every variant on every model; one row per (model, variant) with the
    median ms/step, and the median (min-max) of the per-repeat ratios to
    `hand-written`, to `flax tutorial` (where it runs) and to `best`: the baseline
    (hand-written or GSPMD) with the lowest median on that model."""
    if len(jax.devices()) < 8:
        raise RuntimeError(
            "bench_train needs 8 devices; set XLA_FLAGS="
            "--xla_force_host_platform_device_count=8 before importing JAX."
        )
    mesh = ed.create_data_parallel_mesh(8)
    cases = _cases()
    rows = []
    for name in models:
        calls = {
            label: make(cases[name], mesh)
            for label, make in VARIANTS.items()
            if name in ONLY.get(label, (name,))
        }
        for call in calls.values():  # compile and warm up
            _time(call, IN_FLIGHT + 2)
        times: dict[str, list[float]] = {label: [] for label in calls}
        labels = list(calls)
        for r in range(repeats):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                times[label].append(_time(calls[label], steps))
        best = min(BASELINES, key=lambda b: statistics.median(times[b]))
        for label in labels:
            row = {
                "model": name,
                "variant": label,
                "ms_per_step": 1e3 * statistics.median(times[label]),
                "best": best,
            }
            for key, ref in (
                ("vs_hand_written", "hand-written"),
                ("vs_flax", "flax tutorial"),
                ("vs_best", best),
            ):
                if ref in times:
                    ratios = _ratios(times, label, ref)
                    row[key] = statistics.median(ratios)
                    row[f"{key}_spread"] = (min(ratios), max(ratios))
            rows.append(row)
    return rows


_COLLECTIVE = re.compile(
    r"= (.+?) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_ARRAY = re.compile(r"([a-z]+)(\d*)\[([\d,]*)\]")


def _shape_bytes(shape: str) -> int:
    """Bytes of the arrays in an HLO result shape (one array or a tuple)."""
    total = 0
    for kind, bits, dims in _ARRAY.findall(shape):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * (int(bits) if bits else 8) // 8 if kind != "pred" else size
    return total


def _received(kind: str, result: int, devices: int) -> float:
    """Bytes one device receives for a collective whose result holds `result`
    bytes per device, as ring algorithms move them: an all-gather or all-to-all
    brings in the other devices' parts, a reduce-scatter its inputs' other parts
    (`devices - 1` results), an all-reduce is a reduce-scatter and an
    all-gather."""
    share = (devices - 1) / devices
    factor = {
        "all-gather": share,
        "all-to-all": share,
        "reduce-scatter": devices - 1,
        "all-reduce": 2 * share,
    }.get(kind, 1.0)
    return factor * result


def collectives(models: tuple[str, ...] = MODELS) -> None:
    """Print, for every variant that can be lowered, the collectives of its
    compiled step by kind and result shape (layouts dropped), and the bytes a
    device receives for them (`_received`): where the variants' communication
    differs."""
    mesh = ed.create_data_parallel_mesh(8)
    devices = mesh.devices.size
    cases = _cases()
    for name in models:
        for label, make in VARIANTS.items():
            call = make(cases[name], mesh) if name in ONLY.get(label, (name,)) else None
            if call is None or not hasattr(call, "lower"):
                continue
            compiled = call.lower().compile()
            # `eqx.filter_jit`'s compiled program wraps JAX's.
            text = getattr(compiled, "compiled", compiled).as_text()
            counts: collections.Counter[tuple[str, str]] = collections.Counter()
            for line in text.splitlines():
                found = _COLLECTIVE.search(line)
                if found:
                    shape = re.sub(r"\{[^}]*\}|/\*index=\d+\*/", "", found[1])
                    counts[found[2], shape] += 1
            mib = {
                key: n * _received(key[0], _shape_bytes(key[1]), devices) / 2**20
                for key, n in counts.items()
            }
            print(f"{name} / {label}: {sum(mib.values()):.1f} MiB received per device")
            for (kind, shape), n in sorted(counts.items()):
                short = shape if len(shape) <= 50 else shape[:47] + "..."
                print(f"  {n:3d} x {kind:15s} {mib[kind, shape]:6.2f} MiB  {short}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats")
    parser.add_argument("--steps", type=int, default=40, help="steps per timing")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument(
        "--collectives",
        action="store_true",
        help="print each step's collectives by kind and shape instead of timing",
    )
    args = parser.parse_args()
    if args.collectives:
        collectives(tuple(args.models))
        return
    rows = run(models=tuple(args.models), repeats=args.repeats, steps=args.steps)
    print(
        f"{'model':9} {'variant':14} {'ms/step':>9} {'/hand-written':>14} "
        f"{'/flax':>7}  /best (min-max)"
    )
    for row in rows:
        flax = f"{row['vs_flax']:7.3f}" if "vs_flax" in row else f"{'-':>7}"
        low, high = row["vs_best_spread"]
        print(
            f"{row['model']:9} {row['variant']:14} {row['ms_per_step']:9.3f} "
            f"{row['vs_hand_written']:14.3f} {flax}  {row['vs_best']:.3f} "
            f"({low:.2f}-{high:.2f}) of {row['best']}"
        )


if __name__ == "__main__":
    main()
