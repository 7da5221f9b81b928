"""`ed.MoE`'s router options (`normalize_gates`, `router_dtype`) and its expert
capacity (`capacity_factor`) against references in plain JAX and NumPy (float32,
1e-5): the gates, the router's gradient, the experts a bf16 input picks, the
assignments kept by choice rank then token order, the dropped fraction, expert
parallelism with a capacity on 8 simulated devices; and `step.cost`'s
`model_flops` of a step with an MoE against the hand count."""

import math
from fractions import Fraction

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
    LAYER_D,
    LAYER_H,
    LAYER_T,
    LAYER_TOL,
    MOE_D,
    MOE_E,
    MOE_H,
    MoENet,
    assert_trees_close,
    every_expert,
    layer_tokens,
    moe_loss,
    output_weights,
    router_probs,
)
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed
from eqxdist._experts.routing import Config, route
from eqxdist._jaxpr import counted_as, matmul_flops, sub_jaxprs
from eqxdist._layout.experts import with_expert_axis

D, H, T = LAYER_D, LAYER_H, LAYER_T
TOL = LAYER_TOL


def _reference(moe, x, *, normalize, keep=None):
    """Every token through every expert, combined with its top-k gates (`p`, or
    `p / sum(p)` over the top-k), the assignments `keep` (T, k) says are
    dropped given gate 0."""
    p = router_probs(moe, x)
    top, chosen = jax.lax.top_k(p, moe.top_k)
    gates = top / jnp.sum(top, axis=-1, keepdims=True) if normalize else top
    if keep is not None:
        gates = jnp.where(keep, gates, 0.0)
    per_expert = jnp.einsum(
        "tk,tke->te", gates, jax.nn.one_hot(chosen, moe.num_experts)
    )
    return jnp.einsum("te,ted->td", per_expert, every_expert(moe, x))


def _values_and_grads(moe, x, c, reference):
    """The layer's `sum(y * c)` and its gradients (weights and tokens), and the
    plain-JAX reference's."""
    got = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda mx: jnp.sum(mx[0](mx[1])[0] * c))
    )((moe, x))
    want = jax.value_and_grad(
        lambda m, x: jnp.sum(reference(m, x) * c), argnums=(0, 1)
    )(moe, x)
    return got, (want[0], (eqx.filter(want[1][0], eqx.is_inexact_array), want[1][1]))


def test_top1_gate_is_the_probability_and_trains_the_router():
    """top_k=1's default gate is the raw probability (Switch's): the router
    gets a task-loss gradient, equal to the reference's and far from zero (a
    gate of exactly 1, `p / sum(p)`, gives it none)."""
    moe = ed.MoE(D, H, 4, top_k=1, key=jax.random.key(0))
    assert moe.normalize_gates is False
    x, c = layer_tokens(), output_weights((T, D))
    y, _ = moe(x)
    np.testing.assert_allclose(y, _reference(moe, x, normalize=False), **TOL)
    got, want = _values_and_grads(
        moe, x, c, lambda m, x: _reference(m, x, normalize=False)
    )
    np.testing.assert_allclose(got[0], want[0], **TOL)
    assert_trees_close(got[1], want[1])
    assert np.abs(np.asarray(got[1][0].router.weight)).max() > 1e-2
    # Normalised, a top-1 gate is 1 and the router learns nothing from the task.
    one = ed.MoE(D, H, 4, top_k=1, key=jax.random.key(0), normalize_gates=True)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x)[0] * c))(one)
    assert np.abs(np.asarray(grads.router.weight)).max() < 1e-6


@pytest.mark.parametrize(("top_k", "normalize"), [(1, True), (2, False), (2, True)])
def test_normalize_gates_either_way(top_k, normalize):
    moe = ed.MoE(
        D, H, 4, top_k=top_k, key=jax.random.key(1), normalize_gates=normalize
    )  # fmt: skip
    assert moe.normalize_gates is normalize
    x, c = layer_tokens(), output_weights((T, D))
    got, want = _values_and_grads(
        moe, x, c, lambda m, x: _reference(m, x, normalize=normalize)
    )
    np.testing.assert_allclose(got[0], want[0], **TOL)
    assert_trees_close(got[1], want[1])


def _sets(experts):
    return [frozenset(row) for row in np.asarray(experts).tolist()]


def test_float32_routing_of_bf16_tokens_picks_the_float32_experts():
    """bf16 tokens and router (E 64, k 8): the default `router_dtype` picks, for
    every token, the experts float32 routing of the same values picks; routing
    in bf16 (`router_dtype=None`) picks other sets for some tokens."""
    tokens, e, k, d = 512, 64, 8, 64
    moe = ed.MoE(d, 32, e, top_k=k, key=jax.random.key(2))
    moe = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_array(a) else a, moe)
    x = layer_tokens(shape=(tokens, d)).astype(jnp.bfloat16)
    p = jax.nn.softmax(x.astype(jnp.float32) @ moe.router.weight.astype(jnp.float32).T)
    want = _sets(jax.lax.top_k(p, k)[1])
    config = Config(e, k, "softmax", jax.nn.silu, True, moe.router_dtype)
    routed = route(moe.router.weight, x, config)
    assert routed.probs.dtype == jnp.float32
    assert _sets(routed.routing.experts) == want
    counts = np.bincount(np.asarray(jax.lax.top_k(p, k)[1]).ravel(), minlength=e)
    np.testing.assert_array_equal(moe(x)[1]["tokens_per_expert"], counts)
    in_bf16 = route(moe.router.weight, x, config._replace(router_dtype=None))
    assert in_bf16.probs.dtype == jnp.bfloat16
    differ = np.mean(
        [a != b for a, b in zip(_sets(in_bf16.routing.experts), want, strict=True)]
    )
    assert differ > 0


def _kept_by_hand(chosen, num_experts, limit):
    """A loop over choice ranks, then tokens: an assignment is kept while its
    expert has taken fewer than `limit`."""
    taken = [0] * num_experts
    keep = np.zeros(chosen.shape, bool)
    for rank in range(chosen.shape[1]):
        for t in range(chosen.shape[0]):
            e = chosen[t, rank]
            keep[t, rank] = taken[e] < limit
            taken[e] += keep[t, rank]
    return keep


def _skewed(moe, seed=3):
    """Tokens most of which prefer expert 0: a capacity must drop some."""
    x = np.random.default_rng(seed).normal(size=(T, D))
    w = np.asarray(moe.router.weight[0])
    x = x + 2.0 * w / np.linalg.norm(w)
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_keeps_by_choice_rank_then_token_order(factor):
    e, k = 4, 2
    moe = ed.MoE(D, H, e, top_k=k, key=jax.random.key(3), capacity_factor=factor)
    x, c = _skewed(moe), output_weights((T, D))
    chosen = np.asarray(jax.lax.top_k(router_probs(moe, x), k)[1])
    limit = math.ceil(factor * T * k / e)
    keep = _kept_by_hand(chosen, e, limit)
    assert not keep.all()  # the routing is skewed enough to drop
    y, aux = moe(x)
    np.testing.assert_allclose(aux["dropped_fraction"], 1 - keep.mean(), **TOL)
    np.testing.assert_array_equal(
        aux["tokens_per_expert"], np.bincount(chosen.ravel(), minlength=e)
    )
    reference = lambda m, x: _reference(m, x, normalize=True, keep=keep)  # noqa: E731
    np.testing.assert_allclose(y, reference(moe, x), **TOL)
    got, want = _values_and_grads(moe, x, c, reference)
    np.testing.assert_allclose(got[0], want[0], **TOL)
    assert_trees_close(got[1], want[1])


def test_dropless_drops_nothing():
    moe = ed.MoE(D, H, 4, top_k=2, key=jax.random.key(3))
    _, aux = moe(_skewed(moe))
    assert float(aux["dropped_fraction"]) == 0.0


def _specs(moe, axis):
    params, _ = eqx.partition(moe, eqx.is_array)
    specs = jax.tree.map(lambda _: P(), params)
    names = [n for n in ("w_in", "w_gate", "w_out") if getattr(moe, n) is not None]
    return eqx.tree_at(
        lambda p: [getattr(p, n) for n in names], specs, [P(axis)] * len(names)
    )


@pytest.mark.parametrize(
    ("dispatch", "tokens"),
    [("all_gather", T), ("all_to_all", T), ("all_gather", 12), ("all_to_all", 12)],
)
def test_capacity_under_expert_parallelism_in_the_global_view(
    axis_types, dispatch, tokens
):
    """8 devices, experts and tokens over "data": the call's T is all of its
    tokens, so the layer keeps what one device keeps (values, gradients, the
    dropped fraction); 12 tokens are padded to 16 for the split, the padding
    taking no expert's capacity."""
    kind = getattr(jax.sharding.AxisType, axis_types.capitalize())
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    moe = ed.MoE(
        D, H, 8, top_k=2, key=jax.random.key(8), dispatch=dispatch,
        capacity_factor=0.75,
    )  # fmt: skip
    sharded = with_expert_axis(moe, "data")
    params, static = eqx.partition(sharded, eqx.is_array)
    x = _skewed(moe)[:tokens]
    c = output_weights(x.shape)
    spec = P("data") if tokens % 8 == 0 else P()

    def both(params, x):
        def loss(p, x):
            y, aux = eqx.combine(p, static)(x)
            return jnp.sum(y * c), aux["dropped_fraction"]

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    with jax.set_mesh(mesh):
        placed = jax.tree.map(
            lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
            params, _specs(sharded, "data"),
        )  # fmt: skip
        (value, dropped), grads = jax.jit(both)(
            placed, jax.device_put(x, NamedSharding(mesh, spec))
        )
    (want, want_dropped), want_grads = eqx.filter_jit(
        eqx.filter_value_and_grad(
            lambda mx: (lambda y, a: (jnp.sum(y * c), a["dropped_fraction"]))(
                *mx[0](mx[1])
            ),
            has_aux=True,
        )
    )((moe, x))
    assert float(want_dropped) > 0
    np.testing.assert_allclose(value, want, **TOL)
    np.testing.assert_allclose(dropped, want_dropped, **TOL)
    assert_trees_close(grads, want_grads)


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_capacity_in_the_device_view_counts_the_devices_own_tokens(mesh8, dispatch):
    """In the device view a call's tokens are the device's own: each device's
    outputs equal the one-device layer on its 2 tokens alone, whatever the
    dispatch gathers or sends."""
    moe = ed.MoE(
        D, H, 8, top_k=2, key=jax.random.key(9), dispatch=dispatch,
        capacity_factor=1.0,
    )  # fmt: skip
    sharded = with_expert_axis(moe, "data")
    params, static = eqx.partition(sharded, eqx.is_array)
    x = _skewed(moe)

    def device(params, x):
        y, aux = eqx.combine(params, static)(x)
        return y, aux["dropped_fraction"][None]

    mapped = jax.shard_map(
        device, mesh=mesh8, in_specs=(_specs(sharded, "data"), P("data")),
        out_specs=(P("data"), P("data")), check_vma=False,
    )  # fmt: skip
    y, dropped = jax.jit(mapped)(params, x)
    for i, part in enumerate(jnp.split(x, 8)):
        want, aux = moe(part)
        np.testing.assert_allclose(y[2 * i : 2 * i + 2], want, **TOL)
        np.testing.assert_allclose(dropped[i], aux["dropped_fraction"], **TOL)


def _exchanged_rows(jaxpr):
    """The shapes of what each `all_to_all` of `jaxpr` sends, nested programs
    included."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "all_to_all":
            shapes.append(tuple(eqn.invars[0].aval.shape))
        for value in eqn.params.values():
            for sub in sub_jaxprs(value):
                shapes.extend(_exchanged_rows(sub))
    return shapes


@pytest.mark.parametrize(
    ("factor", "width"),
    # 8 devices, 8 tokens each, top-2 of 8 experts (one per device): dropless,
    # a round sends each destination the balanced share and a half,
    # ceil(1.5 * 16 / 8) = 3 rows (more rounds if a destination gets more);
    # a capacity of C = ceil(factor * 8 * 2 / 8) per expert, at most C rows.
    [(None, 3), (1.0, 2), (2.0, 3), (100.0, 3)],
)
def test_all_to_all_buffers_are_bounded_by_the_capacity(mesh8, factor, width):
    """The all-to-all dispatch sends each destination rounds of the balanced
    share and a half, and under a capacity no more than what the capacity
    lets a device send it (`local * C` rows, at most the device's `T * k`),
    never the dropless worst case, both ways (the rows out with their gates as
    a column, the outputs back);
    the values are the one-device layer's on each device's tokens (as the test
    above, with this shape), the skewed routing taking several rounds."""
    moe = ed.MoE(
        D, H, 8, top_k=2, key=jax.random.key(9), dispatch="all_to_all",
        capacity_factor=factor,
    )  # fmt: skip
    sharded = with_expert_axis(moe, "data")
    params, static = eqx.partition(sharded, eqx.is_array)
    x = jnp.concatenate([_skewed(moe)] * 4)  # 64 tokens, 8 per device
    mapped = jax.shard_map(
        lambda p, x: eqx.combine(p, static)(x)[0], mesh=mesh8,
        in_specs=(_specs(sharded, "data"), P("data")), out_specs=P("data"),
        check_vma=False,
    )  # fmt: skip
    sent = _exchanged_rows(jax.make_jaxpr(mapped)(params, x).jaxpr)
    assert sent == [(8 * width, D + 1), (8 * width, D)], sent
    y = jax.jit(mapped)(params, x)
    for i, part in enumerate(jnp.split(x, 8)):
        np.testing.assert_allclose(y[8 * i : 8 * i + 8], moe(part)[0], **TOL)


def _moe_step_flops(rows, k=2, gated=True):
    """`MoENet`'s training step by hand: per row, the embedding (6 -> D: forward
    and its weight's gradient, the data not differentiated), the router and the
    head (forward, weight and input gradients), and the experts: 2 * D * H per
    product (w_in, w_gate, w_out) per assignment routed, times 3 (forward, and
    the inputs' and the weights' gradients)."""
    products = 3 if gated else 2
    experts = 3 * 2 * MOE_D * MOE_H * products * rows * k
    return rows * (4 * 6 * MOE_D + 6 * MOE_D * MOE_E + 6 * MOE_D * 4) + experts


@pytest.mark.parametrize(
    ("where", "options"),
    [
        ({}, {}),
        ({"expert_axis": "data"}, {}),
        ({"expert_axis": "data"}, {"view": "global"}),
    ],
    ids=["replicated", "expert-parallel", "expert-parallel-global"],
)
def test_model_flops_count_the_routed_assignments(where, options):
    layout = ed.Layout(ed.create_device_mesh({"data": 8}), **where)
    optimizer = optax.sgd(0.1)
    step = ed.make_train_step(moe_loss, optimizer, layout, **options)
    state = eqx.filter_eval_shape(
        ed.TrainState.create, MoENet(jax.random.key(0)), optimizer, jax.random.key(1)
    )
    rows = 64
    batch = {"x": jnp.ones((rows, 6)), "y": jnp.zeros((rows,), jnp.int32)}
    assert step.cost(state, batch)["model_flops"] == _moe_step_flops(rows)


def test_model_flops_of_the_all_to_all_dispatch_and_a_capacity():
    """The same count whichever way the tokens travel, and with a capacity (the
    assignments routed, an upper bound of those kept)."""
    layout = ed.Layout(ed.create_device_mesh({"data": 8}), expert_axis="data")
    optimizer = optax.sgd(0.1)
    model = MoENet(jax.random.key(0))
    moe = ed.MoE(
        MOE_D, MOE_H, MOE_E, top_k=2, key=jax.random.key(2),
        dispatch="all_to_all", capacity_factor=0.5,
    )  # fmt: skip
    model = eqx.tree_at(lambda m: m.moe, model, moe)
    step = ed.make_train_step(moe_loss, optimizer, layout)
    state = eqx.filter_eval_shape(
        ed.TrainState.create, model, optimizer, jax.random.key(1)
    )
    batch = {"x": jnp.ones((64, 6)), "y": jnp.zeros((64,), jnp.int32)}
    assert step.cost(state, batch)["model_flops"] == _moe_step_flops(64)


def test_a_marked_program_counts_as_marked(mesh8):
    """`jax.lax.ragged_dot` has no `dot_general` (it counted zero); marked with
    `counted_as` it counts as marked, and a device's fraction of a count inside
    a `shard_map` adds up over the devices."""
    x, w = jnp.ones((8, 4)), jnp.ones((2, 4, 3))
    sizes = jnp.asarray([5, 3], jnp.int32)

    def grouped(x):
        return jax.lax.ragged_dot(x, w, sizes)

    assert matmul_flops(jax.make_jaxpr(grouped)(x)) == 0
    marked = counted_as(grouped, 2 * 8 * 4 * 3)
    assert matmul_flops(jax.make_jaxpr(marked)(x)) == 192
    shares = jax.shard_map(
        lambda v: counted_as(lambda v: v * 2, Fraction(3, 8))(v),
        mesh=mesh8, in_specs=P("data"), out_specs=P("data"),
    )  # fmt: skip
    assert matmul_flops(jax.make_jaxpr(shares)(jnp.ones(8))) == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (dict(capacity_factor=0), ValueError, "capacity_factor=1.25"),
        (dict(capacity_factor=-1.0), ValueError, "positive finite"),
        (dict(capacity_factor=float("inf")), ValueError, "positive finite"),
        (dict(capacity_factor=True), TypeError, "capacity_factor"),
        (dict(capacity_factor="1.25"), TypeError, "float or None"),
        (dict(router_dtype=jnp.int32), TypeError, "router_dtype=jnp.float32"),
        (dict(router_dtype="nonsense"), TypeError, "not a floating dtype"),
        (dict(normalize_gates=1), TypeError, "normalize_gates=None"),
    ],
)
def test_bad_router_options_say_what_to_change(kwargs, error, words):
    with pytest.raises(error, match="MoE") as info:
        ed.MoE(D, H, 4, key=jax.random.key(0), **kwargs)
    assert words in str(info.value)
