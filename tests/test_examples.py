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


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_answers_help(script: Path) -> None:
    out = _run(str(script), "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:")


def test_main_job_trains_and_the_strategies_agree() -> None:
    out = _run("examples/train_classifier.py", "--epochs", "2")
    assert out.returncode == 0, out.stderr
    for strategy in ("single", "dp", "fsdp"):
        assert f"\n{strategy} " in out.stdout
    assert "parameters of single/dp/fsdp agree: yes" in out.stdout


def test_quickstart_runs() -> None:
    out = _run("examples/quickstart.py")
    assert out.returncode == 0, out.stderr
    assert "data-parallel step vs single program" in out.stdout
