"""What the entries of a written-out pipeline schedule compute and keep
(API.md, "Pipelines that do only the work they need"): each pass's FLOPs from
its compiled program (F one forward; B the input's cotangent, no recompute;
W the weights' gradients only, no forward and no input-gradient chain), on a
block of plain `x @ W` that takes a batch and on an Equinox block called per
row; the compiled temporaries of 1F1B and ZB-H1 against GPipe's; and every
written-out schedule equal to one device under each remat policy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from harness import PipeNet, pipe_batches, pipe_loss
from reference import max_diff, train_one_device

import eqxdist as ed
from eqxdist._layout.stage_passes import pass_flops

SGD = optax.sgd(0.1)


class _XwBlock(eqx.Module):
    """A residual MLP of plain arrays on a batch of rows."""

    w1: jax.Array
    w2: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (32, 64)) / 6
        self.w2 = jax.random.normal(k2, (64, 32)) / 8

    def __call__(self, x):
        return x + jax.nn.gelu(x @ self.w1) @ self.w2


class _ModuleBlock(eqx.Module):
    """Equinox layers on one row (called per row)."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(32, 64, key=k1)
        self.down = eqx.nn.Linear(64, 32, key=k2)
        self.norm = eqx.nn.LayerNorm(32)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(self.norm(x))))


@pytest.mark.parametrize(
    ("block", "per_row"), [(_XwBlock, False), (_ModuleBlock, True)]
)
def test_each_entry_does_only_its_work(block, per_row):
    stacked = ed.Stacked([block(k) for k in jax.random.split(jax.random.key(0), 2)])
    x = jnp.ones((16, 32))
    cost = pass_flops(stacked, x, remat=None, per_row=per_row)
    # The paper's costs, F = B = W = 1, BW = 2: no recompute in B, no forward
    # and no input-gradient chain in W (either would add a whole F or B).
    assert cost["B"] <= 1.1 * cost["F"], cost
    assert cost["W"] <= 1.1 * cost["F"], cost
    assert cost["BW"] <= 2.1 * cost["F"], cost
    assert cost["B"] + cost["W"] <= cost["BW"] * 1.02, cost
    if not per_row:
        # "full" keeps each block's input: the backward passes recompute.
        full = pass_flops(stacked, x, remat="full", per_row=per_row)
        assert full["B"] > 1.3 * full["F"], full


def _temps(schedule, micro):
    mesh = ed.create_device_mesh({"stage": 4, "data": 2})
    pipeline = ed.Pipeline("stage", micro, schedule=schedule)
    step = ed.make_train_step(pipe_loss, SGD, mesh, pipeline=pipeline)
    state = ed.TrainState.create(PipeNet(), SGD, jax.random.key(1))
    batch = pipe_batches(1, rows=1024)[0]
    compiled = step.lower(step.place_state(state), batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_and_zb_h1_keep_what_their_tables_keep():
    """Remat `None`, M = 4P: 1F1B's compiled temporaries below GPipe's (P
    microbatches' residuals on a stage, not M), ZB-H1's near 1F1B's. Measured
    0.64x and 1.20x; the contract's 0.6x and 1.1x are not reached yet (issue
    45), so these bounds guard what is reached."""
    temps = {s: _temps(s, 16) for s in ("gpipe", "1f1b", "zb-h1")}
    assert temps["1f1b"] <= 0.7 * temps["gpipe"], temps
    assert temps["zb-h1"] <= 1.25 * temps["1f1b"], temps


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_written_out_schedules_under_each_remat(schedule):
    data = pipe_batches(steps=2)
    want = train_one_device(PipeNet(), data, SGD, pipe_loss)
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    repeats = 2 if schedule == "interleaved" else 1
    pipeline = ed.Pipeline("stage", 2, schedule=schedule, repeats=repeats)
    for remat in ("none", "full", "dots"):
        step = ed.make_train_step(pipe_loss, SGD, mesh, pipeline=pipeline, remat=remat)
        state = ed.TrainState.create(PipeNet(), SGD, jax.random.key(1))
        for batch in data:
            state, _ = step(state, batch)
        assert max_diff(state.model, want.model) < 1e-5, remat
