"""Randomness under pipelines (API.md "Randomness under pipelines"): a pipelined
`ed.Stacked` called with a key on a batch gives every microbatch, and in the
global view every data shard, its own noise, whatever the schedule and view; the
noise is the same for 2 and 4 stages, with and without remat (the backward
pass's recomputed forward draws the forward's noise), and in the global view it
is `fold_in(key, g)` for the batch's g-th microbatch, written out here in plain
JAX. Per-row keys under `jax.vmap` give one device's noise.

The probe: each row starts as a row of ones in a parameter, and every block
multiplies its input by noise of the input's shape, so one SGD step (rate 1) of
the mean output moves each row by its noise's product over the layers over the
number of rows: one fingerprint per row."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import train_one_device

import eqxdist as ed

WIDTH, LAYERS, ROWS, MICRO = 4, 8, 16, 4
SGD = optax.sgd(1.0)
SCHEDULES = ["gpipe", "circular", "1f1b", "interleaved", "zb-h1"]


class Noisy(eqx.Module):
    bias: jax.Array

    def __call__(self, x, *, key):
        return x * (1 + 0.5 * jax.random.normal(key, x.shape)) + self.bias


class Probe(eqx.Module):
    rows: jax.Array  # one parameter row per batch row
    blocks: ed.Stacked

    def __init__(self, remat=None):
        self.rows = jnp.ones((ROWS, WIDTH))
        blocks = [Noisy(jnp.full(WIDTH, 0.1 * i)) for i in range(LAYERS)]
        self.blocks = ed.Stacked(blocks, remat=remat)


def batch_loss(model, batch, key):
    """Blocks called on a batch, the stack with the loss's key."""
    y = model.blocks(model.rows[batch["i"]], key=key)
    return y.sum(-1).mean(), {}


def row_loss(model, batch, key):
    """Blocks called per row under `jax.vmap`, each row a key split from the
    loss's."""
    h = model.rows[batch["i"]]
    keys = jax.random.split(key, h.shape[0])
    y = jax.vmap(lambda r, k: model.blocks(r, key=k))(h, keys)
    return y.sum(-1).mean(), {}


def _step(schedule, view, *, stages=2, n=1, loss=batch_loss):
    mesh = ed.create_device_mesh(
        {"stage": stages, "data": 2}, devices=jax.devices()[: 2 * stages]
    )
    repeats = 2 if schedule in ("circular", "interleaved") else 1
    pipeline = ed.Pipeline("stage", MICRO, schedule=schedule, repeats=repeats)
    return ed.make_train_step(
        loss, SGD, mesh, pipeline=pipeline, view=view, num_minibatches=n
    )


def _noise(schedule, view, *, stages=2, n=1, remat=None):
    """Each row's fingerprint after one step: its noise's product over the
    layers (the rows' move times the rows, at rate 1)."""
    state = ed.TrainState.create(Probe(remat), SGD, jax.random.key(1))
    state, _ = _step(schedule, view, stages=stages, n=n)(state, _batch())
    return np.asarray(1.0 - state.model.rows) * ROWS


def _batch():
    return {"i": np.arange(ROWS, dtype=np.int32)}


def _all_rows_differ(noise):
    """No two rows (of one microbatch, of two microbatches or data shards) drew
    the same noise."""
    gaps = np.abs(noise[:, None] - noise[None]).max(-1) + np.eye(len(noise))
    assert gaps.min() > 1e-3, np.argwhere(gaps <= 1e-3)


@pytest.mark.parametrize("view", ["device", "global"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_microbatch_draws_its_own_noise_whatever_the_stages_and_remat(
    schedule, view
):
    noise = _noise(schedule, view)
    _all_rows_differ(noise)
    # Four stages of two layers, the layers recomputed in the backward pass:
    # each layer's key is the global layer's, and the recomputed forward draws
    # the forward's noise (its gradient is the same).
    again = _noise(schedule, view, stages=4, remat="full")
    np.testing.assert_allclose(again, noise, atol=1e-6)


def _layers(model, x, key):
    """The blocks in turn on `x` in plain JAX, layer l with `split(key, L)[l]`
    (a scan: one PRNG computation for XLA to compile, not L)."""

    def layer(x, args):
        bias, k = args
        return x * (1 + 0.5 * jax.random.normal(k, x.shape)) + bias, None

    keys = jax.random.split(key, LAYERS)
    return jax.lax.scan(layer, x, (model.blocks.layers.bias, keys))[0]


def _one_device_loss(model, batch, key):
    """`batch_loss` on one device as a pipeline in the global view runs it:
    the batch's g-th microbatch (of 2 data shards x `MICRO`, in row order)
    with the key `fold_in(key, g)`."""
    h = model.rows[batch["i"]]
    micro = h.reshape(2 * MICRO, -1, WIDTH)
    keys = jax.vmap(lambda g: jax.random.fold_in(key, g))(jnp.arange(2 * MICRO))
    y = jax.vmap(lambda x, k: _layers(model, x, k))(micro, keys)
    return y.sum(-1).mean(), {}


@pytest.mark.parametrize(("schedule", "n"), [("gpipe", 2), ("circular", 1)])
def test_the_global_view_noise_is_the_microbatch_key_of_the_one_device_key(schedule, n):
    key, data = jax.random.key(1), [_batch(), _batch()]
    want = train_one_device(
        Probe(), data, SGD, _one_device_loss, minibatches=n, devices=2, key=key
    )
    step = _step(schedule, "global", n=n)
    state = ed.TrainState.create(Probe(), SGD, key)
    for batch in data:
        state, _ = step(state, batch)
    np.testing.assert_allclose(state.model.rows, want.model.rows, atol=1e-5)
    np.testing.assert_allclose(
        state.model.blocks.layers.bias, want.model.blocks.layers.bias, atol=1e-5
    )
    # Each minibatch's microbatches their own noise too.
    _all_rows_differ(np.asarray(want.grads.rows))


def _one_device_rows(model, batch, key):
    """`row_loss` in plain JAX: row r with the key `split(key, rows)[r]`."""
    h = model.rows[batch["i"]]
    keys = jax.random.split(key, h.shape[0])
    y = jax.vmap(lambda x, k: _layers(model, x, k))(h, keys)
    return y.sum(-1).mean(), {}


def test_per_row_keys_in_the_global_view_equal_one_device():
    key, data = jax.random.key(1), [_batch()]
    want = train_one_device(Probe(), data, SGD, _one_device_rows, key=key)
    step = _step("gpipe", "global", loss=row_loss)
    state = ed.TrainState.create(Probe(), SGD, key)
    state, _ = step(state, data[0])
    np.testing.assert_allclose(state.model.rows, want.model.rows, atol=1e-5)
    _all_rows_differ(np.asarray(want.grads.rows))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-h1"])
def test_per_row_keys_in_the_global_view_are_refused_per_microbatch(schedule):
    """These schedules run the loss per microbatch: a microbatch cannot draw the
    whole batch's `split(key, rows)`, so the step refuses, naming the fix,
    before it consumes the state (never other noise)."""
    step = _step(schedule, "global", loss=row_loss)
    state = ed.TrainState.create(Probe(), SGD, jax.random.key(1))
    with pytest.raises(ValueError, match="schedule='gpipe'") as error:
        step(state, _batch())
    assert f"schedule={schedule!r}" in str(error.value)
    assert "random" in str(error.value)
    assert not state.model.rows.is_deleted()
