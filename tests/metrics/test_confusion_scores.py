"""`MatthewsCorrCoef`, `CohenKappa`, `JaccardIndex` and `Specificity` on 8
devices against scikit-learn on the concatenated data: one update, merged, synced
inside `shard_map`, with a mask, imbalanced classes and a class that never
appears as a label."""

import numpy as np
import pytest
from harness import assert_matches, one_and_merged, synced
from sklearn import metrics as skm

import eqxdist as ed

N_DEV, ROWS, C = 8, 12, 5
AVERAGES = ("macro", "micro", "weighted", None)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    n = N_DEV * ROWS
    labels = rng.choice(C - 1, size=n, p=[0.55, 0.25, 0.12, 0.08]).astype(np.int32)
    logits = rng.normal(size=(n, C)) + 1.5 * np.eye(C)[labels]
    mask = rng.random(n) < 0.8
    binary = (labels == 0).astype(np.int32)
    binary_preds = (logits[:, 0] > 0.5).astype(np.int32)
    return logits.astype(np.float32), labels, mask, binary, binary_preds


def _collection():
    metrics = {
        "mcc": ed.metrics.MatthewsCorrCoef(C),
        "kappa": ed.metrics.CohenKappa(C),
        "mcc_binary": ed.metrics.MatthewsCorrCoef(2),
        "jaccard_binary": ed.metrics.JaccardIndex(2, average="binary"),
        "specificity_binary": ed.metrics.Specificity(2, average="binary"),
    }
    for average in AVERAGES:
        metrics[f"jaccard_{average}"] = ed.metrics.JaccardIndex(C, average)
        metrics[f"specificity_{average}"] = ed.metrics.Specificity(C, average=average)
    return ed.MetricCollection(metrics)


def _update(metrics, logits, labels, mask, binary, binary_preds):
    return metrics.update(
        **{
            name: (binary_preds, binary, mask)
            if name.endswith("binary")
            else (logits, labels, mask)
            for name in metrics
        }
    )


def _specificity(y, yp, average, labels):
    mcm = skm.multilabel_confusion_matrix(y, yp, labels=labels)
    tn, fp = mcm[:, 0, 0].astype(float), mcm[:, 0, 1].astype(float)
    per = np.divide(tn, tn + fp, out=np.zeros_like(tn), where=tn + fp > 0)
    if average == "micro":
        return tn.sum() / (tn.sum() + fp.sum())
    if average == "macro":
        return per.mean()
    if average == "weighted":
        support = mcm[:, 1, 0] + mcm[:, 1, 1]
        return np.sum(per * support) / support.sum()
    return per


def _expected(logits, labels, mask, binary, binary_preds):
    y, yp = labels[mask], logits[mask].argmax(-1)
    yb, pb = binary[mask], binary_preds[mask]
    out = {
        "mcc": skm.matthews_corrcoef(y, yp),
        "kappa": skm.cohen_kappa_score(y, yp, labels=range(C)),
        "mcc_binary": skm.matthews_corrcoef(yb, pb),
        "jaccard_binary": skm.jaccard_score(yb, pb, zero_division=0),
        "specificity_binary": _specificity(yb, pb, None, [0, 1])[1],
    }
    for average in AVERAGES:
        out[f"jaccard_{average}"] = skm.jaccard_score(
            y, yp, labels=range(C), average=average, zero_division=0
        )
        out[f"specificity_{average}"] = _specificity(y, yp, average, range(C))
    return out


def test_one_update_merged_and_synced_match_sklearn(mesh8):
    data = _data()
    expected = _expected(*data)

    one, merged = one_and_merged(_collection, _update, data)
    assert_matches(one, expected)
    assert_matches(merged, expected)

    rows = (slice(0, 7), slice(7, None))
    reduced = synced(mesh8, _collection, _update, data, rows)
    assert_matches(reduced.compute(), expected)
    # The absent class: Jaccard 0 (0/0), counted in the macro mean.
    assert float(reduced["jaccard_None"].compute()[C - 1]) == 0.0
    # Every score is a view of the same counts.
    np.testing.assert_array_equal(
        reduced["mcc"].confusion_matrix(),
        skm.confusion_matrix(
            data[1][data[2]], data[0][data[2]].argmax(-1), labels=range(C)
        ),
    )


@pytest.mark.filterwarnings("ignore::UserWarning")  # scikit-learn: one label
def test_degenerate_counts():
    same = np.array([1, 1, 1])
    # One class on both sides: MCC 0 (scikit-learn's convention), kappa NaN.
    assert float(ed.metrics.MatthewsCorrCoef(3).update(same, same).compute()) == 0.0
    assert skm.matthews_corrcoef(same, same) == 0.0
    assert np.isnan(ed.metrics.CohenKappa(3).update(same, same).compute())
    assert np.isnan(ed.metrics.CohenKappa(3).compute())
    # Perfect and inverted binary predictions.
    y = np.array([0, 1, 1, 0])
    assert float(ed.metrics.MatthewsCorrCoef(2).update(1 - y, y).compute()) == -1.0
    assert float(ed.metrics.CohenKappa(2).update(y, y).compute()) == 1.0
    assert float(ed.metrics.JaccardIndex(2, "micro").compute()) == 0.0
