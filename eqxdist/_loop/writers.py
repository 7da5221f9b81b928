"""Metric writers: one protocol (`Writer`: `write(step, values)`, `flush()`,
`close()`) for JSONL, CSV, TensorBoard and Weights & Biases, and `WriterBase`, the
built-ins' common part, written by process 0 only.

`write` never waits for the devices: the values of a call are kept as they came
(possibly arrays a step is still computing) and fetched in one `jax.device_get` at
the next `write`, `flush` or `close`, by which time their step is long done in a
loop that writes every few steps."""

import csv
import itertools
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from .._utils import Closing, typecheck


@runtime_checkable
class Writer(Protocol):
    """What `train_loop` and `MultiWriter` write to: any object with these three
    methods, a subclass of `WriterBase` (every writer of eqxdist) or not (an
    adapter of one's own for an experiment tracker; see the guide "Writing a
    writer"). A writer may also have `resume(step)`, which `train_loop` calls when
    it resumes from a checkpoint (see `WriterBase.resume`).
    """

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        """Record `values` (names to Python numbers or arrays) as those of `step`."""
        ...

    def flush(self) -> None:
        """Write out everything recorded so far."""
        ...

    def close(self) -> None:
        """Flush and release the writer's files or connections."""
        ...


_event_files = itertools.count()  # tells apart event files opened in one second


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


def _host(value: Any) -> Any:
    """A fetched value as the writers' `emit` gets it: a Python number (0-d) or a
    NumPy array (rank >= 1)."""
    array = np.asarray(value)
    if array.ndim == 0:
        item = array.item()
        return item if isinstance(item, int | float) else float(item)
    return array


class WriterBase(Closing):
    """The common part of eqxdist's writers, to subclass for a writer of one's
    own: argument checks, process 0 only, values fetched from the devices only
    once their step is done, errors after `close`, `resume` and the context
    manager (`with writer: ...` closes it).

    A subclass implements `emit(step, values)` and, where its output needs them,
    `flush_output()`, `close_output()`, `check_values(values, caller)` and
    `drop_after(step)`; they run on process 0 only, and `emit` gets host values
    (Python numbers, NumPy arrays of rank >= 1), never arrays on the devices.
    `self.is_writer` says whether this is process 0: open files or connections
    in `__init__` only where it is true.
    """

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
        self.check_values(checked, caller)
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
            self.emit(step, {k: _host(v) for k, v in zip(values, host, strict=True)})

    def flush(self) -> None:
        """Fetch and write out everything recorded so far (waits for its steps):
        a reader of the output (TensorBoard, `tail -f`) sees it at once."""
        self._check_open("flush")
        if self.is_writer:
            self._emit_pending()
            self.flush_output()

    def resume(self, step: int) -> None:
        """Continue a run from `step` (its checkpoint): forget what this writer
        holds of later steps, written by the run that was interrupted after its
        last checkpoint, so that no step appears twice once the resumed run writes
        them again. `train_loop` calls it when it resumes from a checkpoint.
        Formats that can remove rows do (JSONL, CSV); TensorBoard is told to
        discard them; others keep them.
        """
        caller = f"{type(self).__name__}.resume"
        self._check_open("resume")
        step = _check_step(step, caller)
        if self.is_writer:
            self._pending = [(s, v) for s, v in self._pending if s <= step]
            self._emit_pending()
            self.drop_after(step)

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
                self.close_output()

    def emit(self, step: int, values: dict[str, Any]) -> None:
        """Write `values` (Python numbers, NumPy arrays of rank >= 1) as those of
        `step`. Called on process 0 only, in the order of the `write` calls."""
        raise NotImplementedError(
            f"{type(self).__name__}: a WriterBase subclass implements "
            "`emit(step, values)`."
        )

    def flush_output(self) -> None:
        """Push what `emit` wrote to where readers see it (e.g. flush a file)."""

    def close_output(self) -> None:
        """Release the output (close a file, finish a run), after a last flush."""

    def check_values(self, values: dict[str, Any], caller: str) -> None:
        """Raise for values this format cannot hold, at `write` time (on every
        process, so that a mistake shows wherever it is made)."""

    def drop_after(self, step: int) -> None:
        """Remove what was written of steps after `step` (see `resume`), where
        the format allows it."""


def _open(path: str | os.PathLike[str], mode: str, caller: str) -> Any:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{caller}: `path` {str(path)!r} is a directory, not a file.")
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, mode)


class JsonlWriter(WriterBase):
    """Writes one JSON object per `write` call to a file, `{"step": step, **values}`
    (arrays as nested lists, NaN and infinities as JSON's `NaN`/`Infinity`, which
    Python's `json` reads back). Process 0 only.

    **Arguments:**

    - `path`: the file (parent directories are created).
    - `append`: add to an existing file (e.g. when resuming a run) instead of
      truncating it; `resume(step)` (which `train_loop` calls when it resumes from
      a checkpoint) then removes the rows of steps after `step`.

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
            if append:
                _drop_cut_line(self._file)

    def emit(self, step: int, values: dict[str, Any]) -> None:
        row = {
            k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in values.items()
        }
        self._file.write(json.dumps({"step": step, **row}) + "\n")

    def flush_output(self) -> None:
        self._file.flush()

    def close_output(self) -> None:
        self._file.close()

    def drop_after(self, step: int) -> None:
        self._file.close()
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if not _later(line, step)]
        self.path.write_text("".join(kept))
        self._file = open(self.path, "a")  # noqa: SIM115 (closed by close)


def _drop_cut_line(file: Any) -> None:
    """Remove a last line without its newline (a process killed in the middle of
    writing it), which the next row would otherwise continue."""
    with open(file.name, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
    file.truncate(data.rfind(b"\n") + 1)


def _later(line: str, step: int) -> bool:
    """Whether a JSONL row is of a step after `step` (other lines are kept)."""
    try:
        row = json.loads(line)
    except ValueError:
        return False
    logged = row.get("step") if isinstance(row, dict) else None
    return isinstance(logged, int) and logged > step


class CsvWriter(WriterBase):
    """Writes a CSV table with a `step` column and one column per value name, in
    the order names first appear; a row leaves the columns it lacks empty. A name
    that appears later adds a column (the file is rewritten with the wider
    header). Scalars only. Process 0 only.

    **Arguments:**

    - `path`: the file (parent directories are created).
    - `append`: keep the rows of an existing file (e.g. when resuming);
      `resume(step)` then removes the rows of steps after `step`.
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

    def check_values(self, values: dict[str, Any], caller: str) -> None:
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

    def emit(self, step: int, values: dict[str, Any]) -> None:
        row = {"step": step, **values}
        self._rows.append(row)
        new = [name for name in values if name not in self._columns]
        if new:
            self._columns += new
            self._rewrite()
        else:
            csv.DictWriter(self._file, self._columns).writerow(row)

    def flush_output(self) -> None:
        self._file.flush()

    def close_output(self) -> None:
        self._file.close()

    def drop_after(self, step: int) -> None:
        # Rows read back from the file hold the step as text.
        self._rows = [r for r in self._rows if not int(r["step"]) > step]
        self._rewrite()


class TensorBoardWriter(WriterBase):
    """Writes TensorBoard event files under `logdir` (through `tensorboardX`, the
    optional extra `eqxdist[tensorboard]`): scalars as scalar summaries, arrays
    of rank >= 1 as histograms. `flush()` writes them out, so TensorBoard shows a
    run as it goes. Process 0 only.

    **Arguments:**

    - `logdir`: the directory TensorBoard is pointed at (`tensorboard --logdir`).

    `resume(step)` writes TensorBoard's restart marker (a `SessionLog.START` event
    at `step + 1`), so TensorBoard discards the values an interrupted run wrote
    past `step` and shows the resumed run's instead.

    **Raises:**

    `ImportError` naming the extra when `tensorboardX` is not installed.
    """

    @typecheck
    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        super().__init__()
        self.logdir = Path(logdir)
        if self.is_writer:
            try:
                from tensorboardX import record_writer
                from tensorboardX.event_file_writer import EventsWriter
            except ImportError as error:
                raise ImportError(
                    "TensorBoardWriter needs tensorboardX: pip install "
                    "'eqxdist[tensorboard]'."
                ) from error
            # tensorboardX's `SummaryWriter` hands events to a thread whose queue
            # its `flush()` does not wait for (events appeared only at `close`);
            # its `EventsWriter` writes them here, in this thread. The suffix keeps
            # two writers opened within one second from sharing a file name.
            record_writer.directory_check(str(logdir))
            suffix = f".{os.getpid()}.{next(_event_files)}"
            self._events = EventsWriter(os.path.join(str(logdir), "events"), suffix)

    def _event(self, step: int, **fields: Any) -> None:
        from tensorboardX.proto import event_pb2

        event = event_pb2.Event(wall_time=time.time(), step=step, **fields)
        self._events.write_event(event)

    def emit(self, step: int, values: dict[str, Any]) -> None:
        from tensorboardX import summary

        for name, value in values.items():
            if isinstance(value, np.ndarray):
                proto = summary.histogram(name, value, "tensorflow")
            else:
                proto = summary.scalar(name, float(value))
            self._event(step, summary=proto)

    def flush_output(self) -> None:
        self._events.flush()

    def close_output(self) -> None:
        self._events.close()

    def drop_after(self, step: int) -> None:
        from tensorboardX.proto import event_pb2

        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._event(step + 1, session_log=start)


class WandbWriter(WriterBase):
    """Logs to Weights & Biases (`wandb`, the optional extra `eqxdist[wandb]`):
    scalars as W&B scalars, arrays of rank >= 1 as histograms, each at its
    `step` (`run.log(values, step=step)`). Process 0 only: the other processes
    start no run.

    **Arguments:**

    - `run`: a run from `wandb.init(...)` to log to, left running by `close()`;
      or `None` to start one here with `init_kwargs`.
    - `init_kwargs`: `wandb.init`'s arguments (`project=`, `name=`, `config=`,
      `dir=`, `mode="offline"`, ...), for a run that `close()` finishes.

    W&B keeps each run's steps increasing: values of a step below the run's
    latest are dropped (W&B warns). So the values of one step must all be written
    before a later step's (`train_loop` does so); `flush()` writes nothing out of
    order and leaves sending to W&B's own process, and the latest step's values
    are committed when a later step is written or at `close()`. `resume(step)`
    keeps what the run holds: to continue an interrupted run's W&B run from its
    checkpoint, start it with `wandb.init(id=..., resume_from=f"{id}?_step={step}")`
    (W&B's rewind).

    **Raises:**

    `ImportError` naming the extra when `wandb` is not installed; `ValueError`
    for both a `run` and `init_kwargs`.

    !!! Example

        ```python
        with ed.WandbWriter(project="digits", config={"lr": 3e-3}) as writer:
            ed.train_loop(step, state, batches, 1000, writer=writer)
        ```
    """

    def __init__(self, run: Any = None, **init_kwargs: Any) -> None:
        super().__init__()
        if run is not None and init_kwargs:
            raise ValueError(
                "WandbWriter: pass either a `run` (from `wandb.init`) or "
                "`wandb.init`'s arguments, not both; got a run and "
                f"{sorted(init_kwargs)}."
            )
        self._owns_run = run is None
        if self.is_writer:
            try:
                import wandb
            except ImportError as error:
                raise ImportError(
                    "WandbWriter needs wandb: pip install 'eqxdist[wandb]'."
                ) from error
            self._wandb = wandb
            self.run = wandb.init(**init_kwargs) if run is None else run

    def emit(self, step: int, values: dict[str, Any]) -> None:
        logged = {
            name: self._wandb.Histogram(np_histogram=np.histogram(value, bins=64))
            if isinstance(value, np.ndarray)
            else value
            for name, value in values.items()
        }
        self.run.log(logged, step=step)

    def close_output(self) -> None:
        if self._owns_run:
            self.run.finish()


class MultiWriter(WriterBase):
    """Writes to several writers at once (e.g. JSONL and TensorBoard), fetching
    the values once for all of them.

    **Arguments:**

    - `writers`: the writers, eqxdist's or any others of the `Writer` protocol;
      `flush`, `close` and `resume` reach each of them.

    **Raises:**

    `TypeError` naming the first object that has no `write`, `flush` and
    `close`.
    """

    def __init__(self, writers: Sequence[Writer]) -> None:
        super().__init__()
        self.writers = list(writers)
        for i, writer in enumerate(self.writers):
            if not isinstance(writer, Writer):
                raise TypeError(
                    f"MultiWriter: `writers[{i}]` is a {type(writer).__name__}, which "
                    "lacks the Writer protocol's `write`, `flush` and `close` methods; "
                    "pass eqxdist's writers or objects with those three methods."
                )

    def check_values(self, values: dict[str, Any], caller: str) -> None:
        for writer in self.writers:
            if isinstance(writer, WriterBase):
                writer.check_values(values, caller)

    def emit(self, step: int, values: dict[str, Any]) -> None:
        for writer in self.writers:
            writer.write(step, values)

    def flush_output(self) -> None:
        for writer in self.writers:
            writer.flush()

    def drop_after(self, step: int) -> None:
        for writer in self.writers:
            resume_writer(writer, step)

    def close(self) -> None:
        if self._closed:
            return
        try:
            super().close()
        finally:
            for writer in self.writers:
                writer.close()


def resume_writer(writer: Writer, step: int) -> None:
    """`writer.resume(step)` where the writer has it (the protocol does not ask
    for it: a writer of one's own may have nothing to forget)."""
    resume = getattr(writer, "resume", None)
    if callable(resume):
        resume(step)
