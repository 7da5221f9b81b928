"""Expert parallelism as one part of `ed.Layout`: every `ed.MoE`'s expert
weights split over an axis by expert, the tokens sent to them; training equals
single-device training of the same model on the same global data (float32,
1e-5), in both views, under every strategy, with tensor rules, minibatches,
weighted losses and step statistics."""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
    MOE_D as D,
    MOE_E as E,
    MOE_H as H,
    MoENet,
    moe_forward as _forward,
    moe_loss,
)
from jax.sharding import PartitionSpec as P

import eqxdist as ed


def weighted_loss(model, batch, key):
    logits, _ = _forward(model, batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    mask = batch["w"]
    return (jnp.sum(ce * mask), jnp.sum(mask)), {}


def _batches(steps=2, rows=32):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(rows, 6)).astype(np.float32),
            "y": rng.integers(0, 4, rows).astype(np.int32),
            "w": (rng.random(rows) < 0.7).astype(np.float32),
        }
        for _ in range(steps)
    ]


def _chunks(batch, devices, minibatches):
    """The rows each (minibatch, device) of a step computes on, minibatch-major."""
    per = jax.tree.map(
        lambda x: x.reshape(devices, minibatches, -1, *x.shape[1:]), batch
    )
    return [
        [jax.tree.map(lambda x, d=d, m=m: x[d, m], per) for d in range(devices)]
        for m in range(minibatches)
    ]


def _reference(model, batches, optimizer, loss, *, devices, minibatches, view):
    """One device, plain Equinox and Optax: the step's loss is the mean of its
    minibatches' losses, each (device view) the mean of the devices' losses on
    their rows, or (global view) the loss of the minibatch's rows together. A
    weighted loss divides the summed sums by the summed weights."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    state = optimizer.init(params)

    def step_loss(params, batch):
        full = eqx.combine(params, static)
        groups = _chunks(batch, devices, minibatches)
        if view == "global":
            groups = [
                [jax.tree.map(lambda *xs: jnp.concatenate(xs), *group)]
                for group in groups
            ]
        outs = [[loss(full, c, None)[0] for c in group] for group in groups]
        if isinstance(outs[0][0], tuple):
            sums = sum(o[0] for group in outs for o in group)
            return sums / sum(o[1] for group in outs for o in group)
        return jnp.mean(jnp.stack([jnp.mean(jnp.stack(g)) for g in outs]))

    # One program per step (op by op, the MoE's hundreds of small programs
    # cost more than the distributed step under test).
    @jax.jit
    def one_step(params, state, batch):
        grads = jax.grad(step_loss)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for batch in batches:
        params, state = one_step(params, state, batch)
    return eqx.combine(params, static)


# The single-device references several tests compare with, each trained once per
# test process: a reference is a function of the model, batches, optimizer, loss
# and (devices, minibatches, view) alone, which the tests below share exactly.
ADAMW = optax.adamw(1e-2)
SGD = optax.sgd(0.1)


@functools.cache
def _moe_reference(devices, minibatches, view):
    """`_reference` of `test_expert_parallel_training_equals_one_device`'s
    training (several of its cases take the same devices, minibatches and view)."""
    batches = [{"x": b["x"], "y": b["y"]} for b in _batches()]
    return _reference(
        MoENet(jax.random.key(0)), batches, ADAMW, moe_loss,
        devices=devices, minibatches=minibatches, view=view,
    )  # fmt: skip


def _max_diff(a, b):
    a = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    b = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(a, b, strict=True)
    )


TP_RULES = [
    (r"moe\.w_(in|gate)$", P(None, None, "model")),
    (r"moe\.w_out$", P(None, "model", None)),
]

CASES = {
    "dp_device": ({"data": 8}, dict(expert_axis="data"), {}),
    "dp_global": ({"data": 8}, dict(expert_axis="data"), dict(view="global")),
    "fsdp_minibatches": (
        {"data": 8},
        dict(strategy="fsdp", min_weight_size=16, expert_axis="data"),
        dict(num_minibatches=2),
    ),
    "zero1": (
        {"data": 8},
        dict(strategy="zero1", min_weight_size=16, expert_axis="data"),
        {},
    ),
    "tp_fsdp": (
        {"data": 4, "model": 2},
        dict(
            strategy="fsdp",
            min_weight_size=16,
            expert_axis="data",
            param_rules=TP_RULES,
        ),
        {},
    ),
    "own_axis": ({"data": 4, "expert": 2}, dict(expert_axis="expert"), {}),
    # The global view beside another axis: the layer's `shard_map` is over some
    # of the mesh's axes (once a JAX AssertionError in `jnp.searchsorted`).
    "own_axis_global": (
        {"data": 4, "expert": 2},
        dict(expert_axis="expert"),
        dict(view="global"),
    ),
    "tp_global": (
        {"data": 4, "model": 2},
        dict(expert_axis="data", param_rules=TP_RULES),
        dict(view="global"),
    ),
    "hsdp": (
        {"replica": 2, "data": 4},
        dict(
            strategy="fsdp",
            data_axis=("replica", "data"),
            min_weight_size=16,
            expert_axis="data",
        ),
        {},
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_expert_parallel_training_equals_one_device(name):
    shape, where, options = CASES[name]
    mesh = ed.create_device_mesh(shape)
    layout = ed.Layout(mesh, **where)
    optimizer = ADAMW
    model = MoENet(jax.random.key(0))
    step = ed.make_train_step(moe_loss, optimizer, layout, **options)
    state = ed.TrainState.create(model, optimizer, jax.random.key(1))
    for batch in _batches():
        state, _ = step(state, {"x": batch["x"], "y": batch["y"]})
    expected = _moe_reference(
        layout.num_shards,
        options.get("num_minibatches", 1),
        options.get("view", "device"),
    )
    assert _max_diff(state.model, expected) < 1e-5
    specs = layout.model_specs(model)
    assert specs.moe.w_in[0] == where["expert_axis"]
    if where.get("strategy", "dp") == "dp":
        assert specs.moe.router.weight == P()  # replicated; FSDP shards it


def test_weighted_loss_with_step_info():
    layout = ed.Layout(ed.create_device_mesh({"data": 8}), expert_axis="data")
    optimizer = optax.sgd(0.1)
    model = MoENet(jax.random.key(0), gated=False)
    step = ed.make_train_step(weighted_loss, optimizer, layout, step_info=True)
    state = ed.TrainState.create(model, optimizer, jax.random.key(1))
    batches = _batches()
    for batch in batches:
        out = step(state, batch)
        state, info = out.state, out.info
    expected = _reference(
        model,
        batches,
        optimizer,
        weighted_loss,
        devices=8,
        minibatches=1,
        view="device",
    )
    assert _max_diff(state.model, expected) < 1e-5
    assert np.isfinite(float(info["grad_norm"]))


def test_no_collective_gathers_an_expert_weight():
    layout = ed.Layout(
        ed.create_device_mesh({"data": 8}),
        strategy="fsdp",
        min_weight_size=16,
        expert_axis="data",
    )
    optimizer = optax.adamw(1e-2)
    model = MoENet(jax.random.key(0))
    step = ed.make_train_step(moe_loss, optimizer, layout)
    state = ed.TrainState.create(model, optimizer, jax.random.key(1))
    batch = _batches(1)[0]
    text = step.lower(state, {"x": batch["x"], "y": batch["y"]}).compile().as_text()
    gathered = re.findall(r"= f32\[([\d,]+)\]\S* all-gather\(", text)
    shapes = {tuple(int(d) for d in s.split(",")) for s in gathered}
    expert_sized = {s for s in shapes if len(s) == 3 and s[0] in (1, E)}
    assert not expert_sized, shapes


def test_expert_axis_errors():
    mesh = ed.create_device_mesh({"data": 4, "model": 2})
    with pytest.raises(ValueError, match=r"^Layout: `expert_axis`='experts' is not"):
        ed.Layout(mesh, expert_axis="experts")
    with pytest.raises(ValueError, match=r"name the expert axis 'model'"):
        ed.Layout(
            mesh, expert_axis="model", param_rules=[("w_in", P(None, None, "model"))]
        )
    layout = ed.Layout(ed.create_device_mesh({"data": 8}), expert_axis="data")
    model = MoENet(jax.random.key(0))
    bad = eqx.tree_at(lambda m: m.moe, model, ed.MoE(D, H, 4, key=jax.random.key(2)))
    with pytest.raises(ValueError, match=r"has 4 experts, not divisible by the 8"):
        layout.model_specs(bad)
    assert "experts" in layout.describe().splitlines()[1]


def _sequence_loss(model, batch, key):
    """`jax.vmap(moe)` over sequences: each row's tokens routed together."""
    h = jax.vmap(jax.vmap(model.embed))(batch["x"])
    y, aux = jax.vmap(model.moe)(h)
    logits = jax.vmap(jax.vmap(model.head))(h + y)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return ce.mean() + 0.01 * aux["load_balance_loss"].mean(), {}


@pytest.mark.parametrize(
    ("shape", "where", "options"),
    [
        ({"data": 8}, {}, dict(num_minibatches=2)),
        ({"data": 4, "context": 2}, dict(context_axis="context"), {}),
    ],
    ids=["minibatches", "context"],
)
def test_global_view_vmap_over_sequences_trains_as_one_device(shape, where, options):
    """The global view, `jax.vmap(moe)` over sequences of 4 tokens, with
    minibatches (on 8 devices: each sequence padded for the split), or beside a
    context axis (the layer's `shard_map` over some of the mesh's axes)."""
    layout = ed.Layout(ed.create_device_mesh(shape), expert_axis="data", **where)
    optimizer = SGD
    model = MoENet(jax.random.key(0))
    step = ed.make_train_step(
        _sequence_loss, optimizer, layout, view="global", **options
    )
    state = ed.TrainState.create(model, optimizer, jax.random.key(1))
    for batch in _sequence_batches():
        state, _ = step(state, batch)
    assert _max_diff(state.model, _sequence_reference()) < 1e-5


def _sequence_batches():
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(16, 4, 6)).astype(np.float32),
            "y": rng.integers(0, 4, (16, 4)).astype(np.int32),
        }
        for _ in range(2)
    ]


@functools.cache
def _sequence_reference():
    """One device's training of `_sequence_loss`, the same for both cases."""
    return _reference(
        MoENet(jax.random.key(0)), _sequence_batches(), SGD, _sequence_loss,
        devices=1, minibatches=1, view="global",
    )  # fmt: skip


class _Block(eqx.Module):
    moe: ed.MoE

    def __init__(self, key):
        self.moe = ed.MoE(D, H, 8, top_k=2, key=key)

    def __call__(self, x):
        y, aux = self.moe(x)
        return x + y, aux["load_balance_loss"]


class _StackedNet(eqx.Module):
    blocks: ed.Stacked

    def __init__(self, key):
        self.blocks = ed.Stacked([_Block(k) for k in jax.random.split(key, 4)])


def _stacked_loss(model, batch, key):
    h, aux = jax.vmap(model.blocks)(batch["x"])  # each row's tokens together
    return jnp.mean(h**2) + 0.01 * aux.mean(), {"aux": (aux.sum(), aux.size)}


def _plain_stacked_loss(model, batch, key):
    """The same loss on one device, the layers as a Python loop."""
    layers = model.blocks.layers

    def row(x):
        balance = 0.0
        for i in range(4):
            block = jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, layers)
            x, lb = block(x)
            balance = balance + lb
        return x, balance / 4

    h, aux = jax.vmap(row)(batch["x"])
    return jnp.mean(h**2) + 0.01 * aux.mean(), {"aux": aux.mean()}


STACKED_CASES = {
    "stacked_fsdp": ({"data": 8}, dict(strategy="fsdp", min_weight_size=16)),
    # The experts over an axis of their own: the stack's leaves arrive sharded
    # over it, not over the data axis it gathers (once refused by `Stacked`).
    "stacked_own_axis": ({"data": 4, "expert": 2}, dict(expert_axis="expert")),
    "stacked_own_axis_fsdp": (
        {"data": 4, "expert": 2},
        dict(expert_axis="expert", strategy="fsdp", min_weight_size=16),
    ),
    "stacked_own_axis_zero1": (
        {"data": 4, "expert": 2},
        dict(expert_axis="expert", strategy="zero1", min_weight_size=16),
    ),
    "gpipe": ({"stage": 2, "data": 4}, dict(pipeline=ed.Pipeline("stage", 2))),
    "1f1b": (
        {"stage": 2, "data": 4},
        dict(pipeline=ed.Pipeline("stage", 2, schedule="1f1b")),
    ),
    # The schedule's own `shard_map` binds the data axis: the experts enter it
    # split, and take the loss's gradient (JAX differentiates it whole).
    "gpipe_global": (
        {"stage": 2, "data": 4},
        dict(pipeline=ed.Pipeline("stage", 2), view="global"),
    ),
}


@pytest.mark.parametrize("name", STACKED_CASES)
def test_moe_blocks_of_a_stacked_and_a_pipeline_train_as_on_one_device(name):
    """An `ed.Stacked` of MoE blocks (their load-balancing loss out of the
    stack as aux), its expert weights over the data axis, with FSDP or a
    pipeline: the stack never gathers an expert weight, and training equals
    one device's."""
    shape, where = STACKED_CASES[name]
    where = {"expert_axis": "data", **where}
    view = where.pop("view", "device")
    layout = ed.Layout(ed.create_device_mesh(shape), **where)
    optimizer = SGD
    model = _StackedNet(jax.random.key(0))
    step = ed.make_train_step(_stacked_loss, optimizer, layout, view=view)
    state = ed.TrainState.create(model, optimizer, jax.random.key(1))
    reported = []
    for batch in _stacked_batches():
        state, metrics = step(state, batch)
        reported.append(np.asarray(metrics["aux"]))
    expected, want = _stacked_reference()
    assert _max_diff(state.model, expected) < 1e-5
    # The aux out of the stack, each row's and layer's, is one device's to
    # within a rounding of each (~1 ulp: XLA vectorises the router's
    # reductions by the microbatch's shape), so its mean to 1e-6.
    total, count = reported[0]
    assert abs(total / count - want) < 1e-6


def _stacked_batches():
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(16, 4, D)).astype(np.float32)} for _ in range(2)]


@functools.cache
def _stacked_reference():
    """One device's training of the stack, and its first batch's aux: the same
    for every case."""
    model, batches = _StackedNet(jax.random.key(0)), _stacked_batches()
    expected = _reference(
        model, batches, SGD, _plain_stacked_loss,
        devices=1, minibatches=1, view="global",
    )  # fmt: skip
    return expected, float(_plain_stacked_loss(model, batches[0], None)[1]["aux"])


def test_a_state_moves_between_layouts_and_builds_in_place(tmp_path):
    """`init_state` builds the state straight into the experts' layout; a
    checkpoint saved under it restores under replicated experts, and the two
    steps then compute the same update."""
    mesh = ed.create_device_mesh({"data": 8})
    optimizer = optax.adamw(1e-2)
    split = ed.make_train_step(moe_loss, optimizer, ed.Layout(mesh, expert_axis="data"))
    whole = ed.make_train_step(moe_loss, optimizer, ed.Layout(mesh))

    def init(key):
        return ed.TrainState.create(MoENet(key), optimizer, jax.random.key(1))

    state = split.init_state(init, jax.random.key(0))
    assert state.model.moe.w_in.addressable_shards[0].data.shape == (1, D, H)
    batch = {k: v for k, v in _batches(1)[0].items() if k != "w"}
    ed.save_checkpoint(tmp_path / "ckpt", state, step=0)
    restored = ed.restore_checkpoint(
        tmp_path / "ckpt", whole.place_state(init(jax.random.key(0)))
    )
    assert restored.model.moe.w_in.sharding.is_fully_replicated
    a, _ = split(state, batch)
    b, _ = whole(restored, batch)
    assert _max_diff(a.model, b.model) < 1e-5
