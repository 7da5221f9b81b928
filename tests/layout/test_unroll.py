"""`ed.Stacked(..., unroll=True)` and `make_train_step(..., unroll=...)`: the
layers run as a Python loop over static slices of the stacked leaves. The values
equal the scan's and a plain Python loop over the blocks in Equinox; training
under data parallelism, FSDP (every gather path: prefetch, remat, gather in the
body) and pipelines equals single-device training in plain Equinox and Optax
(float32, 1e-5); the lowered program has no `while` loop over the layers."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import PipeBlock, PipeNet, pipe_batches, pipe_loss
from jax.sharding import PartitionSpec as P
from reference import max_diff, train_one_device

import eqxdist as ed

LAYERS = 4


class PlainNet(eqx.Module):
    """`PipeNet` in plain Equinox: its blocks a tuple, run by a Python loop."""

    embed: eqx.nn.Linear
    blocks: tuple
    head: eqx.nn.Linear

    def __call__(self, x):
        x = jax.nn.relu(self.embed(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _plain(net):
    """`net` (a `PipeNet`) with its stacked layers split back into blocks."""
    layers = net.blocks.layers
    blocks = tuple(
        jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, layers)
        for i in range(net.blocks.num_layers)
    )
    return PlainNet(net.embed, blocks, net.head)


def _net(unroll, **options):
    """`PipeNet` of `LAYERS` layers with its `Stacked` built with `unroll`."""
    net = PipeNet(layers=LAYERS)
    stacked = ed.Stacked(net.blocks.layers, unroll=unroll, **options)
    return eqx.tree_at(lambda n: n.blocks, net, stacked)


def _whiles(step, state, batch):
    """The `while` loops of the step's lowered program."""
    return len(re.findall(r"stablehlo\.while", step.lower(state, batch).as_text()))


class _Noisy(eqx.Module):
    """A block that takes a key: noise drawn from the layer's key."""

    block: PipeBlock

    def __call__(self, x, *, key):
        return self.block(x) + 0.1 * jax.random.normal(key, x.shape)


@pytest.mark.parametrize("with_key", [False, True])
def test_unrolled_values_equal_the_scan_and_a_python_loop(with_key):
    key = jax.random.key(3) if with_key else None
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 16)), jnp.float32)
    blocks = [PipeBlock(k) for k in jax.random.split(jax.random.key(0), LAYERS)]
    if with_key:
        blocks = [_Noisy(b) for b in blocks]
    scanned, unrolled = ed.Stacked(blocks), ed.Stacked(blocks, unroll=True)
    assert unrolled.unroll and not scanned.unroll
    assert max_diff(scanned.layers, unrolled.layers) == 0.0  # the same parameters

    def loop(h):
        if key is None:
            for block in blocks:
                h = block(h)
            return h
        for block, k in zip(blocks, jax.random.split(key, LAYERS), strict=True):
            h = block(h, key=k)
        return h

    def run(stack):
        return jax.vmap(lambda h: stack(h) if key is None else stack(h, key=key))(x)

    np.testing.assert_allclose(run(unrolled), run(scanned), atol=1e-6)
    np.testing.assert_allclose(run(unrolled), jax.vmap(loop)(x), atol=1e-6)


# name: (mesh, step options, the Stacked's own options, unroll given where)
CASES = {
    # The step's option overrides a Stacked built to scan.
    "dp_step_option": ({"data": 8}, {}, {}, "step"),
    "fsdp_prefetch": ({"data": 8}, {"strategy": "fsdp"}, {}, "stacked"),
    "fsdp_prefetch_remat_full": (
        {"data": 8},
        {"strategy": "fsdp"},
        {"remat": "full"},
        "stacked",
    ),
    "fsdp_gather_in_body_dots": (
        {"data": 8},
        {"strategy": "fsdp", "remat": "dots"},
        {},
        "stacked",
    ),
    "gpipe": (
        {"stage": 2, "data": 4},
        {"pipeline": ed.Pipeline("stage", 2)},
        {},
        "stacked",
    ),
    # A chunk of the stage's layers chosen per time slot, in the global view.
    "circular_global": (
        {"stage": 2, "data": 4},
        {
            "pipeline": ed.Pipeline("stage", 2, schedule="circular", repeats=2),
            "view": "global",
        },
        {},
        "stacked",
    ),
    "1f1b": (
        {"stage": 2, "data": 4},
        {"pipeline": ed.Pipeline("stage", 2, schedule="1f1b")},
        {},
        "step",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unrolled_training_equals_one_device(case):
    shape, options, own, where = CASES[case]
    optimizer = optax.adamw(1e-2)
    data = pipe_batches(steps=3)
    want = train_one_device(_plain(_net(False)), data, optimizer, pipe_loss)
    mesh = ed.create_device_mesh(shape)
    strategy = options.get("strategy")
    if strategy == "fsdp":
        options = {**options, "min_weight_size": 16}

    def make(unroll):
        stacked_unroll = unroll if where == "stacked" else not unroll
        step = ed.make_train_step(
            pipe_loss,
            optimizer,
            mesh,
            unroll=unroll if where == "step" else None,
            **options,
        )
        state = ed.TrainState.create(
            _net(stacked_unroll, **own), optimizer, jax.random.key(1)
        )
        return step, state

    step, state = make(True)
    scan_step, scan_state = make(False)
    unrolled, scanned = (
        _whiles(step, state, data[0]),
        _whiles(scan_step, scan_state, data[0]),
    )
    if "pipeline" in options:
        # The schedule's own loop over time slots stays; the layers' goes.
        assert unrolled < scanned
    else:
        assert (unrolled, scanned) == (0, 2)  # the layers' forward and backward
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(_plain(state.model), want.model) < 1e-5
    weight = state.model.blocks.layers.linear.weight
    assert (
        weight.sharding.spec
        == step.state_specs(scan_state).model.blocks.layers.linear.weight
    )
    if strategy == "fsdp":
        assert weight.sharding.spec == P(None, "data", None)


def test_the_step_option_overrides_every_stack_both_ways():
    mesh = ed.create_device_mesh({"data": 8})
    optimizer = optax.sgd(0.1)
    batch = pipe_batches(steps=1)[0]
    for built, given, loops in [(True, False, 2), (False, True, 0), (True, None, 0)]:
        step = ed.make_train_step(pipe_loss, optimizer, mesh, unroll=given)
        state = ed.TrainState.create(_net(built), optimizer, jax.random.key(1))
        assert _whiles(step, state, batch) == loops, (built, given)


def test_unroll_mistakes_are_clear_errors():
    blocks = [PipeBlock(k) for k in jax.random.split(jax.random.key(0), 2)]
    with pytest.raises(
        TypeError, match=r"Stacked: `unroll` must be True or False; got 'yes'"
    ):
        ed.Stacked(blocks, unroll="yes")
    mesh = ed.create_device_mesh({"data": 8})
    with pytest.raises(
        TypeError, match=r"make_train_step: `unroll` must be .* got 1 of type int"
    ):
        ed.make_train_step(pipe_loss, optax.sgd(0.1), mesh, unroll=1)
    # A model without a Stacked: the option would do nothing.
    step = ed.make_train_step(pipe_loss, optax.sgd(0.1), mesh, unroll=True)
    state = ed.TrainState.create(
        _plain(PipeNet(layers=2)), optax.sgd(0.1), jax.random.key(1)
    )
    with pytest.raises(
        ValueError, match=r"`unroll`=True is given, but the model holds no ed.Stacked"
    ):
        step(state, pipe_batches(steps=1)[0])
