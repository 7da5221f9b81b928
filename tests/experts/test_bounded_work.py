"""The experts' work is the assignments routed, not every token's (issue 46):
the tile loop against a plain-JAX dense reference (values and gradients,
float32, 1e-5) on uneven groups; expert parallelism on 8 devices with both
dispatches in both views against one device under uneven routing (every token
to one expert, experts receiving none); and the work bound, each device's
tiles run (as the loop records them) at most `ceil(assigned / tile) +
local_experts`, the assignments it ran summing to the tokens' `T * k`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed
from eqxdist._experts.tiles import recording, tiled_ffn, tiled_ffn_grads
from eqxdist._layout.experts import with_expert_axis

D, H, T = 4, 6, 16
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _rng_array(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _dense_rows(x, gates, sizes, weights, activation):
    """Each row through its group's expert by a dense product over every
    expert, the rows past the groups zero."""
    w_in, w_gate, w_out = weights
    group = np.repeat(np.arange(len(sizes) + 1), [*sizes, x.shape[0] - sum(sizes)])
    hidden = activation(jnp.einsum("rd,edh->reh", x, w_in))
    if w_gate is not None:
        hidden = hidden * jnp.einsum("rd,edh->reh", x, w_gate)
    out = jnp.einsum("reh,ehd->red", hidden, w_out)
    pick = jax.nn.one_hot(group, len(sizes))  # rows past the groups: all zero
    return jnp.einsum("re,red->rd", pick, out) * gates[:, None]


@pytest.mark.parametrize(
    ("sizes", "rows"), [([3, 0, 7, 0, 1, 5], 16), ([0, 0, 20, 0], 20), ([0, 4, 2], 11)]
)
@pytest.mark.parametrize("tile", [1, 3, 4, 64])
@pytest.mark.parametrize("gated", [True, False])
def test_tile_loop_equals_dense(sizes, rows, tile, gated):
    e = len(sizes)
    x, gates, c = (
        _rng_array((rows, D), 0),
        _rng_array((rows,), 1),
        _rng_array((rows, D), 2),
    )
    weights = (_rng_array((e, D, H), 3), _rng_array((e, D, H), 4) if gated else None,
               _rng_array((e, H, D), 5))  # fmt: skip
    s = jnp.asarray(sizes, jnp.int32)
    act = jax.nn.silu
    src = jnp.arange(rows)  # row i is token i
    got = jax.jit(lambda *a: tiled_ffn(a[0], src, a[1], s, a[2], act, tile=tile))(
        x, gates, weights
    )
    np.testing.assert_allclose(got, _dense_rows(x, gates, sizes, weights, act), **TOL)
    grads = jax.jit(
        lambda *a: tiled_ffn_grads(a[0], src, a[1], s, a[2], act, c, tile=tile)
    )(x, gates, weights)
    want = jax.grad(
        lambda *a: jnp.sum(_dense_rows(*a[:2], sizes, a[2], act) * c), argnums=(0, 1, 2)
    )(x, gates, weights)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def _dense(moe, x):
    logits = x @ moe.router.weight.T
    p = jax.nn.softmax(logits, axis=-1)
    _, chosen = jax.lax.top_k(p, moe.top_k)
    mask = jax.nn.one_hot(chosen, moe.num_experts).sum(axis=1)
    gates = p * mask / jnp.sum(p * mask, axis=-1, keepdims=True)
    hidden = moe.activation(jnp.einsum("td,edh->teh", x, moe.w_in))
    hidden = hidden * jnp.einsum("td,edh->teh", x, moe.w_gate)
    out = jnp.einsum("teh,ehd->ted", hidden, moe.w_out)
    return jnp.einsum("te,ted->td", gates, out)


def _skewed(moe, skew):
    """`moe` with a router that sends every token (positive entries) to expert
    2 first and 0 second ("one"), or spreads them over experts 0-3 only, 4-7
    receiving none ("none")."""
    if skew == "one":
        rows = [[1.0] * D, [-1.0] * D, [3.0] * D] + [[-1.0] * D] * 5
    else:
        rows = [[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0], [0, 0, 0, 3.0]]
        rows += [[-3.0] * D] * 4
    return eqx.tree_at(lambda m: m.router.weight, moe, jnp.asarray(rows))


def _specs(moe):
    specs = jax.tree.map(lambda _: P(), eqx.filter(moe, eqx.is_array))
    return eqx.tree_at(lambda p: [p.w_in, p.w_gate, p.w_out], specs, [P("data")] * 3)


def _device_view(moe, x, c, mesh):
    """Value and gradients of `sum(y * c)` in the device view over "data"
    (tokens split), with the step's conventions (the experts' gradient the mean
    over the devices, the router's averaged here, the tokens' each device's)."""
    sharded = with_expert_axis(moe, "data")
    params, static = eqx.partition(sharded, eqx.is_array)
    specs = _specs(sharded)

    def device(params, x, c):
        loss = lambda p, x: jnp.sum(eqx.combine(p, static)(x)[0] * c)  # noqa: E731
        value, (g, gx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
        g = jax.tree.map(lambda g, s: g if s != P() else jax.lax.pmean(g, "data"),
                         g, specs)  # fmt: skip
        return jax.lax.pmean(value, "data"), g, gx

    split = P("data")
    mapped = jax.shard_map(device, mesh=mesh, in_specs=(specs, split, split),
                           out_specs=(P(), specs, split), check_vma=False)  # fmt: skip
    value, g, gx = jax.jit(mapped)(params, x, c)
    return value * 8, g, gx  # the sum of the devices' losses


def _global_view(moe, x, c, mesh):
    sharded = with_expert_axis(moe, "data")
    params, static = eqx.partition(sharded, eqx.is_array)
    specs = _specs(sharded)

    def loss(p, x):
        return jnp.sum(eqx.combine(p, static)(x)[0] * c)

    with jax.set_mesh(mesh):
        placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                              params, specs)  # fmt: skip
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        value, (g, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(placed, xs)
    # The experts' gradient in the device view is the mean over the devices.
    return value, jax.tree.map(lambda a: a / 8, g), gx


def _assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)


@pytest.mark.parametrize("skew", ["one", "none"])
@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("view", ["device", "global"])
def test_uneven_routing_equals_one_device(mesh8, skew, dispatch, view):
    moe = _skewed(ed.MoE(D, H, 8, top_k=2, key=jax.random.key(3), dispatch=dispatch),
                  skew)  # fmt: skip
    x = jnp.abs(_rng_array((T, D), 1)) + 0.1
    c = _rng_array((T, D), 7)
    run = _device_view if view == "device" else _global_view
    with recording() as records:
        value, g, gx = run(moe, x, c, mesh8)
    want, (want_g, want_gx) = jax.value_and_grad(
        lambda m, x: jnp.sum(_dense(m, x) * c), argnums=(0, 1)
    )(moe, x)
    np.testing.assert_allclose(value, want, **TOL)
    np.testing.assert_allclose(gx, want_gx, **TOL)
    # The device view's experts' gradient is the mean of the devices' losses'.
    want_g = jax.tree.map(lambda a: a / 8, eqx.filter(want_g, eqx.is_array))
    _assert_close(g, want_g)
    _assert_bounded(records, T * 2, local=1)


def _assert_bounded(records, assignments, local):
    """Every loop ran exactly the tiles of its groups, at most
    `ceil(assigned / tile) + local`; each pass's loops ran the `assignments`."""
    assert records
    for r in records:
        assigned = int(r["sizes"].sum())
        assert len(r["sizes"]) == local
        assert r["tiles"] == int(np.sum(-(-r["sizes"] // r["tile"]))), r
        assert r["tiles"] <= -(-assigned // r["tile"]) + local, r
    for kind in ("forward", "backward"):
        ran = [int(r["sizes"].sum()) for r in records if r["kind"] == kind]
        assert ran and sum(ran) % assignments == 0 and sum(ran) > 0, (kind, ran)


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_each_device_runs_only_its_assignments(mesh8, dispatch):
    """E = 16 (two per device), 512 tokens, top-2: each device's loops run its
    experts' assignments only, within a tile per expert of the ideal, and the
    devices' together run the 1024 assignments once per pass (the all-to-all
    dispatch in rounds: a loop per device per round)."""
    moe = ed.MoE(D, H, 16, top_k=2, key=jax.random.key(4), dispatch=dispatch)
    x, c = _rng_array((512, D), 2), _rng_array((512, D), 3)
    with recording() as records:
        jax.block_until_ready(_device_view(moe, x, c, mesh8))
    _assert_bounded(records, 512 * 2, local=2)
    for kind in ("forward", "backward"):
        ran = [r for r in records if r["kind"] == kind]
        assert len(ran) % 8 == 0 and sum(int(r["sizes"].sum()) for r in ran) == 1024
        if dispatch == "all_gather":
            # The buffer is the worst case (every assignment to one device)...
            assert all(r["rows"] >= 1024 for r in ran)
        else:
            # ... or a round's: the balanced share and a half per source.
            assert all(r["rows"] == 8 * 24 for r in ran)
        # ... the work the assignments: about an eighth of them each.
        assert max(r["tiles"] * r["tile"] for r in ran) < 1024 / 4


def _balanced(experts, tokens, dispatch):
    """An `experts`-expert top-2 layer (`d_model = experts`) and `tokens`
    tokens, token t routed to experts t and t + 1 (mod `experts`) by an
    identity router: every device's tokens spread evenly over the experts."""
    moe = ed.MoE(experts, 16, experts, top_k=2, key=jax.random.key(5),
                 dispatch=dispatch)  # fmt: skip
    moe = eqx.tree_at(lambda m: m.router.weight, moe, jnp.eye(experts))
    t = np.arange(tokens)
    x = np.zeros((tokens, experts), np.float32)
    x[t, t % experts], x[t, (t + 1) % experts] = 3.0, 2.0
    return moe, jnp.asarray(x)


@pytest.mark.parametrize("experts", [8, 32])
@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_balanced_work_per_device_is_its_share_of_the_assignments(
    mesh8, experts, dispatch
):
    """Expert parallelism at E = 8 and 32 under balanced routing (512 tokens,
    top-2, 8 devices): each device's expert products, forward and backward,
    are its share of the assignments, `T k / 8 = 128` rows, within 1.3x (the
    rows its tile loops ran: a loop's trip count is known only when it runs,
    and each iteration is one tile's products); the all-to-all dispatch in one
    round. Every device's values equal one device's."""
    moe, x = _balanced(experts, 512, dispatch)
    c = _rng_array(x.shape, 8)
    with recording() as records:
        value, g, gx = _device_view(moe, x, c, mesh8)
    share = 512 * 2 // 8
    for kind in ("forward", "backward"):
        ran = [r for r in records if r["kind"] == kind]
        assert len(ran) == 8, ran  # one loop per device (per round)
        for r in ran:
            assert int(r["sizes"].sum()) == share, r
            assert r["tiles"] * r["tile"] <= 1.3 * share, r
    want, (want_g, want_gx) = jax.value_and_grad(
        lambda m, x: jnp.sum(_dense(m, x) * c), argnums=(0, 1)
    )(moe, x)
    np.testing.assert_allclose(value, want, **TOL)
    np.testing.assert_allclose(gx, want_gx, **TOL)
    _assert_close(g, jax.tree.map(lambda a: a / 8, eqx.filter(want_g, eqx.is_array)))
