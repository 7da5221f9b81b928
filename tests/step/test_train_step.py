"""make_train_step and TrainState (DP and FSDP, minibatches, placement, keys,
caller mistakes), checked against a plain single-device training loop
(`reference.py`)."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import batch as _batch, batches, counted_loss as loss_fn
from jax.sharding import NamedSharding, PartitionSpec as P
from reference import max_diff, train_one_device

import eqxdist as ed

# Global-norm clipping makes the update depend on every parameter at once: under
# FSDP it must see the whole (sharded) gradient, not one device's shard.
OPTIMIZER = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))


def _model(key=0):
    return eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(key))


def _single_device(model, batches):
    """The reference: one device, the full batch per step; the model and each
    step's loss."""
    trained = train_one_device(model, batches, OPTIMIZER, loss_fn)
    return trained.model, trained.losses


def _train(step, model, batches, key=1):
    state = ed.TrainState.create(model, OPTIMIZER, jax.random.key(key))
    history = []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(metrics)
    return state, history


class Deep(eqx.Module):
    """An MLP whose hidden layers are separately FSDP-wrapped blocks."""

    layers: tuple

    def __init__(self, mesh, remat):
        mlp = _model()
        self.layers = tuple(
            ed.FSDP(layer, mesh, min_weight_size=16, remat=remat) if i < 2 else layer
            for i, layer in enumerate(mlp.layers)
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def test_dp_fsdp_and_single_device_training_agree(axis_types, rng):
    mesh = ed.create_data_parallel_mesh(axis_types=axis_types)
    batches = [_batch(rng) for _ in range(3)]
    reference, ref_losses = _single_device(_model(), batches)
    for strategy in ("dp", "fsdp"):
        step = ed.make_train_step(
            loss_fn,
            OPTIMIZER,
            mesh,
            strategy=strategy,
            num_minibatches=2,
            min_weight_size=16,
        )
        state, history = _train(step, _model(), batches)
        assert max_diff(state.model, reference) < 1e-5, strategy
        assert int(state.step) == 3
        for metrics, ref_loss in zip(history, ref_losses, strict=True):
            total, count = metrics["loss"]
            assert int(count) == 32
            np.testing.assert_allclose(total / count, ref_loss, rtol=1e-5)


@pytest.mark.parametrize("remat", [False, True])
def test_per_block_fsdp_matches_single_device(mesh8, rng, remat):
    batches = [_batch(rng) for _ in range(2)]
    plain = Deep(ed.create_data_parallel_mesh(1), remat=False)
    reference, _ = _single_device(plain, batches)
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8, strategy="fsdp")
    state, _ = _train(step, Deep(mesh8, remat=remat), batches)
    # The wrapped blocks stay sharded (their own min_weight_size); the head,
    # under the step's default min_weight_size, is replicated.
    assert state.model.layers[0].module.weight.sharding.spec == P("data", None)
    assert state.model.layers[2].weight.sharding.spec == P()
    mu = state.opt_state[1][0].mu
    assert mu.layers[0].module.weight.sharding.spec == P("data", None)
    assert max_diff(state.model, reference) < 1e-5


def test_state_is_placed_sharded_and_compiled_once(mesh8, rng, caplog):
    model = _model()
    step = ed.make_train_step(
        loss_fn, OPTIMIZER, mesh8, strategy="fsdp", min_weight_size=16
    )
    state = ed.TrainState.create(model, OPTIMIZER, jax.random.key(0))
    state, _ = step(state, _batch(rng))
    with jax.log_compiles():
        for _ in range(3):  # a new host (NumPy) batch every call
            state, _ = step(state, _batch(rng))
    assert "Compiling" not in caplog.text
    weight = state.model.layers[0].weight  # (16, 8): 128 elements
    assert weight.sharding.spec == P("data", None)
    assert weight.addressable_shards[0].data.shape == (2, 8)
    adam = state.opt_state[1][0]
    assert adam.mu.layers[0].weight.sharding.spec == P("data", None)
    assert adam.nu.layers[2].bias.sharding.spec == P()  # 4 elements
    assert adam.count.sharding.spec == P()
    assert state.key.sharding.spec == P()
    # The arrays of the model the state was created from survive the donation.
    np.testing.assert_array_equal(model.layers[0].weight, _model().layers[0].weight)
    # A state placed another way (replicated) is moved to the FSDP layout.
    replicated = jax.tree.map(
        lambda x: (
            jax.device_put(x, NamedSharding(mesh8, P())) if eqx.is_array(x) else x
        ),
        state,
    )
    state, _ = step(replicated, _batch(rng))
    assert state.model.layers[0].weight.sharding.spec == P("data", None)
    # So is a batch already on the mesh, but replicated rather than split.
    batch = jax.device_put(_batch(rng), NamedSharding(mesh8, P()))
    state, metrics = step(state, batch)
    assert int(metrics["loss"][1]) == 32
    # A second fresh state of the same structure is placed (a copy) as well,
    # without compiling again.
    model2 = _model(key=5)
    with jax.log_compiles():
        fresh, _ = step(
            ed.TrainState.create(model2, OPTIMIZER, jax.random.key(2)), _batch(rng)
        )
    assert "Compiling" not in caplog.text
    assert fresh.model.layers[0].weight.sharding.spec == P("data", None)
    assert fresh.key.sharding.spec == P()
    np.testing.assert_array_equal(model2.layers[0].weight, _model(5).layers[0].weight)


def test_minibatches_give_the_same_update(mesh8, rng):
    batch = _batch(rng)
    results = []
    for num_minibatches, use_scan in ((1, True), (4, True), (4, False)):
        step = ed.make_train_step(
            loss_fn,
            OPTIMIZER,
            mesh8,
            num_minibatches=num_minibatches,
            use_scan=use_scan,
        )
        state, (metrics,) = _train(step, _model(), [batch])
        results.append(state.model)
        assert int(metrics["loss"][1]) == 32
        assert int(metrics["accuracy"].total.value) == 32
    assert max_diff(results[0], results[1]) < 1e-6
    assert max_diff(results[1], results[2]) < 1e-6


def test_one_two_four_and_eight_devices_agree(rng):
    batches = [_batch(rng) for _ in range(2)]
    reference, _ = _single_device(_model(), batches)
    for n in (1, 2, 4, 8):
        mesh = ed.create_data_parallel_mesh(n)
        for strategy in ("dp", "fsdp"):
            step = ed.make_train_step(
                loss_fn, OPTIMIZER, mesh, strategy=strategy, min_weight_size=0
            )
            state, _ = _train(step, _model(), batches)
            assert max_diff(state.model, reference) < 1e-5, (n, strategy)


def test_metrics_are_reduced_over_devices(mesh8, rng):
    batch = _batch(rng)
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8, num_minibatches=2)
    state = ed.TrainState.create(_model(), OPTIMIZER, jax.random.key(0))
    logits = jax.vmap(state.model)(batch["x"])
    _, metrics = step(state, batch)
    accuracy = metrics["accuracy"]
    assert isinstance(accuracy, ed.metrics.Accuracy)
    expected = np.mean(np.argmax(np.asarray(logits), -1) == batch["y"])
    np.testing.assert_allclose(accuracy.compute(), expected, rtol=1e-6)
    assert metrics["accuracy"].total.value.sharding.spec == P()


def test_dropout_keys_differ_per_device_and_minibatch(mesh8):
    dropout = eqx.nn.Dropout(0.5)

    def noisy_loss(model, batch, key):
        device = jax.nn.one_hot(jax.lax.axis_index("data"), 8)
        mask = dropout(jnp.ones(16), key=key)
        metrics = {
            "u": device * jax.random.uniform(key),
            "mask": device[:, None] * mask[None, :],
        }
        return jnp.sum(model.weight) * 0.0 + jnp.mean(batch), metrics

    model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    state = ed.TrainState.create(model, optax.sgd(0.1), jax.random.key(7))
    step = ed.make_train_step(noisy_loss, optax.sgd(0.1), mesh8)
    new_state, metrics = step(state, np.ones((8, 3), np.float32))
    u = np.asarray(metrics["u"])
    step_key = jax.random.fold_in(jax.random.key(7), 0)  # step 0
    (minibatch_key,) = jax.random.split(step_key, 1)
    expected = [
        jax.random.uniform(jax.random.fold_in(minibatch_key, i)) for i in range(8)
    ]
    np.testing.assert_allclose(u, expected, rtol=1e-6)
    assert len(set(u.tolist())) == 8
    masks = np.asarray(metrics["mask"])
    assert len({tuple(row) for row in masks.tolist()}) == 8  # 8 different masks
    # The key stays (the first call placed a copy of it); the step moves on.
    np.testing.assert_array_equal(
        jax.random.key_data(new_state.key), jax.random.key_data(state.key)
    )
    newer_state, again = step(new_state, np.ones((8, 3), np.float32))
    assert newer_state.key is new_state.key
    assert not np.allclose(again["u"], u)  # step 1 draws new numbers


def test_a_loop_that_never_blocks_does_not_deadlock(mesh8):
    # XLA's CPU collectives abort when too many multi-device steps are queued; the
    # step bounds the number in flight. 3000 steps of a tiny model, never blocking.
    def tiny_loss(model, batch, key):
        loss = jnp.mean((jax.vmap(model)(batch) - 1.0) ** 2)
        return loss, {"loss": (loss, 1)}

    step = ed.make_train_step(tiny_loss, optax.sgd(0.01), mesh8)
    state = ed.TrainState.create(
        eqx.nn.Linear(2, 1, key=jax.random.key(0)), optax.sgd(0.01), jax.random.key(0)
    )
    batch = jax.device_put(np.ones((8, 2), np.float32))
    for _ in range(3000):
        state, _ = step(state, batch)
    assert int(state.step) == 3000


def test_train_state_create():
    model = _model()
    state = ed.TrainState.create(model, OPTIMIZER, jax.random.key(0))
    assert state.model is model and int(state.step) == 0
    expected = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(expected)


def test_bad_inputs_raise_clear_errors(mesh8, rng):
    with pytest.raises(ValueError, match=r"unknown strategy 'zero3'.*\['dp', 'fsdp'\]"):
        ed.make_train_step(loss_fn, OPTIMIZER, mesh8, strategy="zero3")
    with pytest.raises(ValueError, match=r"`num_minibatches` must be >= 1; got 0"):
        ed.make_train_step(loss_fn, OPTIMIZER, mesh8, num_minibatches=0)
    with pytest.raises(ValueError, match=r"'batch' is not an axis .* \('data',\)"):
        ed.make_train_step(loss_fn, OPTIMIZER, mesh8, data_axis="batch")
    with pytest.raises(ValueError, match=r"`num_minibatches` must be >= 1; got 0"):
        ed.accumulate_gradients(loss_fn, _model(), _batch(rng), None, 0)
    with pytest.raises(ValueError, match=r"\['x'\] has leading dimension 32.*by nu"):
        ed.accumulate_gradients(loss_fn, _model(), _batch(rng), None, 5)

    state = ed.TrainState.create(_model(), OPTIMIZER, jax.random.key(0))
    step = ed.make_train_step(loss_fn, OPTIMIZER, mesh8, num_minibatches=2)
    with pytest.raises(ValueError, match=r"\['x'\] has leading dimension 24.*= 16"):
        step(state, _batch(rng, rows=24))  # divisible by 8 devices, not by 8 x 2
    with pytest.raises(ValueError, match=r"\['x'\] has leading dimension 12.*= 16"):
        step(state, _batch(rng, rows=12))
    with pytest.raises(TypeError, match="state"):
        step({"model": _model()}, _batch(rng))

    def vector_loss(model, batch, key):
        return jax.vmap(model)(batch["x"]).sum(-1), {}

    with pytest.raises(ValueError, match=r"scalar loss; got .* shape \(2,\)"):
        ed.make_train_step(vector_loss, OPTIMIZER, mesh8)(state, _batch(rng, 16))

    def loss_only(model, batch, key):
        return jnp.mean(jax.vmap(model)(batch["x"]))

    with pytest.raises(TypeError, match=r"tuple `\(loss, metrics\)`"):
        ed.make_train_step(loss_only, OPTIMIZER, mesh8)(state, _batch(rng, 16))


def test_batch_leaves_with_different_rows(mesh8):
    step = ed.make_train_step(loss_fn, optax.sgd(0.1), mesh8)
    state = ed.TrainState.create(_model(), optax.sgd(0.1), jax.random.key(0))
    batch = batches()[0]
    bad = {"x": batch["x"], "y": batch["y"][:16]}
    with pytest.raises(ValueError, match=r"\['x'\]: 32, \['y'\]: 16"):
        step(state, bad)


def test_string_labels_after_good_steps(mesh8):
    step = ed.make_train_step(loss_fn, optax.sgd(0.1), mesh8)
    state = ed.TrainState.create(_model(), optax.sgd(0.1), jax.random.key(0))
    batch = batches()[0]
    state, _ = step(state, batch)
    state, _ = step(state, batch)
    labels = np.array([f"c{i}" for i in batch["y"]])
    with pytest.raises(TypeError, match=r"batch` leaf \['y'\] is a NumPy array of"):
        step(state, {"x": batch["x"], "y": labels})
    objects = batch["y"].astype(object)
    with pytest.raises(TypeError, match=r"batch` leaf \['y'\] is a NumPy array of"):
        step(state, {"x": batch["x"], "y": objects})


def test_empty_batch(mesh8):
    step = ed.make_train_step(loss_fn, optax.sgd(0.1), mesh8)
    state = ed.TrainState.create(_model(), optax.sgd(0.1), jax.random.key(0))
    batch = batches()[0]
    empty = {k: v[:0] for k, v in batch.items()}
    with pytest.raises(ValueError, match="train step: the batch has 0 rows"):
        step(state, empty)
    state, _ = step(state, batch)
    with pytest.raises(ValueError, match="train step: the batch has 0 rows"):
        step(state, empty)


def _step_error(mesh, loss, state, batch, optimizer=OPTIMIZER):
    with pytest.raises((TypeError, ValueError)) as info:
        ed.make_train_step(loss, optimizer, mesh)(state, batch)
    return str(info.value)


def test_loss_mistakes_name_the_loss_the_leaf_and_the_fix(mesh8, rng):
    """What real programs hit: each message names `loss_fn` (or the state), what
    was wrong and what to write, never JAX's internals."""
    state = ed.TrainState.create(_model(), OPTIMIZER, jax.random.key(0))
    batch = _batch(rng, 16)

    def key_metric(model, batch, key):
        return loss_fn(model, batch, key)[0], {"key": key}

    message = _step_error(mesh8, key_metric, state, batch)
    assert "loss_fn: metrics leaf ['key'] is an array of PRNG keys" in message
    assert "jax.random.key_data" in message

    def four_arguments(model, x, y, key):
        return jnp.mean(jax.vmap(model)(x)), {}

    message = _step_error(mesh8, four_arguments, state, batch)
    assert "loss_fn is called as `loss_fn(model, batch, key)`" in message
    assert "four_arguments(model, x, y, key)" in message
    assert "x, y = batch" in message

    def vector(model, batch, key):
        return jax.vmap(model)(batch["x"]).sum(-1), {}

    message = _step_error(mesh8, vector, state, batch)
    assert "got an array of shape (2,)" in message and "Tracer" not in message

    # A BatchNorm naming an axis that is not in the mesh.
    bn, bn_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        8, axis_name=("batch", "devices"), mode="batch"
    )

    def bn_loss(model, model_state, batch, key):
        out, model_state = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(batch["x"], model_state)
        return jnp.mean(out), {}, model_state

    stateful = ed.TrainState.create(
        bn, OPTIMIZER, jax.random.key(0), model_state=bn_state
    )
    message = _step_error(mesh8, bn_loss, stateful, batch)
    assert "loss_fn uses the axis 'devices'" in message
    assert "binds the mesh axes ('data',)" in message

    sgd = ed.TrainState.create(
        _model(), optax.sgd(0.1, momentum=0.9), jax.random.key(0)
    )
    message = _step_error(mesh8, loss_fn, sgd, batch)
    assert "`optimizer.init` gives (" in message and "with 13 leaves" in message
    assert "the state holds (TraceState, EmptyState)" in message
    assert "PyTreeDef" not in message and len(message) < 400


def test_per_block_remat_regathers_and_lowers_step_memory(mesh8):
    # A 4 x 512 x 512 MLP, lowered from an abstract state (nothing allocated).
    def regression_loss(model, batch, key):
        loss = jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)
        return loss, {}

    def deep(remat):
        keys = jax.random.split(jax.random.key(0), 4)
        layers = [eqx.nn.Linear(512, 512, key=k) for k in keys]
        layers = [
            ed.FSDP(x, mesh8, min_weight_size=2**10, remat=remat, layout="largest")
            for x in layers
        ]
        return eqx.nn.Sequential(layers)

    batch = {"x": np.zeros((64, 512), np.float32), "y": np.zeros((64, 512), np.float32)}
    temp, gathers = {}, {}
    for remat in (False, True):
        state = eqx.filter_eval_shape(
            lambda remat=remat: ed.TrainState.create(
                deep(remat), OPTIMIZER, jax.random.key(0)
            )
        )
        step = ed.make_train_step(regression_loss, OPTIMIZER, mesh8, strategy="fsdp")
        compiled = step.lower(state, batch).compile()
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
        gathers[remat] = compiled.as_text().count(" all-gather(")
    assert gathers == {False: 4, True: 7}  # blocks 2-4 gather again backwards
    # Without remat the gathered 1 MiB weights are kept for the backward pass
    # (4.3 MB of temporaries here; 2.6 MB with remat).
    assert temp[True] < 0.7 * temp[False]


class _PReLUNet(eqx.Module):
    linear: eqx.nn.Linear
    act: eqx.nn.PReLU  # holds a weakly typed scalar, `jnp.asarray(0.2)`

    def __init__(self, key):
        self.linear = eqx.nn.Linear(8, 4, key=key)
        self.act = eqx.nn.PReLU(0.2)

    def __call__(self, x):
        return self.act(self.linear(x))


def test_weakly_typed_parameters_compile_the_step_once(mesh8, rng):
    """The first update makes a weakly typed leaf strong (`param + update`); a
    state that kept it weak would compile every step function twice."""
    traces = []

    def counting_loss(model, batch, key):
        traces.append(1)
        return jnp.mean(jax.vmap(model)(batch["x"]) ** 2), {}

    model = _PReLUNet(jax.random.key(0))
    assert jax.typeof(model.act.negative_slope).weak_type
    hand_built = ed.TrainState(  # without TrainState.create
        model,
        OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array)),
        jnp.zeros((), jnp.int32),
        jax.random.key(0),
    )
    builds = {
        "create": lambda step: ed.TrainState.create(
            model, OPTIMIZER, jax.random.key(0)
        ),
        "init_state": lambda step: step.init_state(
            lambda k: ed.TrainState.create(_PReLUNet(k), OPTIMIZER, k),
            jax.random.key(0),
        ),
        "hand_built": lambda step: hand_built,
    }
    for name, build in builds.items():
        traces.clear()
        step = ed.make_train_step(counting_loss, OPTIMIZER, mesh8)
        state = build(step)
        for _ in range(3):
            state, _ = step(state, _batch(rng, 16))
        assert len(traces) == 1, name
        assert not jax.typeof(state.model.act.negative_slope).weak_type


def _squares(model, batch):
    """Each row's squared error (one device, plain JAX)."""
    return jnp.sum((jax.vmap(model)(batch["x"]) - batch["y"][:, None]) ** 2, -1)


def _metric_step(mesh, metrics_of, view, n):
    """A step of `_model()` on 32 rows whose metrics are `metrics_of(losses)`."""

    def loss(model, batch, key):
        losses = _squares(model, batch)
        return losses.mean(), metrics_of(losses)

    return ed.make_train_step(loss, optax.sgd(0.1), mesh, view=view, num_minibatches=n)


@pytest.mark.parametrize("view", ["device", "global"])
def test_plain_metrics_per_row_refused_and_0d_summed_with_a_warning(mesh8, rng, view):
    """v0.5: a per-row plain metrics leaf is a `ValueError` naming it and the fix;
    a 0-d one keeps v0.1's sum over devices and minibatches, with one
    `UserWarning` per step naming it and the number of values summed."""
    batch = {**_batch(rng), "y": rng.integers(0, 4, 32).astype(np.float32)}
    model = _model()
    state = ed.TrainState.create(model, optax.sgd(0.1), jax.random.key(0))
    # One loss_fn call per device and minibatch (device view), per minibatch
    # (global view): each sees 32 / calls rows.
    calls = 16 if view == "device" else 2
    step = _metric_step(mesh8, lambda losses: {"rows": losses}, view, 2)
    with pytest.raises(ValueError) as info:
        step(state, batch)
    message = str(info.value)
    assert f"loss_fn: metrics leaf ['rows'] has shape ({32 // calls},)" in message
    assert f"one entry per row of the {32 // calls} rows" in message
    assert f"over {calls} values" in message
    assert "ed.metrics.Mean().update(values)" in message and "per_row=True" in message

    step = _metric_step(mesh8, lambda losses: {"loss": losses.mean()}, view, 2)
    for _ in range(2):  # one warning per step, not per compilation
        with pytest.warns(UserWarning) as caught:
            state, metrics = step(state, batch)
        assert len(caught) == 1
        warned = str(caught[0].message)
        assert f"leaf ['loss'] is a plain 0-d array, the sum of {calls} values" in (
            warned
        )
        assert "ed.metrics.Mean()" in warned and "(losses.sum()" in warned
    assert metrics["loss"].shape == ()


@pytest.mark.parametrize("view", ["device", "global"])
def test_0d_plain_metric_equals_the_single_device_sum(mesh8, rng, view):
    batch = {**_batch(rng), "y": rng.integers(0, 4, 32).astype(np.float32)}
    model = _model()
    state = ed.TrainState.create(model, optax.sgd(0.1), jax.random.key(0))
    calls = 16 if view == "device" else 2
    step = _metric_step(mesh8, lambda losses: {"loss": losses.mean()}, view, 2)
    with pytest.warns(UserWarning, match=rf"\['loss'\].*the sum of {calls} values"):
        _, metrics = step(state, batch)
    # Every call's mean of 32 / calls rows, summed: the rows' sum / (32 / calls).
    expected = np.sum(_squares(model, batch)) / (32 // calls)
    np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)


@pytest.mark.parametrize("view", ["device", "global"])
def test_pairs_and_metrics_stay_silent(mesh8, rng, view):
    """`(sum, int)` pairs, `(sum, count)` arrays and `Metric`s are meant to add
    up: no warning; and where nothing is summed (the global view, one
    minibatch) a plain array comes back as it is, per-row ones too."""
    batch = {**_batch(rng), "y": rng.integers(0, 4, 32).astype(np.float32)}
    model = _model()
    losses = _squares(model, batch)
    state = ed.TrainState.create(model, optax.sgd(0.1), jax.random.key(0))

    def metrics_of(losses):
        return {
            "pair": (losses.sum(), losses.shape[0]),
            "arrays": (losses.sum(), jnp.asarray(losses.shape[0])),
            "mean": ed.metrics.Mean().update(losses),
            "per_class": jnp.zeros(3).at[0].set(losses.sum()),  # not per row
        }

    step = _metric_step(mesh8, metrics_of, view, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, metrics = step(state, batch)
    total = np.sum(losses)
    np.testing.assert_allclose(metrics["pair"][0], total, rtol=1e-5)
    assert metrics["pair"][1] == 32 and int(metrics["arrays"][1]) == 32
    np.testing.assert_allclose(metrics["mean"].compute(), total / 32, rtol=1e-5)
    np.testing.assert_allclose(metrics["per_class"][0], total, rtol=1e-5)
    if view == "global":
        step = _metric_step(mesh8, lambda ls: {"rows": ls, "loss": ls.mean()}, view, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, metrics = step(state, batch)
        np.testing.assert_allclose(metrics["rows"], losses, rtol=1e-5)
        np.testing.assert_allclose(metrics["loss"], np.mean(losses), rtol=1e-5)
