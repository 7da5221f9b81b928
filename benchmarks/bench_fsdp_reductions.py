"""FSDP gradient reductions alone: per-leaf reduce-scatters, one combined all-reduce
and one flat reduce-scatter, on the gradients of the transformer's FSDP step.

The shapes are those of the reduce-scatters in the compiled eqxdist FSDP step of
`bench_parallel.py`. Each form runs as its own `jax.jit(jax.shard_map(...))`
program on 8 simulated CPU devices:

- `per-leaf reduce-scatters`: one `psum_scatter` per gradient (eqxdist's gather
  VJP; XLA:CPU combines no reduce-scatters);
- `combined all-reduce + slices`: `psum` + `dynamic_slice` per gradient, the form
  GSPMD gives a hand-written `jax.jit` step, which XLA:CPU's all-reduce combiner
  merges into one all-reduce moving the full gradients;
- `flat reduce-scatter`: every gradient as `(devices, elements)` rows,
  concatenated, one `psum_scatter`, split.

Prints the collectives of each compiled program and the min (median) time of
`--repeats` interleaved rounds of 5 calls.

    python benchmarks/bench_fsdp_reductions.py [--repeats 40]
"""

import argparse
import os
import re
import statistics
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import bench_parallel
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed

N = 8


def per_leaf(grads: list[Any]) -> list[Any]:
    return [jax.lax.psum_scatter(g, "data", tiled=True) for g in grads]


def combined(grads: list[Any]) -> list[Any]:
    index = jax.lax.axis_index("data")
    return [
        jax.lax.dynamic_slice_in_dim(
            jax.lax.psum(g, "data"), index * (g.shape[0] // N), g.shape[0] // N
        )
        for g in grads
    ]


def flat(grads: list[Any]) -> list[Any]:
    rows = jnp.concatenate([g.reshape(N, -1) for g in grads], axis=1)
    out = jax.lax.psum_scatter(rows, "data", scatter_dimension=0, tiled=False)
    parts, offset = [], 0
    for g in grads:
        size = g.size // N
        parts.append(out[offset : offset + size].reshape(-1, *g.shape[1:]))
        offset += size
    return parts


def gradient_shapes() -> list[tuple[int, ...]]:
    """Shard shapes of the gradients the eqxdist FSDP step reduce-scatters."""
    setup = bench_parallel._setup(bench_parallel.DEFAULT_CONFIG)
    step = bench_parallel._eqxdist(setup, bench_parallel.LAYOUTS["fsdp"])
    text = step["compiled"].as_text()
    found = re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} reduce-scatter\(", text)
    return [tuple(int(d) for d in dims.split(",")) for dims in found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    mesh = ed.create_device_mesh({"data": N})
    # Each device holds its own full gradient: N full gradients stacked, split.
    grads = [
        jax.device_put(
            np.ones((N * N * s[0], *s[1:]), np.float32),
            NamedSharding(mesh, P("data")),
        )
        for s in gradient_shapes()
    ]
    kib = sum(g.nbytes for g in grads) / N / 1024
    print(f"{len(grads)} gradients, {kib:.0f} KiB per device, {N} CPU devices")
    forms = {}
    for name, reduce in (
        ("per-leaf reduce-scatters", per_leaf),
        ("combined all-reduce + slices", combined),
        ("flat reduce-scatter", flat),
    ):
        fn = jax.jit(
            jax.shard_map(
                lambda gs, reduce=reduce: reduce([g * 1.0 for g in gs]),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P("data"),
                check_vma=False,
            )
        )
        counts = ed.count_collectives(fn.lower(grads).compile())
        print(f"{name}: {', '.join(f'{v} {k}' for k, v in counts.items() if v)}")
        jax.block_until_ready(fn(grads))
        forms[name] = fn
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.repeats):
        for name, fn in forms.items():
            start = time.perf_counter()
            for _ in range(5):
                out = fn(grads)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / 5)
    for name, t in times.items():
        print(
            f"{name}: min {1e3 * min(t):.2f} ms, median "
            f"{1e3 * statistics.median(t):.2f} ms"
        )


if __name__ == "__main__":
    main()
