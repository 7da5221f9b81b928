"""Synchronizing metric collections over 8 devices: three strategies side by side.

Three collections: `basic`, 16 scalar metrics (4 Mean, 4 Accuracy, 4 Sum, 2 Max,
2 Min); `evaluation`, what a real classifier evaluation holds (accuracy, top-5
accuracy, macro-F1, a 10x10 confusion matrix, a 200-bin AUROC, the mean loss);
and `regression_ranking`, a regression and ranking evaluation (MSE, RMSE, MAE,
R2, Pearson correlation, a 200-bin average precision, precision, recall and
NDCG at 5, MRR, the mean loss), whose R2 and correlation are folded states.

- `grouped (eqxdist)`: `MetricCollection.sync`, one collective per (ReduceOp, dtype).
- `per-state (torchmetrics/d9d)`: one all-reduce per accumulator (`acc.sync()` each).
- `gather+reduce (CLU)`: all-gather every accumulator, merge the gathered copies on
  each device (with the accumulators' own exact `merge`).
- `no sync`: the same updates and `compute()` without any collective, to separate the
  cost of synchronizing from the cost of updating.

For each: collectives in the program JAX emits (`lowered`) and in the compiled HLO
(`compiled`, after XLA's passes: the CPU all-reduce combiner merges independent
all-reduces into tuple all-reduces, which is why the per-state row compiles to few),
the bytes those compiled collectives produce per device (`result B`), an estimate of
what each device sends on a ring (`sent B`: `2(p-1)/p` x size for an all-reduce,
`(p-1)/p` x result size for an all-gather), and the median wall time of one jitted
step (each call blocked on, so one step is in flight at a time). The per-state
row can move fewer bytes than the grouped one: XLA drops the all-reduce of a state
that is still a constant (e.g. a `Mean`'s float weight when only masks were given)
and merges identical ones (`macro_f1` and `confusion` count the same pairs), which
it cannot do once those states are concatenated into a group.

    python benchmarks/bench_metrics.py                 # XLA's defaults
    python benchmarks/bench_metrics.py --no-combiner   # as if nothing merged them
    python benchmarks/bench_metrics.py --collections evaluation --rounds 3

The script sets up 8 simulated CPU devices itself (before importing JAX) unless
`XLA_FLAGS` already sets a device count. `run()` returns the rows for other scripts.
"""

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

_COMBINER_OFF = "--xla_disable_hlo_passes=cpu-all-reduce-combiner"
if __name__ == "__main__" and "--no-combiner" in sys.argv:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " " + _COMBINER_OFF
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import eqxdist as ed  # noqa: E402

ed.simulate_cpu_devices(8)  # before JAX starts its backend

_KINDS = (
    [ed.metrics.Mean] * 4
    + [ed.metrics.Accuracy] * 4
    + [ed.metrics.Sum] * 4
    + [ed.metrics.Max] * 2
    + [ed.metrics.Min] * 2
)
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_COLLECTIVE_RE = re.compile(
    r"= (?P<shape>\(.*?\)|\S+) (?P<op>all-reduce|all-gather|reduce-scatter|"
    r"all-to-all|collective-permute)(?:-start)?\("
)


def _is_accumulator(x: Any) -> bool:
    return isinstance(x, ed.metrics.MetricAccumulator)


def _basic() -> ed.MetricCollection:
    return ed.MetricCollection({f"m{i}": kind() for i, kind in enumerate(_KINDS)})


def _evaluation(classes: int) -> ed.MetricCollection:
    return ed.MetricCollection(
        {
            "accuracy": ed.metrics.Accuracy(),
            "top5": ed.metrics.Accuracy(top_k=5),
            "macro_f1": ed.metrics.F1Score(classes),
            "confusion": ed.metrics.ConfusionMatrix(classes),
            "auroc": ed.metrics.AUROC(),
            "loss": ed.metrics.Mean(),
        }
    )


def _regression_ranking() -> ed.MetricCollection:
    return ed.MetricCollection(
        {
            "mse": ed.metrics.MeanSquaredError(),
            "rmse": ed.metrics.MeanSquaredError(squared=False),
            "mae": ed.metrics.MeanAbsoluteError(),
            "r2": ed.metrics.R2Score(),
            "pearson": ed.metrics.PearsonCorrCoef(),
            "ap": ed.metrics.AveragePrecision(),
            "p@5": ed.metrics.PrecisionAtK(5),
            "r@5": ed.metrics.RecallAtK(5),
            "ndcg@5": ed.metrics.NDCGAtK(5),
            "mrr": ed.metrics.MRR(),
            "loss": ed.metrics.Mean(),
        }
    )


def _update_regression_ranking(
    metrics: ed.MetricCollection, x: jax.Array, y: jax.Array
) -> Any:
    # Regression of x[:, 1] from x[:, 0]; ranking of the classes of each row
    # (one query per row, the label the relevant item, graded by its score).
    preds, targets = x[:, 0], 0.5 * x[:, 0] + x[:, 1]
    relevance = jax.nn.one_hot(y, x.shape[-1]) * (1 + (x[:, :1] > 0))
    retrieval = (x, relevance)
    return metrics.update(
        mse=(preds, targets),
        rmse=(preds, targets),
        mae=(preds, targets),
        r2=(preds, targets),
        pearson=(preds, targets),
        ap=(jax.nn.sigmoid(x[:, 0]), (y == 0).astype(jnp.int32)),
        **{name: retrieval for name in ("p@5", "r@5", "ndcg@5", "mrr")},
        loss=((preds - targets) ** 2,),
    )


def _update_evaluation(metrics: ed.MetricCollection, x: jax.Array, y: jax.Array) -> Any:
    probabilities = jax.nn.softmax(x)
    loss = -jnp.take_along_axis(jax.nn.log_softmax(x), y[:, None], -1)[:, 0]
    return metrics.update(
        accuracy=(x, y),
        top5=(x, y),
        macro_f1=(x, y),
        confusion=(x, y),
        auroc=(probabilities[:, 0], (y == 0).astype(jnp.int32)),
        loss=(loss,),
    )


def _update_basic(metrics: ed.MetricCollection, x: jax.Array, y: jax.Array) -> Any:
    # Different inputs per metric, so that XLA cannot merge identical states.
    updates: dict[str, tuple[Any, ...]] = {}
    for i, (name, metric) in enumerate(metrics.metrics.items()):
        if isinstance(metric, ed.metrics.Accuracy):
            updates[name] = (x * (i + 1), (y + i) % x.shape[-1])
        else:
            updates[name] = (x[:, i % x.shape[-1]] * (i + 1),)
    return metrics.update(**updates)


# name: (classes in the inputs, the collection, its update)
_COLLECTIONS: dict[str, tuple[int, Callable[[], Any], Callable[..., Any]]] = {
    "basic": (4, _basic, _update_basic),
    "evaluation": (10, lambda: _evaluation(10), _update_evaluation),
    "regression_ranking": (10, _regression_ranking, _update_regression_ranking),
}


def _per_state(metrics: Any) -> Any:
    return jax.tree.map(
        lambda a: a.sync("data") if _is_accumulator(a) else a,
        metrics,
        is_leaf=_is_accumulator,
    )


def _gather_then_reduce(metrics: Any) -> Any:
    """Every device gathers every device's local states (one all-gather per state)
    and merges them in device order, with the metrics' own (exact) merge."""

    def sync(acc: Any) -> Any:
        if not _is_accumulator(acc):
            return acc
        local = acc.state_dict()
        gathered = ed.all_gather(local)
        rows = [
            acc.load_state_dict({k: v[i] for k, v in gathered.items()})
            for i in range(jax.lax.axis_size("data"))
        ]
        merged = rows[0]
        for row in rows[1:]:
            merged = merged.merge(row)
        synced = {
            k.replace("local", "synchronized"): v
            for k, v in merged.state_dict().items()
        }
        return acc.load_state_dict({**local, **synced})

    return jax.tree.map(sync, metrics, is_leaf=_is_accumulator)


STRATEGIES: dict[str, Callable[[Any], Any]] = {
    "grouped (eqxdist)": lambda m: m.sync("data"),
    "per-state (torchmetrics/d9d)": _per_state,
    "gather+reduce (CLU)": _gather_then_reduce,
    "no sync": lambda m: m,
}


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", shape):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * _BYTES.get(dtype, 8 if dtype.endswith("64") else 4)
    return total


def hlo_collectives(compiled_text: str, num_devices: int) -> dict[str, int]:
    """Count the collectives of a compiled HLO module and the bytes they move."""
    count = result = sent = 0
    for match in _COLLECTIVE_RE.finditer(compiled_text):
        size = _shape_bytes(match["shape"])
        count += 1
        result += size
        factor = 2 if match["op"] == "all-reduce" else 1
        sent += factor * size * (num_devices - 1) // num_devices
    return {"compiled": count, "result_bytes": result, "sent_bytes": sent}


def _median_us(fn: Callable[[], Any], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn())  # one step in flight: CPU collectives stay sane
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _run_collection(
    kind: str, batch_per_device: int, rounds: int, calls: int
) -> list[dict[str, Any]]:
    mesh = ed.create_data_parallel_mesh()
    n = mesh.size
    classes, build, update = _COLLECTIONS[kind]
    key_x, key_y = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (batch_per_device * n, classes))
    y = jax.random.randint(key_y, (batch_per_device * n,), 0, classes)
    metrics = build()
    states = len(jax.tree.leaves(metrics, is_leaf=_is_accumulator))
    label = f"{len(metrics)} {kind}"

    steps, rows = {}, []
    for name, strategy in STRATEGIES.items():

        def step(x: jax.Array, y: jax.Array, strategy: Any = strategy) -> Any:
            return strategy(update(metrics, x, y)).compute()

        out_specs = P("data") if name == "no sync" else P()
        if name == "no sync":  # unsynchronized results differ per device

            def step(x: jax.Array, y: jax.Array) -> Any:
                out = update(metrics, x, y).compute()
                return jax.tree.map(lambda v: v[None], out)

        fn = jax.jit(
            jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=out_specs)
        )
        lowered = fn.lower(x, y)
        stats = hlo_collectives(lowered.compile().as_text(), n)
        stats["lowered"] = len(
            re.findall(
                r"stablehlo\.(all_reduce|all_gather|reduce_scatter)", lowered.as_text()
            )
        )
        jax.block_until_ready(fn(x, y))
        steps[name] = fn
        rows.append({"strategy": name, "metrics": label, "states": states, **stats})

    per_round: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            per_round[name].append(_median_us(lambda fn=fn: fn(x, y), calls))
    reference = statistics.median(per_round["grouped (eqxdist)"])
    for row in rows:
        row["time_us"] = statistics.median(per_round[row["strategy"]])
        row["time_vs_grouped"] = row["time_us"] / reference
    return rows


def run(
    *,
    batch_per_device: int = 32,
    rounds: int = 5,
    calls: int = 40,
    collections: Sequence[str] = ("basic", "evaluation", "regression_ranking"),
) -> list[dict[str, Any]]:
    """Compile and time every strategy on all devices; one row per (collection,
    strategy).

    Rounds alternate between strategies so that a busy machine slows all of them
    alike; each row's time is the median of the per-round medians.
    """
    return [
        row
        for kind in collections
        for row in _run_collection(kind, batch_per_device, rounds, calls)
    ]


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    header = (
        f"{'metrics':21} {'strategy':30} {'lowered':>7} {'compiled':>8} "
        f"{'result B':>9} {'sent B':>7} {'time us':>8} {'x grouped':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['metrics']:21} {r['strategy']:30} {r['lowered']:>7} "
            f"{r['compiled']:>8} {r['result_bytes']:>9} {r['sent_bytes']:>7} "
            f"{r['time_us']:>8.0f} {r['time_vs_grouped']:>9.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-per-device", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40, help="timed calls per round")
    parser.add_argument(
        "--collections",
        nargs="+",
        default=list(_COLLECTIONS),
        choices=list(_COLLECTIONS),
    )
    parser.add_argument(
        "--no-combiner",
        action="store_true",
        help="disable XLA's CPU all-reduce combiner (only when run as a script)",
    )
    args = parser.parse_args(argv)
    rows = run(
        batch_per_device=args.batch_per_device,
        rounds=args.rounds,
        calls=args.calls,
        collections=args.collections,
    )
    combiner = "off" if _COMBINER_OFF in os.environ["XLA_FLAGS"] else "on"
    states = ", ".join(
        sorted({f"{r['metrics']}: {r['states']} accumulator states" for r in rows})
    )
    print(
        f"{states}; {jax.device_count()} {jax.devices()[0].platform} devices, XLA "
        f"all-reduce combiner {combiner}, jax {jax.__version__}"
    )
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
