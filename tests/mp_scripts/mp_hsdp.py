"""HSDP across processes, run by tests/layout/test_layout.py as
`python -m eqxdist.launch -n 2 -d 4 mp_hsdp.py OUT`: a `{"replica": 2, "data": 4}`
mesh whose replica axis spans the processes (devices ordered by process), each
process passing its own rows; DP and FSDP (sharded within a process, replicated
across) train `STEPS` steps; process 0 writes the final parameters to
`OUT/{dp,fsdp}.npz`."""

import sys
from pathlib import Path

import eqxdist as ed

ed.initialize_distributed()

import common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import train_hsdp  # noqa: E402

out = Path(sys.argv[1])
assert jax.process_count() == 2 and len(jax.devices()) == 8, "run under the launcher"
mesh = ed.create_device_mesh({"replica": 2, "data": 4})
# The replica axis spans the processes: each process's devices form one replica.
assert {d.process_index for d in mesh.devices[jax.process_index()]} == {
    jax.process_index()
}
half = slice(jax.process_index() * 16, (jax.process_index() + 1) * 16)
for strategy in ("dp", "fsdp"):
    state = train_hsdp(strategy, half)  # this process's rows
    arrays = common.flat(state.model)
    if jax.process_index() == 0:
        np.savez(out / f"{strategy}.npz", **arrays)
