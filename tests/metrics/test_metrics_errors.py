"""Every caller mistake in the metrics API is a clear `ValueError`/`TypeError`
naming the argument, the value seen and what was expected (one table), and the
documented behaviour of out-of-range values that are only known at run time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import AGGREGATIONS

import eqxdist as ed

F = np.float32
LOGITS = np.eye(5, dtype=F)[[0, 1, 2, 3]]  # 4 examples, 5 classes
LABELS = np.array([0, 1, 2, 3], np.int32)
I32 = jnp.int32


def mine_or_hook(mine, parameter, value):
    """Our own message, or the one of the type checker that the test run adds
    (jaxtyping's pytest hook): both name the argument, the value and the type."""
    return rf"(?s)({mine}|parameter '{parameter}'.*Actual value: {value})"


CASES = [
    # None where an array is expected
    (
        lambda: ed.metrics.MetricAccumulator(None),
        TypeError,
        mine_or_hook(r"`initial_value`.*got None", "initial_value", "None"),
    ),
    (
        lambda: ed.metrics.Mean().update(None),
        TypeError,
        mine_or_hook(r"Mean.update: `values`.*got None", "values", "None"),
    ),
    (
        lambda: ed.metrics.MetricAccumulator(0.0).load_state_dict({"local": None}),
        TypeError,
        mine_or_hook(
            r"`state_dict\['local'\]`.*got None", "state_dict", r"\{'local': None"
        ),
    ),
    (
        lambda: ed.metrics.Sum().load_state_dict({"total": {"local": None}}),
        TypeError,
        mine_or_hook(
            r"`state_dict\['local'\]`.*got None", "state_dict", r"\{'local': None"
        ),
    ),
    (
        lambda: ed.metrics.Accuracy().update(LOGITS, None),
        TypeError,
        mine_or_hook(r"`labels`.*got None", "labels", "None"),
    ),
    # a list where a mapping is expected
    (
        lambda: ed.MetricCollection([ed.metrics.Sum()]),
        TypeError,
        mine_or_hook(r"`metrics` must be a mapping.*got list", "metrics", r"\["),
    ),
    (
        lambda: ed.metrics.Sum().load_state_dict([1.0]),
        TypeError,
        mine_or_hook(
            r"Sum.load_state_dict: `state_dict` must be a mapping.*\['total'\].*list",
            "state_dict",
            r"\[1.0\]",
        ),
    ),
    (
        lambda: ed.metrics.MetricAccumulator(0.0).load_state_dict([1.0]),
        TypeError,
        mine_or_hook(
            r"`state_dict` must be a mapping.*got list", "state_dict", r"\[1.0\]"
        ),
    ),
    (
        lambda: ed.MetricCollection({"s": ed.metrics.Sum()}, prefix=1),
        TypeError,
        mine_or_hook(r"`prefix` must be a string, got 1", "prefix", "1"),
    ),
    # bad dtypes
    (
        lambda: ed.metrics.Sum(dtype="foo"),
        TypeError,
        r"Sum: `dtype` must be .*got 'foo'",
    ),
    (
        lambda: ed.metrics.Max(dtype=bool),
        TypeError,
        r"Max: `dtype` must be an integer or",
    ),
    (lambda: ed.metrics.Min(dtype=jnp.bool_), TypeError, r"Min: `dtype`"),
    (
        lambda: ed.metrics.Mean(dtype=I32),
        TypeError,
        r"Mean: `dtype` must be a float dtype",
    ),
    (
        lambda: ed.metrics.Std(dtype=I32),
        TypeError,
        r"Std: `dtype` must be a float dtype",
    ),
    (lambda: ed.metrics.LastValue(dtype="x"), TypeError, r"LastValue: `dtype`.*'x'"),
    (
        lambda: ed.metrics.Sum(I32).update(np.ones(2, F)),
        TypeError,
        r"`values` has dtype float32.*int32",
    ),
    (
        lambda: ed.metrics.MetricAccumulator(jnp.int8(0), compensated=True),
        TypeError,
        r"carried integer sum .* needs signed 32- or 64-bit words, got dtype int8",
    ),
    # axis names
    (
        lambda: ed.metrics.Sum().sync(3),
        TypeError,
        mine_or_hook(r"Sum.sync: `axis_name` must be .*got 3", "axis_name", "3"),
    ),
    (
        lambda: ed.metrics.MetricAccumulator(0.0).sync(("data", 1)),
        TypeError,
        r"(?s)axis_name.*\('data', 1\)",
    ),
    (
        lambda: ed.metrics.Std().sync("data"),
        ValueError,
        r"'data' is not bound.*shard_map",
    ),
    # state dicts: wrong keys, shapes, dtypes
    (
        lambda: ed.metrics.Sum().load_state_dict({"tot": {"local": F(0)}}),
        ValueError,
        r"expected the keys \['total'\], got \['tot'\]",
    ),
    (
        lambda: ed.metrics.ConfusionMatrix(3).load_state_dict(
            {"counts": {"local": np.zeros((2, 2), np.int32)}}
        ),
        ValueError,
        r"'local' has shape \(2, 2\).*expected shape \(3, 3\)",
    ),
    (
        lambda: ed.metrics.Accuracy().load_state_dict(
            {"correct": {"local": F(0)}, "total": {"local": np.int32(0)}}
        ),
        ValueError,
        r"dtype float32, expected shape \(\) and dtype int32",
    ),
    (
        lambda: ed.metrics.Accuracy().load_state_dict(
            {"correct": {"local": I32(0), "local_lo": I32(0)}, "total": {"local": 0}}
        ),
        ValueError,
        r"expected the key 'local' and optionally .*'local_hi'.*local_lo",
    ),
    (
        lambda: ed.MetricCollection({"s": ed.metrics.Sum()}).load_state_dict({"t": {}}),
        ValueError,
        r"expected the keys \['s'\], got \['t'\]",
    ),
    # collections
    (
        lambda: ed.MetricCollection({"s": ed.metrics.Sum()}).update(t=(1.0,)),
        ValueError,
        r"no metric named 't'; the collection has \['s'\]",
    ),
    (
        lambda: ed.MetricCollection({"s": ed.metrics.Sum()}).update(s=1.0),
        TypeError,
        r"arguments for 's' must be a tuple.*got float",
    ),
    (
        lambda: ed.MetricCollection({"s": 1.0}),
        TypeError,
        mine_or_hook(r"`metrics`\['s'\] must be a Metric", "metrics", r"\{'s': 1.0\}"),
    ),
    # unknown options
    *[
        (
            lambda make=make: make(nan_strategy="drop"),
            ValueError,
            r"unknown `nan_strategy` 'drop'; expected one of \['propagate', 'ignore'\]",
        )
        for make in AGGREGATIONS
    ],
    (
        lambda: ed.metrics.Precision(3, average="mean"),
        ValueError,
        r"unknown `average` 'mean'; expected one of \['micro', 'macro', 'weighted', "
        r"'binary', None\]",
    ),
    (
        lambda: ed.metrics.F1Score(3, average="binary"),
        ValueError,
        r"average='binary'.*num_classes=3",
    ),
    (
        lambda: ed.metrics.ConfusionMatrix(2).recall("avg"),
        ValueError,
        r"unknown `average` 'avg'",
    ),
    (
        lambda: ed.metrics.FBetaScore(3, beta=0),
        ValueError,
        r"`beta` must be > 0, got 0",
    ),
    (
        lambda: ed.metrics.FBetaScore(3, beta="2"),
        TypeError,
        mine_or_hook(r"`beta` must be a number", "beta", "'2'"),
    ),
    (
        lambda: ed.metrics.ConfusionMatrix(1),
        ValueError,
        r"`num_classes` must be >= 2, got 1",
    ),
    (
        lambda: ed.metrics.Recall("3"),
        TypeError,
        mine_or_hook(r"`num_classes` must be an int, got '3'", "num_classes", "'3'"),
    ),
    (lambda: ed.metrics.Accuracy(top_k=0), ValueError, r"`top_k` must be >= 1, got 0"),
    (
        lambda: ed.metrics.Accuracy(top_k=1.5),
        TypeError,
        mine_or_hook(r"`top_k` must be an int, got 1.5", "top_k", "1.5"),
    ),
    (lambda: ed.metrics.AUROC(1), ValueError, r"`num_thresholds` must be >= 2, got 1"),
    (
        lambda: ed.metrics.AUROC(2.0),
        TypeError,
        mine_or_hook(r"`num_thresholds` must be an int", "num_thresholds", "2.0"),
    ),
    # shapes
    (
        lambda: ed.metrics.ConfusionMatrix(5).update(LABELS[:3], LABELS),
        ValueError,
        r"integer `logits_or_predictions` of shape \(3,\).*\(4,\)",
    ),
    (
        lambda: ed.metrics.ConfusionMatrix(4).update(LOGITS, LABELS),
        ValueError,
        r"have 5 classes on their last axis, expected num_classes=4",
    ),
    (
        lambda: ed.metrics.F1Score(5).update(LOGITS, LABELS, np.ones(3)),
        ValueError,
        r"`mask` of shape \(3,\) does not broadcast.*\(4,\)",
    ),
    (
        lambda: ed.metrics.AUROC().update(np.full(3, 0.5, F), LABELS % 2),
        ValueError,
        r"`scores` of shape \(3,\) and `labels` of shape \(4,\)",
    ),
    (
        lambda: ed.metrics.Perplexity().update(LOGITS[:, :, None], LABELS),
        ValueError,
        r"`logits` of shape \(4, 5, 1\).*`labels` \(4,\) plus a trailing",
    ),
    (
        lambda: ed.metrics.Std().update(np.ones(4, F), np.ones(3, F)),
        ValueError,
        r"`weights` of shape \(3,\).*\(4,\)",
    ),
    (
        lambda: ed.metrics.LastValue(shape=(2,)).update(np.ones(3, F)),
        ValueError,
        r"`value` of shape \(3,\) does not broadcast.*\(2,\)",
    ),
    # kinds
    (
        lambda: ed.metrics.ConfusionMatrix(5).update(LOGITS, LABELS.astype(F)),
        TypeError,
        r"`labels` must be integer class labels, got dtype float32",
    ),
    (
        lambda: ed.metrics.Accuracy(top_k=2).update(LABELS, LABELS),
        TypeError,
        r"top_k=2 needs float scores.*int32",
    ),
    (
        lambda: ed.metrics.Accuracy(top_k=6).update(LOGITS, LABELS),
        ValueError,
        r"top_k=6 is more than the 5 classes",
    ),
    (
        lambda: ed.metrics.AUROC().update(LABELS % 2, LABELS % 2),
        TypeError,
        r"`scores` must be floats in \[0, 1\], got dtype int32",
    ),
    (
        lambda: ed.metrics.Perplexity().update(LABELS[:, None], LABELS),
        TypeError,
        r"`logits` must be floats, got dtype int32",
    ),
    # values known at trace time
    (
        lambda: ed.metrics.Accuracy().update(LOGITS, np.array([0, 1, 7, 3])),
        ValueError,
        r"`labels`\[2\] is 7, outside \[0, 4\]; exclude such examples with `mask`",
    ),
    (
        lambda: ed.metrics.ConfusionMatrix(5).update(LABELS, np.array([0, -1, 2, 3])),
        ValueError,
        r"`labels`\[1\] is -1, outside \[0, 4\]",
    ),
    (
        lambda: ed.metrics.Precision(4).update(np.array([0, 1, 4, 3]), LABELS),
        ValueError,
        r"`logits_or_predictions`\[2\] is 4, outside \[0, 3\]",
    ),
    (
        lambda: ed.metrics.AUROC().update(np.array([0.1, 1.5], F), np.array([0, 1])),
        ValueError,
        r"`scores`\[1\] is 1.5, outside \[0, 1\]; pass probabilities",
    ),
    (
        lambda: ed.metrics.AUROC().update(np.array([np.nan, 0.5], F), np.array([0, 1])),
        ValueError,
        r"`scores`\[0\] is nan, outside \[0, 1\]",
    ),
    (
        lambda: ed.metrics.AUROC().update(np.array([0.1, 0.5], F), np.array([0, 2])),
        ValueError,
        r"`labels`\[1\] is 2, outside \[0, 1\]; labels must be 0 or 1",
    ),
    (
        lambda: ed.metrics.Perplexity().update(LOGITS, np.array([0, 1, 2, 5])),
        ValueError,
        r"`labels`\[3\] is 5, outside \[0, 4\]; exclude such tokens with `mask`",
    ),
    # other misuse
    (
        lambda: ed.metrics.Sum().merge(ed.metrics.Mean()),
        TypeError,
        r"Sum.merge: `other` must be a Sum",
    ),
    (
        lambda: ed.metrics.Precision(3).merge(ed.metrics.ConfusionMatrix(3)),
        TypeError,
        r"Precision.merge: `other` must be a Precision.*got ConfusionMatrix",
    ),
    (
        lambda: ed.metrics.MetricAccumulator(jnp.int32(0), compensated=True).merge(
            ed.metrics.MetricAccumulator(0)
        ),
        ValueError,
        r"cannot merge a \(reduce_op, shape, dtype, compensated\)",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), CASES, ids=[str(i) for i in range(len(CASES))]
)
def test_bad_input_raises_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_masked_out_of_range_values_are_not_checked_or_counted():
    cm = ed.metrics.ConfusionMatrix(3).update(
        np.array([0, 5, 1]), np.array([0, -100, 1]), mask=np.array([True, False, True])
    )
    np.testing.assert_array_equal(cm.compute(), np.diag([1, 1, 0]))
    auc = ed.metrics.AUROC().update(
        np.array([0.2, 7.0, 0.9], F), np.array([0, 5, 1]), np.array([True, False, True])
    )
    assert float(auc.compute()) == 1.0


def test_out_of_range_values_known_only_at_run_time():
    """Under `jit` the values are not known when tracing: documented outcomes."""

    @jax.jit
    def run(preds, labels, scores, binary, logits):
        cm = ed.metrics.ConfusionMatrix(3).update(preds, labels)
        acc = ed.metrics.Accuracy().update(logits, labels)
        auc = ed.metrics.AUROC(num_thresholds=4).update(scores, binary)
        ppl = ed.metrics.Perplexity().update(logits, labels)
        return (
            cm.compute(),
            acc.correct.value,
            acc.total.value,
            auc.histograms.value,
            ppl.compute(),
        )

    preds = np.array([0, 1, 2, 9], np.int32)
    labels = np.array([0, -100, 2, 1], np.int32)
    logits = np.eye(3, dtype=F)[[0, 1, 2, 1]]
    scores = np.array([-0.5, 1.5, np.nan, 0.3], F)
    binary = np.array([0, 1, 1, 3], np.int32)
    cm, correct, total, hist, ppl = run(preds, labels, scores, binary, logits)
    # ConfusionMatrix: an example with a label or prediction out of range is
    # dropped. Accuracy: counted, and wrong. AUROC: scores clipped to [0, 1]; a NaN
    # score or a label other than 0/1 is dropped. Perplexity: such tokens dropped.
    np.testing.assert_array_equal(cm, np.diag([1, 0, 1]))
    assert (int(correct), int(total)) == (3, 4)
    np.testing.assert_array_equal(hist, [[1, 0, 0, 0], [0, 0, 0, 1]])
    expected = np.exp(np.log(np.exp(1) + 2) - 1)  # the 3 counted tokens alike
    np.testing.assert_allclose(ppl, expected, rtol=1e-6)
