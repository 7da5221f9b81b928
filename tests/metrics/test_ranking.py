"""`AveragePrecision` on 8 devices against scikit-learn's
`average_precision_score` on the concatenated data: one update, merged, synced
inside `shard_map`, with a mask and weights; within 1e-2 at 200 thresholds and
converging with more; ties."""

import numpy as np
from harness import one_and_merged, synced
from sklearn import metrics as skm

import eqxdist as ed

N_DEV, ROWS = 8, 16


def _data(seed=0):
    rng = np.random.default_rng(seed)
    n = N_DEV * ROWS
    scores = rng.random(n).astype(np.float32)
    labels = (rng.random(n) < 0.3 + 0.5 * scores).astype(np.int32)
    mask = rng.random(n) < 0.8
    weights = rng.random(n).astype(np.float32)
    return scores, labels, mask, weights


def _collection():
    return ed.MetricCollection(
        {
            "ap": ed.metrics.AveragePrecision(),
            "ap_w": ed.metrics.AveragePrecision(),
            "ap_fine": ed.metrics.AveragePrecision(num_thresholds=8192),
            "ap_fine_w": ed.metrics.AveragePrecision(num_thresholds=8192),
        }
    )


def _update(metrics, s, y, m, w):
    return metrics.update(
        ap=(s, y, m),
        ap_w={"scores": s, "labels": y, "mask": m, "weights": w},
        ap_fine=(s, y, m),
        ap_fine_w=(s, y, m, w),
    )


def _check(computed, data):
    s, y, m, w = data
    want = skm.average_precision_score(y[m], s[m])
    want_w = skm.average_precision_score(y[m], s[m], sample_weight=w[m])
    assert abs(float(computed["ap"]) - want) < 1e-2
    assert abs(float(computed["ap_w"]) - want_w) < 1e-2
    assert abs(float(computed["ap_fine"]) - want) < 1e-3
    assert abs(float(computed["ap_fine_w"]) - want_w) < 1e-3


def test_one_update_merged_and_synced_match_sklearn(mesh8):
    data = _data()

    one, merged = one_and_merged(_collection, _update, data)
    _check(one, data)
    _check(merged, data)
    for name in one:
        np.testing.assert_allclose(merged[name], one[name], rtol=1e-6)

    rows = (slice(0, 5), slice(5, None))
    on_devices = synced(mesh8, _collection, _update, data, rows, compute=True)
    _check(on_devices, data)
    for name in one:
        np.testing.assert_allclose(on_devices[name], one[name], rtol=1e-5)


def test_converges_to_sklearn_with_more_thresholds():
    s, y, _, w = _data(1)
    want = skm.average_precision_score(y, s, sample_weight=w)
    errors = [
        abs(
            float(ed.metrics.AveragePrecision(t).update(s, y, weights=w).compute())
            - want
        )
        for t in (10, 200, 20000)
    ]
    assert errors[1] < 1e-2 and errors[2] < 1e-4, errors
    assert errors[2] < errors[1] < errors[0], errors


def test_ties_and_missing_positives():
    # Scores on a grid of 21 values: each has its own bin at 200 thresholds, so
    # equal scores are ties in both definitions and the binned value is exact.
    rng = np.random.default_rng(2)
    s = (rng.integers(0, 21, 60) / 20).astype(np.float32)
    y = (rng.random(60) < s).astype(np.int32)
    got = ed.metrics.AveragePrecision().update(s, y).compute()
    np.testing.assert_allclose(got, skm.average_precision_score(y, s), rtol=1e-6)
    # Boolean labels, an all-False mask, no positive: NaN (scikit-learn: 0).
    ap = ed.metrics.AveragePrecision().update(
        s, y.astype(bool), mask=np.zeros(60, bool)
    )
    assert np.isnan(ap.compute())
    assert np.isnan(
        ed.metrics.AveragePrecision().update(s, np.zeros(60, int)).compute()
    )
    # Weight 0 is the same as leaving the example out.
    w = (rng.random(60) < 0.5).astype(np.float32)
    keep = w != 0
    weighted = ed.metrics.AveragePrecision().update(s, y, weights=w).compute()
    dropped = ed.metrics.AveragePrecision().update(s[keep], y[keep]).compute()
    np.testing.assert_allclose(weighted, dropped, rtol=1e-6)
