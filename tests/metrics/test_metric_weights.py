"""Sample weights on `Accuracy`, `AUROC` and `Perplexity` against scikit-learn and
NumPy float64 on the concatenated data (one update, merged updates, synced across
8 devices inside `jax.shard_map`), and boolean-only masks."""

import re

import numpy as np
import pytest
import sklearn.metrics as skm
from harness import smap
from jax.sharding import PartitionSpec as P

import eqxdist as ed

N_DEV, ROWS, C = 8, 32, 5
N = N_DEV * ROWS


def _data(seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, C, N).astype(np.int32)
    logits = (rng.normal(size=(N, C)) + 1.5 * np.eye(C)[labels]).astype(np.float32)
    binary = rng.integers(0, 2, N).astype(np.int32)
    scores = np.clip(rng.normal(0.35 + 0.3 * binary, 0.25), 0, 1).astype(np.float32)
    mask = rng.random(N) < 0.8
    mask[ROWS : 2 * ROWS] = False  # device 1 counts nothing
    weights = rng.random(N).astype(np.float32) * 3
    int_weights = rng.integers(0, 4, N).astype(np.int32)
    return dict(
        labels=labels,
        logits=logits,
        binary=binary,
        scores=scores,
        mask=mask,
        weights=weights,
        int_weights=int_weights,
    )


def _collection():
    return ed.MetricCollection(
        {
            "acc": ed.metrics.Accuracy(),
            "acc_int": ed.metrics.Accuracy(),
            "top2": ed.metrics.Accuracy(top_k=2),
            "auroc": ed.metrics.AUROC(),
            "auroc_fine": ed.metrics.AUROC(num_thresholds=4096),
            "ppl": ed.metrics.Perplexity(),
        }
    )


def _update(metrics, d):
    classes = (d["logits"], d["labels"], d["mask"], d["weights"])
    return metrics.update(
        acc=classes,
        acc_int=(d["logits"], d["labels"], d["mask"], d["int_weights"]),
        top2=classes,
        auroc=(d["scores"], d["binary"], d["mask"], d["weights"]),
        auroc_fine=(d["scores"], d["binary"], d["mask"], d["weights"]),
        ppl=classes,
    )


def _expected(d):
    m = d["mask"]
    y, logits, w = d["labels"][m], d["logits"][m], d["weights"][m]
    lp = logits.astype(np.float64)
    nll = np.log(np.exp(lp).sum(-1)) - lp[np.arange(len(y)), y]
    return {
        "acc": skm.accuracy_score(y, logits.argmax(-1), sample_weight=w),
        "acc_int": skm.accuracy_score(
            y, logits.argmax(-1), sample_weight=d["int_weights"][m]
        ),
        "top2": skm.top_k_accuracy_score(
            y, logits, k=2, labels=range(C), sample_weight=w
        ),
        "auroc": skm.roc_auc_score(d["binary"][m], d["scores"][m], sample_weight=w),
        "ppl": np.exp(np.sum(w * nll) / np.sum(w)),
    }


def _check(computed, expected):
    for name in ("acc", "acc_int", "top2", "ppl"):
        np.testing.assert_allclose(computed[name], expected[name], rtol=2e-6)
    assert abs(float(computed["auroc"]) - expected["auroc"]) < 1e-2
    # Binned: converging to scikit-learn's value with more thresholds.
    assert abs(float(computed["auroc_fine"]) - expected["auroc"]) < 5e-4


def test_one_update_and_merged_updates_match_sklearn():
    d = _data()
    expected = _expected(d)
    _check(_update(_collection(), d).compute(), expected)
    halves = [{k: v[i * 128 : (i + 1) * 128] for k, v in d.items()} for i in (0, 1)]
    first, second = (_update(_collection(), h) for h in halves)
    _check(first.merge(second).compute(), expected)


def test_synced_across_8_devices_matches_sklearn_with_one_collective_per_dtype(
    mesh8,
):
    d = _data(1)

    def per_device(d):
        return _update(_collection(), d).sync("data").compute()

    fn = smap(mesh8, per_device, (P("data"),))
    lowered = fn.lower(d)
    # (sum, int32): the counts; (sum, float32): the weighted states and NLL sums.
    assert len(re.findall(r"stablehlo\.all_reduce", lowered.as_text())) == 2
    _check(fn(d), _expected(d))


def test_integer_weights_are_counted_exactly_past_2_pow_31():
    preds, labels = np.array([0, 1, 1]), np.array([0, 1, 0])
    weights = np.array([2**30, 2**30, 2**30], np.int32)
    acc = ed.metrics.Accuracy().update(preds, labels, weights=weights)
    acc = acc.merge(acc)
    total = int(acc.total.words[1]) * 2**16 + int(acc.total.words[0])
    assert total == 6 * 2**30
    np.testing.assert_allclose(
        acc.compute(),
        skm.accuracy_score(labels, preds, sample_weight=weights.astype(np.float64)),
    )


def test_weights_and_mask_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match=r"Accuracy.update: `weights` of shape \(3,\)"):
        ed.metrics.Accuracy().update(
            np.zeros(4, np.int32), np.zeros(4, np.int32), None, np.ones(3)
        )
    with pytest.raises(TypeError, match=r"AUROC.update: `weights` must hold numbers"):
        ed.metrics.AUROC().update(
            np.zeros(2, np.float32), np.zeros(2, np.int32), None, np.array(["a", "b"])
        )


_PREDS, _LABELS = np.array([0, 1, 1, 2], np.int32), np.array([0, 1, 2, 2], np.int32)
_LOGITS = np.eye(3, dtype=np.float32)[_PREDS]
_WITH_WEIGHTS = [
    lambda mask: ed.metrics.Accuracy().update(_PREDS, _LABELS, mask),
    lambda mask: ed.metrics.AUROC().update(
        np.full(4, 0.5, np.float32), _LABELS % 2, mask
    ),
    lambda mask: ed.metrics.Perplexity().update(_LOGITS, _LABELS, mask),
]
_WITHOUT_WEIGHTS = [
    lambda mask, kind=kind: kind(3).update(_PREDS, _LABELS, mask)
    for kind in (
        ed.metrics.ConfusionMatrix,
        ed.metrics.Precision,
        ed.metrics.Recall,
        ed.metrics.F1Score,
    )
] + [lambda mask: ed.metrics.FBetaScore(3, beta=2).update(_PREDS, _LABELS, mask)]
_MASKS = [
    np.array([0.5, 1.0, 0.0, 1.0], np.float32),
    np.array([-1, 1, 0, 1], np.int32),
    np.array([1, 1, 0, 1], np.uint8),
]


@pytest.mark.parametrize("mask", _MASKS, ids=lambda m: str(m.dtype))
@pytest.mark.parametrize("update", _WITH_WEIGHTS + _WITHOUT_WEIGHTS)
def test_a_non_bool_mask_is_a_type_error_pointing_to_weights(update, mask):
    hint = "`weights=`" if update in _WITH_WEIGHTS else "takes no weights"
    with pytest.raises(
        TypeError, match=rf"`mask` must be boolean.*{mask.dtype}.*{hint}"
    ):
        update(mask)
    update(mask != 0)  # the boolean mask is accepted
