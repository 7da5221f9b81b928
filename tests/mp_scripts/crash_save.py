"""Save step 1 of `{"w": arange(4)}`, then die (`os._exit(9)`) in the middle of saving
step 2, as a killed or crashed job would. Run by tests/test_checkpoint.py:

    crash_save.py DIR orbax    die while Orbax writes, before it moves the data in
    crash_save.py DIR commit   die after the data is in place, before eqxdist marks
                               the step complete
"""

import os
import sys

import jax.numpy as jnp
import orbax.checkpoint as ocp

import eqxdist as ed
from eqxdist import _checkpoint

directory, where = sys.argv[1], sys.argv[2]
ed.save_checkpoint(directory, {"w": jnp.arange(4.0)}, step=1)


def crash(*args, **kwargs):
    os._exit(9)


if where == "orbax":
    ocp.PyTreeCheckpointHandler.finalize = crash
else:
    _checkpoint._write_atomically = crash
ed.save_checkpoint(directory, {"w": jnp.arange(4.0) + 10}, step=2)
