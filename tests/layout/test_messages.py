"""The messages between pipeline stages (`_layout/pipeline/messages.py`): by
`all_to_all` on XLA:CPU and by `ppermute`s elsewhere, the same values either
way. The CPU devices run the `all_to_all` path in every other pipeline test;
here the `ppermute` path (the one GPUs take) runs on them too."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import PipeNet, pipe_batches, pipe_loss
from jax.sharding import PartitionSpec as P

import eqxdist as ed
from eqxdist._layout.pipeline import messages


def _mesh(stages):
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    return jax.make_mesh((stages, 8 // stages), ("stage", "data"), axis_types=explicit)


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("all_to_all", [False, True])
def test_each_stage_receives_its_neighbours_values(
    monkeypatch, stages, ring, all_to_all
):
    """Stage s receives stage s - 1's `ahead` and stage s + 1's `back`
    (round the ring, or zeros at the ends), written out in NumPy."""
    monkeypatch.setattr(messages, "by_all_to_all", lambda: all_to_all)
    mesh = _mesh(stages)
    rows = 8 // stages * 3
    ahead = np.arange(stages * rows * 5, dtype=np.float32).reshape(stages * rows, 5)
    back = -ahead - 1

    def f(a, b):
        got_a, got_b = messages.exchange(
            [a], [b], axis="stage", stages=stages, ring=ring
        )
        return got_a[0], got_b[0]

    spec = P("stage")
    run = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    placed = jax.NamedSharding(mesh, spec)
    got_a, got_b = run(jax.device_put(ahead, placed), jax.device_put(back, placed))
    want_a, want_b = np.zeros_like(ahead), np.zeros_like(back)
    blocks = lambda x: x.reshape(stages, rows, 5)  # noqa: E731
    for s in range(stages):
        if s > 0 or ring:
            blocks(want_a)[s] = blocks(ahead)[(s - 1) % stages]
        if s < stages - 1 or ring:
            blocks(want_b)[s] = blocks(back)[(s + 1) % stages]
    np.testing.assert_array_equal(np.asarray(got_a), want_a)
    np.testing.assert_array_equal(np.asarray(got_b), want_b)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_a_pipeline_step_is_the_same_by_ppermutes(monkeypatch, schedule):
    """A step of GPipe (JAX differentiates its loop) and of interleaved 1F1B
    (round the ring, both ways in a row) by `ppermute`s equals the same step
    by `all_to_all` (which the other tests compare with one device)."""
    sgd = optax.sgd(0.1)
    repeats = 2 if schedule == "interleaved" else 1
    pipeline = ed.Pipeline("stage", 4, schedule=schedule, repeats=repeats)
    batch = pipe_batches(1, rows=64)[0]
    states, permutes = [], []
    for all_to_all in (True, False):
        monkeypatch.setattr(messages, "by_all_to_all", lambda a=all_to_all: a)
        mesh = ed.create_device_mesh({"stage": 4, "data": 2})
        step = ed.make_train_step(pipe_loss, sgd, mesh, pipeline=pipeline)
        state = step.place_state(
            ed.TrainState.create(PipeNet(layers=8), sgd, jax.random.key(1))
        )
        text = step.lower(state, batch).compile().as_text()
        permutes.append(text.count("collective-permute("))
        state, _ = step(state, batch)
        states.append(state.model)
    for a, b in zip(*(jax.tree.leaves(s) for s in states), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(states[0]))
    # The slot loop's messages are the collective-permutes the `ppermute`
    # path adds (interleaved 1F1B's move into chunk order has its own).
    assert permutes[1] > permutes[0], permutes
