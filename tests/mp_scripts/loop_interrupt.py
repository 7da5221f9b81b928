"""`train_loop` with checkpoints under `eqxdist.launch`, stopped by Ctrl-C (the
launcher passes SIGINT on to every process); run by tests/launch/test_launch.py:

    loop_interrupt.py CKPT

Prints `pid P step S` as it makes the batch of each step, slowly, so that the
signal lands in the middle of the run; the loop saves the step every process
stops at and exits with status 130. Prints `not reached` if it returns."""

import os
import sys
import time

import eqxdist as ed

ed.initialize_distributed()

import common  # noqa: E402
import numpy as np  # noqa: E402


def batch(step: int) -> dict[str, np.ndarray]:
    print(f"pid {os.getpid()} step {step}", flush=True)
    time.sleep(0.3)
    return common.local_rows(common.global_batches()[step % common.STEPS])


mesh = ed.create_data_parallel_mesh()
train_step = ed.make_train_step(common.loss_fn, common.OPTIMIZER, mesh, strategy="dp")
with ed.CheckpointManager(sys.argv[1], save_interval_steps=1000) as manager:
    ed.train_loop(
        train_step, common.make_state(), batch, 100, checkpoints=manager,
        log_every=1000, progress=False,
    )  # fmt: skip
print("not reached", flush=True)
