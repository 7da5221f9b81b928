"""Per-device memory of data parallelism and FSDP, from the placed state and from
XLA's buffer assignment of the compiled training steps.

1. The UvA tutorial's classifier (784 -> 512 -> 10) with adamw: bytes per device
   of the train state (parameters + optimizer state) under `"dp"` and under
   `"fsdp"` with the tutorial's `min_weight_size=2**4`, measured on the placed
   arrays (device 0's shards), against the ideal `1/N` of data parallel.
2. A deep MLP (16 blocks of 1024x1024, adamw, batch 64): for DP, whole-model FSDP
   (weights gathered, and by default, where 64 rows make `fsdp_linears="auto"`
   partition every layer's computation instead), per-block FSDP (`eqxdist.FSDP`
   around each block) and per-block FSDP with `remat=True`, the per-device sizes
   `compiled.memory_analysis()` reports for the compiled step: arguments (the
   sharded state and the batch), temporaries (activations, gathered parameters,
   gradients) and their total with the outputs that do not reuse donated
   buffers (the step's peak, at most); and the all-gathers in its HLO (remat
   gathers again in the backward pass). The model is abstract
   (`eqx.filter_eval_shape`): nothing is allocated.

    python benchmarks/bench_memory.py

The script sets up 8 simulated CPU devices itself (before importing JAX) unless
`XLA_FLAGS` already sets a device count. `run()` returns the rows for other scripts.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqxdist as ed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _tutorial

ed.simulate_cpu_devices(8)  # before JAX starts its backend

MiB = 2**20


class Block(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, width: int, key: Any) -> None:
        self.linear = eqx.nn.Linear(width, width, key=key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(jax.vmap(self.linear)(x))


class DeepMLP(eqx.Module):
    blocks: tuple[Any, ...]

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


def _deep_mlp(mesh: Any, depth: int, width: int, wrap: bool, remat: bool) -> Any:
    keys = jax.random.split(jax.random.key(0), depth)
    blocks = [Block(width, k) for k in keys]
    if wrap:
        blocks = [ed.FSDP(b, mesh, min_weight_size=2**16, remat=remat) for b in blocks]
    return DeepMLP(tuple(blocks))


def _regression_loss(model: Any, batch: Any, key: Any) -> Any:
    del key
    loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    return loss, {"loss": (loss * batch["x"].shape[0], batch["x"].shape[0])}


def _state_bytes_per_device(state: ed.TrainState) -> int:
    """Bytes of parameters and optimizer state that device 0 holds."""
    leaves = jax.tree.leaves((state.model, state.opt_state))
    return sum(
        x.addressable_shards[0].data.nbytes for x in leaves if isinstance(x, jax.Array)
    )


def tutorial_state_rows(mesh: Any) -> list[dict[str, Any]]:
    optimizer = optax.adamw(_tutorial.LEARNING_RATE)
    state = ed.TrainState.create(
        _tutorial.Classifier(jax.random.key(0)), optimizer, jax.random.key(1)
    )
    sizes = {}
    for strategy in ("dp", "fsdp"):
        step = ed.make_train_step(
            _tutorial.loss_fn, optimizer, mesh, strategy=strategy, min_weight_size=2**4
        )
        sizes[strategy] = _state_bytes_per_device(step.place_state(state))
    n = mesh.size
    return [
        {
            "case": "tutorial state",
            "variant": strategy,
            "bytes_per_device": sizes[strategy],
            "fraction_of_dp": sizes[strategy] / sizes["dp"],
            "target": "" if strategy == "dp" else f"<= {1 / n + 0.02:.4f}",
        }
        for strategy in ("dp", "fsdp")
    ]


def deep_mlp_rows(
    mesh: Any, depth: int = 16, width: int = 1024
) -> list[dict[str, Any]]:
    optimizer = optax.adamw(1e-3)
    batch = {
        "x": np.zeros((64, width), np.float32),
        "y": np.zeros((64, width), np.float32),
    }
    # (strategy, wrapped per block, remat, fsdp_linears)
    variants = {
        "dp": ("dp", False, False, "auto"),
        "fsdp (whole model, weights gathered)": ("fsdp", False, False, "gather"),
        "fsdp (whole model, default: layers partitioned)": (
            "fsdp",
            False,
            False,
            "auto",
        ),
        "fsdp (per block)": ("fsdp", True, False, "auto"),
        "fsdp (per block, remat)": ("fsdp", True, True, "auto"),
    }
    rows = []
    for label, (strategy, wrap, remat, linears) in variants.items():
        state = eqx.filter_eval_shape(
            lambda wrap=wrap, remat=remat: ed.TrainState.create(
                _deep_mlp(mesh, depth, width, wrap, remat),
                optimizer,
                jax.random.key(1),
            )
        )
        step = ed.make_train_step(
            _regression_loss,
            optimizer,
            mesh,
            strategy=strategy,
            min_weight_size=2**16,
            fsdp_linears=linears,
        )
        compiled = step.lower(state, batch).compile()
        memory = compiled.memory_analysis()
        hlo = compiled.as_text()
        rows.append(
            {
                "case": f"deep MLP {depth}x{width}x{width}",
                "variant": label,
                "argument_MiB": memory.argument_size_in_bytes / MiB,
                "temp_MiB": memory.temp_size_in_bytes / MiB,
                # Everything XLA assigns for one step: inputs, temporaries and
                # the outputs that do not reuse (donated) input buffers.
                "total_MiB": (
                    memory.argument_size_in_bytes
                    + memory.temp_size_in_bytes
                    + memory.output_size_in_bytes
                    - memory.alias_size_in_bytes
                )
                / MiB,
                "all_gathers": hlo.count(" all-gather(")
                + hlo.count(" all-gather-start("),
            }
        )
    return rows


def run(*, depth: int = 16, width: int = 1024) -> list[dict[str, Any]]:
    """The rows of both tables (see the module docstring)."""
    if len(jax.devices()) < 8:
        raise RuntimeError(
            "bench_memory needs 8 devices; set XLA_FLAGS="
            "--xla_force_host_platform_device_count=8 before importing JAX."
        )
    mesh = ed.create_data_parallel_mesh(8)
    return tutorial_state_rows(mesh) + deep_mlp_rows(mesh, depth, width)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--depth", type=int, default=16, help="deep MLP blocks")
    parser.add_argument("--width", type=int, default=1024, help="deep MLP width")
    args = parser.parse_args()
    rows = run(depth=args.depth, width=args.width)
    print(f"{'case':22} {'variant':25} {'bytes/device':>13} {'of dp':>7}  target")
    for row in rows:
        if "bytes_per_device" in row:
            print(
                f"{row['case']:22} {row['variant']:25} {row['bytes_per_device']:13,d} "
                f"{row['fraction_of_dp']:7.4f}  {row['target']}"
            )
    print()
    print(
        f"{'case':22} {'variant':25} {'args MiB':>9} {'temp MiB':>9} "
        f"{'total MiB':>10} {'all-gathers':>11}"
    )
    for row in rows:
        if "total_MiB" in row:
            print(
                f"{row['case']:22} {row['variant']:25} {row['argument_MiB']:9.1f} "
                f"{row['temp_MiB']:9.1f} {row['total_MiB']:10.1f} "
                f"{row['all_gathers']:11d}"
            )


if __name__ == "__main__":
    main()
