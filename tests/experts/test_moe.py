"""`ed.MoE` against a dense reference in plain JAX (every token through every
expert, the gates masked to the top-k; values and gradients, float32, 1e-5), its
aux values against hand computations, and its expert-parallel computation on 8
simulated devices (device view with the tokens split or replicated over the
expert axis, global view) against the same layer on one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    LAYER_D,
    LAYER_H,
    LAYER_T,
    LAYER_TOL,
    assert_trees_close,
    every_expert,
    layer_tokens,
    output_weights,
    router_probs,
)
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed
from eqxdist._experts import EXPERT_LEAVES
from eqxdist._layout.experts import ExpertParallel, with_expert_axis

D, H, T = LAYER_D, LAYER_H, LAYER_T
TOL = LAYER_TOL


def _dense(moe, x):
    """Every token through every expert, combined with the top-k gates."""
    p = router_probs(moe, x)
    _, chosen = jax.lax.top_k(p, moe.top_k)
    mask = jax.nn.one_hot(chosen, moe.num_experts).sum(axis=1)
    gates = p * mask
    if moe.normalize_gates:  # the default for top_k > 1; top-1 keeps p
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return jnp.einsum("te,ted->td", gates, every_expert(moe, x))


def _check_against_dense(moe, x):
    c = output_weights(x.shape)
    y, _ = eqx.filter_jit(lambda m, x: m(x))(moe, x)
    np.testing.assert_allclose(y, _dense(moe, x), **TOL)
    grad = eqx.filter_jit(eqx.filter_grad(lambda mx: jnp.sum(mx[0](mx[1])[0] * c)))
    grads = grad((moe, x))
    want = jax.grad(lambda m, x: jnp.sum(_dense(m, x) * c), argnums=(0, 1))(moe, x)
    want = (eqx.filter(want[0], eqx.is_inexact_array), want[1])
    assert_trees_close(grads, want)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "gated", "router"),
    [
        (4, 1, True, "softmax"),
        (8, 2, True, "softmax"),
        (8, 2, False, "softmax"),
        (6, 3, True, "sigmoid"),
        (4, 4, False, "sigmoid"),
    ],
)
def test_moe_equals_the_dense_reference(num_experts, top_k, gated, router):
    key = jax.random.key(num_experts + top_k)
    moe = ed.MoE(D, H, num_experts, top_k=top_k, key=key, gated=gated, router=router)
    assert (moe.w_gate is None) is not gated
    assert moe.w_in.shape == (num_experts, D, H)
    assert moe.w_out.shape == (num_experts, H, D)
    _check_against_dense(moe, layer_tokens())


@pytest.mark.parametrize("top_k", [1, 2])
def test_every_token_to_one_expert_is_dropless(top_k):
    """Every token picks expert 2 (then 0): all of them go through it, none
    dropped, and the gradients match the dense reference."""
    moe = ed.MoE(D, H, 4, top_k=top_k, key=jax.random.key(0))
    rows = jnp.asarray([[1.0] * D, [-1.0] * D, [3.0] * D, [-1.0] * D])
    moe = eqx.tree_at(lambda m: m.router.weight, moe, rows)
    x = jnp.abs(layer_tokens()) + 0.1
    _, aux = moe(x)
    want = [T, 0, T, 0] if top_k == 2 else [0, 0, T, 0]
    np.testing.assert_array_equal(aux["tokens_per_expert"], want)
    _check_against_dense(moe, x)


def test_under_vmap_per_sequence():
    moe = ed.MoE(D, H, 4, top_k=2, key=jax.random.key(3))
    x = layer_tokens(shape=(3, 8, D))
    c = output_weights(x.shape)
    y, aux = jax.vmap(moe)(x)
    np.testing.assert_allclose(y, jax.vmap(lambda s: _dense(moe, s))(x), **TOL)
    for i in range(3):  # aux per sequence
        one = moe(x[i])[1]
        for name in one:
            np.testing.assert_allclose(aux[name][i], one[name], **TOL)
    grads = jax.grad(lambda m: jnp.sum(jax.vmap(m)(x)[0] * c))(moe)
    want = jax.grad(lambda m: jnp.sum(jax.vmap(lambda s: _dense(m, s))(x) * c))(moe)
    assert_trees_close(grads, want)
    per_sequence = jax.vmap(
        jax.grad(lambda m, s, w: jnp.sum(m(s)[0] * w)), in_axes=(None, 0, 0)
    )(moe, x, c)
    assert_trees_close(jax.tree.map(lambda g: g.sum(0), per_sequence), grads)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_aux_values_by_hand(router):
    moe = ed.MoE(D, H, 4, top_k=2, key=jax.random.key(4), router=router)
    x = layer_tokens()
    _, aux = moe(x)
    logits = np.asarray(x, np.float64) @ np.asarray(moe.router.weight, np.float64).T
    if router == "softmax":
        p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    else:
        p = 1 / (1 + np.exp(-logits))
    chosen = np.argsort(-p, axis=1)[:, :2]
    counts = np.array([(chosen == e).sum() for e in range(4)])
    balance = 4 * np.sum(counts / chosen.size * p.mean(0))
    z = np.log(np.exp(logits).sum(1))
    np.testing.assert_array_equal(aux["tokens_per_expert"], counts)
    assert aux["tokens_per_expert"].dtype == jnp.int32
    np.testing.assert_allclose(aux["load_balance_loss"], balance, **TOL)
    np.testing.assert_allclose(aux["router_z_loss"], np.mean(z**2), **TOL)
    grad = jax.grad(lambda m: m(x)[1]["load_balance_loss"])(moe)
    assert np.abs(np.asarray(grad.router.weight)).max() > 0  # through P_e


def _specs(moe, axis):
    params, _ = eqx.partition(moe, eqx.is_array)
    specs = jax.tree.map(lambda _: P(), params)
    leaves = [n for n in EXPERT_LEAVES if getattr(moe, n) is not None]
    return eqx.tree_at(
        lambda p: [getattr(p, n) for n in leaves], specs, [P(axis)] * len(leaves)
    )


def _device_grads(moe, x, c, mesh, data_axes, check_vma=False):
    """Per-device `sum(y * c)` and its gradients, differentiated on each device
    inside `shard_map(check_vma=False)` as the step does; the gradients of the
    leaves not sharded over the data axis averaged over it, as the step does."""
    params, static = eqx.partition(moe, eqx.is_array)
    specs = _specs(moe, moe.axis)

    def device(params, x, c):
        def loss(params, x):
            return jnp.sum(eqx.combine(params, static)(x)[0] * c)

        value, (g, gx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
        # Under `check_vma` JAX already sums a replicated leaf's gradient over
        # the devices; the step's mean is then a division.
        size = jax.lax.axis_size(data_axes)
        mean = (
            (lambda g: g / size)
            if check_vma
            else (lambda g: jax.lax.pmean(g, data_axes))
        )
        g = jax.tree.map(lambda g, s: g if data_axes in s else mean(g), g, specs)
        return jax.lax.pmean(value, data_axes), g, gx

    spec_x = P(data_axes)
    mapped = jax.shard_map(
        device, mesh=mesh, in_specs=(specs, spec_x, spec_x),
        out_specs=(P(), specs, spec_x), check_vma=check_vma,
    )  # fmt: skip
    return jax.jit(mapped)(params, x, c)


def _reference_grads(moe, x, c, shards):
    """The mean over the `shards` data shards of each one's `sum(y * c)`, on one
    device, and its gradients."""

    def loss(moe, x):
        pieces = zip(jnp.split(x, shards), jnp.split(c, shards), strict=True)
        return sum(jnp.sum(_dense(moe, a) * w) for a, w in pieces) / shards

    return jax.value_and_grad(loss, argnums=(0, 1))(moe, x)


def _assert_split_device_view_is_one_device(moe, x, mesh8):
    """`moe` with its experts over "data" and the tokens `x` split over it,
    inside `shard_map`: its value and gradients (weights, tokens) equal one
    device's. Returns the reference's weight gradients."""
    c = output_weights((T, D))
    value, grads, gx = _device_grads(with_expert_axis(moe, "data"), x, c, mesh8, "data")
    want, (want_g, want_gx) = _reference_grads(moe, x, c, 8)
    np.testing.assert_allclose(value, want, **TOL)
    assert_trees_close(
        eqx.filter(grads, eqx.is_array), eqx.filter(want_g, eqx.is_array)
    )
    # A device's tokens' gradient is its part of the sum of the devices' losses'
    # (upstream replicated leaves are averaged over the data devices after).
    np.testing.assert_allclose(gx / 8, want_gx, **TOL)
    return want_g


@pytest.mark.parametrize(
    ("num_experts", "gated", "dispatch"),
    [(8, True, "all_gather"), (16, False, "all_gather"), (16, True, "all_to_all")],
)
def test_device_view_tokens_split_over_the_expert_axis(
    mesh8, num_experts, gated, dispatch
):
    moe = ed.MoE(
        D, H, num_experts, top_k=2, key=jax.random.key(5), gated=gated,
        dispatch=dispatch,
    )  # fmt: skip
    _assert_split_device_view_is_one_device(moe, layer_tokens(), mesh8)


def test_device_view_under_vmap_over_rows(mesh8):
    """A step's loss maps the layer over the device's rows: values and the
    gradients (the step's conventions) equal one device's."""
    moe = ed.MoE(D, H, 8, top_k=2, key=jax.random.key(10))
    sharded = with_expert_axis(moe, "data")
    params, static = eqx.partition(sharded, eqx.is_array)
    specs = _specs(sharded, "data")
    x = layer_tokens(shape=(16, 3, D))

    def loss(params, x):
        return jnp.sum(jax.vmap(eqx.combine(params, static))(x)[0] ** 2)

    def device(params, x):
        g = jax.grad(loss)(params, x)
        mean = lambda g, s: g if s != P() else jax.lax.pmean(g, "data")  # noqa: E731
        return jax.lax.pmean(loss(params, x), "data"), jax.tree.map(mean, g, specs)

    mapped = jax.shard_map(
        device, mesh=mesh8, in_specs=(specs, P("data")), out_specs=(P(), specs),
        check_vma=False,
    )  # fmt: skip
    value, grads = jax.jit(mapped)(params, x)

    def reference(moe):
        rows = jnp.split(x, 8)
        return (
            sum(jnp.sum(jax.vmap(lambda s: _dense(moe, s))(r) ** 2) for r in rows) / 8
        )

    want, want_g = jax.value_and_grad(reference)(moe)
    np.testing.assert_allclose(value, want, **TOL)
    assert_trees_close(grads, eqx.filter(want_g, eqx.is_array))


@pytest.mark.parametrize("check_vma", [False, True])
def test_device_view_tokens_replicated_over_the_expert_axis(check_vma):
    """An expert axis of its own: tokens split over "data" only, the same on the
    4 devices of "expert" (Megatron's f/g around the experts; with `check_vma`,
    JAX's own typing of the replicated values)."""
    mesh = jax.make_mesh(
        (2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    moe = ed.MoE(D, H, 8, top_k=2, key=jax.random.key(6))
    x, c = layer_tokens(), output_weights((T, D))
    sharded = with_expert_axis(moe, "expert", tokens_split=False)
    value, grads, gx = _device_grads(sharded, x, c, mesh, "data", check_vma)
    want, (want_g, want_gx) = _reference_grads(moe, x, c, 2)
    np.testing.assert_allclose(value, want, **TOL)
    assert_trees_close(
        eqx.filter(grads, eqx.is_array), eqx.filter(want_g, eqx.is_array)
    )
    np.testing.assert_allclose(gx / 2, want_gx, **TOL)


def _placed(tree, mesh, specs):
    return jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs
    )


@pytest.mark.parametrize(
    ("batched", "dispatch", "tokens"),
    [
        (False, "all_gather", T),
        (True, "all_gather", T),
        (True, "all_to_all", T),
        (True, "all_gather", 3),
    ],
    ids=["tokens", "vmap", "vmap-a2a", "vmap-uneven"],
)
def test_global_view_equals_one_device(axis_types, batched, dispatch, tokens):
    """Whole arrays under `jax.set_mesh`: the layer shards itself over "data"
    (tokens and experts), on Auto and Explicit meshes, under `jax.vmap` too,
    with either dispatch; sequences of a few tokens each (3, on 8 devices) are
    padded for the split, their values and gradients unchanged."""
    kind = getattr(jax.sharding.AxisType, axis_types.capitalize())
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    moe = ed.MoE(D, H, 8, top_k=2, key=jax.random.key(8), dispatch=dispatch)
    sharded = with_expert_axis(moe, "data")
    params, static = eqx.partition(sharded, eqx.is_array)
    shape, x_spec = ((2, T, D), P(None, "data")) if batched else ((T, D), P("data"))
    if tokens != T:
        shape, x_spec = (2, tokens, D), P()
    x, c = layer_tokens(shape=shape), output_weights(shape)

    def apply(params, x):
        layer = eqx.combine(params, static)
        return (jax.vmap(layer) if batched else layer)(x)[0]

    def both(params, x):
        grads = jax.grad(lambda p, x: jnp.sum(apply(p, x) * c), argnums=(0, 1))
        return apply(params, x), grads(params, x)

    def dense(moe, x):
        return jax.vmap(lambda s: _dense(moe, s))(x) if batched else _dense(moe, x)

    with jax.set_mesh(mesh):
        placed = _placed(params, mesh, _specs(sharded, "data"))
        y, grads = jax.jit(both)(placed, jax.device_put(x, NamedSharding(mesh, x_spec)))
    want = jax.grad(lambda m, x: jnp.sum(dense(m, x) * c), argnums=(0, 1))(moe, x)
    np.testing.assert_allclose(np.asarray(y), dense(moe, x), **TOL)
    assert_trees_close(grads, (eqx.filter(want[0], eqx.is_array), want[1]))
    assert grads[0].w_in.sharding.spec[0] == "data"


def _hlo_collectives(text):
    """`(kind, shape)` of every collective of the optimised HLO text."""
    import re

    found = re.findall(
        r"= (\w+\[[\d,]*\])\S* (all-gather|reduce-scatter|all-to-all|all-reduce)"
        r"(?:-start)?\(",
        text,
    )
    return [(kind, shape) for shape, kind in found]


def _dispatch_collectives(mesh8, dispatch):
    """`(is_forward, counts)` of the compiled device view of a 16-expert MoE over
    "data" with `dispatch`, forward and gradient, after checking that no
    collective of either moves an expert weight (or a block of one)."""
    moe = ed.MoE(8, 16, 16, top_k=2, key=jax.random.key(9), dispatch=dispatch)
    moe = with_expert_axis(moe, "data")
    params, static = eqx.partition(moe, eqx.is_array)
    specs = _specs(moe, "data")

    def forward(params, x):
        return eqx.combine(params, static)(x)[0]

    def gradient(params, x):
        return jax.grad(lambda p: jnp.sum(forward(p, x) ** 2))(params)

    x = layer_tokens(shape=(64, 8))
    for fn, out in ((forward, P("data")), (gradient, specs)):
        mapped = jax.shard_map(
            fn, mesh=mesh8, in_specs=(specs, P("data")), out_specs=out,
            check_vma=False,
        )  # fmt: skip
        compiled = jax.jit(mapped).lower(params, x).compile()
        shapes = {s for _, s in _hlo_collectives(compiled.as_text())}
        weights = {f"f32[{a},{b},{c}]" for a in (2, 16) for b, c in ((8, 16), (16, 8))}
        assert not shapes & weights, shapes
        yield fn is forward, ed.count_collectives(compiled)


def test_the_dispatch_communicates_tokens_never_weights(mesh8):
    """The device view's forward: one all-gather (the tokens, with their
    experts' ids and their gates as columns: each device routes its own tokens,
    once), one reduce-scatter of the outputs; forward and backward: no
    collective moves an expert weight (or a block of one)."""
    for is_forward, counts in _dispatch_collectives(mesh8, "all_gather"):
        assert counts["all-to-all"] == 0
        if is_forward:
            assert counts["all-gather"] == 1 and counts["reduce-scatter"] == 1, counts
            assert counts["all-reduce"] == 0, counts


@pytest.mark.parametrize("top_k", [1, 2])
def test_all_to_all_every_token_to_one_expert_is_dropless(mesh8, top_k):
    """`dispatch="all_to_all"`, every device's tokens all routed to expert 2
    (then 0), both on device 1: its buffers full, the others' empty; nothing is
    dropped, and values and gradients equal one device's."""
    moe = ed.MoE(D, H, 8, top_k=top_k, key=jax.random.key(0), dispatch="all_to_all")
    rows = jnp.asarray([[1.0] * D, [-1.0] * D, [3.0] * D] + [[-1.0] * D] * 5)
    moe = eqx.tree_at(lambda m: m.router.weight, moe, rows)
    want_g = _assert_split_device_view_is_one_device(
        moe, jnp.abs(layer_tokens()) + 0.1, mesh8
    )
    assert np.abs(np.asarray(want_g.w_in[2])).max() > 0  # expert 2 did train


def test_all_to_all_dispatch_is_two_all_to_alls(mesh8):
    """The forward of one call: one all-gather of the counts (`n x E`
    integers), then, in rounds, two all-to-alls (the assignments out with
    their gates, the outputs back), no reduce-scatter or all-reduce. The
    gradient program runs the forward and the gradient's rounds: the
    cotangents out, the tokens' and gates' cotangents back, and the
    assignments out again past the first round (whose rows it kept): five,
    with no counts gathered again. No collective moves an expert weight,
    forward or backward."""
    for is_forward, counts in _dispatch_collectives(mesh8, "all_to_all"):
        assert counts["reduce-scatter"] == 0 and counts["all-reduce"] == 0, counts
        assert counts["all-gather"] == 1, counts
        assert counts["all-to-all"] == (2 if is_forward else 5), counts


def test_with_expert_axis_makes_every_moe_expert_parallel_sharing_the_leaves():
    """The layout's subclass holds the axis; the layer itself carries none. It
    is still an `ed.MoE` (a loss asking `isinstance` sees what it saw
    unsharded), its leaves the same objects in the same order. Setting the
    axis again replaces it, never nests."""
    moes = {"a": ed.MoE(D, H, 4, key=jax.random.key(0)), "b": [1.0]}
    moes["c"] = [ed.MoE(D, H, 4, key=jax.random.key(1))]
    out = with_expert_axis(moes, "expert", tokens_split=False)
    for old, new in ((moes["a"], out["a"]), (moes["c"][0], out["c"][0])):
        assert type(new) is ExpertParallel and isinstance(new, ed.MoE)
        assert (new.axis, new.tokens_split, new.whole_loss) == ("expert", False, False)
        assert new.w_in is old.w_in and new.router is old.router
    assert jax.tree.leaves(out) == jax.tree.leaves(moes)
    again = with_expert_axis(out, "data")
    assert type(again["a"]) is ExpertParallel and again["a"].axis == "data"
    assert again["a"].w_out is moes["a"].w_out
    assert with_expert_axis(moes, None) is moes


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"top_k": 0}, ["top_k", "[1, num_experts=4]", "in 1..4."]),
        ({"top_k": 5}, ["top_k", "in 1..4 (or more experts)"]),
        ({"router": "relu"}, ["router", "softmax"]),
        ({"dispatch": "ring"}, ["dispatch", "'ring'", "all_gather", "all_to_all"]),
    ],
)
def test_bad_arguments_say_what_to_change(kwargs, words):
    with pytest.raises(ValueError) as error:
        ed.MoE(D, H, 4, key=jax.random.key(0), **kwargs)
    for word in ["MoE", *words]:
        assert word in str(error.value)


def test_a_size_that_is_not_an_int_is_a_type_error():
    with pytest.raises(TypeError, match="MoE: `num_experts` must be an int; got float"):
        ed.MoE(D, H, 4.0, key=jax.random.key(0))


def test_bad_tokens_and_axes_say_what_to_change(mesh8):
    moe = ed.MoE(D, H, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"MoE: `x` has shape \(2, 16, 4\).*vmap"):
        moe(layer_tokens(shape=(2, T, D)))
    with pytest.raises(ValueError, match="MoE: `expert_axis`='expert'.*neither"):
        with_expert_axis(moe, "expert")(layer_tokens())
    with jax.set_mesh(mesh8), pytest.raises(ValueError, match="not divisible by the 8"):
        with_expert_axis(moe, "data")(layer_tokens())  # 4 experts, 8 devices
    moe8 = with_expert_axis(ed.MoE(D, H, 8, key=jax.random.key(0)), "data")
    params, static = eqx.partition(moe8, eqx.is_array)
    whole = jax.tree.map(lambda _: P(), params)  # the experts not sharded
    mapped = jax.shard_map(
        lambda p, x: eqx.combine(p, static)(x)[0], mesh=mesh8,
        in_specs=(whole, P("data")), out_specs=P("data"), check_vma=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="leaf `w_in` has shape \\(8, 4, 6\\)"):
        mapped(params, layer_tokens())


def test_route_is_the_first_half_of_a_call():
    """`MoE.route`: each token's top-k experts by the router's probabilities and
    their normalised gates, computed here in plain JAX, and the same aux values
    as the whole call; a batch of tokens is refused as the call refuses it."""
    moe = ed.MoE(D, H, 8, top_k=2, key=jax.random.key(4))
    x = layer_tokens()
    routing, aux = moe.route(x)
    p = router_probs(moe, x)
    top_p, top_ids = jax.lax.top_k(p, 2)
    np.testing.assert_array_equal(routing.experts, top_ids)
    np.testing.assert_allclose(
        routing.gates, top_p / top_p.sum(1, keepdims=True), **TOL
    )
    _, call_aux = moe(x)
    for name in ("load_balance_loss", "router_z_loss", "tokens_per_expert"):
        np.testing.assert_allclose(aux[name], call_aux[name], **TOL)
    with pytest.raises(ValueError, match=r"MoE: `x` has shape \(2, 16, 4\).*vmap"):
        moe.route(layer_tokens(shape=(2, T, D)))
