"""make_eval_step: any number of rows, padded and masked inside, equal to the
unpadded single-device metrics; dp and fsdp; a TrainState with model state."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import BNNet, batch as _batch, bn_loss

import eqxdist as ed
from eqxdist._step.eval_step import padded_rows


def eval_fn(model, batch, mask):
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return {
        "accuracy": ed.metrics.Accuracy().update(logits, batch["y"], mask),
        "loss": ed.metrics.Mean().update(losses, mask),
        "count": (mask.sum(), None)[0],
    }


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_any_row_count_equals_single_device(axis_types, rng, strategy):
    mesh = ed.create_data_parallel_mesh(axis_types=axis_types)
    model = eqx.nn.MLP(8, 4, 64, 1, key=jax.random.key(0))
    step = ed.make_eval_step(eval_fn, mesh, strategy=strategy, min_weight_size=16)
    for n in [1, 7, 13, 100, 129]:
        batch = _batch(rng, n)
        got = step(model, batch)
        # One device, no padding, no eqxdist step.
        logits = jax.vmap(model)(batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        accuracy = np.mean(np.argmax(np.asarray(logits), -1) == batch["y"])
        assert float(got["accuracy"].compute()) == pytest.approx(accuracy, abs=1e-7)
        assert float(got["loss"].compute()) == pytest.approx(
            float(losses.mean()), rel=1e-6
        )
        assert int(got["count"]) == n


def test_compiles_once_per_padded_size(mesh8, rng):
    traced = []

    def counting(model, batch, mask):
        traced.append(batch["x"].shape)
        return eval_fn(model, batch, mask)

    model = eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0))
    step = ed.make_eval_step(counting, mesh8)
    for n in range(100, 121):
        step(model, _batch(rng, n))
    assert len(traced) == len({padded_rows(n, 8) for n in range(100, 121)}) <= 3
    assert padded_rows(100, 8) >= 100 and padded_rows(100, 8) % 8 == 0
    assert padded_rows(100, 8) <= 100 * 1.125 + 8


def test_train_state_with_model_state(mesh8, rng):
    model, model_state = eqx.nn.make_with_state(BNNet)(
        jax.random.key(0), ("batch", "data")
    )
    opt = optax.adam(1e-2)
    state = ed.TrainState.create(model, opt, jax.random.key(0), model_state=model_state)
    train = ed.make_train_step(bn_loss, opt, mesh8, strategy="fsdp", min_weight_size=16)
    state, _ = train(state, _batch(rng, 64))

    def bn_eval(model, model_state, batch, mask):
        inference = eqx.nn.inference_mode(model)
        logits, _ = jax.vmap(inference, in_axes=(0, None), out_axes=(0, None))(
            batch["x"], model_state
        )
        return {"accuracy": ed.metrics.Accuracy().update(logits, batch["y"], mask)}

    evaluate = ed.make_eval_step(bn_eval, mesh8, strategy="fsdp", min_weight_size=16)
    batch = _batch(rng, 13)
    got = float(evaluate(state, batch)["accuracy"].compute())
    host_model = jax.device_get(state.model)
    host_state = jax.device_get(state.model_state)
    # In inference mode BatchNorm uses its running statistics, no collective.
    logits, _ = jax.vmap(
        eqx.nn.inference_mode(host_model), in_axes=(0, None), out_axes=(0, None)
    )(batch["x"], host_state)
    assert got == pytest.approx(np.mean(np.argmax(logits, -1) == batch["y"]))
    # The state is still usable for training: evaluation consumed nothing.
    train(state, _batch(rng, 64))


def test_eval_mistakes(mesh8, rng):
    model = eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0))
    step = ed.make_eval_step(eval_fn, mesh8)
    with pytest.raises(
        ValueError, match=r"same number of rows.*\['x'\]: 5.*\['y'\]: 6"
    ):
        step(model, {"x": np.zeros((5, 8), np.float32), "y": np.zeros(6, np.int32)})
    with pytest.raises(ValueError, match=r"no array with rows"):
        step(model, {"x": np.float32(1.0)})
    with pytest.raises(ValueError, match=r"unknown strategy"):
        ed.make_eval_step(eval_fn, mesh8, strategy="tp")


def test_eval_function_of_the_wrong_arity(mesh8, rng):
    def eval_fn(model, x, y, mask):
        return {}

    with pytest.raises(TypeError, match=r"eval_fn is called as `eval_fn\(model, b"):
        ed.make_eval_step(eval_fn, mesh8)(
            eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0)), _batch(rng, 16)
        )


def rows_eval_fn(model, batch, mask):
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    metrics = {"loss": ed.metrics.Mean().update(losses, mask)}
    return metrics, {"prediction": jnp.argmax(logits, -1), "loss": losses}


@pytest.mark.parametrize("view", ["device", "global"])
@pytest.mark.parametrize(
    ("strategy", "axis_types"), [("dp", "auto"), ("fsdp", "explicit")]
)
def test_per_row_outputs_in_the_batch_order(rng, view, strategy, axis_types):
    mesh = ed.create_data_parallel_mesh(axis_types=axis_types)
    model = eqx.nn.MLP(8, 4, 64, 1, key=jax.random.key(0))
    step = ed.make_eval_step(
        rows_eval_fn, mesh, strategy=strategy, min_weight_size=16, view=view,
        per_row=True,
    )  # fmt: skip
    for n in (45, 8, 1):
        batch = _batch(rng, n)
        metrics, rows = step(model, batch)
        # One device, no padding, no eqxdist step.
        logits = jax.vmap(model)(batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        assert isinstance(rows["prediction"], np.ndarray)
        assert rows["prediction"].shape == (n,) and rows["loss"].shape == (n,)
        np.testing.assert_array_equal(rows["prediction"], np.argmax(logits, -1))
        np.testing.assert_allclose(rows["loss"], losses, rtol=1e-6, atol=1e-7)
        assert float(metrics["loss"].compute()) == pytest.approx(
            float(losses.mean()), rel=1e-6
        )


def test_a_whole_batch_metric_in_the_global_view(mesh8, rng):
    """The global view sees every real row at once: a rank metric over the whole
    batch (the rank of each row's loss among all rows), as on one device."""

    def rank_fn(model, batch, mask):
        losses = optax.softmax_cross_entropy_with_integer_labels(
            jax.vmap(model)(batch["x"]), batch["y"]
        )
        masked = jnp.where(mask, losses, jnp.inf)
        return {"median_rank": jnp.sum(mask) // 2}, {
            "rank": jnp.argsort(jnp.argsort(masked))
        }

    model = eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0))
    batch = _batch(rng, 21)
    _, rows = ed.make_eval_step(rank_fn, mesh8, view="global", per_row=True)(
        model, batch
    )
    losses = optax.softmax_cross_entropy_with_integer_labels(
        jax.vmap(model)(batch["x"]), batch["y"]
    )
    np.testing.assert_array_equal(rows["rank"], np.argsort(np.argsort(losses)))


def test_row_outputs_without_per_row_are_errors(mesh8, rng):
    model = eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0))

    def predictions(model, batch, mask):
        return {"prediction": jnp.argmax(jax.vmap(model)(batch["x"]), -1)}

    for view in ("device", "global"):
        step = ed.make_eval_step(predictions, mesh8, view=view)
        with pytest.raises(ValueError, match=r"metrics leaf \['prediction'\] has shape"
                           r" \(\d+,\), one entry per row.*per_row=True"):  # fmt: skip
            step(model, _batch(rng, 13))
    step = ed.make_eval_step(predictions, mesh8, per_row=True)
    with pytest.raises(TypeError, match=r"must return `\(metrics, rows\)`"):
        step(model, _batch(rng, 13))

    def scalar_rows(model, batch, mask):
        return {}, {"total": jnp.sum(batch["x"])}

    step = ed.make_eval_step(scalar_rows, mesh8, per_row=True)
    with pytest.raises(ValueError, match=r"per-row output \['total'\] is \(\)"):
        step(model, _batch(rng, 13))
