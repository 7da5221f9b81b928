"""The transformer language-model example trains under FSDP x tensor parallelism,
reports a finite loss and perplexity, and agrees with plain data parallelism on the
same batches. Run in its own process, as a user would run it."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "transformer_lm.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # The script sets up its own simulated devices; the test process's flags
    # (8 devices from conftest) must not leak into it.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_trains_and_agrees_with_data_parallel() -> None:
    out = _run(
        *("--steps", "6", "--compare-steps", "4", "--log-every", "3"),
        *("--batch-size", "16", "--seq-len", "16", "--d-model", "32"),
        *("--sample-chars", "8", "--min-weight-size", "64"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    # Megatron layout under FSDP: column-parallel by output features, row-parallel
    # by input features, and the free dimension sharded over "data".
    assert re.search(r"attn\.query\.weight\s+P\('model', 'data'\)", text)
    assert re.search(r"mlp\.down\.weight\s+P\('data', 'model'\)", text)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)  ppl", text)]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    held_out = re.search(r"held-out loss (\S+), perplexity (\S+)", text)
    assert held_out is not None
    loss, ppl = float(held_out[1]), float(held_out[2])
    assert math.isclose(ppl, math.exp(loss), rel_tol=1e-3)
    agree = re.search(
        r"after 4 steps: max \|param diff\| (\S+) .*parameters agree", text
    )
    assert agree is not None, text
    assert float(agree[1]) < 1e-5


@pytest.mark.slow
def test_help_describes_every_option() -> None:
    out = _run("--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:")
    listing = out.stdout.split("options:", 1)[1]
    entries = re.findall(r"^  (--[a-z-]+)(.*?)(?=^  -|\Z)", listing, flags=re.M | re.S)
    options = [name for name, _ in entries]
    assert "--steps" in options and "--compare-steps" in options
    for name, text in entries:
        # Every option has a help text that states its default.
        assert "(default:" in text, name
