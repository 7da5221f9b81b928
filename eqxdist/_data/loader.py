"""`BatchLoader`: the global batch of every step as a pure function of
`(seed, step)`, read by each process for its own devices only."""

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jaxtyping import PyTree

from .._layout.layout import Layout, check_layout, resolve_layout
from .._utils import (
    Closing,
    checked_first,
    plural,
    typecheck,
)
from .reader import Reader
from .sources import as_source, check_read


def local_positions(sharding: NamedSharding, rows: int) -> np.ndarray:
    """The positions in a global batch of `rows` rows that this process's devices
    hold, in increasing order: the order `jax.make_array_from_process_local_data`
    expects the process's rows in."""
    blocks = {
        (index[0].start or 0, rows if index[0].stop is None else index[0].stop)
        for index in sharding.addressable_devices_indices_map((rows,)).values()
        if index is not None
    }
    return np.concatenate([np.arange(a, b) for a, b in sorted(blocks)])


class _Permutations:
    """The row order of each epoch, `np.random.default_rng([seed, epoch])`'s
    permutation, cached for the two latest epochs (the consumer's and the
    read-ahead's at an epoch boundary): drawing one costs O(len(source))."""

    def __init__(self, size: int, seed: int, shuffle: bool) -> None:
        self._size, self._seed, self._shuffle = size, seed, shuffle
        self._cache: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def rows(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The rows at `positions` (taken modulo the size) of `epoch`'s order."""
        positions = positions % self._size
        if not self._shuffle:
            return positions
        with self._lock:
            order = self._cache.get(epoch)
            if order is None:
                order = np.random.default_rng([self._seed, epoch]).permutation(
                    self._size
                )
                self._cache = {e: o for e, o in self._cache.items() if e == epoch - 1}
                self._cache[epoch] = order
        rows: np.ndarray = order[positions]
        return rows


def _check_step(step: Any, caller: str) -> None:
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise TypeError(
            f"{caller}: `step` must be an int; got {type(step).__name__} {step!r}."
        )
    if step < 0:
        raise ValueError(f"{caller}: `step` must be >= 0; got {step}.")


class BatchLoader(Closing):
    """Batches of a map-style data set for a step of `layout`, each process
    reading only the rows its own devices hold.

    The global batch of step `s` is a pure function of `(seed, s)`: step `s` is
    batch `s % steps_per_epoch` of epoch `s // steps_per_epoch`, whose rows are
    taken in the order of a permutation of `range(len(source))` drawn from
    `(seed, epoch)` (the identity with `shuffle=False`). It is the same batch
    whatever the number of processes and devices, so resuming needs only the step
    number: `loader.iterate(int(state.step))` continues the exact stream, also
    after a restart on another cluster size.

    **Arguments:**

    - `source`: a pytree of arrays sharing their leading dimension (NumPy arrays,
      `np.memmap`s: only the rows asked for are read from disk), a Grain
      `MapDataset` (`eqxdist[grain]`), or any object with `__len__` and
      `__getitem__(indices: np.ndarray) -> pytree of arrays` with `len(indices)`
      rows.
    - `global_batch_size`: rows per step over all devices; a multiple of the
      number of devices along the layout's data axes.
    - `layout`: the step's `ed.Layout`: every leaf is placed as the step takes
      it, its rows over the data axes and, with a context axis, leaves of rank
      >= 2 sharded over it along dimension 1 (in their natural order; a
      device-view step puts its block in the balanced order itself). Or, as in
      v0.4, a mesh with the layout's keywords beside it (`data_axis`,
      `context_axis`, ...).
    - `seed`: the shuffling seed (>= 0).
    - `shuffle`: `False` reads the rows in order, epoch after epoch.
    - `prefetch`: how many batches `iterate` reads and places ahead of the
      consumer in a background thread; `0` reads each batch when it is asked for.
    - `drop_remainder`: `True` drops the last `len(source) % global_batch_size`
      rows of each epoch's order (a different set every epoch when shuffled).
      `False` keeps them: the epoch's last batch is filled up to
      `global_batch_size` with the first rows of the same epoch's order, which
      are then seen twice; every batch keeps its shape, so the step compiles once,
      and the repeated rows are the last `steps_per_epoch * global_batch_size -
      len(source)` rows of that batch, for a loss or metric mask.

    **Raises:**

    `ValueError` for an empty source, leaves of unequal length, a
    `global_batch_size` below 1, not divisible by the devices along `data_axis`
    or (with `drop_remainder`) larger than the data set, or a negative `seed` or
    `prefetch`; the `ed.Layout` errors for its keywords; `TypeError` for a
    source that is neither a pytree of arrays nor indexable.

    !!! Example

        ```python
        data = {"x": np.ones((1000, 8), np.float32), "y": np.zeros(1000, np.int32)}
        with ed.BatchLoader(data, 64, layout, seed=0) as loader:
            for step, batch in loader.iterate(int(state.step)):
                if step == num_steps:
                    break
                state, metrics = train_step(state, batch)
        ```
    """

    @checked_first(layout=check_layout)
    @typecheck
    def __init__(
        self,
        source: Any,
        global_batch_size: int,
        layout: Layout | Mesh | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
        prefetch: int = 2,
        drop_remainder: bool = True,
        **layout_keywords: Any,
    ) -> None:
        caller = "BatchLoader"
        self.layout = resolve_layout(caller, layout, layout_keywords)
        self.source = as_source(source, caller)
        size = len(self.source)
        self.global_batch_size = global_batch_size
        self.sharding = self.layout.batch_sharding
        devices = self.layout.num_shards
        data_axis = self.layout.batch_spec[0]
        # Every leaf placed alike (no context axis): one call places the tree.
        self._uniform = self.layout.leaf_spec(2) == self.layout.batch_spec
        if size < 1:
            raise ValueError(f"{caller}: `source` is empty; it needs at least 1 row.")
        if global_batch_size < 1 or global_batch_size % devices:
            raise ValueError(
                f"{caller}: `global_batch_size`={global_batch_size} must be a "
                f"positive multiple of the {plural(devices, 'device')} along "
                f"{data_axis!r}."
            )
        if drop_remainder and global_batch_size > size:
            raise ValueError(
                f"{caller}: `global_batch_size`={global_batch_size} is larger than "
                f"the data set ({size} rows), so with `drop_remainder=True` no batch "
                "is left; use a smaller batch or `drop_remainder=False`."
            )
        for name, value in [("seed", seed), ("prefetch", prefetch)]:
            if value < 0:
                raise ValueError(f"{caller}: `{name}` must be >= 0; got {value}.")
        self.prefetch = prefetch
        self.steps_per_epoch = (
            size // global_batch_size
            if drop_remainder
            else -(-size // global_batch_size)
        )
        self._positions = local_positions(self.sharding, global_batch_size)
        self._order = _Permutations(size, seed, shuffle)
        self._readers: set[Reader] = set()

    def _rows(self, step: int, positions: np.ndarray) -> np.ndarray:
        epoch, index = divmod(step, self.steps_per_epoch)
        return self._order.rows(epoch, index * self.global_batch_size + positions)

    @typecheck
    def indices(self, step: int) -> np.ndarray:
        """The rows of the source, in batch order, that make up the global batch
        of `step` (every process's rows; each process reads only its own)."""
        _check_step(step, "BatchLoader.indices")
        return self._rows(step, np.arange(self.global_batch_size))

    # Not wrapped in `typecheck`: checking the returned pytree would cost more than
    # reading and placing a batch; `_check_step` checks the argument.
    def batch(self, step: int) -> PyTree[jax.Array]:
        """The global batch of `step`: the source's pytree with every leaf a
        `jax.Array` of `global_batch_size` rows split over `data_axis` (rows in
        mesh order), built with `jax.make_array_from_process_local_data` from the
        rows this process's devices hold, read in one `source[indices]` call.

        **Raises:**

        `TypeError` for a non-int `step`; `ValueError` for a negative one or when
        the source returns other than one row per index; an exception of the
        source, with a note naming the step."""
        _check_step(step, "BatchLoader.batch")
        rows = self._rows(int(step), self._positions)
        try:
            local = self.source[rows]
        except Exception as error:
            error.add_note(f"BatchLoader: raised reading the rows of step {step}.")
            raise
        local = check_read(local, len(rows), step, "BatchLoader")
        if self.sharding.is_fully_addressable and self._uniform:
            # Every row is local: one call places the whole tree at once.
            return jax.make_array_from_process_local_data(self.sharding, local)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(
                self.layout.leaf_sharding(max(1, np.ndim(x))),
                x,
                (self.global_batch_size, *np.shape(x)[1:]),
            ),
            local,
        )

    @typecheck
    def iterate(self, start_step: int = 0) -> Iterator[tuple[int, PyTree[jax.Array]]]:
        """`(step, batch(step))` for `step = start_step, start_step + 1, ...`,
        forever (epochs follow each other); break out of the loop to stop.

        With `prefetch > 0` a background thread reads and places up to `prefetch`
        batches ahead, while the consumer's steps run. An exception it meets is
        raised in the consumer, at the batch of the step it happened in (with a
        note naming the step), and ends the iteration. The thread stops when the
        iterator is closed or garbage collected after it started, or at
        `close()`.

        **Raises:**

        `ValueError` for a negative `start_step`.
        """
        _check_step(start_step, "BatchLoader.iterate")
        if self.prefetch == 0:
            return ((step, self.batch(step)) for step in itertools.count(start_step))
        reader = Reader(self.batch, start_step, self.prefetch)
        self._readers.add(reader)
        return self._drain(reader)

    def _drain(self, reader: Reader) -> Iterator[tuple[int, Any]]:
        try:
            while (item := reader.next()) is not None:
                yield item
        finally:
            reader.close()
            self._readers.discard(reader)

    def close(self) -> None:
        """Stop every read-ahead thread of this loader (each after the read in
        progress) and wait for them; iterators of `iterate` then end. The loader
        itself stays usable."""
        while self._readers:
            self._readers.pop().close()
