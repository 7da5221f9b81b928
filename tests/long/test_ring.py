"""Context-parallel `ed.attention` (ring attention) against the whole sequence on
one device (`jax.nn.dot_product_attention`, float32, values and gradients), in
the device view and the global view, on {context 4} and {data 2, context 4};
the work each device does; and what the compiled programs communicate and hold."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxdist as ed

B, T, H, KV, D = 2, 32, 4, 2, 8


def _inputs(seed=0, length=T):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    k, v = jnp.asarray(rng.normal(size=(2, B, length, KV, D)), jnp.float32)
    seg = jnp.asarray(np.sort(rng.integers(0, 4, (B, T)), axis=1), jnp.int32)
    return q, k, v, seg


def _reference(q, k, v, seg, causal):
    mask = None if seg is None else seg[:, None, :, None] == seg[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)


def _value_and_grads(attend, q, k, v, seg, compiled=False):
    """`attend(q, k, v, seg)` and the gradients of a weighted sum of it, jitted
    (and the compiled program, if `compiled`)."""
    weights = jnp.asarray(np.random.default_rng(5).normal(size=q.shape), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, seg) * weights)

    def both(q, k, v):
        return attend(q, k, v, seg), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    program = jax.jit(both).lower(q, k, v).compile()
    return (program(q, k, v), program) if compiled else program(q, k, v)


def _assert_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def _device_view(mesh, causal, segments, data):
    """Ring attention inside `jax.shard_map`, the batch over "data" (if `data`)
    and the sequence over "context" in the balanced order."""
    cp = mesh.shape["context"]
    spec = P("data" if data else None, "context")

    def one(q, k, v, s):
        s = s if segments else None
        return ed.attention(
            q, k, v, segment_ids=s, causal=causal, context_axis="context"
        )

    def per_device(q, k, v, seg):
        return jax.vmap(one)(q, k, v, seg)

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec)

    def attend(q, k, v, seg):
        order = lambda x: ed.to_context_order(x, cp, axis=1)  # noqa: E731
        out = mapped(order(q), order(k), order(v), order(seg))
        return ed.from_context_order(out, cp, axis=1)

    return attend


def _global_view(causal, segments):
    def attend(q, k, v, seg):
        def one(q, k, v, s):
            return ed.attention(
                q, k, v, causal=causal, segment_ids=s if segments else None,
                context_axis="context",
            )  # fmt: skip

        return jax.vmap(one)(q, k, v, seg)

    return attend


CASES = [
    # mesh, view, causal, segments
    ({"context": 4}, "device", True, True),
    ({"context": 4}, "device", False, True),
    ({"context": 4}, "global", True, False),
    ({"data": 2, "context": 4}, "device", True, True),
]


@pytest.mark.parametrize(
    ("shape", "view", "causal", "segments"),
    CASES,
    ids=[
        f"{'x'.join(map(str, s.values()))}-{v}-{'causal' if c else 'full'}"
        f"{'-segments' if g else ''}"
        for s, v, c, g in CASES
    ],
)
def test_ring_attention_is_attention_over_the_whole_sequence(
    shape, view, causal, segments
):
    mesh = ed.create_device_mesh(shape)
    q, k, v, seg = _inputs()
    want = _value_and_grads(
        lambda q, k, v, s: _reference(q, k, v, s if segments else None, causal),
        q, k, v, seg,
    )  # fmt: skip
    if view == "device":
        attend = _device_view(mesh, causal, segments, data="data" in shape)
        got = _value_and_grads(attend, q, k, v, seg)
    else:
        with jax.set_mesh(mesh):
            got = _value_and_grads(_global_view(causal, segments), q, k, v, seg)
    _assert_close(got, want)


def test_the_global_view_of_a_batch_sharded_over_data_and_context(axis_types):
    """Whole sequences, sharded in their natural order (as XLA or a step shards
    them): the function reorders each device's block with collective-permutes,
    in the forward and the backward pass, and gathers nothing."""
    mesh = ed.create_device_mesh({"data": 2, "context": 4}, axis_types=axis_types)
    q, k, v, seg = _inputs(1)
    want = _value_and_grads(lambda *a: _reference(*a, True), q, k, v, seg)
    with jax.set_mesh(mesh):
        placed = jax.device_put(
            (q, k, v, seg), jax.NamedSharding(mesh, P("data", "context"))
        )
        got, program = _value_and_grads(
            _global_view(True, True), *placed, compiled=True
        )
    _assert_close(got, want)
    counts = ed.count_collectives(program)
    assert counts["collective-permute"] > 0, counts
    assert counts["all-gather"] == 0 and counts["all-to-all"] == 0, counts


def test_keys_of_another_length_with_a_pair_of_segment_ids():
    q, k, v, seg = _inputs(2, length=16)
    kv_seg = jnp.asarray(
        np.sort(np.random.default_rng(3).integers(0, 4, (B, 16))), jnp.int32
    )
    kv_seg = kv_seg.at[:, :4].set(jnp.arange(4))  # every segment has keys
    mask = seg[:, None, :, None] == kv_seg[:, None, None, :]
    want = _value_and_grads(
        lambda q, k, v, s: jax.nn.dot_product_attention(q, k, v, mask=mask),
        q,
        k,
        v,
        seg,
    )
    mesh = ed.create_device_mesh({"context": 4})

    def attend(q, k, v, s):
        one = lambda q, k, v, a, b: ed.attention(  # noqa: E731
            q, k, v, segment_ids=(a, b), context_axis="context"
        )
        return jax.vmap(one)(q, k, v, s, kv_seg)

    with jax.set_mesh(mesh):
        got = _value_and_grads(attend, q, k, v, seg)
    _assert_close(got, want)


LENGTHS = [(t, s, v) for t, s in ((16, 32), (32, 16)) for v in ("device", "global")]


@pytest.mark.parametrize(
    ("t", "s", "view"), LENGTHS, ids=[f"T{t}-S{s}-{v}" for t, s, v in LENGTHS]
)
def test_causal_attention_of_queries_and_keys_of_different_lengths(t, s, view):
    """JAX's `is_causal` where T != S (`jnp.tril` of (T, S): query t attends keys
    s <= t), on {data 2, context 4}: queries and keys each in the balanced order
    of their own sequence, the mask from their positions in them."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.normal(size=(B, t, H, D)), jnp.float32)
    k, v = jnp.asarray(rng.normal(size=(2, B, s, KV, D)), jnp.float32)
    unused = jnp.zeros((B, t), jnp.int32)  # segment ids the helpers pass round
    want = _value_and_grads(lambda *a: _reference(*a[:3], None, True), q, k, v, unused)
    mesh = ed.create_device_mesh({"data": 2, "context": 4})
    if view == "device":
        attend = _device_view(mesh, True, False, data=True)
        got = _value_and_grads(attend, q, k, v, unused)
    else:
        with jax.set_mesh(mesh):
            got = _value_and_grads(_global_view(True, False), q, k, v, unused)
    _assert_close(got, want)


def test_causal_attention_of_different_lengths_with_a_pair_of_segment_ids():
    q, k, v, seg = _inputs(4, length=64)
    kv_seg = jnp.asarray(
        np.sort(np.random.default_rng(5).integers(0, 4, (B, 64))), jnp.int32
    )
    kv_seg = kv_seg.at[:, :4].set(jnp.arange(4))  # every segment has early keys
    mask = seg[:, None, :, None] == kv_seg[:, None, None, :]
    want = _value_and_grads(
        lambda q, k, v, s: jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True
        ),
        q, k, v, seg,
    )  # fmt: skip

    def attend(q, k, v, s):
        one = lambda q, k, v, a, b: ed.attention(  # noqa: E731
            q, k, v, segment_ids=(a, b), causal=True, context_axis="context"
        )
        return jax.vmap(one)(q, k, v, s, kv_seg)

    with jax.set_mesh(ed.create_device_mesh({"context": 4})):
        got = _value_and_grads(attend, q, k, v, seg)
    _assert_close(got, want)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_device_does_the_same_causal_work(cp):
    """The positions `context_positions` gives are the balanced order's, and each
    device's queries have the same number of keys at or before them."""
    length = 2 * cp * 4
    mesh = ed.create_device_mesh({"context": cp})
    positions = jax.jit(
        jax.shard_map(
            lambda: ed.context_positions(length // cp, "context"),
            mesh=mesh,
            in_specs=(),
            out_specs=P("context"),
        )
    )()
    np.testing.assert_array_equal(positions, ed.to_context_order(np.arange(length), cp))
    per_device = np.asarray(positions).reshape(cp, -1)
    pairs = (per_device + 1).sum(axis=1)  # keys 0..p for the query at p
    assert len(set(pairs.tolist())) == 1, pairs
    contiguous = (np.arange(length).reshape(cp, -1) + 1).sum(axis=1)
    assert contiguous[-1] > 2 * contiguous[0]  # what the balance avoids


def _compiled_ring(cp, length, heads=4, dim=16):
    """The gradient program of causal ring attention in the device view."""
    mesh = ed.create_device_mesh({"context": cp})
    shape = jax.ShapeDtypeStruct((length, heads, dim), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(ed.attention(q, k, v, causal=True, context_axis="context") ** 2)

    mapped = jax.shard_map(
        jax.grad(loss, argnums=(0, 1, 2)),
        mesh=mesh, in_specs=P("context"), out_specs=P("context"),
    )  # fmt: skip
    return jax.jit(mapped).lower(shape, shape, shape).compile()


def test_the_ring_passes_keys_round_and_gathers_nothing():
    counts = ed.count_collectives(_compiled_ring(4, 64))
    # forward: 3 steps x (keys, values); backward: 3 x (keys, values, their
    # gradients) + the gradients' way home; XLA may merge some of them.
    assert counts["collective-permute"] >= 6, counts
    assert counts["all-gather"] == 0 and counts["all-to-all"] == 0, counts
    assert counts["all-reduce"] == 0 and counts["reduce-scatter"] == 0, counts


def test_per_device_temporaries_fall_as_the_context_axis_grows():
    temps = {
        cp: _compiled_ring(cp, 256).memory_analysis().temp_size_in_bytes
        for cp in (1, 2, 8)
    }
    for cp in (2, 8):
        assert temps[cp] <= temps[1] / cp, temps  # at least 1/cp: blocks fall as 1/cp^2


def test_the_device_view_needs_balanced_chunks_and_a_bound_axis():
    mesh = ed.create_device_mesh({"context": 4})
    q = jnp.zeros((4 * 3, H, D))

    def odd(q):
        return ed.attention(q, q, q, causal=True, context_axis="context")

    with pytest.raises(ValueError, match=r"even lengths .* got 3 queries and 3 keys"):
        jax.shard_map(odd, mesh=mesh, in_specs=P("context"), out_specs=P("context"))(q)
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            ValueError, match=r"`q` has 12 positions, which is not divisible by 8 "
        ),
    ):
        jax.jit(odd)(q)
    with pytest.raises(
        ValueError, match=r"context_positions: `local_length` must be even"
    ):
        ed.context_positions(3, "context")
    with pytest.raises(
        ValueError, match=r"context_positions: `context_axis`='context' is not bound"
    ):
        ed.context_positions(4, "context")


def test_the_order_helpers():
    x = np.arange(2 * 16).reshape(2, 16)
    ordered = ed.to_context_order(x, 4, axis=1)
    assert isinstance(ordered, np.ndarray)
    np.testing.assert_array_equal(ordered[0, :4], [0, 1, 14, 15])
    np.testing.assert_array_equal(ed.from_context_order(ordered, 4, axis=-1), x)
    back = ed.from_context_order(
        ed.to_context_order(jnp.asarray(x), 2, axis=1), 2, axis=1
    )
    assert isinstance(back, jax.Array)
    np.testing.assert_array_equal(back, x)
    with pytest.raises(
        ValueError,
        match=r"to_context_order: .* length 16, .* 2 \* context_size = 24",
    ):
        ed.to_context_order(x, 12, axis=1)
    with pytest.raises(
        ValueError, match=r"from_context_order: `context_size` must be .* got 0"
    ):
        ed.from_context_order(x, 0)


def test_bfloat16_ring_attention_is_as_close_as_one_device_s():
    """In bfloat16 the ring (float32 softmax statistics) is as close to float32
    attention of the same inputs, values and gradients, as
    `jax.nn.dot_product_attention` in bfloat16 on the whole sequence."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(7)[:3])
    exact = _value_and_grads(
        lambda *a: _reference(*a, True),
        *(x.astype(jnp.float32) for x in (q, k, v)),
        None,
    )
    one_device = _value_and_grads(lambda *a: _reference(*a, True), q, k, v, None)
    with jax.set_mesh(ed.create_device_mesh({"context": 4})):
        ring = _value_and_grads(_global_view(True, False), q, k, v, None)
    assert ring[0].dtype == jnp.bfloat16
    for name, ours, theirs, want in zip(
        ["out", "dq", "dk", "dv"],
        jax.tree.leaves(ring),
        jax.tree.leaves(one_device),
        jax.tree.leaves(exact),
        strict=True,
    ):
        ring_error = _relative_error(ours, want)
        bf16_error = _relative_error(theirs, want)
        assert ring_error <= 1.25 * bf16_error, (name, ring_error, bf16_error)


def _relative_error(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return np.linalg.norm(got - want) / np.linalg.norm(want)
