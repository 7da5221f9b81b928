"""A multi-process training run in which process 1 fails at step 3, run by
tests/launch/test_launch.py as `python -m eqxdist.launch -n 2 -d 4 mp_fail.py OUT HOW`:
with HOW `raise` it raises a RuntimeError, with `exit` it calls `sys.exit(3)`.

Process 0 would train forever (stuck in a collective once process 1 is gone); it
also starts a child process. Every process id is written to `OUT/pids` so the test
can check that none survives the launcher."""

import sys
from pathlib import Path

import eqxdist as ed

ed.initialize_distributed()

import common  # noqa: E402
import jax  # noqa: E402

out, how = Path(sys.argv[1]), sys.argv[2]
common.record_pids(out)

step = common.make_step(ed.create_data_parallel_mesh())
state = common.make_state()
batch = common.local_rows(common.global_batches()[0])
for i in range(10**6):
    if i == 3 and jax.process_index() == 1:
        if how == "exit":
            print("process 1 exits with status 3", flush=True)
            sys.exit(3)
        raise RuntimeError("injected failure in process 1")
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    print(f"step {i} done", flush=True)
