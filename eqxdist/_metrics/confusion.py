"""The confusion-matrix family: `ConfusionMatrix`, `Precision`, `Recall`,
`F1Score`, `FBetaScore`.

All five hold the same state, a `(num_classes, num_classes)` carried integer count
of (true class, predicted class) pairs, and share one `update`; they differ only in
what `compute()` returns, and each can give every other view of its counts
(`confusion_matrix()`, `precision(average)`, `recall(average)`,
`fbeta(beta, average)`). Scores follow scikit-learn with `labels=range(num_classes)`
and `zero_division=0`.
"""

from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .accumulator import MetricAccumulator
from .base import Metric
from .inputs import (
    check_range,
    class_predictions,
    count_dtype,
    counted_mask,
    float_dtype,
    integer_labels,
)

AVERAGES = ("micro", "macro", "weighted", "binary", None)

_C = TypeVar("_C", bound="_ConfusionCounts")


def _check_num_classes(num_classes: Any, caller: str) -> int:
    if not isinstance(num_classes, int) or isinstance(num_classes, bool):
        raise TypeError(f"{caller}: `num_classes` must be an int, got {num_classes!r}.")
    if num_classes < 2:
        raise ValueError(f"{caller}: `num_classes` must be >= 2, got {num_classes}.")
    return num_classes


def _check_average(average: Any, num_classes: int, caller: str) -> str | None:
    if average not in AVERAGES:
        raise ValueError(
            f"{caller}: unknown `average` {average!r}; expected one of "
            f"{list(AVERAGES)}."
        )
    if average == "binary" and num_classes != 2:
        raise ValueError(
            f"{caller}: average='binary' scores class 1 of a two-class problem, but "
            f"num_classes={num_classes}; use 'macro', 'micro', 'weighted' or None."
        )
    return average  # type: ignore[no-any-return]


def _divide(num: Array, den: Array) -> Array:
    """`num / den` with 0/0 (and x/0) as 0 (scikit-learn's `zero_division=0`)."""
    return jnp.where(den == 0, 0.0, num / jnp.where(den == 0, 1.0, den))


def _score(counts: Array, kind: str, beta: float, average: str | None) -> Array:
    """Precision, recall or F-beta of a float confusion matrix (rows: true class,
    columns: predicted), per class or averaged."""
    tp = jnp.diagonal(counts)
    predicted, support = counts.sum(axis=0), counts.sum(axis=1)
    fp, fn = predicted - tp, support - tp
    if average == "micro":
        tp, fp, fn = tp.sum(), fp.sum(), fn.sum()
    if kind == "precision":
        per = _divide(tp, tp + fp)
    elif kind == "recall":
        per = _divide(tp, tp + fn)
    else:
        b2 = beta * beta
        per = _divide((1 + b2) * tp, (1 + b2) * tp + b2 * fn + fp)
    if average in (None, "micro"):
        return per
    if average == "binary":
        return per[1]
    if average == "macro":
        return per.mean()
    return _divide(jnp.sum(per * support), support.sum())  # weighted


class _ConfusionCounts(Metric):
    """The state and `update` of the confusion-matrix family; subclasses differ
    only in `compute`, and each can give every other view of its counts."""

    counts: MetricAccumulator
    num_classes: int = eqx.field(static=True)

    def __init__(self, num_classes: int):
        caller = type(self).__name__
        self.num_classes = _check_num_classes(num_classes, caller)
        zeros = jnp.zeros((num_classes, num_classes), count_dtype())
        self.counts = MetricAccumulator(zeros, compensated=True)

    def update(
        self: _C,
        logits_or_predictions: ArrayLike,
        labels: ArrayLike,
        mask: ArrayLike | None = None,
    ) -> _C:
        """Count a batch: `labels` integer classes of any shape;
        `logits_or_predictions` integer predictions of `labels`' shape, or float
        scores with a trailing axis of `num_classes` (argmax); `mask` boolean,
        broadcastable to `labels`' shape, False for examples not to count (another
        dtype is a `TypeError`).

        A label or integer prediction outside `[0, num_classes)` is a `ValueError`
        when known at trace time (among the entries `mask` keeps); at run time the
        example is not counted, like padding (so an ignore index such as -100 may
        also be left in under `jit`).

        **Raises:**

        `TypeError` for non-integer `labels`; `ValueError` for mismatched shapes,
        a number of classes other than `num_classes`, or out-of-range values known
        at trace time.
        """
        caller = f"{type(self).__name__}.update"
        n = self.num_classes
        labels = integer_labels(labels, caller)
        counted = counted_mask(mask, labels.shape, caller)
        preds = class_predictions(logits_or_predictions, labels, n, caller)
        fix = "exclude such examples with `mask`."
        check_range(labels, counted, 0, n - 1, caller, "labels", fix)
        check_range(preds, counted, 0, n - 1, caller, "logits_or_predictions", fix)
        valid = counted & (labels >= 0) & (labels < n) & (preds >= 0) & (preds < n)
        cell = jnp.where(
            valid, labels.astype(jnp.int32) * n + preds.astype(jnp.int32), 0
        )
        batch = jnp.zeros(n * n, count_dtype()).at[cell.ravel()].add(valid.ravel())
        return self._with_children({"counts": self.counts.update(batch.reshape(n, n))})

    def confusion_matrix(self) -> Array:
        """The `(num_classes, num_classes)` counts (rows: true class, columns:
        predicted) in the default integer dtype, saturated (never wrapped) at its
        largest value."""
        return self.counts.value

    def precision(self, average: str | None = "macro") -> Array:
        """Precision of these counts (see `Precision`)."""
        return self._view("precision", 1.0, average)

    def recall(self, average: str | None = "macro") -> Array:
        """Recall of these counts (see `Recall`)."""
        return self._view("recall", 1.0, average)

    def fbeta(self, beta: float | int = 1.0, average: str | None = "macro") -> Array:
        """F-beta score of these counts (see `FBetaScore`); `beta=1` is F1."""
        return self._view(
            "fbeta", _check_beta(beta, f"{type(self).__name__}.fbeta"), average
        )

    def _view(self, kind: str, beta: float, average: str | None) -> Array:
        average = _check_average(
            average, self.num_classes, f"{type(self).__name__}.{kind}"
        )
        return _score(self.counts.value_as(float_dtype()), kind, beta, average)


def _check_beta(beta: Any, caller: str) -> float:
    if isinstance(beta, bool) or not isinstance(beta, int | float):
        raise TypeError(f"{caller}: `beta` must be a number, got {beta!r}.")
    if not beta > 0:
        raise ValueError(f"{caller}: `beta` must be > 0, got {beta}.")
    return float(beta)


class ConfusionMatrix(_ConfusionCounts):
    """Counts of (true class, predicted class) pairs, scikit-learn's
    `confusion_matrix(labels, predictions, labels=range(num_classes))`.

    One `(num_classes, num_classes)` carried integer state (exact to 2**47 per
    cell), synced in the (sum, int) all-reduce. `Precision`, `Recall`, `F1Score` and
    `FBetaScore` hold the same state with the same `update`; any of them also gives
    the others' values through `precision(average)`, `recall(average)`,
    `fbeta(beta, average)` and `confusion_matrix()`.

    **Arguments:**

    - `num_classes`: the number of classes (>= 2).

    `compute()` is the integer `(num_classes, num_classes)` matrix, rows = true
    class, columns = predicted (default int dtype, saturated at its largest value).

    **Raises:**

    `TypeError`/`ValueError` for a `num_classes` that is not an int >= 2.

    !!! Example

        ```python
        cm = ed.metrics.ConfusionMatrix(3).update(logits, labels, mask)
        cm.compute()           # (3, 3) counts
        cm.recall(None)        # per-class recall from the same counts
        ```
    """

    def compute(self) -> Array:
        """The `(num_classes, num_classes)` integer counts."""
        return self.confusion_matrix()


class FBetaScore(_ConfusionCounts):
    """F-beta score, `(1 + beta**2) tp / ((1 + beta**2) tp + beta**2 fn + fp)`,
    per class or averaged, as scikit-learn's `fbeta_score(..., labels=
    range(num_classes), zero_division=0)`: a 0/0 is 0, and averages run over all
    classes, absent ones included.

    A view of the confusion-matrix counts (see `ConfusionMatrix` for `update`,
    state and sync).

    **Arguments:**

    - `num_classes`: the number of classes (>= 2).
    - `beta`: weight of recall against precision (> 0).
    - `average`: `"macro"` (default; unweighted mean over classes), `"micro"`
      (from the summed counts: equals accuracy when every example is counted),
      `"weighted"` (mean weighted by each class's number of true examples),
      `"binary"` (class 1 of `num_classes=2`) or `None` (one value per class).

    `compute()` is a float scalar, or a `(num_classes,)` vector for
    `average=None`.

    **Raises:**

    `ValueError` for an unknown `average`, `"binary"` with `num_classes != 2`, or
    `beta <= 0`; `TypeError` for a non-numeric `beta` or non-int `num_classes`.

    !!! Example

        ```python
        f = ed.metrics.FBetaScore(3, beta=0.5, average="weighted")
        f.update(logits, labels).compute()
        ```
    """

    beta: float = eqx.field(static=True)
    average: str | None = eqx.field(static=True)

    def __init__(
        self, num_classes: int, beta: float | int, average: str | None = "macro"
    ):
        super().__init__(num_classes)
        name = type(self).__name__
        self.beta = _check_beta(beta, name)
        self.average = _check_average(average, self.num_classes, name)

    def compute(self) -> Array:
        """The score (float scalar, or one per class for `average=None`)."""
        return self.fbeta(self.beta, self.average)


class F1Score(FBetaScore):
    """F1 score, the harmonic mean of precision and recall: `FBetaScore` with
    `beta=1` (scikit-learn's `f1_score(..., zero_division=0)`).

    **Arguments:**

    - `num_classes`: the number of classes (>= 2).
    - `average`: as `FBetaScore`'s (default `"macro"`).

    !!! Example

        ```python
        ed.metrics.F1Score(10).update(logits, labels, mask).compute()  # macro-F1
        ```
    """

    def __init__(self, num_classes: int, average: str | None = "macro"):
        super().__init__(num_classes, 1.0, average)


class _AveragedScore(_ConfusionCounts):
    """A score of the counts named by `_kind`, per class or averaged: what
    `Precision` and `Recall` share."""

    average: str | None = eqx.field(static=True)
    _kind: ClassVar[str]

    def __init__(self, num_classes: int, average: str | None = "macro"):
        super().__init__(num_classes)
        self.average = _check_average(average, self.num_classes, type(self).__name__)

    def compute(self) -> Array:
        """The score (float scalar, or one per class for `average=None`)."""
        return self._view(self._kind, 1.0, self.average)


class Precision(_AveragedScore):
    """Precision, `tp / (tp + fp)`: of the examples predicted as a class, the
    fraction that are; scikit-learn's `precision_score(..., labels=
    range(num_classes), zero_division=0)`.

    A view of the confusion-matrix counts (see `ConfusionMatrix`).

    **Arguments:**

    - `num_classes`: the number of classes (>= 2).
    - `average`: as `FBetaScore`'s (default `"macro"`).

    `compute()` is a float scalar, or a `(num_classes,)` vector for `average=None`.

    !!! Example

        ```python
        ed.metrics.Precision(2, average="binary").update(predictions, labels).compute()
        ```
    """

    _kind = "precision"


class Recall(_AveragedScore):
    """Recall, `tp / (tp + fn)`: of the examples of a class, the fraction predicted
    as it; scikit-learn's `recall_score(..., labels=range(num_classes),
    zero_division=0)`. Macro recall is balanced accuracy over all classes.
    Arguments, counts and `compute()` as `Precision`'s.

    !!! Example

        ```python
        ed.metrics.Recall(5, average=None).update(logits, labels).compute()  # per class
        ```
    """

    _kind = "recall"
