"""Gradient accumulation (`accumulate_gradients`) and the losses it takes:
minibatches summing metrics and averaging gradients, inside `shard_map` too, and
token-weighted losses `(loss_sum, weight)`, each against plain single-device
JAX/Optax (`reference.py`) on the same global data, on 8 simulated devices."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
    batch as _batch,
    counted_loss as loss_fn,
    make_layout_step,
    token_batch,
    token_losses,
    token_mlp,
    token_weighted_loss,
)
from jax.sharding import PartitionSpec as P
from reference import max_diff, train_one_device

import eqxdist as ed


def _model(key=0):
    return eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(key))


# -- accumulate_gradients -------------------------------------------------------


def test_accumulate_gradients_sums_metrics_and_averages_grads(rng):
    model = _model()
    batch = _batch(rng, rows=12)
    (_, _), full_grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
        model, batch, None
    )
    accumulate = eqx.filter_jit(ed.accumulate_gradients)
    results = [
        accumulate(loss_fn, model, batch, None, 3, use_scan=use_scan)
        for use_scan in (True, False)
    ]
    for grads, metrics in results:
        assert max_diff(grads, full_grads) < 1e-6
        total, count = metrics["loss"]
        assert int(count) == 12
        expected = float(loss_fn(model, batch, None)[0]) * 12
        np.testing.assert_allclose(total, expected, rtol=1e-5)
        assert int(metrics["accuracy"].total.value) == 12
    assert max_diff(results[0][0], results[1][0]) < 1e-7  # scan and loop


@pytest.mark.parametrize("use_scan", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
def test_accumulate_gradients_inside_shard_map_with_check_vma(
    mesh8, rng, use_scan, weighted
):
    # Under JAX's default `check_vma=True` a loop carry must keep its type: the
    # losses depend on each device's rows, and so does the model state here.
    model, batch = _model(), _batch(rng)

    def stateful(model, state, batch, key):
        loss, metrics = loss_fn(model, batch, key)
        if weighted:  # (sum, weight): weight 1 per row, the same mean
            loss = (loss * batch["x"].shape[0], batch["x"].shape[0])
        return loss, metrics, state + jnp.sum(batch["x"])

    params, static = eqx.partition(model, eqx.is_array)

    def local(params, batch):
        grads, metrics, state = ed.accumulate_gradients(
            stateful,
            eqx.combine(params, static),
            batch,
            None,
            2,
            use_scan=use_scan,
            model_state=jnp.zeros(()),
        )
        return eqx.filter(grads, eqx.is_array), metrics["loss"][0][None], state[None]

    grads, loss_sums, states = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh8,
            in_specs=(P(), P("data")),
            out_specs=(P(), P("data"), P("data")),
        )
    )(params, batch)
    # JAX sums the replicated parameters' gradients over the 8 devices: 8 times the
    # gradient of the global mean.
    (_, _), full = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, batch, None)
    assert max_diff(grads, jax.tree.map(lambda g: 8 * g, full)) < 1e-5
    rows = batch["x"].reshape(8, 4, 8)
    np.testing.assert_allclose(states, rows.sum(axis=(1, 2)), rtol=1e-5)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        jax.vmap(model)(batch["x"]), batch["y"]
    )
    np.testing.assert_allclose(loss_sums, losses.reshape(8, 4).sum(1), rtol=1e-5)


def test_accumulate_gradients_splits_the_key(rng):
    def keyed(model, batch, key):
        return jnp.sum(model) * 0.0, {"u": jax.random.uniform(key)}

    key = jax.random.key(3)
    _, metrics = ed.accumulate_gradients(keyed, jnp.ones(2), jnp.ones((4, 1)), key, 2)
    expected = sum(float(jax.random.uniform(k)) for k in jax.random.split(key, 2))
    np.testing.assert_allclose(metrics["u"], expected, rtol=1e-6)


# -- token-weighted losses -------------------------------------------------------


def token_mean(model, batch, key):
    """The token-weighted mean of the global batch, as one device computes it."""
    del key
    mask = batch["mask"]
    masked = jnp.where(mask, token_losses(model, batch), 0.0)
    return jnp.sum(masked) / jnp.maximum(mask.sum(), 1)


@pytest.mark.parametrize(
    ("setup", "n", "axis_types"),
    [(s, n, "auto") for s in ["dp", "fsdp", "hsdp"] for n in [1, 4]]
    + [("hsdp", 4, "explicit")],
)
def test_token_weighted_loss_matches_single_device(setup, n, axis_types):
    optimizer = optax.sgd(0.5)
    data = [token_batch(0), token_batch(1, empty=(5,), full=(0, 1))]
    want = train_one_device(token_mlp(), data, optimizer, token_mean).model
    step = make_layout_step(
        setup, token_weighted_loss, optimizer, axis_types, num_minibatches=n
    )
    state = ed.TrainState.create(token_mlp(), optimizer, jax.random.key(0))
    for batch in data:
        state, metrics = step(state, batch)
    assert max_diff(state.model, want) < 1e-6
    assert int(metrics["tokens"].compute()) == int(data[-1]["mask"].sum())
    assert max_diff(state.model, token_mlp()) > 1e-3  # it trained


def test_a_batch_without_tokens_gives_a_zero_gradient(mesh8):
    optimizer = optax.sgd(0.5)
    step = ed.make_train_step(token_weighted_loss, optimizer, mesh8, step_info=True)
    state = ed.TrainState.create(token_mlp(), optimizer, jax.random.key(0))
    batch = token_batch(0, empty=range(8), full=())
    out = step(state, batch)
    state, metrics, info = out.state, out.metrics, out.info
    assert float(info["grad_norm"]) == 0.0
    assert max_diff(state.model, token_mlp()) == 0.0
    assert int(metrics["tokens"].compute()) == 0


def test_accumulate_gradients_weighted(rng):
    batch = token_batch(2, empty=(1,))
    model = token_mlp()
    grads, _ = ed.accumulate_gradients(token_weighted_loss, model, batch, None, 4)
    want = eqx.filter_grad(
        lambda m: (
            jnp.sum(jnp.where(batch["mask"], token_losses(m, batch), 0.0))
            / batch["mask"].sum()
        )
    )(model)
    assert max_diff(grads, want) < 1e-6


def test_weighted_loss_mistakes(mesh8):
    state = ed.TrainState.create(token_mlp(), optax.sgd(0.1), jax.random.key(0))
    batch = token_batch(0)

    def three(model, batch, key):
        return (jnp.float32(1), jnp.float32(1), jnp.float32(1)), {}

    def vector_weight(model, batch, key):
        return (jnp.float32(1), batch["mask"].sum(axis=1)), {}

    def bool_weight(model, batch, key):
        return (jnp.sum(token_losses(model, batch)), jnp.bool_(True)), {}

    for fn, kind, pattern in [
        (three, TypeError, "a pair `\\(loss_sum, weight\\)`; got a tuple of length 3"),
        (vector_weight, ValueError, "a scalar `weight`"),
        (bool_weight, TypeError, "floating-point or integer scalar"),
    ]:
        step = ed.make_train_step(fn, optax.sgd(0.1), mesh8)
        with pytest.raises(kind, match=pattern):
            step(state, batch)
