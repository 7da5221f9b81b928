"""Classification metrics: `Accuracy` (top-k), `AUROC` and `Perplexity`; the
confusion-matrix family (`ConfusionMatrix`, `Precision`, `Recall`, `F1Score`,
`FBetaScore`) is in `confusion.py`.

Every count here is a carried integer sum (see `MetricAccumulator`): exact to
2**47 and never wrapping, synced in the one (sum, int) all-reduce of a collection.

Which to use: `Accuracy` for the fraction of correct (or top-k) predictions;
`ConfusionMatrix` when you want the counts themselves, and `Precision`, `Recall`,
`F1Score`, `FBetaScore` for per-class or averaged scores (all four are views of
the same `(num_classes, num_classes)` counts, with the same `update`); `AUROC` for
a binary ranking score independent of any threshold; `Perplexity` for language
models (exp of the mean token negative log-likelihood).

Labels outside `[0, num_classes)` are a `ValueError` when their values are known
at trace time (eagerly, with NumPy or concrete JAX arrays, counting only the
entries `mask` keeps). Under `jit` they are only known at run time; then what each
metric does with them is stated in its docstring (never an error, never a count
in a wrong cell).
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .accumulator import MetricAccumulator
from .aggregation import Mean
from .base import Metric
from .checks import positive_int
from .inputs import (
    as_array,
    binned_scores,
    check_range,
    class_predictions,
    count_dtype,
    count_true,
    counted_mask,
    example_weights,
    float_dtype,
    integer_labels,
)


class Accuracy(Metric):
    """Fraction of correct predictions (or of labels among the `top_k` highest
    scores), kept as carried integer counts: exact to 2**47, never wrapping.
    Syncs in the (sum, int) all-reduce.

    `update(logits_or_predictions, labels, mask=None)`:

    - `labels`: integer class labels, any shape (e.g. `(batch,)` or
      `(batch, tokens)`).
    - `logits_or_predictions`: integer (or boolean) predictions of `labels`' shape,
      compared directly; or float scores with one more trailing axis (classes),
      which go through `argmax` over that axis (with `top_k > 1`: correct when the
      label's score is among the `top_k` highest; ties count in the label's favour).
    - `mask`: optional, boolean, broadcastable to `labels`' shape; examples where
      it is False (padding) are not counted. Another dtype is a `TypeError`.
    - `weights`: optional per-example weights, broadcastable to `labels`' shape:
      the result is `sum(weights * correct) / sum(weights)` over the counted
      examples (scikit-learn's `accuracy_score(sample_weight=)`). Integer or
      boolean weights are counted exactly (carried integers); float weights are
      added in a compensated float sum.

    A label outside `[0, num_classes)` (float scores) is a `ValueError` when known
    at trace time; at run time it is counted as a wrong prediction.

    **Arguments:**

    - `top_k`: how many of the highest scores may contain the label (default 1).

    `compute()` is a float scalar, NaN while nothing has been counted.

    **Raises:**

    `TypeError` if `top_k` is not an int; `ValueError` if it is < 1.

    !!! Example

        ```python
        acc = ed.metrics.Accuracy().update(logits, labels, mask=labels >= 0)
        top5 = ed.metrics.Accuracy(top_k=5).update(logits, labels)
        acc.compute()
        ```
    """

    correct: MetricAccumulator
    total: MetricAccumulator
    # Float-weighted (correct, total); added in v0.3, absent from older state dicts.
    weighted: MetricAccumulator
    top_k: int = eqx.field(static=True)
    _added_states: ClassVar[frozenset[str]] = frozenset({"weighted"})

    def __init__(self, top_k: int = 1) -> None:
        if not isinstance(top_k, int) or isinstance(top_k, bool):
            raise TypeError(f"Accuracy: `top_k` must be an int, got {top_k!r}.")
        if top_k < 1:
            raise ValueError(f"Accuracy: `top_k` must be >= 1, got {top_k}.")
        self.top_k = top_k
        self.correct = MetricAccumulator(jnp.zeros((), count_dtype()), compensated=True)
        self.total = MetricAccumulator(jnp.zeros((), count_dtype()), compensated=True)
        self.weighted = MetricAccumulator(jnp.zeros(2, float_dtype()), compensated=True)

    def update(
        self,
        logits_or_predictions: ArrayLike,
        labels: ArrayLike,
        mask: ArrayLike | None = None,
        weights: ArrayLike | None = None,
    ) -> "Accuracy":
        """Count a batch of predictions.

        **Raises:**

        `TypeError` if `labels` are not integers, or `top_k > 1` with integer
        predictions; `ValueError` if the shapes of predictions (or logits) and
        labels, or of mask and labels, do not match, if `top_k` exceeds the number
        of classes, or for a label outside the classes known at trace time.
        """
        caller = "Accuracy.update"
        labels = integer_labels(labels, caller)
        counted = counted_mask(mask, labels.shape, caller, has_weights=True)
        w = example_weights(weights, labels.shape, caller)
        preds = as_array(logits_or_predictions, caller, "logits_or_predictions")
        floating = jnp.issubdtype(preds.dtype, jnp.floating)
        if self.top_k > 1 and not floating:
            raise TypeError(
                f"{caller}: top_k={self.top_k} needs float scores with a trailing "
                f"class axis, got {preds.dtype} `logits_or_predictions`."
            )
        if not floating or self.top_k == 1:
            hits = class_predictions(preds, labels, None, caller) == labels
        else:
            class_predictions(preds, labels, None, caller)  # shape checks
            if self.top_k > preds.shape[-1]:
                raise ValueError(
                    f"{caller}: top_k={self.top_k} is more than the "
                    f"{preds.shape[-1]} classes of `logits_or_predictions`."
                )
            valid = (labels >= 0) & (labels < preds.shape[-1])
            index = jnp.where(valid, labels, 0)[..., None].astype(jnp.int32)
            score = jnp.take_along_axis(preds, index, axis=-1)
            above = jnp.sum(preds > score, axis=-1)
            hits = valid & (above < self.top_k)
        if floating:
            num_classes = preds.shape[-1]
            fix = "exclude such examples with `mask`."
            check_range(labels, counted, 0, num_classes - 1, caller, "labels", fix)
        if w is None:
            return self._with_children(
                {
                    "correct": self.correct.update(count_true(hits, counted)),
                    "total": self.total.update(count_true(counted)),
                }
            )
        w = jnp.where(counted, w, jnp.zeros_like(w))
        right = jnp.where(hits, w, jnp.zeros_like(w))
        if jnp.issubdtype(w.dtype, jnp.floating):
            batch = jnp.stack([jnp.sum(right), jnp.sum(w)]).astype(float_dtype())
            return self._with_children({"weighted": self.weighted.update(batch)})
        return self._with_children(
            {
                "correct": self.correct.update_sum(right),
                "total": self.total.update_sum(w),
            }
        )

    def compute(self) -> Array:
        """Correct / counted (float), weighted; NaN while nothing has been
        counted."""
        weighted = self.weighted.value_as(float_dtype())
        correct, total = (
            acc.value_as(float_dtype()) + extra
            for acc, extra in zip((self.correct, self.total), weighted, strict=True)
        )
        return jnp.where(total == 0, jnp.nan, correct / jnp.where(total == 0, 1, total))


class AUROC(Metric):
    """Area under the ROC curve of a binary task, binned: scikit-learn's
    `roc_auc_score` within about 1e-2 at the default 200 thresholds, exact in the
    limit of many thresholds (only pairs of a positive and a negative whose scores
    fall in the same bin are counted as ties).

    The state is two histograms of scores, positives and negatives, over
    `num_thresholds` equal bins of [0, 1]: `(2, num_thresholds)` carried integer
    counts, synced in the (sum, int) all-reduce. Memory does not grow with the
    number of examples.

    `update(scores, labels, mask=None, weights=None)`: `scores` float in [0, 1]
    (probabilities of class 1, e.g. `jax.nn.sigmoid(logit)`), `labels` in {0, 1}
    (int or bool), of the same shape; `mask` boolean, broadcastable to it (another
    dtype is a `TypeError`); `weights` optional per-example weights, broadcastable
    to it (scikit-learn's `roc_auc_score(sample_weight=)`), added in a second,
    float pair of histograms (a compensated float sum).

    Out-of-range input: scores outside [0, 1] (or NaN) and labels other than 0 and
    1 are a `ValueError` when known at trace time (entries `mask` drops are not
    checked). At run time, a score below 0 falls in the first bin and above 1 in
    the last (as 0 and 1 would), a NaN score or a label other than 0/1 is not
    counted.

    **Arguments:**

    - `num_thresholds`: the number of bins (>= 2; default 200).

    `compute()` is a float scalar; NaN while there is no positive or no negative
    example (scikit-learn raises there).

    **Raises:**

    `TypeError`/`ValueError` for a `num_thresholds` that is not an int >= 2.

    !!! Example

        ```python
        auc = ed.metrics.AUROC().update(jax.nn.sigmoid(logits), labels, mask)
        auc.compute()
        ```
    """

    histograms: MetricAccumulator
    # Weighted histograms; added in v0.3, absent from older state dicts.
    weighted: MetricAccumulator
    num_thresholds: int = eqx.field(static=True)
    _added_states: ClassVar[frozenset[str]] = frozenset({"weighted"})

    def __init__(self, num_thresholds: int = 200):
        self.num_thresholds = positive_int(num_thresholds, "AUROC", "num_thresholds", 2)
        zeros = jnp.zeros((2, num_thresholds), count_dtype())
        self.histograms = MetricAccumulator(zeros, compensated=True)
        self.weighted = MetricAccumulator(
            jnp.zeros((2, num_thresholds), float_dtype()), compensated=True
        )

    def update(
        self,
        scores: ArrayLike,
        labels: ArrayLike,
        mask: ArrayLike | None = None,
        weights: ArrayLike | None = None,
    ) -> "AUROC":
        """Count a batch of scores.

        **Raises:**

        `TypeError` for non-float `scores` or non-integer `labels`; `ValueError`
        for shapes that differ, or values out of range known at trace time.
        """
        caller = "AUROC.update"
        t = self.num_thresholds
        valid, cell = binned_scores(scores, labels, mask, t, caller)
        w = example_weights(weights, valid.shape, caller)
        cell = cell.ravel()
        if w is None:
            batch = jnp.zeros(2 * t, count_dtype()).at[cell].add(valid.ravel())
            return self._with_children(
                {"histograms": self.histograms.update(batch.reshape(2, t))}
            )
        w = jnp.where(valid, w.astype(float_dtype()), 0).ravel()
        batch = jnp.zeros(2 * t, float_dtype()).at[cell].add(w)
        return self._with_children(
            {"weighted": self.weighted.update(batch.reshape(2, t))}
        )

    def compute(self) -> Array:
        """The area under the ROC curve (float); NaN without both classes."""
        counts = self.histograms.value_as(float_dtype())
        neg, pos = counts + self.weighted.value_as(float_dtype())
        n_neg, n_pos = neg.sum(), pos.sum()
        # The probability that a positive scores above a negative: every positive
        # in a higher bin counts, those in the same bin count half (a tie). This
        # is the trapezoidal area under the ROC curve of the bin thresholds.
        above = jnp.cumsum(pos[::-1])[::-1] - pos
        wins = jnp.sum(
            neg / jnp.maximum(n_neg, 1) * (above + 0.5 * pos) / jnp.maximum(n_pos, 1)
        )
        return jnp.where((n_neg == 0) | (n_pos == 0), jnp.nan, wins)


class Perplexity(Metric):
    """Perplexity of a language model: `exp` of the token-weighted mean negative
    log-likelihood of the labels under the logits (`exp(mean(cross-entropy))`).

    The state is a `Mean` of the per-token negative log-likelihoods (a compensated
    float sum and a carried integer token count, exact to 2**47 tokens), synced in
    the (sum, float) and (sum, int) all-reduces; merge it across steps and devices
    like any other metric.

    `update(logits, labels, mask=None, weights=None)`: `logits` float
    `(..., vocab)`, `labels` integer `(...)`, `mask` boolean, broadcastable to
    `labels`' shape (False: padding, not counted; another dtype is a `TypeError`),
    `weights` optional per-token weights broadcastable to `labels`' shape (the
    mean NLL becomes `sum(weights * nll) / sum(weights)`, as `Mean`'s). A label
    outside `[0, vocab)` is a `ValueError` when known at trace time (among the
    tokens `mask` keeps); at run time that token is not counted (as with an
    ignore index).

    `compute()` is a float scalar; NaN while no token has been counted.

    !!! Example

        ```python
        ppl = ed.metrics.Perplexity().update(logits, tokens[:, 1:], mask[:, 1:])
        ppl.compute()
        ```
    """

    nll: Mean

    def __init__(self) -> None:
        self.nll = Mean()

    def update(
        self,
        logits: ArrayLike,
        labels: ArrayLike,
        mask: ArrayLike | None = None,
        weights: ArrayLike | None = None,
    ) -> "Perplexity":
        """Count a batch of tokens.

        **Raises:**

        `TypeError` for non-float `logits` or non-integer `labels`; `ValueError`
        for mismatched shapes or labels out of range known at trace time.
        """
        caller = "Perplexity.update"
        logits = as_array(logits, caller, "logits")
        if not jnp.issubdtype(logits.dtype, jnp.floating):
            raise TypeError(
                f"{caller}: `logits` must be floats, got dtype {logits.dtype}."
            )
        labels = integer_labels(labels, caller)
        if logits.ndim != labels.ndim + 1 or logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"{caller}: `logits` of shape {logits.shape} must have the shape of "
                f"`labels` {labels.shape} plus a trailing vocabulary axis."
            )
        counted = counted_mask(mask, labels.shape, caller, has_weights=True)
        w = example_weights(weights, labels.shape, caller)
        vocab = logits.shape[-1]
        check_range(
            labels,
            counted,
            0,
            vocab - 1,
            caller,
            "labels",
            "exclude such tokens with `mask`.",
        )
        valid = counted & (labels >= 0) & (labels < vocab)
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
        index = jnp.where(valid, labels, 0)[..., None].astype(jnp.int32)
        picked = jnp.take_along_axis(logits, index, axis=-1)[..., 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - picked
        nll = nll.astype(self.nll.total.local.dtype)
        if w is not None:
            valid = jnp.where(valid, w, jnp.zeros_like(w))
        return self._with_children({"nll": self.nll.update(nll, valid)})

    def compute(self) -> Array:
        """`exp` of the mean negative log-likelihood; NaN while empty."""
        return jnp.exp(self.nll.compute())
