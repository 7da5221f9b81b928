"""FSDP with gradient accumulation: eqxdist's step against a hand-written FSDP step
that gathers once and reduce-scatters once per step.

The UvA tutorial's classifier (784 -> 512 -> 10, dropout, adamw) with a batch of 128
in 4 minibatches, and a deeper MLP (4 x 512 x 512, batch 256 in 4 minibatches), on 8
simulated CPU devices, one process, side by side:

- `eqxdist fsdp`: `make_train_step(..., strategy="fsdp", num_minibatches=4)` with its
  default `fsdp_gather="step"` (gather once, reduce-scatter once per step).
- `eqxdist fsdp per-minibatch`: the same with `fsdp_gather="minibatch"` (what
  eqxdist 0.1 did: one gather and reduce-scatter per minibatch).
- `hand-written`: `jax.jit(jax.shard_map(..., check_vma=False))` over the sharded
  arrays: the custom-VJP gather (`ed.gather_params`) run once under `jax.vjp`, full
  gradients accumulated over the minibatches, one pullback (reduce-scatter) per
  step, `pmean` of replicated leaves, the optimizer on the shards. The reference of
  the ratios.

Also counted from the compiled HLO (deterministic): all-gathers and reduce-scatters
executed per step (ops inside loops times their trip count).

    python benchmarks/bench_fsdp_accumulation.py [--repeats 7] [--steps 30]
"""

import argparse
import collections
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _tutorial

ed.simulate_cpu_devices(8)  # before JAX starts its backend

IN_FLIGHT = 8
MIN_WEIGHT_SIZE = 2**4
MINIBATCHES = 4


class Deep(eqx.Module):
    layers: tuple[eqx.nn.Linear, ...]
    out: eqx.nn.Linear

    def __init__(self, key: Any, depth: int = 4, width: int = 512) -> None:
        keys = jax.random.split(key, depth + 1)
        self.layers = tuple(
            eqx.nn.Linear(_tutorial.INPUT_SIZE if i == 0 else width, width, key=k)
            for i, k in enumerate(keys[:-1])
        )
        self.out = eqx.nn.Linear(width, _tutorial.NUM_CLASSES, key=keys[-1])

    def __call__(self, x: jax.Array, *, key: Any = None) -> Any:
        """Logits of a batch of rows (the tutorial's loss calls the model on one)."""
        for layer in self.layers:
            x = jax.nn.silu(jax.vmap(layer)(x))
        return jax.vmap(self.out)(x)


def _cases() -> dict[str, dict[str, Any]]:
    deep_x, deep_y = jax.random.split(jax.random.key(5))
    return {
        "tutorial": {
            "model": _tutorial.Classifier(jax.random.key(0)),
            "batch": _tutorial.make_batch(jax.random.key(2)),
        },
        "deep": {
            "model": Deep(jax.random.key(0)),
            "batch": {
                "inputs": jax.random.normal(deep_x, (256, _tutorial.INPUT_SIZE)),
                "labels": jax.random.randint(deep_y, (256,), 0, 10),
            },
        },
    }


def _eqxdist(case: dict[str, Any], mesh: Any, gather: str) -> Callable[[], Any]:
    optimizer = optax.adamw(_tutorial.LEARNING_RATE)
    step = ed.make_train_step(
        _tutorial.loss_fn,
        optimizer,
        mesh,
        strategy="fsdp",
        num_minibatches=MINIBATCHES,
        min_weight_size=MIN_WEIGHT_SIZE,
        fsdp_gather=gather,
    )
    state = ed.TrainState.create(case["model"], optimizer, jax.random.key(3))
    batch = ed.shard_batch(case["batch"], ed.create_data_parallel_sharding(mesh))
    holder = [state]

    def call() -> Any:
        holder[0], metrics = step(holder[0], batch)
        return metrics["loss"][0]

    call.bounded = True  # type: ignore[attr-defined]
    call.lowered = lambda: step.lower(holder[0], batch)  # type: ignore[attr-defined]
    return call


def _hand_written(case: dict[str, Any], mesh: Any) -> Callable[[], Any]:
    optimizer = optax.adamw(_tutorial.LEARNING_RATE)
    params, static = eqx.partition(case["model"], eqx.is_array)
    specs = ed.fsdp_specs(params, 8, min_weight_size=MIN_WEIGHT_SIZE)
    opt_state = optimizer.init(params)
    opt_specs = optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        opt_state,
        specs,
        transform_non_params=lambda x: P(),
    )

    def loss(model: Any, batch: Any, key: Any) -> Any:
        key = jax.random.fold_in(key, jax.lax.axis_index("data"))
        return _tutorial.loss_fn(model, batch, key)

    def grads_and_metrics(shards: Any, step: Any, key: Any, batch: Any) -> Any:
        full, pullback = jax.vjp(lambda p: ed.gather_params(p, specs), shards)
        grads, metrics = ed.accumulate_gradients(
            loss,
            eqx.combine(full, static),
            batch,
            jax.random.fold_in(key, step),
            MINIBATCHES,
        )
        (grads,) = pullback(eqx.filter(grads, eqx.is_array))
        grads = ed.sync_gradients(grads, specs)
        return grads, jax.tree.map(lambda m: jax.lax.psum(m, "data"), metrics)

    sharded = jax.shard_map(
        grads_and_metrics,
        mesh=mesh,
        in_specs=(specs, P(), P(), P("data")),
        out_specs=(specs, P()),
        check_vma=False,
    )

    def step(params: Any, opt_state: Any, step: Any, key: Any, batch: Any) -> Any:
        grads, metrics = sharded(params, step, key, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, step + 1, metrics

    def shardings(tree_specs: Any) -> Any:
        return jax.tree.map(
            lambda s: NamedSharding(mesh, s),
            tree_specs,
            is_leaf=lambda x: isinstance(x, P),
        )

    param_sh, opt_sh = shardings(specs), shardings(opt_specs)
    replicated = NamedSharding(mesh, P())
    fn = jax.jit(
        step,
        in_shardings=(
            param_sh,
            opt_sh,
            replicated,
            replicated,
            NamedSharding(mesh, P("data")),
        ),
        out_shardings=(param_sh, opt_sh, replicated, replicated),
        donate_argnums=(0, 1, 2),
    )
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
    holder = [
        copy(jax.device_put(params, param_sh)),
        copy(jax.device_put(opt_state, opt_sh)),
        jax.device_put(jnp.zeros((), jnp.int32), replicated),
    ]
    key = jax.device_put(jax.random.key(3), replicated)
    batch = ed.shard_batch(case["batch"], ed.create_data_parallel_sharding(mesh))

    def call() -> Any:
        *holder[:], metrics = fn(*holder, key, batch)
        return metrics["loss"][0]

    call.lowered = lambda: fn.lower(*holder, key, batch)  # type: ignore[attr-defined]
    return call


VARIANTS: dict[str, Callable[[dict[str, Any], Any], Callable[[], Any]]] = {
    "eqxdist fsdp": lambda c, m: _eqxdist(c, m, "step"),
    "eqxdist fsdp per-minibatch": lambda c, m: _eqxdist(c, m, "minibatch"),
    "hand-written": _hand_written,
}


def collectives_per_step(compiled: Any) -> int:
    """All-gathers and reduce-scatters executed per step (`ed.count_collectives`)."""
    counts = ed.count_collectives(compiled)
    return counts["all-gather"] + counts["reduce-scatter"]


def _time(call: Callable[[], Any], steps: int) -> float:
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


def run(*, repeats: int = 7, steps: int = 30) -> list[dict[str, Any]]:
    """One row per (model, variant): median ms/step, median and spread (min-max) of
    the per-repeat ratio to `hand-written`, collectives per step."""
    mesh = ed.create_data_parallel_mesh(8)
    rows = []
    for name, case in _cases().items():
        calls = {label: make(case, mesh) for label, make in VARIANTS.items()}
        for call in calls.values():
            _time(call, IN_FLIGHT + 2)
        counts = {
            label: collectives_per_step(call.lowered().compile())  # type: ignore[attr-defined]
            for label, call in calls.items()
        }
        times: dict[str, list[float]] = {label: [] for label in calls}
        labels = list(calls)
        for r in range(repeats):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                times[label].append(_time(calls[label], steps))
        for label in labels:
            ratios = [
                a / b for a, b in zip(times[label], times["hand-written"], strict=True)
            ]
            rows.append(
                {
                    "model": name,
                    "variant": label,
                    "ms_per_step": 1e3 * statistics.median(times[label]),
                    "vs_hand_written": statistics.median(ratios),
                    "spread": (min(ratios), max(ratios)),
                    "collectives": counts[label],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats")
    parser.add_argument("--steps", type=int, default=30, help="steps per timing")
    args = parser.parse_args()
    print("| model | variant | ms/step | / hand-written (min-max) | collectives/step |")
    print("|---|---|---|---|---|")
    for r in run(repeats=args.repeats, steps=args.steps):
        lo, hi = r["spread"]
        print(
            f"| {r['model']} | {r['variant']} | {r['ms_per_step']:.2f} | "
            f"{r['vs_hand_written']:.3f} ({lo:.2f}-{hi:.2f}) | {r['collectives']} |"
        )


if __name__ == "__main__":
    main()
