"""Pipelines on models shaped unlike the guide's: a pipelined `ed.Stacked` whose
blocks take a batch (`(rows, d)`, called outside `jax.vmap`) and whose blocks
carry an integer leaf beside the activations (positions, as Llama ports pass
them); metrics with a Python count (`(sum, int)` pairs); every schedule in both
views, against single-device training of the same model in plain Equinox and
Optax (float32, 1e-5). And the message `ed.Stacked` gives for blocks whose
static fields differ."""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import max_diff, train_one_device

import eqxdist as ed

WIDTH = 8
SGD = optax.sgd(0.1)


class Block(eqx.Module):
    """A residual block on plain arrays, on one row `(d,)` or on a batch
    `(rows, d)`, carrying the int32 positions (`()` or `(rows,)`) through."""

    weight: jax.Array
    bias: jax.Array

    def __init__(self, key: jax.Array) -> None:
        self.weight = jax.random.normal(key, (WIDTH, WIDTH)) / WIDTH**0.5
        self.bias = jnp.zeros(WIDTH)

    def __call__(self, carried: tuple) -> tuple:
        x, positions = carried
        scale = 1.0 + (positions % 3).astype(x.dtype)[..., None]
        return x + jnp.tanh(x @ self.weight + self.bias) * scale / 3, positions


class Net(eqx.Module):
    embed: eqx.nn.Linear
    blocks: ed.Stacked
    head: eqx.nn.Linear

    def __init__(self, layers: int = 8) -> None:
        k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
        self.embed = eqx.nn.Linear(4, WIDTH, key=k1)
        self.blocks = ed.Stacked([Block(k) for k in jax.random.split(k2, layers)])
        self.head = eqx.nn.Linear(WIDTH, 3, key=k3)

    def rows(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """A batch at once: the Stacked called on `(rows, d)`, no `vmap`."""
        h, _ = self.blocks((jax.vmap(self.embed)(x), positions))
        return jax.vmap(self.head)(h)

    def row(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """One row: the Stacked called on `(d,)`, under the loss's `vmap`."""
        h, _ = self.blocks((self.embed(x), positions))
        return self.head(h)


def _losses(model: Net, batch: dict, batched: bool) -> jax.Array:
    if batched:
        logits = model.rows(batch["x"], batch["positions"])
    else:
        logits = jax.vmap(model.row)(batch["x"], batch["positions"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def batch_loss(model: Net, batch: dict, key: jax.Array) -> tuple:
    losses = _losses(model, batch, batched=True)
    # A `(sum, count)` pair whose count is a Python int, beside a Metric.
    metrics = {
        "pair": (losses.sum(), losses.shape[0]),
        "mean": ed.metrics.Mean().update(losses),
    }
    return losses.mean(), metrics


def row_weighted_loss(model: Net, batch: dict, key: jax.Array) -> tuple:
    losses = _losses(model, batch, batched=False)
    mask = batch["mask"]
    return (jnp.sum(losses * mask), mask.sum()), {"pair": (losses.sum(), len(losses))}


def row_weighted_mean(model: Net, batch: dict, key: jax.Array) -> jax.Array:
    """`row_weighted_loss` on one device: the mean over the real rows."""
    (total, weight), _ = row_weighted_loss(model, batch, key)
    return total / weight


def _data(steps: int = 2, rows: int = 32) -> list:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(rows, 4)).astype(np.float32),
            "positions": rng.integers(0, 64, rows).astype(np.int32),
            "y": rng.integers(0, 3, rows).astype(np.int32),
            "mask": (rng.random(rows) < 0.7).astype(np.float32),
        }
        for _ in range(steps)
    ]


def _train(loss, shape, schedule, view, data):
    mesh = ed.create_device_mesh(shape)
    repeats = 2 if schedule in ("circular", "interleaved") else 1
    pipeline = ed.Pipeline("stage", 2, schedule=schedule, repeats=repeats)
    step = ed.make_train_step(loss, SGD, mesh, pipeline=pipeline, view=view)
    state = ed.TrainState.create(Net(), SGD, jax.random.key(1))
    metrics = []
    for batch in data:
        state, m = step(state, batch)
        metrics.append(m)
    return state, metrics


@functools.cache
def _one_device() -> Any:
    return train_one_device(Net(), _data(), SGD, batch_loss)


@pytest.mark.parametrize(
    ("schedule", "view", "shape"),
    [
        ("gpipe", "device", {"stage": 2, "data": 4}),
        ("gpipe", "global", {"stage": 4, "data": 2}),
        ("circular", "device", {"stage": 2, "data": 4}),
        ("circular", "global", {"stage": 2, "data": 4}),
        ("1f1b", "device", {"stage": 4, "data": 2}),
        ("1f1b", "global", {"stage": 2, "data": 4}),
        ("interleaved", "global", {"stage": 2, "data": 4}),
        ("zb-h1", "device", {"stage": 4, "data": 2}),
    ],
)
def test_blocks_that_take_a_batch_train_as_on_one_device(schedule, view, shape):
    """The Stacked called on `(rows, d)` with int32 positions beside the
    activations, and a `(sum, int)` metric: every schedule, both views."""
    data = _data()
    want = _one_device()
    state, metrics = _train(batch_loss, shape, schedule, view, data)
    assert max_diff(state.model, want.model) < 1e-5
    for m, loss, batch in zip(metrics, want.losses, data, strict=True):
        total, count = m["pair"]
        assert int(count) == len(batch["y"])
        np.testing.assert_allclose(float(total) / int(count), loss, rtol=1e-5)
        np.testing.assert_allclose(float(m["mean"].compute()), loss, rtol=1e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_one_f_one_b_global_view_rows_under_vmap_with_a_weighted_loss(schedule):
    """Blocks on one row under the loss's `vmap`, int32 positions carried, a
    weighted loss and a `(sum, int)` metric, under 1F1B (and ZB-H1) in the
    global view."""
    data = _data()
    want = train_one_device(Net(), data, SGD, row_weighted_mean)
    state, metrics = _train(
        row_weighted_loss, {"stage": 2, "data": 4}, schedule, "global", data
    )
    assert max_diff(state.model, want.model) < 1e-5
    np.testing.assert_allclose(
        [float(m["pair"][0] / m["pair"][1]) for m in metrics],
        [float(_losses(model, b, False).mean()) for model, b in _models(data)],
        rtol=1e-5,
    )


def _models(data: list) -> list:
    """Each step's model before its update, on one device, with its batch."""
    models = [Net()]
    for n in range(1, len(data)):
        models.append(train_one_device(Net(), data[:n], SGD, row_weighted_mean).model)
    return list(zip(models, data, strict=True))


def test_blocks_with_different_static_fields_name_the_field_and_values():
    class Cached(eqx.Module):
        linear: eqx.nn.Linear
        cache_key: str = eqx.field(static=True)

        def __call__(self, x):
            return self.linear(x)

    keys = jax.random.split(jax.random.key(0), 2)
    blocks = [
        Cached(eqx.nn.Linear(4, 4, key=k), f"layer_{i}") for i, k in enumerate(keys)
    ]
    with pytest.raises(ValueError) as error:
        ed.Stacked(blocks)
    message = str(error.value)
    assert "cache_key" in message
    assert "'layer_0'" in message and "'layer_1'" in message
    assert "blocks[1]" in message
    assert "PyTreeDef" not in message


# -- 1F1B in the global view: the whole batch's loss, cut into shares ---------


def masked_loss(model: Net, batch: dict, key: jax.Array) -> tuple:
    """The eqx-llama notebook's loss: the mean over the real tokens of the
    whole batch, with a `(sum, count)` metric of the microbatch's own rows."""
    ce = _losses(model, batch, batched=False)
    mask = batch["mask"]
    loss = jnp.sum(ce * mask) / jnp.sum(mask)
    return loss, {"pair": (jnp.sum(ce * mask), jnp.sum(mask))}


def mixed_loss(model: Net, batch: dict, key: jax.Array) -> tuple:
    """A masked mean plus a mean over every row and a term of the parameters
    alone (a regulariser), on a batch at once (no `vmap`)."""
    ce = _losses(model, batch, batched=True)
    mask = batch["mask"]
    aux = jnp.sum(ce * mask) / jnp.sum(mask) + 0.01 * ce.mean()
    return aux + 1e-3 * jnp.sum(model.head.weight**2), {}


def _uneven(steps: int = 2, rows: int = 32) -> list:
    """Masks that differ in count between devices and microbatches: a
    different share of real rows in each block of 4."""
    data = _data(steps, rows)
    for n, batch in enumerate(data):
        keep = np.arange(rows) % 4 < (np.arange(rows) // 4 + n) % 4 + 1
        batch["mask"] = (keep & (batch["mask"] > 0)).astype(np.float32)
        batch["mask"][0] = 1.0
    return data


@pytest.mark.parametrize("loss", [masked_loss, mixed_loss])
def test_one_f_one_b_global_view_takes_the_whole_batch_loss(loss):
    """1F1B in the global view on the loss of the whole batch (divided by its
    real tokens, plus means and a parameter term): equal to one device, and the
    metrics summed over the microbatches."""
    data = _uneven()
    want = train_one_device(Net(), data, SGD, loss)
    state, metrics = _train(loss, {"stage": 2, "data": 4}, "1f1b", "global", data)
    assert max_diff(state.model, want.model) < 1e-5
    if loss is masked_loss:
        for m, batch in zip(metrics, data, strict=True):
            assert float(m["pair"][1]) == batch["mask"].sum()


def test_one_f_one_b_global_view_refuses_a_loss_that_couples_microbatches():
    def log_of_mean(model: Net, batch: dict, key: jax.Array) -> tuple:
        return jnp.log(_losses(model, batch, batched=False).mean()), {}

    with pytest.raises(ValueError) as error:
        _train(log_of_mean, {"stage": 2, "data": 4}, "1f1b", "global", _data(1))
    message = str(error.value)
    for part in ("schedule='1f1b'", "view='global'", "`log`", "gpipe", "(loss_sum"):
        assert part in message, message
