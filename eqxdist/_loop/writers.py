"""Metric writers: one protocol (`write(step, values)`, `flush()`, `close()`) for
JSONL, CSV and TensorBoard, written by process 0 only.

`write` never waits for the devices: the values of a call are kept as they came
(possibly arrays a step is still computing) and fetched in one `jax.device_get` at
the next `write`, `flush` or `close`, by which time their step is long done in a
loop that writes every few steps."""

import csv
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._utils import Closing, typecheck


def _check_values(values: Any, caller: str) -> dict[str, Any]:
    if not isinstance(values, Mapping):
        raise TypeError(
            f"{caller}: `values` must be a mapping from names to scalars or arrays; "
            f"got {type(values).__name__}."
        )
    out = {}
    for name, value in values.items():
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"{caller}: every key of `values` must be a non-empty string; got "
                f"{name!r}."
            )
        if not isinstance(value, int | float | np.ndarray | np.generic | jax.Array):
            raise TypeError(
                f"{caller}: `values[{name!r}]` must be a Python number or an array; "
                f"got {type(value).__name__}. Call `.compute()` on a Metric first."
            )
        out[name] = value
    return out


def _check_step(step: Any, caller: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"{caller}: `step` must be an int >= 0; got {step!r}.")
    return int(step)


def _plain(value: Any) -> Any:
    """A fetched value as JSON would hold it: a number, or nested lists."""
    array = np.asarray(value)
    if array.ndim == 0:
        item = array.item()
        return item if isinstance(item, int | float | bool) else float(item)
    return array.tolist()


class Writer(Closing):
    """The writers' common part: argument checks, process 0 only, deferred fetch,
    write-after-close errors and the context manager. Subclasses implement
    `_emit(step, host_values)` and `_flush_file()` / `_close_file()`."""

    def __init__(self) -> None:
        self.is_writer = jax.process_index() == 0
        self._pending: list[tuple[int, dict[str, Any]]] = []
        self._closed = False

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise ValueError(
                f"{type(self).__name__}.{method}: the writer is closed; create a new "
                "one to write more."
            )

    def _check(self, values: dict[str, Any], caller: str) -> None:
        """Subclass hook: refuse values this format cannot hold, at `write` time."""

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        """Record `values` (names to Python numbers or arrays, e.g. a step's
        metrics) as those of `step`. Arrays may still be being computed: they are
        fetched at the next `write`, `flush` or `close`, so that writing never
        waits for the step they belong to. A no-op on processes other than 0.

        **Raises:**

        `ValueError` once the writer is closed or for a negative `step`;
        `TypeError` for values that are not numbers or arrays.
        """
        caller = f"{type(self).__name__}.write"
        self._check_open("write")
        step = _check_step(step, caller)
        checked = _check_values(values, caller)
        self._check(checked, caller)
        if not self.is_writer:
            return
        self._emit_pending()
        self._pending.append((step, checked))
        if not any(isinstance(v, jax.Array) for v in checked.values()):
            self._emit_pending()  # nothing to wait for

    def _emit_pending(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        fetched = jax.device_get([list(values.values()) for _, values in pending])
        for (step, values), host in zip(pending, fetched, strict=True):
            self._emit(step, {k: _plain(v) for k, v in zip(values, host, strict=True)})

    def flush(self) -> None:
        """Fetch and write everything recorded so far (waits for its steps)."""
        self._check_open("flush")
        if self.is_writer:
            self._emit_pending()
            self._flush_file()

    def close(self) -> None:
        """Flush and close. Closing twice is harmless."""
        if self._closed:
            return
        try:
            if self.is_writer:
                self._emit_pending()
        finally:
            self._closed = True
            if self.is_writer:
                self._close_file()

    def _emit(self, step: int, values: dict[str, Any]) -> None:
        raise NotImplementedError

    def _flush_file(self) -> None:
        raise NotImplementedError

    def _close_file(self) -> None:
        raise NotImplementedError


def _open(path: str | os.PathLike[str], mode: str, caller: str) -> Any:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{caller}: `path` {str(path)!r} is a directory, not a file.")
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, mode)


class JsonlWriter(Writer):
    """Writes one JSON object per `write` call to a file, `{"step": step, **values}`
    (arrays as nested lists, NaN and infinities as JSON's `NaN`/`Infinity`, which
    Python's `json` reads back). Process 0 only.

    **Arguments:**

    - `path`: the file (parent directories are created).
    - `append`: add to an existing file (e.g. when resuming a run) instead of
      truncating it.

    !!! Example

        ```python
        with ed.JsonlWriter("run/metrics.jsonl") as writer:
            for i in range(num_steps):
                state, metrics = step(state, batches[i])
                writer.write(i + 1, metrics.compute())
        ```
    """

    @typecheck
    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        super().__init__()
        self.path = Path(path)
        if self.is_writer:
            self._file = _open(path, "a" if append else "w", "JsonlWriter")

    def _emit(self, step: int, values: dict[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **values}) + "\n")

    def _flush_file(self) -> None:
        self._file.flush()

    def _close_file(self) -> None:
        self._file.close()


class CsvWriter(Writer):
    """Writes a CSV table with a `step` column and one column per value name, in
    the order names first appear; a row leaves the columns it lacks empty. A name
    that appears later adds a column (the file is rewritten with the wider
    header). Scalars only. Process 0 only.

    **Arguments:**

    - `path`: the file (parent directories are created).
    - `append`: keep the rows of an existing file (e.g. when resuming).
    """

    @typecheck
    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        super().__init__()
        self.path = Path(path)
        self._columns: list[str] = ["step"]
        self._rows: list[dict[str, Any]] = []
        if self.is_writer:
            _open(path, "a", "CsvWriter").close()
            if append:
                with open(self.path, newline="") as f:
                    reader = csv.DictReader(f)
                    self._columns = list(reader.fieldnames or ["step"])
                    self._rows = list(reader)
            self._file = open(self.path, "w", newline="")  # noqa: SIM115 (closed by close)
            self._rewrite()

    def _check(self, values: dict[str, Any], caller: str) -> None:
        for name, value in values.items():
            if np.ndim(value) != 0:
                raise ValueError(
                    f"{caller}: a CSV cell holds a scalar; `values[{name!r}]` has "
                    f"shape {np.shape(value)}. Write arrays with JsonlWriter."
                )
            if name == "step":
                raise ValueError(f"{caller}: 'step' is the CSV's own column.")

    def _rewrite(self) -> None:
        self._file.seek(0)
        self._file.truncate()
        table = csv.DictWriter(self._file, self._columns)
        table.writeheader()
        table.writerows(self._rows)

    def _emit(self, step: int, values: dict[str, Any]) -> None:
        row = {"step": step, **values}
        self._rows.append(row)
        new = [name for name in values if name not in self._columns]
        if new:
            self._columns += new
            self._rewrite()
        else:
            csv.DictWriter(self._file, self._columns).writerow(row)

    def _flush_file(self) -> None:
        self._file.flush()

    def _close_file(self) -> None:
        self._file.close()


class TensorBoardWriter(Writer):
    """Writes TensorBoard event files under `logdir` (through `tensorboardX`, the
    optional extra `eqxdist[tensorboard]`): scalars as scalar summaries, arrays
    of rank >= 1 as histograms. Process 0 only.

    **Arguments:**

    - `logdir`: the directory TensorBoard is pointed at (`tensorboard --logdir`).

    **Raises:**

    `ImportError` naming the extra when `tensorboardX` is not installed.
    """

    @typecheck
    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        super().__init__()
        self.logdir = Path(logdir)
        if self.is_writer:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as error:
                raise ImportError(
                    "TensorBoardWriter needs tensorboardX: pip install "
                    "'eqxdist[tensorboard]'."
                ) from error
            self._summary = SummaryWriter(str(logdir))

    def _emit(self, step: int, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if isinstance(value, list):
                self._summary.add_histogram(name, np.asarray(value), step)
            else:
                self._summary.add_scalar(name, float(value), step)

    def _flush_file(self) -> None:
        self._summary.flush()

    def _close_file(self) -> None:
        self._summary.close()


class MultiWriter(Writer):
    """Writes to several writers at once (e.g. JSONL and TensorBoard), fetching
    the values once for all of them.

    **Arguments:**

    - `writers`: the writers; `flush`/`close` reach each of them.
    """

    @typecheck
    def __init__(self, writers: Sequence[Writer]) -> None:
        super().__init__()
        self.writers = list(writers)

    def _check(self, values: dict[str, Any], caller: str) -> None:
        for writer in self.writers:
            writer._check(values, caller)

    def _emit(self, step: int, values: dict[str, Any]) -> None:
        for writer in self.writers:
            writer.write(step, values)

    def _flush_file(self) -> None:
        for writer in self.writers:
            writer.flush()

    def _close_file(self) -> None:
        pass

    def close(self) -> None:
        super().close()
        for writer in self.writers:
            writer.close()
