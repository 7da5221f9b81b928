"""The UvA scaling tutorial's FSDP run, in Equinox with eqxdist.

The tutorial's classifier, optimizer and fixed batch (see `data_parallel.py`), with
each Dense layer wrapped in `eqxdist.FSDP` (the tutorial's `shard_module_params`),
trained by `eqxdist.make_train_step(..., strategy="fsdp")`: every parameter with
more than `--min-weight-size` elements, and its adamw moments, is split over the 8
devices; each layer all-gathers its weights just before use and its gradients are
reduce-scattered back to the shards. Prints the layout, the metrics the tutorial's
way, the per-device memory of the train state, and that the parameters match those
of the data-parallel run.

    python examples/fsdp.py [--steps 15] [--min-weight-size 16]
"""

import _tutorial
import equinox as eqx

import eqxdist as ed

ed.enable_gpu_collective_overlap()  # XLA's GPU overlap flags; a no-op without a GPU
ed.simulate_cpu_devices(8)  # before JAX starts its backend


def main() -> None:
    args = _tutorial.parse_args(__doc__.split("\n\n")[0])
    mesh = ed.create_data_parallel_mesh()

    def shard_layers(model: _tutorial.Classifier) -> _tutorial.Classifier:
        def fsdp(layer: _tutorial.Dense) -> ed.FSDP:
            return ed.FSDP(layer, mesh, min_weight_size=args.min_weight_size)

        layers = (model.input_dense, model.output_dense)
        wrapped: _tutorial.Classifier = eqx.tree_at(
            lambda m: (m.input_dense, m.output_dense),
            model,
            tuple(fsdp(layer) for layer in layers),
        )
        return wrapped

    step, state, batch = _tutorial.setup("fsdp", args, mesh, wrap=shard_layers)
    specs = step.state_specs(state)
    _tutorial.print_specs(specs.model, "FSDP parameter specs:")
    _tutorial.print_specs(specs.opt_state, "FSDP optimizer state specs:")

    fsdp_state = _tutorial.train(step, state, batch, args.steps, "FSDP")
    _tutorial.print_layout(fsdp_state.model, "FSDP parameters (path, shape, sharding):")

    dp_step, dp_state, _ = _tutorial.setup("dp", args, mesh)
    dp_state = _tutorial.train(dp_step, dp_state, batch, args.steps, "DP")

    fsdp_bytes = _tutorial.bytes_per_device(fsdp_state)
    dp_bytes = _tutorial.bytes_per_device(dp_state)
    print(
        f"Train state per device: FSDP {fsdp_bytes:,} bytes, DP {dp_bytes:,} bytes "
        f"({fsdp_bytes / dp_bytes:.1%}; 1/{mesh.size} = {1 / mesh.size:.1%})."
    )
    diff = _tutorial.max_abs_diff(fsdp_state.model, dp_state.model)
    verdict = "match" if diff < 1e-4 else "DIFFER"
    print(
        f"DP and FSDP parameters {verdict}: max abs difference {diff:.2e} "
        f"after {args.steps + 1} steps (tolerance 1e-4)."
    )


if __name__ == "__main__":
    main()
