"""One side of a race: prints `ready`, waits for a line on stdin, then saves
`{"a": full(VALUE), "b": ..., "c": ...}` as step 5 of DIR. Prints `saved`, or `lost:`
and the error (which must be a `ValueError`). Run twice at once by
tests/checkpoint/test_checkpoint.py.

    save_race.py DIR VALUE
"""

import sys

import jax.numpy as jnp

import eqxdist as ed

directory, value = sys.argv[1], float(sys.argv[2])
state = {name: jnp.full((512, 1024), value) for name in ("a", "b", "c")}
jnp.zeros(()).block_until_ready()
print("ready", flush=True)
sys.stdin.readline()
try:
    ed.save_checkpoint(directory, state, step=5)
    print("saved", flush=True)
except ValueError as e:
    print(f"lost: {e}", flush=True)
