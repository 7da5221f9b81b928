"""Stateful metrics: values on 8 devices against NumPy on the same global data."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import assert_same_tree, smap
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed

N_DEV = 8


# --------------------------------------------------------------------------- d9d cases


def test_per_device_sums_sync_never_double_counts(mesh8):
    def per_device(index):
        acc = ed.metrics.MetricAccumulator(0.0).update(10.0).sync("data")
        first = acc.value
        acc = acc.update(10.0)
        unsynced = acc.value  # back to this device's own state
        acc = acc.sync(("data",))
        by_index = ed.metrics.MetricAccumulator(0, "sum").update(index[0]).sync("data")
        return first, acc.value, unsynced[None], acc.local[None], by_index.value

    fn = smap(mesh8, per_device, P("data"), (P(), P(), P("data"), P("data"), P()))
    first, second, unsynced, local, by_index = fn(jnp.arange(N_DEV))
    assert float(first) == 80.0
    assert float(second) == 160.0
    np.testing.assert_array_equal(unsynced, np.full(N_DEV, 20.0))
    np.testing.assert_array_equal(local, np.full(N_DEV, 20.0))
    assert int(by_index) == 28 and by_index.dtype == jnp.int32


def test_max_min_accumulators_across_devices(mesh8):
    def per_device(x):
        hi = ed.metrics.MetricAccumulator(-jnp.inf, ed.metrics.ReduceOp.MAX).update(
            x.max()
        )
        lo = ed.metrics.MetricAccumulator(jnp.inf, "min").update(x.min())
        hi, lo = hi.sync(), lo.sync()
        return hi.value, lo.value

    x = jnp.array([3.0, -1.0, 7.0, 2.0, 0.5, -4.0, 1.0, 6.0])
    hi, lo = smap(mesh8, per_device, P("data"))(x)
    assert float(hi) == 7.0 and float(lo) == -4.0


def test_weighted_mean_half_devices_weight_zero(mesh8):
    def per_device(values, weights):
        return ed.metrics.Mean().update(values, weights).sync().compute()

    values = jnp.arange(16.0)
    weights = jnp.array([1.0] * 8 + [0.0] * 8)  # devices 4..7 have weight 0
    fn = smap(mesh8, per_device, (P("data"), P("data")))
    np.testing.assert_allclose(fn(values, weights), np.mean(np.arange(8.0)))
    assert np.isnan(fn(values, jnp.zeros(16)))


def test_sum_mean_max_min_sequences_with_empty_updates():
    batches = [np.array([1.0, 2.0]), np.zeros((0,)), np.array([[3.0], [-5.0]]), 4.0]
    s, m, hi, lo = (
        ed.metrics.Sum(),
        ed.metrics.Mean(),
        ed.metrics.Max(),
        ed.metrics.Min(),
    )
    assert float(s.compute()) == 0.0 and np.isnan(m.compute())
    assert float(hi.compute()) == -np.inf and float(lo.compute()) == np.inf
    s, m = s.update(np.zeros((0,))), m.update(np.zeros((0, 3)))
    hi, lo = hi.update(np.zeros((0,))), lo.update(np.zeros((0,)))
    assert float(s.compute()) == 0.0 and np.isnan(m.compute())
    assert float(hi.compute()) == -np.inf and float(lo.compute()) == np.inf
    seen = []
    for batch in batches:
        s, m = s.update(batch), m.update(batch)
        hi, lo = hi.update(batch), lo.update(batch)
        seen.extend(np.ravel(batch))
    assert float(s.compute()) == np.sum(seen)
    np.testing.assert_allclose(m.compute(), np.mean(seen))
    assert float(hi.compute()) == 4.0 and float(lo.compute()) == -5.0
    weighted = ed.metrics.Mean().update(np.array([1.0, 3.0]), np.array([True, False]))
    weighted = weighted.update(np.array([5.0, 7.0]), weights=np.array([0.5, 1.5]))
    np.testing.assert_allclose(weighted.compute(), (1 + 2.5 + 10.5) / 3)
    assert np.isnan(ed.metrics.Mean().update(np.ones(3), np.zeros(3)).compute())
    padded = ed.metrics.Mean().update(
        np.array([2.0, np.nan, np.inf]), np.array([1, 0, 0])
    )
    assert float(padded.compute()) == 2.0
    assert int(ed.metrics.Sum(jnp.int32).update(np.array([2, 3])).compute()) == 5


def test_accuracy_predictions_logits_and_mask():
    labels = np.array([0, 1, 2, 1])
    preds = np.array([0, 1, 1, 1])
    assert float(ed.metrics.Accuracy().update(preds, labels).compute()) == 0.75
    logits = np.eye(3, dtype=np.float32)[preds] + 0.1
    mask = np.array([True, True, False, False])
    acc = ed.metrics.Accuracy().update(logits, labels, mask=mask)
    assert float(acc.compute()) == 1.0
    acc = acc.update(preds[None], labels[None], mask=np.array([[False] * 4]))
    assert int(acc.total.value) == 2 and int(acc.correct.value) == 2
    assert np.isnan(ed.metrics.Accuracy().compute())
    assert np.isnan(
        ed.metrics.Accuracy().update(preds, labels, mask=np.zeros(4, bool)).compute()
    )


# ------------------------------------------------------ distributed == global data


def _collection():
    return ed.MetricCollection(
        {
            "acc": ed.metrics.Accuracy(),
            "acc_int": ed.metrics.Accuracy(),
            "loss": ed.metrics.Mean(),
            "weighted": ed.metrics.Mean(),
            "total": ed.metrics.Sum(),
            "peak": ed.metrics.Max(),
            "floor": ed.metrics.Min(),
        }
    )


def _update(metrics, logits, labels, mask, weights):
    loss = jnp.sum(logits**2, axis=-1)
    return metrics.update(
        acc=(logits, labels),
        acc_int={"logits_or_predictions": labels % 2, "labels": labels, "mask": mask},
        loss=(loss,),
        weighted={"values": loss, "weights": weights},
        total=(loss,),
        peak=(logits,),
        floor=(loss,),
    )


def _global_data(rng):
    logits = rng.normal(size=(64, 5)).astype(np.float32)
    labels = rng.integers(0, 5, size=64)
    mask = rng.random(64) < np.repeat(np.linspace(0.0, 1.0, N_DEV), 8)  # uneven
    mask[:8] = False  # device 0 contributes nothing
    weights = rng.random(64).astype(np.float32) * (rng.random(64) < 0.7)
    return logits, labels, mask, weights


def _numpy_reference(logits, labels, mask, weights):
    loss = np.sum(logits.astype(np.float64) ** 2, axis=-1)
    return {
        "acc": np.mean(np.argmax(logits, -1) == labels),
        "acc_int": np.sum(((labels % 2) == labels) & mask) / np.sum(mask),
        "loss": np.mean(loss),
        "weighted": np.sum(loss * weights) / np.sum(weights),
        "total": np.sum(loss),
        "peak": np.max(logits),
        "floor": np.min(loss),
    }


def test_distributed_equals_global_data(axis_types, rng):
    mesh8 = ed.create_data_parallel_mesh(axis_types=axis_types)
    data = _global_data(rng)
    expected = _numpy_reference(*data)

    def per_device(*batch):
        # Two updates per device (two halves of its rows), then one sync.
        half = [x[:2] for x in batch], [x[2:] for x in batch]
        metrics = _update(_collection(), *half[0])
        return _update(metrics, *half[1]).sync("data").compute()

    sharding = NamedSharding(mesh8, P("data"))
    # Placed (on a mesh with Explicit axes `shard_map` checks inputs, not moves).
    placed = [jax.device_put(x, sharding) for x in data]
    collective = smap(mesh8, per_device, P("data"))(*placed)
    global_mode = jax.jit(lambda *b: _update(_collection(), *b).compute())(*placed)
    synced_none = _update(_collection(), *data).sync(None)
    assert synced_none.is_synchronized
    for name, want in expected.items():
        np.testing.assert_allclose(collective[name], want, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(global_mode[name], want, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(
            synced_none.compute()[name], want, rtol=1e-5, err_msg=name
        )


def test_reduce_returns_a_replicated_metric_to_merge_outside(mesh8, rng):
    logits, labels, mask, weights = _global_data(rng)

    def per_device(logits, labels, mask, weights):
        return _update(_collection(), logits, labels, mask, weights).reduce("data")

    step = smap(mesh8, per_device, P("data"))
    halves = [(x[:32], x[32:]) for x in (logits, labels, mask, weights)]
    first = step(*(h[0] for h in halves))
    second = step(*(h[1] for h in halves))
    assert not first.is_synchronized
    merged = first.merge(second).compute()
    expected = _numpy_reference(logits, labels, mask, weights)
    for name, want in expected.items():
        np.testing.assert_allclose(merged[name], want, rtol=1e-5, err_msg=name)


def _sixteen_metrics():
    kinds = (
        [ed.metrics.Mean] * 4
        + [ed.metrics.Accuracy] * 4
        + [ed.metrics.Sum] * 4
        + [ed.metrics.Max] * 2
        + [ed.metrics.Min] * 2
    )
    return ed.MetricCollection({f"m{i}": kind() for i, kind in enumerate(kinds)})


def test_collection_sync_one_collective_per_reduce_op_and_dtype(mesh8):
    metrics = _sixteen_metrics()

    def per_device(x, labels):
        updates = {
            name: (x, labels) if isinstance(m, ed.metrics.Accuracy) else (x[:, 0] * i,)
            for i, (name, m) in enumerate(metrics.metrics.items())
        }
        return metrics.update(**updates).sync("data").compute()

    x = jnp.arange(32.0).reshape(16, 2)
    labels = jnp.arange(16) % 2
    fn = smap(mesh8, per_device, P("data"))
    lowered = fn.lower(x, labels)
    assert len(re.findall(r"stablehlo\.all_reduce", lowered.as_text())) == 4
    hlo = lowered.compile().as_text()
    collectives = re.findall(
        r"= (?:\(.*?\)|\S+) (all-(?:reduce|gather))(?:-start)?\(", hlo
    )
    # Groups: (sum, float32), (sum, int32), (max, float32), (min, float32).
    assert 1 <= len(collectives) <= 4, collectives
    out = fn(x, labels)
    np.testing.assert_allclose(out["m0"], 0.0)
    np.testing.assert_allclose(out["m1"], np.mean(np.arange(0, 32, 2.0)))
    np.testing.assert_allclose(out["m4"], np.mean(np.argmax(x, -1) == labels))
    np.testing.assert_allclose(out["m9"], 9 * np.sum(np.arange(0, 32, 2.0)))
    np.testing.assert_allclose(out["m12"], 12 * 30.0)
    np.testing.assert_allclose(out["m15"], 0.0)


def test_counts_exact_beyond_2_pow_24(mesh8):
    big = 2**24
    acc = ed.metrics.Accuracy().load_state_dict(
        {"correct": {"local": jnp.int32(big)}, "total": {"local": jnp.int32(big)}}
    )
    acc = acc.update(np.array([1, 0]), np.array([1, 1]))
    assert int(acc.correct.value) == big + 1 and int(acc.total.value) == big + 2
    mean = ed.metrics.Mean().load_state_dict(
        {
            "total": {"local": jnp.float32(0.0)},
            "weight": {"local": jnp.float32(0.0)},
            "count": {"local": jnp.int32(big)},
        }
    )
    assert int(mean.update(np.zeros(1)).count.value) == big + 1
    assert int(mean.update(np.zeros(3), weights=np.array([1, 1, 0])).count.value) == (
        big + 2
    )

    def per_device(total):
        state = {"correct": {"local": total[0]}, "total": {"local": total[0]}}
        return (
            ed.metrics.Accuracy()
            .load_state_dict(state)
            .update(jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32))
            .sync()
        )

    synced = jax.jit(
        jax.shard_map(
            lambda t: per_device(t).total.value,
            mesh=mesh8,
            in_specs=P("data"),
            out_specs=P(),
        )
    )(jnp.full(N_DEV, big + 1, jnp.int32))
    assert int(synced) == N_DEV * (big + 2)  # 2**27 + 16: not a float32 integer


def _pair(acc, synchronized=False):
    """The exact total `hi + lo` of a compensated accumulator, as a Python int."""
    state = acc.state_dict()
    key = "synchronized" if synchronized else "local"
    return int(state[key]) + int(state[f"{key}_lo"])


def test_float_weights_beyond_2_pow_24_audit_repro():
    big = 2**24
    m = ed.metrics.Mean().update(jnp.zeros(big), weights=jnp.ones(big))
    assert _pair(m.weight) == big  # one float32 sum of 2**24 ones is exact
    for _ in range(4):
        m = m.update(jnp.array([4.0]), weights=jnp.array([1.0]))
    assert float(m.weight.value) == big + 4 and int(m.count.value) == 0
    np.testing.assert_allclose(m.compute(), np.float32(16.0) / np.float32(big + 4))
    assert m.compute() != np.float32(16.0) / np.float32(big)  # the saturated answer
    m = m.update(jnp.array([4.0]), weights=jnp.array([1.0]))
    assert _pair(m.weight) == big + 5 and _pair(m.total) == 20  # 16777221: not f32
    assert m.state_dict()["weight"] == {"local": big + 4.0, "local_lo": 1.0}
    restored = ed.metrics.Mean().load_state_dict(m.state_dict())
    assert_same_tree(restored, m)
    assert _pair(restored.update(1.0, weights=2.0).weight) == big + 7

    # The weighted sum of values is compensated the same way, and so is `Sum`.
    s = ed.metrics.Sum().update(jnp.ones(big))
    ones = ed.metrics.Mean().update(jnp.ones(big))
    for _ in range(3):
        s, ones = s.update(1.0), ones.update(jnp.ones(1))
    assert _pair(s.total) == big + 3 and float(s.compute()) == big + 4  # rounded
    assert float(ones.compute()) == 1.0 and _pair(ones.total) == big + 3
    assert int(ed.metrics.Sum(jnp.int32).update(np.array([2, 3])).total.value) == 5
    assert ed.metrics.Sum(jnp.int32).state_dict() == {
        "total": {"local": jnp.int32(0), "local_hi": jnp.int32(0)}
    }
    inf = ed.metrics.Sum().update(np.array([1.0, np.inf])).update(1.0)
    assert float(inf.compute()) == np.inf and float(inf.total.local_lo) == 0.0


def _seeded_mean(index):
    """A Mean whose float weight total is 2**24 + 3 * index + 1 and whose weighted
    sum is 2**25 + 5 * index + 1 (neither a float32 number for most indices)."""
    big = 2**24
    weight_hi = jnp.float32(big) + jnp.asarray(index, jnp.float32) * 2
    total_hi = jnp.float32(2 * big) + jnp.asarray(index, jnp.float32) * 4
    return ed.metrics.Mean().load_state_dict(
        {
            "total": {"local": total_hi, "local_lo": jnp.float32(1) + index},
            "weight": {"local": weight_hi, "local_lo": jnp.float32(1) + index},
            "count": {"local": jnp.int32(0)},
        }
    )


def _exact_totals(m):
    return _pair(m.weight), _pair(m.total)


def test_compensated_sync_and_merge_equal_the_global_totals(mesh8):
    big = 2**24
    values = np.arange(16, dtype=np.float32) % 3  # two rows per device
    weights = np.array([1.0, 0.0] * 8, np.float32)
    global_weight = sum(big + 3 * i + 1 for i in range(N_DEV)) + int(weights.sum())
    global_total = sum(2 * big + 5 * i + 1 for i in range(N_DEV))
    global_total += int(values @ weights)
    # Past float32's integers: a float32 state, or a plain float32 all-reduce of the
    # devices' totals, could not hold them.
    assert int(np.float32(global_weight)) != global_weight
    assert int(np.float32(global_total)) != global_total

    def synchronized(m):  # the replicated part of a synced Mean
        pairs = [(acc.synchronized, acc.synchronized_lo) for acc in (m.weight, m.total)]
        return pairs, m.compute()

    def per_device(index, values, weights):
        local = _seeded_mean(index[0]).update(values, weights)
        collection = ed.MetricCollection(
            {"m": local, "n": ed.metrics.Accuracy()}
        ).sync()
        return (
            jax.tree.map(lambda x: x[None], local.state_dict()),
            synchronized(local.sync("data")),
            synchronized(collection["m"]),
            local.reduce("data"),
        )

    fn = smap(mesh8, per_device, P("data"), (P("data"), P(), P(), P()))
    states, synced, in_collection, reduced = fn(
        jnp.arange(N_DEV), jnp.asarray(values), jnp.asarray(weights)
    )
    for pairs, mean in (synced, in_collection):
        exact = [int(hi) + int(lo) for hi, lo in pairs]
        assert exact == [global_weight, global_total]
        np.testing.assert_allclose(mean, global_total / global_weight, rtol=1e-6)
    assert not reduced.is_synchronized
    assert _exact_totals(reduced) == (global_weight, global_total)

    # Merging the eight local states, in either order, gives the same totals.
    devices = [
        ed.metrics.Mean().load_state_dict(jax.tree.map(lambda x, i=i: x[i], states))
        for i in range(N_DEV)
    ]
    for order in (devices, devices[::-1]):
        merged = order[0]
        for other in order[1:]:
            merged = merged.merge(other)
        assert _exact_totals(merged) == (global_weight, global_total)


# ------------------------------------------------------------ merge, state dicts


_ints = st.lists(st.integers(-50, 50), max_size=6)


def _metrics_of(values):
    x = np.asarray(values, np.float32)
    labels = np.abs(np.asarray(values, np.int32)) % 3
    return ed.MetricCollection(
        {
            "sum": ed.metrics.Sum(),
            "mean": ed.metrics.Mean(),
            "max": ed.metrics.Max(),
            "min": ed.metrics.Min(),
            "acc": ed.metrics.Accuracy(),
        }
    ).update(
        sum=(x,),
        mean=(x, labels),
        max=(x,),
        min=(x,),
        acc=(labels % 2, labels),
    )


@settings(max_examples=25, deadline=None)
@given(_ints, _ints, _ints)
def test_merge_is_associative_and_commutative(a, b, c):
    ma, mb, mc = _metrics_of(a), _metrics_of(b), _metrics_of(c)
    left = ma.merge(mb).merge(mc)
    assert_same_tree(left, ma.merge(mb.merge(mc)))
    assert_same_tree(ma.merge(mb), mb.merge(ma))
    # Integer-valued data: merging states is exactly updating with all the data.
    assert_same_tree(left.state_dict(), _metrics_of(a + b + c).state_dict())


def test_state_dict_round_trips(mesh8):
    metrics = _update(_collection(), *_global_data(np.random.default_rng(1)))
    for m in (metrics, metrics.sync(None), metrics.reset()):
        assert_same_tree(_collection().load_state_dict(m.state_dict()), m)
    assert metrics.sync(None).state_dict()["acc"]["total"].keys() == {
        "local",
        "local_hi",
        "synchronized",
        "synchronized_hi",
    }
    acc = ed.metrics.MetricAccumulator(jnp.zeros(3), "max").update(
        jnp.array([1.0, -2.0, 5.0])
    )
    for a in (acc, acc.sync(None)):
        fresh = ed.metrics.MetricAccumulator(jnp.zeros(3), "max")
        assert_same_tree(fresh.load_state_dict(a.state_dict()), a)

    def per_device(x):  # inside shard_map, including the synchronized state
        summed = ed.metrics.Sum().update(x).sync()
        return ed.metrics.Sum().load_state_dict(summed.state_dict()).compute()

    assert float(smap(mesh8, per_device, P("data"))(jnp.arange(8.0))) == 28.0

    # Compensated sums: the rounding errors are saved too; states saved without
    # them (or written by hand) load with errors 0.
    big = ed.metrics.MetricAccumulator(jnp.float32(2**24), compensated=True)
    big = big.update(1.0).update(1.0).update(1.0)
    assert big.compensated and not ed.metrics.MetricAccumulator(0.0).compensated
    for a in (big, big.sync(None), big.sync(None).reset()):
        assert_same_tree(big.load_state_dict(a.state_dict()), a)
    assert big.sync(None).state_dict().keys() == {
        "local",
        "local_lo",
        "synchronized",
        "synchronized_lo",
    }
    assert int(big.local) + int(big.local_lo) == 2**24 + 3
    old = big.load_state_dict({"local": big.local, "synchronized": big.local})
    assert float(old.local_lo) == 0.0 and float(old.synchronized_lo) == 0.0


def test_reset_returns_to_the_initial_state():
    metrics = _update(_collection(), *_global_data(np.random.default_rng(2)))
    assert_same_tree(metrics.reset(), _collection())
    assert_same_tree(metrics.sync(None).reset(), _collection())
    acc = ed.metrics.MetricAccumulator(-1.0, "max").update(3.0)
    assert float(acc.reset().value) == -1.0 and acc.reset().initial.dtype == jnp.float32


# ------------------------------------------------------------- jit, scan, pytrees


def test_jit_with_a_python_loop_of_updates(rng):
    batches = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(5)]
    labels = [rng.integers(0, 3, size=4) for _ in range(5)]

    @jax.jit
    def evaluate(metrics, batches, labels):
        for x, y in zip(batches, labels, strict=True):
            metrics = metrics.update(acc=(x, y), mean=(x,), peak=(x,))
        return metrics

    empty = ed.MetricCollection(
        {
            "acc": ed.metrics.Accuracy(),
            "mean": ed.metrics.Mean(),
            "peak": ed.metrics.Max(),
        }
    )
    metrics = evaluate(empty, batches, labels)
    x, y = np.concatenate(batches), np.concatenate(labels)
    out = metrics.compute()
    np.testing.assert_allclose(out["acc"], np.mean(np.argmax(x, -1) == y))
    np.testing.assert_allclose(out["mean"], np.mean(x), rtol=1e-5)
    np.testing.assert_allclose(out["peak"], np.max(x))
    again = evaluate(metrics, batches, labels).compute()  # same compiled function
    np.testing.assert_allclose(again["acc"], out["acc"])


def test_scan_carry_inside_shard_map(mesh8, rng):
    x = rng.normal(size=(8 * 6, 3)).astype(np.float32)

    def per_device(x):
        minibatches = x.reshape(3, 2, 3)
        first = ed.MetricCollection(
            {"mean": ed.metrics.Mean(), "peak": ed.metrics.Max()}
        ).update(mean=(minibatches[0],), peak=(minibatches[0],))

        def body(metrics, mb):
            new = metrics.reset().update(mean=(mb,), peak=(mb,))
            return metrics.merge(new), None

        merged, _ = jax.lax.scan(body, first, minibatches[1:])
        # A reset carry keeps the per-device type, so it can seed the loop too.
        from_reset, _ = jax.lax.scan(body, first.reset(), minibatches)
        return merged.sync().compute(), from_reset.sync().compute()

    merged, from_reset = smap(mesh8, per_device, P("data"))(x)
    for out in (merged, from_reset):
        np.testing.assert_allclose(out["mean"], np.mean(x), rtol=1e-5)
        np.testing.assert_allclose(out["peak"], np.max(x))


def test_metrics_as_aux_of_a_loss_under_grad_and_scan(mesh8, rng):
    # What a training step does: loss_fn returns metrics, merged over minibatches.
    x = rng.normal(size=(8 * 4, 3)).astype(np.float32)
    labels = rng.integers(0, 3, size=8 * 4)

    def loss_fn(w, x, y):
        logits = x * w
        loss = jnp.mean((logits - 1.0) ** 2, axis=-1)
        metrics = ed.MetricCollection(
            {"loss": ed.metrics.Mean(), "acc": ed.metrics.Accuracy()}
        )
        return jnp.mean(loss), metrics.update(loss=(loss,), acc=(logits, y))

    def per_device(w, x, y):
        grad_fn = jax.grad(loss_fn, has_aux=True)
        mb = (x.reshape(2, 2, 3), y.reshape(2, 2))
        g0, m0 = grad_fn(w, mb[0][0], mb[1][0])

        def body(carry, batch):
            g, m = grad_fn(w, *batch)
            return (carry[0] + g, carry[1].merge(m)), None

        (_, metrics), _ = jax.lax.scan(body, (g0, m0), (mb[0][1:], mb[1][1:]))
        return metrics.reduce("data")

    metrics = smap(mesh8, per_device, (P(), P("data"), P("data")))(
        jnp.float32(0.5), x, labels
    )
    want_loss = np.mean(np.mean((x * 0.5 - 1.0) ** 2, axis=-1))
    np.testing.assert_allclose(metrics.compute()["loss"], want_loss, rtol=1e-5)
    want_acc = np.mean(np.argmax(x * 0.5, -1) == labels)
    np.testing.assert_allclose(metrics.compute()["acc"], want_acc)


def test_collection_is_a_metric_and_nests():
    inner = ed.MetricCollection({"s": ed.metrics.Sum()})
    outer = ed.MetricCollection({"inner": inner, "m": ed.metrics.Mean()})
    assert isinstance(outer, ed.Metric) and isinstance(outer["inner"], ed.Metric)
    assert list(outer) == ["inner", "m"] and len(outer) == 2 and "m" in outer
    outer = outer.update(inner={"s": (np.array([1.0, 2.0]),)}, m=(np.array([4.0]),))
    assert outer.compute() == {"inner": {"s": 3.0}, "m": 4.0}
    assert list(outer.state_dict()) == ["inner", "m"]


class _ScaledMaxAbs(ed.Metric):
    peak: ed.metrics.MetricAccumulator
    scale: jax.Array  # an array leaf that is configuration, not state

    def __init__(self, scale=1.0):
        self.peak = ed.metrics.MetricAccumulator(0.0, "max")
        self.scale = jnp.asarray(scale)

    def update(self, values):
        return eqx.tree_at(
            lambda m: m.peak, self, self.peak.update(jnp.abs(values).max())
        )

    def compute(self):
        return self.peak.value * self.scale


def test_custom_metric_subclass(mesh8):
    def per_device(x):
        metric = _ScaledMaxAbs(2.0).update(x)
        merged = metric.merge(_ScaledMaxAbs(2.0).update(x[::-1] * 0.5))
        return metric.sync().compute(), merged.reduce().compute()

    x = jnp.array([1.0, -9.0, 3.0, 2.0, 0.0, 4.0, -2.0, 5.0])
    synced, reduced = smap(mesh8, per_device, P("data"))(x)
    assert (float(synced), float(reduced)) == (18.0, 18.0)
    assert float(_ScaledMaxAbs(2.0).update(x).reset().compute()) == 0.0
    assert _ScaledMaxAbs().state_dict() == {"peak": {"local": jnp.float32(0.0)}}


# ------------------------------------------------------------------ bad input


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"Unknown `reduce_op` 'mean'.*\['sum', 'max'"):
        ed.metrics.MetricAccumulator(0.0, "mean")
    with pytest.raises(TypeError, match="reduce_op"):
        ed.metrics.MetricAccumulator(0.0, 1)
    with pytest.raises(TypeError, match="bool"):
        ed.metrics.MetricAccumulator(False)
    with pytest.raises(ValueError, match=r"shape \(2,\) does not broadcast.*\(\)"):
        ed.metrics.MetricAccumulator(0.0).update(np.ones(2))
    with pytest.raises(TypeError, match="float32.*int32"):
        ed.metrics.Sum(jnp.int32).update(np.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"`weights` of shape \(3,\).*\(4,\)"):
        ed.metrics.Mean().update(np.ones(4), np.ones(3))
    with pytest.raises(ValueError, match=r"float.*\(4, 2\).*labels.*\(5,\)"):
        ed.metrics.Accuracy().update(np.ones((4, 2), np.float32), np.ones(5, np.int32))
    with pytest.raises(ValueError, match=r"float.*\(4,\).*trailing class axis"):
        ed.metrics.Accuracy().update(np.ones(4, np.float32), np.ones(4, np.int32))
    with pytest.raises(ValueError, match=r"integer.*\(3,\).*\(4,\)"):
        ed.metrics.Accuracy().update(np.ones(3, np.int32), np.ones(4, np.int32))
    with pytest.raises(TypeError, match="`labels` must be integer"):
        ed.metrics.Accuracy().update(
            np.ones((4, 2), np.float32), np.ones(4, np.float32)
        )
    with pytest.raises(ValueError, match=r"`mask` of shape \(3,\)"):
        ed.metrics.Accuracy().update(
            np.ones(4, np.int32), np.ones(4, np.int32), np.ones(3)
        )
    with pytest.raises(TypeError, match="must hold numbers"):
        ed.metrics.Sum().update(np.array(["a"]))

    metrics = ed.MetricCollection(
        {"acc": ed.metrics.Accuracy(), "loss": ed.metrics.Mean()}
    )
    with pytest.raises(ValueError, match=r"no metric named 'los'.*\['acc', 'loss'\]"):
        metrics.update(los=(np.ones(2),))
    with pytest.raises(KeyError, match="no metric named 'x'"):
        metrics["x"]
    with pytest.raises(TypeError, match=r"tuple.*dict.*\(x,\)"):
        metrics.update(loss=np.ones(2))
    with pytest.raises(TypeError, match="metrics"):
        ed.MetricCollection({"m": 1.0})
    with pytest.raises(TypeError, match="Sum.merge: `other` must be a Sum"):
        ed.metrics.Sum().merge(ed.metrics.Mean())
    with pytest.raises(TypeError, match="same structure"):
        metrics.merge(ed.MetricCollection({"acc": ed.metrics.Accuracy()}))
    with pytest.raises(ValueError, match="reduce_op, shape, dtype"):
        ed.metrics.MetricAccumulator(0.0).merge(
            ed.metrics.MetricAccumulator(0.0, "max")
        )
    with pytest.raises(ValueError, match=r"compensated\) = \(.*True\).*False\)"):
        ed.metrics.MetricAccumulator(0.0).merge(
            ed.metrics.MetricAccumulator(0.0, compensated=True)
        )
    with pytest.raises(ValueError, match="`compensated=True` is for sums.*'max'"):
        ed.metrics.MetricAccumulator(0.0, "max", compensated=True)
    with pytest.raises(ValueError, match=r"optionally 'synchronized', got.*local_lo"):
        ed.metrics.MetricAccumulator(0.0).load_state_dict(
            {"local": 0.0, "local_lo": 0.0}
        )
    with pytest.raises(ValueError, match="word of 'synchronized', which is missing"):
        ed.metrics.MetricAccumulator(0.0, compensated=True).load_state_dict(
            {"local": jnp.float32(0), "synchronized_lo": jnp.float32(0)}
        )
    with pytest.raises(ValueError, match="'data' is not bound.*shard_map"):
        ed.metrics.Sum().sync("data")
    with pytest.raises(
        ValueError, match=r"expected the keys \['total'\], got \['tot'\]"
    ):
        ed.metrics.Sum().load_state_dict({"tot": {"local": jnp.float32(0)}})
    with pytest.raises(
        ValueError, match=r"'local' has shape \(2,\).*expected shape \(\)"
    ):
        ed.metrics.Sum().load_state_dict({"total": {"local": jnp.zeros(2)}})
    with pytest.raises(ValueError, match="dtype int32.*dtype float32"):
        ed.metrics.Sum().load_state_dict({"total": {"local": jnp.int32(0)}})
