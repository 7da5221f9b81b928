"""Host memory of `load_safetensors` under FSDP across processes.

Writes a checkpoint of about `--mib` MiB (float32, an `ed.Stacked` of MLP blocks
and a head, in Hugging Face's layout), then loads it in two processes of four
CPU devices each (`python -m eqxdist.launch -n 2 -d 4`) under FSDP over all
eight devices, and reports each process's peak resident memory
(`ru_maxrss`) above its baseline after imports, JAX's start and the mesh,
against the checkpoint's size. The goal: about half the checkpoint (the
process's own shards, which on CPU devices live in host memory) plus the largest
single slice read at once, never the whole checkpoint. `--naive` adds the same
figure for reading every tensor whole (`safetensors.numpy.load_file`) and
placing it with `jax.device_put`, for contrast.

    python benchmarks/bench_weights.py --mib 320
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

import eqxdist as ed

WIDTH = 1024


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(WIDTH, 4 * WIDTH, use_bias=False, key=k1)
        self.down = eqx.nn.Linear(4 * WIDTH, WIDTH, use_bias=False, key=k2)


class Net(eqx.Module):
    layers: ed.Stacked
    head: eqx.nn.Linear

    def __init__(self, layers: int, key: jax.Array) -> None:
        keys = jax.random.split(key, layers + 1)
        self.layers = ed.Stacked(eqx.filter_vmap(Block)(keys[:layers]))
        self.head = eqx.nn.Linear(WIDTH, 8 * WIDTH, use_bias=False, key=keys[-1])


def write(directory: Path, layers: int) -> int:
    """The checkpoint, written tensor by tensor from NumPy (no model in memory)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {"head.weight": rng.normal(size=(8 * WIDTH, WIDTH)).astype(np.float32)}
    for i in range(layers):
        for name, shape in (("up", (4 * WIDTH, WIDTH)), ("down", (WIDTH, 4 * WIDTH))):
            tensors[f"layers.{i}.{name}.weight"] = rng.normal(size=shape).astype(
                np.float32
            )
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return sum(t.nbytes for t in tensors.values())


def child(directory: Path, layers: int, naive: bool) -> None:
    """One process of the launched pair: load, report its figures as JSON."""
    ed.initialize_distributed()
    mesh = ed.create_data_parallel_mesh()
    layout = ed.Layout(mesh, strategy="fsdp")
    like = eqx.filter_eval_shape(Net, layers, jax.random.key(0))
    specs = layout.model_specs(like)
    jax.block_until_ready(jax.device_put(np.zeros(8), jax.local_devices()[0]))
    base = _peak_mib()
    if naive:
        from jax.sharding import NamedSharding
        from safetensors.numpy import load_file

        whole = load_file(directory / "model.safetensors")
        up, down = (
            np.stack([whole[f"layers.{i}.{n}.weight"] for i in range(layers)])
            for n in ("up", "down")
        )
        model = eqx.tree_at(
            lambda m: (
                m.layers.layers.up.weight,
                m.layers.layers.down.weight,
                m.head.weight,
            ),
            like,
            (up, down, whole["head.weight"]),
        )
        model = jax.tree.map(
            lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), model, specs
        )
    else:
        model = ed.load_safetensors(directory, like, layout=layout)
    jax.block_until_ready(model)
    held = sum(
        s.data.nbytes for x in jax.tree.leaves(model) for s in x.addressable_shards
    )
    largest = max(
        s.data.nbytes for x in jax.tree.leaves(model) for s in x.addressable_shards
    )
    print(
        "WEIGHTS "
        + json.dumps(
            {
                "process": jax.process_index(),
                "peak_mib": _peak_mib() - base,
                "held_mib": held / 2**20,
                "largest_slice_mib": largest / 2**20,
            }
        ),
        flush=True,
    )


def run(mib: int, naive: bool = False) -> list[dict[str, float]]:
    layers = max(1, (mib - 32) // 32)  # 32 MiB per layer, 32 MiB head
    with tempfile.TemporaryDirectory() as tmp:
        size = write(Path(tmp), layers)
        rows = []
        for mode in ("load_safetensors", "naive") if naive else ("load_safetensors",):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "eqxdist.launch",
                    "-n",
                    "2",
                    "-d",
                    "4",
                    __file__,
                    "--child",
                    tmp,
                    "--layers",
                    str(layers),
                ]
                + (["--naive"] if mode == "naive" else []),
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode:
                raise RuntimeError(out.stdout + out.stderr)
            for line in out.stdout.splitlines():
                if "WEIGHTS " in line:
                    row = json.loads(line.split("WEIGHTS ", 1)[1])
                    rows.append({"mode": mode, "checkpoint_mib": size / 2**20, **row})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=320)
    parser.add_argument("--naive", action="store_true")
    parser.add_argument("--child", type=Path)
    parser.add_argument("--layers", type=int)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.layers, args.naive)
        return
    for row in run(args.mib, args.naive):
        print(
            f"{row['mode']:>17} process {row['process']}: peak +"
            f"{row['peak_mib']:.0f} MiB for a {row['checkpoint_mib']:.0f} MiB "
            f"checkpoint ({row['peak_mib'] / row['checkpoint_mib']:.2f}x); holds "
            f"{row['held_mib']:.0f} MiB of shards, largest slice "
            f"{row['largest_slice_mib']:.0f} MiB"
        )


if __name__ == "__main__":
    main()
