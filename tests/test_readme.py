"""The README's tour runs as it stands and prints what the README says it prints:
its ```python blocks, in order, as one script in a fresh process, the way a reader
pastes them (the tour calls `simulate_cpu_devices` itself, so the process starts
without XLA_FLAGS); its stated output read as the docs' is (`stated_output.py`)."""

import re
from pathlib import Path

import pytest
from stated_output import blocks_of, mismatch, run_as_pasted, stated_output

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SETUP_COMMANDS = [
    'python3 -m venv .venv && .venv/bin/pip install -e ".[examples]" && '
    ".venv/bin/python examples/train_classifier.py",
    'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && '
    ".venv/bin/python -m pytest",
]


@pytest.mark.slow
def test_readme_tour_runs_and_prints_what_it_states(tmp_path: Path) -> None:
    blocks = blocks_of(README)
    assert blocks, "README.md has no ```python block"
    script = tmp_path / "tour.py"
    script.write_text("\n".join(block.code for block in blocks))
    out = run_as_pasted(script)
    assert out.returncode == 0, out.stdout + out.stderr
    stated = [stated_output(block) for block in blocks]
    assert not any(s.unstated or s.twice for s in stated), stated
    difference = mismatch(
        [line for s in stated for line in s.lines or []], out.stdout.splitlines()
    )
    assert difference is None, difference
    assert "held-out (77 rows)" in out.stdout
    accuracy = float(re.search(r"acc: ([0-9.]+)", out.stdout.split("held-out")[1])[1])
    assert accuracy > 0.6, out.stdout  # it learned: chance is 0.25


def test_readme_starts_with_the_two_setup_commands() -> None:
    text = README.read_text()
    commands = [
        line for line in text.splitlines() if line.startswith("python3 -m venv")
    ]
    assert commands == SETUP_COMMANDS
    first_block = text.index("```bash")
    assert "```python" not in text[:first_block] and "## " not in text[:first_block]
    assert text.index(SETUP_COMMANDS[1]) < text.index("\n## ")


def test_readme_is_short_and_its_figures_live_in_the_benchmarks_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    wide = [
        line
        for line in prose.splitlines()
        if len(line) > 100 and not line.startswith("|")
    ]
    assert not wide, wide  # code blocks and tables aside
    # Measured figures are dated, with their commands, in docs/benchmarks.md.
    assert not re.search(r"\d+(\.\d+)? ?(ms|MiB|s)/step|ms/step|\d\.\d+x", text)
    assert "(docs/benchmarks.md)" in text
