"""Losses under the schedules that run the loss once per microbatch (`"1f1b"`,
`"interleaved"`, `"zb-h1"`; API.md "Losses under per-microbatch schedules"):
in either view the step trains on exactly the loss `loss_fn` computes on the
rows it is given, its metrics those of the rows, against one device in plain
JAX, Equinox and Optax (float32, 1e-5) -- or it refuses, at the first step and
before the state is consumed, naming the operation that mixes rows of
different microbatches, the schedule in use and both fixes. Each class of
row-coupling operation is refused (a trace of the first step, no training);
one exact training case per schedule and view."""

import jax
import jax.numpy as jnp
import optax
import pytest
from harness import PipeNet, pipe_batches
from reference import max_diff, train_one_device

import eqxdist as ed

SGD = optax.sgd(0.1)
SHAPE = {"stage": 2, "data": 4}
ROWS, DEVICES, MICRO = 32, 4, 2
SCHEDULES = ("1f1b", "interleaved", "zb-h1")


def _data(steps: int = 2) -> list:
    return pipe_batches(steps=steps, rows=ROWS, seed=3)


def _step(loss, schedule: str, view: str):
    repeats = 2 if schedule == "interleaved" else 1
    pipeline = ed.Pipeline("stage", MICRO, schedule=schedule, repeats=repeats)
    mesh = ed.create_device_mesh(SHAPE)
    step = ed.make_train_step(loss, SGD, mesh, pipeline=pipeline, view=view)
    return step, ed.TrainState.create(PipeNet(layers=4), SGD, jax.random.key(1))


def _ce(model, batch: dict) -> jax.Array:
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


# Each class of operation that mixes rows, as a loss's terms on the rows' loss
# `c` (`(rows,)`) and the stack's output `s` (`(rows, d)`), and the primitive
# the error names (any of them, where JAX writes the operation with several).
COUPLED = {
    "dpo_pairs": (lambda c, s, b, k: jax.nn.log_sigmoid(c[::2] - c[1::2]), "slice"),
    "halves": (lambda c, s, b, k: c[: c.shape[0] // 2] - c[c.shape[0] // 2 :], "slice"),
    "task_means": (
        lambda c, s, b, k: c.reshape(4, -1).mean(1) @ jnp.arange(4.0),
        "reshape",
    ),
    "discount": (lambda c, s, b, k: 0.9 ** jnp.arange(c.shape[0]) * c, "iota"),
    "first_half": (
        lambda c, s, b, k: (jnp.arange(c.shape[0]) < c.shape[0] // 2) * c,
        "iota",
    ),
    "top_k": (lambda c, s, b, k: jax.lax.top_k(c, c.shape[0] // 4)[0], "top_k"),
    "gather": (lambda c, s, b, k: c[b["y"]], "gather"),
    "concat": (lambda c, s, b, k: jnp.concatenate([c, 2 * c]), "concatenate"),
    "pad": (lambda c, s, b, k: jnp.pad(c, (1, 0)), "pad"),
    "roll": (lambda c, s, b, k: jnp.roll(c, 1), "slice|concatenate|gather"),
    "sort": (lambda c, s, b, k: jnp.sort(c) * jnp.linspace(0, 1, c.shape[0]), "sort"),
    "cumsum": (lambda c, s, b, k: jnp.cumsum(c), "cumsum|reduce_window|cumlogsumexp"),
    "row_row": (lambda c, s, b, k: (s @ s.T).ravel(), "dot_general"),
    "log_of_mean": (lambda c, s, b, k: jnp.log(c.mean())[None], "log"),
    "max_over_rows": (lambda c, s, b, k: c.max()[None], "reduce_max"),
    # Per-row noise from the loss's key (the global view's one-device key).
    "noise": (
        lambda c, s, b, k: (
            c * jax.vmap(jax.random.uniform)(jax.random.split(k, c.shape[0]))
        ),
        "random_split|random_bits",
    ),
}
# Terms proven per row: reductions and products over other axes, a reshape
# keeping the rows whole, a slice of the other axis, a per-row pick.
PER_ROW = {
    "feature_ops": lambda c, s, b, k: c * jnp.max(s, 1) + jnp.sort(s, 1)[:, -1],
    "reshape_whole": lambda c, s, b, k: (s.reshape(-1, 2, 2) ** 2).sum((1, 2)) + c,
    "pick": lambda c, s, b, k: jnp.take_along_axis(s, b["y"][:, None], 1)[:, 0],
    "columns": lambda c, s, b, k: s[:, 1:3].sum(1) * b["mask"] / b["mask"].sum(),
    "argsort_features": lambda c, s, b, k: jnp.argsort(s, axis=1)[:, 0] * c,
    "one_hot": lambda c, s, b, k: (jax.nn.one_hot(b["y"], 4) * s).sum(1),
    "row_dot": lambda c, s, b, k: (c @ b["mask"])[None] / c.shape[0],
    # A reduction inside `jax.vmap` over the rows: JAX writes its axes as NumPy
    # integers (once a type error of the analysis itself).
    "vmapped_mean": lambda c, s, b, k: (
        jax.vmap(lambda r: r.reshape(2, 2).mean(0))(s).sum(1) + c
    ),
}


def _post(term):
    """A loss after the stack as `hoist` reads it: the stack's output `s`, the
    batch and the key in, the mean of `term` out."""

    def post(params, batch, key, s):
        c = optax.softmax_cross_entropy_with_integer_labels(s @ params, batch["y"])
        return term(c, s, batch, key).mean()

    return post


def _analysed(term, view: str, schedule: str = "1f1b"):
    """`hoist.shares` on `term`'s loss at a microbatch's 4 rows beside the
    whole 16 (the `ValueError` it raises, if any)."""
    from eqxdist._step.hoist import Where, shares

    def traced(rows: int):
        batch = {
            "y": jnp.zeros(rows, jnp.int32),
            "mask": jnp.ones(rows, jnp.float32),
        }
        args = (jnp.ones((4, 4)), batch, jax.random.key(0), jnp.ones((rows, 4)))
        return jax.make_jaxpr(_post(term))(*args)

    kinds = ["param", "batch", "batch", "key", "stack"]
    return shares(traced(4), traced(16), kinds, False, Where(schedule, view))


@pytest.mark.parametrize("name", list(COUPLED))
def test_each_row_coupling_operation_is_refused_naming_it(name):
    term, op = COUPLED[name]
    for view in ("global", "device"):
        if name == "noise" and view == "device":
            _analysed(term, view)  # the device view's key differs per slice
            continue
        with pytest.raises(ValueError) as error:
            _analysed(term, view, SCHEDULES[len(name) % 3])
        message = str(error.value)
        assert any(f"`{o}`" in message for o in op.split("|")), message
        assert "test_loss_analysis.py" in message  # the user's line


@pytest.mark.parametrize("name", list(PER_ROW))
def test_per_row_operations_are_taken(name):
    for view in ("global", "device"):
        _analysed(PER_ROW[name], view)


@pytest.mark.parametrize(
    ("name", "schedule", "view"),
    [
        ("dpo_pairs", "1f1b", "global"),
        ("task_means", "interleaved", "device"),
        ("first_half", "zb-h1", "device"),
        ("noise", "zb-h1", "global"),
    ],
)
def test_the_step_refuses_at_the_first_step(name, schedule, view):
    term = COUPLED[name][0]

    def loss(model, batch, key):
        s = jax.vmap(model)(batch["x"])
        c = optax.softmax_cross_entropy_with_integer_labels(s, batch["y"])
        return term(c, s, batch, key).mean(), {}

    step, state = _step(loss, schedule, view)
    with pytest.raises(ValueError) as error:
        step(state, _data(1)[0])
    message = str(error.value)
    for part in (f"schedule={schedule!r}", f"view={view!r}", "gpipe", "(loss_sum"):
        assert part in message, message
    assert "test_loss_analysis.py" in message  # the user's line
    # Nothing was consumed: the state is whole.
    assert not jax.tree.leaves(state.model)[0].is_deleted()


def _exact_loss(view: str):
    """A masked token mean (a hoisted `mask.sum()` and a log of it), a mean
    over the rows by its Python count, a parameter-only penalty, and -- in the
    global view -- a factor drawn from the loss's key (a batch constant)."""

    def loss(model, batch, key):
        ce, mask = _ce(model, batch), batch["mask"]
        value = jnp.sum(ce * mask) / jnp.sum(mask) * jnp.log1p(jnp.sum(mask))
        value = value + 0.1 * jnp.sum(ce) / ce.shape[0]
        value = value + 1e-2 * jnp.sum(model.head.weight**2)
        if view == "global":
            value = value * (1 + 0.1 * jax.random.uniform(key))
        return value, {"loss": ed.metrics.Mean().update(value)}

    return loss


def _per_device(loss):
    """The device view's reference: each data device's loss over its own
    rows, averaged over the devices."""

    def averaged(model, batch, key):
        per = ROWS // DEVICES
        parts = [
            loss(model, {k: v[d * per : (d + 1) * per] for k, v in batch.items()}, key)
            for d in range(DEVICES)
        ]
        return sum(p[0] for p in parts) / DEVICES, {}

    return averaged


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("view", ["global", "device"])
def test_an_exact_loss_equals_one_device_with_its_reported_mean(schedule, view):
    data = _data(1)
    loss = _exact_loss(view)
    reference = loss if view == "global" else _per_device(loss)
    key = jax.random.key(1) if view == "global" else None
    want = train_one_device(PipeNet(layers=4), data, SGD, reference, key=key)
    step, state = _step(loss, schedule, view)
    state, metrics = step(state, data[0])
    reported = float(metrics["loss"].compute())
    assert abs(reported - want.losses[0]) < 1e-5, (reported, want.losses[0])
    assert max_diff(state.model, want.model) < 1e-5


def _twice(model, batch, key):
    return (_ce(model, batch) + _ce(model, batch)).mean(), {}


def _layer_penalty(model, batch, key):
    penalty = sum(jnp.sum(w**2) for w in jax.tree.leaves(model.blocks))
    return _ce(model, batch).mean() + 1e-3 * penalty, {}


@pytest.mark.parametrize(
    ("loss", "schedule", "words"),
    [(_twice, "zb-h1", "called 2 times"), (_layer_penalty, "interleaved", "Stacked")],
)
def test_other_refusals_name_the_schedule_in_use(loss, schedule, words):
    step, state = _step(loss, schedule, "device")
    with pytest.raises(ValueError, match=f"schedule={schedule!r}") as error:
        step(state, _data(1)[0])
    assert words in str(error.value) and "gpipe" in str(error.value)
