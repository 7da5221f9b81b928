"""Regression metrics on 8 devices against scikit-learn and NumPy float64 on the
concatenated data: one update, several merged, and synced inside `shard_map`;
unweighted and weighted; constant targets and weight-0 NaNs."""

import jax
import numpy as np
import pytest
from harness import assert_matches, one_and_merged, synced
from hypothesis import given, settings, strategies as st
from sklearn import metrics as skm

import eqxdist as ed

N_DEV, ROWS = 8, 6
KINDS = {
    "mse": ed.metrics.MeanSquaredError,
    "rmse": lambda: ed.metrics.MeanSquaredError(squared=False),
    "mae": ed.metrics.MeanAbsoluteError,
    "msle": ed.metrics.MeanSquaredLogError,
    "r2": ed.metrics.R2Score,
    "pearson": ed.metrics.PearsonCorrCoef,
}


def _data(seed=0):
    rng = np.random.default_rng(seed)
    n = N_DEV * ROWS
    preds = rng.gamma(2.0, size=(n, 3)).astype(np.float32)
    targets = np.abs(0.8 * preds + 0.5 * rng.normal(size=(n, 3))).astype(np.float32)
    # One weight per row (broadcast over the 3 outputs); some rows weigh 0.
    weights = rng.random((n, 1)) * (rng.random((n, 1)) < 0.8)
    return preds, targets, weights.astype(np.float32)


def _collection():
    metrics = {name: kind() for name, kind in KINDS.items()}
    metrics |= {f"{name}_w": kind() for name, kind in KINDS.items()}
    return ed.MetricCollection(metrics)


def _update(metrics, preds, targets, weights):
    args = {name: (preds, targets) for name in KINDS}
    args |= {f"{name}_w": (preds, targets, weights) for name in KINDS}
    return metrics.update(**args)


def _pearson(x, y, w):
    mx, my = np.average(x, weights=w), np.average(y, weights=w)
    cxy = np.sum(w * (x - mx) * (y - my))
    return cxy / np.sqrt(np.sum(w * (x - mx) ** 2) * np.sum(w * (y - my) ** 2))


def _expected(preds, targets, weights):
    p, t = preds.astype(np.float64).ravel(), targets.astype(np.float64).ravel()
    out = {}
    for suffix, w in (
        ("", np.ones_like(p)),
        ("_w", np.broadcast_to(weights, preds.shape).ravel().astype(np.float64)),
    ):
        out["mse" + suffix] = skm.mean_squared_error(t, p, sample_weight=w)
        out["rmse" + suffix] = skm.root_mean_squared_error(t, p, sample_weight=w)
        out["mae" + suffix] = skm.mean_absolute_error(t, p, sample_weight=w)
        out["msle" + suffix] = skm.mean_squared_log_error(t, p, sample_weight=w)
        out["r2" + suffix] = skm.r2_score(t, p, sample_weight=w)
        out["pearson" + suffix] = _pearson(p, t, w)
    out["pearson"] = np.corrcoef(p, t)[0, 1]
    return out


def _assert_matches(computed, expected):
    assert_matches(computed, expected, rtol=2e-5)


def test_one_update_merged_and_synced_match_sklearn(mesh8):
    preds, targets, weights = _data()
    expected = _expected(preds, targets, weights)

    data = (preds, targets, weights)
    one, merged = one_and_merged(_collection, _update, data)
    _assert_matches(one, expected)
    _assert_matches(merged, expected)

    rows = (slice(0, 2), slice(2, None))
    _assert_matches(synced(mesh8, _collection, _update, data, rows).compute(), expected)


def test_r2_and_pearson_edge_cases():
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    constant = np.full(4, 2.0, np.float32)
    # Constant targets: 1 for perfect predictions, 0 otherwise (force_finite).
    assert float(ed.metrics.R2Score().update(constant, constant).compute()) == 1.0
    assert skm.r2_score(constant, constant) == 1.0
    assert float(ed.metrics.R2Score().update(x, constant).compute()) == 0.0
    assert skm.r2_score(constant, x) == 0.0
    # Fewer than two observations: NaN (as scikit-learn, which warns).
    assert np.isnan(ed.metrics.R2Score().update(x[:1], x[:1] + 1).compute())
    assert np.isnan(ed.metrics.R2Score().compute())
    # A constant side has no correlation.
    assert np.isnan(ed.metrics.PearsonCorrCoef().update(x, constant).compute())
    assert float(
        ed.metrics.PearsonCorrCoef().update(x, -3 * x + 1).compute()
    ) == pytest.approx(-1)
    # Weight 0 leaves an element out, NaN or not.
    nan = np.array([1.0, np.nan, 3.0, 4.0], np.float32)
    w = np.array([1, 0, 1, 1], np.float32)
    keep = w != 0
    for kind in KINDS.values():
        got = kind().update(nan, x[::-1].copy(), w).compute()
        want = kind().update(nan[keep], x[::-1][keep]).compute()
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.isnan(ed.metrics.MeanSquaredError().compute())


def test_moments_stay_accurate_with_a_large_offset():
    """Targets at 1e3 x their spread, merged from 16 small batches: no sum of
    squares minus a squared sum, so float32 keeps R2 and the correlation."""
    rng = np.random.default_rng(1)
    t = 1e3 + rng.normal(size=(16, 8))
    p = t + 0.3 * rng.normal(size=t.shape)
    r2, pearson = ed.metrics.R2Score(), ed.metrics.PearsonCorrCoef()
    for i in range(16):
        r2 = r2.merge(
            ed.metrics.R2Score().update(
                p[i].astype(np.float32), t[i].astype(np.float32)
            )
        )
        pearson = pearson.update(p[i].astype(np.float32), t[i].astype(np.float32))
    p32, t32 = (
        p.astype(np.float32).astype(np.float64),
        t.astype(np.float32).astype(np.float64),
    )
    np.testing.assert_allclose(
        r2.compute(), skm.r2_score(t32.ravel(), p32.ravel()), atol=1e-4
    )
    np.testing.assert_allclose(
        pearson.compute(), np.corrcoef(p32.ravel(), t32.ravel())[0, 1], atol=1e-4
    )


@jax.jit
def _split_and_merge(p, t, w, assign):
    """Three states of a split of the same data (by weight 0 elsewhere), merged in
    several orders, and the state of the whole."""
    out = {}
    for name in ("r2", "pearson", "mse"):
        kind = KINDS[name]
        a, b, c = (kind().update(p, t, w * (assign == k)) for k in range(3))
        out[name] = [
            kind().update(p, t, w).compute(),
            a.merge(b).merge(c).compute(),
            a.merge(b.merge(c)).compute(),
            c.merge(a).merge(b).compute(),
        ]
    return out


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_merges_are_exact_in_any_order(seed):
    rng = np.random.default_rng(seed)
    p = (rng.normal(size=24) * rng.uniform(0.1, 100)).astype(np.float32)
    t = (p * rng.normal() + rng.normal(size=24) + rng.normal() * 50).astype(np.float32)
    w = rng.random(24).astype(np.float32)
    assign = rng.integers(0, 3, 24)
    for name, (whole, *merged) in _split_and_merge(p, t, w, assign).items():
        for value in merged:
            np.testing.assert_allclose(value, whole, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_row_mask_and_one_weight_per_row(mesh8):
    """`mask=` (bool rows) drops rows as if they were never passed; `weights=` of
    one value per row, shape `(rows,)`, covers the row's 3 outputs; both inside
    `shard_map` too, synced."""
    preds, targets, weights = _data(1)
    mask = np.random.default_rng(2).random(len(preds)) < 0.7
    row_weights = weights[:, 0]  # (rows,), not (rows, 1)
    kept = _expected(preds[mask], targets[mask], weights[mask])

    def update(metrics, preds, targets, row_weights, mask):
        args = {name: {"preds": preds, "targets": targets, "mask": mask}
                for name in KINDS}  # fmt: skip
        args |= {
            f"{name}_w": {"preds": preds, "targets": targets, "weights": row_weights}
            for name in KINDS
        }
        return metrics.update(**args)

    masked = {name: kept[name] for name in KINDS}
    everything = _expected(preds, targets, weights)
    weighted = {name: v for name, v in everything.items() if name.endswith("_w")}
    data = (preds, targets, row_weights, mask)
    one = update(_collection(), *data).compute()
    _assert_matches({name: one[name] for name in KINDS}, masked)
    _assert_matches({name: one[name] for name in weighted}, weighted)
    rows = (slice(0, 2), slice(2, None))
    got = synced(mesh8, _collection, update, data, rows).compute()
    _assert_matches({name: got[name] for name in KINDS}, masked)
    _assert_matches({name: got[name] for name in weighted}, weighted)

    # A mask and weights of the wrong number of rows are clear errors.
    with pytest.raises(ValueError, match=r"mask"):
        ed.metrics.MeanSquaredError().update(preds, targets, mask=mask[:5])
    with pytest.raises(ValueError, match=r"weights"):
        ed.metrics.MeanSquaredError().update(preds, targets, weights=row_weights[:5])
