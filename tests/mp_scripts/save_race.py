"""One side of a race, for as many trials as it is sent: builds
`{"a": full(VALUE), "b": ..., "c": ...}`, prints `ready`, then for each line DIR
on stdin saves that state as step 5 of DIR and prints `saved`, or `lost:` and the
error (which must be a `ValueError`). Ends at the end of stdin. Run twice at once
by tests/checkpoint/test_checkpoint.py; one process runs every trial, so the
trials pay JAX's and Orbax's start once.

    save_race.py VALUE
"""

import sys

import jax.numpy as jnp

import eqxdist as ed

value = float(sys.argv[1])
state = {name: jnp.full((512, 1024), value) for name in ("a", "b", "c")}
jnp.zeros(()).block_until_ready()
print("ready", flush=True)
for line in sys.stdin:
    try:
        ed.save_checkpoint(line.strip(), state, step=5)
        print("saved", flush=True)
    except ValueError as e:
        print(f"lost: {e}", flush=True)
