"""Calibration of a classifier's confidence: `CalibrationError`."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .accumulator import MetricAccumulator
from .base import Metric
from .checks import positive_int
from .inputs import (
    as_array,
    check_range,
    count_dtype,
    counted_mask,
    float_dtype,
    integer_labels,
)


class CalibrationError(Metric):
    """Expected calibration error of the top-label confidence (Guo et al., 2017):
    the examples are binned by their highest probability into `num_bins` equal
    bins of [0, 1] (`[i/n, (i+1)/n)`, the last one closed), and
    `ECE = sum_b |correct_b - confidence_b| / N`, with `correct_b` the number of
    examples of bin `b` whose top class is the label and `confidence_b` the sum of
    their highest probabilities (torchmetrics' `CalibrationError(norm="l1")`).

    The state is a `(2, num_bins)` carried integer count (examples and correct
    ones per bin) and a `(num_bins,)` compensated float sum of the confidences,
    synced in the (sum, int) and (sum, float) all-reduces.

    `update(probs, labels, mask=None)`: `probs` float `(..., C)` in [0, 1] (e.g.
    `jax.nn.softmax(logits)`), `labels` integer `(...)`, `mask` boolean,
    broadcastable to `labels`' shape. Probabilities outside [0, 1] and labels
    outside `[0, C)` are a `ValueError` when known at trace time (among the
    entries `mask` keeps); under `jit` a confidence is clipped into the bins and
    an example with such a label counts as wrong.

    **Arguments:**

    - `num_bins`: the number of equal-width bins (>= 1; default 15).

    `compute()` is a float scalar in [0, 1]; NaN while nothing has been counted.

    **Raises:**

    `TypeError`/`ValueError` for a `num_bins` that is not an int >= 1.

    !!! Example

        ```python
        ece = ed.metrics.CalibrationError().update(jax.nn.softmax(logits), labels, mask)
        ece.compute()
        ```
    """

    counts: MetricAccumulator
    confidence: MetricAccumulator
    num_bins: int = eqx.field(static=True)

    def __init__(self, num_bins: int = 15):
        self.num_bins = positive_int(num_bins, "CalibrationError", "num_bins")
        self.counts = MetricAccumulator(
            jnp.zeros((2, num_bins), count_dtype()), compensated=True
        )
        self.confidence = MetricAccumulator(
            jnp.zeros(num_bins, float_dtype()), compensated=True
        )

    def update(
        self, probs: ArrayLike, labels: ArrayLike, mask: ArrayLike | None = None
    ) -> "CalibrationError":
        """Count a batch of predicted distributions.

        **Raises:**

        `TypeError` for non-float `probs`, non-integer `labels` or a non-boolean
        `mask`; `ValueError` for mismatched shapes or values out of range known at
        trace time.
        """
        caller = "CalibrationError.update"
        probs = as_array(probs, caller, "probs")
        if not jnp.issubdtype(probs.dtype, jnp.floating):
            raise TypeError(
                f"{caller}: `probs` must be float probabilities, got dtype "
                f"{probs.dtype}."
            )
        labels = integer_labels(labels, caller)
        if probs.ndim != labels.ndim + 1 or probs.shape[:-1] != labels.shape:
            raise ValueError(
                f"{caller}: `probs` of shape {probs.shape} must have the shape of "
                f"`labels` {labels.shape} plus a trailing class axis."
            )
        counted = counted_mask(
            mask, labels.shape, caller, has_weights=False, target="the rows"
        )
        fix = "pass probabilities (e.g. jax.nn.softmax of logits)."
        check_range(probs, counted[..., None], 0, 1, caller, "probs", fix)
        classes = probs.shape[-1]
        fix = "exclude such examples with `mask`."
        check_range(labels, counted, 0, classes - 1, caller, "labels", fix)
        confidence = jnp.max(probs, axis=-1).astype(float_dtype())
        correct = jnp.argmax(probs, axis=-1) == labels
        n = self.num_bins
        bins = jnp.clip(jnp.floor(confidence * n), 0, n - 1).astype(jnp.int32).ravel()
        keep = counted.ravel()
        hits = jnp.stack([keep, keep & correct.ravel()]).astype(count_dtype())
        counts = jnp.zeros((2, n), count_dtype()).at[:, bins].add(hits)
        summed = (
            jnp.zeros(n, float_dtype())
            .at[bins]
            .add(jnp.where(keep, confidence.ravel(), 0))
        )
        return self._with_children(
            {
                "counts": self.counts.update(counts),
                "confidence": self.confidence.update(summed),
            }
        )

    def compute(self) -> Array:
        """The expected calibration error; NaN while empty."""
        counts = self.counts.value_as(float_dtype())
        total = counts[0].sum()
        gap = jnp.abs(counts[1] - self.confidence.value).sum()
        return jnp.where(total == 0, jnp.nan, gap / jnp.where(total == 0, 1, total))
