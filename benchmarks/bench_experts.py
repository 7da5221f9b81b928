"""Expert parallelism against replicated experts, and a replicated MoE against
the dense MLP of its active FLOPs: step time (CPU time on 8 simulated devices),
expert bytes per device, the compiled step's temporaries per device, the
collectives of each compiled step, and the expert FLOPs each device executes
against the ideal.

A small mixture-of-experts model (an embedding, `--layers` residual `ed.MoE`
blocks, top-2, a head) on 8 simulated CPU devices, one process, at each
`--experts` count (default 8 and 32): `ed.Layout(mesh)` (data parallelism, every
device holding every expert: `replicated`) against `ed.Layout(mesh,
expert_axis="data")` with the all-gather dispatch (`expert_parallel`) and with
`MoE(dispatch="all_to_all")` (`expert_parallel_a2a`), and the same model with
each MoE replaced by a dense gated MLP `top_k x d_hidden` wide (`dense`, the MoE's
active FLOPs), data parallel. Also one block alone, forward and backward on
each device's tokens, no collective and no optimizer (`moe_layer` against
`dense_layer`): the grouped products against one dense product, without the
step's per-parameter work (the update and the gradients' all-reduce of `E /
top_k` times the dense MLP's parameters), which the `replicated / dense` step
ratio includes. And XLA's own batched product for the same work
(`batched_layer`): the same experts' products as one batched product
(`einsum`) over equal groups of `T k / E` of the device's rows, every expert
the same number, no router, no sort, no gather: the work the MoE block routes,
perfectly balanced and in one operation (at 8,192 tokens at or below the routed
block's time; with more tokens the tile loops beat it).

The all-to-all dispatch's rounds: after the timing, `--steps` more steps of
each all-to-all run with the tile loops reporting, and the rounds a layer took
on a device, averaged (one under balanced routing; a router in training may
send one destination more than a round holds). And a replicated step's
per-parameter work per layer for its experts, timed alone: the all-reduce of
the experts' gradients over the 8 devices, and that with AdamW's update of the
experts on every device (what the replicated step pays beyond the block's
products, for `E / top_k` times the dense MLP's parameters; expert parallelism
keeps each expert's gradient and update on its one device).

Timing is interleaved: every repeat times all seven for `--steps` steps (the
order alternating); the table gives median milliseconds per step and the
median of the per-repeat ratios of each pair with their spread. On CPU the
collectives are memory copies.

Expert FLOPs: `compiled.cost_analysis()` counts a loop body once, and the
experts run in loops over the active tiles (a traced count), so they are counted
as executed: each tile loop reports its trip count when it runs
(`eqxdist._experts.tiles.recording`), and tiles x tile rows x the products'
FLOPs per row (forward `3 x 2 d h`, backward `8 x 2 d h`: the two hidden
products recomputed) are summed over the step and divided by the 8 devices.
The ideal is a device's share of the assignments, `T k / 8`, times a dense
gated MLP's forward and backward FLOPs per row (`9 x 2 d h`).

    python benchmarks/bench_experts.py [--quick] [--repeats 5] [--steps 5]
        [--experts 8,32] [--tokens 8192] [--d-model 64] [--d-hidden 128]
        [--capacity-factor 1.25]

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
from eqxdist._experts.tiles import recording

ed.simulate_cpu_devices(8)  # before JAX starts its backend

LENGTH, TOP_K = 16, 2
# Goals of issue 46: expert parallelism / replicated, replicated MoE / dense.
GOAL_EP, GOAL_DENSE = 1.25, 1.3


class DenseMLP(eqx.Module):
    """The dense gated MLP of an MoE's active FLOPs: `width = top_k x d_hidden`
    hidden units (each token computes `top_k` experts of `d_hidden`)."""

    w_in: Any
    w_gate: Any
    w_out: Any

    def __init__(self, d_model: int, width: int, key: Any) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.w_in = jax.random.normal(k1, (d_model, width)) / d_model**0.5
        self.w_gate = jax.random.normal(k2, (d_model, width)) / d_model**0.5
        self.w_out = jax.random.normal(k3, (width, d_model)) / width**0.5

    def __call__(self, x: Any) -> Any:
        return (jax.nn.silu(x @ self.w_in) * (x @ self.w_gate)) @ self.w_out


class Batched(eqx.Module):
    """An MoE block's expert products with nothing around them: the rows (each
    token `top_k` times) cut into `E` equal groups, group e through expert e's
    gated MLP, all experts in one batched product; the copies of a token
    summed. The work a routed block does, perfectly balanced, in one
    operation: XLA's batched product for it, no routing to follow."""

    w_in: Any
    w_gate: Any
    w_out: Any

    def __init__(self, args: argparse.Namespace, experts: int, key: Any) -> None:
        d, h = args.d_model, args.d_hidden
        rows = args.tokens // len(jax.devices()) * TOP_K
        if rows % experts:
            raise ValueError(
                f"bench_experts: batched_layer cuts a device's {rows} rows "
                f"(--tokens {args.tokens} / {len(jax.devices())} devices x top-"
                f"{TOP_K}) into {experts} equal groups; choose --tokens so that "
                f"{experts} divides them."
            )
        k1, k2, k3 = jax.random.split(key, 3)
        self.w_in = jax.random.normal(k1, (experts, d, h)) / d**0.5
        self.w_gate = jax.random.normal(k2, (experts, d, h)) / d**0.5
        self.w_out = jax.random.normal(k3, (experts, h, d)) / h**0.5

    def __call__(self, x: Any) -> Any:
        groups = jnp.concatenate([x] * TOP_K).reshape(len(self.w_in), -1, x.shape[1])
        hidden = jax.nn.silu(jnp.einsum("gcd,gdh->gch", groups, self.w_in))
        hidden = hidden * jnp.einsum("gcd,gdh->gch", groups, self.w_gate)
        y = jnp.einsum("gch,ghd->gcd", hidden, self.w_out)
        return y.reshape(TOP_K, *x.shape).sum(0)


class Net(eqx.Module):
    embed: eqx.nn.Linear
    blocks: list[Any]
    head: eqx.nn.Linear

    def __init__(
        self, args: argparse.Namespace, experts: int, key: Any, kind: str
    ) -> None:
        keys = jax.random.split(key, args.layers + 2)
        d_model, d_hidden = args.d_model, args.d_hidden
        self.embed = eqx.nn.Linear(16, d_model, key=keys[0])
        if kind == "dense":
            self.blocks = [DenseMLP(d_model, TOP_K * d_hidden, k) for k in keys[2:]]
        else:
            self.blocks = [
                ed.MoE(
                    d_model,
                    d_hidden,
                    experts,
                    top_k=TOP_K,
                    key=k,
                    dispatch=kind,
                    capacity_factor=args.capacity_factor,
                )
                for k in keys[2:]
            ]
        self.head = eqx.nn.Linear(d_model, 4, key=keys[1])


def loss_fn(model: Net, batch: dict[str, Any], key: Any) -> Any:
    h = jax.vmap(model.embed)(batch["x"].reshape(-1, 16))  # every row's tokens
    balance = 0.0
    for block in model.blocks:
        if isinstance(block, ed.MoE):
            y, aux = block(h)
            balance = balance + aux["load_balance_loss"]
        else:
            y = block(h)
        h = h + y
    logits = jax.vmap(model.head)(h)
    labels = batch["y"].reshape(-1)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return ce + 0.01 * balance, {}


def _batch(tokens: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = tokens // LENGTH
    return {
        "x": rng.normal(size=(rows, LENGTH, 16)).astype(np.float32),
        "y": rng.integers(0, 4, (rows, LENGTH)).astype(np.int32),
    }


def _expert_bytes(state: ed.TrainState) -> int:
    leaves = [
        leaf
        for block in state.model.blocks
        if isinstance(block, ed.MoE)
        for leaf in (block.w_in, block.w_gate, block.w_out)
        if leaf is not None
    ]
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)


def _setup(
    layout: ed.Layout, args: argparse.Namespace, experts: int, kind: str
) -> dict[str, Any]:
    optimizer = optax.adamw(1e-3)
    model = Net(args, experts, jax.random.key(0), kind)
    batch = _batch(args.tokens, 0)

    def build() -> tuple[Any, Any]:
        step = ed.make_train_step(loss_fn, optimizer, layout)
        state = step.init_state(
            lambda k: ed.TrainState.create(model, optimizer, k), jax.random.key(1)
        )
        return step, state

    step, state = build()
    compiled = step.lower(state, batch).compile()
    counts = {k: n for k, n in ed.count_collectives(compiled).items() if n}
    temp = compiled.memory_analysis().temp_size_in_bytes
    flops, recorded, records = None, None, []
    if kind != "dense":
        # A second trace with the tile loops reporting their trip counts (the
        # program keeps reporting to `records` whenever it runs).
        with recording() as records:
            recorded, fresh = build()
            jax.block_until_ready(recorded(fresh, batch))
            jax.effects_barrier()
        flops = _executed_flops(records, args) / len(jax.devices())
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    return {"step": step, "state": state, "batch": batch, "counts": counts,
            "bytes": _expert_bytes(state), "flops": flops, "temp": temp,
            "recorded": recorded, "records": records}  # fmt: skip


def _rounds(run: dict[str, Any], args: argparse.Namespace) -> float:
    """The all-to-all rounds a layer took on a device, averaged over `--steps`
    steps from the timed state (a tile loop's forward runs once a round)."""
    records, state = run["records"], run["state"]
    before = len(records)
    for _ in range(args.steps):
        state, _ = run["recorded"](state, run["batch"])
        jax.block_until_ready(state)  # bounded steps in flight
    jax.effects_barrier()
    loops = sum(r["kind"] == "forward" for r in records[before:])
    return loops / (len(jax.devices()) * args.layers * args.steps)


def _executed_flops(records: list[dict[str, Any]], args: argparse.Namespace) -> float:
    """The expert FLOPs the tile loops ran: tiles x tile rows x the products'
    FLOPs per row (forward 3, backward 8 products of `2 d h`)."""
    per_row = {"forward": 3, "backward": 8}
    rows = sum(r["tiles"] * r["tile"] * per_row[r["kind"]] for r in records)
    return float(rows * 2 * args.d_model * args.d_hidden)


def _ideal_flops(args: argparse.Namespace) -> float:
    """A device's share of the assignments through a dense gated MLP's forward
    and backward (9 products of `2 d h` per row), every layer."""
    rows = args.tokens * TOP_K / len(jax.devices())
    return rows * 9 * 2 * args.d_model * args.d_hidden * args.layers


def _layer(args: argparse.Namespace, experts: int, kind: str) -> dict[str, Any]:
    """One block's forward and backward alone (`kind` "moe": an `ed.MoE`,
    "dense": the dense gated MLP of its active FLOPs, "batched": the experts'
    products over equal groups in one batched product) on each device's
    tokens, no collective and no optimizer: what the grouped products cost
    against one dense product, without the step's per-parameter work (the
    update and the gradients' all-reduce of `E / top_k` times the dense MLP's
    parameters)."""
    key = jax.random.key(2)
    if kind == "moe":
        block: Any = ed.MoE(args.d_model, args.d_hidden, experts, top_k=TOP_K, key=key)
    elif kind == "batched":
        block = Batched(args, experts, key)
    else:
        block = DenseMLP(args.d_model, TOP_K * args.d_hidden, key)
    params, static = eqx.partition(block, eqx.is_array)
    rng = np.random.default_rng(3)
    x, c = (rng.normal(size=(args.tokens, args.d_model)).astype(np.float32)
            for _ in range(2))  # fmt: skip

    def device(params: Any, x: Any, c: Any) -> Any:
        def loss(params: Any, x: Any) -> Any:
            y = eqx.combine(params, static)(x)
            return (y[0] if kind == "moe" else y) * c

        return jax.grad(lambda p, x: loss(p, x).sum(), argnums=(0, 1))(params, x)

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), params)
    fn = jax.jit(jax.shard_map(
        device, mesh=mesh, in_specs=(specs, split.spec, split.spec),
        out_specs=(specs, split.spec), check_vma=False,
    ))  # fmt: skip
    inputs = (jax.device_put(x, split), jax.device_put(c, split))
    compiled = fn.lower(params, *inputs).compile()  # compiled once: timed, sized
    jax.block_until_ready(compiled(params, *inputs))
    return {"step": lambda p, batch: (p, compiled(p, *batch)), "state": params,
            "batch": inputs, "counts": {}, "bytes": 0, "flops": None,
            "temp": compiled.memory_analysis().temp_size_in_bytes}  # fmt: skip


def _per_parameter_ms(args: argparse.Namespace, experts: int) -> tuple[float, float]:
    """Milliseconds of what a replicated step does per layer for its experts'
    parameters beyond the block's products, timed alone on the 8 devices
    (the median of 5 `_time`s): the all-reduce of the experts' gradients
    (`psum`), and that with the optimizer's update of the experts (`adamw`,
    every device the whole layer's experts, as replicated data parallelism
    runs it)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    split, whole = jax.sharding.PartitionSpec("data"), jax.sharding.PartitionSpec()
    d, h = args.d_model, args.d_hidden
    shapes = ((experts, d, h), (experts, d, h), (experts, h, d))
    optimizer = optax.adamw(1e-3)
    # On the devices before the timing (not copied in each call): each
    # device's gradients, and the replicated experts and optimizer state.
    on = jax.sharding.NamedSharding
    grads = tuple(
        jax.device_put(np.ones((8 * a, b, c), np.float32), on(mesh, split))
        for a, b, c in shapes
    )
    params = tuple(
        jax.device_put(np.ones(shape, np.float32), on(mesh, whole)) for shape in shapes
    )
    opt_state = jax.jit(optimizer.init)(params)

    def reduced(*g: Any) -> Any:
        return tuple(jax.lax.psum(w, "data") for w in g)

    def updated(g: Any, params: Any, opt_state: Any) -> Any:
        updates, opt_state = optimizer.update(reduced(*g), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    specs = jax.tree.map(lambda _: whole, (params, opt_state))
    reduce_fn = jax.jit(jax.shard_map(
        reduced, mesh=mesh, in_specs=(split,) * 3, out_specs=(whole,) * 3,
        check_vma=False,
    ))  # fmt: skip
    # The experts and their state donated and carried from call to call, as a
    # train step's are.
    update_fn = jax.jit(jax.shard_map(
        updated, mesh=mesh, in_specs=((split,) * 3, *specs), out_specs=specs,
        check_vma=False,
    ), donate_argnums=(1, 2))  # fmt: skip
    runs = (
        {"step": lambda state, g: (state, reduce_fn(*g)), "state": None,
         "batch": grads},
        {"step": lambda state, g: (update_fn(g, *state), None),
         "state": (params, opt_state), "batch": grads},
    )  # fmt: skip
    for timed in runs:
        _time(timed, 1)  # compiled and run once before the timing
    reduce_ms, update_ms = (
        statistics.median(_time(timed, args.steps) for _ in range(5)) for timed in runs
    )
    return reduce_ms, update_ms


def _time(run: dict[str, Any], steps: int) -> float:
    state = run["state"]
    start = time.perf_counter()
    for _ in range(steps):
        state, out = run["step"](state, run["batch"])
    jax.block_until_ready((state, out))
    run["state"] = state
    return (time.perf_counter() - start) / steps * 1e3


PAIRS = (
    ("expert_parallel", "replicated"),
    ("expert_parallel_a2a", "replicated"),
    ("replicated", "dense"),
    ("moe_layer", "dense_layer"),
    ("batched_layer", "dense_layer"),
)


def run(args: argparse.Namespace, experts: int) -> dict[str, Any]:
    mesh = ed.create_device_mesh({"data": 8})
    split = ed.Layout(mesh, expert_axis="data")
    runs = {
        "replicated": _setup(ed.Layout(mesh), args, experts, "all_gather"),
        "expert_parallel": _setup(split, args, experts, "all_gather"),
        "expert_parallel_a2a": _setup(split, args, experts, "all_to_all"),
        "dense": _setup(ed.Layout(mesh), args, experts, "dense"),
        "moe_layer": _layer(args, experts, "moe"),
        "dense_layer": _layer(args, experts, "dense"),
        "batched_layer": _layer(args, experts, "batched"),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    ratios: dict[tuple[str, str], list[float]] = {pair: [] for pair in PAIRS}
    for r in range(args.repeats):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:
            times[name].append(_time(runs[name], args.steps))
        for a, b in PAIRS:
            ratios[a, b].append(times[a][-1] / times[b][-1])
    rounds = _rounds(runs["expert_parallel_a2a"], args)
    per_parameter = _per_parameter_ms(args, experts)
    return {
        name: {
            "ms": statistics.median(times[name]),
            "bytes": runs[name]["bytes"],
            "collectives": runs[name]["counts"],
            "flops": runs[name]["flops"],
            "temp": runs[name]["temp"],
        }
        for name in runs
    } | {
        "ratios": {
            pair: (statistics.median(r), min(r), max(r)) for pair, r in ratios.items()
        },
        "ideal_flops": _ideal_flops(args),
        "a2a_rounds": rounds,
        "per_parameter_ms": per_parameter,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny, seconds")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--experts", default="8,32")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--d-hidden", type=int, default=128)
    parser.add_argument(
        "--capacity-factor", type=float, default=None,
        help="every MoE's capacity_factor (default: dropless)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.experts = 1, 1, "8"
        args.layers, args.tokens = 1, 512
    print(
        f"{args.layers} MoE layers, top-{TOP_K}, d_model {args.d_model}, d_hidden "
        f"{args.d_hidden}, {args.tokens} tokens per step, 8 CPU devices; dense: a "
        f"gated MLP {TOP_K} x {args.d_hidden} wide; capacity factor "
        f"{args.capacity_factor}"
    )
    for experts in (int(e) for e in args.experts.split(",")):
        out = run(args, experts)
        print(f"\n{experts} experts")
        print(
            f"{'layout':<20} {'ms/step':>8} {'expert bytes/dev':>17} "
            f"{'expert FLOPs/dev / ideal':>25} {'temp bytes/dev':>15}  collectives"
        )
        for name in out:
            if name in ("ratios", "ideal_flops", "a2a_rounds", "per_parameter_ms"):
                continue
            row = out[name]
            work = (
                ""
                if row["flops"] is None
                else f"{row['flops'] / out['ideal_flops']:.2f}"
            )
            print(
                f"{name:<20} {row['ms']:>8.2f} {row['bytes']:>17,} {work:>25} "
                f"{row['temp']:>15,}  {row['collectives']}"
            )
        for (a, b), (median, low, high) in out["ratios"].items():
            goal = GOAL_EP if b == "replicated" else GOAL_DENSE
            what = "no router" if a == "batched_layer" else f"goal at most {goal}x"
            print(f"{a} / {b}: {median:.2f}x ({low:.2f}-{high:.2f}; {what})")
        print(
            f"all-to-all rounds per layer per device ({args.steps} steps after "
            f"the timing): {out['a2a_rounds']:.2f}"
        )
        reduce_ms, update_ms = out["per_parameter_ms"]
        print(
            f"a replicated step's per-parameter work per layer for its experts, "
            f"alone: all-reduce of the gradients {reduce_ms:.2f} ms, with the "
            f"update {update_ms:.2f} ms"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
