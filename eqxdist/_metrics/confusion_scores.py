"""Scores of the confusion-matrix counts beyond precision and recall:
`MatthewsCorrCoef`, `CohenKappa`, `JaccardIndex`, `Specificity`.

Each holds the state of `ConfusionMatrix` (a `(num_classes, num_classes)` carried
integer count of (true class, predicted class) pairs, synced in the (sum, int)
all-reduce) with its `update`, and differs only in `compute()`; any of them still
gives the other views of its counts (`confusion_matrix()`, `precision(average)`,
...). Conventions follow scikit-learn with `labels=range(num_classes)`: a 0/0 is 0
(`zero_division=0`), averages run over all classes, absent ones included.
"""

from typing import TypeVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .confusion import _check_average, _ConfusionCounts, _divide
from .inputs import counted_mask, float_dtype, integer_labels

_S = TypeVar("_S", bound="_ConfusionScore")


class _ConfusionScore(_ConfusionCounts):
    """`ConfusionMatrix`'s update with a boolean-only `mask`."""

    def __init__(self, num_classes: int):
        # Declared so that type checkers see this signature rather than the
        # dataclass fields.
        super().__init__(num_classes)

    def update(
        self: _S,
        logits_or_predictions: ArrayLike,
        labels: ArrayLike,
        mask: ArrayLike | None = None,
    ) -> _S:
        """Count a batch, as `ConfusionMatrix.update`; `mask` must be boolean.

        **Raises:**

        As `ConfusionMatrix.update`, and `TypeError` for a non-boolean `mask`.
        """
        if mask is not None:
            caller = f"{type(self).__name__}.update"
            shape = integer_labels(labels, caller).shape
            mask = counted_mask(
                mask, shape, caller, has_weights=False, target="the rows"
            )
        return super().update(logits_or_predictions, labels, mask)

    def _float_counts(self) -> Array:
        return self.counts.value_as(float_dtype())


class MatthewsCorrCoef(_ConfusionScore):
    """Matthews correlation coefficient of the multiclass confusion matrix,
    `(c s - t.p) / sqrt((s**2 - p.p) (s**2 - t.t))` (`c` correct, `s` counted,
    `t`/`p` the true/predicted counts per class): scikit-learn's
    `matthews_corrcoef`, 0 where the denominator is 0.

    **Arguments:**

    - `num_classes`: the number of classes (>= 2).

    `compute()` is a float scalar in [-1, 1].

    !!! Example

        ```python
        ed.metrics.MatthewsCorrCoef(3).update(logits, labels, mask).compute()
        ```
    """

    def compute(self) -> Array:
        """The correlation; 0 when a side has one class only (or nothing)."""
        counts = self._float_counts()
        t, p = counts.sum(axis=1), counts.sum(axis=0)
        c, s = jnp.trace(counts), counts.sum()
        cov_tp = c * s - t @ p
        cov_pp, cov_tt = s * s - p @ p, s * s - t @ t
        return _divide(cov_tp, jnp.sqrt(cov_pp * cov_tt))


class CohenKappa(_ConfusionScore):
    """Cohen's kappa, the agreement of predictions with labels beyond chance,
    `(p_o - p_e) / (1 - p_e)`: scikit-learn's `cohen_kappa_score(labels,
    predictions, labels=range(num_classes))` (unweighted), NaN where it is
    undefined (`p_e = 1`, as scikit-learn's default `replace_undefined_by`).

    **Arguments:**

    - `num_classes`: the number of classes (>= 2).

    `compute()` is a float scalar; NaN while nothing has been counted.

    !!! Example

        ```python
        ed.metrics.CohenKappa(5).update(rater_a, rater_b).compute()
        ```
    """

    def compute(self) -> Array:
        """Kappa; NaN where undefined."""
        counts = self._float_counts()
        s = counts.sum()
        safe = jnp.where(s == 0, 1, s)
        observed = jnp.trace(counts) / safe
        expected = counts.sum(axis=1) @ counts.sum(axis=0) / (safe * safe)
        undefined = (s == 0) | (expected == 1)
        kappa = (observed - expected) / jnp.where(undefined, 1, 1 - expected)
        return jnp.where(undefined, jnp.nan, kappa)


def _average(per_class: Array, support: Array, average: str | None) -> Array:
    if average is None:
        return per_class
    if average == "binary":
        return per_class[1]
    if average == "macro":
        return per_class.mean()
    return _divide(jnp.sum(per_class * support), support.sum())  # weighted


class _AveragedScore(_ConfusionScore):
    average: str | None = eqx.field(static=True)

    def __init__(self, num_classes: int, average: str | None = "macro"):
        super().__init__(num_classes)
        self.average = _check_average(average, self.num_classes, type(self).__name__)


class JaccardIndex(_AveragedScore):
    """Jaccard index (intersection over union), `tp / (tp + fp + fn)`, per class
    or averaged: scikit-learn's `jaccard_score(..., labels=range(num_classes),
    zero_division=0)`.

    **Arguments:**

    - `num_classes`: the number of classes (>= 2).
    - `average`: `"macro"` (default), `"micro"` (from the summed counts),
      `"weighted"` (by each class's number of true examples), `"binary"` (class 1
      of `num_classes=2`) or `None` (one value per class).

    `compute()` is a float scalar, or a `(num_classes,)` vector for
    `average=None`.

    !!! Example

        ```python
        # The mean IoU:
        ed.metrics.JaccardIndex(4).update(pixel_logits, pixel_labels).compute()
        ```
    """

    def compute(self) -> Array:
        """The index (float scalar, or one per class for `average=None`)."""
        counts = self._float_counts()
        tp = jnp.diagonal(counts)
        support = counts.sum(axis=1)
        union = support + counts.sum(axis=0) - tp
        if self.average == "micro":
            return _divide(tp.sum(), union.sum())
        return _average(_divide(tp, union), support, self.average)


class Specificity(_AveragedScore):
    """Specificity (true negative rate), `tn / (tn + fp)`: of the examples not of
    a class, the fraction not predicted as it (one-vs-rest, per class, from
    scikit-learn's `multilabel_confusion_matrix`), per class or averaged.
    `"weighted"` weighs each class by its number of true examples (torchmetrics'
    convention); a 0/0 is 0.

    **Arguments:**

    - `num_classes`: the number of classes (>= 2).
    - `average`: as `JaccardIndex`'s (default `"macro"`).

    `compute()` is a float scalar, or a `(num_classes,)` vector for
    `average=None`.

    !!! Example

        ```python
        specificity = ed.metrics.Specificity(2, average="binary")
        specificity.update(predictions, labels).compute()
        ```
    """

    def compute(self) -> Array:
        """The specificity (float scalar, or one per class for `average=None`)."""
        counts = self._float_counts()
        tp = jnp.diagonal(counts)
        support, predicted = counts.sum(axis=1), counts.sum(axis=0)
        fp = predicted - tp
        tn = counts.sum() - support - fp
        if self.average == "micro":
            return _divide(tn.sum(), tn.sum() + fp.sum())
        return _average(_divide(tn, tn + fp), support, self.average)
