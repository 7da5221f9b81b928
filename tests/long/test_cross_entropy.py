"""`ed.cross_entropy` and `ed.linear_cross_entropy` against Optax's summed,
weighted cross-entropy on the whole logits on one device (float32, values and
gradients), vocab-parallel on {model 4} in both views; what their compiled
programs communicate and hold; their errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxdist as ed

ROWS, D, V = (3, 5), 16, 32


def _data(seed=0, rows=ROWS):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(*rows, D)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(V, D)) * 0.5, jnp.float32)
    bias = jnp.asarray(rng.normal(size=V), jnp.float32)
    labels = jnp.asarray(rng.integers(0, V, rows), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=rows), jnp.float32)
    return hidden, weight, bias, labels, weights


def _optax(hidden, weight, bias, labels, weights):
    """Optax on the whole logits, summed and weighted, and the total weight."""
    logits = hidden @ weight.T + bias
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(losses * weights), jnp.sum(weights)


def _value_and_grads(loss, *args):
    """`loss(*args)` and the gradients of its loss sum with respect to the first
    three arguments (hidden, weight, bias), jitted."""
    return jax.jit(
        lambda *a: (loss(*a), jax.grad(lambda *b: loss(*b)[0], argnums=(0, 1, 2))(*a))
    )(*args)


def _assert_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def _cross_entropy(vocab_axis=None):
    def loss(hidden, weight, bias, labels, weights):
        logits = hidden @ weight.T + bias
        return ed.cross_entropy(logits, labels, weights=weights, vocab_axis=vocab_axis)

    return loss


def _linear(vocab_axis=None, chunk_size=4):
    def loss(hidden, weight, bias, labels, weights):
        return ed.linear_cross_entropy(
            hidden, weight, labels, bias=bias, weights=weights,
            vocab_axis=vocab_axis, chunk_size=chunk_size,
        )  # fmt: skip

    return loss


@pytest.mark.parametrize("loss", ["cross_entropy", "linear_cross_entropy"])
def test_the_losses_are_optax_summed_and_weighted(loss):
    data = _data()
    ours = _cross_entropy() if loss == "cross_entropy" else _linear(chunk_size=4)
    _assert_close(_value_and_grads(ours, *data), _value_and_grads(_optax, *data))


def test_without_weights_every_row_counts_once_and_boolean_weights_mask():
    hidden, weight, bias, labels, _ = _data(1)
    logits = hidden @ weight.T + bias
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    loss_sum, count = jax.jit(ed.cross_entropy)(logits, labels)
    np.testing.assert_allclose(loss_sum, losses.sum(), rtol=1e-6)
    assert count == 15
    mask = labels % 2 == 0
    loss_sum, count = jax.jit(
        lambda *a: ed.linear_cross_entropy(*a, bias=bias, weights=mask, chunk_size=7)
    )(hidden, weight, labels)
    np.testing.assert_allclose(loss_sum, losses[mask].sum(), rtol=1e-5)
    assert count == mask.sum()


def test_padding_rows_of_weight_zero_may_hold_any_label():
    hidden, weight, bias, labels, weights = _data(2)
    labels = labels.at[0, :2].set(-100)
    weights = weights.at[0, :2].set(0.0)
    got = ed.cross_entropy(hidden @ weight.T + bias, labels, weights=weights)
    want = _optax(hidden, weight, bias, jnp.where(weights == 0, 0, labels), weights)
    _assert_close(got, want)
    with pytest.raises(
        ValueError,
        match=r"cross_entropy: `labels` has 2 value\(s\) outside .* e.g. -100",
    ):
        ed.cross_entropy(hidden @ weight.T + bias, labels)


def test_traced_labels_out_of_range_give_nan():
    hidden, weight, bias, labels, _ = _data(3)
    labels = labels.at[0, 0].set(V)
    loss = jax.jit(lambda y: ed.cross_entropy(hidden @ weight.T + bias, y)[0])(labels)
    assert np.isnan(loss)


def _vocab_parallel(loss_of, view, mesh):
    """The loss with the vocabulary sharded over "model": in the device view
    `weight` and `bias` are the device's blocks; in the global view the whole."""
    loss = loss_of(vocab_axis="model")
    if view == "global":
        return loss
    return jax.shard_map(
        loss, mesh=mesh,
        in_specs=(P(), P("model"), P("model"), P(), P()), out_specs=(P(), P()),
    )  # fmt: skip


@pytest.mark.parametrize("view", ["device", "global"])
@pytest.mark.parametrize("loss", ["cross_entropy", "linear_cross_entropy"])
def test_vocab_parallel_losses_equal_optax_on_the_whole_vocabulary(loss, view):
    mesh = ed.create_device_mesh({"model": 4})
    data = _data(4)
    loss_of = _cross_entropy if loss == "cross_entropy" else _linear
    with jax.set_mesh(mesh):
        got = _value_and_grads(_vocab_parallel(loss_of, view, mesh), *data)
    _assert_close(got, _value_and_grads(_optax, *data))


@pytest.mark.parametrize("view", ["device", "global"])
def test_vocab_parallel_cross_entropy_gathers_no_logits(view):
    mesh = ed.create_device_mesh({"model": 4})
    data = _data(5)
    loss = _vocab_parallel(_cross_entropy, view, mesh)
    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2)))
        counts = ed.count_collectives(grads.lower(*data).compile())
    # the max and the (sum, label logit) pair; the hidden states' gradient
    assert counts["all-gather"] == 0 and counts["all-to-all"] == 0, counts
    assert 2 <= counts["all-reduce"] <= 3, counts


def test_the_chunked_loss_holds_under_half_the_whole_logits():
    rows, vocab, dim = 2048, 2048, 64
    hidden = jax.ShapeDtypeStruct((rows, dim), jnp.float32)
    weight = jax.ShapeDtypeStruct((vocab, dim), jnp.float32)
    labels = jax.ShapeDtypeStruct((rows,), jnp.int32)
    logits_bytes = rows * vocab * 4

    def temporaries(loss):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return (
            grads.lower(hidden, weight, labels)
            .compile()
            .memory_analysis()
            .temp_size_in_bytes
        )

    def chunked(h, w, y):
        return ed.linear_cross_entropy(h, w, y, chunk_size=256)[0]

    def whole(h, w, y):
        return optax.softmax_cross_entropy_with_integer_labels(h @ w.T, y).sum()

    assert temporaries(whole) >= logits_bytes  # what the measure sees of whole logits
    assert temporaries(chunked) < logits_bytes / 2


def test_loss_errors():
    hidden, weight, _, labels, _ = _data(6)
    with pytest.raises(
        ValueError,
        match=r"linear_cross_entropy: `chunk_size` must be an int >= 1 .* got 0",
    ):
        ed.linear_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(
        ValueError,
        match=r"linear_cross_entropy: `labels` has 1 value\(s\) outside .* e.g. 32",
    ):
        ed.linear_cross_entropy(hidden, weight, labels.at[1, 1].set(V))
    with pytest.raises(
        ValueError, match=r"`vocab_axis`='model' is neither bound .* no context mesh"
    ):
        ed.cross_entropy(hidden @ weight.T, labels, vocab_axis="model")
    with jax.set_mesh(ed.create_device_mesh({"model": 8})):
        odd = jnp.zeros((*ROWS, 12))
        with pytest.raises(
            ValueError,
            match=r"cross_entropy: the vocabulary has 12 entries, .* by the 8 devices",
        ):
            jax.jit(lambda x: ed.cross_entropy(x, labels % 12, vocab_axis="model"))(odd)


def _short(error):
    """A message of a few lines, not a dump of every parameter."""
    lines = str(error.value).splitlines()
    assert len(lines) <= 4, lines
    return str(error.value)


def test_a_transposed_head_float_labels_and_rows_of_another_shape_say_so_briefly():
    hidden, weight, bias, labels, weights = _data(6)
    with pytest.raises(ValueError) as error:
        ed.linear_cross_entropy(hidden, weight.T, labels)  # a (d, V) weight
    message = _short(error)
    assert message.startswith("linear_cross_entropy: `weight` has shape (16, 32);")
    assert "expected (V, d) = (V, 16)" in message and "pass `weight.T`" in message
    with pytest.raises(ValueError) as error:
        ed.linear_cross_entropy(hidden, weight, labels, bias=bias[:7])
    assert "`bias` has shape (7,); expected (V,) = (32,)" in _short(error)
    with pytest.raises(TypeError) as error:
        ed.cross_entropy(hidden @ weight.T, labels.astype(jnp.float32))
    message = _short(error)
    assert message.startswith("cross_entropy: `labels` has dtype float32")
    assert "expected integer class ids of shape (3, 5)" in message
    assert "labels.astype(jnp.int32)" in message
    with pytest.raises(TypeError) as error:
        ed.linear_cross_entropy(hidden, weight, labels.astype(jnp.float32))
    assert _short(error).startswith("linear_cross_entropy: `labels` has dtype float32")
    with pytest.raises(ValueError) as error:
        ed.cross_entropy(hidden @ weight.T, labels, weights=weights[:, :2])
    assert "`weights` has shape (3, 2); expected (3, 5), the rows of `logits`" in (
        _short(error)
    )
    with pytest.raises(ValueError) as error:
        ed.linear_cross_entropy(hidden, weight, labels.reshape(-1))
    assert "`labels` has shape (15,); expected (3, 5), the rows of `hidden`" in (
        _short(error)
    )
