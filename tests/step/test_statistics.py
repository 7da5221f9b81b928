"""Step statistics (`step_info`: the gradient, update and parameter norms),
the global sums they read (each device its share) and skipping non-finite steps
(`skip_nonfinite`), against plain single-device JAX/Optax (`reference.py`) on
the same global data, on 8 simulated devices."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
    STEP_LAYOUTS,
    TOKEN_ROWS,
    make_layout_step,
    token_batch,
    token_losses,
    token_mean_loss,
    token_mlp,
    token_weighted_loss,
)
from jax.sharding import PartitionSpec as P
from reference import train_one_device

import eqxdist as ed

# -- step statistics -----------------------------------------------------------------


def one_plain_step(model, optimizer, batch):
    """The gradient, update and new parameters of one step on one device, in plain
    Equinox/Optax."""
    trained = train_one_device(model, [batch], optimizer, token_mean_loss)
    new_params = eqx.filter(trained.model, eqx.is_inexact_array)
    return trained.grads, trained.updates, new_params


@pytest.mark.parametrize("setup", sorted(STEP_LAYOUTS))
def test_step_info_norms_match_single_device(setup, axis_types):
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    batch = token_batch(3, empty=())
    model = token_mlp()
    grads, updates, new_params = one_plain_step(model, optimizer, batch)

    step = make_layout_step(
        setup, token_mean_loss, optimizer, axis_types, step_info=True
    )
    state = ed.TrainState.create(model, optimizer, jax.random.key(0))
    out = step(state, batch)
    state, info = out.state, out.info
    assert sorted(info) == ["grad_norm", "param_norm", "skipped", "update_norm"]
    for value in info.values():
        assert value.shape == () and value.dtype == jnp.float32
        assert value.sharding.is_fully_replicated
    np.testing.assert_allclose(info["grad_norm"], optax.tree.norm(grads), rtol=1e-5)
    np.testing.assert_allclose(info["update_norm"], optax.tree.norm(updates), rtol=1e-5)
    np.testing.assert_allclose(
        info["param_norm"], optax.tree.norm(new_params), rtol=1e-6
    )
    assert float(info["skipped"]) == 0.0
    if setup != "dp":  # the norms of sharded leaves are global
        assert not state.model.layers[0].weight.sharding.is_fully_replicated


@pytest.mark.parametrize(
    "shape, axes",
    [
        ({"data": 8}, ("data",)),
        ({"replica": 2, "data": 2, "model": 2}, ("replica", "data")),
    ],
)
def test_sums_read_shares_and_add_up_to_the_whole(shape, axes):
    """Each device sums a slice of every copy (leaves of any shape, remainders,
    leaves too small to split, leaves sharded over data or rule axes); the parts
    add up to NumPy's sums over the whole arrays."""
    from eqxdist._step.statistics import NONFINITE, SQUARES, global_sums

    mesh = ed.create_device_mesh(shape)
    rng = np.random.default_rng(0)
    values = [
        rng.normal(size=s).astype(np.float32) for s in [(10,), (3,), (9, 17), (16, 8)]
    ]
    values.append(rng.normal(size=(8, 6)).astype(jnp.bfloat16))
    rule = "model" if "model" in shape else None
    specs = [P(), P(), P(), P(axes[-1], rule), P(None, rule)]
    manual = [P(), P(), P(), P(axes[-1]), P()]
    tree = [
        jax.device_put(v, jax.sharding.NamedSharding(mesh, s))
        for v, s in zip(values, specs, strict=True)
    ]
    kinds = (SQUARES, NONFINITE)
    sums_of = jax.jit(lambda t: global_sums(t, specs, manual, axes, mesh, kinds))
    sums = sums_of(tree)
    expected = sum(float(np.sum(np.square(v.astype(np.float64)))) for v in values)
    np.testing.assert_allclose(sums[SQUARES], expected, rtol=1e-5)
    assert float(sums[NONFINITE]) == 0.0
    # Only the kinds asked for are computed.
    only = jax.jit(lambda t: global_sums(t, specs, manual, axes, mesh, (SQUARES,)))
    assert only(tree).keys() == {SQUARES}
    np.testing.assert_array_equal(only(tree)[SQUARES], sums[SQUARES])
    tree[2] = tree[2].at[8, 16].set(jnp.inf)  # in the remainder of the split dim
    assert np.isnan(sums_of(tree)[NONFINITE])


def test_step_info_under_zero1():
    """Gradients and updates leave the step sharded as the optimizer state is."""
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    batch = token_batch(5, empty=())
    model = token_mlp()
    grads, updates, _ = one_plain_step(model, optimizer, batch)
    step = ed.make_train_step(
        token_mean_loss,
        optimizer,
        ed.create_data_parallel_mesh(),
        strategy="zero1",
        min_weight_size=16,
        step_info=True,
    )
    state = ed.TrainState.create(model, optimizer, jax.random.key(0))
    info = step(state, batch).info
    np.testing.assert_allclose(info["grad_norm"], optax.tree.norm(grads), rtol=1e-5)
    np.testing.assert_allclose(info["update_norm"], optax.tree.norm(updates), rtol=1e-5)


# -- skipping non-finite steps ------------------------------------------------------


@jax.custom_jvp
def zero_with_gradient(w, scale):
    """0, with gradient `scale` everywhere: an Inf gradient of a finite loss."""
    del scale
    return jnp.zeros((), w.dtype)


@zero_with_gradient.defjvp
def _zero_with_gradient_jvp(primals, tangents):
    w, scale = primals
    return jnp.zeros((), w.dtype), jnp.sum(tangents[0]) * scale


@pytest.mark.parametrize("setup", ["dp", "fsdp"])
def test_step_info_copies_no_parameter(setup):
    """AdamW's update reads the parameters, so the update norm reads the old
    parameters, which the step overwrites in place: the step orders the two, and
    its program copies no parameter (nor anything else) that the plain step does
    not."""
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    batch = token_batch(3, empty=())
    state = ed.TrainState.create(token_mlp(), optimizer, jax.random.key(0))

    def copies(**kwargs):
        step = make_layout_step(setup, token_mean_loss, optimizer, **kwargs)
        text = step.lower(step.place_state(state), batch).compile().as_text()
        return sorted(
            line.split(" = ")[1].split(" copy(")[0]
            for line in text.splitlines()
            if " copy(" in line and "[]" not in line.split(" copy(")[0]
        )

    assert copies(step_info=True) == copies()


def _loop_operands(hlo):
    """(result type, opcode) of what enters the one `while` of a compiled step's
    entry computation: the instructions that define its carry's elements."""
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}\n")]
    defs = {}
    for line in entry.splitlines():
        found = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = (.+?) ([\w-]+)\((.*)$", line)
        if found:
            operands = re.findall(r"%[\w.-]+", found[4].split("), ")[0])
            defs[found[1]] = (found[2].split("{")[0], found[3], operands)
    (loop,) = [d for d in defs.values() if d[1] == "while"]
    (carry,) = loop[2]
    return [defs[o][:2] for o in defs[carry][2]]


@pytest.mark.parametrize("loss_fn", [token_mean_loss, token_weighted_loss])
@pytest.mark.parametrize("setup", ["dp", "hsdp"])
def test_skip_nonfinite_divides_the_gradients_inside_its_loop(setup, loss_fn):
    """The update of `skip_nonfinite` runs in a loop (once, or not at all). The
    gradients enter it as the all-reduce leaves them, and the mean's division and
    the weighted loss's scale run inside it, fused into the optimizer's pass: no
    elementwise pass writes a gradient out before the loop, as dividing first did.
    (Under FSDP the gather's VJP divides its reduce-scatter itself, on the
    device's shard.)"""
    optimizer = optax.adamw(1e-2)
    state = ed.TrainState.create(token_mlp(), optimizer, jax.random.key(0))
    step = make_layout_step(setup, loss_fn, optimizer, skip_nonfinite=True)
    hlo = step.lower(step.place_state(state), token_batch(3)).compile().as_text()
    operands = _loop_operands(hlo)
    # The carry: the skip flag, the parameters, the optimizer state, the update
    # sums and the gradients.
    assert ("pred[]", "fusion") in operands
    written = [t for t, op in operands if op == "fusion" and "[]" not in t]
    assert written == []


def stateful_loss(model, model_state, batch, key):
    del key
    losses = token_losses(model, batch).mean(axis=1)
    spike = zero_with_gradient(model.layers[0].weight, jnp.max(batch["spike"]))
    loss = losses.mean() + spike
    return (
        loss,
        {"loss": ed.metrics.Mean().update(losses)},
        {"seen": model_state["seen"] + 1},
    )


def spiked_batch(kind):
    batch = token_batch(4, empty=())
    batch["spike"] = np.zeros(TOKEN_ROWS, np.float32)
    if kind == "nan_row":
        batch["x"][9, 2, 1] = np.nan  # one row of device 2
    else:
        batch["spike"][4 * 6] = np.inf  # device 6: Inf gradient, finite loss
    return batch


@pytest.mark.parametrize(
    ("setup", "kind", "axis_types"),
    [(s, k, "auto") for s in ["dp", "fsdp", "hsdp"] for k in ["nan_row", "inf_grad"]]
    + [("fsdp", "nan_row", "explicit")],
)
def test_skip_nonfinite_leaves_the_state_bit_identical(setup, kind, axis_types):
    optimizer = optax.adam(1e-2)
    step = make_layout_step(
        setup,
        stateful_loss,
        optimizer,
        axis_types,
        step_info=True,
        skip_nonfinite=True,
    )
    state = ed.TrainState.create(
        token_mlp(), optimizer, jax.random.key(0), model_state={"seen": jnp.float32(0)}
    )
    good = token_batch(5, empty=())
    good["spike"] = np.zeros(TOKEN_ROWS, np.float32)
    out = step(state, good)
    state, info = out.state, out.info
    assert float(info["skipped"]) == 0.0 and float(state.model_state["seen"]) == 1
    before = jax.device_get((state.model, state.opt_state, state.model_state))

    out = step(state, spiked_batch(kind))
    state, metrics, info = out.state, out.metrics, out.info
    assert float(info["skipped"]) == 1.0
    assert float(info["update_norm"]) == 0.0
    assert int(state.step) == 2
    after = jax.device_get((state.model, state.opt_state, state.model_state))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    loss = float(metrics["loss"].compute())
    assert np.isnan(loss) if kind == "nan_row" else np.isfinite(loss)

    out = step(state, good)

    state, info = out.state, out.info  # training goes on
    assert float(info["skipped"]) == 0.0 and int(state.step) == 3
    assert np.isfinite(float(info["param_norm"]))


def test_without_skipping_nonfinite_values_propagate(mesh8):
    optimizer = optax.adam(1e-2)
    step = ed.make_train_step(stateful_loss, optimizer, mesh8, step_info=True)
    state = ed.TrainState.create(
        token_mlp(), optimizer, jax.random.key(0), model_state={"seen": jnp.float32(0)}
    )
    out = step(state, spiked_batch("inf_grad"))
    state, info = out.state, out.info
    assert float(info["skipped"]) == 0.0
    assert not np.isfinite(float(info["grad_norm"]))
    assert not np.all(np.isfinite(np.asarray(state.model.layers[0].weight)))
