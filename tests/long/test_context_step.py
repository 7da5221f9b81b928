"""`make_train_step(..., context_axis=...)`: a tiny causal language model trained
with its sequences split over a context axis, in the device view (ring attention
on balanced chunks, `ed.context_positions`) and the global view (whole sequences,
`ed.attention` sharding itself), against the same model trained on one device
in plain JAX and Optax (`jax.nn.dot_product_attention`, Optax's cross-entropy);
and `BatchLoader(..., context_axis=...)`."""

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxdist as ed
from tests.reference import train_one_device

V, D, H, ROWS, T = 16, 8, 2, 4, 32


class TinyLM(eqx.Module):
    """Token and position embeddings, one causal attention layer with a residual,
    a linear head: plain `x @ W` arrays."""

    embed: jax.Array
    pos: jax.Array
    qkv: jax.Array
    out: jax.Array
    head: jax.Array

    def __init__(self, key: jax.Array) -> None:
        k = jax.random.split(key, 5)
        self.embed = jax.random.normal(k[0], (V, D)) * 0.5
        self.pos = jax.random.normal(k[1], (T, D)) * 0.5
        self.qkv = jax.random.normal(k[2], (D, 3 * D)) / math.sqrt(D)
        self.out = jax.random.normal(k[3], (D, D)) / math.sqrt(D)
        self.head = jax.random.normal(k[4], (V, D)) / math.sqrt(D)

    def hidden(self, tokens: jax.Array, positions: jax.Array, attend) -> jax.Array:
        """`(rows, length)` tokens at `positions` to `(rows, length, D)`."""
        x = self.embed[tokens] + self.pos[positions]
        q, k, v = jnp.split(x @ self.qkv, 3, axis=-1)
        shape = (*tokens.shape, H, D // H)
        mixed = attend(q.reshape(shape), k.reshape(shape), v.reshape(shape))
        return x + mixed.reshape(x.shape) @ self.out


def device_loss(model: TinyLM, batch: dict, key) -> tuple:
    """The device view: this device's chunks of the sequences, balanced."""
    tokens = batch["tokens"]
    positions = ed.context_positions(tokens.shape[1], "context")

    @jax.vmap
    def attend(q, k, v):
        return ed.attention(q, k, v, causal=True, context_axis="context")

    h = model.hidden(tokens, positions, attend)
    loss = ed.cross_entropy(h @ model.head.T, batch["targets"], weights=batch["mask"])
    return loss, {}


def global_loss(model: TinyLM, batch: dict, key) -> tuple:
    """The global view: whole sequences in their order."""
    tokens = batch["tokens"]

    @jax.vmap
    def attend(q, k, v):
        return ed.attention(q, k, v, causal=True, context_axis="context")

    h = model.hidden(tokens, jnp.arange(tokens.shape[1]), attend)
    loss = ed.linear_cross_entropy(
        h, model.head, batch["targets"], weights=batch["mask"], chunk_size=32
    )
    return loss, {}


def reference_loss(model: TinyLM, batch: dict, key) -> jax.Array:
    """One device, plain JAX and Optax: the weighted mean over the tokens."""
    tokens = batch["tokens"]

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    h = model.hidden(tokens, jnp.arange(tokens.shape[1]), attend)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        h @ model.head.T, batch["targets"]
    )
    return jnp.sum(losses * batch["mask"]) / jnp.sum(batch["mask"])


def batches(steps: int = 3, rows: int = ROWS, length: int = T) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, V, (rows, length + 1)).astype(np.int32)
        mask = (rng.random((rows, length)) < 0.8).astype(np.float32)
        out.append({"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask})
    return out


def _close(a, b, atol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-5)


def _train(mesh, view, data=None, **options):
    loss = device_loss if view == "device" else global_loss
    optimizer = optax.adam(1e-2)
    step = ed.make_train_step(
        loss,
        optimizer,
        mesh,
        context_axis="context",
        view=view,
        min_weight_size=0,
        **options,
    )
    state = ed.TrainState.create(
        TinyLM(jax.random.key(1)), optimizer, jax.random.key(2)
    )
    infos = []
    for batch in data or batches():
        out = step(state, batch)
        state = out[0]
        infos.append(out.info)
    return state, step, infos


@functools.cache
def _reference(rows=ROWS):
    """The same training on `batches(rows=rows)` on one device (a weighted loss:
    the token-weighted mean over the whole batch, however the steps split it);
    computed once per size."""
    return train_one_device(
        TinyLM(jax.random.key(1)), batches(rows=rows), optax.adam(1e-2), reference_loss
    )


MESHES = {
    "context8": ((8,), ("context",)),
    "data2_context4": ((2, 4), ("data", "context")),
}


@pytest.mark.parametrize("view", ["device", "global"])
@pytest.mark.parametrize(
    ("mesh_name", "strategy"), [("context8", "dp"), ("data2_context4", "fsdp")]
)
def test_a_language_model_trains_as_on_one_device(mesh_name, strategy, view):
    shape, names = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names)  # Explicit axes, JAX's default
    state, step, _ = _train(mesh, view, strategy=strategy)
    want = _reference()
    _close(state.model, want.model)
    # Parameters are replicated over the context axis, sharded over "data" by FSDP.
    specs = step.state_specs(state).model
    assert all("context" not in jax.tree.leaves(s) for s in jax.tree.leaves(specs))


HSDP = {
    "mesh": {"replica": 2, "data": 2, "context": 2},
    "data_axis": ("replica", "data"),
}
TENSOR = {
    "mesh": {"data": 2, "model": 2, "context": 2},
    "param_rules": [("qkv", P(None, "model")), ("out", P("model", None))],
}


@pytest.mark.parametrize("view", ["device", "global"])
@pytest.mark.parametrize("case", [HSDP, TENSOR], ids=["hsdp", "tensor_rules"])
def test_hsdp_tensor_rules_minibatches_weights_and_step_info(case, view):
    """FSDP over two data axes (HSDP), or with tensor-parallel rules over "model";
    2 minibatches of a weighted loss; step_info's gradient norm."""
    options = {k: v for k, v in case.items() if k != "mesh"}
    mesh = ed.create_device_mesh(case["mesh"])
    data = batches(rows=8)
    state, _, infos = _train(
        mesh, view, data, strategy="fsdp", num_minibatches=2, step_info=True, **options
    )
    # A weighted loss is the token-weighted mean over the whole batch, however
    # the minibatches split it.
    want = _reference(8)
    _close(state.model, want.model)
    grad_norm = float(optax.tree.norm(want.grads))
    np.testing.assert_allclose(float(infos[-1]["grad_norm"]), grad_norm, rtol=1e-5)


def test_the_device_view_sees_balanced_chunks_and_their_positions():
    """What a device's loss sees: its rows' chunks `i` and `2 cp - 1 - i` of the
    sequence, and the positions of those chunks."""
    mesh = ed.create_device_mesh({"data": 2, "context": 4})
    seen = {}

    def loss(model, batch, key):
        positions = ed.context_positions(batch["tokens"].shape[1], "context")
        got = jnp.all(batch["tokens"] == positions[None, :])
        balanced = ed.metrics.Sum().update(got.astype(jnp.int32))
        return jnp.sum(model["w"]) * 0.0, {"balanced": balanced}

    step = ed.make_train_step(loss, optax.sgd(0.1), mesh, context_axis="context")
    state = ed.TrainState.create({"w": jnp.ones(2)}, optax.sgd(0.1), jax.random.key(0))
    tokens = np.tile(np.arange(T, dtype=np.int32), (ROWS, 1))
    _, metrics = step(state, {"tokens": tokens})
    seen["balanced"] = int(metrics["balanced"].compute())
    assert seen["balanced"] == 8  # true on every one of the 8 devices


def test_batches_are_placed_over_data_and_context():
    mesh = ed.create_device_mesh({"data": 2, "context": 4})
    data = {"tokens": np.arange(ROWS * T).reshape(ROWS, T), "row": np.arange(ROWS)}
    with ed.BatchLoader(
        data, ROWS, mesh, context_axis="context", shuffle=False, prefetch=0
    ) as loader:
        batch = loader.batch(0)
    assert batch["tokens"].sharding.spec == P("data", "context")
    assert batch["row"].sharding.spec == P("data")
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), data["tokens"])
    # The step takes them as they are (no copy of the batch to another layout).
    state, _, _ = _train(mesh, "device", [dict(b) for b in _loader_batches(mesh)])
    _close(state.model, _reference().model)


def _loader_batches(mesh):
    data = batches()
    stacked = {k: np.concatenate([b[k] for b in data]) for k in data[0]}
    with ed.BatchLoader(
        stacked, ROWS, mesh, context_axis="context", shuffle=False, prefetch=0
    ) as loader:
        return [loader.batch(s) for s in range(len(data))]


def test_bad_context_options_are_clear_errors():
    mesh = ed.create_device_mesh({"data": 2, "context": 4})
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match="context_axis.*'seq'.*not"):
        ed.make_train_step(device_loss, opt, mesh, context_axis="seq")
    with pytest.raises(ValueError, match="also a data axis"):
        ed.make_train_step(device_loss, opt, mesh, context_axis="data")
    with pytest.raises(ValueError, match="name the context axis"):
        ed.make_train_step(
            device_loss, opt, mesh, context_axis="context",
            param_rules=[("qkv", P(None, "context"))],
        )  # fmt: skip
    step = ed.make_train_step(device_loss, opt, mesh, context_axis="context")
    state = ed.TrainState.create(TinyLM(jax.random.key(1)), opt, jax.random.key(2))
    short = batches(1, length=12)[0]
    with pytest.raises(
        ValueError, match=r"dimension 1 \(the sequence\).*multiple of 2 x 4"
    ):
        step(state, short)
    with pytest.raises(ValueError, match="context_axis"):
        ed.BatchLoader({"x": np.ones((8, 8))}, 8, mesh, context_axis="seq")


@pytest.mark.parametrize("view", ["device", "global"])
def test_an_evaluation_with_a_context_axis(view):
    """The summed loss and token count of a batch of 5 rows (padded to the
    devices), as on one device; per-row outputs in the global view."""
    mesh = ed.create_device_mesh({"data": 2, "context": 4})
    model = TinyLM(jax.random.key(1))
    batch = {k: v[:5] for k, v in batches(1, rows=8)[0].items()}
    loss = device_loss if view == "device" else global_loss

    def eval_fn(model, batch, mask):
        weights = batch["mask"] * mask[:, None]
        (total, count), _ = loss(model, {**batch, "mask": weights}, None)
        return {"loss": (total, count)}

    step = ed.make_eval_step(eval_fn, mesh, context_axis="context", view=view)
    total, count = step(model, batch)["loss"]
    full = batch["mask"].sum()
    want = reference_loss(model, batch, None) * full
    np.testing.assert_allclose(float(total), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(count), float(full))
    if view == "device":
        with pytest.raises(ValueError, match="per_row=True with context_axis"):
            ed.make_eval_step(eval_fn, mesh, context_axis="context", per_row=True)


class AttentionBlock(eqx.Module):
    """One causal attention layer with a residual, on one row `(length, D)`:
    ring attention over `context_axis`, or on one device (`None`) JAX's."""

    qkv: jax.Array
    out: jax.Array
    context_axis: str | None = eqx.field(static=True)

    def __init__(self, key: jax.Array, context_axis: str | None) -> None:
        k = jax.random.split(key)
        self.qkv = jax.random.normal(k[0], (D, 3 * D)) / math.sqrt(D)
        self.out = jax.random.normal(k[1], (D, D)) / math.sqrt(D)
        self.context_axis = context_axis

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (
            a.reshape(x.shape[0], H, D // H) for a in jnp.split(x @ self.qkv, 3, -1)
        )
        if self.context_axis is None:
            mixed = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            mixed = ed.attention(q, k, v, causal=True, context_axis=self.context_axis)
        return x + mixed.reshape(x.shape) @ self.out


class StackedLM(eqx.Module):
    """Embeddings, an `ed.Stacked` of attention blocks (the pipelined part), a
    linear head."""

    embed: jax.Array
    pos: jax.Array
    blocks: ed.Stacked
    head: jax.Array

    def __init__(self, context_axis: str | None, layers: int = 2) -> None:
        k = jax.random.split(jax.random.key(3), 4)
        self.embed = jax.random.normal(k[0], (V, D)) * 0.5
        self.pos = jax.random.normal(k[1], (T, D)) * 0.5
        keys = jax.random.split(k[2], layers)
        self.blocks = ed.Stacked([AttentionBlock(j, context_axis) for j in keys])
        self.head = jax.random.normal(k[3], (V, D)) / math.sqrt(D)

    def logits(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        x = self.embed[tokens] + self.pos[positions]
        return jax.vmap(self.blocks)(x) @ self.head.T


def stacked_device_loss(model: StackedLM, batch: dict, key) -> tuple:
    positions = ed.context_positions(batch["tokens"].shape[1], "context")
    logits = model.logits(batch["tokens"], positions)
    return ed.cross_entropy(logits, batch["targets"], weights=batch["mask"]), {}


def stacked_reference_loss(model: StackedLM, batch: dict, key) -> jax.Array:
    logits = model.logits(batch["tokens"], jnp.arange(batch["tokens"].shape[1]))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(losses * batch["mask"]) / jnp.sum(batch["mask"])


PIPELINE_MESH = {"stage": 2, "data": 2, "context": 2}


def test_pipeline_stages_with_ring_attention_train_as_on_one_device():
    """GPipe over a "stage" axis, each stage's blocks running ring attention over
    its own "context" devices: the parameters of the same training on one
    device."""
    mesh = ed.create_device_mesh(PIPELINE_MESH)
    optimizer = optax.sgd(0.5)
    step = ed.make_train_step(
        stacked_device_loss, optimizer, mesh, context_axis="context",
        pipeline=ed.Pipeline("stage", 2, schedule="gpipe"), min_weight_size=0,
    )  # fmt: skip
    state = ed.TrainState.create(StackedLM("context"), optimizer, jax.random.key(2))
    data = batches(2)
    for batch in data:
        state, _ = step(state, batch)
    want = train_one_device(StackedLM(None), data, optimizer, stacked_reference_loss)
    _close(eqx.filter(state.model, eqx.is_array), eqx.filter(want.model, eqx.is_array))


def example_loss(model: StackedLM, batch: dict, key) -> tuple:
    """`examples/transformer_lm.py`'s loss: token-weighted, with the loss, the
    perplexity of the logits and the token count as metrics."""
    positions = ed.context_positions(batch["tokens"].shape[1], "context")
    logits = model.logits(batch["tokens"], positions)
    mask = batch["mask"] > 0
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    metrics = {
        "loss": ed.metrics.Mean().update(losses, batch["mask"]),
        "perplexity": ed.metrics.Perplexity().update(logits, batch["targets"], mask),
        "tokens": ed.metrics.Sum().update(mask.sum()),
    }
    loss_sum = jnp.sum(jnp.where(mask, losses, 0.0))
    return (loss_sum, batch["mask"].sum()), ed.MetricCollection(metrics)


def test_the_examples_pipeline_and_context_layout_trains_as_on_one_device():
    """`transformer_lm.py --pipeline-parallel 2 --context-parallel 2`: GPipe
    stages running ring attention, FSDP, and metrics whose all-reduces (the
    perplexity's token count reads only the batch) XLA:CPU could run before the
    pipeline's loop of `ppermute`s on some devices and after it on others (the
    example deadlocked). The step fences its loss (`Layout.fence`): it trains
    as one device does, and evaluates."""
    mesh = ed.create_device_mesh(PIPELINE_MESH)
    layout = ed.Layout(
        mesh, strategy="fsdp", min_weight_size=0, context_axis="context",
        pipeline=ed.Pipeline("stage", 2, schedule="gpipe"),
    )  # fmt: skip
    optimizer = optax.sgd(0.5)
    step = ed.make_train_step(example_loss, optimizer, layout)
    model = StackedLM("context")
    state = ed.TrainState.create(model, optimizer, jax.random.key(2))
    data = batches(2)
    assert layout.fences
    assert "optimization_barrier" in step.lower(state, data[0]).as_text()
    state, metrics = step(state, data[0])
    metrics = metrics.compute()
    first = float(stacked_reference_loss(StackedLM(None), data[0], None))
    np.testing.assert_allclose(float(metrics["loss"]), first, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["perplexity"]), math.exp(first), 1e-5)
    assert int(metrics["tokens"]) == int(data[0]["mask"].sum())
    state, _ = step(state, data[1])
    want = train_one_device(StackedLM(None), data, optimizer, stacked_reference_loss)
    _close(eqx.filter(state.model, eqx.is_array), eqx.filter(want.model, eqx.is_array))

    def eval_fn(model: StackedLM, batch: dict, rows: jax.Array) -> Any:
        return example_loss(model, {**batch, "mask": batch["mask"] * rows[:, None]}, 0)[
            1
        ]

    held = ed.make_eval_step(eval_fn, layout)(state, data[0]).compute()
    last = float(stacked_reference_loss(want.model, data[0], None))
    np.testing.assert_allclose(float(held["loss"]), last, rtol=1e-5)
    np.testing.assert_allclose(float(held["perplexity"]), math.exp(last), rtol=1e-5)


@pytest.mark.parametrize(
    ("view", "schedule", "repeats"),
    [
        ("device", "1f1b", 1),
        ("global", "1f1b", 1),
        ("device", "interleaved", 2),
        ("global", "zb-h1", 1),
    ],
)
def test_1f1b_with_a_context_axis_is_a_clear_error(view, schedule, repeats):
    """1F1B runs a forward pass on one stage while another runs a backward
    pass; their ring attention's collectives over the context axis then pair up
    with the wrong ones across stages (the trained parameters were silently
    wrong): `make_train_step` refuses the pair and names the schedules that
    work. So do interleaved 1F1B and ZB-H1, which do the same."""
    mesh = ed.create_device_mesh(PIPELINE_MESH)
    pipeline = ed.Pipeline("stage", 2, schedule=schedule, repeats=repeats)
    with pytest.raises(ValueError) as info:
        ed.make_train_step(
            stacked_device_loss, optax.sgd(0.5), mesh, context_axis="context",
            pipeline=pipeline, view=view,
        )  # fmt: skip
    message = str(info.value)
    for part in ("make_train_step", f"schedule={schedule!r}", "'context'", "'gpipe'"):
        assert part in message, part
    assert "'circular'" in message
