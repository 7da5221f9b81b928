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
        return np.asarray(part[tuple(index)])


def _reader(entry: Entry, files: dict[str, Path]) -> Any:
    dtype = np.dtype(entry.leaf.dtype)
    shape = tuple(entry.leaf.shape)

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        if not entry.stacked:
            value = _read(files[entry.names[0]], entry.names[0], index)
            return value if value.dtype == dtype else value.astype(dtype)
        layers = range(*index[0].indices(shape[0]))
        inner = tuple(
            len(range(*s.indices(n))) for s, n in zip(index[1:], shape[1:], strict=True)
        )
        out = np.empty((len(layers), *inner), dtype)
        for j, i in enumerate(layers):  # each layer's slice straight into place
            out[j] = _read(files[entry.names[i]], entry.names[i], index[1:])
        return out

    return callback


def _build(shape: tuple[int, ...], sharding: Any, read: Any) -> jax.Array:
    """`jax.make_array_from_callback`, one device at a time: each slice is on its
    device before the next is read, so at most one slice is in host memory
    beside the shards (the callback form reads every local slice first). A
    slice replicated on several devices is read once."""
    arrays = []
    last: tuple[Any, jax.Array] | None = None
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)
        if last is None or last[0] != key:
            last = (key, jax.device_put(read(index), device))
            arrays.append(last[1])
        else:
            arrays.append(jax.device_put(last[1], device))
        jax.block_until_ready(arrays[-1])
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


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

    Each process reads only the parts of each tensor that its devices hold,
    one device's slice at a time, through the file's memory map, opened per
    slice: a model loaded under FSDP over `n` processes costs each about
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
        leaves.append(_build(tuple(leaf.shape), sharding, _reader(entry, files)))
    return jax.tree.unflatten(jax.tree.structure(like), leaves)
