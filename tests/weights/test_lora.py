"""`ed.lora`, `ed.LoRALinear`, `ed.lora_trainable`, `ed.merge_lora`: the model
unchanged at creation (inside an `ed.Stacked` too), only the adapters trained
(no optimizer state for the base) and equal to one device in plain Equinox and
Optax under data parallelism, FSDP, tensor rules and a 1F1B pipeline, the
adapters placed by their weight's rule, the merge, and their tensor names."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import PipeNet, pipe_batches, pipe_loss
from jax.sharding import PartitionSpec as P
from reference import max_diff, train_one_device
from safetensors.numpy import load_file

import eqxdist as ed

ADAM = optax.adamw(1e-2, weight_decay=0.1)  # decay must not touch the frozen base
RANK = 2
WHERE = r"blocks\.linear|head"


def lora_net() -> PipeNet:
    return ed.lora(PipeNet(layers=4), rank=RANK, where=WHERE, key=jax.random.key(5))


def adapters_only(model: PipeNet):
    """The reference's filter, written out: the four adapter leaves."""
    frozen = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(
        lambda m: (
            m.blocks.layers.linear.lora_a,
            m.blocks.layers.linear.lora_b,
            m.head.lora_a,
            m.head.lora_b,
        ),
        frozen,
        (True,) * 4,
    )


def test_adapters_at_creation_leave_the_model_unchanged():
    base = PipeNet(layers=4)
    model = ed.lora(base, rank=RANK, where=WHERE, key=jax.random.key(5), alpha=4)
    linear = model.blocks.layers.linear
    assert isinstance(linear, ed.LoRALinear) and isinstance(model.head, ed.LoRALinear)
    assert isinstance(model.embed, eqx.nn.Linear)
    assert linear.lora_a.shape == (4, RANK, 16) and linear.lora_b.shape == (4, 16, RANK)
    assert float(jnp.abs(linear.lora_a).max()) <= 1 / 4 and linear.scale == 2.0
    assert not linear.lora_b.any()
    assert model.blocks.shapes[2:4] == ((4, RANK, 16), (4, 16, RANK))
    assert float(jnp.std(linear.lora_a[0] - linear.lora_a[1])) > 0  # per layer
    x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    np.testing.assert_array_equal(jax.vmap(model)(x), jax.vmap(base)(x))
    named = ed.lora(
        base, rank=1, where=lambda name, lin: name == "embed", key=jax.random.key(0)
    )
    assert isinstance(named.embed, ed.LoRALinear)
    with pytest.raises(ValueError, match=r"selects no eqx.nn.Linear.*blocks\.linear"):
        ed.lora(base, rank=1, where="nothing", key=jax.random.key(0))


def _layout(name: str):
    if name == "dp":
        return ed.Layout(ed.create_data_parallel_mesh())
    if name == "fsdp":
        return ed.Layout(
            ed.create_data_parallel_mesh(), strategy="fsdp", min_weight_size=0
        )
    if name == "tensor":
        return ed.Layout(
            ed.create_device_mesh({"data": 4, "model": 2}),
            param_rules=[(r"blocks.*linear\.weight", P(None, "model", None))],
        )
    return ed.Layout(
        ed.create_device_mesh({"stage": 2, "data": 4}),
        pipeline=ed.Pipeline("stage", 4, schedule="1f1b"),
    )


@functools.cache
def one_device():
    model = lora_net()
    return train_one_device(
        model, pipe_batches(steps=2), ADAM, pipe_loss, adapters_only(model)
    )


@pytest.mark.parametrize("layout", ["dp", "fsdp", "tensor", "1f1b"])
def test_training_only_the_adapters_equals_one_device(layout):
    model = lora_net()
    step = ed.make_train_step(pipe_loss, ADAM, _layout(layout))
    state = ed.TrainState.create(
        model, ADAM, jax.random.key(1), trainable=ed.lora_trainable(model)
    )
    # No optimizer state for the frozen base: adam's moments, one per adapter.
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim >= 2]
    assert len(moments) == 2 * 4
    batches = pipe_batches(steps=2)
    for batch in batches:
        state, _ = step(state, batch)
    expected = one_device()
    assert max_diff(state.model, expected.model) < 1e-5
    trained = state.model.blocks.layers.linear
    np.testing.assert_array_equal(trained.weight, model.blocks.layers.linear.weight)
    np.testing.assert_array_equal(state.model.head.bias, model.head.bias)
    assert np.abs(np.asarray(trained.lora_b)).max() > 0


def test_a_rule_for_the_weight_places_its_adapters():
    model = lora_net()
    layout = ed.Layout(
        ed.create_device_mesh({"data": 4, "model": 2}),
        param_rules=[
            (r"blocks.*linear\.weight", P(None, "model", None)),  # output dim
            (r"head\.weight", P(None, "model")),  # input dim
        ],
    )
    specs = layout.model_specs(model)
    assert specs.blocks.layers.linear.lora_b == P(None, "model", None)
    assert specs.blocks.layers.linear.lora_a == P(None, None, None)
    assert specs.head.lora_a == P(None, "model") and specs.head.lora_b == P(None, None)
    fsdp = ed.Layout(
        layout.mesh,
        strategy="fsdp",
        min_weight_size=0,
        param_rules=[(r"blocks.*linear\.weight", P(None, "model", None))],
    )
    b = fsdp.model_specs(model).blocks.layers.linear.lora_b
    assert b[1] == "model" and b[2] is None  # the rank never split by the rule


def test_merge_gives_plain_linears_computing_the_same(tmp_path):
    model = lora_net()
    model = eqx.tree_at(  # adapters that do something
        lambda m: (m.blocks.layers.linear.lora_b, m.head.lora_b),
        model,
        (jnp.full((4, 16, RANK), 0.3), jnp.full((4, RANK), -0.2)),
    )
    merged = ed.merge_lora(model)
    assert isinstance(merged.blocks.layers.linear, eqx.nn.Linear)
    assert isinstance(merged.head, eqx.nn.Linear)
    assert merged.blocks.shapes == PipeNet(layers=4).blocks.shapes
    x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    np.testing.assert_allclose(jax.vmap(merged)(x), jax.vmap(model)(x), atol=1e-5)
    lin = model.head
    np.testing.assert_allclose(
        merged.head.weight, lin.weight + lin.scale * lin.lora_b @ lin.lora_a, atol=1e-6
    )
    ed.save_safetensors(tmp_path, model)
    names = load_file(tmp_path / "model.safetensors")
    assert {
        "blocks.0.linear.weight",
        "blocks.0.linear.lora_a",
        "blocks.3.linear.lora_b",
    } <= set(names)
    back = ed.load_safetensors(tmp_path, model)
    assert max_diff(back, model) == 0
