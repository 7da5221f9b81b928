"""A loss (or an evaluation) that reads the pipelined `Stacked`'s weights itself,
outside the stack (a penalty over them): in the device view a stage holds only
its own layers, so under GPipe and the circular schedule the loss gets every
stage's (`_layout.all_layers`). Its reported value and the parameters equal one
device's in plain Equinox and Optax (float32, 1e-5), and a loss that reads no
layer compiles without the gather."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import PipeNet, pipe_batches, pipe_loss
from reference import max_diff, train_one_device

import eqxdist as ed

ADAM = optax.adam(1e-2)
ROWS, DEVICES = 32, 4


def _penalty(model) -> jax.Array:
    """Each layer's squared weights scaled by its index: a layer placed at
    another index (the circular schedule's chunk order) changes the value."""
    total = jnp.zeros(())
    for w in jax.tree.leaves(model.blocks):
        index = jnp.arange(1, w.shape[0] + 1).reshape(-1, *[1] * (w.ndim - 1))
        total = total + jnp.sum(index * w**2)
    return total


def _loss(model, batch, key):
    value = pipe_loss(model, batch, key)[0] + 1e-2 * _penalty(model)
    return value, {"loss": ed.metrics.Mean().update(value)}


def _per_device(model, batch, key):
    """The device view's reference: each data device's loss on its rows,
    averaged."""
    per = ROWS // DEVICES
    parts = [
        _loss(model, {k: v[d * per : (d + 1) * per] for k, v in batch.items()}, key)
        for d in range(DEVICES)
    ]
    return sum(p[0] for p in parts) / DEVICES, {}


@pytest.mark.parametrize(
    ("schedule", "strategy"), [("gpipe", "dp"), ("circular", "fsdp")]
)
def test_a_penalty_over_the_layers_equals_one_device(schedule, strategy):
    data = pipe_batches(steps=2)
    want = train_one_device(PipeNet(layers=4), data, ADAM, _per_device)
    repeats = 2 if schedule == "circular" else 1
    pipeline = ed.Pipeline("stage", 2, schedule=schedule, repeats=repeats)
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    step = ed.make_train_step(
        _loss, ADAM, mesh, pipeline=pipeline, strategy=strategy, min_weight_size=16
    )
    state = ed.TrainState.create(PipeNet(layers=4), ADAM, jax.random.key(1))
    for batch, wanted in zip(data, want.losses, strict=True):
        state, metrics = step(state, batch)
        assert abs(float(metrics["loss"].compute()) - wanted) < 1e-5
    assert max_diff(state.model, want.model) < 1e-5


def test_only_a_loss_that_reads_the_layers_gathers_them():
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    state = ed.TrainState.create(PipeNet(layers=4), ADAM, jax.random.key(1))
    batch = pipe_batches(steps=1)[0]
    gathers = {}
    for name, loss in (("plain", pipe_loss), ("penalty", _loss)):
        step = ed.make_train_step(loss, ADAM, mesh, pipeline=ed.Pipeline("stage", 2))
        compiled = step.lower(state, batch).compile()
        gathers[name] = ed.count_collectives(compiled)["all-gather"]
    # Each of the Stacked's array leaves once, none in the backward pass.
    leaves = len(jax.tree.leaves(eqx.filter(state.model.blocks, eqx.is_array)))
    assert gathers == {"plain": 0, "penalty": leaves}


def test_an_evaluation_reads_every_stages_layers():
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    model = PipeNet(layers=4)

    def evaluate(model, batch, mask):
        penalty = _penalty(model) + 0 * mask.sum()
        return {"penalty": ed.metrics.Mean().update(penalty)}

    step = ed.make_eval_step(evaluate, mesh, pipeline=ed.Pipeline("stage", 2))
    got = float(step(model, pipe_batches(steps=1)[0])["penalty"].compute())
    np.testing.assert_allclose(got, float(_penalty(model)), rtol=1e-6)
