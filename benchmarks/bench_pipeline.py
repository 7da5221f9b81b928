"""Pipeline parallelism against FSDP and FSDP x TP on a deep model: speed,
memory, the bubble, and what each schedule and remat policy keeps.

On 8 simulated CPU devices, one process, two models of `--layers` blocks (16) in
an `ed.Stacked`, trained with adamw:

- `transformer`: the transformer of the examples (`examples/_transformer.py`,
  `stacked=True`): d_model 64, 4 heads, 32 positions, a vocabulary of 64; 32
  sequences a step;
- `x @ W`: residual MLP blocks written with plain arrays (`x + gelu(x @ w1 + b1)
  @ w2 + b2`, width 128, hidden 256) on 256 rows a step (`--xw-rows`): a model written
  another way than the examples'.

Four sections, each model:

1. `layout`: a train step under FSDP over `{"data": 8}`, FSDP x TP over
   `{"data": 4, "model": 2}` (Megatron rules; for `x @ W` `w1` by columns,
   `w2` by rows) and pipeline stages x FSDP over the data axis (`{"stage": 2,
   "data": 4}`, `{"stage": 4, "data": 2}`; GPipe and 1F1B with M = 2P
   microbatches, circular and interleaved 1F1B with R = 2, ZB-H1). Steps/s,
   the ratio to FSDP, and the per-device peak bytes of the compiled step
   (`memory_analysis()`: arguments + outputs - aliased + temporaries) and its
   temporaries (the schedules side by
   side at the same M = 8).
2. `bubble`: `{"stage": 4, "data": 2}` for each schedule at growing M, against
   the same block work without a bubble: the pipeline on `{"stage": 1, "data":
   8}` (one stage, one microbatch; each device runs B/8 rows through all L
   blocks, as each device of P = 4 runs B/2 rows through L/4). The measured
   bubble is 1 - t_ref / t(M), beside the schedule's table's idle fraction
   (`Pipeline.idle_fraction`, the table run in lockstep: (P - 1)/(R M + P - 1)
   for GPipe and the circular schedule, 2 (P - 1)/(3 R M + 2 (P - 1)) for 1F1B
   and interleaved 1F1B, (P - 1)/(3 M + P - 1) for ZB-H1). It is what the
   pipeline costs over that reference: the bubble (GPipe and the circular
   schedule compute on every iteration of their loop, on garbage in the bubble,
   so on CPU devices the bubble is compute, not idle time), smaller
   microbatches, the loop's per-iteration work (`ppermute`, buffers) and the
   all-reduce of the last stage's output. 1F1B idles in its bubble slots
   (`lax.switch`), which on 8 simulated devices sharing the host's cores frees
   the cores for the busy stages: its bubble shows less here than on real
   devices; it also recomputes each stage's forward pass in its backward pass
   (twice, as ZB-H1 does: in B and in W), and its compiled loop runs each row
   of its table in lockstep, as long as the row's longest entry (which the
   table's figure counts).
   The compiled temporaries per device of each schedule and M come with it.
   GPipe's times are fitted by least squares to t(M) = a + b / M + c M: b / M
   is the bubble's work (b = (P - 1) x the stage's work per step), c the cost
   of each microbatch's iteration beyond its share of the work; the step is
   fastest at M = sqrt(b / c).
3. `remat`: the compiled temporaries of each remat policy (`none`, `full`,
   `dots`, `offload`: on CPU, where device memory is host memory, `offload`
   keeps what `full` keeps) under GPipe and 1F1B, P = 4, M = 8.
4. `work` (the `x @ W` model; the transformer's loss, which slices each row's
   tokens, is refused by the written-out schedules' loss analysis): what the
   written-out schedules buy: data parallelism over `{"data":
   8}` and each schedule on `{"stage": 4, "data": 2}` at M = 8 (no FSDP), for
   the same model and rows: ms/step against GPipe and against data
   parallelism, and `model_flops` against data parallelism's; the compiled
   temporaries of GPipe, 1F1B and ZB-H1 at M = 4P = 16; and what each entry
   kind computes (XLA's FLOPs of each pass compiled on its own, in units of F:
   `eqxdist._layout.pipeline.stage_passes.pass_flops`). On CPU devices sharing cores
   the step time is all the devices' work together, so it shows recompute and
   per-slot overhead, not bubbles.
5. `messages`: what one slot's messages cost on these devices, a loop of 54
   slots each sending a 16 x 128 block to the next stage and one back: two
   `ppermute`s, one, and one `all_to_all` carrying both ways (what the
   pipeline's `messages.exchange` sends on XLA:CPU).

Times are medians of `--repeats` interleaved repeats (the order rotating) of
`--steps` steps each; the memory figures are deterministic. Compiled programs
are shared between the step and `memory_analysis()` through a temporary JAX
compilation cache.

    python benchmarks/bench_pipeline.py [--quick] [--repeats 3] [--steps 2]
        [--only layout|bubble|remat|work|messages]

The script sets up 8 simulated CPU devices itself (before JAX starts).
"""

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import eqxdist as ed
from eqxdist._layout.pipeline import messages
from eqxdist._layout.pipeline.stage_passes import pass_flops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _transformer import STACKED_MEGATRON_RULES, benchmark_model

ed.simulate_cpu_devices(8)  # before JAX starts its backend

OPTIMIZER = optax.adamw(1e-3)
MIN_WEIGHT_SIZE = 2**10
MiB = 2**20


# --- the models --------------------------------------------------------------


class XwBlock(eqx.Module):
    """A residual MLP block of plain arrays: `x + gelu(x @ w1 + b1) @ w2 + b2`."""

    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array

    def __init__(self, width: int, hidden: int, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (width, hidden)) / math.sqrt(width)
        self.b1 = jnp.zeros(hidden)
        self.w2 = jax.random.normal(k2, (hidden, width)) / math.sqrt(hidden)
        self.b2 = jnp.zeros(width)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jax.nn.gelu(x @ self.w1 + self.b1) @ self.w2 + self.b2


class XwNet(eqx.Module):
    w_in: jax.Array
    blocks: ed.Stacked
    w_out: jax.Array

    def __init__(self, layers: int, key: jax.Array) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.w_in = jax.random.normal(k1, (32, 128)) / math.sqrt(32)
        keys = jax.random.split(k2, layers)
        self.blocks = ed.Stacked([XwBlock(128, 256, k) for k in keys])
        self.w_out = jax.random.normal(k3, (128, 10)) / math.sqrt(128)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.blocks(x @ self.w_in) @ self.w_out


XW_RULES = (
    (r"\.w1$", P(None, None, "model")),
    (r"\.b1$", P(None, "model")),
    (r"\.w2$", P(None, "model", None)),
)


def lm_loss(model: Any, batch: Any, key: Any) -> Any:
    logits = jax.vmap(model)(batch["tokens"][:, :-1])
    targets = batch["tokens"][:, 1:]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


def xw_loss(model: Any, batch: Any, key: Any) -> Any:
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


class Model(NamedTuple):
    name: str
    build: Callable[[], Any]
    loss: Callable[..., Any]
    batch: dict[str, np.ndarray]
    rules: tuple[tuple[str, P], ...]


def models(layers: int, xw_rows: int = 256) -> list[Model]:
    rng = np.random.default_rng(0)
    config = {"vocab": 64, "d_model": 64, "heads": 4, "layers": layers, "seq_len": 32}
    tokens = rng.integers(0, 64, (32, 33)).astype(np.int32)
    rows = {
        "x": rng.normal(size=(xw_rows, 32)).astype(np.float32),
        "y": rng.integers(0, 10, xw_rows).astype(np.int32),
    }
    return [
        Model(
            "transformer",
            lambda: benchmark_model(config, jax.random.key(0), stacked=True),
            lm_loss,
            {"tokens": tokens},
            STACKED_MEGATRON_RULES,
        ),
        Model(
            "x @ W", lambda: XwNet(layers, jax.random.key(0)), xw_loss, rows, XW_RULES
        ),
    ]


# --- one compiled step --------------------------------------------------------


class Case(NamedTuple):
    name: str
    axes: dict[str, int]
    options: dict[str, Any]


def fsdp(axes: dict[str, int], name: str, **options: Any) -> Case:
    return Case(
        name, axes, {"strategy": "fsdp", "min_weight_size": MIN_WEIGHT_SIZE, **options}
    )


def staged(stages: int, micro: int, schedule: str, **options: Any) -> Case:
    repeats = 2 if schedule in ("circular", "interleaved") else 1
    pipeline = ed.Pipeline("stage", micro, schedule=schedule, repeats=repeats)
    r = f" R={repeats}" if repeats > 1 else ""
    name = f"stage {stages} x data {8 // stages}, {schedule}{r} M={micro}"
    return fsdp(
        {"stage": stages, "data": 8 // stages}, name, pipeline=pipeline, **options
    )


class Built(NamedTuple):
    run: Callable[[], Any]
    peak: int
    temp: int
    model_flops: float


def build(model: Model, case: Case, timed: bool = True) -> Built:
    """The case's step on the model (placed state and batch), its compiled
    program's peak and temporary bytes per device."""
    mesh = ed.create_device_mesh(case.axes)
    options = dict(case.options)
    if options.pop("rules", False):
        options["param_rules"] = model.rules
    step = ed.make_train_step(model.loss, OPTIMIZER, mesh, **options)
    state = step.place_state(
        ed.TrainState.create(model.build(), OPTIMIZER, jax.random.key(1))
    )
    batch = ed.shard_batch(model.batch, step.layout.batch_sharding)
    memory = step.lower(state, batch).compile().memory_analysis()
    model_flops = step.cost(state, batch)["model_flops"]
    peak = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
    holder = {"state": state}

    def run() -> Any:
        holder["state"], _ = step(holder["state"], batch)
        return holder["state"]

    if timed:
        jax.block_until_ready(run())  # compiled (from the cache) and warm
    return Built(run, int(peak), int(memory.temp_size_in_bytes), model_flops)


def time_runs(runs: dict[str, Callable[[], Any]], repeats: int, steps: int) -> Any:
    """Median seconds per step of each run, interleaved, the order rotating."""
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            for _ in range(steps):
                out = runs[name]()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / steps)
    return {n: statistics.median(t) for n, t in times.items()}


# --- the sections ---------------------------------------------------------------


def layout_rows(model: Model, quick: bool, repeats: int, steps: int) -> list[str]:
    cases = [
        fsdp({"data": 8}, "fsdp, data 8"),
        fsdp({"data": 4, "model": 2}, "fsdp x tp, data 4 x model 2", rules=True),
        staged(2, 4, "gpipe"),
        staged(2, 4, "1f1b"),
        staged(4, 8, "gpipe"),
        staged(4, 8, "1f1b"),
        staged(4, 8, "circular"),
        staged(4, 8, "interleaved"),
        staged(4, 8, "zb-h1"),
    ]
    if quick:
        cases = cases[:3] + cases[4:6] + cases[8:]
    built = {c.name: build(model, c) for c in cases}
    times = time_runs({n: b.run for n, b in built.items()}, repeats, steps)
    base = times[cases[0].name]
    rows = []
    for name, b in built.items():
        rows.append(
            f"{model.name:11s} layout  {name:34s} {1 / times[name]:6.2f} steps/s "
            f"({base / times[name]:4.2f}x fsdp)  peak {b.peak / MiB:5.1f}, temp "
            f"{b.temp / MiB:5.1f} MiB/device"
        )
        print(rows[-1], flush=True)
    return rows


def bubble_rows(model: Model, quick: bool, repeats: int, steps: int) -> list[str]:
    reference = fsdp(
        {"stage": 1, "data": 8},
        "stage 1 x data 8, gpipe M=1 (no bubble)",
        pipeline=ed.Pipeline("stage", 1),
    )
    micro = {
        "gpipe": [1, 2, 4, 8, 16],
        "circular": [4, 16],
        "1f1b": [4, 16],
        "interleaved": [4, 16],
        "zb-h1": [4, 16],
    }
    if quick:
        micro = {
            "gpipe": [1, 4, 16],
            "circular": [8],
            "1f1b": [4, 16],
            "interleaved": [8],
            "zb-h1": [4, 16],
        }
    cases = [reference] + [
        staged(4, m, schedule) for schedule, ms in micro.items() for m in ms
    ]
    built, rows = {}, []
    for c in cases:
        try:
            built[c.name] = build(model, c)
        except ValueError as refused:
            # The written-out schedules refuse a loss their analysis does not
            # prove the microbatches' own (the transformer's at one sequence
            # a microbatch): said, not timed.
            rows.append(
                f"{model.name:11s} bubble  {c.name:44s} refused: "
                f"{str(refused).split(':')[0]}"
            )
            print(rows[-1], flush=True)
    cases = [c for c in cases if c.name in built]
    times = time_runs({n: b.run for n, b in built.items()}, repeats, steps)
    ref = times[reference.name]
    for case in cases:
        name, b = case.name, built[case.name]
        pipeline = case.options["pipeline"]
        # The table's idle fraction (`Pipeline.idle_fraction`): what the
        # schedule's compiled loop leaves idle, its rows run in lockstep.
        table = pipeline.idle_fraction(case.axes["stage"])
        rows.append(
            f"{model.name:11s} bubble  {name:44s} {times[name] * 1e3:7.1f} ms/step  "
            f"bubble {1 - ref / times[name]:5.2f} (table {table:4.2f})  "
            f"temp {b.temp / MiB:6.1f} MiB/device"
        )
        print(rows[-1], flush=True)
    gpipe = [c for c in cases if c.options["pipeline"].schedule == "gpipe"][1:]
    if len(gpipe) >= 3:
        rows.append(fit_row(model, gpipe, [times[c.name] for c in gpipe]))
        print(rows[-1], flush=True)
    return rows


def fit_row(model: Model, cases: list[Case], seconds: list[float]) -> str:
    """GPipe's step time against M fitted to `a + b / M + c M`."""
    m = np.array([c.options["pipeline"].microbatches for c in cases], float)
    basis = np.stack([np.ones_like(m), 1 / m, m], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(basis, 1e3 * np.array(seconds), rcond=None)
    best = math.sqrt(b / c) if b > 0 and c > 0 else float("nan")
    return (
        f"{model.name:11s} fit     gpipe, stage 4: t(M) = {a:.1f} + {b:.1f} / M + "
        f"{c:.2f} M ms: the bubble's work {b:.1f} ms / M, {c:.2f} ms per "
        f"microbatch; fastest at M = {best:.1f}"
    )


def remat_rows(model: Model, quick: bool) -> list[str]:
    rows = []
    for schedule in ("gpipe",) if quick else ("gpipe", "1f1b"):
        temps = {}
        for remat in ("none", "full", "dots", "offload"):
            case = staged(4, 8, schedule, remat=remat)
            temps[remat] = build(model, case, timed=False).temp
        for remat, temp in temps.items():
            rows.append(
                f"{model.name:11s} remat   stage 4 x data 2, {schedule} M=8, "
                f"remat={remat:8s} temp {temp / MiB:6.1f} MiB/device "
                f"({temp / temps['none']:4.2f}x none)"
            )
            print(rows[-1], flush=True)
    return rows


def work_rows(model: Model, quick: bool, repeats: int, steps: int) -> list[str]:
    """Each schedule's step against GPipe and data parallelism on the same
    model and rows, its model FLOPs against data parallelism's, the compiled
    temporaries at M = 4P, and what each entry kind computes."""
    dp = Case("dp, data 8", {"data": 8}, {})
    schedules = ["gpipe", "1f1b", "zb-h1", "interleaved"]

    def case(schedule: str, micro: int) -> Case:
        repeats = 2 if schedule == "interleaved" else 1
        pipeline = ed.Pipeline("stage", micro, schedule=schedule, repeats=repeats)
        name = f"stage 4 x data 2, {schedule} M={micro}"
        return Case(name, {"stage": 4, "data": 2}, {"pipeline": pipeline})

    cases = [dp] + [case(s, 8) for s in schedules]
    built = {c.name: build(model, c) for c in cases}
    times = time_runs({n: b.run for n, b in built.items()}, repeats, steps)
    gpipe, base = times[cases[1].name], built[dp.name]
    rows = []
    for c in cases:
        b, t = built[c.name], times[c.name]
        rows.append(
            f"{model.name:11s} work    {c.name:30s} {t * 1e3:7.1f} ms/step "
            f"({t / gpipe:4.2f}x gpipe, {t / times[dp.name]:4.2f}x dp)  model FLOPs "
            f"{b.model_flops / base.model_flops:4.2f}x dp"
        )
        print(rows[-1], flush=True)
    temps = {s: build(model, case(s, 16), timed=False).temp for s in schedules[:3]}
    rows.append(
        f"{model.name:11s} memory  M=16 temp MiB/device: gpipe "
        f"{temps['gpipe'] / MiB:.1f}, 1f1b {temps['1f1b'] / MiB:.1f} "
        f"({temps['1f1b'] / temps['gpipe']:.2f}x gpipe), zb-h1 "
        f"{temps['zb-h1'] / MiB:.1f} ({temps['zb-h1'] / temps['1f1b']:.2f}x 1f1b)"
    )
    print(rows[-1], flush=True)
    stacked = model.build().blocks
    x = entry_input(model)
    cost = pass_flops(stacked, x, remat=None, per_row=True)
    units = ", ".join(f"{k} {v / cost['F']:.2f}" for k, v in cost.items())
    rows.append(f"{model.name:11s} entries XLA FLOPs in units of F: {units}")
    print(rows[-1], flush=True)
    return rows


def message_rows(repeats: int) -> list[str]:
    """What one slot's messages cost on the 8 devices of `{"stage": 4,
    "data": 2}`: a loop of 54 slots (interleaved 1F1B's at P = 4, M = 8),
    each sending a 16 x 128 float32 block (a microbatch's activations at 256
    rows) to the next stage and one back, by two `ppermute`s, by one, and by
    one `all_to_all` carrying both (`messages.exchange` on XLA:CPU)."""
    mesh = jax.make_mesh(
        (4, 2), ("stage", "data"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    slots = 54
    ahead = [(i, (i + 1) % 4) for i in range(4)]
    back = [((i + 1) % 4, i) for i in range(4)]

    def both_ways(h: Any) -> Any:
        return jax.lax.ppermute(h, "stage", ahead) + jax.lax.ppermute(h, "stage", back)

    def one_way(h: Any) -> Any:
        return jax.lax.ppermute(h, "stage", ahead)

    def all_to_all(h: Any) -> Any:
        # The library's own exchange, which on XLA:CPU is one `all_to_all`.
        assert messages.by_all_to_all()
        (f,), (b,) = messages.exchange([h], [h], axis="stage", stages=4, ring=True)
        return f + b

    def looped(send: Callable[[Any], Any]) -> Callable[[], Any]:
        def loop(x: Any) -> Any:
            def slot(h: Any, _: Any) -> tuple[Any, None]:
                return send(h) * 0.5, None

            return jax.lax.scan(slot, x, None, length=slots)[0]

        spec = P("stage", "data")
        fn = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=spec, out_specs=spec))
        x = jax.device_put(jnp.ones((4 * 16, 2 * 128)), jax.NamedSharding(mesh, spec))
        jax.block_until_ready(fn(x))
        return lambda: fn(x)

    runs = {
        "2 ppermutes": looped(both_ways),
        "1 ppermute": looped(one_way),
        "1 all_to_all, both ways": looped(all_to_all),
    }
    times = time_runs(runs, max(repeats, 5), 3)
    rows = [
        f"messages {name:24s} {t / slots * 1e3:6.3f} ms a slot"
        for name, t in times.items()
    ]
    print("\n".join(rows), flush=True)
    return rows


def entry_input(model: Model) -> Any:
    """A microbatch of the stack's input rows for `pass_flops` (M = 8 over
    data 2): what a stage's entry runs on (the `x @ W` model's)."""
    return jnp.ones((model.batch["x"].shape[0] // 16, 128))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases, 8 blocks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16, help="blocks (of 8)")
    parser.add_argument(
        "--only",
        choices=("layout", "bubble", "remat", "work", "messages"),
        default=None,
    )
    parser.add_argument(
        "--xw-rows", type=int, default=256, help="rows a step of the x @ W model"
    )
    args = parser.parse_args()
    layers = 8 if args.quick else args.layers
    if layers % 8:
        parser.error("--layers must be a multiple of 8 (4 stages x 2 repeats)")
    if not jax.config.jax_compilation_cache_dir:
        # The step and `memory_analysis()` compile the same program: once.
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    start = time.perf_counter()
    rows = []
    for model in models(layers, args.xw_rows):
        if args.only in (None, "layout"):
            rows += layout_rows(model, args.quick, args.repeats, args.steps)
        if args.only in (None, "bubble"):
            rows += bubble_rows(model, args.quick, args.repeats, args.steps)
        if args.only in (None, "remat"):
            rows += remat_rows(model, args.quick)
        if args.only in (None, "work") and model.name == "x @ W":
            # The transformer's loss is refused by the written-out schedules'
            # loss analysis ("not proven the microbatches' own"), left as is.
            rows += work_rows(model, args.quick, args.repeats, args.steps)
    if args.only in (None, "messages"):
        rows += message_rows(args.repeats)
    print(f"\n{layers} blocks; {time.perf_counter() - start:.0f} s in all")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
