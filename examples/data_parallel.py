"""The UvA scaling tutorial's data-parallel run, in Equinox with eqxdist.

A 784 -> 512 -> 10 classifier (bf16 compute, dropout 0.1) trained with adamw
(1e-3) on one fixed batch of 128 random examples, in 4 minibatches per step, on 8
simulated CPU devices: `eqxdist.make_train_step(..., strategy="dp")` replicates
the state, splits the batch over the devices, averages the gradients and sums the
`(sum, count)` metrics over devices and minibatches. Prints the metrics of the
first 15 steps and of the 16th the tutorial's way, then checks that, without
dropout, the parameters equal those of the same run on a single device.

    python examples/data_parallel.py [--steps 15] [--minibatches 4]
"""

import _tutorial
import jax.numpy as jnp

import eqxdist as ed

ed.simulate_cpu_devices(8)  # before JAX starts its backend


def main() -> None:
    args = _tutorial.parse_args(__doc__.split("\n\n")[0])
    mesh = ed.create_data_parallel_mesh()
    print(f"{mesh.size} devices, mesh axes {dict(mesh.shape)}")

    step, state, batch = _tutorial.setup("dp", args, mesh)
    state = _tutorial.train(step, state, batch, args.steps, "DP")
    _tutorial.print_layout(state.model, "DP parameters (path, shape, sharding):")

    # The same training on 8 devices and on one, without dropout (whose masks
    # depend on the device count) and in float32 (bfloat16 rounds sums of 16 rows
    # differently from sums of 128): data parallelism must not change the result.
    models = []
    for devices in (8, 1):
        mesh = ed.create_data_parallel_mesh(devices)
        step, state, batch = _tutorial.setup(
            "dp", args, mesh, dropout_rate=0.0, dtype=jnp.float32
        )
        for _ in range(args.steps + 1):
            state, _ = step(state, batch)
        models.append(state.model)
    diff = _tutorial.max_abs_diff(*models)
    verdict = "match" if diff < 1e-4 else "DIFFER"
    print(
        f"Without dropout, in float32, DP on 8 devices and on 1 device {verdict}: "
        f"max abs "
        f"parameter difference {diff:.2e} after {args.steps + 1} steps."
    )


if __name__ == "__main__":
    main()
