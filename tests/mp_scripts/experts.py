"""Expert parallelism across processes, run by tests/experts/test_expert_mp.py as
`python -m eqxdist.launch -n 2 -d 4 experts.py OUT`: a `{"data": 8}` mesh whose
data axis, and so the experts split over it, spans the processes (devices ordered
by process), each process passing its own rows; `harness.train_experts` trains
the MoE model 2 steps (experts over "data", FSDP for the rest); process 0 writes
the final parameters to `OUT/experts.npz`."""

import sys
from pathlib import Path

import eqxdist as ed

ed.initialize_distributed()

import common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import MOE_E, train_experts  # noqa: E402

out = Path(sys.argv[1])
assert jax.process_count() == 2 and len(jax.devices()) == 8, "run under the launcher"
half = slice(jax.process_index() * 16, (jax.process_index() + 1) * 16)
state = train_experts(half)  # this process's rows
# Each process holds only its own 4 of the experts: the tokens crossed processes.
w_in = state.model.moe.w_in
assert len(w_in.addressable_shards) == 4, w_in.sharding
assert {s.data.shape[0] for s in w_in.addressable_shards} == {MOE_E // 8}
arrays = common.flat(state.model)
if jax.process_index() == 0:
    np.savez(out / "experts.npz", **arrays)
