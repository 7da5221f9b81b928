"""The README's tour runs as it stands: its ```python blocks, in order, as one
script in a fresh process, the way a reader pastes them (the tour calls
`simulate_cpu_devices` itself, so the process starts without XLA_FLAGS)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", flags=re.S | re.M)


@pytest.mark.slow
def test_readme_tour_runs(tmp_path: Path) -> None:
    blocks = BLOCK.findall((ROOT / "README.md").read_text())
    assert blocks, "README.md has no ```python block"
    script = tmp_path / "tour.py"
    script.write_text("\n".join(blocks))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # The checkout's eqxdist, as the tests import it.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "held-out (77 rows)" in out.stdout
    accuracy = float(re.search(r"acc: ([0-9.]+)", out.stdout.split("held-out")[1])[1])
    assert accuracy > 0.6, out.stdout  # it learned: chance is 0.25
