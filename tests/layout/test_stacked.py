"""FSDPSequential (prefetching FSDP blocks) and Stacked (scan over layers): the
trained parameters equal single-device training, the compiled HLO gathers one block
ahead, and compile time does not grow with depth."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import over_data
from jax.sharding import PartitionSpec as P
from reference import train_one_device

import eqxdist as ed
from eqxdist._layout.flags import CPU_FSDP_OPTIONS

WIDTH = 16


class Block(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, size_in, size_out, key):
        self.linear = eqx.nn.Linear(size_in, size_out, key=key)

    def __call__(self, x):
        return jnp.tanh(jax.vmap(self.linear)(x))


class Chain(eqx.Module):
    blocks: tuple

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Model(eqx.Module):
    body: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.head)(self.body(x))


def _blocks(n, key=0):
    return [Block(WIDTH, WIDTH, k) for k in jax.random.split(jax.random.key(key), n)]


def _head():
    return eqx.nn.Linear(WIDTH, 1, key=jax.random.key(99))


def _loss_fn(model, batch, key):
    x, y = batch
    loss = jnp.mean((model(x) - y) ** 2)
    return loss, {"loss": (loss * x.shape[0], x.shape[0])}


def _batch(rng):
    x = jnp.asarray(rng.normal(size=(32, WIDTH)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(32, 1)), jnp.float32)
    return x, y


def _single_device(model, batch, optimizer, steps):
    """`steps` steps on `batch`, on one device."""
    return train_one_device(model, [batch] * steps, optimizer, _loss_fn).model


def _layer_weights(body):
    """The blocks' weights as one (n, out, in) array, whatever holds them."""
    if isinstance(body, ed.Stacked):
        return body.layers.linear.weight
    blocks = body.blocks
    return jnp.stack(
        [
            b.module.linear.weight if isinstance(b, ed.FSDP) else b.linear.weight
            for b in blocks
        ]
    )


BODIES = {
    "stacked": lambda bs, mesh: ed.Stacked(bs),
    "stacked_no_prefetch": lambda bs, mesh: ed.Stacked(bs, prefetch=False),
    "stacked_remat": lambda bs, mesh: ed.Stacked(bs, remat=True),
    "stacked_remat_no_prefetch": lambda bs, mesh: ed.Stacked(
        bs, remat=True, prefetch=False
    ),
    "sequential": lambda bs, mesh: ed.FSDPSequential(bs, mesh, min_weight_size=16),
    "sequential_remat_leading": lambda bs, mesh: ed.FSDPSequential(
        bs, mesh, min_weight_size=16, remat=True, layout="leading"
    ),
}


@pytest.mark.parametrize(
    ("body", "axis_types"),
    [(body, "auto") for body in sorted(BODIES)]
    + [("stacked", "explicit"), ("sequential_remat_leading", "explicit")],
)
def test_fsdp_training_equals_single_device(rng, body, axis_types):
    mesh8 = ed.create_data_parallel_mesh(axis_types=axis_types)
    blocks = _blocks(4)
    reference = Model(Chain(tuple(blocks)), _head())
    model = Model(BODIES[body](blocks, mesh8), _head())
    batch = _batch(rng)
    np.testing.assert_allclose(model(batch[0]), reference(batch[0]), atol=1e-6)
    optimizer = optax.adam(1e-2)
    want = _single_device(reference, batch, optimizer, steps=3)
    step = ed.make_train_step(
        _loss_fn, optimizer, mesh8, strategy="fsdp", min_weight_size=16
    )
    state = ed.TrainState.create(model, optimizer, jax.random.key(0))
    for _ in range(3):
        state, _ = step(state, batch)
    got = state.model
    np.testing.assert_allclose(
        _layer_weights(got.body), _layer_weights(want.body), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(got.head.weight, want.head.weight, rtol=1e-5, atol=1e-5)
    if isinstance(got.body, ed.Stacked):
        # The layer axis is never sharded; the per-layer rule shards the rest.
        spec = step.state_specs(state).model.body.layers.linear.weight
        assert spec == P(None, "data", None)  # the train step's leading layout
        assert got.body.layers.linear.weight.sharding.spec == spec


def test_stacked_under_data_parallel_and_from_stacked_leaves(mesh8, rng):
    blocks = _blocks(3)
    reference = Model(Chain(tuple(blocks)), _head())
    # Built from leaves that already carry the layer axis (e.g. filter_vmap).
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    model = Model(ed.Stacked(layers, remat=True), _head())
    batch = _batch(rng)
    optimizer = optax.sgd(0.1)
    want = _single_device(reference, batch, optimizer, steps=2)
    step = ed.make_train_step(_loss_fn, optimizer, mesh8, strategy="dp")
    state = ed.TrainState.create(model, optimizer, jax.random.key(0))
    for _ in range(2):
        state, _ = step(state, batch)
    np.testing.assert_allclose(
        _layer_weights(state.model.body), _layer_weights(want.body), atol=1e-5
    )


def test_stacked_state_checkpoints_like_any_model(mesh8, rng, tmp_path):
    model = Model(ed.Stacked(_blocks(3)), _head())
    optimizer = optax.adam(1e-2)
    step = ed.make_train_step(
        _loss_fn, optimizer, mesh8, strategy="fsdp", min_weight_size=16
    )
    state, _ = step(
        ed.TrainState.create(model, optimizer, jax.random.key(0)), _batch(rng)
    )
    ed.save_checkpoint(tmp_path, state, step=1)
    target = eqx.filter_eval_shape(
        ed.TrainState.create, model, optimizer, jax.random.key(0)
    )
    restored = ed.restore_checkpoint(tmp_path, target)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(
            jax.random.key_data(a) if a.dtype == jax.random.key(0).dtype else a,
            jax.random.key_data(b) if b.dtype == jax.random.key(0).dtype else b,
        )
    # Adam's moments carry the layer axis, sharded like their parameters.
    mu = state.opt_state[0].mu.body.layers.linear.weight
    assert mu.shape == (3, WIDTH, WIDTH) and mu.sharding.spec == P(None, "data", None)


# -- the compiled HLO: gathers run one block ahead -----------------------------


def _computations(hlo):
    """{computation name: {instruction: operand names}} of compiled HLO text."""
    comps, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            current = comps.setdefault(head.group(1), {})
            continue
        inst = re.match(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*)$", line)
        if inst and current is not None:
            rhs = inst.group(2).split(", metadata=")[0]
            current[inst.group(1)] = (rhs, re.findall(r"%([\w.\-]+)", rhs))
    return comps


def _ancestors(graph, name):
    seen, todo = set(), [name]
    while todo:
        for op in graph[todo.pop()][1]:
            if op in graph and op not in seen:
                seen.add(op)
                todo.append(op)
    return seen


def _gathers(graph, shape):
    return [
        n
        for n, (rhs, _) in graph.items()
        if re.match(rf"f32\[{shape}\]\S* all-gather\(", rhs)
    ]


def _compiled(model, x, mesh, *, grad):
    specs = model.partition_specs()
    arrays, static = eqx.partition(model, eqx.is_array)

    def loss(a, xs):
        return jnp.sum(eqx.combine(a, static)(xs) ** 2)

    fn = jax.grad(loss) if grad else loss
    out_specs = specs if grad else P()
    step = jax.jit(over_data(fn, mesh, specs, out_specs=out_specs))
    return step.lower(arrays, x).compile(compiler_options=CPU_FSDP_OPTIONS).as_text()


@pytest.mark.parametrize("grad", [False, True])
def test_prefetched_gather_does_not_wait_for_previous_block(mesh8, grad):
    # Widths differ per block so that each block's gathered weight has its own
    # shape: (24, 16), (32, 24), (40, 32).
    widths = [16, 24, 32, 40]
    keys = jax.random.split(jax.random.key(0), 3)
    blocks = [Block(widths[i], widths[i + 1], keys[i]) for i in range(3)]
    x = jnp.ones((16, 16))
    shapes = [f"{widths[i + 1]},{widths[i]}" for i in range(3)]
    for prefetch in (True, False):
        model = ed.FSDPSequential(
            blocks, mesh8, min_weight_size=64, layout="leading", prefetch=prefetch
        )
        comps = _computations(_compiled(model, x, mesh8, grad=grad))
        graph = comps[next(n for n in comps if n.startswith("main"))]
        for i in range(2):
            (this,) = _gathers(graph, shapes[i])
            (nxt,) = _gathers(graph, shapes[i + 1])
            # Block i's output depends on its gathered weight; block i+1's gather
            # may not depend on it with prefetch (it does without).
            assert (this in _ancestors(graph, nxt)) == (not prefetch), (prefetch, i)


def test_scanned_layer_runs_on_the_previous_iterations_gather(mesh8):
    """In the scan body, the layer's matrix product uses the weight gathered in the
    previous iteration (the carry) and the body's all-gather (the next layer's)
    does not depend on it; without prefetch the product waits for the gather."""
    x = jnp.ones((16, WIDTH))
    for prefetch in (True, False):
        model = ed.FSDP(
            ed.Stacked(_blocks(4), prefetch=prefetch), mesh8, min_weight_size=64
        )
        comps = _computations(_compiled(model, x, mesh8, grad=False))
        (body,) = [
            g
            for g in comps.values()
            if _gathers(g, f"{WIDTH},{WIDTH}")
            and any(" while(" in r for r, _ in g.values()) is False
            and any(re.search(r"\bdot\(|fusion\(", r) for r, _ in g.values())
            and any("opt-barrier" in r for r, _ in g.values())
        ]
        (gather,) = _gathers(body, f"{WIDTH},{WIDTH}")
        dots = [n for n, (r, _) in body.items() if _calls_dot(comps, r)]
        assert dots
        for dot in dots:
            assert (gather in _ancestors(body, dot)) == (not prefetch)
            assert dot not in _ancestors(body, gather)


def test_unrolled_layers_keep_the_prefetch_order(mesh8):
    """Unrolled (no loop), layer i + 1's gather waits for layer i's input, not
    its output: counting the gathers each gather depends on, the first two
    start together; without prefetch each waits for all before it."""
    x = jnp.ones((16, WIDTH))
    for prefetch, want in ((True, [0, 0, 1, 2]), (False, [0, 1, 2, 3])):
        stacked = ed.Stacked(_blocks(4), prefetch=prefetch, unroll=True)
        model = ed.FSDP(stacked, mesh8, min_weight_size=64)
        comps = _computations(_compiled(model, x, mesh8, grad=False))
        graph = comps[next(n for n in comps if n.startswith("main"))]
        assert not any(" while(" in r for g in comps.values() for r, _ in g.values())
        gathers = _gathers(graph, f"{WIDTH},{WIDTH}")
        before = [len(set(gathers) & _ancestors(graph, g)) for g in gathers]
        assert sorted(before) == want, prefetch


def _calls_dot(comps, rhs):
    if re.search(r"\bdot\(", rhs):
        return True
    called = re.search(r"calls=%([\w.\-]+)", rhs)
    return bool(called) and any(
        re.search(r"\bdot\(", r) for r, _ in comps[called.group(1)].values()
    )


def _compiled_instructions(num_layers):
    """The number of HLO instructions in the compiled FSDP gradient of a scanned
    model: what compile time grows with, counted exactly (a wall-clock ratio
    would flake on a busy machine)."""
    mesh = ed.create_data_parallel_mesh()
    model = ed.FSDP(ed.Stacked(_blocks(num_layers)), mesh, min_weight_size=64)
    specs = model.partition_specs()
    arrays, static = eqx.partition(model, eqx.is_array)

    def loss(a, xs):
        return jnp.sum(eqx.combine(a, static)(xs) ** 2)

    text = (
        jax.jit(over_data(jax.grad(loss), mesh, specs))
        .lower(arrays, jnp.ones((16, WIDTH)))
        .compile()
        .as_text()
    )
    return sum(1 for line in text.splitlines() if " = " in line)


def test_scanned_program_is_flat_in_depth():
    # One scanned layer body whatever the depth: the compiled program (and so its
    # compile time) does not grow with the number of layers.
    sizes = {n: _compiled_instructions(n) for n in (4, 8, 16)}
    assert max(sizes.values()) <= 1.02 * min(sizes.values()), sizes


def test_layer_module_errors(mesh8):
    blocks = _blocks(2)
    with pytest.raises(ValueError, match=r"`blocks\[1\]\.linear\.out_features` is 8"):
        ed.Stacked([blocks[0], Block(WIDTH, 8, jax.random.key(1))])
    bad = eqx.tree_at(lambda b: b.linear.bias, blocks[1], jnp.ones(WIDTH, jnp.int32))
    with pytest.raises(ValueError, match=r"`blocks\[1\]` has a leaf of shape/dtype"):
        ed.Stacked([blocks[0], bad])
    with pytest.raises(ValueError, match="empty"):
        ed.Stacked([])
    with pytest.raises(ValueError, match="FSDP or Stacked module"):
        ed.Stacked([ed.FSDP(b, mesh8) for b in blocks])
    # (Under the test suite's jaxtyping hook the annotation check speaks first.)
    with pytest.raises(TypeError, match=r"(?s)mesh.*'mesh'.*Mesh"):
        ed.FSDPSequential(blocks, "mesh")
    with pytest.raises(ValueError, match="empty"):
        ed.FSDPSequential([], mesh8)
    with pytest.raises(ValueError, match="`layout`='contiguous' is not a layout"):
        ed.FSDPSequential(blocks, mesh8, layout="contiguous")
    stacked = ed.Stacked(blocks)
    with pytest.raises(ValueError, match="layer axis must not be sharded"):
        jax.shard_map(
            lambda w, x: eqx.tree_at(lambda s: s.layers.linear.weight, stacked, w)(x),
            mesh=ed.create_data_parallel_mesh(2),
            in_specs=(P("data"), P()),
            out_specs=P(),
            check_vma=False,
        )(stacked.layers.linear.weight, jnp.ones((4, WIDTH)))


@pytest.mark.parametrize("remat", [False, True])
def test_stacked_under_vmap_reduce_scatters_once_per_parameter(mesh8, remat):
    """`jax.vmap(model)` (the usual Equinox pattern) must not batch the collectives:
    each reduce-scatter moves one layer's parameter gradient, not one per example."""
    layers = [
        eqx.nn.Linear(WIDTH, WIDTH, key=k)
        for k in jax.random.split(jax.random.key(0), 3)
    ]
    model = ed.FSDP(
        ed.Stacked(layers, remat=remat), mesh8, min_weight_size=64, layout="largest"
    )
    specs = model.partition_specs()
    arrays, static = eqx.partition(model, eqx.is_array)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, WIDTH)), jnp.float32)

    def loss(a, xs):
        return jnp.sum(jax.vmap(eqx.combine(a, static))(xs) ** 2)

    grad = jax.jit(over_data(jax.grad(loss), mesh8, specs))
    hlo = grad.lower(arrays, x).compile().as_text()
    shapes = re.findall(r"= f32\[([\d,]*)\]\S* reduce-scatter\(", hlo)
    assert shapes and all(s == f"{WIDTH},{WIDTH // 8}" for s in shapes), shapes
    plain = eqx.filter_grad(lambda m: _loss_plain(m, x))(layers)
    want = jnp.stack([layer.weight for layer in plain]) / 8
    got = grad(arrays, x).module.layers.weight
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _loss_plain(layers, x):
    def model(v):
        for layer in layers:
            v = layer(v)
        return v

    return jnp.sum(jax.vmap(model)(x) ** 2)


class Noisy(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x, *, key):
        return jnp.tanh(jax.vmap(self.linear)(x)) + 0.1 * jax.random.normal(
            key, x.shape
        )


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("remat", [False, True])
def test_stacked_passes_one_key_per_layer(mesh8, rng, prefetch, remat):
    blocks = [
        Noisy(eqx.nn.Linear(WIDTH, WIDTH, key=k))
        for k in jax.random.split(jax.random.key(0), 3)
    ]
    x = jnp.asarray(rng.normal(size=(8, WIDTH)), jnp.float32)
    key = jax.random.key(7)

    def unrolled(blocks, x):
        for block, k in zip(blocks, jax.random.split(key, 3), strict=True):
            x = block(x, key=k)
        return jnp.sum(x**2)

    want, want_grads = jax.value_and_grad(unrolled)(blocks, x)
    stacked = ed.FSDP(
        ed.Stacked(blocks, remat=remat, prefetch=prefetch), mesh8, min_weight_size=64
    )
    np.testing.assert_allclose(jnp.sum(stacked(x, key=key) ** 2), want, rtol=1e-5)
    specs = stacked.partition_specs()
    arrays, static = eqx.partition(stacked, eqx.is_array)

    def local(a, x):  # every device sees the whole batch and the same key
        return jax.grad(
            lambda a: jnp.sum(eqx.combine(a, static).module(x, key=key) ** 2)
        )(a)

    grads = jax.shard_map(
        local, mesh=mesh8, in_specs=(specs, P()), out_specs=specs, check_vma=False
    )(arrays, x)
    np.testing.assert_allclose(
        grads.module.layers.linear.weight,
        jnp.stack([b.linear.weight for b in want_grads]),
        rtol=1e-5,
        atol=1e-6,
    )
