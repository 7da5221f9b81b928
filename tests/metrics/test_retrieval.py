"""Retrieval metrics on 8 devices against scikit-learn's `ndcg_score` and a
NumPy float64 brute force over every order of the tied items, on the
concatenated queries: one update, merged, synced inside `shard_map`, with a mask
over queries, ties, queries without a relevant item and `k` beyond the list."""

import itertools

import numpy as np
import pytest
from harness import assert_matches, one_and_merged, synced
from sklearn import metrics as skm

import eqxdist as ed

N_DEV, QUERIES, ITEMS = 8, 2, 6
KS = (1, 3, 10)  # 10 > ITEMS


def _data(seed=0):
    rng = np.random.default_rng(seed)
    q = N_DEV * QUERIES
    scores = rng.integers(0, 4, (q, ITEMS)).astype(np.float32)  # many ties
    relevance = rng.integers(0, 4, (q, ITEMS)) * (rng.random((q, ITEMS)) < 0.5)
    relevance[[0, 5]] = 0  # queries without a relevant item
    mask = rng.random(q) < 0.8
    mask[0] = True
    return scores, relevance.astype(np.float32), mask


def _collection():
    metrics = {"mrr": ed.metrics.MRR()}
    for k in KS:
        metrics |= {
            f"p@{k}": ed.metrics.PrecisionAtK(k),
            f"r@{k}": ed.metrics.RecallAtK(k),
            f"ndcg@{k}": ed.metrics.NDCGAtK(k),
        }
    return ed.MetricCollection(metrics)


def _update(metrics, scores, relevance, mask):
    return metrics.update(**{name: (scores, relevance, mask) for name in metrics})


def _orders(scores):
    """Every order of the items that ranks higher scores first (ties in every
    order)."""
    return [
        order
        for order in itertools.permutations(range(len(scores)))
        if all(scores[a] >= scores[b] for a, b in itertools.pairwise(order))
    ]


def _brute_force(scores, relevance):
    """The metrics of each query, averaged over the orders of its tied items."""
    out = {}
    for s, rel in zip(scores, relevance, strict=True):
        ideal = np.sort(rel)[::-1]
        values = []
        for order in _orders(s):
            ranked = rel[list(order)]
            hit = ranked > 0
            row = {"mrr": 1 / (np.argmax(hit) + 1) if hit.any() else 0.0}
            for k in KS:
                disc = 1 / np.log2(np.arange(min(k, ITEMS)) + 2)
                idcg = np.sum(ideal[:k] * disc)
                row[f"p@{k}"] = hit[:k].sum() / k
                row[f"r@{k}"] = hit[:k].sum() / hit.sum() if hit.any() else 0.0
                row[f"ndcg@{k}"] = np.sum(ranked[:k] * disc) / idcg if idcg else 0.0
            values.append(row)
        for name in values[0]:
            out.setdefault(name, []).append(np.mean([v[name] for v in values]))
    return {name: np.array(v) for name, v in out.items()}


def _expected(scores, relevance, mask):
    per_query = _brute_force(scores[mask], relevance[mask])
    expected = {name: v.mean() for name, v in per_query.items()}
    for k in KS:  # the brute force is scikit-learn's tie convention
        want = skm.ndcg_score(relevance[mask], scores[mask], k=k)
        np.testing.assert_allclose(expected[f"ndcg@{k}"], want, rtol=1e-12)
    return expected


def test_one_update_merged_and_synced_match_brute_force_and_sklearn(mesh8):
    data = _data()
    expected = _expected(*data)

    one, merged = one_and_merged(_collection, _update, data)
    assert_matches(one, expected)
    assert_matches(merged, expected)

    rows = (slice(0, 1), slice(1, None))
    assert_matches(
        synced(mesh8, _collection, _update, data, rows, compute=True), expected
    )


def test_single_queries():
    scores = np.array([[0.9, 0.1, 0.5, 0.5]], np.float32)
    relevance = np.array([[0, 1, 3, 0]], np.float32)
    # Ranked: item 0 (not relevant), items 2 and 3 tied (one relevant), item 1.
    assert float(ed.metrics.MRR().update(scores, relevance).compute()) == pytest.approx(
        0.5 * (1 / 2) + 0.5 * (1 / 3)
    )
    assert float(
        ed.metrics.PrecisionAtK(2).update(scores, relevance).compute()
    ) == pytest.approx(0.25)
    assert float(ed.metrics.RecallAtK(10).update(scores, relevance).compute()) == 1.0
    assert float(
        ed.metrics.PrecisionAtK(10).update(scores, relevance).compute()
    ) == pytest.approx(0.2)
    nothing = np.zeros_like(relevance)
    for metric in (
        ed.metrics.MRR(),
        ed.metrics.RecallAtK(2),
        ed.metrics.NDCGAtK(2),
        ed.metrics.PrecisionAtK(2),
    ):
        assert float(metric.update(scores, nothing).compute()) == 0.0
        assert np.isnan(metric.update(scores, relevance, np.zeros(1, bool)).compute())
    # A NaN score ranks last.
    nan = np.array([[np.nan, 0.1, 0.2]], np.float32)
    assert float(
        ed.metrics.MRR().update(nan, np.array([[1.0, 0, 0]])).compute()
    ) == pytest.approx(1 / 3)
