"""Binary ranking of scores: `AveragePrecision`, binned as `AUROC` is, with sample
weights."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .accumulator import MetricAccumulator
from .base import Metric
from .checks import positive_int, weights_for
from .inputs import binned_scores, float_dtype


class AveragePrecision(Metric):
    """Average precision of a binary task, `sum_n (R_n - R_(n-1)) P_n` over the
    thresholds from the highest score down, binned: scikit-learn's
    `average_precision_score` within about 1e-2 at the default 200 thresholds,
    exact in the limit of many thresholds (examples whose scores share a bin count
    as tied, as equal scores do in scikit-learn).

    The state is two weighted histograms of scores, negatives and positives, over
    `num_thresholds` equal bins of [0, 1]: a `(2, num_thresholds)` compensated
    float sum (weights may be fractional; 0/1 weights stay exact counts to about
    2**36 through `sync`), synced in the (sum, float) all-reduce. Memory does not
    grow with the number of examples.

    `update(scores, labels, mask=None, weights=None)`: `scores` float in [0, 1]
    (probabilities of class 1), `labels` in {0, 1} (int or bool), of the same
    shape; `mask` boolean and `weights` numbers, both broadcastable to it.

    Out-of-range input is treated as `AUROC` treats it: a `ValueError` when known
    at trace time (among the entries `mask` keeps); under `jit` a score below 0
    falls in the first bin and above 1 in the last, and a NaN score or a label
    other than 0/1 is not counted.

    **Arguments:**

    - `num_thresholds`: the number of bins (>= 2; default 200).

    `compute()` is a float scalar; NaN while there is no positive example
    (scikit-learn returns 0 with a warning).

    **Raises:**

    `TypeError`/`ValueError` for a `num_thresholds` that is not an int >= 2.

    !!! Example

        ```python
        ap = ed.metrics.AveragePrecision().update(jax.nn.sigmoid(logits), labels, mask)
        ap.compute()
        ```
    """

    histograms: MetricAccumulator
    num_thresholds: int = eqx.field(static=True)

    def __init__(self, num_thresholds: int = 200):
        self.num_thresholds = positive_int(
            num_thresholds, "AveragePrecision", "num_thresholds", 2
        )
        zeros = jnp.zeros((2, num_thresholds), float_dtype())
        self.histograms = MetricAccumulator(zeros, compensated=True)

    def update(
        self,
        scores: ArrayLike,
        labels: ArrayLike,
        mask: ArrayLike | None = None,
        weights: ArrayLike | None = None,
    ) -> "AveragePrecision":
        """Count a batch of scores, each with weight 1 or its entry of `weights`.

        **Raises:**

        `TypeError` for non-float `scores`, non-integer `labels` or a non-boolean
        `mask`; `ValueError` for shapes that differ or do not broadcast, or values
        out of range known at trace time.
        """
        caller = "AveragePrecision.update"
        t = self.num_thresholds
        valid, cell = binned_scores(scores, labels, mask, t, caller)
        w = weights_for(weights, valid.shape, caller, "`labels`")
        dtype = self.histograms.local.dtype
        added = jnp.where(valid, w, 0).astype(dtype).ravel()
        batch = jnp.zeros(2 * t, dtype).at[cell.ravel()].add(added)
        return self._with_children(
            {"histograms": self.histograms.update(batch.reshape(2, t))}
        )

    def compute(self) -> Array:
        """The average precision (float); NaN without a positive example."""
        neg, pos = self.histograms.value
        # Thresholds at the bin edges, from the highest bin down: the examples at
        # or above bin b are predicted positive.
        tp = jnp.cumsum(pos[::-1])[::-1]
        fp = jnp.cumsum(neg[::-1])[::-1]
        predicted = tp + fp
        precision = jnp.where(
            predicted == 0, 0, tp / jnp.where(predicted == 0, 1, predicted)
        )
        total = pos.sum()
        ap = jnp.sum(pos * precision) / jnp.where(total == 0, 1, total)
        return jnp.where(total == 0, jnp.nan, ap)
