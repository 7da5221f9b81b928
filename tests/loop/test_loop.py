"""`train_loop`: the same parameters as a bare loop over the step (and as plain
single-device Optax), exact resume, what it logs, evaluation, preemption and
Ctrl-C, profiling, the progress bar, and the watchdog ending a process whose step
never completes."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compile_speed import script_flags
from reference import train_one_device

import eqxdist as ed

ROWS, STEPS = 32, 12
SCHEDULE = optax.linear_schedule(1e-2, 1e-3, STEPS)
OPTIMIZER = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS * 5, 8)).astype(np.float32)
    return x, np.tanh(x[:, :3] @ rng.normal(size=(3, 2))).astype(np.float32)


X, Y = _data()


def batch(step: int) -> dict[str, np.ndarray]:
    rows = slice(ROWS * (step % 5), ROWS * (step % 5 + 1))
    return {"x": X[rows], "y": Y[rows]}


def loss_fn(model: Any, b: Any, key: Any) -> Any:
    losses = jnp.mean((jax.vmap(model)(b["x"]) - b["y"]) ** 2, axis=1)
    return jnp.mean(losses), ed.MetricCollection({"loss": ed.metrics.Mean()}).update(
        loss=(losses,)
    )


def eval_fn(model: Any, b: Any, mask: Any) -> Any:
    losses = jnp.mean((jax.vmap(model)(b["x"]) - b["y"]) ** 2, axis=1)
    return ed.MetricCollection({"loss": ed.metrics.Mean()}).update(loss=(losses, mask))


def make_state() -> ed.TrainState:
    model = eqx.nn.MLP(8, 2, 16, 1, key=jax.random.key(0))
    return ed.TrainState.create(model, OPTIMIZER, jax.random.key(1))


def params(state_or_model: Any) -> list[np.ndarray]:
    model = getattr(state_or_model, "model", state_or_model)
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


def test_loop_equals_a_bare_loop_and_plain_optax(mesh8: Any, tmp_path: Path) -> None:
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    state = step.place_state(make_state())
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, batch(i))
        losses.append(float(metrics.compute()["loss"]))
    with ed.JsonlWriter(tmp_path / "m.jsonl") as writer:
        result = ed.train_loop(
            step, make_state(), batch, STEPS, writer=writer, log_every=5,
            progress=False,
        )  # fmt: skip
    assert result.step == STEPS and not result.preempted
    for a, b in zip(params(result.state), params(state), strict=True):
        np.testing.assert_array_equal(a, b)
    # Plain single-device Equinox + Optax on the same batches.
    batches = [batch(i) for i in range(STEPS)]
    model = train_one_device(make_state().model, batches, OPTIMIZER, loss_fn).model
    for a, b in zip(params(result.state), params(model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Log points at 5, 10 and the end; the logged values are the step's own.
    rows = [json.loads(r) for r in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 12]
    for r in rows:
        assert r["loss"] == pytest.approx(losses[r["step"] - 1], rel=1e-6)
        # The rate the logged step used (its count before the step).
        lr = float(SCHEDULE(r["step"] - 1))
        assert r["learning_rate"] == pytest.approx(lr, rel=1e-6)
    assert rows[1]["examples_per_sec"] == pytest.approx(ROWS * rows[1]["steps_per_sec"])
    assert "mfu" not in rows[1]  # CPU: no known peak
    assert result.logs[-1][1]["loss"] == rows[-1]["loss"]


def test_resume_continues_exactly(mesh8: Any, tmp_path: Path) -> None:
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    whole = ed.train_loop(step, make_state(), batch, STEPS, progress=False)
    with ed.CheckpointManager(tmp_path, save_interval_steps=4) as manager:
        first = ed.train_loop(
            step, make_state(), batch, STEPS, checkpoints=manager, stop_at=7,
            progress=False,
        )  # fmt: skip
        assert first.step == 7 and manager.all_steps() == [4, 7]
    with ed.CheckpointManager(tmp_path, save_interval_steps=4) as manager:
        second = ed.train_loop(
            step, make_state(), batch, STEPS, checkpoints=manager, progress=False
        )
        assert second.start_step == 7 and manager.latest_step() == STEPS
    for a, b in zip(params(second.state), params(whole.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_resume_through_a_batch_loader_with_metadata(
    mesh8: Any, tmp_path: Path
) -> None:
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    data = {"x": X, "y": Y}  # 5 batches of 32 rows per epoch, shuffled per epoch

    def run(**kwargs: Any) -> ed.LoopResult:
        with ed.BatchLoader(data, ROWS, mesh8, seed=3) as loader:
            return ed.train_loop(
                step, make_state(), loader, STEPS, progress=False, **kwargs
            )

    whole = run()
    epoch = {"metadata": lambda s: {"epoch": s // 5}}
    with ed.CheckpointManager(tmp_path, save_interval_steps=4) as manager:
        assert run(checkpoints=manager, stop_at=7, **epoch).step == 7
        assert manager.metadata(7) == {"loader_step": 7, "epoch": 1}
        assert manager.metadata(4) == {"loader_step": 4, "epoch": 0}
    with ed.CheckpointManager(tmp_path, save_interval_steps=4) as manager:
        assert run(checkpoints=manager, **epoch).start_step == 7
        resumed = manager.restore(whole.state)
    for a, b in zip(params(resumed), params(whole.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_periodic_evaluation(mesh8: Any, tmp_path: Path) -> None:
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    evaluate = ed.make_eval_step(eval_fn, mesh8)
    held_out = {"x": X[:13], "y": Y[:13]}  # not a multiple of 8 devices
    with ed.CsvWriter(tmp_path / "m.csv") as writer:
        result = ed.train_loop(
            step, make_state(), batch, 10, writer=writer, eval_step=evaluate,
            eval_batches=[held_out, held_out], eval_every=4, progress=False,
        )  # fmt: skip
    assert [s for s, _ in result.evals] == [4, 8, 10]
    model = result.state.model
    expected = np.mean(
        (np.asarray(jax.vmap(model)(held_out["x"])) - held_out["y"]) ** 2
    )
    assert float(result.evals[-1][1]["loss"]) == pytest.approx(expected, rel=1e-5)
    assert "eval_loss" in (tmp_path / "m.csv").read_text().splitlines()[0]


def test_preemption_saves_and_stops(mesh8: Any, tmp_path: Path) -> None:
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)

    def signalling(s: int) -> Any:
        if s == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would
        return batch(s)

    with ed.CheckpointManager(tmp_path, save_interval_steps=100) as manager:
        result = ed.train_loop(
            step, make_state(), signalling, STEPS, checkpoints=manager,
            exit_on_preemption=False, progress=False,
        )  # fmt: skip
        assert result.preempted and result.step == 6
        assert manager.all_steps() == [6]
    with ed.CheckpointManager(tmp_path / "b", save_interval_steps=100) as manager:
        with pytest.raises(SystemExit) as exit_:
            ed.train_loop(
                step, make_state(), signalling, STEPS, checkpoints=manager,
                progress=False,
            )  # fmt: skip
        assert exit_.value.code == 0 and manager.all_steps() == [6]


@pytest.fixture
def python_sigint_handler() -> Any:
    """Python's own SIGINT handler (raising `KeyboardInterrupt`), as in a script
    run from a terminal, whatever the test runner installed."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_saves_the_step_and_stops_cleanly(
    mesh8: Any, tmp_path: Path, python_sigint_handler: Any, capsys: Any
) -> None:
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    presses = 1

    def interrupted(s: int) -> Any:
        if s == 5:
            for _ in range(presses):
                signal.raise_signal(signal.SIGINT)  # Ctrl-C while step 6 runs
        return batch(s)

    with ed.CheckpointManager(tmp_path / "a", save_interval_steps=100) as manager:
        result = ed.train_loop(
            step, make_state(), interrupted, STEPS, checkpoints=manager,
            exit_on_preemption=False, progress=False,
        )  # fmt: skip
        assert result.interrupted and not result.preempted and result.step == 6
        assert manager.all_steps() == [6]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert "interrupted (Ctrl-C): saved step 6\n" in capsys.readouterr().out
    # The saved step is the state the loop ended on.
    for a, b in zip(params(ed.restore_checkpoint(tmp_path / "a", result.state)),
                    params(result.state), strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    with ed.CheckpointManager(tmp_path / "b", save_interval_steps=100) as manager:
        with pytest.raises(SystemExit) as exit_:
            ed.train_loop(
                step, make_state(), interrupted, STEPS, checkpoints=manager,
                progress=False,
            )  # fmt: skip
        # 128 + SIGINT, no traceback; the step is saved.
        assert exit_.value.code == 130 and manager.all_steps() == [6]
    assert "interrupted (Ctrl-C): saved step 6, exiting" in capsys.readouterr().out
    presses = 2  # a second Ctrl-C stops at once
    with (
        ed.CheckpointManager(tmp_path / "c", save_interval_steps=100) as manager,
        pytest.raises(KeyboardInterrupt),
    ):
        ed.train_loop(
            step, make_state(), interrupted, STEPS, checkpoints=manager,
            progress=False,
        )  # fmt: skip
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_evaluation_at_the_end_only(mesh8: Any) -> None:
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    evaluate = ed.make_eval_step(eval_fn, mesh8)
    held_out = {"x": X[:13], "y": Y[:13]}
    result = ed.train_loop(
        step, make_state(), batch, 6, eval_step=evaluate, eval_batches=held_out,
        progress=False,
    )  # fmt: skip
    assert [s for s, _ in result.evals] == [6]
    model = result.state.model
    expected = np.mean(
        (np.asarray(jax.vmap(model)(held_out["x"])) - held_out["y"]) ** 2
    )
    assert float(result.evals[0][1]["loss"]) == pytest.approx(expected, rel=1e-5)


def logged(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL log without the timings, which differ run to run."""
    timings = {"steps_per_sec", "examples_per_sec"}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in timings} for r in rows]


def test_a_resumed_run_logs_each_step_once(
    mesh8: Any, tmp_path: Path, capsys: Any
) -> None:
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    with ed.JsonlWriter(tmp_path / "whole.jsonl") as writer:
        ed.train_loop(
            step, make_state(), batch, STEPS, writer=writer, log_every=1,
            progress=False,
        )  # fmt: skip

    def crashing(s: int) -> Any:
        if s == 7:
            raise RuntimeError("the machine went away")
        return batch(s)

    path = tmp_path / "run.jsonl"
    with (
        ed.CheckpointManager(tmp_path / "ckpt", save_interval_steps=4) as manager,
        ed.JsonlWriter(path) as writer,
        pytest.raises(RuntimeError, match="went away"),
    ):
        ed.train_loop(
            step, make_state(), crashing, STEPS, writer=writer, log_every=1,
            checkpoints=manager, progress=False,
        )  # fmt: skip
    # Logged past the checkpoint at step 4 before the crash (in step 8's batch).
    assert [r["step"] for r in logged(path)] == [1, 2, 3, 4, 5, 6]
    with (
        ed.CheckpointManager(tmp_path / "ckpt", save_interval_steps=4) as manager,
        ed.JsonlWriter(path, append=True) as writer,
    ):
        result = ed.train_loop(
            step, make_state(), batch, STEPS, writer=writer, log_every=1,
            checkpoints=manager, progress=False,
        )  # fmt: skip
        assert result.start_step == 4
    assert logged(path) == logged(tmp_path / "whole.jsonl")
    # Resumed at its end: nothing to run, and it says so.
    capsys.readouterr()
    with ed.CheckpointManager(tmp_path / "ckpt") as manager:
        again = ed.train_loop(
            step, make_state(), batch, STEPS, checkpoints=manager, progress=False
        )
    assert again.start_step == again.step == STEPS and not again.logs
    assert (
        capsys.readouterr().out
        == f"already at step {STEPS} of {STEPS}: nothing to run\n"
    )


def test_a_writer_of_ones_own(mesh8: Any) -> None:
    class Recorder:  # the protocol, no eqxdist base class
        def __init__(self) -> None:
            self.steps: list[int] = []

        def write(self, step: int, values: Any) -> None:
            self.steps.append(step)

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    recorder = Recorder()
    ed.train_loop(
        step, make_state(), batch, 4, writer=recorder, log_every=2, progress=False
    )
    assert recorder.steps == [2, 4]


def test_profile_and_compilation_cache(mesh8: Any, tmp_path: Path) -> None:
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    before = jax.config.jax_compilation_cache_dir
    min_seconds = jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        ed.train_loop(
            step, make_state(), batch, 4, profile_steps=(1, 3),
            profile_dir=tmp_path / "trace", compilation_cache_dir=tmp_path / "cache",
            progress=False,
        )  # fmt: skip
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")
    finally:  # conftest's cache, as it was
        jax.config.update("jax_compilation_cache_dir", before)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))


def test_plain_progress_lines(mesh8: Any, capsys: Any) -> None:
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    ed.train_loop(step, make_state(), batch, 4, log_every=2, progress=False, name="mlp")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["mlp step 2/4", "mlp step 4/4"]
    assert all("  loss " in line for line in lines)


def test_bad_arguments(mesh8: Any) -> None:
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    with pytest.raises(
        ValueError, match="`log_every`, `eval_every` and `max_in_flight` must be >= 1"
    ):
        ed.train_loop(step, make_state(), batch, 4, log_every=0)
    with pytest.raises(
        ValueError, match="`eval_step`, `eval_batches` and `eval_every`"
    ):
        ed.train_loop(step, make_state(), batch, 4, eval_every=2)
    with pytest.raises(ValueError, match="`profile_steps` needs a `profile_dir`"):
        ed.train_loop(step, make_state(), batch, 4, profile_steps=(0, 1))
    with pytest.raises(ValueError, match="`timeout` must be > 0"):
        ed.Watchdog(0)


HANG = """
import time
import eqxdist as ed
ed.simulate_cpu_devices(2)
import jax, jax.numpy as jnp, equinox as eqx, optax, numpy as np

def hang(x):
    time.sleep(3600)  # a step that never completes, as a hung collective
    return x

def loss_fn(model, b, key):
    x = b["x"]
    x = jax.lax.cond(b["hang"][0] > 0,
        lambda x: jax.pure_callback(hang, x, x), lambda x: x, x)
    return jnp.mean(jax.vmap(model)(x) ** 2), {}

model = eqx.nn.Linear(4, 1, key=jax.random.key(0))
step = ed.make_train_step(loss_fn, optax.sgd(0.1), ed.create_data_parallel_mesh())
state = ed.TrainState.create(model, optax.sgd(0.1), jax.random.key(0))
batch = lambda s: {"x": np.ones((2, 4), np.float32),
                   "hang": np.full((2,), s >= 3, np.int32)}
print("training", flush=True)
ed.train_loop(step, state, batch, 100, watchdog_timeout=3, progress=False)
print("not reached", flush=True)
"""


@pytest.mark.slow
def test_watchdog_ends_a_process_whose_step_never_completes() -> None:
    env = {**os.environ, "XLA_FLAGS": script_flags()}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(HANG)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "training" in result.stdout and "not reached" not in result.stdout
    assert "eqxdist watchdog: no step completed" in result.stderr
    # Every thread's stack, the main thread's inside the loop.
    assert "Thread 0x" in result.stderr and "train_loop" in result.stderr


def test_progress_bar_shows_rate_and_values(capsys: Any) -> None:
    progress = ed.Progress(10, name="demo", bar=True)
    progress.advance(3)
    progress.update(5, {"loss": 0.5})
    progress.print("a line above the bar")
    progress.close()
    out = capsys.readouterr().out
    assert "demo" in out and "5/10" in out and "loss 0.5" in out
    assert "step/s" in out and "a line above the bar" in out


def test_progress_numbers_fit_a_terminal_line(capsys: Any) -> None:
    """Large values are written with a suffix, not in exponent form: a bar's
    postfix cut at the terminal's width never cuts `1.564e+04` to `1.564`."""
    progress = ed.Progress(10, bar=False)
    progress.update(1, {"tokens_per_sec": 15640.2, "loss": 0.41234, "n": 3.2e7})
    out = capsys.readouterr().out
    assert "tokens_per_sec 15.64k  loss 0.4123  n 32M" in out


def test_progress_bar_counts_each_step_once(mesh8: Any, capsys: Any) -> None:
    # A log point's values arrive after the bar has moved on: the bar stays.
    progress = ed.Progress(11, bar=True)
    for s in range(1, 11):
        progress.advance(s)
    progress.update(5, {"loss": 0.5})
    progress.advance(11)
    assert progress._bar.n == 11 and progress.step == 11
    progress.close()
    capsys.readouterr()
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8)
    ed.train_loop(step, make_state(), batch, 11, log_every=5, progress=True)
    out = capsys.readouterr().out
    # tqdm drops the total ("16step") once the count passes it.
    assert "11/11" in out and not re.search(r"\d+step \[", out), out


def test_progress_bar_without_tqdm_is_an_error(monkeypatch: Any) -> None:
    # Asked for by name, a missing tqdm is an error, not silently plain lines.
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(ImportError, match=r"Progress\(bar=True\) needs tqdm"):
        ed.Progress(10, bar=True)
    ed.Progress(10, bar=None).close()  # chosen automatically: plain lines


def test_logs_step_info_grad_norm(mesh8: Any, tmp_path: Path) -> None:
    """A step made with `step_info=True`: the loop writes its statistics, and the
    logged `grad_norm` is the norm of the single-device gradient."""
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8, step_info=True)
    with ed.JsonlWriter(tmp_path / "m.jsonl") as writer:
        ed.train_loop(
            step, make_state(), batch, 1, writer=writer, log_every=1, progress=False
        )
    (row,) = [json.loads(r) for r in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["skipped"] == 0.0

    # Plain single-device Equinox + Optax on the same global batch.
    def mse(model: Any, b: Any, key: Any) -> Any:
        return jnp.mean((jax.vmap(model)(b["x"]) - b["y"]) ** 2)

    one_step = train_one_device(make_state().model, [batch(0)], OPTIMIZER, mse)
    grads, updates = one_step.grads, one_step.updates
    expected = float(optax.tree.norm(eqx.filter(grads, eqx.is_array)))
    np.testing.assert_allclose(row["grad_norm"], expected, rtol=1e-5)
    new = eqx.filter(one_step.model, eqx.is_array)
    np.testing.assert_allclose(
        row["update_norm"], float(optax.tree.norm(updates)), rtol=1e-5
    )
    np.testing.assert_allclose(
        row["param_norm"], float(optax.tree.norm(new)), rtol=1e-5
    )


PART_OPTIMIZERS = {"first": optax.sgd(0.1), "last": optax.sgd(0.05)}
PART_OF = {"first": lambda m: m.layers[0], "last": lambda m: m.layers[1]}


def _one_device_part_losses(steps: int) -> list[dict[str, float]]:
    """Plain Equinox and Optax: each loop step, the part `first`'s SGD step then
    `last`'s on the same batch; the loss each step computed (before its
    update), as the part steps' `loss` metric holds it."""
    model = make_state().model
    opt_states = {
        name: PART_OPTIMIZERS[name].init(eqx.filter(where(model), eqx.is_array))
        for name, where in PART_OF.items()
    }
    losses = []
    for s in range(steps):
        logged = {}
        for name, where in PART_OF.items():

            def part_loss(part: Any, model: Any, b: Any, where: Any = where) -> Any:
                return loss_fn(eqx.tree_at(where, model, part), b, None)[0]

            value, grads = eqx.filter_value_and_grad(part_loss)(
                where(model), model, batch(s)
            )
            updates, opt_states[name] = PART_OPTIMIZERS[name].update(
                grads, opt_states[name]
            )
            model = eqx.tree_at(where, model, eqx.apply_updates(where(model), updates))
            logged[f"{name}/loss"] = float(value)
        losses.append(logged)
    return losses


def test_default_show_prints_every_parts_loss(
    mesh8: Any, tmp_path: Path, capsys: Any
) -> None:
    """A loop over part steps logs `first/loss` and `last/loss`: the default
    `show=("loss",)` prints both (each the single-device loss of its part step),
    and an explicit `show` still prints only what it names."""
    steps = {
        name: ed.make_train_step(loss_fn, PART_OPTIMIZERS, mesh8, part=name)
        for name in PART_OF
    }

    def state() -> ed.TrainState:
        model = make_state().model
        return ed.TrainState.create(
            model, PART_OPTIMIZERS, jax.random.key(1), parts=PART_OF
        )

    with ed.JsonlWriter(tmp_path / "m.jsonl") as writer:
        ed.train_loop(steps, state(), batch, 2, writer=writer, log_every=1,
                      progress=False)  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    expected = _one_device_part_losses(2)
    assert len(lines) == 2
    for s, (line, want) in enumerate(zip(lines, expected, strict=True)):
        shown = re.fullmatch(
            rf"step {s + 1}/2  first/loss (\S+)  last/loss (\S+)", line
        )
        assert shown is not None, line
        # Printed to 4 significant digits.
        np.testing.assert_allclose(
            [float(v) for v in shown.groups()], list(want.values()), rtol=1e-3
        )
    for row, want in zip(logged(tmp_path / "m.jsonl"), expected, strict=True):
        np.testing.assert_allclose(
            [row["first/loss"], row["last/loss"]], list(want.values()), rtol=1e-5
        )

    ed.train_loop(steps, state(), batch, 2, log_every=1, progress=False,
                  show=("last/loss",))  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r"last/loss \S+", "last/loss X", x) for x in lines] == [
        "step 1/2  last/loss X",
        "step 2/2  last/loss X",
    ]
