"""What the step statistics, non-finite skipping and sharded initialisation cost.

1. Step time of `make_train_step(..., step_info=True, skip_nonfinite=True)`
   against the plain step (same model, optimizer and batch), for dp and fsdp,
   and of each option alone. All run in one process, interleaved within each
   repeat (the order rotating), at most 4 steps in flight; the ratio is taken
   per repeat, and the median and spread (min-max) over repeats are printed,
   with the compiled steps' bytes accessed per device (`cost_analysis()`,
   deterministic) against the plain step's. Goal: <= 1.03.
2. `TrainStep.init_state` of an 8 x 1024^2 MLP (Adam) under FSDP: the most
   bytes a device holds while it runs (`TrainStep.init_peak_bytes`: the
   compiled programs' outputs and temporaries, from `memory_analysis()`)
   against the per-device share of the state. Goal: <= 1.25x. Beside it, the
   same state built by one `jax.jit` with the same output shardings, which
   XLA:CPU's default scheduler runs with the layers' random initialisers side
   by side (their threefry working arrays, about one shard per layer, as
   temporaries); building the state on one device and placing it holds the
   whole state (8x the share) on that device.

    python benchmarks/bench_step_info.py            # 8 x 1024^2, about a minute
    python benchmarks/bench_step_info.py --quick    # 4 x 256^2, seconds

The script sets up 8 simulated CPU devices itself (before JAX starts).
"""

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed

ed.simulate_cpu_devices(8)  # before JAX starts its backend

IN_FLIGHT = 4


def mlp(width: int, depth: int, key: Any) -> eqx.nn.Sequential:
    keys = jax.random.split(key, depth)
    layers = []
    for k in keys:
        layers += [eqx.nn.Linear(width, width, key=k), eqx.nn.Lambda(jnp.tanh)]
    return eqx.nn.Sequential(layers)


def loss_fn(model: Any, batch: Any, key: Any) -> Any:
    del key
    out = jax.vmap(model)(batch["x"])
    loss = jnp.mean((out - batch["y"]) ** 2)
    return loss, {"loss": (loss, 1)}


def time_steps(step: Any, state: Any, batch: Any, steps: int) -> tuple[Any, float]:
    out = None
    start = time.perf_counter()
    for i in range(steps):
        out = step(state, batch)
        state = out[0]
        if (i + 1) % IN_FLIGHT == 0:
            jax.block_until_ready(state)
    jax.block_until_ready(state)
    return state, (time.perf_counter() - start) / steps


def bytes_accessed(step: Any, state: Any, batch: Any) -> float:
    """The compiled step's bytes accessed per device (`cost_analysis()`): XLA's
    count of what each fusion reads and writes, the same on every run (the
    timings on a shared 2-core machine are not)."""
    cost = step.lower(state, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["bytes accessed"])


def bench_overhead(args: argparse.Namespace) -> None:
    mesh = ed.create_data_parallel_mesh()
    optimizer = optax.adamw(1e-3)
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(args.batch, args.width)).astype(np.float32),
        "y": rng.normal(size=(args.batch, args.width)).astype(np.float32),
    }
    variants = {
        "plain": {},
        "skip_nonfinite": {"skip_nonfinite": True},
        "step_info": {"step_info": True},
        "both": {"step_info": True, "skip_nonfinite": True},
    }
    for strategy in ("dp", "fsdp"):
        kwargs = {"strategy": strategy, "min_weight_size": 2**14}
        steps = {
            name: ed.make_train_step(loss_fn, optimizer, mesh, **kwargs, **extra)
            for name, extra in variants.items()
        }
        states = {
            name: ed.TrainState.create(
                mlp(args.width, args.depth, jax.random.key(0)),
                optimizer,
                jax.random.key(1),
            )
            for name in steps
        }
        for name in steps:  # compile and warm up
            states[name], _ = time_steps(steps[name], states[name], batch, 4)
        times: dict[str, list[float]] = {name: [] for name in steps}
        names = list(steps)
        for r in range(args.repeats):
            # The order rotates, so that no variant always runs first or last.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                states[name], t = time_steps(
                    steps[name], states[name], batch, args.steps
                )
                times[name].append(t)
        accessed = {
            name: bytes_accessed(steps[name], states[name], batch) for name in steps
        }
        plain = times["plain"]
        print(
            f"{strategy}: plain step {statistics.median(plain) * 1e3:.1f} ms, "
            f"{accessed['plain'] / 2**20:.0f} MiB accessed per device"
        )
        for name in names[1:]:
            ratios = [t / p for t, p in zip(times[name], plain, strict=True)]
            print(
                f"  {name:15s} / plain: median {statistics.median(ratios):.3f} "
                f"(spread {min(ratios):.3f}-{max(ratios):.3f}); bytes accessed "
                f"{accessed[name] / accessed['plain']:.2f}x"
            )


def bench_init(args: argparse.Namespace) -> None:
    mesh = ed.create_data_parallel_mesh()
    optimizer = optax.adam(1e-3)

    def init_fn(key: Any) -> ed.TrainState:
        return ed.TrainState.create(mlp(args.width, args.depth, key), optimizer, key)

    step = ed.make_train_step(
        loss_fn, optimizer, mesh, strategy="fsdp", min_weight_size=2**14
    )
    key = jax.random.key(0)
    peak = step.init_peak_bytes(init_fn, key)
    programs = len(step.lower_init(init_fn, key))
    abstract = eqx.filter_eval_shape(init_fn, key)
    total = sum(
        x.size * x.dtype.itemsize
        for x in jax.tree.leaves(abstract)
        if isinstance(x, jax.ShapeDtypeStruct)
        and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    )
    share = total / len(jax.devices())
    # The whole state as one program, placed as init_state places it.
    shardings = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        eqx.filter(step.state_specs(abstract), lambda x: x is not None),
        is_leaf=lambda x: isinstance(x, P),
    )
    whole = jax.jit(
        lambda k: eqx.filter(init_fn(k), eqx.is_array), out_shardings=shardings
    )
    memory = whole.lower(key).compile().memory_analysis()
    one = memory.output_size_in_bytes + memory.temp_size_in_bytes
    mib = 2**20
    print(
        f"init_state {args.depth} x {args.width}^2 fsdp: state {total / mib:.1f} MiB, "
        f"per-device share {share / mib:.2f} MiB; per device at most "
        f"{peak / mib:.2f} MiB = {peak / share:.3f}x the share ({programs} "
        f"programs); as one program {one / mib:.2f} MiB = {one / share:.2f}x "
        f"(temporaries {memory.temp_size_in_bytes / mib:.2f} MiB); unsharded "
        f"create + place_state: {total / share:.0f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, seconds")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.quick:
        args.width, args.depth, args.steps, args.repeats = 256, 4, 4, 3
    bench_overhead(args)
    bench_init(args)


if __name__ == "__main__":
    main()
