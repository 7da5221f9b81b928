"""FSDP at accelerator speed, measured on CPU: which dimension is sharded, gathers
one block ahead, and scanning over stacked layers.

All in one process, variants interleaved within each repeat, at most 4 steps in
flight (blocking every 4 steps); ratios are taken per repeat, then the median and
the spread (min-max) over repeats are printed.

1. Hand-written FSDP step (`jax.jit(jax.shard_map(...))` with `gather_params` /
   `sync_gradients`, plain SGD on the shards) of a deep MLP of `eqx.nn.Linear`
   blocks: the tutorial's layout (`fsdp_specs(..., layout="largest")`, which
   shards an `(out, in)` weight on `in`) against `layout="leading"` (on `out`).
2. `make_train_step(strategy="fsdp")` with Adam on the same MLP, per variant:
   step time (ratio to eqxdist 0.1's step: the model gathered whole with the
   tutorial's layout, `fsdp_layout="largest"`), compile time (`lower` +
   `compile`), per-device temporary memory from `compiled.memory_analysis()`, and
   the collectives and copies in the compiled HLO. Variants: the whole model with
   either layout (`"leading"` is the train step's default), per-block `FSDP`,
   `FSDPSequential` (one block of prefetch), and `Stacked` (scan over layers) with
   and without prefetch; with `--remat` the per-block variants rematerialise.
3. Compile time against depth (4, 8, 16 blocks): unrolled per-block `FSDP`
   against `Stacked` (min over repeats; trace + compile).

    python benchmarks/bench_fsdp_layout.py            # 8 x 1024^2, ~2 minutes
    python benchmarks/bench_fsdp_layout.py --quick    # 4 x 512^2, seconds
    python benchmarks/bench_fsdp_layout.py --depth 16 --width 1024 --repeats 7

The script sets up 8 simulated CPU devices itself (before JAX starts) unless
`XLA_FLAGS` already sets a device count; on a GPU it turns on
`ed.enable_gpu_collective_overlap()`.
"""

import argparse
import collections
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed

ed.enable_gpu_collective_overlap()  # a no-op without a GPU
ed.simulate_cpu_devices(8)  # before JAX starts its backend

IN_FLIGHT = 4
MiB = 2**20
MIN_WEIGHT_SIZE = 2**16


class Block(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, width: int, key: Any) -> None:
        self.linear = eqx.nn.Linear(width, width, key=key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(jax.vmap(self.linear)(x))


class Chain(eqx.Module):
    blocks: tuple[Any, ...]

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


def _blocks(depth: int, width: int) -> list[Block]:
    return [Block(width, k) for k in jax.random.split(jax.random.key(0), depth)]


def _batch(width: int, rows: int) -> dict[str, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    return {
        "x": jax.random.normal(kx, (rows, width)),
        "y": jax.random.normal(ky, (rows, width)),
    }


def _loss_fn(model: Any, batch: Any, key: Any) -> Any:
    del key
    loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    return loss, {"loss": (loss * batch["x"].shape[0], batch["x"].shape[0])}


def _hlo_counts(hlo: str) -> str:
    counts = {
        "all-gather": len(re.findall(r" all-gather(?:-start)?\(", hlo)),
        "reduce-scatter": len(re.findall(r" reduce-scatter(?:-start)?\(", hlo)),
        "all-reduce": len(re.findall(r" all-reduce(?:-start)?\(", hlo)),
        "copy": len(re.findall(r" copy\(", hlo)),
        "transpose": len(re.findall(r" transpose\(", hlo)),
    }
    return ", ".join(f"{v} {k}" for k, v in counts.items())


# -- 1. the hand-written step ------------------------------------------------------


def _hand_written(
    mesh: Any, depth: int, width: int, rows: int, layout: str
) -> tuple[Callable[[], Any], Any]:
    model = Chain(tuple(_blocks(depth, width)))
    arrays, static = eqx.partition(model, eqx.is_array)
    specs = ed.fsdp_specs(arrays, 8, min_weight_size=MIN_WEIGHT_SIZE, layout=layout)
    shards = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), arrays, specs
    )
    batch = ed.shard_batch(_batch(width, rows), ed.create_data_parallel_sharding(mesh))

    def local(shards: Any, batch: Any) -> Any:
        def loss(s: Any) -> Any:
            full = ed.gather_params(eqx.combine(s, static), specs)
            return _loss_fn(full, batch, None)[0]

        value, grads = jax.value_and_grad(loss)(shards)
        grads = ed.sync_gradients(grads, specs)
        new = jax.tree.map(lambda p, g: p - 1e-3 * g, shards, grads)
        return new, jax.lax.pmean(value, "data")

    fn = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(specs, P("data")),
            out_specs=(specs, P()),
            check_vma=False,
        ),
        donate_argnums=0,
    )
    holder = [shards]

    def call() -> Any:
        holder[0], loss = fn(holder[0], batch)
        return loss

    return call, fn.lower(shards, batch)


# -- 2. the train step -------------------------------------------------------------


def _variants(mesh: Any, depth: int, width: int, remat: bool) -> dict[str, Any]:
    blocks = _blocks(depth, width)
    kw = {"min_weight_size": MIN_WEIGHT_SIZE, "remat": remat}
    return {
        # The train step's own layout: the tutorial's rule (eqxdist 0.1), and the
        # leading dimension (the default since 0.2).
        "whole model, largest (0.1)": (Chain(tuple(blocks)), "largest"),
        "whole model, leading (default)": Chain(tuple(blocks)),
        "per-block FSDP, largest": Chain(
            tuple(ed.FSDP(b, mesh, layout="largest", **kw) for b in blocks)
        ),
        "per-block FSDP, leading": Chain(
            tuple(ed.FSDP(b, mesh, layout="leading", **kw) for b in blocks)
        ),
        "FSDPSequential prefetch, leading": ed.FSDPSequential(
            blocks, mesh, layout="leading", **kw
        ),
        "Stacked scan, leading, no prefetch": ed.FSDP(
            ed.Stacked(blocks, remat=remat, prefetch=False),
            mesh,
            min_weight_size=MIN_WEIGHT_SIZE,
            layout="leading",
        ),
        "Stacked scan, leading, prefetch": ed.FSDP(
            ed.Stacked(blocks, remat=remat),
            mesh,
            min_weight_size=MIN_WEIGHT_SIZE,
            layout="leading",
        ),
    }


def _train_step(
    mesh: Any, model: Any, width: int, rows: int
) -> tuple[Callable[[], Any], Any, float]:
    """A train step of `model`, or of `(model, fsdp_layout)`."""
    model, layout = model if isinstance(model, tuple) else (model, "leading")
    optimizer = optax.adam(1e-3)
    step = ed.make_train_step(
        _loss_fn,
        optimizer,
        mesh,
        strategy="fsdp",
        min_weight_size=MIN_WEIGHT_SIZE,
        max_steps_in_flight=IN_FLIGHT,
        fsdp_layout=layout,
    )
    state = ed.TrainState.create(model, optimizer, jax.random.key(3))
    batch = ed.shard_batch(_batch(width, rows), ed.create_data_parallel_sharding(mesh))
    start = time.perf_counter()
    lowered = step.lower(state, batch)
    compiled_seconds = time.perf_counter() - start  # tracing + lowering ...
    holder = [state]

    def call() -> Any:
        holder[0], metrics = step(holder[0], batch)
        return metrics["loss"][0]

    return call, lowered, compiled_seconds


# -- timing --------------------------------------------------------------------------


def _time(call: Callable[[], Any], steps: int) -> float:
    """Seconds per step, blocking every `IN_FLIGHT` steps."""
    queue: collections.deque[Any] = collections.deque()
    start = time.perf_counter()
    for _ in range(steps):
        queue.append(call())
        if len(queue) >= IN_FLIGHT:
            queue.popleft().block_until_ready()
    while queue:
        queue.popleft().block_until_ready()
    return (time.perf_counter() - start) / steps


def _interleaved(
    calls: dict[str, Callable[[], Any]], baseline: str, repeats: int, steps: int
) -> dict[str, tuple[float, float, float, float]]:
    """name -> (median ms/step, median ratio to baseline, min ratio, max ratio)."""
    for call in calls.values():  # warm up: compile and run once
        _time(call, 2)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(_time(call, steps))
    out = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times[baseline], strict=True)]
        out[name] = (
            1e3 * statistics.median(ts),
            statistics.median(ratios),
            min(ratios),
            max(ratios),
        )
    return out


def _depth_compile_seconds(
    mesh: Any, depth: int, width: int, stacked: bool, repeats: int
) -> float:
    """Trace + lower + compile of the train step, min over `repeats` fresh steps
    (the model is built outside the timing)."""
    blocks = _blocks(depth, width)
    if stacked:
        model: Any = ed.FSDP(
            ed.Stacked(blocks), mesh, min_weight_size=MIN_WEIGHT_SIZE, layout="leading"
        )
    else:
        model = Chain(
            tuple(
                ed.FSDP(b, mesh, min_weight_size=MIN_WEIGHT_SIZE, layout="leading")
                for b in blocks
            )
        )
    optimizer = optax.adam(1e-3)
    state = ed.TrainState.create(model, optimizer, jax.random.key(3))
    batch = _batch(width, 64)
    best = float("inf")
    for _ in range(repeats):
        step = ed.make_train_step(
            _loss_fn, optimizer, mesh, strategy="fsdp", min_weight_size=MIN_WEIGHT_SIZE
        )
        state = step.place_state(state)
        start = time.perf_counter()
        step.lower(state, batch).compile()
        best = min(best, time.perf_counter() - start)
    return best


def run(
    *, depth: int, width: int, rows: int, repeats: int, steps: int, remat: bool
) -> list[tuple[str, str, str]]:
    mesh = ed.create_data_parallel_mesh()
    rows_out: list[tuple[str, str, str]] = []

    # 1. hand-written
    hand = {
        layout: _hand_written(mesh, depth, width, rows, layout)
        for layout in ("largest", "leading")
    }
    result = _interleaved({k: v[0] for k, v in hand.items()}, "largest", repeats, steps)
    for layout, (ms, ratio, lo, hi) in result.items():
        compiled = hand[layout][1].compile()
        rows_out.append(
            (
                f"hand-written FSDP, {layout}",
                f"{ms:.2f} ms/step; {ratio:.2f}x largest ({lo:.2f}-{hi:.2f})",
                _hlo_counts(compiled.as_text()),
            )
        )

    # 2. train step variants
    calls, lowered, compile_s = {}, {}, {}
    for name, model in _variants(mesh, depth, width, remat).items():
        calls[name], lowered[name], trace_s = _train_step(mesh, model, width, rows)
        start = time.perf_counter()
        compiled = lowered[name].compile()
        compile_s[name] = (trace_s + time.perf_counter() - start, compiled)
    baseline = "whole model, largest (0.1)"
    result = _interleaved(calls, baseline, repeats, steps)
    for name, (ms, ratio, lo, hi) in result.items():
        seconds, compiled = compile_s[name]
        memory = compiled.memory_analysis()
        temp = memory.temp_size_in_bytes / MiB if memory is not None else float("nan")
        rows_out.append(
            (
                f"train step, {name}"
                + (", remat" if remat and not name.startswith("whole") else ""),
                f"{ms:.2f} ms/step; {ratio:.2f}x 0.1 ({lo:.2f}-{hi:.2f}); "
                f"compile {seconds:.2f} s; temp {temp:.1f} MiB/device",
                _hlo_counts(compiled.as_text()),
            )
        )

    # 3. compile time against depth: a warm-up compile (JAX's one-time costs),
    # then depths interleaved over rounds, min per depth.
    small = min(width, 256)
    rounds = max(2, repeats // 2)
    for stacked in (False, True):
        _depth_compile_seconds(mesh, 2, small, stacked, 1)
        best = {d: float("inf") for d in (4, 8, 16)}
        for _ in range(rounds):
            for d in best:
                best[d] = min(
                    best[d], _depth_compile_seconds(mesh, d, small, stacked, 1)
                )
        rows_out.append(
            (
                f"trace+compile vs depth, {'Stacked' if stacked else 'per-block FSDP'}",
                ", ".join(f"{d}: {s:.2f} s" for d, s in best.items())
                + f" ({max(best.values()) / min(best.values()):.2f}x spread)",
                f"width {small}, min of {rounds} interleaved rounds",
            )
        )
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="4 x 512^2, few steps")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=64, help="global batch rows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps per repeat")
    parser.add_argument("--remat", action="store_true", help="remat per-block")
    args = parser.parse_args()
    if args.quick:
        args.depth, args.width, args.repeats, args.steps = 4, 512, 3, 4
    print(
        f"deep MLP {args.depth} x {args.width}^2, batch {args.rows}, "
        f"{len(jax.devices())} {jax.devices()[0].platform} devices, "
        f"{args.repeats} repeats x {args.steps} steps"
    )
    for name, figures, hlo in run(
        depth=args.depth,
        width=args.width,
        rows=args.rows,
        repeats=args.repeats,
        steps=args.steps,
        remat=args.remat,
    ):
        print(f"{name:<52} {figures}\n{'':<52} {hlo}")


if __name__ == "__main__":
    main()
