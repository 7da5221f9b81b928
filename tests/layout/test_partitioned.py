"""FSDP `Linear` layers whose computation is partitioned over the devices instead of
their weights gathered (`make_train_step(fsdp_linears=...)`), against plain
single-device Equinox/Optax on the same global data, on 8 simulated devices."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from reference import max_diff, train_one_device

import eqxdist as ed
from eqxdist._layout.partitioned import partition_pays

WIDTH = 32
ROWS = 32  # 4 rows per device


class Block(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key, width=WIDTH):
        self.linear = eqx.nn.Linear(width, width, key=key)

    def __call__(self, x):
        return jax.nn.gelu(jax.vmap(self.linear)(x))


class Net(eqx.Module):
    """Three `Linear` blocks (weights `(32, 32)`, sharded on their rows) and a
    head whose weight `(3, 32)` FSDP shards on its columns: not a candidate."""

    blocks: tuple[Block, ...]
    head: eqx.nn.Linear

    def __init__(self, key=0):
        keys = jax.random.split(jax.random.key(key), 4)
        self.blocks = tuple(Block(k) for k in keys[:3])
        self.head = eqx.nn.Linear(WIDTH, 3, key=keys[3])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(x)


def batch_of(seed, rows=ROWS):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(rows, WIDTH)).astype(np.float32),
        "y": rng.integers(0, 3, size=(rows,)).astype(np.int32),
        "w": rng.integers(0, 4, size=(rows,)).astype(np.float32),
    }


def losses(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        model(batch["x"]), batch["y"]
    )


def mean_loss(model, batch, key):
    del key
    return losses(model, batch).mean(), {}


def weighted_loss(model, batch, key):
    del key
    return (jnp.sum(batch["w"] * losses(model, batch)), batch["w"].sum()), {}


def weighted_mean(model, batch, key):
    """`weighted_loss` as one device computes it: the weighted mean of the rows."""
    del key
    return jnp.sum(batch["w"] * losses(model, batch)) / batch["w"].sum()


def make_step(loss_fn, optimizer, setup="fsdp", **kwargs):
    shape, axes = {
        "fsdp": ({"data": 8}, "data"),
        "hsdp": ({"replica": 2, "data": 4}, ("replica", "data")),
    }[setup]
    return ed.make_train_step(
        loss_fn,
        optimizer,
        ed.create_device_mesh(shape),
        strategy="fsdp",
        data_axis=axes,
        fsdp_axis="data",
        min_weight_size=64,
        **kwargs,
    )


def all_to_alls(step, state, batch):
    return ed.count_collectives(step.lower(state, batch).compile().as_text())[
        "all-to-all"
    ]


@pytest.mark.parametrize(
    ("setup", "n", "gather", "weighted"),
    [
        ("fsdp", 1, "step", False),
        ("fsdp", 4, "step", True),
        ("fsdp", 4, "minibatch", False),
        ("hsdp", 1, "step", True),
        ("hsdp", 2, "step", False),
    ],
)
def test_partitioned_layers_train_as_one_device_does(setup, n, gather, weighted):
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    data = [batch_of(s) for s in range(3)]
    want = train_one_device(
        Net(), data, optimizer, weighted_mean if weighted else mean_loss
    ).model
    step = make_step(
        weighted_loss if weighted else mean_loss,
        optimizer,
        setup,
        num_minibatches=n,
        fsdp_gather=gather,
        fsdp_linears="partition",
    )
    state = step.place_state(ed.TrainState.create(Net(), optimizer, jax.random.key(0)))
    assert all_to_alls(step, state, data[0]) > 0  # the layers are partitioned
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, want) < 2e-6
    assert max_diff(state.model, Net()) > 1e-3  # it trained
    # The weights stayed sharded, each device holding its rows.
    weight = state.model.blocks[0].linear.weight
    assert weight.addressable_shards[0].data.shape == (
        WIDTH // 4 if setup == "hsdp" else WIDTH // 8,
        WIDTH,
    )


def test_the_plan_names_row_sharded_linears_only():
    step = make_step(mean_loss, optax.sgd(0.1))
    plan = step.layout.plan(Net())
    names = [jax.tree_util.keystr(p) for p in plan.linears]
    assert names == [".blocks[0].linear", ".blocks[1].linear", ".blocks[2].linear"]
    # Tensor-parallel rules take a weight out: its layer gathers as before.
    tp = ed.make_train_step(
        mean_loss,
        optax.sgd(0.1),
        ed.create_device_mesh({"data": 4, "model": 2}),
        strategy="fsdp",
        min_weight_size=64,
        param_rules=[(r"blocks\[1\]\.linear\.weight", P(None, "model"))],
    )
    names = [jax.tree_util.keystr(p) for p in tp.layout.plan(Net()).linears]
    assert names == [".blocks[0].linear", ".blocks[2].linear"]


def test_auto_chooses_by_the_elements_moved():
    # A 32 x 32 weight moves 2 * 1024 elements; 16 rows move 16 * (32 + 4) each way.
    assert partition_pays(32, 32, rows=16, devices=8, weight_moves=1)
    assert not partition_pays(32, 32, rows=1024, devices=8, weight_moves=1)
    # Gathered per minibatch, a weight moves once per minibatch.
    assert partition_pays(32, 32, rows=64, devices=8, weight_moves=4)
    assert not partition_pays(32, 32, rows=64, devices=8, weight_moves=1)

    optimizer = optax.sgd(0.1)
    state = ed.TrainState.create(Net(), optimizer, jax.random.key(0))
    step = make_step(mean_loss, optimizer)  # fsdp_linears="auto" by default
    few, many = batch_of(0, rows=16), batch_of(0, rows=1024)
    assert all_to_alls(step, state, few) == 6  # 3 layers, forward and backward
    assert all_to_alls(step, state, many) == 0
    gathered = make_step(mean_loss, optimizer, fsdp_linears="gather")
    assert all_to_alls(gathered, state, few) == 0


class Tied(eqx.Module):
    """A layer used as a module and, transposed, through its `weight` (weight
    tying), and a frozen layer."""

    inner: eqx.nn.Linear
    frozen: eqx.nn.Linear

    def __init__(self, key=0):
        k1, k2 = jax.random.split(jax.random.key(key))
        self.inner = eqx.nn.Linear(WIDTH, WIDTH, key=k1)
        self.frozen = eqx.nn.Linear(WIDTH, WIDTH, key=k2)

    def __call__(self, x):
        h = jax.nn.gelu(jax.vmap(self.inner)(x))
        h = jax.vmap(self.frozen)(h)
        return (h @ self.inner.weight)[:, :3]


def test_weight_tying_and_frozen_layers_train_as_one_device_does():
    optimizer = optax.adam(1e-2)
    data = [batch_of(s) for s in range(2)]
    trainable = jax.tree.map(lambda _: True, Tied())
    trainable = eqx.tree_at(
        lambda m: m.frozen, trainable, jax.tree.map(lambda _: False, trainable.frozen)
    )

    want = train_one_device(Tied(), data, optimizer, mean_loss, trainable).model

    step = make_step(mean_loss, optimizer, fsdp_linears="partition")
    state = ed.TrainState.create(
        Tied(), optimizer, jax.random.key(0), trainable=trainable
    )
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, want) < 2e-6
    assert max_diff(state.model.frozen, Tied().frozen) == 0.0


class Branchy(eqx.Module):
    """A layer under `lax.cond`: devices may take different branches, so it must
    not hold collectives."""

    blocks: tuple[Block, ...]

    def __init__(self, key=0):
        self.blocks = tuple(Block(k) for k in jax.random.split(jax.random.key(key), 2))

    def __call__(self, x):
        x = self.blocks[0](x)
        x = jax.lax.cond(x.sum() > 0, lambda v: self.blocks[1](v), lambda v: v, x)
        return x[:, :3]


def test_a_layer_under_a_branch_is_gathered_even_when_partitioning():
    optimizer = optax.sgd(0.1)
    data = [batch_of(s) for s in range(2)]
    want = train_one_device(Branchy(), data, optimizer, mean_loss).model
    step = make_step(mean_loss, optimizer, fsdp_linears="partition")
    state = ed.TrainState.create(Branchy(), optimizer, jax.random.key(0))
    assert all_to_alls(step, state, data[0]) == 2  # the first block only
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, want) < 2e-6


def test_step_info_norms_with_partitioned_layers():
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    batch = batch_of(5)
    model = Net()
    one_step = train_one_device(model, [batch], optimizer, mean_loss)
    grads, updates = one_step.grads, one_step.updates
    step = make_step(mean_loss, optimizer, fsdp_linears="partition", step_info=True)
    state = ed.TrainState.create(model, optimizer, jax.random.key(0))
    out = step(state, batch)
    state, info = out.state, out.info
    np.testing.assert_allclose(info["grad_norm"], optax.tree.norm(grads), rtol=1e-5)
    np.testing.assert_allclose(info["update_norm"], optax.tree.norm(updates), rtol=1e-5)


def test_unknown_fsdp_linears_is_a_value_error(mesh8):
    with pytest.raises(
        ValueError, match="make_train_step: unknown fsdp_linears 'always'"
    ):
        ed.make_train_step(mean_loss, optax.sgd(0.1), mesh8, fsdp_linears="always")


class NormedNet(eqx.Module):
    """`Linear`s inside `eqx.nn.SpectralNorm` and `eqx.nn.WeightNorm`, which
    replace their layer's weight (`eqx.tree_at`) before calling it."""

    spectral: eqx.nn.SpectralNorm
    weight_norm: eqx.nn.WeightNorm
    head: eqx.nn.Linear

    def __init__(self, key=0):
        keys = jax.random.split(jax.random.key(key), 4)
        linear = eqx.nn.Linear(WIDTH, WIDTH, key=keys[0])
        self.spectral = eqx.nn.SpectralNorm(linear, "weight", key=keys[1])
        self.weight_norm = eqx.nn.WeightNorm(eqx.nn.Linear(WIDTH, WIDTH, key=keys[2]))
        self.head = eqx.nn.Linear(WIDTH, 3, key=keys[3])

    def __call__(self, x, state):
        h, state = self.spectral(x, state)
        return self.head(jax.nn.gelu(self.weight_norm(jax.nn.gelu(h)))), state


def normed_loss(model, state, batch, key):
    del key
    logits, state = jax.vmap(
        model, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
    )(batch["x"], state)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {}, state


@pytest.mark.parametrize("linears", ["auto", "partition"])
@pytest.mark.parametrize(
    ("shape", "axes"),
    [({"data": 8}, "data"), ({"replica": 2, "data": 4}, ("replica", "data"))],
)
def test_spectral_and_weight_norm_layers_are_gathered(shape, axes, linears):
    optimizer = optax.adam(1e-2)
    data = [batch_of(seed) for seed in range(3)]
    model, model_state = eqx.nn.make_with_state(NormedNet)()

    # Single device: plain Equinox and Optax, the model state carried along.
    want = train_one_device(
        model, data, optimizer, normed_loss, model_state=model_state
    )

    step = ed.make_train_step(
        normed_loss,
        optimizer,
        ed.create_device_mesh(shape),
        strategy="fsdp",
        data_axis=axes,
        min_weight_size=16,
        fsdp_linears=linears,
    )
    state = ed.TrainState.create(
        model, optimizer, jax.random.key(0), model_state=model_state
    )
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, want.model) < 1e-5
    assert max_diff(state.model_state, want.model_state) < 1e-5
    weight = state.model.spectral.layer.weight
    assert weight.addressable_shards[0].data.size * 4 <= weight.size  # sharded
