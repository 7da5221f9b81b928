"""The numbers behind metrics: exact integer totals past 2**31 (within one update,
host integers wider than int32), `Mean(float16)`, integer states that must say what
they are, and state dicts saved by eqxdist 0.2 loading unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import smap
from jax.sharding import PartitionSpec as P

import eqxdist as ed
from eqxdist._metrics import numerics as num

N_DEV = 8


def _exact(acc):
    """A carried integer state as Python ints, from its two words."""
    lo, hi = acc.words if acc.synchronized_words is None else acc.synchronized_words
    return int(np.asarray(hi, np.int64)) * 2**16 + int(np.asarray(lo, np.int64))


# ------------------------------------------------------- integers that wrapped


def test_integer_weights_summing_past_2_pow_31_in_one_update():
    values = np.array([5.0, 5.0], np.float32)
    weights = np.array([2**31 - 1, 1], np.int32)
    mean = ed.metrics.Mean().update(values, weights)
    assert float(mean.compute()) == 5.0
    assert _exact(mean.count) == int(np.sum(weights.astype(np.int64)))
    quarter = ed.metrics.Mean().update(
        np.arange(4.0, dtype=np.float32), np.full(4, 2**30)
    )
    np.testing.assert_allclose(quarter.compute(), np.mean(np.arange(4.0)), rtol=1e-7)
    assert _exact(quarter.count) == 2**32


def test_int32_sum_past_2_pow_31_in_one_update_and_many_entries(rng):
    total = ed.metrics.Sum(jnp.int32).update(np.full(4, 2**30, np.int32))
    assert _exact(total.total) == 2**32
    assert float(total.total.value_as(jnp.float32)) == 2.0**32
    assert int(total.compute()) == 2**31 - 1  # saturated, never wrapped
    # More entries than one block of low words (2**14), negatives included.
    big = rng.integers(-(2**31), 2**31, size=2**15 + 3, dtype=np.int64)
    big = big.astype(np.int32)
    summed = ed.metrics.Sum(jnp.int32).update(big)
    assert _exact(summed.total) == int(big.astype(np.int64).sum())
    jitted = jax.jit(lambda m, x: m.update(x))(ed.metrics.Sum(jnp.int32), big)
    assert _exact(jitted.total) == int(big.astype(np.int64).sum())
    # Unsigned 32-bit words past 2**31 each.
    unsigned = np.array([2**32 - 1, 2**31], np.uint32)
    assert _exact(ed.metrics.Sum(jnp.int32).update(unsigned).total) == 2**32 - 1 + 2**31


def test_host_integers_wider_than_int32():
    wide = np.array([3_000_000_000, 5], np.int64)
    exact = ed.metrics.Sum(jnp.int32).update(wide).update(2**40)
    assert _exact(exact.total) == 3_000_000_005 + 2**40
    assert float(ed.metrics.Sum().update(wide).compute()) == float(np.float32(3e9 + 5))
    std = ed.metrics.Std().update(np.array([2**40, 2**40 + 2**20], np.int64))
    np.testing.assert_allclose(std.compute(), np.std([2.0**40, 2.0**40 + 2**20]))
    assert (
        float(ed.metrics.Std().update(2**40).update(2**40).compute()) == 0.0
    )  # Python ints
    np.testing.assert_allclose(
        ed.metrics.Max().update(np.array([2**40, 7])).compute(), 2.0**40
    )
    with pytest.raises(ValueError, match=r"beyond what a carried int32 sum holds"):
        ed.metrics.Sum(jnp.int32).update(np.array([2**62, 2**62], np.int64))


@pytest.mark.parametrize(
    "call",
    [
        lambda: ed.metrics.Accuracy().update(
            np.array([2**32, 1], np.int64), np.array([0, 1])
        ),
        lambda: ed.metrics.Accuracy().update(0, 2**40),
        lambda: ed.metrics.F1Score(3).update(0, 2**40),
        lambda: ed.metrics.AUROC().update(np.float32(0.5), 2**40),
        lambda: ed.metrics.ConfusionMatrix(2).update(
            np.array([3_000_000_000, 0]), np.array([0, 1])
        ),
    ],
)
def test_integers_beyond_int32_as_labels_are_refused_clearly(call):
    with pytest.raises(ValueError, match=r"holds the integer \d+, outside int32"):
        call()


def test_integer_totals_past_2_pow_31_synced_across_devices(mesh8):
    weights = np.full((N_DEV, 4), 2**30, np.int32)  # 2**32 per device
    values = np.arange(N_DEV * 4, dtype=np.float32).reshape(N_DEV, 4)

    def per_device(v, w):
        mean = ed.metrics.Mean().update(v, w).sync("data")
        count = ed.metrics.Sum(jnp.int32).update(w).sync("data")
        return mean.compute(), count.total.synchronized_words

    mean, (lo, hi) = smap(mesh8, per_device, (P("data"), P("data")))(values, weights)
    np.testing.assert_allclose(mean, np.mean(values), rtol=1e-6)
    assert int(hi) * 2**16 + int(lo) == N_DEV * 2**32


# ------------------------------------------------------------- float16 and kin


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_mean_in_narrow_floats_is_the_rounded_exact_mean(mesh8, rng, dtype):
    values = rng.normal(3.0, 2.0, size=(N_DEV, 512)).astype(dtype)
    weights = rng.integers(0, 3, size=(N_DEV, 512)).astype(np.int32)
    as64 = np.asarray(values, np.float64)
    expected = np.sum(as64 * weights) / np.sum(weights)
    local = ed.metrics.Mean(dtype).update(values, weights)
    # Narrow floats: the exact mean rounded once, within half a unit in the last
    # place (a float16 batch sum rounded to float16 first is off by more).
    # float32 sums its batches in float32: within two units.
    ulp = float(jnp.finfo(dtype).eps) * 2.0 ** np.floor(np.log2(abs(expected)))
    ulp *= 2.0 if dtype == jnp.float32 else 0.5 * (1 + 1e-3)
    assert local.compute().dtype == dtype
    assert abs(float(local.compute()) - expected) <= ulp
    unweighted = ed.metrics.Mean(dtype).update(values).update(values[:2])
    both = np.concatenate([as64.ravel(), as64[:2].ravel()])
    assert abs(float(unweighted.compute()) - both.mean()) <= ulp

    def per_device(v, w):
        return ed.metrics.Mean(dtype).update(v, w).sync("data").compute()

    synced = smap(mesh8, per_device, (P("data"), P("data")))(values, weights)
    assert abs(float(synced) - expected) <= ulp
    assert np.isnan(float(ed.metrics.Mean(jnp.float16).compute()))


# --------------------------------------------------------- states that say so


def test_compensated_python_int_is_a_clear_error():
    with pytest.raises(TypeError, match=r"compensated=True.*Python int 0.*ambiguous"):
        ed.metrics.MetricAccumulator(0, compensated=True)
    count = ed.metrics.MetricAccumulator(jnp.int32(0), compensated=True).update(2**30)
    assert _exact(count.update(2**30).update(2**30)) == 3 * 2**30
    total = ed.metrics.MetricAccumulator(0.0, compensated=True).update(
        jnp.float32(2**24)
    )
    hi, lo = total.update(1.0).words  # 2**24 + 1 is not a float32
    assert float(hi) + float(lo) == 2**24 + 1


def test_update_sum_refuses_non_scalar_or_non_sum_states():
    with pytest.raises(TypeError, match=r"update_sum: only for scalar sums.*\(2,\)"):
        ed.metrics.MetricAccumulator(jnp.zeros(2)).update_sum(np.ones(3))
    with pytest.raises(TypeError, match=r"update_sum: only for scalar sums.*'max'"):
        ed.metrics.MetricAccumulator(0.0, "max").update_sum(np.ones(3))


# ----------------------------------------------------- eqxdist 0.2 state dicts


def _v02_metrics():
    """The updates that produced `V02_STATE_DICT` with eqxdist 0.2's code."""
    return ed.MetricCollection(
        {
            "sum": ed.metrics.Sum()
            .update(jnp.float32(2**24))
            .update(jnp.array([1.0, 1.0, 0.25])),
            "isum": ed.metrics.Sum(jnp.int32)
            .update(2**30)
            .update(2**30)
            .update(2**30)
            .update(7),
            "mean": ed.metrics.Mean()
            .update(jnp.array([1.0, 3.0]))
            .update(jnp.array([10.0, 2.0]), weights=jnp.array([0.5, 0.0]))
            .update(jnp.array([4.0]), weights=jnp.array([3])),
            "max": ed.metrics.Max().update(jnp.array([1.0, 5.0])),
            "std": ed.metrics.Std().update(jnp.array([1.0, 2.0, 4.0])),
            "last": ed.metrics.LastValue().update(0.25),
            "acc": ed.metrics.Accuracy().update(
                jnp.array([0, 1, 1, 2]), jnp.array([0, 1, 2, 2])
            ),
            "auroc": ed.metrics.AUROC(num_thresholds=4).update(
                jnp.array([0.1, 0.6, 0.8, 0.3]), jnp.array([0, 1, 1, 0])
            ),
            "cm": ed.metrics.ConfusionMatrix(2).update(
                jnp.array([0, 1, 1]), jnp.array([0, 1, 0])
            ),
            "ppl": ed.metrics.Perplexity().update(
                jnp.array([[0.0, 1.0], [2.0, 0.0]]), jnp.array([1, 0])
            ),
        }
    ).sync(None)


# Written by eqxdist 0.2 (main at 4b58bd0): `_v02_metrics().state_dict()`.
V02_STATE_DICT = {
    "sum": {
        "total": {
            "local": np.array(16777218.0, np.float32),
            "synchronized": np.array(16777218.0, np.float32),
            "local_lo": np.array(0.25, np.float32),
            "synchronized_lo": np.array(0.25, np.float32),
        },
    },
    "isum": {
        "total": {
            "local": np.array(7, np.int32),
            "synchronized": np.array(7, np.int32),
            "local_hi": np.array(49152, np.int32),
            "synchronized_hi": np.array(49152, np.int32),
        },
    },
    "mean": {
        "total": {
            "local": np.array(21.0, np.float32),
            "synchronized": np.array(21.0, np.float32),
            "local_lo": np.array(0.0, np.float32),
            "synchronized_lo": np.array(0.0, np.float32),
        },
        "weight": {
            "local": np.array(0.5, np.float32),
            "synchronized": np.array(0.5, np.float32),
            "local_lo": np.array(0.0, np.float32),
            "synchronized_lo": np.array(0.0, np.float32),
        },
        "count": {
            "local": np.array(5, np.int32),
            "synchronized": np.array(5, np.int32),
            "local_hi": np.array(0, np.int32),
            "synchronized_hi": np.array(0, np.int32),
        },
    },
    "max": {
        "best": {
            "local": np.array(5.0, np.float32),
            "synchronized": np.array(5.0, np.float32),
        },
    },
    "std": {
        "moments": {
            "local": np.array(
                [3.0, 2.3333332538604736, 7.947286206899662e-08, 4.6666669845581055],
                np.float32,
            ),
            "synchronized": np.array(
                [3.0, 2.3333332538604736, 7.947286206899662e-08, 4.6666669845581055],
                np.float32,
            ),
        },
    },
    "last": {
        "last": {
            "local": np.array([1.0, 0.25], np.float32),
            "synchronized": np.array([1.0, 0.25], np.float32),
        },
    },
    "acc": {
        "correct": {
            "local": np.array(3, np.int32),
            "synchronized": np.array(3, np.int32),
            "local_hi": np.array(0, np.int32),
            "synchronized_hi": np.array(0, np.int32),
        },
        "total": {
            "local": np.array(4, np.int32),
            "synchronized": np.array(4, np.int32),
            "local_hi": np.array(0, np.int32),
            "synchronized_hi": np.array(0, np.int32),
        },
    },
    "auroc": {
        "histograms": {
            "local": np.array([[1, 1, 0, 0], [0, 0, 1, 1]], np.int32),
            "synchronized": np.array([[1, 1, 0, 0], [0, 0, 1, 1]], np.int32),
            "local_hi": np.array([[0, 0, 0, 0], [0, 0, 0, 0]], np.int32),
            "synchronized_hi": np.array([[0, 0, 0, 0], [0, 0, 0, 0]], np.int32),
        },
    },
    "cm": {
        "counts": {
            "local": np.array([[1, 1], [0, 1]], np.int32),
            "synchronized": np.array([[1, 1], [0, 1]], np.int32),
            "local_hi": np.array([[0, 0], [0, 0]], np.int32),
            "synchronized_hi": np.array([[0, 0], [0, 0]], np.int32),
        },
    },
    "ppl": {
        "nll": {
            "total": {
                "local": np.array(0.4401897192001343, np.float32),
                "synchronized": np.array(0.4401897192001343, np.float32),
                "local_lo": np.array(0.0, np.float32),
                "synchronized_lo": np.array(0.0, np.float32),
            },
            "weight": {
                "local": np.array(0.0, np.float32),
                "synchronized": np.array(0.0, np.float32),
                "local_lo": np.array(0.0, np.float32),
                "synchronized_lo": np.array(0.0, np.float32),
            },
            "count": {
                "local": np.array(2, np.int32),
                "synchronized": np.array(2, np.int32),
                "local_hi": np.array(0, np.int32),
                "synchronized_hi": np.array(0, np.int32),
            },
        },
    },
}


def _flatten(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, (*prefix, key))
        else:
            yield (*prefix, key), np.asarray(value)


def test_state_dicts_of_eqxdist_0_2_load_unchanged():
    now = _v02_metrics()
    loaded = ed.MetricCollection(
        {name: metric.reset() for name, metric in now.metrics.items()}
    ).load_state_dict(V02_STATE_DICT)
    assert loaded.is_synchronized
    # Every saved key and value is read back as it was written...
    saved = dict(_flatten(V02_STATE_DICT))
    again = dict(_flatten(loaded.state_dict()))
    added = {key for key in again if key[1] == "weighted"}  # v0.3's weighted states
    assert set(again) - added == set(saved)
    for key, value in saved.items():
        assert again[key].dtype == value.dtype
        np.testing.assert_array_equal(again[key], value, err_msg=str(key))
    # ...and today's code, from the same updates, writes the same state dict.
    for key, value in _flatten(now.state_dict()):
        if key not in added:
            np.testing.assert_array_equal(value, saved[key], err_msg=str(key))
    for name, value in now.compute().items():
        np.testing.assert_array_equal(loaded.compute()[name], value, err_msg=name)


# ------------------------------------------------------ the representations


F32 = jnp.dtype(jnp.float32)


def _as_int(words):
    return sum(int(np.asarray(w, np.int64)) << (16 * i) for i, w in enumerate(words))


@pytest.mark.parametrize(
    "rep, a, b, exact",
    [
        (num.Plain(num.ReduceOp.MAX), jnp.float32(1), jnp.float32(3), 3),
        (num.Plain(num.ReduceOp.SUM), jnp.int32(5), jnp.int32(-7), -2),
        (num.Compensated(), jnp.float32(2**24), jnp.float32(1), 2**24 + 1),
        (num.Carried(), jnp.int32(2**31 - 1), jnp.int32(2**31 - 1), 2**32 - 2),
        (num.Folded(fold=jnp.minimum), jnp.float32(4), jnp.float32(2), 2),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, num.Plain) else "",
)
def test_every_representation_answers_the_same_questions(rep, a, b, exact):
    words = rep.add(rep.start(a), rep.encode(b))
    assert len(words) == (2 if rep.second else 1)
    if isinstance(rep, num.Carried):
        assert _as_int(words) == exact
        assert float(rep.value_as(words, F32)) == float(np.float32(exact))
        assert int(rep.value(words)) == 2**31 - 1  # saturated, never wrapped
    else:
        assert sum(float(w) for w in words) == exact
    # A state dict's words load back as they were; a missing second word is 0.
    loaded = rep.load(words[0], words[1] if rep.second else None)
    for x, y in zip(loaded, words, strict=True):
        assert x.dtype == y.dtype and np.asarray(x) == np.asarray(y)
    if rep.second:
        alone = rep.load(words[0], None)
        assert float(rep.value_as(alone, F32)) == float(words[0])
    if not isinstance(rep, num.Folded):
        # On one device, the sync parts reduce to themselves.
        again = rep.from_sync_parts(rep.sync_parts(words, ()))
        assert float(rep.value_as(again, F32)) == float(rep.value_as(words, F32))
