"""`ed.Stacked` blocks that return `(x, aux)`: the stack returns the aux stacked
over the layers (`(rows, L, ...)` under `jax.vmap`, `(L, ...)` per call), with
a scan, unrolled, under FSDP's gathers and under every pipeline schedule in
both views; a loss using the aux trains as on one device, against a reference
written in plain JAX and Optax with a Python loop over the layers (float32,
1e-5), and the per-layer aux values (read through per-row weighted metrics,
which also fix the rows' order) equal the reference's."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import max_diff

import eqxdist as ed

WIDTH, LAYERS = 8, 8
SGD = optax.sgd(0.1)


class AuxBlock(eqx.Module):
    """A residual block on one row `(d,)` or a batch `(rows, d)` that returns
    `(x, aux)`: a load-balancing-like scalar per row and a vector per row."""

    weight: jax.Array
    bias: jax.Array

    def __init__(self, key: jax.Array) -> None:
        self.weight = jax.random.normal(key, (WIDTH, WIDTH)) / WIDTH**0.5
        self.bias = jnp.full(WIDTH, 0.1)

    def __call__(self, x: jax.Array) -> tuple:
        y = jnp.tanh(x @ self.weight + self.bias)
        return x + y, {"lb": jnp.mean(y**2, axis=-1), "gate": y[..., :2]}


class Net(eqx.Module):
    embed: jax.Array
    blocks: ed.Stacked
    head: jax.Array

    def __init__(self, unroll: bool = False) -> None:
        k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
        self.embed = jax.random.normal(k1, (4, WIDTH)) / 2
        blocks = [AuxBlock(k) for k in jax.random.split(k2, LAYERS)]
        self.blocks = ed.Stacked(blocks, unroll=unroll)
        self.head = jax.random.normal(k3, (WIDTH, 3)) / WIDTH**0.5

    def __call__(self, x: jax.Array) -> tuple:
        """One row or a batch; the aux as the stack returns it."""
        h, aux = self.blocks(jnp.tanh(x @ self.embed))
        return h @ self.head, aux


def _objective(logits: Any, lb: Any, gate: Any, batch: dict) -> tuple:
    """The loss of `(rows, L)` aux values, and per-layer metrics weighted per
    row (`w`), which depend on the rows' order."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    loss = losses.mean() + 0.1 * lb.mean(0).sum() + 0.05 * gate.mean(0).sum()
    metrics = {
        f"lb{i}": ed.metrics.Mean().update(lb[:, i] * batch["w"]) for i in range(LAYERS)
    }
    metrics["gate"] = ed.metrics.Mean().update(gate[:, -1, 1] * batch["w"])
    return loss, metrics


def row_loss(model: Net, batch: dict, key: Any) -> tuple:
    """The stack on one row under `jax.vmap`: aux `(rows, L, ...)`."""
    logits, aux = jax.vmap(model)(batch["x"])
    assert aux["lb"].shape == (len(batch["y"]), LAYERS)
    return _objective(logits, aux["lb"], aux["gate"], batch)


def batch_loss(model: Net, batch: dict, key: Any) -> tuple:
    """The stack on a batch, no `vmap`: aux `(L, rows, ...)`."""
    logits, aux = model(batch["x"])
    assert aux["lb"].shape == (LAYERS, len(batch["y"]))
    return _objective(logits, aux["lb"].T, jnp.swapaxes(aux["gate"], 0, 1), batch)


def reference_loss(model: Net, batch: dict) -> tuple:
    """`row_loss` in plain JAX: a Python loop over the layers' slices."""
    h = jnp.tanh(batch["x"] @ model.embed)
    lbs, gates = [], []
    for i in range(LAYERS):
        weight, bias = model.blocks.layers.weight[i], model.blocks.layers.bias[i]
        y = jnp.tanh(h @ weight + bias)
        lbs.append(jnp.mean(y**2, axis=-1))
        gates.append(y[:, :2])
        h = h + y
    return _objective(h @ model.head, jnp.stack(lbs, 1), jnp.stack(gates, 1), batch)


def _data(steps: int = 2, rows: int = 32) -> list:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(rows, 4)).astype(np.float32),
            "y": rng.integers(0, 3, rows).astype(np.int32),
            "w": rng.random(rows).astype(np.float32),
        }
        for _ in range(steps)
    ]


def _one_device(data: list) -> tuple:
    """The reference trained on the global batches: the model, and each step's
    metrics (before its update)."""
    model = Net()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = SGD.init(params)

    @jax.jit
    def step(params: Any, opt_state: Any, batch: dict) -> tuple:
        def scalar(p: Any) -> tuple:
            return reference_loss(eqx.combine(p, static), batch)

        (_, metrics), grads = jax.value_and_grad(scalar, has_aux=True)(params)
        updates, opt_state = SGD.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    history = []
    for batch in data:
        params, opt_state, metrics = step(params, opt_state, batch)
        history.append(metrics)
    return eqx.combine(params, static), history


def _check(state: Any, metrics: list, want: tuple) -> None:
    model, history = want
    assert max_diff(state.model, model) < 1e-5
    # Every layer's parameters moved through the aux too (a nonzero update).
    assert bool(jnp.all(jnp.any(state.model.blocks.layers.bias != 0.1, axis=1)))
    for got, expected in zip(metrics, history, strict=True):
        for name, metric in expected.items():
            np.testing.assert_allclose(
                float(got[name].compute()), float(metric.compute()), rtol=1e-5
            )


def _train(step: Any, data: list, unroll: bool = False) -> tuple:
    state = ed.TrainState.create(Net(unroll), SGD, jax.random.key(1))
    metrics = []
    for batch in data:
        state, m = step(state, batch)
        metrics.append(m)
    return state, metrics


def test_stacked_returns_the_layers_aux_and_its_gradient():
    """Outside a step: `(L, ...)` per call, `(rows, L, ...)` under vmap, equal
    to the Python loop, scanned and unrolled, with a gradient on every layer."""
    data = _data(1)[0]
    want_loss, want_metrics = reference_loss(Net(), data)
    for unroll in (False, True):
        model = Net(unroll)
        h = jnp.tanh(data["x"][0] @ model.embed)
        _, aux = model.blocks(h)
        assert aux["lb"].shape == (LAYERS,) and aux["gate"].shape == (LAYERS, 2)
        loss, metrics = row_loss(model, data, None)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        grads = jax.grad(lambda m: row_loss(m, data, None)[0])(model)
        want = jax.grad(lambda m: reference_loss(m, data)[0])(model)
        assert max_diff(grads, want) < 1e-6
        for name, metric in want_metrics.items():
            np.testing.assert_allclose(
                metrics[name].compute(), metric.compute(), rtol=1e-6
            )


@pytest.mark.parametrize(
    ("unroll", "options"),
    [
        (False, {"strategy": "fsdp", "min_weight_size": 16}),
        (False, {"strategy": "fsdp", "min_weight_size": 16, "remat": "full"}),
        (True, {}),
    ],
)
def test_no_pipeline_trains_as_on_one_device(unroll, options):
    """Data parallel (unrolled) and FSDP (a scan gathering one layer ahead;
    with remat, each layer recomputed from re-gathered shards)."""
    data = _data()
    mesh = ed.create_device_mesh({"data": 8})
    step = ed.make_train_step(row_loss, SGD, mesh, **options)
    _check(*_train(step, data, unroll), _one_device(data))


@pytest.mark.parametrize(
    ("schedule", "view", "loss"),
    [
        ("gpipe", "device", row_loss),
        ("gpipe", "global", batch_loss),
        ("circular", "global", row_loss),
        ("circular", "device", batch_loss),
        ("1f1b", "device", row_loss),
        ("1f1b", "global", row_loss),
        ("1f1b", "device", batch_loss),
        ("interleaved", "device", batch_loss),
        ("zb-h1", "global", row_loss),
    ],
)
def test_every_schedule_trains_as_on_one_device(schedule, view, loss):
    data = _data()
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    repeats = 2 if schedule in ("circular", "interleaved") else 1
    pipeline = ed.Pipeline("stage", 2, schedule=schedule, repeats=repeats)
    step = ed.make_train_step(loss, SGD, mesh, pipeline=pipeline, view=view)
    _check(*_train(step, data), _one_device(data))


class ScalarAux(AuxBlock):
    def __call__(self, x: jax.Array) -> tuple:
        y, aux = super().__call__(x)
        return y, {"lb": aux["lb"].mean()}


def test_a_batch_aux_without_rows_under_a_pipeline_is_a_clear_error():
    model = Net()
    blocks = [ScalarAux(k) for k in jax.random.split(jax.random.key(2), LAYERS)]
    model = eqx.tree_at(lambda m: m.blocks, model, ed.Stacked(blocks))
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    step = ed.make_train_step(
        lambda m, b, k: m(b["x"])[0].sum(), SGD, mesh, pipeline=ed.Pipeline("stage", 2)
    )
    state = ed.TrainState.create(model, SGD, jax.random.key(1))
    with pytest.raises(ValueError, match=r"aux leaf \"\['lb'\]\".*rows as their"):
        step(state, _data(1)[0])


def test_a_block_returning_another_structure_is_a_clear_error():
    class Bad(AuxBlock):
        def __call__(self, x: jax.Array) -> Any:
            return [x, x, x]

    stack = ed.Stacked([Bad(k) for k in jax.random.split(jax.random.key(0), 2)])
    with pytest.raises(ValueError, match=r"Stacked: a block returned PyTreeDef\(\["):
        stack(jnp.ones(WIDTH))
