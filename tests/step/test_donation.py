"""Safe donation: a step donates only the state it returned itself; a consumed
state is a ValueError everywhere, never a crash. The scenarios run in a process
of their own, so that a segfault fails the test instead of killing pytest; one
process runs every scenario of a strategy in turn, each from a fresh step and
fresh states (the process says which scenario it is in before it starts it)."""

import subprocess
import sys
import textwrap

import pytest

# Run once per process.
SET_UP = textwrap.dedent(
    """
    import os
    import eqxdist as ed
    ed.simulate_cpu_devices(8)
    import equinox as eqx, jax, numpy as np, optax

    mesh = ed.create_data_parallel_mesh()
    opt = optax.adam(1e-2)

    def loss_fn(model, batch, key):
        return ((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2).mean(), {}

    def eval_fn(model, batch, mask):
        return {"n": mask.sum()}

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 4)).astype(np.float32),
             "y": rng.normal(size=(16, 2)).astype(np.float32)}
    model = eqx.nn.MLP(4, 2, 32, 1, key=jax.random.key(0))
    """
)

# Run before each scenario: a fresh step, and a state it consumed (`s2`).
PRELUDE = textwrap.dedent(
    """
    step = ed.make_train_step(loss_fn, opt, mesh, strategy=os.environ["STRATEGY"],
                              min_weight_size=16)
    s1 = ed.TrainState.create(model, opt, jax.random.key(0))
    s2, _ = step(s1, batch)
    if os.environ.get("HOST_COPY"):
        # As every logger does: on CPU the host copy of a replicated array can be
        # a view of its device buffer, which then never reports itself deleted.
        host = jax.device_get(s2)
    s3, _ = step(s2, batch)   # s2 is consumed (donated) now

    def expect_error(fn, *parts):
        try:
            fn()
        except ValueError as e:
            for part in parts:
                assert part in str(e), e
        else:
            raise AssertionError("no ValueError")

    def expect_consumed(fn):
        expect_error(
            fn, "consumed by an earlier step", "pass the state the step returned"
        )
    """
)

SCENARIOS = {
    "step": "expect_consumed(lambda: step(s2, batch))",
    "place_state": "expect_consumed(lambda: step.place_state(s2))",
    "lower": "expect_consumed(lambda: step.lower(s2, batch))",
    "eval": "expect_consumed(lambda: ed.make_eval_step(eval_fn, mesh)(s2, batch))",
    "save_checkpoint": (
        "import tempfile\n"
        "expect_consumed(lambda: ed.save_checkpoint(tempfile.mkdtemp(), s2, step=1))"
    ),
    # Another step object never consumes a state it did not return: the state
    # `step` returned last stays valid for `step`.
    "other_step": (
        "other = ed.make_train_step(loss_fn, opt, mesh,"
        " strategy=os.environ['STRATEGY'], min_weight_size=16)\n"
        "s4, _ = other(s3, batch); w4 = np.asarray(s4.model.layers[0].weight)\n"
        "s5, _ = other(s4, batch)\n"
        "s4b, _ = step(s3, batch)\n"
        "np.testing.assert_array_equal(w4, s4b.model.layers[0].weight)"
    ),
    # An array of the step's own state put into another state (`eqx.tree_at`)
    # goes when that state is consumed: the error names the sharing and its fixes.
    "shared_array": (
        "w = s3.model.layers[0].weight\n"
        "shared = eqx.tree_at(lambda s: s.model.layers[0].weight, s1, w)\n"
        "s4, _ = step(s3, batch)  # donates s3, and so `shared`'s weight\n"
        "expect_error(lambda: step(shared, batch), 'consumed by an earlier step',"
        " 'shared with another state',"
        " 'donate=False')"
    ),
    # The caller's arrays survive: a fresh state (s1 is not the step's own) is
    # copied, and a model placed by the caller is used by two fresh states.
    "caller_arrays_survive": (
        "placed = ed.replicate_params(model, mesh)\n"
        "a = ed.TrainState.create(placed, opt, jax.random.key(0))\n"
        "b = ed.TrainState.create(placed, opt, jax.random.key(1))\n"
        "a2, _ = step(a, batch); a3, _ = step(a2, batch)\n"
        "b2, _ = step(b, batch)\n"
        "arrays = jax.tree.leaves(eqx.filter(placed, eqx.is_array))\n"
        "assert not any(x.is_deleted() for x in arrays)\n"
        "assert np.isfinite(float(arrays[0].sum()))\n"
        "again, _ = step(s1, batch)  # s1 was never consumed: copied, still valid\n"
        "assert int(again.step) == 1"
    ),
}


def _run_scenarios(scenarios, env):
    """`SCENARIOS[scenario]` after the prelude for each of `scenarios`, in turn in
    one fresh process, each in a namespace of its own: it ends, each scenario
    passes."""
    code = SET_UP + "\nimport sys\nbase = dict(globals())\n"
    for scenario in scenarios:
        body = PRELUDE + "\n" + SCENARIOS[scenario]
        code += (
            f"print('scenario', {scenario!r}, flush=True)\n"
            f"exec(compile({body!r}, {scenario!r}, 'exec'), dict(base))\n"
        )
    proc = subprocess.run(
        [sys.executable, "-c", code + "print('OK')\n"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = [line.split()[1] for line in proc.stdout.splitlines() if "scenario" in line]
    assert ran == list(scenarios)
    assert proc.stdout.strip().endswith("OK")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_consumed_state(strategy, cached_env):
    _run_scenarios(sorted(SCENARIOS), {**cached_env, "STRATEGY": strategy})


HOST_COPY_ENTRY_POINTS = ["step", "place_state", "lower", "eval", "save_checkpoint"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_consumed_state_read_to_host(strategy, cached_env):
    """A consumed state whose arrays were read to the host first
    (`jax.device_get`) is the same `ValueError`, never a SIGSEGV."""
    _run_scenarios(
        HOST_COPY_ENTRY_POINTS, {**cached_env, "STRATEGY": strategy, "HOST_COPY": "1"}
    )
