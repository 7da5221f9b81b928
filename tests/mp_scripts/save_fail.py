"""An asynchronous save into a directory this process may not write, run by
tests/checkpoint/test_manager.py:

    save_fail.py DIR

Every directory creation under DIR's temporary names fails with EACCES (what a
user without write permission gets; the tests run as root, for whom `chmod` does
not deny anything). Prints the error the manager raises, then `done`; the process
must then exit at once (Orbax's background threads must not hold it)."""

import errno
import os
import sys

import jax.numpy as jnp

import eqxdist as ed

directory = sys.argv[1]
manager = ed.CheckpointManager(directory, async_save=True)
_mkdir = os.mkdir


def refusing_mkdir(path, *args, **kwargs):  # type: ignore[no-untyped-def]
    if ".orbax-checkpoint-tmp" in os.fspath(path):
        raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
    return _mkdir(path, *args, **kwargs)


os.mkdir = refusing_mkdir
try:
    manager.save(1, {"w": jnp.ones(1000)})
    manager.close()
except PermissionError as e:
    print("error:", e, *getattr(e, "__notes__", []), flush=True)
print("done", flush=True)
