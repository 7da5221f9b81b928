"""The two views of a train step against a hand-written GSPMD step, and a GAN's
two part steps against two hand-written steps.

On 8 simulated CPU devices, one process, interleaved:

- `device`: `make_train_step(..., view="device")`: the loss per device inside
  `jax.shard_map`, eqxdist's collectives (FSDP gathers or partitioned linears).
- `global`: `make_train_step(..., view="global")`: the loss on the whole batch,
  XLA's GSPMD partitioner laying out the computation.
- `gspmd`: a hand-written `eqx.filter_jit` step on global arrays, the state placed
  with the same `PartitionSpec`s (`step.state_specs`), the same loss and optimizer,
  donating the state: what the global view must match (within 1.05x).

for `"dp"` and `"fsdp"`, on a deep MLP of `eqx.nn.Linear` layers (8 x 1024^2,
batch 128), the same MLP with a plain `x @ W` layer of its own, a small
classifier, and the transformer of the examples. Each row gives the median
milliseconds per step, the median (min-max) per-repeat ratio to `gspmd`, and the
collectives of the compiled step (count and megabytes received per device).

`--gan`: the DCGAN of `examples/dcgan.py` (global view, dp): one discriminator
and one generator step on one state (`part=`) against two hand-written
`eqx.filter_jit` steps on the two halves.

    python benchmarks/bench_views.py [--quick] [--repeats 5] [--steps 10]
    python benchmarks/bench_views.py --strategies fsdp --views global \\
        --fsdp-layouts leading,largest --models "x @ W"
    python benchmarks/bench_views.py --gan

The script sets up 8 simulated CPU devices itself (before JAX starts).
"""

import argparse
import math
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
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _transformer import benchmark_model

ed.simulate_cpu_devices(8)  # before JAX starts its backend

IN_FLIGHT = 8
MIN_WEIGHT_SIZE = 2**10
OPTIMIZER = optax.adamw(1e-3)


class XwLinear(eqx.Module):
    """A linear layer written as many users write theirs: `x @ w + b`."""

    w: jax.Array
    b: jax.Array

    def __init__(self, width_in: int, width_out: int, key: Any) -> None:
        self.w = jax.random.normal(key, (width_in, width_out)) / math.sqrt(width_in)
        self.b = jnp.zeros(width_out)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w + self.b


class DeepMLP(eqx.Module):
    layers: tuple[Any, ...]
    head: Any

    def __init__(self, width: int, depth: int, key: Any, plain: bool) -> None:
        keys = jax.random.split(key, depth + 1)
        layer = XwLinear if plain else eqx.nn.Linear
        self.layers = tuple(layer(width, width, key=k) for k in keys[:-1])
        self.head = layer(width, 10, key=keys[-1])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = jax.nn.gelu(layer(x))
        return self.head(x)


def classification_loss(model: Any, batch: Any, key: Any) -> Any:
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


def lm_loss(model: Any, batch: Any, key: Any) -> Any:
    logits = jax.vmap(model)(batch["tokens"][:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["tokens"][:, 1:]
    )
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


def setups(quick: bool) -> dict[str, tuple[Callable[[], Any], Any, Any]]:
    """name: (model builder, batch, loss)."""
    rng = np.random.default_rng(0)
    width, depth, rows = (256, 4, 64) if quick else (1024, 8, 128)

    def mlp_batch(features: int) -> dict[str, np.ndarray]:
        return {
            "x": rng.normal(size=(rows, features)).astype(np.float32),
            "y": rng.integers(0, 10, rows).astype(np.int32),
        }

    lm = {"vocab": 256, "d_model": 128, "heads": 4, "layers": 2, "seq_len": 64}
    if quick:
        lm = {**lm, "d_model": 64, "seq_len": 32}
    tokens = rng.integers(0, lm["vocab"], (32, lm["seq_len"] + 1)).astype(np.int32)
    return {
        "deep (eqx.nn.Linear)": (
            lambda: DeepMLP(width, depth, jax.random.key(0), plain=False),
            mlp_batch(width),
            classification_loss,
        ),
        "deep (x @ W)": (
            lambda: DeepMLP(width, depth, jax.random.key(0), plain=True),
            mlp_batch(width),
            classification_loss,
        ),
        "classifier": (
            lambda: eqx.nn.MLP(784, 10, 512, 1, key=jax.random.key(0)),
            mlp_batch(784),
            classification_loss,
        ),
        "transformer": (
            lambda: benchmark_model(lm, jax.random.key(0)),
            {"tokens": tokens},
            lm_loss,
        ),
    }


def gspmd_step(step: ed.TrainStep, loss: Any, state: Any, batch: Any) -> Callable:
    """The hand-written step: `jax.jit` on global arrays placed as `step` places
    them (`place_state`), the same loss and optimizer, the state donated."""
    placed = step.place_state(state)
    params, static = eqx.partition(placed.model, eqx.is_inexact_array)

    def train(params: Any, opt_state: Any, batch: Any) -> Any:
        def value(p: Any) -> Any:
            return loss(eqx.combine(p, static), batch, None)

        (_, metrics), grads = jax.value_and_grad(value, has_aux=True)(params)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    shardings = jax.tree.map(lambda x: x.sharding, (params, placed.opt_state))
    jitted = jax.jit(train, out_shardings=(*shardings, None), donate_argnums=(0, 1))
    holder = {"params": params, "opt": placed.opt_state}
    data = ed.shard_batch(batch, ed.create_data_parallel_sharding(step.mesh))

    def run() -> Any:
        holder["params"], holder["opt"], metrics = jitted(
            holder["params"], holder["opt"], data
        )
        return metrics

    run.compiled = jitted.lower(holder["params"], holder["opt"], data).compile()  # type: ignore[attr-defined]
    return run


def eqxdist_step(step: ed.TrainStep, state: Any, batch: Any) -> Callable:
    holder = {"state": step.place_state(state)}
    data = ed.shard_batch(batch, step.layout.batch_sharding)

    def run() -> Any:
        holder["state"], metrics = step(holder["state"], data)
        return metrics

    run.compiled = step.lower(holder["state"], data).compile()  # type: ignore[attr-defined]
    return run


_OP = re.compile(
    r" = (.*?) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_SHAPE = re.compile(r"(f32|bf16|s32|u32|f16|pred|s8|u8)\[([\d,]*)\]")
_BYTES = {
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "bf16": 2,
    "f16": 2,
    "pred": 1,
    "s8": 1,
    "u8": 1,
}


def collectives(compiled: Any) -> tuple[int, float]:
    """The compiled step's collectives (`ed.count_collectives`, loops counted as
    they run), and the megabytes of their results per device, each op once: what
    a device receives, to the order of magnitude."""
    count = sum(ed.count_collectives(compiled).values())
    total = 0
    for match in _OP.finditer(compiled.as_text()):
        for dtype, dims in _SHAPE.findall(match.group(1)):
            total += math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
    return count, total / 2**20


def time_rows(runs: dict[str, Callable], repeats: int, steps: int) -> dict[str, Any]:
    """Median ms per step of each run, interleaved, the order rotating."""
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for run in runs.values():  # compile and warm up (twice: a first call's
        for _ in range(2):  # host inputs come back placed, which may recompile)
            jax.block_until_ready(run())
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            for i in range(steps):
                out = runs[name]()
                if (i + 1) % IN_FLIGHT == 0:
                    jax.block_until_ready(out)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return times


def run(
    quick: bool,
    repeats: int,
    steps: int,
    models: str = "",
    fsdp_layouts: tuple[Any, ...] = (None,),
    strategies: tuple[str, ...] = ("dp", "fsdp"),
    views: tuple[str, ...] = ("device", "global"),
) -> list[dict[str, Any]]:
    """Every model (those whose name contains `models`), each of `strategies`;
    under fsdp each of `fsdp_layouts` (`None`: the step's default placement),
    all of a model's variants timed side by side, each against the GSPMD step
    on the placement of its own layout and, where `"largest"` is among them,
    against the GSPMD step on `"largest"` (Equinox's own route: each weight
    split on its largest dimension, docs/benchmarks.md)."""
    mesh = ed.create_data_parallel_mesh()
    rows = []
    for name, (build, batch, loss) in setups(quick).items():
        if models not in name:
            continue
        for strategy in strategies:
            layouts = fsdp_layouts if strategy == "fsdp" else (None,)
            runs, base = {}, {}
            for fsdp_layout in layouts:
                options: dict[str, Any] = {"strategy": strategy}
                if strategy == "fsdp":
                    options["min_weight_size"] = MIN_WEIGHT_SIZE
                    if fsdp_layout is not None:
                        options["fsdp_layout"] = fsdp_layout
                tag = "" if len(layouts) == 1 else f":{fsdp_layout or 'default'}"
                for view in views:
                    step = ed.make_train_step(
                        loss, OPTIMIZER, mesh, view=view, **options
                    )
                    state = ed.TrainState.create(build(), OPTIMIZER, jax.random.key(1))
                    runs[view + tag] = eqxdist_step(step, state, batch)
                    base[view + tag] = "gspmd" + tag
                # The hand-written step on the last step's placement.
                runs["gspmd" + tag] = gspmd_step(step, loss, state, batch)
                base["gspmd" + tag] = "gspmd" + tag
            times = time_rows(runs, repeats, steps)
            for variant, ms in times.items():
                ref = times[base[variant]]
                ratios = [t / g for t, g in zip(ms, ref, strict=True)]
                eqx_ref = times.get("gspmd:largest")
                to_eqx = None
                if eqx_ref is not None:
                    to_eqx = statistics.median(
                        t / g for t, g in zip(ms, eqx_ref, strict=True)
                    )
                count, mb = collectives(runs[variant].compiled)  # type: ignore[attr-defined]
                rows.append(
                    {
                        "model": name,
                        "strategy": strategy,
                        "variant": variant,
                        "ms": statistics.median(ms),
                        "ratio": statistics.median(ratios),
                        "range": (min(ratios), max(ratios)),
                        "collectives": count,
                        "mb": mb,
                        "to_eqx": to_eqx,
                    }
                )
                print(_format(rows[-1]), flush=True)
    return rows


def _format(row: dict[str, Any]) -> str:
    low, high = row["range"]
    to_eqx = row.get("to_eqx")
    return (
        f"{row['model']:22s} {row['strategy']:5s} {row['variant']:15s} "
        f"{row['ms']:8.2f} ms  {row['ratio']:.3f} ({low:.2f}-{high:.2f}) x gspmd  "
        f"{row['collectives']:3d} collectives {row['mb']:7.2f} MB"
        + ("" if to_eqx is None else f"  {to_eqx:.3f} x gspmd:largest")
    )


def run_gan(repeats: int, steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import dcgan

    mesh = ed.create_data_parallel_mesh()
    args = argparse.Namespace(optimizer="adam", lr=2e-3)
    opts = dcgan.optimizers(args)
    images = dcgan.digits()[:64]
    batch = ed.shard_batch({"image": images}, ed.create_data_parallel_sharding(mesh))
    step_d = ed.make_train_step(dcgan.disc_loss, opts, mesh, part="disc", view="global")
    step_g = ed.make_train_step(dcgan.gen_loss, opts, mesh, part="gen", view="global")
    model, model_state = eqx.nn.make_with_state(dcgan.GAN)(jax.random.key(0))
    state = step_d.place_state(
        ed.TrainState.create(
            model, opts, jax.random.key(1), model_state=model_state, parts=dcgan.PARTS
        )
    )
    holder = {"state": state}

    def parts() -> Any:
        holder["state"], m = step_d(holder["state"], batch)
        holder["state"], m = step_g(holder["state"], batch)
        return m

    # Two hand-written steps: the model's arrays carried whole, each step
    # differentiating its part and donating the arrays it replaces.
    arrays, static = eqx.partition(model, eqx.is_array)
    replicated = NamedSharding(mesh, P())
    carry = {
        "arrays": jax.device_put(arrays, replicated),
        "opt": {
            name: opts[name].init(eqx.filter(where(model), eqx.is_inexact_array))
            for name, where in dcgan.PARTS.items()
        },
        "ms": model_state,
        "step": 0,
    }
    key = jax.random.key(1)

    def make(name: str, loss_fn: Any) -> Any:
        where = dcgan.PARTS[name]

        def step(arrays: Any, opt_state: Any, ms: Any, batch: Any, k: Any) -> Any:
            model = eqx.combine(arrays, static)
            part = eqx.filter(where(model), eqx.is_inexact_array)

            def value(p: Any) -> Any:
                trial = eqx.tree_at(where, model, eqx.combine(p, where(model)))
                out = loss_fn(trial, ms, batch, k)
                return out[0], out[2]

            grads, ms = jax.grad(value, has_aux=True)(part)
            updates, opt_state = opts[name].update(grads, opt_state, part)
            new = eqx.combine(eqx.apply_updates(part, updates), where(model))
            model = eqx.tree_at(where, model, new)
            return eqx.filter(model, eqx.is_array), opt_state, ms

        return jax.jit(step, donate_argnums=(0, 1, 2))

    hand = {"disc": make("disc", dcgan.disc_loss), "gen": make("gen", dcgan.gen_loss)}

    def two_steps() -> Any:
        for name in ("disc", "gen"):
            k = jax.random.fold_in(key, carry["step"])
            carry["arrays"], carry["opt"][name], carry["ms"] = hand[name](
                carry["arrays"], carry["opt"][name], carry["ms"], batch, k
            )
            carry["step"] += 1
        return carry["arrays"]

    times = time_rows({"parts": parts, "hand-written": two_steps}, repeats, steps)
    ratios = [a / b for a, b in zip(times["parts"], times["hand-written"], strict=True)]
    print(
        f"GAN (D + G per loop step): parts {statistics.median(times['parts']):.2f} ms, "
        f"two hand-written steps {statistics.median(times['hand-written']):.2f} ms: "
        f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models, seconds")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gan", action="store_true", help="the GAN comparison only")
    parser.add_argument(
        "--models", default="", help="only the models whose name contains this"
    )
    parser.add_argument(
        "--strategies", default="dp,fsdp", help="comma-separated (dp, fsdp)"
    )
    parser.add_argument(
        "--views", default="device,global", help="the eqxdist steps' views"
    )
    parser.add_argument(
        "--fsdp-layouts",
        default="",
        help="under fsdp, these placements side by side (comma-separated: "
        "'default', 'leading', 'largest'); default: the step's default only",
    )
    args = parser.parse_args()
    if args.gan:
        run_gan(args.repeats, args.steps)
    else:
        layouts = tuple(
            None if name == "default" else name
            for name in args.fsdp_layouts.split(",")
            if name
        )
        run(
            args.quick,
            args.repeats,
            args.steps,
            args.models,
            layouts or (None,),
            tuple(args.strategies.split(",")),
            tuple(args.views.split(",")),
        )


if __name__ == "__main__":
    main()
