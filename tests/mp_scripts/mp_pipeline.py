"""Pipeline stages across processes, run by tests/layout/test_pipeline.py as
`python -m eqxdist.launch -n 2 -d 4 mp_pipeline.py OUT`: a `{"stage": 2, "data":
4}` mesh whose stage axis spans the processes (each process one stage), both
passing every row; GPipe, the interleaved schedule (2 chunks per stage) and
ZB-H1 train 3 steps each (`harness.train_pipeline`); process 0 writes the
final parameters to `OUT/<schedule>.npz`."""

import sys
from pathlib import Path

import eqxdist as ed

ed.initialize_distributed()

import common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import MP_SCHEDULES, train_pipeline  # noqa: E402

out = Path(sys.argv[1])
assert jax.process_count() == 2 and len(jax.devices()) == 8, "run under the launcher"
mesh = ed.create_device_mesh({"stage": 2, "data": 4})
# The stage axis spans the processes: each process's devices form one stage.
assert {d.process_index for d in mesh.devices[jax.process_index()]} == {
    jax.process_index()
}
for schedule in MP_SCHEDULES:
    state = train_pipeline(schedule)
    arrays = common.flat(state.model)
    if jax.process_index() == 0:
        np.savez(out / f"{schedule}.npz", **arrays)
