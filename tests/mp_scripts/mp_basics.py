"""Meshes, batches, reductions, metrics and state placement across processes, run by
tests/launch/test_launch.py as `python -m eqxdist.launch -n 2 -d 4 mp_basics.py OUT`.

Process 0 writes `OUT/basics.json`: for each check either its value (which the test
compares with NumPy on the same global data) or `{"error": ...}`."""

import json
import sys
import traceback
from pathlib import Path

import eqxdist as ed

ed.initialize_distributed()

import common  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

out = Path(sys.argv[1])
mesh = ed.create_data_parallel_mesh()
sharding = ed.create_data_parallel_sharding(mesh)
# The global data: 16 rows, process p holds rows 8p..8p+7.
data = np.arange(16 * 3, dtype=np.float32).reshape(16, 3) - 20.0
rows = slice(8 * jax.process_index(), 8 * (jax.process_index() + 1))
results = {}


def check(name):
    def record(fn):
        try:
            results[name] = fn()
        except Exception:  # the test shows which check broke, and how
            results[name] = {"error": traceback.format_exc()}

    return record


def smap(fn, in_specs, out_specs=P()):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


@check("mesh")
def _():
    info = ed.get_mesh_info(mesh)
    return {
        "process_count": info["process_count"],
        "total_devices": info["total_devices"],
        "local_devices": info["local_devices"],
        "jax_process_count": jax.process_count(),
    }


@check("shard_batch")
def _():
    batch = ed.shard_batch(
        {"x": data[rows], "s": np.float32(2.5), "tag": "t"}, sharding
    )
    x = batch["x"]
    return {
        "shape": list(x.shape),
        "spec": str(x.sharding.spec),
        "sum": float(jax.jit(jnp.sum)(x)),
        "scalar": float(batch["s"]),
        "tag": batch["tag"],
        "full": common.host(x).tolist(),
    }


@check("global_reductions")
def _():
    x = ed.shard_batch(data[rows], sharding)
    return {
        op: float(fn({"x": x}, axis_name=None)["x"])
        for op, fn in [
            ("mean", ed.reduce_mean),
            ("sum", ed.reduce_sum),
            ("max", ed.reduce_max),
            ("min", ed.reduce_min),
        ]
    }


@check("collectives")
def _():
    def per_device(x):
        local = {"sum": x.sum(), "max": x.max()}
        custom = ed.reduce_custom(local, {"sum": "sum", "max": "max"})
        gathered = ed.all_gather({"rows": x[:, 0]}, tiled=True)
        return ed.reduce_mean(x.mean()), custom["sum"], custom["max"], gathered["rows"]

    mean, total, top, first_column = smap(per_device, P("data"))(
        ed.shard_batch(data[rows], sharding)
    )
    return {
        "mean": float(mean),
        "sum": float(total),
        "max": float(top),
        "first_column": common.host(first_column).tolist(),
    }


@check("metrics")
def _():
    def per_device(x, y):
        mean = ed.metrics.Mean().update(x[:, 0]).sync("data")
        accuracy = ed.metrics.Accuracy().update(x, y).sync("data")
        total = ed.metrics.MetricAccumulator(0.0).update(x.sum()).sync("data")
        return mean.compute(), accuracy.compute(), total.value

    labels = (np.arange(16) % 3).astype(np.int32)
    batch = ed.shard_batch({"x": data[rows], "y": labels[rows]}, sharding)
    mean, accuracy, total = smap(per_device, (P("data"), P("data")))(
        batch["x"], batch["y"]
    )
    return {"mean": float(mean), "accuracy": float(accuracy), "sum": float(total)}


@check("replicate_params")
def _():
    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))  # process-local arrays
    placed = ed.replicate_params({"model": model, "key": jax.random.key(3)}, mesh)
    return {
        "specs": sorted(
            {str(x.sharding.spec) for x in jax.tree.leaves(placed) if eqx.is_array(x)}
        ),
        "weight": common.host(placed["model"].layers[0].weight).tolist(),
        "key": common.host(placed["key"]).tolist(),
    }


@check("shard_model_state")
def _():
    model = eqx.nn.MLP(4, 2, 16, 1, key=jax.random.key(0))
    placed = ed.shard_model_state(model, mesh, "shard", min_weight_size=8)
    weight = placed.layers[0].weight
    return {
        "spec": str(weight.sharding.spec),
        "weight": common.host(weight).tolist(),
    }


@check("jit_on_placed")
def _():
    w = ed.replicate_params(jnp.ones((3, 2)), mesh)
    x = ed.shard_batch(data[rows], sharding)
    return float(jax.jit(lambda w, x: (x @ w).sum())(w, x))


@check("per_row_eval")
def _():
    """Each process passes 7 of its 8 rows (padded inside to a multiple of its
    4 devices); every process gets the rows of both, process 0's first."""

    def eval_fn(model, batch, mask):
        total = jnp.where(mask, batch["x"][:, 0], 0.0).sum()
        return {"total": total}, {"twice": 2 * batch["x"][:, 0], "x": batch["x"]}

    got = {}
    for view in ("device", "global"):
        step = ed.make_eval_step(eval_fn, mesh, view=view, per_row=True)
        metrics, per_row = step(None, {"x": data[rows][:7]})
        got[view] = {
            "total": float(metrics["total"]),
            "twice": per_row["twice"].tolist(),
            "x": per_row["x"].tolist(),
        }
    return got


ed.print_metrics({"value": jnp.float32(0.5)}, "printed once")
if jax.process_index() == 0:
    (out / "basics.json").write_text(json.dumps(results))
