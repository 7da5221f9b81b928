"""Sharded initialisation (`TrainStep.init_state`): the state built into its
shardings, a group of leaves at a time, equal to the state built whole and placed
(`place_state`), without a device ever holding a full copy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import STEP_LAYOUTS, make_layout_step, token_mean_loss, token_mlp

import eqxdist as ed
from eqxdist._step.sharded_init import leaf_groups


class Block(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(16, 16, key=key)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


class Deep(eqx.Module):
    body: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(self.body(x))


def init_models(setup, mesh):
    """A model builder per kind of model the layouts treat apart."""
    if setup == "stacked":
        return lambda key: Deep(
            ed.Stacked([Block(k) for k in jax.random.split(key, 3)]),
            eqx.nn.Linear(16, 2, key=key),
        )
    if setup == "fsdp_module":
        return lambda key: Deep(
            ed.FSDP(Block(key), mesh, min_weight_size=16),
            eqx.nn.Linear(16, 2, key=key),
        )
    return lambda key: eqx.nn.MLP(4, 3, 32, 1, key=key)


@pytest.mark.parametrize(
    ("setup", "axis_types"),
    [(s, "auto") for s in ["dp", "fsdp", "hsdp", "fsdp_tp", "stacked", "fsdp_module"]]
    + [("fsdp_tp", "explicit"), ("stacked", "explicit")],
)
def test_init_state_equals_place_state(setup, axis_types):
    layout = setup if setup in STEP_LAYOUTS else "fsdp"
    mesh = ed.create_device_mesh(STEP_LAYOUTS[layout][0], axis_types=axis_types)
    optimizer = optax.adam(1e-2)
    step = make_layout_step(layout, token_mean_loss, optimizer, axis_types)
    build = init_models(setup, mesh)

    def init_fn(key):
        model = build(key)
        trainable = jax.tree.map(lambda _: True, model)
        if setup == "dp":  # a frozen part and a model state
            trainable = eqx.tree_at(lambda m: m.layers[0], trainable, False)
        return ed.TrainState.create(
            model,
            optimizer,
            key,
            model_state={"seen": jnp.zeros((3,))},
            trainable=trainable,
        )

    key = jax.random.key(7)
    got = step.init_state(init_fn, key)
    want = step.place_state(init_fn(key))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert got.trainable == want.trainable
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    for x, y in leaves:
        if not eqx.is_array(x):
            assert x is y or x == y
            continue
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
        assert np.array_equal(np.asarray(x), np.asarray(y))
    if setup != "dp":
        sharded = [x for x in jax.tree.leaves(got) if eqx.is_array(x) and x.size >= 64]
        assert any(not x.sharding.is_fully_replicated for x in sharded)


def test_init_state_no_device_holds_a_full_copy(mesh8):
    """8 x 1024^2 under FSDP: while the state is built, a device holds about its
    share of it."""
    optimizer = optax.adam(1e-3)
    width, depth = 1024, 8

    def init_fn(key):
        keys = jax.random.split(key, depth)
        layers = [eqx.nn.Linear(width, width, key=k) for k in keys]
        return ed.TrainState.create(eqx.nn.Sequential(layers), optimizer, key)

    step = ed.make_train_step(token_mean_loss, optimizer, mesh8, strategy="fsdp")
    key = jax.random.key(0)
    programs = [p.compile().memory_analysis() for p in step.lower_init(init_fn, key)]
    abstract = eqx.filter_eval_shape(init_fn, key)
    total = sum(
        x.size * x.dtype.itemsize
        for x in jax.tree.leaves(abstract)
        if isinstance(x, jax.ShapeDtypeStruct)
        and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    )
    share = total / 8  # the biases (replicated) add 0.1%
    # Each device's outputs are its share; a full copy of the parameters alone
    # would be 8/3 of the share, of the whole state 8 times.
    assert sum(m.output_size_in_bytes for m in programs) <= 1.01 * share
    # Built in groups, the random bits being drawn are one group's: the peak is
    # the share (the goal: 1.25x; one program for the whole state: 1.43x).
    assert len(programs) > 1
    held = peak = 0
    for m in programs:
        peak = max(peak, held + m.output_size_in_bytes + m.temp_size_in_bytes)
        held += m.output_size_in_bytes
    assert step.init_peak_bytes(init_fn, key) == peak
    assert peak <= 1.05 * share, (peak, share)


@pytest.mark.parametrize(
    ("sizes", "groups"),
    [
        ([4, 4, 4, 4], [[0], [1], [2], [3]]),
        ([1, 1, 1, 1, 4, 8, 1, 1], [[0, 1], [2, 3], [4], [5], [6, 7]]),
        ([100], [[0]]),
        ([0, 0, 3, 0], [[0, 1], [2, 3]]),  # a key (0 bytes) joins a group
        ([], []),
    ],
)
def test_init_groups_are_runs_of_an_eighth_of_the_bytes(sizes, groups):
    # Each group holds at most sum / 8 (a larger leaf alone), in leaf order.
    assert leaf_groups(sizes, min_bytes=0) == groups
    # Of at least `min_bytes` each: a small state is one group (one program).
    assert leaf_groups(sizes) == ([list(range(len(sizes)))] if sizes else [])
    assert leaf_groups([4, 4, 4, 4], min_bytes=8) == [[0, 1], [2, 3]]


def test_init_state_mistakes(mesh8):
    step = ed.make_train_step(token_mean_loss, optax.sgd(0.1), mesh8)
    with pytest.raises(TypeError, match="init_state: `init_fn\\(\\*args\\)` must"):
        step.init_state(lambda key: token_mlp(), jax.random.key(0))
    with pytest.raises(TypeError, match="init_peak_bytes: `init_fn\\(\\*args\\)` must"):
        step.init_peak_bytes(lambda key: token_mlp(), jax.random.key(0))
