"""The metric writers: what lands in the JSONL, CSV, TensorBoard and W&B files,
that values are fetched only later (never waiting for a step), process 0 only,
writers of the protocol that are not eqxdist's, resuming, and the errors."""

import csv
import glob
import json
import struct
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from harness import MP_SCRIPTS, launch
from tensorboard.backend.event_processing import event_accumulator

import eqxdist as ed


def test_jsonl_holds_one_object_per_write(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.jsonl"
    x = jnp.arange(4.0)
    with ed.JsonlWriter(path) as writer:
        writer.write(1, {"loss": jnp.mean(x), "lr": 0.5, "n": np.int32(3)})
        writer.write(2, {"loss": jnp.sum(x), "hist": x})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"step": 1, "loss": 1.5, "lr": 0.5, "n": 3},
        {"step": 2, "loss": 6.0, "hist": [0.0, 1.0, 2.0, 3.0]},
    ]


def test_device_values_are_written_at_the_next_write_or_flush(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    writer = ed.JsonlWriter(path)
    writer.write(10, {"loss": jnp.float32(2.0)})
    assert path.read_text() == ""  # kept until its step is surely done
    writer.write(20, {"loss": jnp.float32(1.0)})
    writer.flush()
    assert [json.loads(r)["step"] for r in path.read_text().splitlines()] == [10, 20]
    writer.close()
    with ed.JsonlWriter(path, append=True) as again:
        again.write(30, {"loss": 0.5})
    assert len(path.read_text().splitlines()) == 3


def test_csv_has_a_column_per_name_and_widens(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    with ed.CsvWriter(path) as writer:
        writer.write(1, {"loss": jnp.float32(0.25)})
        writer.write(2, {"loss": 0.125, "acc": jnp.float32(0.5)})
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [
        {"step": "1", "loss": "0.25", "acc": ""},
        {"step": "2", "loss": "0.125", "acc": "0.5"},
    ]
    with ed.CsvWriter(path, append=True) as writer:
        writer.write(3, {"acc": 1.0})
    with open(path, newline="") as f:
        assert list(csv.DictReader(f))[-1] == {"step": "3", "loss": "", "acc": "1.0"}


def test_tensorboard_events_read_back_with_tensorboard(tmp_path: Path) -> None:
    losses = np.array([2.0, 1.5, 0.75], np.float32)
    with ed.MultiWriter(
        [ed.TensorBoardWriter(tmp_path / "tb"), ed.JsonlWriter(tmp_path / "m.jsonl")]
    ) as writer:
        for i, loss in enumerate(losses):
            writer.write(10 * (i + 1), {"loss": jnp.asarray(loss), "lr": 1e-3 * i})
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "lr"}
    scalars = events.Scalars("loss")
    assert [e.step for e in scalars] == [10, 20, 30]
    np.testing.assert_allclose([e.value for e in scalars], losses)
    np.testing.assert_allclose([e.value for e in events.Scalars("lr")], [0, 1e-3, 2e-3])
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("kind", ["jsonl", "csv", "tensorboard", "multi"])
def test_write_after_close_is_an_error(tmp_path: Path, kind: str) -> None:
    make = {
        "jsonl": lambda: ed.JsonlWriter(tmp_path / "m.jsonl"),
        "csv": lambda: ed.CsvWriter(tmp_path / "m.csv"),
        "tensorboard": lambda: ed.TensorBoardWriter(tmp_path / "tb"),
        "multi": lambda: ed.MultiWriter([ed.JsonlWriter(tmp_path / "n.jsonl")]),
    }
    writer = make[kind]()
    writer.write(1, {"loss": 1.0})
    writer.close()
    writer.close()  # twice is harmless
    with pytest.raises(ValueError, match=r"write: the writer is closed"):
        writer.write(2, {"loss": 1.0})
    with pytest.raises(ValueError, match=r"flush: the writer is closed"):
        writer.flush()


def test_bad_values_are_clear_errors(tmp_path: Path) -> None:
    with ed.JsonlWriter(tmp_path / "m.jsonl") as writer:
        with pytest.raises(TypeError, match=r"JsonlWriter.write: `values\['m'\]`"):
            writer.write(1, {"m": ed.metrics.Mean()})
        with pytest.raises(TypeError, match="values"):
            writer.write(1, [1.0])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"`step` must be an int >= 0; got -1"):
            writer.write(-1, {"loss": 1.0})
    with (
        ed.CsvWriter(tmp_path / "m.csv") as table,
        pytest.raises(ValueError, match=r"values\['x'\]` has shape \(3,\)"),
    ):
        table.write(1, {"x": jnp.zeros(3)})
    with pytest.raises(TypeError, match="writers"):
        ed.MultiWriter([object()])  # type: ignore[list-item]
    # (beartype, which the tests run, may catch it first: it samples one item.)
    with pytest.raises(TypeError, match=r"writers"):
        ed.MultiWriter([ed.JsonlWriter(tmp_path / "n.jsonl"), "a.jsonl"])  # type: ignore[list-item]


def tensorboard_scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    """`(step, value)` of `tag` as TensorBoard's own reader loads `logdir`."""
    events = event_accumulator.EventAccumulator(str(logdir))
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_flush_makes_the_events_readable_before_close(
    tmp_path: Path,
) -> None:
    writer = ed.TensorBoardWriter(tmp_path / "tb")
    writer.write(1, {"loss": 0.5})
    writer.flush()
    assert tensorboard_scalars(tmp_path / "tb", "loss") == [(1, 0.5)]
    writer.write(2, {"loss": jnp.float32(0.25)})
    writer.flush()
    assert tensorboard_scalars(tmp_path / "tb", "loss") == [(1, 0.5), (2, 0.25)]
    writer.close()


class Recorder:
    """A writer of one's own (an experiment tracker's adapter): the protocol's
    three methods, no eqxdist base class."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.calls: list[str] = []

    def write(self, step: int, values: Any) -> None:
        self.rows.append((step, dict(values)))

    def flush(self) -> None:
        self.calls.append("flush")

    def close(self) -> None:
        self.calls.append("close")


def test_multiwriter_takes_a_writer_of_the_protocol(tmp_path: Path) -> None:
    recorder = Recorder()
    assert isinstance(recorder, ed.Writer) and not isinstance(recorder, ed.WriterBase)
    assert isinstance(ed.JsonlWriter(tmp_path / "x.jsonl"), ed.Writer)
    writer = ed.MultiWriter([ed.JsonlWriter(tmp_path / "m.jsonl"), recorder])
    writer.write(1, {"loss": jnp.float32(0.5), "hist": jnp.arange(3.0)})
    writer.write(2, {"loss": 0.25})
    writer.flush()
    assert recorder.calls == ["flush"]
    # Fetched once for all: host numbers and NumPy arrays, never device arrays.
    (s1, v1), (s2, v2) = recorder.rows
    assert (s1, v1["loss"], s2, v2) == (1, 0.5, 2, {"loss": 0.25})
    assert isinstance(v1["hist"], np.ndarray)
    np.testing.assert_array_equal(v1["hist"], [0.0, 1.0, 2.0])
    writer.close()
    assert recorder.calls == ["flush", "close"]
    rows = [json.loads(r) for r in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 1, "loss": 0.5, "hist": [0.0, 1.0, 2.0]}


@pytest.mark.parametrize("kind", ["jsonl", "csv", "tensorboard", "multi"])
def test_resume_forgets_the_steps_after_the_checkpoint(
    tmp_path: Path, kind: str
) -> None:
    # An interrupted run logged steps 5, 10 and 15 but was last saved at 10; the
    # resumed run logs 15 (another value: another wall-clock) and 20.
    make = {
        "jsonl": lambda append: ed.JsonlWriter(tmp_path / "m.jsonl", append=append),
        "csv": lambda append: ed.CsvWriter(tmp_path / "m.csv", append=append),
        "tensorboard": lambda append: ed.TensorBoardWriter(tmp_path / "tb"),
        "multi": lambda append: ed.MultiWriter(
            [ed.JsonlWriter(tmp_path / "m.jsonl", append=append), Recorder()]
        ),
    }
    with make[kind](False) as first:
        for step in (5, 10, 15):
            first.write(step, {"loss": step / 100})
    if kind == "jsonl":  # and the process died in the middle of a line
        with open(tmp_path / "m.jsonl", "a") as f:
            f.write('{"step": 16, "lo')
    with make[kind](True) as resumed:
        # Pending (device values) at `resume`: step 5 is kept, step 12 is not.
        resumed.write(5, {"loss": jnp.float32(1.0)})
        resumed.write(12, {"loss": jnp.float32(9.0)})
        resumed.resume(10)
        resumed.write(15, {"loss": 0.5})
        resumed.write(20, {"loss": 0.25})
    want = [(5, 0.05), (10, 0.1), (5, 1.0), (15, 0.5), (20, 0.25)]
    if kind in ("jsonl", "multi"):
        rows = [json.loads(r) for r in (tmp_path / "m.jsonl").read_text().splitlines()]
        assert [(r["step"], r["loss"]) for r in rows] == want
    elif kind == "csv":
        with open(tmp_path / "m.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert [(int(r["step"]), float(r["loss"])) for r in rows] == want
    else:
        # TensorBoard drops the values past step 10 at the restart marker; a
        # step written twice keeps the later value.
        got = tensorboard_scalars(tmp_path / "tb", "loss")
        assert [step for step, _ in got] == [5, 10, 5, 15, 20]
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want])


def wandb_history(directory: Path) -> list[dict[str, Any]]:
    """The history rows (`run.log` calls merged per step) of the offline run
    under `directory`, read from W&B's run file: LevelDB-log records (a 7-byte
    file header, then 32 KiB blocks of records with a 7-byte header each) holding
    `wandb_internal_pb2.Record` protos."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(directory / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    rows, position, block, parts = [], 7, 1 << 15, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # the block's zero-filled tail
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        parts += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_internal_pb2.Record.FromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(
                            item.value_json
                        )
                        for item in record.history.item
                        if not (item.key or item.nested_key[0]).startswith("_")
                    }
                    | {"_step": record.history.step.num}
                )
    return rows


@pytest.mark.slow  # wandb.init starts W&B's service process
def test_wandb_writer_logs_offline(tmp_path: Path, monkeypatch: Any) -> None:
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    try:
        with ed.WandbWriter(project="eqxdist-test", dir=str(tmp_path)) as writer:
            assert isinstance(writer, ed.Writer)
            writer.write(1, {"loss": jnp.float32(0.5)})
            writer.write(1, {"eval_accuracy": 0.75})  # the same step: one row
            writer.write(2, {"loss": 0.25, "weights": jnp.array([0.0, 1.0, 1.0])})
            writer.flush()
    finally:
        wandb.teardown()
    rows = wandb_history(tmp_path)
    assert [r["_step"] for r in rows] == [1, 2]
    assert {k: rows[0][k] for k in ("loss", "eval_accuracy")} == {
        "loss": 0.5,
        "eval_accuracy": 0.75,
    }
    assert rows[1]["loss"] == 0.25
    # A histogram of the array: 64 bins, counts of its 3 values.
    assert rows[1]["weights/_type"] == "histogram"
    assert sum(rows[1]["weights/values"]) == 3 and rows[1]["weights/values"][-1] == 2


def test_wandb_writer_errors(monkeypatch: Any) -> None:
    with pytest.raises(
        ValueError, match=r"either a `run`.*got a run and \['project'\]"
    ):
        ed.WandbWriter(object(), project="p")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'eqxdist\[wandb\]'"):
        ed.WandbWriter(project="p")


@pytest.mark.slow
def test_only_process_zero_writes(tmp_path: Path) -> None:
    result = launch(MP_SCRIPTS / "mp_writers.py", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.csv", "m.jsonl", "tb"]
    rows = [json.loads(r) for r in (tmp_path / "m.jsonl").read_text().splitlines()]
    # The global mean of the same rows computed here on one process.
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    expected = [float(np.mean(x * (s + 1))) for s in range(3)]
    assert [r["step"] for r in rows] == [1, 2, 3]
    np.testing.assert_allclose([r["mean"] for r in rows], expected, rtol=1e-6)
    assert len((tmp_path / "m.csv").read_text().splitlines()) == 4
    assert len(list((tmp_path / "tb").iterdir())) == 1
