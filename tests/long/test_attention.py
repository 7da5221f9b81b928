"""`ed.attention` on one device against `jax.nn.dot_product_attention` (float32,
values and gradients) for every option, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxdist as ed
from eqxdist._long.attention import fused_kernel

T, S, H, D = 16, 16, 4, 8


def _inputs(rng, kv_heads=H, length=S, dtype=jnp.float32):
    q = rng.normal(size=(T, H, D))
    k, v = rng.normal(size=(2, length, kv_heads, D))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _segments(rng, length):
    return jnp.asarray(np.sort(rng.integers(0, 3, length)), jnp.int32)


def _grads(fn, *args):
    """The value of `fn(*args)` and the gradients of a weighted sum of it with
    respect to every float argument."""
    weights = jnp.asarray(np.random.default_rng(9).normal(size=(T, H, D)), jnp.float32)

    def loss(*a):
        return jnp.sum(fn(*a) * weights)

    floats = tuple(
        i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)
    )
    return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=floats)(*a)))(*args)


def _assert_close(got, want, atol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5)


CASES = {
    "plain": {},
    "causal, scale": {"causal": True, "scale": 0.3},
    "grouped-query": {"kv_heads": 2, "causal": True},
    "multi-query, mask": {"kv_heads": 1, "mask": True},
    "bias (T, S)": {"bias": (T, S)},
    "everything": {"kv_heads": 2, "causal": True, "bias": (H, T, S), "mask": True},
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_attention_is_jax_nn_dot_product_attention(case, rng):
    options = dict(CASES[case])
    q, k, v = _inputs(rng, options.pop("kv_heads", H))
    extra = []
    bias_shape = options.pop("bias", None)
    if bias_shape is not None:
        extra.append(jnp.asarray(rng.normal(size=bias_shape), jnp.float32))
    use_mask = options.pop("mask", False)
    mask = (
        jnp.asarray(rng.random((T, S)) < 0.7).at[:, 0].set(True) if use_mask else None
    )

    def ours(q, k, v, *bias):
        return ed.attention(
            q, k, v, bias=bias[0] if bias else None, mask=mask, **options
        )

    def theirs(q, k, v, *bias):
        return jax.nn.dot_product_attention(
            q, k, v, bias[0] if bias else None, mask,
            scale=options.get("scale"), is_causal=options.get("causal", False),
        )  # fmt: skip

    _assert_close(_grads(ours, q, k, v, *extra), _grads(theirs, q, k, v, *extra))


@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids_are_a_mask_of_same_segments(causal, rng):
    q, k, v = _inputs(rng, kv_heads=2)
    seg = _segments(rng, T)
    same = seg[:, None] == seg[None, :]
    ours = _grads(lambda *a: ed.attention(*a, causal=causal, segment_ids=seg), q, k, v)
    theirs = _grads(
        lambda *a: jax.nn.dot_product_attention(*a, mask=same, is_causal=causal),
        q, k, v,
    )  # fmt: skip
    _assert_close(ours, theirs)


def test_a_pair_of_segment_ids_for_queries_and_keys(rng):
    q, k, v = _inputs(rng, length=24)
    q_seg, kv_seg = _segments(rng, T), _segments(rng, 24)
    kv_seg = kv_seg.at[:3].set(jnp.arange(3))  # every query segment has a key
    same = q_seg[:, None] == kv_seg[None, :]
    ours = _grads(lambda *a: ed.attention(*a, segment_ids=(q_seg, kv_seg)), q, k, v)
    theirs = _grads(lambda *a: jax.nn.dot_product_attention(*a, mask=same), q, k, v)
    _assert_close(ours, theirs)


def test_a_batch_is_vmapped(rng):
    q, k, v = (jnp.stack([x, 2 * x]) for x in _inputs(rng))
    out = jax.jit(jax.vmap(lambda *a: ed.attention(*a, causal=True)))(q, k, v)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    _assert_close(out, want)


def test_the_fused_kernel_is_chosen_only_where_cudnn_takes_the_inputs():
    # These devices are CPUs: never; the dtype and head-dimension rules hold
    # before the device is asked.
    assert not fused_kernel(jnp.bfloat16, 64)
    assert not fused_kernel(jnp.float32, 64)
    assert not fused_kernel(jnp.bfloat16, 12)
    assert not fused_kernel(jnp.float16, 256)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (
            lambda q, k, v: (q, k[..., :4], v[..., :4]),
            r"`q` has head dimension 8 .* `k` 4",
        ),
        (
            lambda q, k, v: (q, k[:, :3], v[:, :3]),
            r"3 heads, which does not divide `q`'s 4",
        ),
        (
            lambda q, k, v: (q, k, v[:8]),
            r"`v` has shape \(8, 4, 8\) and `k` \(16, 4, 8\)",
        ),
        (
            lambda q, k, v: (q, k, v.astype(jnp.bfloat16)),
            r"dtypes float32, float32 and bfloat16",
        ),
    ],
    ids=["head dims", "heads", "value shape", "dtypes"],
)
def test_mismatched_shapes_are_clear_errors(change, pattern, rng):
    with pytest.raises(ValueError, match=r"^attention: .*" + pattern):
        ed.attention(*change(*_inputs(rng)))


def test_bad_bias_mask_and_segments_are_clear_errors(rng):
    q, k, v = _inputs(rng)
    with pytest.raises(
        ValueError, match=r"`bias` has shape \(3, 16, 16\), which does not"
    ):
        ed.attention(q, k, v, bias=jnp.zeros((3, T, S)))
    with pytest.raises(ValueError, match=r"`mask` has shape \(16, 5\)"):
        ed.attention(q, k, v, mask=jnp.ones((T, 5), bool))
    with pytest.raises(
        ValueError, match=r"segment ids of the queries have shape \(15,\)"
    ):
        ed.attention(q, k, v, segment_ids=jnp.zeros(15, jnp.int32))
    q2, k2, v2 = _inputs(rng, length=24)
    with pytest.raises(
        ValueError, match=r"`q` has 16 positions and `k` 24; pass a pair"
    ):
        ed.attention(q2, k2, v2, segment_ids=jnp.zeros(T, jnp.int32))


def test_context_axis_errors_without_a_mesh_or_with_a_bias(rng):
    q, k, v = _inputs(rng)
    with pytest.raises(
        ValueError, match=r"'context' is neither bound .* no context mesh"
    ):
        ed.attention(q, k, v, causal=True, context_axis="context")
    mesh = ed.create_device_mesh({"data": 2, "seq": 4})
    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match=r"mesh axes \('data', 'seq'\)"),
    ):
        jax.jit(lambda q, k, v: ed.attention(q, k, v, context_axis="context"))(q, k, v)
    with pytest.raises(ValueError, match=r"`bias` cannot be given with `context_axis`"):
        ed.attention(q, k, v, bias=jnp.zeros((T, S)), context_axis="seq")


@pytest.mark.parametrize(("t", "s"), [(16, 32), (32, 16)])
def test_causal_attention_of_queries_and_keys_of_different_lengths(t, s):
    """JAX's `is_causal` where T != S: `jnp.tril` of (T, S), query t attending
    keys s <= t (no context axis; the ring's in test_ring.py)."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.normal(size=(t, H, D)), jnp.float32)
    k, v = jnp.asarray(rng.normal(size=(2, s, 2, D)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(t, H, D)), jnp.float32)

    def value_and_grads(attend):
        loss = lambda *a: jnp.sum(attend(*a) * weights)  # noqa: E731
        return jax.jit(lambda *a: (attend(*a), jax.grad(loss, (0, 1, 2))(*a)))(q, k, v)

    ours = value_and_grads(lambda *a: ed.attention(*a, causal=True))
    theirs = value_and_grads(
        lambda *a: jax.nn.dot_product_attention(*a, is_causal=True)
    )
    _assert_close(ours, theirs)


def _short(error):
    lines = str(error.value).splitlines()
    assert len(lines) <= 4, lines
    return str(error.value)


def test_a_batch_or_a_missing_heads_axis_says_so_briefly(rng):
    q, k, v = (x[None] for x in _inputs(rng))
    with pytest.raises(ValueError) as error:
        ed.attention(q, k, v, causal=True)
    message = _short(error)
    assert message.startswith("attention: `q` has shape (1, 16, 4, 8); expected ")
    assert "(T, H, D), one sequence (4 dimensions seen, 3 expected)" in message
    assert "jax.vmap(functools.partial(ed.attention" in message
    with pytest.raises(ValueError) as error:
        ed.attention(q[0], k[0, :, 0], v[0])
    message = _short(error)
    assert "`k` has shape (16, 8); expected (S, K_heads, D)" in message
    assert "heads axis" in message
    with pytest.raises(TypeError) as error:
        ed.attention(q[0].astype(jnp.int32), k[0], v[0])
    assert "`q` has dtype int32; expected a floating dtype" in _short(error)
    with pytest.raises(ValueError) as error:
        ed.attention(q[0], k[0], v[0], segment_ids=jnp.zeros((1, T), jnp.int32))
    assert "`segment_ids` has shape (1, 16) and dtype int32; expected" in (
        _short(error)
    )
