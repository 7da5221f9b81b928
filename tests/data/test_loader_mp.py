"""BatchLoader on 2 processes x 4 devices (real processes, `eqxdist.launch`): each
process asks its source only for its own rows, and the global batches equal those
of 1 process x 8 devices and of NumPy indexing."""

import json

import jax
import numpy as np
import pytest
from harness import MP_SCRIPTS, launch
from mp_scripts.common import (  # mp_loader.py's
    LOADER_BATCH as BATCH,
    LOADER_DATA as DATA,
    LOADER_MESHES as MESHES,
    LOADER_ROWS as ROWS,
    LOADER_SEED as SEED,
)

import eqxdist as ed

SCRIPT = MP_SCRIPTS / "mp_loader.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("mp_loader")
    result = launch(SCRIPT, out)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return [json.loads((out / f"loader_{p}.json").read_text()) for p in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MESHES))
def test_2x4_batches_equal_1x8_and_each_process_reads_its_own_rows(runs, name):
    shape, data_axis = MESHES[name]
    mesh = ed.create_device_mesh(shape)
    loader = ed.BatchLoader(DATA, BATCH, mesh, data_axis=data_axis, seed=SEED)
    for process, run in enumerate(runs):
        got = run[name]
        for step in range(5):
            rows = np.random.default_rng([SEED, step // 2]).permutation(ROWS)[
                (step % 2) * BATCH : (step % 2 + 1) * BATCH
            ]
            np.testing.assert_array_equal(loader.indices(step), rows)
            for key in DATA:
                want = DATA[key][rows]
                np.testing.assert_array_equal(np.asarray(loader.batch(step)[key]), want)
                np.testing.assert_array_equal(got["batches"][str(step)][key], want)
            # One read per step, of this process's rows only (all of them when
            # the processes are replicas along "model").
            own = rows if name == "model_data" else np.split(rows, 2)[process]
            assert got["calls"][step] == own.tolist()
        assert len(got["calls"]) == 5
        assert [step for step, _ in got["stream"]] == [3, 4, 5, 6]
        for step, batch in got["stream"]:
            for key in DATA:
                np.testing.assert_array_equal(
                    batch[key], DATA[key][loader.indices(step)]
                )
    assert jax.process_count() == 1
