"""FSDP: shard_params / gather_params / sync_gradients and the FSDP module wrapper,
checked against single-device computations on the same global data."""

import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import over_data
from jax.sharding import PartitionSpec as P

import eqxdist as ed


def _params(rng):
    return {
        "rows": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),  # dim 0
        "cols": jnp.asarray(rng.normal(size=(3, 24)), jnp.float32),  # dim 1
        "small": jnp.asarray(rng.normal(size=(4,)), jnp.float32),  # replicated
        "lr": 0.5,  # non-array leaf
    }


def _loss(params, x):
    # Touches every parameter; per-device mean loss, as in data parallelism.
    h = jnp.tanh(x @ params["rows"].T)  # (b, 16)
    y = (h[:, :3] @ params["cols"]).sum(-1) + params["small"].sum()
    return jnp.mean(y**2) * params["lr"]


def _dp_mean_grads(params, x, n):
    """The data-parallel gradient: mean over devices of each device's gradient."""
    per_device = [
        jax.grad(_loss)(params, xs) for xs in np.split(np.asarray(x), n, axis=0)
    ]
    return jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *per_device)


def test_shard_params_keeps_this_devices_block(mesh8, rng):
    params = _params(rng)
    arrays = {k: v for k, v in params.items() if k != "lr"}
    specs = ed.fsdp_specs(arrays, 8, min_weight_size=8)
    assert specs == {"rows": P("data", None), "cols": P(None, "data"), "small": P()}

    def local(p):
        shards, got_specs = ed.shard_params(p, "data", min_weight_size=8)
        assert got_specs == specs
        return shards

    shards = jax.shard_map(local, mesh=mesh8, in_specs=P(), out_specs=specs)(arrays)
    for name in arrays:  # the blocks reassemble to the original arrays
        np.testing.assert_array_equal(shards[name], arrays[name])
        assert shards[name].sharding.spec == specs[name]
    assert jax.tree.leaves(
        jax.shard_map(
            lambda p: ed.shard_params(p, min_weight_size=8)[0]["rows"][None],
            mesh=mesh8,
            in_specs=P(),
            out_specs=P("data"),
        )(arrays)
    )[0].shape == (8, 2, 3)  # each device holds 16 / 8 rows


@pytest.mark.parametrize("check_vma", [False, True])
def test_gather_params_forward_and_mean_gradient(mesh8, rng, check_vma):
    params = _params(rng)
    x = jnp.asarray(rng.normal(size=(32, 3)), jnp.float32)
    specs = ed.fsdp_specs(params, 8, min_weight_size=8)
    arrays, static = eqx.partition(params, eqx.is_array)
    array_specs = specs  # "lr": None, like the partitioned arrays

    def gathered_loss(shards, xs):
        return _loss(ed.gather_params(eqx.combine(shards, static), specs), xs)

    def local(shards, xs):
        grads = jax.grad(gathered_loss)(shards, xs)
        if not check_vma:  # replicated leaves: per-device gradients, average them
            grads = ed.sync_gradients(grads, array_specs)
        return grads

    grads = over_data(local, mesh8, array_specs, check_vma=check_vma)(arrays, x)
    expected = _dp_mean_grads(params, x, 8)
    for name in ("rows", "cols"):
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-5, atol=1e-6)
    # Under check_vma=True JAX already sums a replicated leaf's gradient.
    factor = 8 if check_vma else 1
    np.testing.assert_allclose(
        grads["small"], factor * expected["small"], rtol=1e-5, atol=1e-6
    )


def test_combined_gather_reduce_scatters_once_per_dtype(mesh8, rng):
    """The step's gather (`combined=True`): leaves sharded on any dimension, of two
    dtypes, get the mean gradient of the per-leaf gather in one reduce-scatter per
    dtype."""
    from eqxdist._layout.collectives import gather_tree

    params = _params(rng)
    params["half"] = jnp.asarray(rng.normal(size=(8, 5)), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(32, 3)), jnp.float32)
    specs = ed.fsdp_specs(params, 8, min_weight_size=8)
    arrays, static = eqx.partition(params, eqx.is_array)

    def grads_of(combined):
        def loss(shards, xs):
            full = gather_tree(
                eqx.combine(shards, static), specs, "data", combined=combined
            )
            extra = jnp.sum(full["half"].astype(jnp.float32) ** 2) * jnp.mean(xs)
            return _loss(full, xs) + extra

        return jax.jit(
            over_data(
                lambda a, xs: ed.sync_gradients(jax.grad(loss)(a, xs), specs),
                mesh8,
                specs,
            )
        )

    counts = {
        c: ed.count_collectives(grads_of(c).lower(arrays, x).compile())
        for c in (False, True)
    }
    assert counts[False]["reduce-scatter"] == 3  # rows, cols, half
    assert counts[True]["reduce-scatter"] == 2  # float32, bfloat16
    separate, together = grads_of(False)(arrays, x), grads_of(True)(arrays, x)
    for name in ("rows", "cols", "small", "half"):
        np.testing.assert_allclose(
            np.asarray(together[name], np.float32),
            np.asarray(separate[name], np.float32),
            rtol=1e-6,
            atol=1e-7,
        )


def test_gather_params_reassembles_full_arrays(mesh8, rng):
    params = _params(rng)
    specs = ed.fsdp_specs(params, 8, min_weight_size=8)
    arrays, static = eqx.partition(params, eqx.is_array)

    def local(shards):
        full = ed.gather_params(eqx.combine(shards, static), specs)
        assert full["lr"] == 0.5
        return {k: v for k, v in full.items() if k != "lr"}

    full = jax.shard_map(
        local, mesh=mesh8, in_specs=(specs,), out_specs=P(), check_vma=False
    )(arrays)
    for name in full:
        np.testing.assert_array_equal(full[name], params[name])


def test_sync_gradients_averages_over_unsharded_axes(rng):
    mesh = ed.create_hybrid_mesh(4, 2)
    g = {
        "by_data": jnp.asarray(rng.normal(size=(4, 8, 2)), jnp.float32),
        "replicated": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32),
        "none": None,
    }
    specs = {"by_data": P("data"), "replicated": P(), "none": P()}

    def run(axis_names):
        def local(by_data, replicated):
            return ed.sync_gradients(
                {"by_data": by_data, "replicated": replicated, "none": None},
                specs,
                axis_names,
            )

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P("data", "model"), P(("data", "model"))),
            out_specs={"by_data": P("data"), "replicated": P(), "none": P()},
            check_vma=False,
        )(g["by_data"], g["replicated"])

    out = run(("data", "model"))
    as_list = run(["data", "model"])  # any sequence of names, as in the tutorial
    np.testing.assert_array_equal(as_list["replicated"], out["replicated"])
    # by_data: block i holds rows [2 model shards] -> mean over the model axis
    expected = np.asarray(g["by_data"]).reshape(4, 2, 4, 2).mean(1)
    np.testing.assert_allclose(out["by_data"], expected, rtol=1e-6)
    np.testing.assert_allclose(
        out["replicated"], np.asarray(g["replicated"]).mean(0, keepdims=True), rtol=1e-6
    )
    assert out["none"] is None


def test_gather_and_sync_reject_mismatched_specs(mesh8):
    def run(fn):
        return jax.shard_map(
            fn, mesh=mesh8, in_specs=P(), out_specs=P(), check_vma=False
        )(jnp.ones((8, 4)))

    with pytest.raises(ValueError, match=r"`specs` do not match the structure"):
        run(lambda w: ed.gather_params({"w": w}, {"v": P("data")})["w"])
    with pytest.raises(ValueError, match=r"spec .* has 3 entries .* shape \(8, 4\)"):
        run(lambda w: ed.gather_params({"w": w}, {"w": P("data", None, None)})["w"])
    with pytest.raises(ValueError, match=r"\['w'\] is an array .* its spec is None"):
        run(lambda w: ed.sync_gradients({"w": w}, {"w": None})["w"])
    with pytest.raises(ValueError, match="not bound"):
        ed.gather_params({"w": jnp.ones(8)}, {"w": P("data")})
    with pytest.raises(ValueError, match="not bound"):
        ed.shard_params({"w": jnp.ones(8)})


class Block(eqx.Module):
    linear: eqx.nn.Linear
    scale: jax.Array
    activation: object = eqx.field(static=True)

    def __init__(self, size, key):
        self.linear = eqx.nn.Linear(size, size, key=key)
        self.scale = jnp.ones(size)
        self.activation = jnp.tanh

    def __call__(self, x):
        return self.activation(jax.vmap(self.linear)(x)) * self.scale


class Deep(eqx.Module):
    blocks: tuple
    head: eqx.nn.Linear

    def __init__(self, blocks, key):
        self.blocks = tuple(blocks)
        self.head = eqx.nn.Linear(16, 1, use_bias=False, key=key)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(x)


def _deep(mesh, *, wrap, remat=False):
    keys = jax.random.split(jax.random.key(0), 4)
    blocks = [Block(16, k) for k in keys[:3]]
    if wrap:
        # The tutorial's rule: a (16, 16) weight's tie goes to the later dimension.
        blocks = [
            ed.FSDP(b, mesh, min_weight_size=16, remat=remat, layout="largest")
            for b in blocks
        ]
    return Deep(blocks, keys[3])


def test_fsdp_module_places_its_leaves_and_calls_through(axis_types, rng):
    mesh8 = ed.create_data_parallel_mesh(axis_types=axis_types)
    plain = _deep(mesh8, wrap=False)
    model = _deep(mesh8, wrap=True)
    block = model.blocks[0]
    assert block.module.linear.weight.sharding.spec == P(None, "data")  # a tie
    assert block.module.linear.bias.sharding.spec == P()  # 16 elements: too small
    specs = block.partition_specs()
    assert isinstance(specs, ed.FSDP)
    assert specs.module.linear.weight == P(None, "data")
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    expected = plain(x)
    np.testing.assert_allclose(model(x), expected, atol=1e-6)  # eagerly
    np.testing.assert_allclose(  # plain jit on global (sharded) arrays
        eqx.filter_jit(lambda m, x: m(x))(model, x), expected, atol=1e-6
    )


@pytest.mark.parametrize("remat", [False, True])
def test_fsdp_module_in_shard_map_matches_dp_gradients(mesh8, rng, remat):
    plain = _deep(mesh8, wrap=False)
    model = _deep(mesh8, wrap=True, remat=remat)
    x = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)

    def loss(m, xs):
        return jnp.mean(m(xs) ** 2)

    arrays, static = eqx.partition(model, eqx.is_array)
    # Leaves inside FSDP wrappers: their own specs; the head stays replicated.
    specs = jax.tree.map(
        lambda x: x.partition_specs() if isinstance(x, ed.FSDP) else P(),
        arrays,
        is_leaf=lambda x: isinstance(x, ed.FSDP),
    )

    def local(a, xs):
        grads = eqx.filter_grad(loss)(eqx.combine(a, static), xs)
        return ed.sync_gradients(grads, specs)

    step = jax.jit(over_data(local, mesh8, specs))
    grads = step(arrays, x)
    expected = eqx.filter_grad(
        lambda m: jnp.mean(jnp.stack([loss(m, xs) for xs in jnp.split(x, 8)]))
    )(plain)
    got = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    want = jax.tree.leaves(eqx.filter(expected, eqx.is_array))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)
    # Each wrapped block gathers its one sharded weight: 3 all-gathers. With
    # remat, the backward pass gathers the weights of blocks 2 and 3 again (the
    # first block's input needs no gradient, so its weight is not needed). XLA:CPU
    # would merge the two gathers after dropping remat's barriers; GPU/TPU keep
    # them, as does make_train_step on CPU.
    options = {"xla_disable_hlo_passes": "cse_barrier_expander"}
    hlo = step.lower(arrays, x).compile(compiler_options=options).as_text()
    assert hlo.count(" all-gather(") == (5 if remat else 3)


def test_fsdp_module_errors(mesh8):
    with pytest.raises(ValueError, match=r"'model' is not an axis .* \('data',\)"):
        ed.FSDP(eqx.nn.Linear(4, 4, key=jax.random.key(0)), mesh8, axis_name="model")
    with pytest.raises(ValueError, match="min_weight_size"):
        ed.FSDP(eqx.nn.Linear(4, 4, key=jax.random.key(0)), mesh8, min_weight_size=-1)
    block = ed.FSDP(
        eqx.nn.Linear(16, 16, key=jax.random.key(0)), mesh8, min_weight_size=0
    )
    wrong = eqx.tree_at(lambda b: b.module.weight, block, jnp.ones((16, 4)))
    with pytest.raises(ValueError, match=r"global shape \(16, 16\) arrived with shape"):
        jax.shard_map(
            lambda b: wrong(jnp.ones(16)),
            mesh=mesh8,
            in_specs=P(),
            out_specs=P(),
            check_vma=False,
        )(jnp.ones(1))


def test_fsdp_specs_leading_layout():
    tree = {"w": jnp.zeros((24, 64)), "v": jnp.zeros((3, 16, 32)), "b": jnp.zeros(4)}
    tutorial = ed.fsdp_specs(tree, 8, min_weight_size=8)
    leading = ed.fsdp_specs(tree, 8, min_weight_size=8, layout="leading")
    assert tutorial == {"w": P(None, "data"), "v": P(None, None, "data"), "b": P()}
    assert leading == {"w": P("data", None), "v": P(None, "data", None), "b": P()}
    with pytest.raises(ValueError, match=r"`layout`='rows' is not a layout"):
        ed.fsdp_specs(tree, 8, layout="rows")


def test_leading_layout_gives_the_tutorial_layouts_results(mesh8, rng):
    """A hand-written FSDP step (gather_params / sync_gradients) and the FSDP
    module in make_train_step give the same values under either layout."""
    params = _params(rng)
    arrays = {k: v for k, v in params.items() if k != "lr"}
    x = jnp.asarray(rng.normal(size=(32, 3)), jnp.float32)

    def grads_for(layout):
        specs = ed.fsdp_specs(arrays, 8, min_weight_size=8, layout=layout)

        def local(shards, xs):
            grads = jax.grad(
                lambda s: _loss({**ed.gather_params(s, specs), "lr": 0.5}, xs)
            )(shards)
            return ed.sync_gradients(grads, specs)

        return over_data(local, mesh8, specs)(arrays, x)

    tutorial, leading = grads_for("largest"), grads_for("leading")
    for name in arrays:
        np.testing.assert_allclose(leading[name], tutorial[name], rtol=1e-6, atol=1e-7)

    def trained(layout):
        keys = jax.random.split(jax.random.key(0), 4)
        blocks = [
            ed.FSDP(Block(16, k), mesh8, min_weight_size=16, layout=layout)
            for k in keys[:3]
        ]
        model = Deep(blocks, keys[3])
        assert blocks[0].module.linear.weight.sharding.spec == (
            P("data", None) if layout == "leading" else P(None, "data")
        )

        def loss_fn(m, batch, key):
            loss = jnp.mean(m(batch) ** 2)
            return loss, {"loss": (loss, 1)}

        step = ed.make_train_step(loss_fn, optax.adam(1e-2), mesh8, strategy="fsdp")
        state = ed.TrainState.create(model, optax.adam(1e-2), jax.random.key(1))
        batch = jnp.asarray(np.random.default_rng(1).normal(size=(32, 16)), jnp.float32)
        for _ in range(3):
            state, _ = step(state, batch)
        return jax.tree.leaves(eqx.filter(state.model, eqx.is_array))

    for a, b in zip(trained("leading"), trained("largest"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fsdp_module_caller_mistakes(mesh8):
    linear = eqx.nn.Linear(16, 16, key=jax.random.key(0))
    # (Under the test suite's jaxtyping hook the annotation check speaks first;
    # without it FSDP's own check names the argument, the value and the fix.)
    with pytest.raises(TypeError, match=r"(?s)mesh.*'mesh'.*Mesh"):
        ed.FSDP(linear, "mesh")
    with pytest.raises(ValueError, match=r"built inside `jax.shard_map`.*outside"):
        jax.shard_map(
            lambda w: ed.FSDP(eqx.tree_at(lambda m: m.weight, linear, w), mesh8)(
                jnp.ones(16)
            ),
            mesh=mesh8,
            in_specs=P(),
            out_specs=P(),
            check_vma=False,
        )(linear.weight)
    with pytest.raises(ValueError, match=r"`layout`='rows' is not a layout"):
        ed.FSDP(linear, mesh8, layout="rows")


@pytest.mark.slow
def test_fsdp_min_weight_size_not_an_int():
    """Outside the test run's type checking, as a user runs it."""
    code = textwrap.dedent(
        """
        import eqxdist as ed
        ed.simulate_cpu_devices(8)
        import numpy as np
        try:
            ed.FSDP({"w": np.ones((8, 8), np.float32)},
                    ed.create_data_parallel_mesh(), min_weight_size="x")
        except TypeError as e:
            print(e)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "FSDP: `min_weight_size` must be an int" in proc.stdout
    assert "got str 'x'" in proc.stdout
