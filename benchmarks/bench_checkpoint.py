"""What the checksums of eqxdist checkpoints cost, side by side in one process.

For a state of `--mib` MiB (float32 arrays on 8 simulated CPU devices), measures:

1. save: `save_checkpoint` (Orbax write + SHA-256 of every file before the commit)
   against the SHA-256 pass alone over the same files (`files.checksums`);
2. restore: `restore_checkpoint` (checksums verified, then Orbax reads) against the
   verification pass alone (`files.verify`).

Reports seconds per GiB of each and the checksums' share of the total. Files are
read back from the page cache (they were just written), so this is the hashing
cost; on a network file system the extra read of every file counts as well.

    python benchmarks/bench_checkpoint.py --mib 512
"""

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed
from eqxdist._checkpoint import files


def best_of(repeats: int, fn) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(mib: int, repeats: int) -> dict[str, float]:
    mesh = ed.create_data_parallel_mesh()
    rows = mib * 2**20 // 4 // 1024 // 8 * 8
    state = {
        f"w{i}": jax.device_put(
            jax.random.normal(jax.random.key(i), (rows // 4, 1024)),
            NamedSharding(mesh, P("data")),
        )
        for i in range(4)
    }
    jax.block_until_ready(state)
    gib = sum(x.nbytes for x in state.values()) / 2**30
    root = Path(tempfile.mkdtemp())
    steps = iter(range(10**6))

    def save() -> None:
        ed.save_checkpoint(root, state, step=next(steps))

    save_time = best_of(repeats, save)
    location = root / str(ed.latest_step(root))
    hash_time = best_of(repeats, lambda: files.checksums(location / files.ITEM))
    restore_time = best_of(
        repeats, lambda: jax.block_until_ready(ed.restore_checkpoint(root, state))
    )
    metadata = files.read_marker(location, 0, "bench")
    verify_time = best_of(repeats, lambda: files.verify(location, metadata, 0, "bench"))
    shutil.rmtree(root)
    jnp.zeros(()).block_until_ready()
    return {
        "GiB": gib,
        "save s/GiB": save_time / gib,
        "checksums at save s/GiB": hash_time / gib,
        "restore s/GiB": restore_time / gib,
        "verification at restore s/GiB": verify_time / gib,
        "share at save": hash_time / save_time,
        "share at restore": verify_time / restore_time,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for name, value in run(args.mib, args.repeats).items():
        print(f"{name:32s} {value:8.3f}")


if __name__ == "__main__":
    main()
