"""An ordinary multi-process training loop, one that knows nothing of preemption (no
`CheckpointManager`, no preemption sync point), run by tests/launch/test_launch.py as
`python -m eqxdist.launch -n 2 -d 2 ordinary_train.py OUT [STEPS [FAILURES]]`: it
trains STEPS steps (default: forever); while `EQXDIST_RESTART_COUNT` is below
FAILURES (default 0), process 1 exits with status 3 after step 1 instead.

Under `jax.distributed` JAX catches SIGTERM itself (its preemption notice), so such a
script would not end when the launcher passes a SIGTERM on. Every process id (and a
child process of process 0) is written to `OUT/pids`."""

import os
import sys
from pathlib import Path

import eqxdist as ed

ed.initialize_distributed()

import common  # noqa: E402
import jax  # noqa: E402

out = Path(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10**6
failures = int(sys.argv[3]) if len(sys.argv) > 3 else 0
fail = jax.process_index() == 1 and int(os.environ["EQXDIST_RESTART_COUNT"]) < failures
common.record_pids(out)

step = common.make_step(ed.create_data_parallel_mesh())
state = common.make_state()
batch = common.local_rows(common.global_batches()[0])
for i in range(steps):
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    print(f"step {i} done", flush=True)
    if fail and i == 1:
        print("process 1 exits with status 3", flush=True)
        sys.exit(3)
print(f"trained {steps} steps", flush=True)
