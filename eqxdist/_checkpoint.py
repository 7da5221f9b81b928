"""Saving and restoring sharded state (a `TrainState`, a model, any pytree of arrays),
from one process or many, through Orbax.

Layout: `directory/<step>/` is an Orbax checkpoint of the state's array leaves (each
process writes only the shards it holds) plus `eqxdist_checkpoint.json`, which names
every leaf by its pytree path with its shape and dtype. That file is written last,
atomically, once every process has finished: a step without it is an interrupted save
and is never reported or restored.
"""

import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, Sharding
from jaxtyping import PyTree

from ._distributed import barrier
from ._mesh import create_data_parallel_mesh
from ._utils import is_array, is_array_like, path_str, typecheck

_MARKER = "eqxdist_checkpoint.json"
_FORMAT = "eqxdist-checkpoint"
_VERSION = 1
# Barrier names must never repeat; every process saves in the same order, so a
# per-process counter gives them all the same names.
_barrier_ids = itertools.count()


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """No (complete) checkpoint where one was asked for. Both a `FileNotFoundError`
    and a `ValueError` (a bad `directory` or `step` argument)."""


def _orbax() -> Any:
    # Imported on first use: Orbax takes a second or two to import, and most
    # programs that import eqxdist never save a checkpoint.
    import orbax.checkpoint as ocp

    return ocp


def _is_key(x: Any) -> bool:
    return bool(jnp.issubdtype(x.dtype, jax.dtypes.prng_key))


def _default_sharding() -> NamedSharding:
    """Where leaves without a sharding go: replicated over every device (of every
    process), the default data-parallel mesh."""
    return NamedSharding(create_data_parallel_mesh(), P())


def _savable(x: Any) -> Any:
    """`x` as Orbax should write it: a global `jax.Array` as it is (every process
    writes its own shards); anything else (NumPy values, in a multi-process run also
    arrays on this process's devices only) as a host value, written by process 0."""
    if isinstance(x, jax.Array) and (
        jax.process_count() == 1 or not x.is_fully_addressable
    ):
        return x
    return np.asarray(x)


def _complete_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(
        int(entry.name)
        for entry in root.iterdir()
        if entry.name.isdigit() and (entry / _MARKER).is_file()
    )


def _check_step(step: Any, caller: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise TypeError(
            f"{caller}: `step` must be an int; got {step!r} of type "
            f"{type(step).__name__}."
        )
    if step < 0:
        raise ValueError(f"{caller}: `step` must be >= 0; got {step}.")
    return int(step)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


@typecheck
def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The highest step with a complete checkpoint in `directory`, or `None` if there
    is none (or `directory` does not exist yet, as on a first run).

    Steps whose save was interrupted (by a crash, or a kill mid-save) are ignored.

    !!! Example

        ```python
        step = ed.latest_step("ckpt")
        if step is not None:
            state = ed.restore_checkpoint("ckpt", state, step=step)
        ```
    """
    steps = _complete_steps(Path(directory))
    return steps[-1] if steps else None


@typecheck
def save_checkpoint(
    directory: str | os.PathLike[str], state: PyTree[Any], *, step: int
) -> Path:
    """Save `state` as `directory/<step>`. Call it from every process at the same
    point of the program (it synchronises them).

    **Arguments:**

    - `directory`: the run's checkpoint directory (created if missing; on a cluster,
      a file system every process can see).
    - `state`: any pytree: a `TrainState`, a model, a dict of arrays. Its array
      leaves are saved, sharded or not; each process writes only the shards it
      holds (one copy of each replicated piece). PRNG keys are saved too. Leaves
      that are not global arrays (NumPy arrays, arrays on one local device) are
      saved as process 0 holds them. Non-array leaves (static fields, activation
      functions, Python numbers) are not saved: `restore_checkpoint` takes them from
      its `target`.
    - `step`: the training step, a non-negative int.

    **Returns:**

    The checkpoint's path, `directory/<step>`.

    **Raises:**

    `ValueError` if `directory/<step>` already holds a complete checkpoint, or
    `directory` is a file; `TypeError`/`ValueError` for a `step` that is not a
    non-negative int.

    The save is atomic: the step only counts as saved once every process has
    written its part, so a crash mid-save leaves `latest_step` and
    `restore_checkpoint` on the previous complete checkpoint, which stays intact.
    (An interrupted save of this step is cleaned up by the next save of it.)

    !!! Example

        ```python
        if step % 100 == 0:
            ed.save_checkpoint("ckpt", state, step=step)
        ```
    """
    step = _check_step(step, "save_checkpoint")
    ocp = _orbax()
    root = Path(directory).absolute()
    if root.exists() and not root.is_dir():
        raise ValueError(
            f"save_checkpoint: `directory` {str(root)!r} is a file; pass a directory."
        )
    target = root / str(step)
    if (target / _MARKER).is_file():
        raise ValueError(
            f"save_checkpoint: step {step} is already saved in {str(target)!r}; save "
            "under another step, or delete that directory first."
        )

    entries: list[dict[str, Any]] = []
    arrays: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not is_array(leaf):
            continue
        entry: dict[str, Any] = {
            "path": path_str(path),
            "shape": list(leaf.shape),
            "dtype": str(leaf.dtype),
        }
        if _is_key(leaf):
            # Orbax stores numbers: keep the key's bits and its implementation.
            entry["prng_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
            entry["key_data_shape"] = list(leaf.shape)
        arrays[f"leaf{len(entries)}"] = _savable(leaf)
        entries.append(entry)
    metadata = {
        "format": _FORMAT,
        "version": _VERSION,
        "step": step,
        "process_count": jax.process_count(),
        "leaves": entries,
    }

    run = next(_barrier_ids)
    if jax.process_index() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if target.exists():  # the leftover of an interrupted save of this step
            shutil.rmtree(target)
    barrier(f"eqxdist_checkpoint_{run}_start")
    # Orbax writes into a temporary directory and renames it when complete.
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        checkpointer.save(target, arrays)
    barrier(f"eqxdist_checkpoint_{run}_written")
    if jax.process_index() == 0:
        _write_atomically(target / _MARKER, json.dumps(metadata, indent=1))
    barrier(f"eqxdist_checkpoint_{run}_committed")
    return target


def _target_sharding(leaf: Any) -> Sharding:
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, Sharding) else _default_sharding()


def _mismatch(message: str, location: Path) -> ValueError:
    return ValueError(
        f"restore_checkpoint: `target` does not match the checkpoint in "
        f"{str(location)!r}: {message}"
    )


def _listed(paths: list[str]) -> str:
    shown = ", ".join(paths[:5])
    return shown + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


@typecheck
def restore_checkpoint(
    directory: str | os.PathLike[str],
    target: PyTree[Any],
    *,
    step: int | None = None,
) -> PyTree[Any]:
    """Load a checkpoint written by `save_checkpoint`, laid out as `target` asks.

    **Arguments:**

    - `directory`: the directory given to `save_checkpoint`.
    - `target`: a pytree with the structure of the saved state, e.g. a freshly
      created `TrainState` or the abstract one from `eqx.filter_eval_shape`. Each
      array leaf says where the restored array goes: a concrete array's
      `.sharding`, or a `jax.ShapeDtypeStruct`'s `sharding`; an abstract leaf with
      no sharding is replicated over all devices (of all processes), and a NumPy
      leaf comes back as a NumPy array. So a
      checkpoint saved under data parallelism restores FSDP-sharded and vice versa,
      on any number of devices or processes. Non-array leaves are taken from
      `target` as they are.
    - `step`: which step; default the latest complete one.

    **Returns:**

    A pytree like `target` holding the checkpoint's values.

    **Raises:**

    - `CheckpointNotFoundError` (a `FileNotFoundError` and `ValueError`) if
      `directory` does not exist, holds no complete checkpoint, or `step` is not
      one of its complete checkpoints; the message lists the steps there are.
    - `ValueError` naming the leaf paths if `target`'s array leaves are not the
      checkpoint's (missing or extra leaves, another shape or dtype).

    !!! Example

        ```python
        abstract = eqx.filter_eval_shape(ed.TrainState.create, model, opt, key)
        state = ed.restore_checkpoint("ckpt", abstract)  # latest step, replicated
        ```
    """
    ocp = _orbax()
    root = Path(directory).absolute()
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"restore_checkpoint: checkpoint directory {str(root)!r} does not exist."
        )
    complete = _complete_steps(root)
    if step is None:
        if not complete:
            raise CheckpointNotFoundError(
                f"restore_checkpoint: no complete checkpoint in {str(root)!r} (a "
                "step directory without its eqxdist_checkpoint.json is an "
                "interrupted save)."
            )
        step = complete[-1]
    elif _check_step(step, "restore_checkpoint") not in complete:
        state = "is incomplete (its save was interrupted)"
        if not (root / str(step)).exists():
            state = "does not exist"
        raise CheckpointNotFoundError(
            f"restore_checkpoint: step {step} in {str(root)!r} {state}; the complete "
            f"steps are {complete}."
        )
    location = root / str(step)
    metadata = json.loads((location / _MARKER).read_text())
    saved = {
        entry["path"]: (f"leaf{i}", entry) for i, entry in enumerate(metadata["leaves"])
    }

    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    wanted = {
        path_str(path): i
        for i, (path, leaf) in enumerate(leaves)
        if is_array_like(leaf)
    }
    missing = [p for p in wanted if p not in saved]
    extra = [p for p in saved if p not in wanted]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"array leaves not in the checkpoint: {_listed(missing)}")
        if extra:
            parts.append(f"saved leaves `target` has no array for: {_listed(extra)}")
        raise _mismatch("; ".join(parts) + ".", location)

    restore_args = {}
    for path, i in wanted.items():
        leaf = leaves[i][1]
        key, entry = saved[path]
        shape, dtype = tuple(leaf.shape), str(leaf.dtype)
        if shape != tuple(entry["shape"]) or dtype != entry["dtype"]:
            raise _mismatch(
                f"leaf {path} is {dtype}{list(shape)} in `target` but "
                f"{entry['dtype']}{entry['shape']} in the checkpoint.",
                location,
            )
        if isinstance(leaf, np.ndarray | np.generic):
            restore_args[key] = ocp.RestoreArgs(restore_type=np.ndarray)
        else:
            sharding = _target_sharding(leaf)
            try:
                sharding.shard_shape(shape)
            except ValueError as e:
                raise ValueError(
                    f"restore_checkpoint: the sharding of `target` leaf {path} does "
                    f"not fit its shape {list(shape)}: {e}"
                ) from None
            restore_args[key] = ocp.ArrayRestoreArgs(
                sharding=sharding,
                global_shape=tuple(entry.get("key_data_shape", shape)),
            )
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(
            location, args=ocp.args.PyTreeRestore(restore_args=restore_args)
        )

    out = [leaf for _, leaf in leaves]
    for path, i in wanted.items():
        key, entry = saved[path]
        value = restored[key]
        if "prng_impl" in entry:
            value = jax.random.wrap_key_data(value, impl=entry["prng_impl"])
        out[i] = value
    return jax.tree_util.tree_unflatten(treedef, out)
