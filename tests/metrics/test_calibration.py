"""`CalibrationError` on 8 devices against NumPy float64 on the concatenated
data: one update, merged, synced inside `shard_map`, with a mask."""

import numpy as np
from harness import one_and_merged, synced
from jax.sharding import PartitionSpec as P

import eqxdist as ed

N_DEV, ROWS, C = 8, 16, 4


def _data(seed=0):
    rng = np.random.default_rng(seed)
    n = N_DEV * ROWS
    logits = 2 * rng.normal(size=(2, n // 2, C))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    labels = rng.integers(0, C, (2, n // 2))
    mask = rng.random((2, n // 2)) < 0.8
    return probs.astype(np.float32), labels.astype(np.int32), mask


def _ece(probs, labels, num_bins):
    """Top-label ECE in float64, equal-width bins [i/n, (i+1)/n), the last closed."""
    confidence = probs.max(-1)
    correct = probs.argmax(-1) == labels
    bins = np.minimum(np.floor(confidence * np.float32(num_bins)), num_bins - 1)
    gap = 0.0
    for b in range(num_bins):
        inside = bins == b
        gap += abs(correct[inside].sum() - confidence[inside].astype(np.float64).sum())
    return gap / len(labels)


def _collection():
    return ed.MetricCollection(
        {
            "ece": ed.metrics.CalibrationError(),
            "ece_10": ed.metrics.CalibrationError(num_bins=10),
        }
    )


def _update(metrics, probs, labels, mask):
    return metrics.update(ece=(probs, labels, mask), ece_10=(probs, labels, mask))


def test_one_update_merged_and_synced_match_numpy(mesh8):
    probs, labels, mask = _data()
    m = mask
    expected = {
        "ece": _ece(probs[m], labels[m], 15),
        "ece_10": _ece(probs[m], labels[m], 10),
    }

    data = (probs, labels, mask)
    on_devices = synced(
        mesh8, _collection, _update, data, in_specs=P(None, "data"), compute=True
    )
    for computed in (*one_and_merged(_collection, _update, data, (0, 1)), on_devices):
        for name, want in expected.items():
            np.testing.assert_allclose(computed[name], want, rtol=1e-5, err_msg=name)


def test_perfect_calibration_and_empty():
    # Confidence 1 and right: no gap; confidence 0.8 and right half the time: 0.3.
    probs = np.array([[1.0, 0.0], [0.8, 0.2], [0.8, 0.2]], np.float32)
    labels = np.array([0, 0, 1])
    ece = ed.metrics.CalibrationError().update(probs, labels).compute()
    np.testing.assert_allclose(ece, [_ece(probs, labels, 15), 0.6 / 3], rtol=1e-6)
    assert np.isnan(ed.metrics.CalibrationError().compute())
    masked = ed.metrics.CalibrationError().update(probs, labels, np.zeros(3, bool))
    assert np.isnan(masked.compute())
