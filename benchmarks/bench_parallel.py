"""Parallel layouts of a transformer training step: eqxdist against hand-written jit.

The decoder-only transformer of `examples/transformer_lm.py`
(`examples/_transformer.py`), trained with adamw on a batch of random tokens, on 8
simulated CPU devices under four layouts:

- `dp`: `{"data": 8}`, everything replicated;
- `fsdp`: `{"data": 8}`, parameters and optimizer state sharded 8 ways;
- `fsdp x tp`: `{"data": 4, "model": 2}`, FSDP over "data" plus the Megatron
  tensor-parallel rules over "model";
- `hsdp`: `{"replica": 2, "data": 4}`, sharded 4 ways within each replica group,
  replicated across the 2 groups (`data_axis=("replica", "data")`).

Each layout runs two ways, side by side in this process:

- `eqxdist`: `ed.make_train_step(...)` (a `jax.jit` of a `shard_map` manual over the
  data axes, rule axes left to XLA);
- `hand-written`: `jax.jit` of `jax.value_and_grad` on global arrays plus the optax
  update, with explicit `in_shardings`/`out_shardings` (`NamedSharding`s of the same
  `PartitionSpec`s, taken from `step.state_specs`) and the same donation: the step
  a user writes for XLA's partitioner, and the reference of the ratios;
- `gspmd` (dp and fsdp only): Equinox's own route, `eqx.filter_jit` on global
  arrays with the parameters placed by `eqx.filter_shard` (replicated, or split over
  "data" on their largest divisible dimension, not eqxdist's specs) and the
  optimizer state placed like them (`optax.tree_map_params`).

Timing is interleaved: every repeat times each variant for `--steps` steps, the
variants of a layout back to back (their order rotating), blocking every 8 steps;
the table gives the median milliseconds per step, and the median (and min-max) of
the per-repeat ratios eqxdist / hand-written.
Memory and communication are read off the compiled steps (deterministic):
per-device train-state bytes as the layout predicts them (each leaf's bytes over
the product of the mesh axes its spec names) and as placed (the shards on device
0), `memory_analysis()` of both compiled steps (arguments + outputs - aliased +
temporaries: the peak), and the collectives in the compiled HLO (count and result
bytes per kind).

    python benchmarks/bench_parallel.py [--quick] [--repeats 9] [--steps 8]

The script sets up 8 simulated CPU devices itself (before JAX starts). `run()`
returns the rows for other scripts.
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
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _transformer import MEGATRON_RULES, TransformerLM, benchmark_model

ed.simulate_cpu_devices(8)  # before JAX starts its backend

IN_FLIGHT = 8
HAND = {False: "hand-written", True: "hand-written, gathered"}
GSPMD = "gspmd"
# The layouts Equinox's own route has a plain counterpart for: parameters
# replicated, or each split on its largest divisible dimension.
GSPMD_LAYOUTS = ("dp", "fsdp")
MIN_WEIGHT_SIZE = 2**10
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp": {"mesh": {"data": 8}, "strategy": "dp"},
    "fsdp": {"mesh": {"data": 8}, "strategy": "fsdp"},
    "fsdp x tp": {
        "mesh": {"data": 4, "model": 2},
        "strategy": "fsdp",
        "param_rules": MEGATRON_RULES,
    },
    "hsdp": {
        "mesh": {"replica": 2, "data": 4},
        "strategy": "fsdp",
        "data_axis": ("replica", "data"),
    },
}
DEFAULT_CONFIG = {
    "vocab": 72,
    "d_model": 128,
    "heads": 4,
    "layers": 2,
    "seq_len": 64,
    "batch": 32,
}
COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "f64": 8}


def loss_fn(model: TransformerLM, batch: dict[str, jax.Array], key: Any) -> Any:
    del key
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return losses.mean(), {"loss": (losses.sum(), losses.size)}


def _setup(config: dict[str, Any]) -> dict[str, Any]:
    model = benchmark_model(config, jax.random.key(0))
    tokens = jax.random.randint(
        jax.random.key(1), (config["batch"], config["seq_len"] + 1), 0, config["vocab"]
    )
    return {"model": model, "batch": {"tokens": np.asarray(tokens)}}


# -- the variants: each gives `step() -> token` and its compiled executable ---------


def _eqxdist(setup: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    mesh = ed.create_device_mesh(layout["mesh"])
    optimizer = optax.adamw(1e-3)
    step = ed.make_train_step(
        loss_fn,
        optimizer,
        mesh,
        strategy=layout["strategy"],
        data_axis=layout.get("data_axis", "data"),
        param_rules=layout.get("param_rules", ()),
        min_weight_size=MIN_WEIGHT_SIZE,
    )
    state = ed.TrainState.create(setup["model"], optimizer, jax.random.key(2))
    state = step.place_state(state)
    batch = setup["batch"]
    compiled = step.lower(state, batch).compile()
    holder = {"state": state}

    def run() -> Any:
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"][0]

    return {
        "run": run,
        "compiled": compiled,
        "specs": step.state_specs(state),
        "state": lambda: holder["state"],
        "mesh": mesh,
    }


def _without(spec: P, axes: tuple[str, ...]) -> P:
    """`spec` with the mesh axes in `axes` dropped (replicated over them)."""
    out = []
    for entry in spec:
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(n for n in names if n not in axes)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    return P(*out)


def _hand_written(
    setup: dict[str, Any], layout: dict[str, Any], specs: Any, *, gather: bool
) -> dict[str, Any]:
    """`jax.jit` with explicit shardings; XLA partitions the global computation.
    With `gather`, the parameters are constrained to their layout without the data
    axes before the loss (`with_sharding_constraint`): the usual way to ask XLA
    for FSDP's all-gather of weights instead of resharding activations."""
    mesh = ed.create_device_mesh(layout["mesh"])
    optimizer = optax.adamw(1e-3)
    data_axis = layout.get("data_axis", "data")
    data_axes = data_axis if isinstance(data_axis, tuple) else (data_axis,)

    def sharding(tree: Any) -> Any:
        return jax.tree.map(
            lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda x: isinstance(x, P)
        )

    state_shardings = (sharding(specs.model), sharding(specs.opt_state))
    batch_sharding = {"tokens": NamedSharding(mesh, P(data_axis))}
    replicated = NamedSharding(mesh, P())
    gathered = sharding(
        jax.tree.map(
            lambda s: _without(s, data_axes),
            specs.model,
            is_leaf=lambda x: isinstance(x, P),
        )
    )

    def loss_of(model: Any, batch: Any) -> Any:
        if gather:
            model = jax.lax.with_sharding_constraint(model, gathered)
        return loss_fn(model, batch, None)

    def train_step(model: Any, opt_state: Any, batch: Any) -> Any:
        (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(model, batch)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, metrics

    jitted = jax.jit(
        train_step,
        in_shardings=(*state_shardings, batch_sharding),
        out_shardings=(*state_shardings, replicated),
        donate_argnums=(0, 1),
    )
    # From host copies: a replicated `device_put` of a device array may reuse its
    # buffer as device 0's shard (even with may_alias=False), and donation would
    # then delete the model every variant starts from.
    host_model = jax.tree.map(np.asarray, setup["model"])
    model = jax.device_put(host_model, state_shardings[0])
    opt_state = jax.device_put(optimizer.init(host_model), state_shardings[1])
    batch = jax.device_put(setup["batch"], batch_sharding)
    compiled = jitted.lower(model, opt_state, batch).compile()
    holder = {"model": model, "opt_state": opt_state}

    def run() -> Any:
        holder["model"], holder["opt_state"], metrics = compiled(
            holder["model"], holder["opt_state"], batch
        )
        return metrics["loss"][0]

    return {"run": run, "compiled": compiled}


def _largest_dim_spec(x: Any, size: int) -> P:
    if x.size < MIN_WEIGHT_SIZE:
        return P()
    for dim in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
        if x.shape[dim] % size == 0:
            return P(*([None] * dim), "data")
    return P()


def _gspmd(setup: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    """Equinox's own route: `eqx.filter_jit` on global arrays, parameters placed by
    `eqx.filter_shard` (replicated under dp; under fsdp each split over "data" on
    its largest divisible dimension), the optimizer state placed like its
    parameters (`optax.tree_map_params`); no `shard_map`, XLA's GSPMD partitions."""
    mesh = ed.create_device_mesh(layout["mesh"])
    optimizer = optax.adamw(1e-3)
    fsdp = layout["strategy"] == "fsdp"
    host, static = eqx.partition(jax.tree.map(np.asarray, setup["model"]), eqx.is_array)
    params_sh = jax.tree.map(
        lambda x: NamedSharding(mesh, _largest_dim_spec(x, 8) if fsdp else P()), host
    )
    opt_sh = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        optimizer.init(host),
        params_sh,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )

    @eqx.filter_jit(donate="all-except-first")
    def train_step(batch: Any, params: Any, opt_state: Any) -> Any:
        def loss(p: Any) -> Any:
            return loss_fn(eqx.combine(p, static), batch, None)

        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = eqx.filter_shard(eqx.apply_updates(params, updates), params_sh)
        return params, eqx.filter_shard(opt_state, opt_sh), metrics

    params = eqx.filter_shard(host, params_sh)
    opt_state = eqx.filter_shard(optimizer.init(params), opt_sh)
    batch = jax.device_put(setup["batch"], NamedSharding(mesh, P("data")))
    # `.compiled`: the `jax.stages.Compiled` inside Equinox's wrapper.
    compiled = train_step.lower(batch, params, opt_state).compile().compiled
    holder = {"params": params, "opt_state": opt_state}

    def run() -> Any:
        holder["params"], holder["opt_state"], metrics = train_step(
            batch, holder["params"], holder["opt_state"]
        )
        return metrics["loss"][0]

    return {"run": run, "compiled": compiled}


# -- what the compiled steps hold and move --------------------------------------------


def predicted_state_bytes(state: ed.TrainState, specs: Any, mesh: Any) -> int:
    """Per-device bytes of parameters + optimizer state as the layout says: each
    leaf's bytes over the number of devices its spec splits it over."""
    total = 0
    for leaf, spec in zip(
        jax.tree.leaves((state.model, state.opt_state)),
        jax.tree.leaves(
            (specs.model, specs.opt_state), is_leaf=lambda x: isinstance(x, P)
        ),
        strict=True,
    ):
        names = [n for e in spec for n in ((e,) if isinstance(e, str) else e or ())]
        total += leaf.nbytes // math.prod(mesh.shape[n] for n in names)
    return total


def placed_state_bytes(state: ed.TrainState) -> int:
    """Bytes of parameters + optimizer state that device 0 actually holds."""
    device = jax.devices()[0]
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves((state.model, state.opt_state))
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def peak_bytes(compiled: Any) -> int:
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
        size = math.prod(int(d) for d in dims.split(",") if d)
        total += BYTES.get(dtype, 4) * size
    return total


def collectives(compiled: Any) -> dict[str, tuple[int, int]]:
    """`{kind: (count, result bytes)}` of the collectives in the compiled HLO (an
    async pair counts once)."""
    out: dict[str, tuple[int, int]] = {}
    for line in compiled.as_text().splitlines():
        match = re.match(r"\s*(?:ROOT )?%?\S+ = (.+?) ([a-z-]+)\(", line)
        if not match:
            continue
        result, op = match.groups()
        kind = op.removesuffix("-start")
        if kind in COLLECTIVES and not op.endswith("-done"):
            count, nbytes = out.get(kind, (0, 0))
            out[kind] = (count + 1, nbytes + _shape_bytes(result))
    return out


def _format_collectives(found: dict[str, tuple[int, int]]) -> str:
    if not found:
        return "none"
    return ", ".join(
        f"{count} {kind} ({nbytes / 1024:.0f} KiB)"
        for kind, (count, nbytes) in sorted(found.items())
    )


# -- timing ---------------------------------------------------------------------------


def _time(run: Callable[[], Any], steps: int) -> float:
    """Seconds per step over `steps` steps, at most `IN_FLIGHT` in flight."""
    start = time.perf_counter()
    pending = []
    for _ in range(steps):
        pending.append(run())
        if len(pending) >= IN_FLIGHT:
            pending.pop(0).block_until_ready()
    for token in pending:
        token.block_until_ready()
    return (time.perf_counter() - start) / steps


def run(
    *, repeats: int = 9, steps: int = 8, config: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """One row per layout: timings, ratios, memory and collectives."""
    setup = _setup(config or DEFAULT_CONFIG)
    variants: dict[tuple[str, str], dict[str, Any]] = {}
    for name, layout in LAYOUTS.items():
        ours = _eqxdist(setup, layout)
        variants[(name, "eqxdist")] = ours
        for gather in (False, True):
            variants[(name, HAND[gather])] = _hand_written(
                setup, layout, ours["specs"], gather=gather
            )
        if name in GSPMD_LAYOUTS:
            variants[(name, GSPMD)] = _gspmd(setup, layout)
    for variant in variants.values():  # warm up: first dispatches, caches
        _time(variant["run"], 2)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in variants}
    labels = ["eqxdist", *HAND.values(), GSPMD]
    for r in range(repeats):
        # The variants of one layout run back to back (order rotating), so that
        # each ratio compares timings taken moments apart on a shared machine.
        rotated = labels[r % len(labels) :] + labels[: r % len(labels)]
        for name in LAYOUTS:
            for label in rotated:
                if (name, label) not in variants:
                    continue
                times[(name, label)].append(
                    _time(variants[(name, label)]["run"], steps)
                )
    rows = []
    for name in LAYOUTS:
        ours = variants[(name, "eqxdist")]
        state = ours["state"]()
        row: dict[str, Any] = {
            "layout": name,
            "mesh": dict(LAYOUTS[name]["mesh"]),
            "ms_eqxdist": 1e3 * statistics.median(times[(name, "eqxdist")]),
            "state_bytes_predicted": predicted_state_bytes(
                state, ours["specs"], ours["mesh"]
            ),
            "state_bytes_placed": placed_state_bytes(state),
            "peak_eqxdist": peak_bytes(ours["compiled"]),
            "collectives_eqxdist": collectives(ours["compiled"]),
        }
        for key, label in (
            ("hand", HAND[False]),
            ("hand_gathered", HAND[True]),
            ("gspmd", GSPMD),
        ):
            if (name, label) not in variants:
                continue
            hand = variants[(name, label)]
            ratios = [
                a / b
                for a, b in zip(
                    times[(name, "eqxdist")], times[(name, label)], strict=True
                )
            ]
            row[f"ms_{key}"] = 1e3 * statistics.median(times[(name, label)])
            row[f"ratio_{key}"] = statistics.median(ratios)
            row[f"spread_{key}"] = (min(ratios), max(ratios))
            row[f"peak_{key}"] = peak_bytes(hand["compiled"])
            row[f"collectives_{key}"] = collectives(hand["compiled"])
        rows.append(row)
    return rows


KEYS = ("hand", "hand_gathered", "gspmd")


def _cell(r: dict[str, Any], k: str) -> str:
    if f"ms_{k}" not in r:
        return "-"
    low, high = r[f"spread_{k}"]
    return f"{r[f'ms_{k}']:.1f} ({r[f'ratio_{k}']:.3f}x, {low:.2f}-{high:.2f})"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| layout | mesh | eqxdist ms/step | hand-written ms/step (eqxdist ratio, "
        "min-max) | hand-written, gathered | gspmd (eqx.filter_jit) |\n"
        "|---|---|---|---|---|---|"
    )
    for r in rows:
        mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
        cells = [_cell(r, k) for k in KEYS]
        print(
            f"| {r['layout']} | {mesh} | {r['ms_eqxdist']:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    print(
        "\n| layout | state B/device predicted / placed | peak B/device eqxdist "
        "| hand-written | hand-written, gathered | gspmd |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        peaks = [f"{r[f'peak_{k}']:,}" if f"peak_{k}" in r else "-" for k in KEYS]
        print(
            f"| {r['layout']} | {r['state_bytes_predicted']:,} / "
            f"{r['state_bytes_placed']:,} | {r['peak_eqxdist']:,} | "
            + " | ".join(peaks)
            + " |"
        )
    print(
        "\nCollectives in the compiled step: count and result bytes per device.\n"
        "\n| layout | collectives eqxdist | hand-written | hand-written, gathered "
        "| gspmd |\n|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['layout']} | "
            + " | ".join(
                _format_collectives(r[f"collectives_{k}"])
                if f"collectives_{k}" in r
                else "-"
                for k in ("eqxdist", *KEYS)
            )
            + " |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats")
    parser.add_argument("--steps", type=int, default=8, help="steps per repeat")
    parser.add_argument(
        "--quick", action="store_true", help="3 repeats of 8 steps (a smoke run)"
    )
    args = parser.parse_args()
    repeats, steps = (3, 8) if args.quick else (args.repeats, args.steps)
    print(
        f"transformer step, 8 simulated CPU devices, {jax.__version__=}, "
        f"{repeats} repeats x {steps} steps, interleaved\n"
    )
    rows = run(repeats=repeats, steps=steps)
    print_table(rows)
    # Against the fastest baseline of each layout (the ratio eqxdist / it).
    worst = max(max(r[f"ratio_{k}"] for k in KEYS if f"ratio_{k}" in r) for r in rows)
    exact = all(r["state_bytes_predicted"] == r["state_bytes_placed"] for r in rows)
    print(
        f"\nworst median ratio against the fastest baseline {worst:.3f}x "
        f"(goal <= 1.05x); state bytes as the "
        f"layout predicts: {'yes' if exact else 'NO'}"
    )


if __name__ == "__main__":
    main()
