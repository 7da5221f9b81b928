"""The compiled-step cache on its own, with a toy step (no optimizer, FSDP or
metrics): compilation per structure, donation groups, consumed states, batches in
another layout, the bound on steps in flight."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from eqxdist._step.compiled import CompiledStep, Placement


class Toy(eqx.Module):
    w: jax.Array
    k: jax.Array

    def __getitem__(self, name):
        return getattr(self, name)


def _toy(w, k):
    return Toy(jnp.asarray(w), jnp.asarray(k))


def _cache(mesh, traces, donate=True, max_in_flight=4):
    def fn(state, batch):
        traces.append(1)
        return Toy(state.w + batch.mean(), state.k), {"sum": batch.sum()}

    return CompiledStep(
        fn,
        mesh,
        describe=lambda s: Placement(Toy(P("data"), P()), Toy(False, True)),
        batch_sharding=NamedSharding(mesh, P("data")),
        leaf_sharding=lambda ndim: NamedSharding(mesh, P("data")),
        donate=donate,
        max_in_flight=max_in_flight,
        check_batch=lambda b: None,
        name="toy step",
    )


def test_compiles_once_and_computes(mesh8):
    traces = []
    step = _cache(mesh8, traces)
    state = _toy(np.zeros(8, np.float32), np.float32(3.0))
    batch = np.arange(16, dtype=np.float32)
    for _ in range(5):
        state, aux = step(state, batch)
    assert len(traces) == 1
    np.testing.assert_allclose(state["w"], np.full(8, 5 * 7.5))
    assert float(aux["sum"]) == 120.0
    assert state["w"].sharding.spec == P("data")
    # A new structure compiles again.
    step(_toy(np.zeros(8, np.float32), np.float32(3.0)), [batch][0][:8])
    assert len(traces) == 2


def test_donates_only_its_own_state(mesh8):
    step = _cache(mesh8, [])
    w = jax.device_put(np.ones(8, np.float32), NamedSharding(mesh8, P("data")))
    mine = _toy(w, jnp.float32(1.0))
    s2, _ = step(mine, np.ones(16, np.float32))
    assert not w.is_deleted()  # the caller's array: copied, not donated
    s3, _ = step(s2, np.ones(16, np.float32))
    assert s2["w"].is_deleted()  # the step's own state: donated
    assert not s3["k"].is_deleted() and s3["k"] is s2["k"]  # kept, not donated
    with pytest.raises(
        ValueError, match=r"toy step: `state` was consumed.*at \.w was donated"
    ):
        step(s2, np.ones(16, np.float32))


def test_moves_a_batch_in_another_layout(mesh8):
    traces = []
    step = _cache(mesh8, traces)
    state = _toy(np.zeros(8, np.float32), np.float32(0.0))
    replicated = jax.device_put(np.ones(16, np.float32), NamedSharding(mesh8, P()))
    state, aux = step(state, replicated)  # jit alone would reject it
    assert float(aux["sum"]) == 16.0
    np.testing.assert_allclose(state["w"], 1.0)


def test_no_donation(mesh8):
    step = _cache(mesh8, [], donate=False)
    state = _toy(np.zeros(8, np.float32), np.float32(0.0))
    s2, _ = step(state, np.ones(16, np.float32))
    s3, _ = step(s2, np.ones(16, np.float32))
    assert not s2["w"].is_deleted()
    np.testing.assert_allclose(s3["w"], 2.0)


def test_bounds_steps_in_flight(mesh8):
    step = _cache(mesh8, [], max_in_flight=2)
    state = _toy(np.zeros(8, np.float32), np.float32(0.0))
    for _ in range(10):
        state, _ = step(state, np.ones(16, np.float32))
        assert len(step._in_flight) <= 2
    np.testing.assert_allclose(state["w"], 10.0)
