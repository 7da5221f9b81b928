"""Map-style data sources: what `BatchLoader` reads rows from, and the checks that
every read returns what was asked for."""

from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from .._utils import is_array, path_str
from .grain import grain_source


@runtime_checkable
class Source(Protocol):
    """A map-style data set: `len(source)` rows, `source[indices]` the rows
    `indices` (a 1-d `np.ndarray` of `int64`) as a pytree of arrays with
    `len(indices)` rows each."""

    def __len__(self) -> int: ...

    def __getitem__(self, indices: np.ndarray) -> Any: ...


class ArraySource:
    """A pytree of arrays sharing their leading dimension, read by fancy indexing
    (so an `np.memmap` leaf reads only the rows asked for from disk)."""

    def __init__(self, tree: Any, caller: str) -> None:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        if not leaves:
            raise ValueError(f"{caller}: `source` has no array leaves; pass data.")
        arrays = []
        for path, leaf in leaves:
            if not is_array(leaf):
                raise TypeError(
                    f"{caller}: `source` leaf {path_str(path)} is a "
                    f"{type(leaf).__name__}; a pytree source must hold only arrays "
                    "(NumPy arrays, `np.memmap`s)."
                )
            if np.ndim(leaf) == 0:
                raise ValueError(
                    f"{caller}: `source` leaf {path_str(path)} is 0-d; every leaf "
                    "needs a leading (row) dimension."
                )
            # A jax.Array leaf is copied to the host once, not gathered per batch.
            arrays.append(leaf if isinstance(leaf, np.ndarray) else np.asarray(leaf))
        paths = [path_str(path) for path, _ in leaves]
        lengths = dict(zip(paths, map(len, arrays), strict=True))
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"{caller}: the leaves of `source` have unequal leading dimensions "
                f"{lengths}; every leaf must have one row per example."
            )
        self._arrays = arrays
        self._treedef = jax.tree.structure(tree)
        self._length = len(arrays[0])

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, indices: np.ndarray) -> Any:
        return jax.tree.unflatten(self._treedef, [a[indices] for a in self._arrays])


def as_source(source: Any, caller: str) -> Source:
    """`source` as a `Source`: a pytree of arrays is wrapped in an `ArraySource`, a
    Grain `MapDataset` in a `GrainSource`; any other object with `__len__` and
    `__getitem__` is used as it is."""
    leaves = jax.tree.leaves(source)
    if is_array(source) or not (len(leaves) == 1 and leaves[0] is source):
        return ArraySource(source, caller)
    grain = grain_source(source)
    if grain is not None:
        return grain
    if isinstance(source, Source):
        return source
    raise TypeError(
        f"{caller}: `source` is a {type(source).__name__}, which is neither a pytree "
        "of arrays nor an object with `__len__` and `__getitem__(indices)`."
    )


def check_read(rows: Any, count: int, step: int, caller: str) -> Any:
    """`rows`, as the source returned them for `count` indices of `step`, with every
    leaf a NumPy array; a `ValueError` naming the step and the leaf otherwise."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(rows)
    if not leaves:
        raise ValueError(
            f"{caller}: the source returned no arrays for the {count} rows of step "
            f"{step}; `__getitem__(indices)` must return a pytree of arrays."
        )
    out = []
    for path, leaf in leaves:
        if not is_array(leaf) or np.ndim(leaf) == 0 or len(leaf) != count:
            seen = (
                f"shape {np.shape(leaf)}"
                if is_array(leaf)
                else f"a {type(leaf).__name__}"
            )
            raise ValueError(
                f"{caller}: the source returned {seen} at leaf {path_str(path)} for "
                f"the {count} rows of step {step}; `__getitem__(indices)` must return "
                f"arrays with len(indices) = {count} rows."
            )
        out.append(np.asarray(leaf))
    return jax.tree.unflatten(treedef, out)
