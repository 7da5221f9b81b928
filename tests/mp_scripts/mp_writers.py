"""Every process writes the same values through the writers; only process 0's
files may appear. Run as `python -m eqxdist.launch -n 2 -d 4 mp_writers.py OUT`."""

import sys
from pathlib import Path

import eqxdist as ed

ed.initialize_distributed()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

out = Path(sys.argv[1])
mesh = ed.create_data_parallel_mesh()
sharding = ed.create_data_parallel_sharding(mesh)
x = np.arange(32, dtype=np.float32).reshape(8, 4)
rows = slice(4 * jax.process_index(), 4 * (jax.process_index() + 1))
mean = jax.jit(jnp.mean, out_shardings=jax.NamedSharding(mesh, jax.P()))
with ed.MultiWriter(
    [ed.JsonlWriter(out / "m.jsonl"), ed.CsvWriter(out / "m.csv"),
     ed.TensorBoardWriter(out / "tb")]
) as writer:  # fmt: skip
    for step in range(3):
        global_x = ed.shard_batch(x[rows] * (step + 1), sharding)
        writer.write(step + 1, {"mean": mean(global_x)})
