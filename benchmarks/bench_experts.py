"""Expert parallelism against replicated experts: step time, expert bytes per
device and the collectives of each compiled step.

A small mixture-of-experts model (an embedding, `--layers` residual `ed.MoE`
blocks of `--experts` experts, top-2, a head) on 8 simulated CPU devices, one
process: `ed.Layout(mesh)` (data parallelism, every device holding every
expert) against `ed.Layout(mesh, expert_axis="data")` (each device holding
`experts / 8` of them, the tokens sent to them and back), once with the
all-gather dispatch (`expert_parallel`) and once with `MoE(dispatch=
"all_to_all")` (`expert_parallel_a2a`). Timing is interleaved: every repeat
times all three for `--steps` steps (the order alternating); the table gives
median milliseconds per step, the median of the per-repeat ratios of each pair
with their spread, the bytes of
expert weights device 0 holds and the collectives of each compiled step. On CPU
the collectives are memory copies: the ratio says what the dispatch costs here,
not on a GPU's interconnect.

    python benchmarks/bench_experts.py [--repeats 5] [--steps 20] [--experts 16]

The script sets up 8 simulated CPU devices itself (before importing JAX) unless
`XLA_FLAGS` already sets a device count. `run()` returns the figures.
"""

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqxdist as ed

ed.simulate_cpu_devices(8)  # before JAX starts its backend

D_MODEL, D_HIDDEN, ROWS, LENGTH = 64, 128, 64, 16


class Net(eqx.Module):
    embed: eqx.nn.Linear
    blocks: list[ed.MoE]
    head: eqx.nn.Linear

    def __init__(
        self, layers: int, experts: int, key: Any, dispatch: str = "all_gather"
    ) -> None:
        keys = jax.random.split(key, layers + 2)
        self.embed = eqx.nn.Linear(16, D_MODEL, key=keys[0])
        self.blocks = [
            ed.MoE(D_MODEL, D_HIDDEN, experts, key=k, dispatch=dispatch)
            for k in keys[2:]
        ]
        self.head = eqx.nn.Linear(D_MODEL, 4, key=keys[1])


def loss_fn(model: Net, batch: dict[str, Any], key: Any) -> Any:
    h = jax.vmap(model.embed)(batch["x"].reshape(-1, 16))  # every row's tokens
    balance = 0.0
    for block in model.blocks:
        y, aux = block(h)
        h, balance = h + y, balance + aux["load_balance_loss"]
    logits = jax.vmap(model.head)(h)
    labels = batch["y"].reshape(-1)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return ce + 0.01 * balance, {}


def _batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(ROWS, LENGTH, 16)).astype(np.float32),
        "y": rng.integers(0, 4, (ROWS, LENGTH)).astype(np.int32),
    }


def _expert_bytes(state: ed.TrainState) -> int:
    leaves = [
        leaf
        for block in state.model.blocks
        for leaf in (block.w_in, block.w_gate, block.w_out)
        if leaf is not None
    ]
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)


def _setup(
    layout: ed.Layout, args: argparse.Namespace, dispatch: str = "all_gather"
) -> dict[str, Any]:
    optimizer = optax.adamw(1e-3)
    step = ed.make_train_step(loss_fn, optimizer, layout)
    model = Net(args.layers, args.experts, jax.random.key(0), dispatch)
    state = step.init_state(
        lambda k: ed.TrainState.create(model, optimizer, k), jax.random.key(1)
    )
    batch = _batch(0)
    compiled = step.lower(state, batch).compile()
    counts = {k: n for k, n in ed.count_collectives(compiled).items() if n}
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    return {"step": step, "state": state, "batch": batch, "counts": counts,
            "bytes": _expert_bytes(state)}  # fmt: skip


def _time(run: dict[str, Any], steps: int) -> float:
    state = run["state"]
    start = time.perf_counter()
    for _ in range(steps):
        state, _ = run["step"](state, run["batch"])
    jax.block_until_ready(state)
    run["state"] = state
    return (time.perf_counter() - start) / steps * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    mesh = ed.create_device_mesh({"data": 8})
    runs = {
        "replicated": _setup(ed.Layout(mesh), args),
        "expert_parallel": _setup(ed.Layout(mesh, expert_axis="data"), args),
        "expert_parallel_a2a": _setup(
            ed.Layout(mesh, expert_axis="data"), args, dispatch="all_to_all"
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    pairs = (
        ("expert_parallel", "replicated"),
        ("expert_parallel_a2a", "replicated"),
        ("expert_parallel_a2a", "expert_parallel"),
    )
    ratios: dict[tuple[str, str], list[float]] = {pair: [] for pair in pairs}
    for r in range(args.repeats):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:
            times[name].append(_time(runs[name], args.steps))
        for a, b in pairs:
            ratios[a, b].append(times[a][-1] / times[b][-1])
    return {
        name: {
            "ms": statistics.median(times[name]),
            "bytes": runs[name]["bytes"],
            "collectives": runs[name]["counts"],
        }
        for name in runs
    } | {
        "ratios": {
            pair: (statistics.median(r), min(r), max(r)) for pair, r in ratios.items()
        }
    }


class DenseMLP(eqx.Module):
    """The dense MLP of an MoE's active FLOPs: one gated expert `top_k` times as
    wide (each token computes `top_k` experts of `d_hidden`)."""

    w_in: Any
    w_gate: Any
    w_out: Any

    def __init__(self, width: int, key: Any) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.w_in = jax.random.normal(k1, (D_MODEL, width)) / D_MODEL**0.5
        self.w_gate = jax.random.normal(k2, (D_MODEL, width)) / D_MODEL**0.5
        self.w_out = jax.random.normal(k3, (width, D_MODEL)) / width**0.5

    def __call__(self, x: Any) -> Any:
        return (jax.nn.silu(x @ self.w_in) * (x @ self.w_gate)) @ self.w_out


def one_device(args: argparse.Namespace) -> dict[str, Any]:
    """On one device, a training step of one `ed.MoE` (top-2) against the dense
    MLP of the same active FLOPs, on `ROWS * LENGTH` tokens; and how unevenly a
    freshly initialised (random) router spreads them over the experts."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(ROWS * LENGTH, D_MODEL)), jnp.float32)
    layers = {
        "moe": ed.MoE(D_MODEL, D_HIDDEN, args.experts, key=jax.random.key(0)),
        "dense": DenseMLP(2 * D_HIDDEN, jax.random.key(0)),
    }

    def out(layer: Any, x: Any) -> Any:
        y = layer(x)
        return y[0] if isinstance(y, tuple) else y

    @eqx.filter_jit
    def step(layer: Any, x: Any) -> Any:
        grads = eqx.filter_grad(lambda m: jnp.mean(out(m, x) ** 2))(layer)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, layer, grads)

    times: dict[str, list[float]] = {name: [] for name in layers}
    for layer in layers.values():
        jax.block_until_ready(step(layer, x))  # compile
    for r in range(args.repeats):
        for name in list(layers)[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            for _ in range(args.steps):
                layers[name] = step(layers[name], x)
            jax.block_until_ready(layers[name])
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    ratios = [m / d for m, d in zip(times["moe"], times["dense"], strict=True)]
    counts = np.asarray(layers["moe"](x)[1]["tokens_per_expert"])
    return {
        "moe_ms": statistics.median(times["moe"]),
        "dense_ms": statistics.median(times["dense"]),
        "ratio": statistics.median(ratios),
        "imbalance": float(counts.max() / counts.mean()),
        "counts": counts.tolist(),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    out = run(args)
    print(
        f"{args.layers} MoE layers of {args.experts} experts, d_model {D_MODEL}, "
        f"d_hidden {D_HIDDEN}, {ROWS} x {LENGTH} tokens per step, 8 CPU devices"
    )
    print(f"{'layout':<20} {'ms/step':>8} {'expert bytes/dev':>17}  collectives")
    for name in ("replicated", "expert_parallel", "expert_parallel_a2a"):
        row = out[name]
        print(f"{name:<20} {row['ms']:>8.2f} {row['bytes']:>17,}  {row['collectives']}")
    for (a, b), (median, low, high) in out["ratios"].items():
        print(f"{a} / {b}: {median:.2f}x ({low:.2f}-{high:.2f})")
    one = one_device(args)
    print(
        f"one device, {ROWS * LENGTH} tokens: MoE step {one['moe_ms']:.2f} ms, dense "
        f"MLP of the same active FLOPs {one['dense_ms']:.2f} ms: "
        f"{one['ratio']:.2f}x (goal: at most 1.5x)"
    )
    print(
        f"a random router's imbalance: the busiest expert gets "
        f"{one['imbalance']:.2f}x the mean ({one['counts']} assignments)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
