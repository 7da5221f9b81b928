"""Save steps 1, 2, 3, ... of a 4 MiB state through a `CheckpointManager` until
killed; run by tests/checkpoint/test_checkpoint.py, which SIGKILLs it at random moments.

    save_loop.py DIR sync|async

Step `s` holds `s` in every element, so a restored checkpoint shows at once whether
it is whole. Prints `step s` once `save(s, ...)` has returned."""

import sys

import jax.numpy as jnp

import eqxdist as ed

directory, mode = sys.argv[1], sys.argv[2]
with ed.CheckpointManager(directory, max_to_keep=2, async_save=mode == "async") as m:
    step = (m.latest_step() or 0) + 1
    while True:
        state = {"w": jnp.full((1024, 1024), step, jnp.float32), "s": jnp.int32(step)}
        m.save(step, state)
        print(f"step {step}", flush=True)
        step += 1
