"""The UvA scaling tutorial's `shard_map` demos, with Equinox and current JAX.

On a 4 x 2 mesh of simulated CPU devices (axes "i" and "j"): arrays sharded with
`NamedSharding` and computed on by plain `jax.numpy`; an `eqx.nn.Linear` applied
inside `jax.shard_map` to a batch split over "i" and weights split over "j";
normalisation with `lax.pmean`; a matmul that all-gathers its weight; a
`psum_scatter`; a `ppermute` ring shift; each device's axis indices; and
`eqxdist.fold_rng_over_axis` giving a different key per device along one axis.

    python examples/shard_map_basics.py
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed

ed.simulate_cpu_devices(8)  # before JAX starts its backend


def heading(text: str) -> None:
    print(f"\n--- {text} ---")


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    ).parse_args()
    mesh = ed.create_device_mesh({"i": 4, "j": 2})
    print("mesh:", ed.get_mesh_info(mesh)["axes"])

    heading("jax.numpy on sharded arrays: XLA inserts the communication")
    batch_size, input_dim, output_dim = 192, 64, 128
    kx, kw, kb, klinear = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (batch_size, input_dim))
    w = jax.random.normal(kw, (input_dim, output_dim))
    b = jax.random.normal(kb, (output_dim,))
    x_sharded = jax.device_put(x, NamedSharding(mesh, P("i", None)))
    w_sharded = jax.device_put(w, NamedSharding(mesh, P(None, "j")))
    b_sharded = jax.device_put(b, NamedSharding(mesh, P("j")))
    out = jnp.dot(x_sharded, w_sharded) + b_sharded
    print("output", out.shape, "sharded as", out.sharding.spec)

    heading(
        "shard_map: an eqx.nn.Linear on local blocks (batch over i, outputs over j)"
    )
    linear = eqx.nn.Linear(input_dim, output_dim, key=klinear)
    # eqx.nn.Linear's weight is (out, in): split its rows (outputs) over "j".
    specs = eqx.tree_at(lambda m: (m.weight, m.bias), linear, (P("j", None), P("j")))

    def local_linear(layer: eqx.nn.Linear, x: jax.Array) -> jax.Array:
        print("  local x", x.shape, "local weight", layer.weight.shape)
        return jax.vmap(layer)(x)

    y = jax.shard_map(
        local_linear,
        mesh=mesh,
        in_specs=(specs, P("i", None)),
        out_specs=P("i", "j"),
    )(linear, x)
    np.testing.assert_allclose(y, jax.vmap(linear)(x), rtol=1e-5, atol=1e-5)
    print("output", y.shape, "sharded as", y.sharding.spec, "(equals the unsharded)")

    heading("parallel normalisation: statistics with lax.pmean over j")

    def parallel_normalize(x: jax.Array) -> jax.Array:
        mean = lax.pmean(x, axis_name="j")
        std = lax.pmean((x - mean) ** 2, axis_name="j") ** 0.5
        return (x - mean) / std

    normalized = jax.shard_map(
        parallel_normalize, mesh=mesh, in_specs=P("i", "j"), out_specs=P("i", "j")
    )(x)
    print(f"mean {float(normalized.mean()):.2e}, std {float(normalized.std()):.4f}")

    heading("matmul with an all-gathered weight (FSDP's forward pass)")

    def matmul_with_weight_gather(x: jax.Array, w: jax.Array) -> jax.Array:
        print("  local w", w.shape, end=" -> ")
        w_gathered = lax.all_gather(w, axis_name="i", axis=0, tiled=True)
        print("gathered w", w_gathered.shape)
        return x @ w_gathered

    out = jax.shard_map(
        matmul_with_weight_gather,
        mesh=mesh,
        in_specs=(P("i", None), P("i", None)),
        out_specs=P("i", None),
    )(x, w)
    np.testing.assert_allclose(out, x @ w, rtol=1e-5, atol=1e-4)
    print("equals x @ w")

    heading("psum_scatter: sum over i, each device keeps one block")
    x_exmp = np.array([[3, 1, 4, 1], [5, 9, 2, 6], [5, 3, 5, 8], [9, 7, 1, 2]])
    scattered = jax.shard_map(
        # Device k gets column k of the sum of the rows: shape (1,) per device.
        lambda x: lax.psum_scatter(x, axis_name="i", scatter_dimension=1),
        mesh=mesh,
        in_specs=P("i", None),
        out_specs=P("i"),
    )(x_exmp)
    print("output", np.asarray(scattered).ravel())  # [22 20 12 17]

    heading("ppermute: shift one device along i")
    size = mesh.shape["i"]
    shifted = jax.shard_map(
        lambda x: lax.ppermute(
            x, axis_name="i", perm=[(k, (k + 1) % size) for k in range(size)]
        ),
        mesh=mesh,
        in_specs=P("i"),
        out_specs=P("i"),
    )(np.arange(4))
    print("output", np.asarray(shifted))  # [3 0 1 2]

    heading("axis indices of every device")
    indices = jax.jit(
        jax.shard_map(
            lambda: jnp.stack([lax.axis_index("i"), lax.axis_index("j")])[None],
            mesh=mesh,
            in_specs=(),
            out_specs=P(("i", "j")),
        )
    )()
    for device, (i, j) in enumerate(np.asarray(indices)):
        print(f"device {device}: i-axis={i}, j-axis={j}")

    heading("fold_rng_over_axis: a different key along i, the same along j")
    keys = jax.jit(
        jax.shard_map(
            lambda key: jax.random.key_data(ed.fold_rng_over_axis(key, "i"))[None],
            mesh=mesh,
            in_specs=P(),
            out_specs=P(("i", "j")),
        )
    )(jax.random.key(0))
    for device, data in enumerate(np.asarray(keys)):
        print(f"device {device}: key {data}")


if __name__ == "__main__":
    main()
