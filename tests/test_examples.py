"""The examples keep working: every one answers `--help`, and the main job trains
and reports that the strategies agree. Each runs in its own process, as a user would
run it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(
    p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_")
)


def _run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_answers_help(script: Path) -> None:
    out = _run(str(script), "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:")


@pytest.mark.slow
def test_main_job_trains_and_the_strategies_agree(tmp_path: Path) -> None:
    out = _run("examples/train_classifier.py", "--epochs", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    for strategy in ("single", "dp", "fsdp"):
        assert f"\n{strategy} " in out.stdout
        assert (tmp_path / strategy / "history.json").exists()
    assert "parameters of single/dp/fsdp agree: yes" in out.stdout
    assert "held-out confusion matrix" in out.stdout
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 2 * 11  # strategies x epochs x steps per epoch
    assert '"strategy": "fsdp"' in lines[-1]


def _summary(stdout: str, strategy: str) -> str:
    (line,) = [x for x in stdout.splitlines() if x.startswith(f"{strategy} ")]
    # strategy, devices, accuracy, macro-F1, loss (not the timing columns)
    return " ".join(line.split()[:5])


@pytest.mark.slow
def test_main_job_resumes_exactly(tmp_path: Path) -> None:
    args = ["examples/train_classifier.py", "--epochs", "2", "--strategies", "dp"]
    whole = _run(*args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    first = _run(*args, "--out", str(tmp_path / "split"), "--stop-after", "1")
    assert first.returncode == 0, first.stderr
    second = _run(*args, "--out", str(tmp_path / "split"), "--resume")
    assert second.returncode == 0, second.stderr
    assert "resumed at step 11, epoch 1" in second.stdout
    assert _summary(second.stdout, "dp") == _summary(whole.stdout, "dp")


@pytest.mark.slow
def test_quickstart_runs() -> None:
    out = _run("examples/quickstart.py")
    assert out.returncode == 0, out.stderr
    assert "data-parallel step vs single program" in out.stdout
