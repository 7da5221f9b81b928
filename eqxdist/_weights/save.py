"""`save_safetensors`: a model's array leaves in Hugging Face's file layout, one
tensor written once whatever the number of processes."""

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from .names import Entry, Renamer, check_unique, leaf_entries

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
METADATA = {"format": "pt"}


def shard_name(i: int, n: int) -> str:
    """Hugging Face's name of shard `i` (from 1) of `n`."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _plan_shards(
    tensors: list[tuple[str, int, int | None, int]], max_shard_bytes: int
) -> list[list[tuple[str, int, int | None, int]]]:
    """Tensors `(name, leaf, layer, bytes)` in order, cut into files of at most
    `max_shard_bytes` (a larger tensor alone in its own file)."""
    shards: list[list[tuple[str, int, int | None, int]]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor[3] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor[3]
    return shards


def host_value(x: Any, path: str) -> np.ndarray:
    """The whole value of an array leaf on this host: a sharded array spanning
    processes is gathered (every process takes part)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        raise ValueError(
            f"save_safetensors: the leaf {path} is abstract ({x.shape}, {x.dtype}); "
            "pass a model with values."
        )
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _clear(directory: Path) -> None:
    """Remove the files an earlier save left, so no stale shard or index is read."""
    for old in [*directory.glob("model-*-of-*.safetensors"), directory / SINGLE]:
        old.unlink(missing_ok=True)
    (directory / INDEX).unlink(missing_ok=True)


def _tensor_list(
    entries: list[Entry | None],
) -> list[tuple[str, int, int | None, int]]:
    tensors = []
    for i, entry in enumerate(entries):
        if entry is None:
            continue
        shape = tuple(entry.leaf.shape)
        itemsize = np.dtype(entry.leaf.dtype).itemsize
        per_tensor = int(np.prod(shape[1:] if entry.stacked else shape)) * itemsize
        for layer, name in enumerate(entry.names):
            tensors.append((name, i, layer if entry.stacked else None, per_tensor))
    return tensors


def save_safetensors(
    directory: str | os.PathLike[str],
    model: Any,
    *,
    names: Any = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write every array leaf of `model` as safetensors files in Hugging Face's
    layout, for `load_safetensors`, `transformers`, `safetensors.torch` and
    other tools.

    `model` is any pytree (an Equinox model), its leaves sharded or not, in one
    process or several. The files are `directory/model.safetensors` when every
    tensor fits in `max_shard_bytes`, else `model-00001-of-0000N.safetensors`, ...
    with `model.safetensors.index.json` (`{"metadata": {"total_size": bytes},
    "weight_map": {name: file}}`); every file's metadata is `{"format": "pt"}`.
    Files an earlier save left in `directory` under these names are removed.

    Names: a leaf's path joined by dots, as a PyTorch state dict names it
    (`blocks.3.lin.weight`, `head.weight`); the leaves of an `ed.Stacked` are
    named as the list of blocks it was built from, one tensor per layer without
    the layer axis (`layers.0.wq.weight`, `layers.1.wq.weight`, ...), so a model
    with a list of blocks and its `Stacked` twin write the same files. `names`
    renames: a sequence of `(pattern, template)`; the first pattern that
    `re.fullmatch`es a default name gives the name `match.expand(template)`;
    no match keeps the default.

    With several processes every process calls it (a sharded leaf is gathered
    tensor by tensor), process 0 writes each tensor once, and every process
    returns when the files are complete. Process 0 holds at most one file's
    tensors in host memory at a time (`max_shard_bytes`).

    **Raises:**

    `ValueError` for two leaves given one name, an abstract leaf or a
    `max_shard_bytes` below 1; `TypeError` for malformed `names`.

    !!! Example

        ```python
        ed.save_safetensors("out", model)  # layers.0.wq.weight, ...
        ed.save_safetensors("hf", model, names=[
            (r"layers\\.(\\d+)\\.wq\\.(.*)", r"model.layers.\\1.self_attn.q_proj.\\2"),
        ])
        ```
    """
    caller = "save_safetensors"
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int):
        raise TypeError(
            f"{caller}: `max_shard_bytes` must be an int; got {max_shard_bytes!r}."
        )
    if max_shard_bytes < 1:
        raise ValueError(
            f"{caller}: `max_shard_bytes` must be >= 1; got {max_shard_bytes}."
        )
    entries = leaf_entries(model, Renamer(names, caller))
    check_unique(entries, caller)
    directory = Path(directory)
    writer = jax.process_index() == 0
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
        _clear(directory)
    shards = _plan_shards(_tensor_list(entries), max_shard_bytes)
    files = (
        [SINGLE]
        if len(shards) == 1
        else [shard_name(i + 1, len(shards)) for i in range(len(shards))]
    )
    cache: tuple[int, np.ndarray] | None = None
    for file, shard in zip(files, shards, strict=True):
        arrays: dict[str, np.ndarray] = {}
        for name, i, layer, _ in shard:
            entry = entries[i]
            assert entry is not None
            if cache is None or cache[0] != i:
                cache = (i, host_value(entry.leaf, entry.path))
            value = cache[1] if layer is None else cache[1][layer]
            if writer:
                arrays[name] = np.require(value, requirements="C")
        if writer:
            save_file(arrays, directory / file, metadata=METADATA)
        del arrays
    if writer and len(files) > 1:
        index = {
            "metadata": {"total_size": sum(t[3] for s in shards for t in s)},
            "weight_map": {
                t[0]: f for f, s in zip(files, shards, strict=True) for t in s
            },
        }
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("eqxdist.save_safetensors")
