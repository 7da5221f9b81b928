"""The metric writers: what lands in the JSONL, CSV and TensorBoard files, that
values are fetched only later (never waiting for a step), process 0 only, and the
errors."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

import eqxdist as ed

ROOT = Path(__file__).resolve().parents[2]


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
            writer.write(1, {"m": ed.Mean()})
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


@pytest.mark.slow
def test_only_process_zero_writes(tmp_path: Path) -> None:
    script = ROOT / "tests" / "mp_scripts" / "mp_writers.py"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "eqxdist.launch",
            "-n",
            "2",
            "-d",
            "4",
            script,
            tmp_path,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
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
