"""A two-minute tour of eqxdist's foundation on 8 simulated CPU devices.

Builds a mesh, places a batch on it, computes per-device metrics inside
`jax.shard_map`, reduces them across devices (collective mode), checks them against
the same numbers computed on the global arrays (global mode), and takes one
data-parallel gradient step of an Equinox model.

    python examples/quickstart.py [--devices 8] [--batch-size 64]
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import eqxdist as ed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="global batch size (a multiple of --devices)",
    )
    args = parser.parse_args()

    ed.simulate_cpu_devices(args.devices)  # before JAX starts its backend
    mesh = ed.create_data_parallel_mesh()
    print("mesh:", ed.get_mesh_info(mesh))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch_size, 16)).astype(np.float32)
    y = (x @ rng.normal(size=(16,)) > 0).astype(np.int32)
    batch = ed.shard_batch({"x": x, "y": y}, ed.create_data_parallel_sharding(mesh))
    print("batch['x'] sharding:", batch["x"].sharding.spec)

    model = eqx.nn.Linear(16, 2, key=jax.random.key(0))
    model = ed.replicate_params(model, mesh)

    def loss_fn(model: eqx.nn.Linear, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = jax.vmap(model)(x)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])

    def per_device(model, batch):
        loss, grads = jax.value_and_grad(loss_fn)(model, batch["x"], batch["y"])
        grads = ed.all_reduce_gradients(grads)  # mean over the "data" axis
        model = jax.tree.map(lambda p, g: p - 0.5 * g, model, grads)
        metrics = {"loss": loss, "examples": jnp.float32(batch["x"].shape[0])}
        reduced = ed.reduce_custom(metrics, {"examples": "sum"})
        return model, reduced, ed.all_gather({"loss": loss})

    step = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=(P(), P(), P()),
            check_vma=False,  # classic data parallelism: we all-reduce ourselves
        )
    )
    new_model, metrics, gathered = step(model, batch)
    per_device_loss = ed.collect_from_devices(gathered)["loss"]
    print(f"mean loss over devices: {float(metrics['loss']):.6f}")
    print(f"examples seen:          {int(metrics['examples'])}")
    print("per-device losses:     ", [round(float(v), 4) for v in per_device_loss])

    # The same loss, computed on the global arrays in one program (global mode).
    global_loss = ed.reduce_mean({"loss": loss_fn(model, batch["x"], batch["y"])}, None)
    print(f"global-array loss:      {float(global_loss['loss']):.6f}")
    assert np.isclose(float(global_loss["loss"]), float(metrics["loss"]), atol=1e-5)

    # One gradient step on all the data at once gives the same parameters.
    grads = jax.grad(loss_fn)(model, batch["x"], batch["y"])
    reference = jax.tree.map(lambda p, g: p - 0.5 * g, model, grads)
    diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(new_model), jax.tree.leaves(reference), strict=True
        )
    )
    print(f"data-parallel step vs single program, max |diff|: {diff:.2e}")
    assert diff < 1e-5


if __name__ == "__main__":
    main()
