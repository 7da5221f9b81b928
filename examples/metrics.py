"""Evaluate a classifier on 8 devices with stateful metrics, three ways.

The evaluation set does not divide into full batches, so the last batch is padded and
masked. The same `MetricCollection` (accuracy, top-2 accuracy, macro-F1, a confusion
matrix, mean, worst and standard deviation of the loss) is computed:

1. inside `jax.shard_map`: each device updates with its rows of every batch in a
   `lax.scan`, then one `sync` (one all-reduce per (ReduceOp, dtype)) gives the
   replicated result;
2. inside `jax.shard_map`, one call per batch, as a training step would: each call
   returns `metrics.reduce("data")` (replicated), merged outside;
3. in global mode: plain `jax.jit` on sharded global arrays, no sync at all;

and compared with NumPy on the unpadded data.

    python examples/metrics.py --num-examples 1000 --batch-size 64
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import eqxdist as ed

ed.simulate_cpu_devices(8)  # before JAX starts its backend


def make_data(num_examples, features, classes, seed):
    rng = np.random.default_rng(seed)
    true_w = rng.normal(size=(features, classes)).astype(np.float32)
    x = rng.normal(size=(num_examples, features)).astype(np.float32)
    noisy = x @ true_w + rng.normal(scale=2.0, size=(num_examples, classes))
    model = eqx.nn.Linear(features, classes, key=jax.random.key(seed))
    model = eqx.tree_at(lambda m: m.weight, model, jnp.asarray(true_w.T))
    return model, x, np.argmax(noisy, axis=-1).astype(np.int32)


def padded_batches(x, y, batch_size):
    """Stack into (num_batches, batch_size, ...) with a mask of the real rows."""
    num_batches = -(-len(x) // batch_size)
    pad = num_batches * batch_size - len(x)
    mask = np.arange(num_batches * batch_size) < len(x)
    x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
    y = np.concatenate([y, np.zeros(pad, y.dtype)])
    shape = (num_batches, batch_size)
    return x.reshape(*shape, -1), y.reshape(shape), mask.reshape(shape)


def empty_metrics(classes):
    return ed.MetricCollection(
        {
            "accuracy": ed.metrics.Accuracy(),
            "top2": ed.metrics.Accuracy(top_k=2),
            "macro_f1": ed.metrics.F1Score(classes),
            "confusion": ed.metrics.ConfusionMatrix(classes),
            "loss": ed.metrics.Mean(),
            "worst_loss": ed.metrics.Max(),
            "loss_std": ed.metrics.Std(),
        }
    )


def update(metrics, model, x, y, mask):
    logits = jax.vmap(model)(x)
    losses = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], -1)[:, 0]
    return metrics.update(
        accuracy=(logits, y, mask),
        top2=(logits, y, mask),
        macro_f1=(logits, y, mask),
        confusion=(logits, y, mask),
        loss={"values": losses, "weights": mask},
        worst_loss=(jnp.where(mask, losses, -jnp.inf),),
        loss_std=(losses, mask),
    )


def evaluate_scan_then_sync(mesh, model, x, y, mask):
    def per_device(model, x, y, mask):
        # The carry is updated with per-device rows, so it must start "varying".
        init = jax.lax.pcast(empty_metrics(model.out_features), "data", to="varying")

        def body(metrics, batch):
            return update(metrics, model, *batch), None

        metrics, _ = jax.lax.scan(body, init, (x, y, mask))
        return metrics.sync("data").compute()

    batch_spec = P(None, "data")  # (num_batches, batch) split along the batch axis
    fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(), batch_spec, batch_spec, batch_spec),
        out_specs=P(),
    )
    return jax.jit(fn)(model, x, y, mask)


def evaluate_step_by_step(mesh, model, x, y, mask):
    step = jax.jit(
        jax.shard_map(
            lambda model, *batch: update(
                empty_metrics(model.out_features), model, *batch
            ).reduce("data"),
            mesh=mesh,
            in_specs=(P(), P("data"), P("data"), P("data")),
            out_specs=P(),
        )
    )
    metrics = empty_metrics(model.out_features)
    for batch in zip(x, y, mask, strict=True):
        metrics = metrics.merge(step(model, *batch))  # merge blocks: one step in flight
    return metrics.compute()


def evaluate_global(mesh, model, x, y, mask):
    sharding = ed.create_data_parallel_sharding(mesh)
    step = jax.jit(update)
    metrics = empty_metrics(model.out_features)
    for batch in zip(x, y, mask, strict=True):
        metrics = step(metrics, model, *ed.shard_batch(batch, sharding))
        jax.block_until_ready(metrics)
    return metrics.compute()


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--num-examples", type=int, default=1000, help="examples evaluated (any number)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=64, help="rows per step, a multiple of 8"
    )
    parser.add_argument("--features", type=int, default=16, help="input features")
    parser.add_argument("--classes", type=int, default=5, help="number of classes")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args()

    mesh = ed.create_data_parallel_mesh()
    model, x, y = make_data(args.num_examples, args.features, args.classes, args.seed)
    batches = padded_batches(x, y, args.batch_size)

    logits = np.asarray(jax.vmap(model)(x))
    log_probs = np.asarray(jax.nn.log_softmax(logits))
    losses = -log_probs[np.arange(len(y)), y]
    predicted = np.argmax(logits, -1)
    top2 = np.argsort(-logits, axis=-1)[:, :2]
    confusion = np.zeros((args.classes, args.classes), np.int64)
    np.add.at(confusion, (y, predicted), 1)
    tp = np.diag(confusion)
    denominator = confusion.sum(0) + confusion.sum(1)  # 2 tp + fp + fn
    f1 = np.divide(2 * tp, denominator, out=np.zeros(len(tp)), where=denominator > 0)
    reference = {
        "accuracy": np.mean(predicted == y),
        "top2": np.mean((top2 == y[:, None]).any(-1)),
        "macro_f1": f1.mean(),
        "confusion": confusion,
        "loss": np.mean(losses),
        "worst_loss": np.max(losses),
        "loss_std": np.std(losses.astype(np.float64)),
    }
    scalars = [name for name in reference if name != "confusion"]
    print(
        f"{len(x)} examples in {len(batches[0])} batches of {args.batch_size} "
        f"on {mesh.size} devices"
    )
    print("numpy:          " + "  ".join(f"{k}={reference[k]:.4f}" for k in scalars))
    for label, evaluate in [
        ("scan + sync:    ", evaluate_scan_then_sync),
        ("step + reduce:  ", evaluate_step_by_step),
        ("global arrays:  ", evaluate_global),
    ]:
        result = evaluate(mesh, model, *batches)
        print(label + "  ".join(f"{k}={float(result[k]):.4f}" for k in scalars))
        for name, want in reference.items():
            np.testing.assert_allclose(result[name], want, rtol=1e-5, err_msg=name)
    print("confusion matrix (rows: true class, columns: predicted):")
    print(np.asarray(result["confusion"]))
    print("all three modes agree with NumPy")


if __name__ == "__main__":
    main()
