"""`BatchLoader` across processes, run by tests/data/test_loader_mp.py as
`python -m eqxdist.launch -n 2 -d 4 mp_loader.py OUT`.

Each process writes `OUT/loader_<process>.json`: per mesh, the global batches it
saw (gathered from both processes) and every `indices` its source was asked for."""

import json
import sys
from pathlib import Path

import eqxdist as ed

ed.initialize_distributed()

import common  # noqa: E402
import jax  # noqa: E402
from common import (  # noqa: E402
    LOADER_BATCH as BATCH,
    LOADER_DATA as DATA,
    LOADER_MESHES as MESHES,
    LOADER_ROWS as ROWS,
    LOADER_SEED as SEED,
)


class Recording:
    def __init__(self):
        self.calls = []

    def __len__(self):
        return ROWS

    def __getitem__(self, indices):
        self.calls.append(indices.tolist())
        return {k: v[indices] for k, v in DATA.items()}


def gathered(batch):
    return {k: common.host(v).tolist() for k, v in batch.items()}


out = {}
for name, (shape, data_axis) in MESHES.items():
    mesh = ed.create_device_mesh(shape)
    source = Recording()
    with ed.BatchLoader(
        source, BATCH, mesh, data_axis=data_axis, seed=SEED, prefetch=2
    ) as loader:
        batches = {step: gathered(loader.batch(step)) for step in range(5)}
        calls = list(source.calls)
        stream = []
        for step, batch in loader.iterate(3):
            stream.append([step, gathered(batch)])
            if step == 6:
                break
    out[name] = {"batches": batches, "calls": calls, "stream": stream}

path = Path(sys.argv[1]) / f"loader_{jax.process_index()}.json"
path.write_text(json.dumps(out))
