"""The update phase of a step with the Optax optimizers a single-device loop
takes: `optax.MultiSteps`, transformations that read Optax's extra argument
`value` (`optax.contrib.reduce_on_plateau`), and optimizer states holding
`optax.MaskedNode` laid out by every strategy; each against single-device
Equinox/Optax training (`reference.py`) on the same global data."""

import equinox as eqx
import jax
import optax
import pytest
from harness import batches, loss_fn
from reference import max_diff, train_one_device

import eqxdist as ed


def _mlp():
    return eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(1))


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_multisteps_matches_single_device(mesh8, strategy):
    optimizer = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    data = batches(steps=4)
    ref_model = train_one_device(_mlp(), data, optimizer, loss_fn, value=True).model

    step = ed.make_train_step(
        loss_fn, optimizer, mesh8, strategy=strategy, min_weight_size=16
    )
    state = ed.TrainState.create(_mlp(), optimizer, jax.random.key(0))
    models = []
    for batch in data:
        state, _ = step(state, batch)
        models.append(jax.device_get(state.model))
    assert max_diff(state.model, ref_model) < 1e-5
    # Every other step applies the accumulated update.
    assert max_diff(models[0], _mlp()) == 0.0
    assert max_diff(models[1], _mlp()) > 1e-4
    assert max_diff(models[2], models[1]) == 0.0


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_reduce_on_plateau_gets_the_loss(mesh8, strategy):
    # A large step on fresh batches: the loss does not improve every step, so
    # the plateau scale drops only if the step passes the loss as `value`.
    optimizer = optax.chain(
        optax.sgd(2.0),
        optax.contrib.reduce_on_plateau(factor=0.5, patience=0, cooldown=0),
    )
    data = batches(steps=5)
    want = train_one_device(_mlp(), data, optimizer, loss_fn, value=True)
    ref_model, ref_opt = want.model, want.opt_state
    assert float(ref_opt[1].scale) < 1.0

    step = ed.make_train_step(
        loss_fn, optimizer, mesh8, strategy=strategy, min_weight_size=16
    )
    state = ed.TrainState.create(_mlp(), optimizer, jax.random.key(0))
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, ref_model) < 1e-5
    assert float(state.opt_state[1].scale) == float(ref_opt[1].scale)
    assert float(state.opt_state[1].best_value) == pytest.approx(
        float(ref_opt[1].best_value), rel=1e-6
    )


def test_not_an_optimizer(mesh8):
    with pytest.raises(TypeError, match=r"make_train_step: `optimizer` must be"):
        ed.make_train_step(loss_fn, object(), mesh8)
    with pytest.raises(TypeError, match=r"TrainState.create: `optimizer` must be"):
        ed.TrainState.create(_mlp(), object(), jax.random.key(0))


# -- optimizers whose state holds optax.MaskedNode ----------------------------------


def _masked_optimizers():
    def is_matrix(params):
        return jax.tree.map(lambda x: x.ndim == 2, params)

    def groups(params):
        return jax.tree.map(lambda x: "matrix" if x.ndim == 2 else "vector", params)

    return {
        # Weight decay on the matrices only.
        "masked": optax.chain(
            optax.masked(optax.add_decayed_weights(0.1), is_matrix), optax.adam(1e-2)
        ),
        # One learning rate per group.
        "multi_transform": optax.multi_transform(
            {"matrix": optax.adam(1e-2), "vector": optax.sgd(0.1, momentum=0.9)},
            groups,
        ),
        "muon": optax.contrib.muon(1e-2),
    }


LAYOUTS = {
    # name: (mesh shape, make_train_step options)
    "fsdp": ({"data": 8}, {"strategy": "fsdp"}),
    "zero1": ({"data": 8}, {"strategy": "zero1"}),
    "hsdp": (
        {"replica": 2, "data": 4},
        {"strategy": "fsdp", "data_axis": ("replica", "data")},
    ),
    "fsdp_tp": (
        {"data": 4, "model": 2},
        {
            "strategy": "fsdp",
            "param_rules": [
                (r"layers\[0\]\.weight", jax.sharding.PartitionSpec("model"))
            ],
        },
    ),
}


@pytest.mark.parametrize(
    ("optimizer", "layout"),
    [("muon", layout) for layout in LAYOUTS]
    + [("multi_transform", "fsdp_tp"), ("multi_transform", "zero1")]
    + [("masked", "hsdp")],
)
def test_masked_optimizer_states_are_laid_out_and_train(optimizer, layout):
    optimizer = _masked_optimizers()[optimizer]
    shape, options = LAYOUTS[layout]
    data = batches()
    want = train_one_device(_mlp(), data, optimizer, loss_fn, value=True)
    ref_model, ref_opt = want.model, want.opt_state

    step = ed.make_train_step(
        loss_fn,
        optimizer,
        ed.create_device_mesh(shape),
        min_weight_size=16,
        **options,
    )
    state = ed.TrainState.create(_mlp(), optimizer, jax.random.key(0))
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, ref_model) < 1e-5
    assert max_diff(state.opt_state, ref_opt) < 1e-5
    # Each state leaf of the (16, 8) weight is laid out as the weight's share of
    # it (its optimizer state under zero1), masked nodes kept where they are.
    specs = step.state_specs(state)
    weight = specs.model.layers[0].weight
    assert "data" in str(weight) or layout == "zero1"
    state_specs = [
        s
        for s, x in zip(
            jax.tree.leaves(specs.opt_state, is_leaf=lambda s: s is None),
            jax.tree.leaves(state.opt_state, is_leaf=lambda s: s is None),
            strict=True,
        )
        if x is not None and x.shape == (16, 8)
    ]
    assert state_specs and all("data" in str(s) for s in state_specs)
    assert jax.tree.structure(specs.opt_state, is_leaf=lambda s: s is None) == (
        jax.tree.structure(state.opt_state, is_leaf=lambda s: s is None)
    )
