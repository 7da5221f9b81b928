"""`load_safetensors`: each leaf read from its tensors, only the slices this
process's devices hold, through the files' memory maps."""

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from safetensors import safe_open

from .._layout.layout import Layout
from .._utils import flatten_up_to
from .names import Entry, Renamer, check_unique, leaf_entries
from .save import INDEX, SINGLE

CALLER = "load_safetensors"


def _weight_map(path: Path) -> tuple[dict[str, Path], str]:
    """Every tensor's file under `path` (a directory with an index or one
    `model.safetensors`, or a file), and what was read, for messages."""
    if path.is_dir() and (path / INDEX).exists():
        index = json.loads((path / INDEX).read_text())
        return {k: path / v for k, v in index["weight_map"].items()}, str(path / INDEX)
    if path.is_dir():
        path = path / SINGLE
    if not path.is_file():
        raise ValueError(
            f"{CALLER}: no checkpoint at {str(path)!r}; pass a directory holding "
            f"{INDEX} or {SINGLE}, or a .safetensors file."
        )
    with safe_open(path, framework="numpy") as f:
        return dict.fromkeys(f.keys(), path), str(path)


def _check(entry: Entry, files: dict[str, Path], source: str) -> None:
    """A `ValueError` for a tensor of `entry` that is missing or of another shape."""
    shape = tuple(entry.leaf.shape[1:] if entry.stacked else entry.leaf.shape)
    for name in entry.names:
        if name not in files:
            raise ValueError(
                f"{CALLER}: no tensor {name!r} in {source} for the leaf "
                f"{entry.path} (shape {shape}); the checkpoint has "
                f"{len(files)} tensors, e.g. {sorted(files)[:3]}. Map names with "
                "`names=[(pattern, template)]`."
            )
        with safe_open(files[name], framework="numpy") as f:
            found = tuple(f.get_slice(name).get_shape())
        if found != shape:
            raise ValueError(
                f"{CALLER}: tensor {name!r} in {files[name]} has shape {found}; "
                f"the leaf {entry.path} expects {shape}"
                + (
                    " per layer (its Stacked's layer axis aside)."
                    if entry.stacked
                    else "."
                )
            )


def _read(file: Path, name: str, index: Sequence[slice]) -> np.ndarray:
    """`index` of tensor `name`: only these bytes of the file are touched, and
    the map is dropped once they are copied."""
    with safe_open(file, framework="numpy") as f:
        part = f.get_slice(name)
        if not part.get_shape():
            return np.asarray(f.get_tensor(name))
        return np.array(part[tuple(index)])


def _reader(entry: Entry, files: dict[str, Path]) -> Any:
    dtype = np.dtype(entry.leaf.dtype)
    shape = tuple(entry.leaf.shape)

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        if not entry.stacked:
            value = _read(files[entry.names[0]], entry.names[0], index)
        else:
            layers = range(*index[0].indices(shape[0]))
            value = np.stack(
                [
                    _read(files[entry.names[i]], entry.names[i], index[1:])
                    for i in layers
                ]
            )
        return value if value.dtype == dtype else value.astype(dtype)

    return callback


def load_safetensors(
    path: str | os.PathLike[str],
    like: Any,
    *,
    names: Any = None,
    layout: Layout | None = None,
) -> Any:
    """A model of `like`'s structure with every array leaf read from safetensors
    files written in Hugging Face's layout (by `save_safetensors`, `transformers`,
    `safetensors.torch`, ...).

    **Arguments:**

    - `path`: a directory holding `model.safetensors.index.json` (shards) or one
      `model.safetensors`, or a `.safetensors` file.
    - `like`: the model to fill; its array leaves may be abstract, e.g.
      `eqx.filter_eval_shape(Model, key)`. Each is read from the tensor named as
      `save_safetensors` names it (an `ed.Stacked`'s leaf from one tensor per
      layer), cast to the leaf's dtype. Other leaves are kept.
    - `names`: `(pattern, template)` pairs renaming the default names, as for
      `save_safetensors`.
    - `layout`: an `ed.Layout`; each leaf is placed as `layout.model_specs(like)`
      says. Without one, on this process's first device.

    Each process reads only the parts of each tensor that its devices hold
    (`jax.make_array_from_callback`), through the file's memory map, opened
    per part: a model loaded under FSDP over `n` processes costs each about
    its `1/n` share of host memory plus the largest single slice, never the
    whole checkpoint. Save then load is bit-exact for every dtype.

    **Raises:**

    `ValueError` for a missing checkpoint, a missing tensor or a tensor whose
    shape differs from its leaf's (naming the tensor, its file, the leaf's path
    and both shapes), or two leaves given one name.
    """
    if layout is not None and not isinstance(layout, Layout):
        raise TypeError(
            f"{CALLER}: `layout` must be an ed.Layout or None; got {layout!r}."
        )
    entries = leaf_entries(like, Renamer(names, CALLER))
    check_unique(entries, CALLER)
    files, source = _weight_map(Path(path))
    for entry in entries:
        if entry is not None:
            _check(entry, files, source)
    if layout is None:
        specs: list[Any] = [None] * len(entries)
    else:
        specs = flatten_up_to(like, layout.model_specs(like))
    default = SingleDeviceSharding(jax.local_devices()[0])
    leaves = []
    for entry, leaf, spec in zip(entries, jax.tree.leaves(like), specs, strict=True):
        if entry is None:
            leaves.append(leaf)
            continue
        sharding = default if layout is None else NamedSharding(layout.mesh, spec)
        leaves.append(
            jax.make_array_from_callback(
                tuple(leaf.shape), sharding, _reader(entry, files), dtype=leaf.dtype
            )
        )
    return jax.tree.unflatten(jax.tree.structure(like), leaves)
