"""Saving and restoring sharded state (a `TrainState`, a model, any pytree of arrays),
from one process or many, through Orbax. The on-disk format is described in
`files`; `CheckpointManager` (`manager`) writes the same."""

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, Sharding
from jaxtyping import PyTree

from .._mesh import create_data_parallel_mesh
from .._utils import check_not_consumed, is_array_like, path_str, typecheck
from . import files
from .writer import Writer, check_step, orbax


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """No (complete) checkpoint where one was asked for. Both a `FileNotFoundError`
    and a `ValueError` (a bad `directory` or `step` argument)."""


def _default_sharding() -> NamedSharding:
    """Where leaves without a sharding go: replicated over every device (of every
    process), the default data-parallel mesh."""
    return NamedSharding(create_data_parallel_mesh(), P())


@typecheck
def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The highest step with a complete checkpoint in `directory`, or `None` if there
    is none (or `directory` does not exist yet, as on a first run).

    Steps whose save was interrupted (by a crash, or a kill mid-save) are ignored,
    and so is anything else under `directory`: files, symlinks, names that are not
    a step as `str(step)` writes it (`007`, `step_7`, a non-ASCII digit).

    **Raises:**

    `ValueError` if `directory` is a file.

    !!! Example

        ```python
        step = ed.latest_step("ckpt")
        if step is not None:
            state = ed.restore_checkpoint("ckpt", state, step=step)
        ```
    """
    root = Path(directory).absolute()
    files.check_root(root, "latest_step")
    steps = files.complete_steps(root)
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

    - `ValueError` if `directory/<step>` already holds a complete checkpoint (or
      another save of this step finished first while this one ran: two saves of a
      step are never mixed), if `directory` or `directory/<step>` is a file, or if
      `state` was consumed (donated) by an earlier train step.
    - `TypeError`/`ValueError` for a `step` that is not a non-negative int.

    The save is atomic: the step only counts as saved once every process has
    written its part (Orbax's commit), so a crash mid-save leaves `latest_step`
    and `restore_checkpoint` on the previous complete checkpoint, which stays
    intact. The size and SHA-256 of every file are recorded, and
    `restore_checkpoint` checks them. Leftovers of saves that died are removed by
    the next save in `directory`.

    !!! Example

        ```python
        if step % 100 == 0:
            ed.save_checkpoint("ckpt", state, step=step)
        ```
    """
    step = check_step(step, "save_checkpoint")
    check_not_consumed(state, "save_checkpoint")
    root = Path(directory).absolute()
    files.check_root(root, "save_checkpoint")
    writer = Writer(
        root,
        max_to_keep=None,
        save_interval_steps=1,
        async_save=False,
        caller="save_checkpoint",
    )
    try:
        writer.save(step, state, "save_checkpoint")
    finally:
        writer.close()
    return root / str(step)


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
    - `ValueError` naming the step and the file if the checkpoint's files changed
      after the save (flipped bytes, truncated or deleted files): the size and
      SHA-256 of every file recorded at save are checked before anything is read.

    !!! Example

        ```python
        abstract = eqx.filter_eval_shape(ed.TrainState.create, model, opt, key)
        state = ed.restore_checkpoint("ckpt", abstract)  # latest step, replicated
        ```
    """
    ocp = orbax()
    root = Path(directory).absolute()
    files.check_root(root, "restore_checkpoint")
    step = _find_step(root, step)
    location = root / str(step)
    metadata = files.read_marker(location, step, "restore_checkpoint")
    saved = {
        entry["path"]: (f"leaf{i}", entry) for i, entry in enumerate(metadata["leaves"])
    }
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    wanted = _match_leaves(leaves, saved, location)
    restore_args = _restore_args(ocp, leaves, wanted, saved, location)
    # Before Orbax reads anything: corrupted bytes would restore as wrong values.
    files.verify(location, metadata, step, "restore_checkpoint")
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(
                files.item_directory(location, metadata),
                args=ocp.args.PyTreeRestore(restore_args=restore_args),
            )
        out = _place(restored, leaves, wanted, saved)
    except (OSError, ValueError, KeyError, TypeError) as e:
        # Files removed or changed where no checksum guards them (a v0.1
        # checkpoint), or a marker whose key description is not JAX's.
        raise ValueError(
            f"restore_checkpoint: checkpoint step {step} in {str(root)!r} is "
            f"corrupted: it cannot be read ({type(e).__name__}: {e}). Restore "
            "another step (`step=`) or save again."
        ) from e
    return jax.tree_util.tree_unflatten(treedef, out)


def _find_step(root: Path, step: int | None) -> int:
    """`step` if it is a complete checkpoint in `root`; by default the latest."""
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"restore_checkpoint: checkpoint directory {str(root)!r} does not exist."
        )
    complete = files.complete_steps(root)
    if step is None:
        if not complete:
            raise CheckpointNotFoundError(
                f"restore_checkpoint: no complete checkpoint in {str(root)!r} (a "
                "step directory without its eqxdist_checkpoint.json is an "
                "interrupted save)."
            )
        return complete[-1]
    if check_step(step, "restore_checkpoint") not in complete:
        state = "is incomplete (its save was interrupted)"
        if not (root / str(step)).exists():
            state = "does not exist"
        raise CheckpointNotFoundError(
            f"restore_checkpoint: step {step} in {str(root)!r} {state}; the complete "
            f"steps are {complete}."
        )
    return step


def _match_leaves(
    leaves: list[tuple[Any, Any]],
    saved: dict[str, tuple[str, dict[str, Any]]],
    location: Path,
) -> dict[str, int]:
    """The index in `leaves` of each array leaf, by path; its paths must be the
    saved ones."""
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
    return wanted


def _restore_args(
    ocp: Any,
    leaves: list[tuple[Any, Any]],
    wanted: dict[str, int],
    saved: dict[str, tuple[str, dict[str, Any]]],
    location: Path,
) -> dict[str, Any]:
    """Orbax's restore arguments per saved leaf: where `target`'s leaf puts it,
    once its shape and dtype are checked against the saved ones."""
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
    return restore_args


def _place(
    restored: dict[str, Any],
    leaves: list[tuple[Any, Any]],
    wanted: dict[str, int],
    saved: dict[str, tuple[str, dict[str, Any]]],
) -> list[Any]:
    """`target`'s leaves with each array leaf replaced by its restored value (a
    PRNG key rewrapped from its saved key data)."""
    out = [leaf for _, leaf in leaves]
    for path, i in wanted.items():
        key, entry = saved[path]
        value = restored[key]
        if "prng_impl" in entry:
            value = jax.random.wrap_key_data(value, impl=entry["prng_impl"])
        out[i] = value
    return out
