"""The metrics of a real evaluation (top-k accuracy, the confusion-matrix family,
AUROC, Std, LastValue, Perplexity) on 8 devices against scikit-learn and NumPy
float64 on the concatenated data: several updates per device, a random mask,
imbalanced classes and a class that never appears. One compiled program serves the
value, HLO and state-dict checks (compiling is what makes metric tests slow)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import AGGREGATIONS, assert_same_tree, smap
from jax.sharding import PartitionSpec as P
from sklearn import metrics as skm

import eqxdist as ed

N_DEV, ROWS, UPDATES, C = 8, 12, 3, 5
AVERAGES = ("micro", "macro", "weighted", None)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    n = N_DEV * ROWS
    # Imbalanced; class C - 1 never appears as a label (it may be predicted).
    labels = rng.choice(C - 1, size=n, p=[0.55, 0.25, 0.12, 0.08]).astype(np.int32)
    logits = rng.normal(size=(n, C)).astype(np.float32) + 1.2 * np.eye(C)[labels]
    logits = logits.astype(np.float32)
    mask = rng.random(n) < 0.75
    mask[ROWS : 2 * ROWS] = False  # device 1 counts nothing
    binary = (labels == 0).astype(np.int32)
    scores = 1 / (1 + np.exp(logits[:, 1] - logits[:, 0]))
    values = (1e4 + rng.normal(size=n)).astype(np.float32)  # |mean| = 1e4 x std
    weights = (rng.random(n) * mask).astype(np.float32)
    return {
        "logits": logits,
        "labels": labels,
        "mask": mask,
        "binary": binary,
        "scores": scores.astype(np.float32),
        "binary_preds": (scores > 0.5).astype(np.int32),
        "values": values,
        "weights": weights,
    }


def _collection():
    metrics = {
        "acc": ed.metrics.Accuracy(),
        "top3": ed.metrics.Accuracy(top_k=3),
        "cm": ed.metrics.ConfusionMatrix(C),
        "auroc": ed.metrics.AUROC(),
        "auroc_fine": ed.metrics.AUROC(num_thresholds=4096),
        "std": ed.metrics.Std(),
        "std_weighted": ed.metrics.Std(),
        "last": ed.metrics.LastValue(),
        "ppl": ed.metrics.Perplexity(),
        "f1_binary": ed.metrics.F1Score(2, average="binary"),
        "precision_binary": ed.metrics.Precision(2, average="binary"),
        "recall_binary": ed.metrics.Recall(2, average="binary"),
    }
    for average in AVERAGES:
        metrics[f"precision_{average}"] = ed.metrics.Precision(C, average)
        metrics[f"recall_{average}"] = ed.metrics.Recall(C, average)
        metrics[f"f1_{average}"] = ed.metrics.F1Score(C, average)
        metrics[f"f2_{average}"] = ed.metrics.FBetaScore(C, beta=2.0, average=average)
    return ed.MetricCollection(metrics, prefix="val/")


def _update(metrics, d, step):
    classes = (d["logits"], d["labels"], d["mask"])
    args = {}
    for name, metric in metrics.metrics.items():
        if name.endswith("binary"):
            args[name] = (d["binary_preds"], d["binary"], d["mask"])
        elif isinstance(metric, ed.metrics.AUROC):
            args[name] = (d["scores"], d["binary"], d["mask"])
        elif isinstance(metric, ed.metrics.Accuracy | ed.metrics.Perplexity) or hasattr(
            metric, "confusion_matrix"
        ):
            args[name] = classes
    args["std"] = {"values": d["values"], "weights": d["mask"]}
    args["std_weighted"] = (d["values"], d["weights"])
    args["last"] = (step,)
    return metrics.update(**args)


def _expected(d):
    m = d["mask"]
    y, logits = d["labels"][m], d["logits"][m]
    yp = logits.argmax(-1)
    out = {
        "acc": np.mean(y == yp),
        "top3": skm.top_k_accuracy_score(y, logits, k=3, labels=range(C)),
        "cm": skm.confusion_matrix(y, yp, labels=range(C)),
        "auroc": skm.roc_auc_score(d["binary"][m], d["scores"][m]),
        "std": np.std(d["values"][m].astype(np.float64)),
    }
    out["auroc_fine"] = out["auroc"]
    v, w = d["values"].astype(np.float64), d["weights"].astype(np.float64)
    mean = np.sum(w * v) / np.sum(w)
    out["std_weighted"] = np.sqrt(np.sum(w * (v - mean) ** 2) / np.sum(w))
    lp = logits.astype(np.float64)
    nll = np.log(np.exp(lp).sum(-1)) - lp[np.arange(len(y)), y]
    out["ppl"] = np.exp(nll.mean())
    yb, pb = d["binary"][m], d["binary_preds"][m]
    out["f1_binary"] = skm.f1_score(yb, pb, average="binary", zero_division=0)
    out["precision_binary"] = skm.precision_score(yb, pb, zero_division=0)
    out["recall_binary"] = skm.recall_score(yb, pb, zero_division=0)
    kw = {"labels": list(range(C)), "zero_division": 0}
    for average in AVERAGES:
        out[f"precision_{average}"] = skm.precision_score(y, yp, average=average, **kw)
        out[f"recall_{average}"] = skm.recall_score(y, yp, average=average, **kw)
        out[f"f1_{average}"] = skm.f1_score(y, yp, average=average, **kw)
        out[f"f2_{average}"] = skm.fbeta_score(y, yp, beta=2.0, average=average, **kw)
    return out


@pytest.fixture(scope="module")
def evaluated(mesh8):
    """Every device updates three times with its rows, then `reduce`s (a sync whose
    result is replicated, returnable with `out_specs=P()`)."""
    data = _data()
    rows = ROWS // UPDATES

    def per_device(d):
        metrics = _collection()
        index = jax.lax.axis_index("data")
        for i in range(UPDATES):
            part = {k: v[i * rows : (i + 1) * rows] for k, v in d.items()}
            metrics = _update(metrics, part, (index * UPDATES + i).astype(jnp.float32))
        return metrics.reduce("data")

    fn = smap(mesh8, per_device, P("data"))
    lowered = fn.lower(data)
    reduced = fn(data)
    return data, reduced.compute(), reduced, lowered


def test_every_metric_and_average_matches_sklearn(evaluated):
    data, computed, reduced, _ = evaluated
    expected = _expected(data)
    assert set(computed) == {f"val/{name}" for name in expected} | {"val/last"}
    again = jax.jit(lambda m: m.sync(None).compute())(reduced)
    for name, want in expected.items():
        got = computed[f"val/{name}"]
        if name == "cm":
            assert got.dtype == jnp.int32
            np.testing.assert_array_equal(got, want)
        elif name == "auroc":
            assert abs(float(got) - want) < 1e-2
        elif name == "auroc_fine":
            assert abs(float(got) - want) < 1e-3
        else:
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(again[f"val/{name}"], got, rtol=1e-6)
    # The last update of the highest-indexed device: step 8 * 3 - 1.
    assert float(computed["val/last"]) == N_DEV * UPDATES - 1
    # A class that never appears has recall 0 (0/0) and counts in the macro mean.
    assert float(computed["val/recall_None"][C - 1]) == 0.0
    assert computed["val/f1_None"].shape == (C,)


def test_collection_syncs_with_one_all_reduce_per_op_and_dtype(evaluated):
    *_, lowered = evaluated
    # (sum, int32): every count; (sum, float32): Std's and LastValue's rows and
    # Perplexity's sums. Nothing else, however many metrics.
    assert len(re.findall(r"stablehlo\.all_reduce", lowered.as_text())) == 2
    compiled = lowered.compile().as_text()
    collectives = re.findall(
        r"= (?:\(.*?\)|\S+) (all-(?:reduce|gather)|collective-permute)(?:-start)?\(",
        compiled,
    )
    assert 1 <= len(collectives) <= 2, collectives


def test_state_dicts_round_trip(evaluated):
    *_, reduced, _ = evaluated
    for metrics in (reduced, reduced.sync(None), reduced.reset()):
        loaded = _collection().load_state_dict(metrics.state_dict())
        assert_same_tree(loaded, metrics)
        assert_same_tree(
            jax.tree.map(np.asarray, loaded.compute()),
            jax.tree.map(np.asarray, metrics.compute()),
        )


def test_merge_equals_one_metric_updated_with_both():
    data, more = _data(1), _data(2)
    update = jax.jit(_update)
    one = update(_collection(), data, jnp.float32(0.0))
    other = update(_collection(), more, jnp.float32(1.0))
    merged = one.merge(other)
    both = update(one, more, jnp.float32(1.0))
    for name in _collection().names:
        if name.startswith("std"):  # float rounding differs with the order
            np.testing.assert_allclose(
                merged[name].compute(), both[name].compute(), rtol=1e-6
            )
        else:
            assert_same_tree(merged[name].state_dict(), both[name].state_dict())
    concatenated = {k: np.concatenate([data[k], more[k]]) for k in data}
    expected = _expected(concatenated)
    for name in ("acc", "cm", "f1_macro", "recall_weighted", "ppl", "std_weighted"):
        np.testing.assert_allclose(
            merged.compute()[f"val/{name}"], expected[name], rtol=2e-6, err_msg=name
        )


def _exact(acc):
    """A carried count's exact value as a Python int (per element)."""
    return np.asarray(acc.local, np.int64) + (np.asarray(acc.local_hi, np.int64) << 16)


def test_counts_past_2_pow_31_stay_exact(mesh8):
    labels = np.arange(2**16, dtype=np.int32) % 3
    preds = np.where(np.arange(2**16) % 4 == 0, 0, labels).astype(np.int32)
    acc = ed.metrics.Accuracy().update(preds, labels)
    cm = ed.metrics.ConfusionMatrix(3).update(preds, labels)
    mean = ed.metrics.Mean().update(np.ones(2**16, np.float32), np.ones(2**16, bool))
    total = ed.metrics.Sum(jnp.int32).update(np.full(2**16, 3, np.int32))
    negative = ed.metrics.Sum(jnp.int32).update(np.full(2**16, -3, np.int32))
    correct = int(np.sum(preds == labels))
    for _ in range(17):  # 2**16 * 2**17 = 2**33 examples
        acc, cm, mean = acc.merge(acc), cm.merge(cm), mean.merge(mean)
        total, negative = total.merge(total), negative.merge(negative)
    assert int(_exact(acc.total)) == 2**33
    assert int(_exact(acc.correct)) == correct * 2**17
    np.testing.assert_allclose(acc.compute(), correct / 2**16, rtol=1e-7)
    assert int(_exact(mean.count)) == 2**33 and float(mean.compute()) == 1.0
    assert int(_exact(total.total)) == 3 * 2**33
    assert int(total.compute()) == 2**31 - 1  # saturated, never wrapped
    assert int(_exact(negative.total)) == -3 * 2**33
    assert int(negative.compute()) == -(2**31)
    assert float(negative.total.value_as(jnp.float32)) == -3 * 2.0**33
    cells = _exact(cm.counts)
    np.testing.assert_array_equal(
        cells, skm.confusion_matrix(labels, preds).astype(np.int64) << 17
    )
    assert cells.max() > 2**31 and int(cm.compute().max()) == 2**31 - 1
    np.testing.assert_allclose(
        cm.precision(None), skm.precision_score(labels, preds, average=None), rtol=1e-6
    )

    def per_device(index):  # 8 devices of 2**33 + index counts each
        local = acc.total.load_state_dict(
            {"local": index[0], "local_hi": jnp.int32(2**17)}
        )
        synced = local.sync("data")
        return synced.synchronized, synced.synchronized_hi

    synced = smap(mesh8, per_device, P("data"))(jnp.arange(N_DEV, dtype=jnp.int32))
    exact = int(synced[0]) + (int(synced[1]) << 16)
    assert exact == N_DEV * 2**33 + sum(range(N_DEV))


def test_std_is_accurate_when_the_mean_is_1e4_times_the_deviation():
    rng = np.random.default_rng(3)
    batches = [(1e5 + 10 * rng.normal(size=64)).astype(np.float32) for _ in range(6)]
    std = ed.metrics.Std()
    for i, batch in enumerate(batches):
        std = std.update(batch) if i % 2 else std.merge(ed.metrics.Std().update(batch))
    x = np.concatenate(batches)
    want = np.std(x.astype(np.float64))
    np.testing.assert_allclose(std.compute(), want, rtol=2e-6)
    # The textbook formula in float32 has nothing left at this ratio.
    naive = np.sqrt(max(np.mean(x**2) - np.mean(x) ** 2, 0.0))
    assert abs(naive - want) > 0.1 * want


def test_last_value_after_sync_skips_devices_without_one(mesh8):
    def per_device(index):
        fresh = jax.lax.pcast(ed.metrics.LastValue(shape=(2,)), "data", to="varying")
        last = jax.lax.cond(
            index[0] < 5,
            lambda: fresh.update(jnp.stack([index[0], -index[0]]).astype(jnp.float32)),
            lambda: fresh,
        )
        return last.sync("data").compute(), fresh.sync("data").compute()

    last, empty = smap(mesh8, per_device, P("data"))(jnp.arange(N_DEV))
    np.testing.assert_array_equal(last, [4.0, -4.0])  # device 4: the last with one
    assert np.isnan(empty).all()
    merged = ed.metrics.LastValue().update(1.0).merge(ed.metrics.LastValue())
    assert float(merged.compute()) == 1.0
    assert float(merged.merge(ed.metrics.LastValue().update(2.0)).compute()) == 2.0


def test_nan_strategy():
    x = np.array([1.0, np.nan, 3.0], np.float32)
    for make in AGGREGATIONS:
        assert np.isnan(make().update(x).compute()), make
    ignored = {
        ed.metrics.Sum: 4.0,
        ed.metrics.Mean: 2.0,
        ed.metrics.Max: 3.0,
        ed.metrics.Min: 1.0,
        ed.metrics.Std: 1.0,
    }
    for make, want in ignored.items():
        got = make(nan_strategy="ignore").update(x).compute()
        assert float(got) == want, make
    weighted = ed.metrics.Mean(nan_strategy="ignore").update(x, np.array([1, 1, 3]))
    assert float(weighted.compute()) == 2.5
