"""The examples keep working: every one answers `--help`, the main job trains and
reports that the strategies agree, stops cleanly on Ctrl-C and resumes, and the
multi-process example recovers from a crash by a restart. Each runs in its own
process, as a user would run it."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from compile_speed import script_flags
from fresh_pythons import run_fresh

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(
    p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_")
)

# `python` with SIGINT at its default, as a terminal's Ctrl-C finds it, although
# a run in the background (CI) inherits it ignored: reset, then exec Python.
WITH_SIGINT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
]


def _run(
    env: dict[str, str], *args: str, timeout: int = 240
) -> subprocess.CompletedProcess[str]:
    """`python *args` from the repository root, in `env` (the `script_env`
    fixture)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_every_example_answers_help(tmp_path: Path) -> None:
    """`python examples/<name>.py --help`, each in a fresh Python (`run_fresh`: one
    process imports eqxdist once for all of them)."""
    ran = run_fresh([[str(script), "--help"] for script in EXAMPLES], tmp_path)
    for script, (status, output) in zip(EXAMPLES, ran, strict=True):
        assert status == 0, f"{script.name} --help:\n{output}"
        assert output.startswith("usage:"), f"{script.name} --help:\n{output}"


def _logged_after(path: Path, step: int) -> list[dict[str, float]]:
    """The metrics.jsonl rows of the steps after `step`, without the timings."""
    timings = {"steps_per_sec", "examples_per_sec"}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        {k: v for k, v in row.items() if k not in timings}
        for row in rows
        if row["step"] > step
    ]


@pytest.mark.slow
def test_main_job_trains_four_ways_and_resumes_exactly(
    tmp_path: Path, training_script_env: dict[str, str]
) -> None:
    """README command 1 as the README runs it, for 2 epochs instead of 10 (each
    epoch runs the same programs; the README's figures after 10 come from running
    it): every strategy logs, evaluates and writes TensorBoard events, and the
    first three agree. Then a data-parallel run stopped after epoch 1 and resumed
    from its checkpoint continues the loader's stream exactly: every loss,
    accuracy and held-out metric it logs after the restart is bit-identical to the
    uninterrupted run's (another batch would change the loss); the checkpoint's
    metadata holds the loader's position and the stream's seed and batch size,
    and a resume with another seed is refused."""
    import eqxdist as ed

    whole = tmp_path / "whole"
    main_job = ["examples/train_classifier.py", "--epochs", "2"]
    out = _run(training_script_env, *main_job, "--out", str(whole), timeout=1800)
    assert out.returncode == 0, out.stdout + out.stderr
    for strategy in ("single", "dp", "fsdp", "reorder"):
        assert f"\n{strategy} " in out.stdout
        rows = [
            json.loads(line)
            for line in (whole / strategy / "metrics.jsonl").read_text().splitlines()
        ]
        # Every 5th step and the last of 2 epochs x 11 steps; one evaluation per
        # epoch.
        assert [r["step"] for r in rows if "loss" in r] == [5, 10, 15, 20, 22]
        assert [r["step"] for r in rows if "eval_loss" in r] == [11, 22]
        assert all(
            r["learning_rate"] == pytest.approx(3e-3) for r in rows if "loss" in r
        )
        assert list((whole / "tensorboard" / strategy).glob("events.out.*"))
    assert "parameters of single/dp/fsdp agree: yes (after epoch 1" in out.stdout
    assert "held-out confusion matrix" in out.stdout

    args = [*main_job, "--strategies", "dp", "--out", str(tmp_path / "split")]
    first = _run(training_script_env, *args, "--stop-after", "1")
    assert first.returncode == 0, first.stderr
    with ed.CheckpointManager(tmp_path / "split" / "dp") as manager:
        assert manager.latest_step() == 11
        assert manager.metadata(11) == {"loader_step": 11, "seed": 0, "batch_size": 128}
    assert re.search(r"\ndp +8 +1 ", first.stdout), first.stdout  # epochs trained
    other = _run(training_script_env, *args, "--resume", "--seed", "1")
    assert other.returncode != 0
    assert "this run asks for {'seed': 1, 'batch_size': 128}" in other.stderr
    second = _run(training_script_env, *args, "--resume")
    assert second.returncode == 0, second.stderr
    assert "dp resumed at step 11" in second.stdout
    resumed = _logged_after(tmp_path / "split" / "dp" / "metrics.jsonl", 11)
    reference = _logged_after(whole / "dp" / "metrics.jsonl", 11)
    assert [r["step"] for r in resumed] == [15, 20, 22, 22]
    assert resumed == reference


@pytest.mark.slow
def test_quickstart_runs(script_env: dict[str, str]) -> None:
    out = _run(script_env, "examples/quickstart.py")
    assert out.returncode == 0, out.stderr
    assert "data-parallel step vs single program" in out.stdout


@pytest.mark.slow
def test_dcgan_parts_equal_one_device(
    tmp_path: Path, script_env: dict[str, str]
) -> None:
    """examples/dcgan.py: its two part steps, in the global view, through
    `train_loop` with checkpoints, against the same training in plain Equinox and
    Optax on one device (SGD: Adam's first steps amplify rounding, see the
    example's docstring). Data parallel; `--strategy fsdp` is the same script
    with another `strategy=` (part steps under FSDP in either view:
    `tests/step/test_parts.py`)."""
    out = _run(
        script_env, "examples/dcgan.py", "--steps", "3", "--optimizer", "sgd",
        "--lr", "0.05", "--strategy", "dp", "--check", "--out", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.search(
        r"largest parameter difference from one device: (\S+) "
        r"\(tolerance 5e-04, sgd\): parameters agree",
        out.stdout,
    )
    assert found is not None, out.stdout
    assert float(found.group(1)) < 1e-5
    assert "after 3 steps (6 part steps)" in out.stdout
    # The loop's default `show` prints both parts' losses.
    assert re.search(r"^step 3/3  disc/loss \S+  gen/loss \S+$", out.stdout, re.M)
    assert (tmp_path / "checkpoints").is_dir()


@pytest.mark.slow
def test_main_job_ctrl_c_saves_and_resume_logs_each_step_once(
    tmp_path: Path, training_script_env: dict[str, str]
) -> None:
    """Ctrl-C in the middle of epoch 2 saves the step the run is at and ends it
    with one line and status 130 (it was a long `KeyboardInterrupt` traceback,
    nothing saved); `--resume` then logs every step once; a `--resume` of the
    finished run says there is nothing to run (it printed `nan` step times)."""
    import eqxdist as ed

    args = ["examples/train_classifier.py", "--epochs", "2", "--strategies", "dp"]
    args += ["--log-every", "1", "--out", str(tmp_path)]
    run = subprocess.Popen(
        [*WITH_SIGINT, *args],
        cwd=ROOT,
        env=training_script_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert run.stdout is not None
    lines = []
    for line in run.stdout:
        lines.append(line)
        if "dp step 13/22 " in line:  # the plain progress line of step 13
            run.send_signal(signal.SIGINT)
            break
    rest, err = run.communicate(timeout=240)
    out = "".join(lines) + rest
    assert run.returncode == 130, out + err
    stopped = re.search(r"dp interrupted \(Ctrl-C\): saved step (\d+), exiting\n", out)
    assert stopped, out
    saved = int(stopped[1])
    assert 13 < saved < 22 and "Traceback" not in err, err
    assert ed.latest_step(tmp_path / "dp") == saved
    resumed = _run(training_script_env, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"dp resumed at step {saved}" in resumed.stdout
    rows = [
        json.loads(line)
        for line in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 23))
    assert [r["step"] for r in rows if "eval_loss" in r] == [11, 22]
    again = _run(training_script_env, *args, "--resume")
    assert again.returncode == 0, again.stderr
    assert "dp already at step 22 of 22: nothing to run" in again.stdout
    assert "nan" not in again.stdout and re.search(r"\ndp .* - ", again.stdout)


@pytest.mark.slow
def test_multi_process_example_restarts_past_a_crash(tmp_path: Path) -> None:
    """`--crash-at` crashes the first attempt only, so `--max-restarts 1` shows a
    restart that resumes from the latest checkpoint and finishes (the crash came
    back after every restart). This is also the launcher's test of restarting a
    JAX job (its distributed service joined again after a crash); the launcher's
    own restart tests use plain processes."""
    import eqxdist as ed

    # No shared compilation cache: the processes run at once (see `cached_env`).
    env = {**os.environ, "XLA_FLAGS": script_flags()}
    out = _run(
        env, "-m", "eqxdist.launch", "-n", "2", "-d", "2", "--max-restarts", "1",
        "examples/multi_process.py", "--checkpoint-dir", str(tmp_path),
        "--steps", "12", "--crash-at", "7", "--log-every", "4",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    # Process 1 crashes; process 0, in a collective with it, may see the broken
    # connection and exit first: the launcher restarts after whichever it sees.
    assert re.search(
        r"restart 1 of 1 after process [01] exited with status 1", out.stderr
    ), out.stderr
    assert (out.stdout + out.stderr).count("RuntimeError: --crash-at 7") == 1
    assert "[0] resumed from step 5" in out.stdout
    assert "[0] === Steps 8-11 ===" in out.stdout
    assert ed.latest_step(tmp_path) == 12


@pytest.mark.slow
def test_finetune_lora_under_a_pipeline(
    tmp_path: Path, script_env: dict[str, str]
) -> None:
    """examples/finetune_lora.py at a few steps under its 1F1B pipeline layout:
    the checkpoint loads to the NumPy reference's logits, the loss falls, and the
    merged model written back reloads to the fine-tuned logits (its asserts)."""
    out = _run(
        script_env,
        "examples/finetune_lora.py",
        "--out",
        str(tmp_path),
        "--layout",
        "pipeline",
        "--steps",
        "4",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "logits vs the NumPy reference" in out.stdout
    assert (tmp_path / "merged" / "model.safetensors").exists()
