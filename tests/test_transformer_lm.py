"""The transformer language-model example trains on padded, variable-length
sequences under FSDP x tensor parallelism with a token-weighted loss, reports a
finite loss, perplexity and gradient norm, and agrees with plain data parallelism
on the same batches (which splits the rows, and so the real tokens, differently
over the devices: only the globally token-weighted loss makes both agree); with
pipeline stages too, and with sequences split over a context axis inside the
pipeline's stages and the chunked loss. Run in its own process, as a user would
run it."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fresh_pythons import run_fresh

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "transformer_lm.py"


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    # `env` (the `script_env` fixture) leaves out the test process's flags (8
    # devices from conftest): the script sets up its own simulated devices.
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


# The default layout's run: trained, compared with data parallelism, and the
# uninterrupted run its resumed twin must end at (one run serves both checks).
COMMON = (
    *("--steps", "6", "--log-every", "3", "--save-every", "3"),
    *("--batch-size", "16", "--seq-len", "16", "--d-model", "32"),
    *("--min-weight-size", "64", "--min-len", "2"),
)


def _held_out(text: str) -> str:
    found = re.search(r"held-out loss (\S+), perplexity (\S+)", text)
    assert found is not None, text
    return found[0]


@pytest.mark.slow
def test_trains_agrees_with_data_parallel_and_resumes_the_exact_stream(
    tmp_path: Path, script_env: dict[str, str]
) -> None:
    """The default layout (FSDP x tensor rules) trains, agrees with data
    parallelism, and, stopped at step 3 and resumed (the loader's position
    travels in the checkpoint), ends where the uninterrupted run does; the
    comparison (`--compare-steps`) and the sample run after training and do
    not touch its stream."""
    whole = tmp_path / "whole"
    out = _run(
        script_env,
        *COMMON,
        *("--out", str(whole), "--compare-steps", "4", "--sample-chars", "8"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    # A fresh --out trains from step 0: the comparison's steps are a run of
    # their own, and nothing is resumed.
    assert "resumed" not in text
    # Megatron layout under FSDP: column-parallel by output features, row-parallel
    # by input features, and the free dimension sharded over "data".
    assert re.search(r"attn\.query\.weight\s+P\('model', 'data'\)", text)
    assert re.search(r"mlp\.down\.weight\s+P\('data', 'model'\)", text)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)  perplexity", text)]
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
    assert re.search(
        r"throughput: [\d,]+ tokens/s \([\d,]+ real.*MFU n/a \(the peak FLOP/s of "
        r"a 'cpu' device is unknown",
        text,
    )
    rows = [json.loads(r) for r in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6]
    for row in rows:
        # step_info's statistics reach the writers.
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
        assert math.isfinite(row["update_norm"]) and row["skipped"] == 0.0
        # Padded: between 2 and 16 real targets in each of the 16 rows, and
        # not all of them full (the lengths are random).
        assert 16 * 2 <= row["real_tokens"] < 16 * 16

    quick = (*COMMON, "--compare-steps", "0", "--sample-chars", "0")
    split = ("--out", str(tmp_path / "split"))
    first = _run(script_env, *quick, *split, "--stop-at", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    second = _run(script_env, *quick, *split, "--resume")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed" not in first.stdout
    assert "resumed at step 3" in second.stdout
    assert _held_out(second.stdout) == _held_out(text)
    rows = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [3, 6]


@pytest.mark.slow
def test_help_describes_every_option(tmp_path: Path) -> None:
    """`--help`, and the arguments refused before anything runs: each in a fresh
    Python (`run_fresh`: one process imports eqxdist once for all of them)."""
    runs = [
        ["--help"],
        ["--seq-len", "16", "--min-len", "17"],
        ["--schedule", "zb-h1"],
        [
            *("--pipeline-parallel", "2", "--context-parallel", "2"),
            *("--schedule", "interleaved", "--repeats", "2"),
        ],
        ["--expert-parallel"],
        ["--context-parallel", "4", "--seq-len", "12"],
    ]
    (status, text), *refused = run_fresh([[str(SCRIPT), *r] for r in runs], tmp_path)
    assert status == 0, text
    assert text.startswith("usage:")
    listing = text.split("options:", 1)[1]
    entries = re.findall(r"^  (--[a-z-]+)(.*?)(?=^  -|\Z)", listing, flags=re.M | re.S)
    options = [name for name, _ in entries]
    assert "--steps" in options and "--compare-steps" in options
    assert "--min-len" in options
    for name, help_text in entries:
        # Every option has a help text that states its default.
        assert "(default:" in help_text, name
    # Every schedule of ed.Pipeline is offered (1f1b the default), for a pipeline.
    assert re.search(r"--schedule \{1f1b,gpipe,zb-h1,circular,interleaved\}", text)
    for status, text in refused:
        assert status != 0, text
    messages = [
        "--min-len must be in [1, --seq-len=16]; got 17",
        "add --pipeline-parallel N",
        "--schedule interleaved does not go with --context-parallel",
        "--expert-parallel splits the experts",
        "--seq-len 12 must be a multiple of 2 x --context-parallel = 8",
    ]
    for (_, text), message in zip(refused, messages, strict=True):
        assert message in text, text
    assert "add --experts N" in refused[3][1]


@pytest.mark.slow
def test_pipeline_stages_agree_with_data_parallel(
    tmp_path: Path, script_env: dict[str, str]
) -> None:
    """`--pipeline-parallel 2 --schedule 1f1b --experts 4 --expert-parallel`: the
    blocks, an `ed.Stacked` of MoE blocks (their aux losses out of the stack),
    in 2 stages of a `{"stage": 2, "data": 4}` mesh, each device's 4 rows in 2
    microbatches, each device holding 1 of every layer's 4 experts; the same
    parameters as plain data parallelism."""
    out = _run(
        script_env,
        *("--out", str(tmp_path)),
        *("--steps", "4", "--compare-steps", "4", "--log-every", "2"),
        *("--batch-size", "16", "--seq-len", "16", "--d-model", "32"),
        *("--sample-chars", "0", "--min-weight-size", "64", "--min-len", "2"),
        *("--pipeline-parallel", "2", "--microbatches", "2", "--schedule", "1f1b"),
        *("--experts", "4", "--expert-parallel"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "2 blocks, d_model 32" in text and "mesh {'stage': 2, 'data': 4}" in text
    assert (
        "pipeline: 1f1b, 2 stages of 1 block(s), repeats 1, 2 microbatches of 2 "
        "rows per device: idle fraction 0.25 (ed.Pipeline.idle_fraction); remat none"
    ) in text
    # The experts' auxiliary loss is on the progress line.
    assert len(re.findall(r"perplexity \S+  aux_loss \d", text)) == 2
    # Each stage holds its layer, sharded over "data" too (FSDP).
    assert re.search(r"attn\.query\.weight\s+P\('stage', 'data', None\)", text)
    assert re.search(r"norm1\.weight\s+P\('stage',\)", text)
    # Each device holds its stage's layer's expert: split by expert over "data".
    assert re.search(r"mlp\.w_in\s+P\('stage', 'data'\)", text)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)  perplexity", text)]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    assert losses[1] < losses[0]
    agree = re.search(
        r"DP \(8 devices\) vs 1f1b pipeline x FSDP after 4 steps: "
        r"max \|param diff\| (\S+) .*parameters agree",
        text,
    )
    assert agree is not None, text
    assert float(agree[1]) < 1e-5


@pytest.mark.slow
def test_context_parallel_in_pipeline_stages_with_the_chunked_loss(
    tmp_path: Path, script_env: dict[str, str]
) -> None:
    """`--pipeline-parallel 2 --context-parallel 2 --chunked-loss 64`: the blocks
    in 2 GPipe stages, every sequence split over the 2 devices of "context"
    (ring attention) within each stage, the loss of the head chunk by chunk, on
    `{"stage": 2, "data": 2, "context": 2}`; the same parameters as data
    parallelism on whole sequences with Optax's loss, and the perplexity (exp of
    the token-mean loss) still on the progress line."""
    out = _run(
        script_env,
        *("--out", str(tmp_path)),
        *("--steps", "4", "--compare-steps", "4", "--log-every", "2"),
        *("--batch-size", "16", "--seq-len", "32", "--d-model", "32"),
        *("--sample-chars", "0", "--min-weight-size", "64", "--min-len", "2"),
        *("--pipeline-parallel", "2", "--microbatches", "2"),
        *("--context-parallel", "2", "--chunked-loss", "64"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "mesh {'stage': 2, 'data': 2, 'context': 2}" in text
    shown = re.findall(r"step \d/4  loss (\S+)  perplexity (\S+)  grad_norm", text)
    assert len(shown) == 2 and float(shown[1][0]) < float(shown[0][0])
    rows = [
        json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        assert math.isclose(row["perplexity"], math.exp(row["loss"]), rel_tol=1e-5)
    held_out = re.search(r"held-out loss (\S+), perplexity (\S+)", text)
    assert held_out is not None
    assert math.isclose(float(held_out[2]), math.exp(float(held_out[1])), rel_tol=1e-3)
    agree = re.search(
        r"DP \(8 devices\) vs gpipe pipeline x context-parallel x FSDP after 4 "
        r"steps: "
        r"max \|param diff\| (\S+) .*parameters agree",
        text,
    )
    assert agree is not None, text
    assert float(agree[1]) < 1e-5
