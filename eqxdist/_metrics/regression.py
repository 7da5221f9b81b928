"""Regression metrics: `MeanSquaredError` (and RMSE), `MeanAbsoluteError`,
`MeanSquaredLogError`, `R2Score` and `PearsonCorrCoef`.

All take `update(preds, targets, weights=None, mask=None)` on arrays of any
equal shapes, every element one observation (scikit-learn's metrics on the
flattened arrays), with optional `weights` that broadcast to that shape (weight 0
leaves an element out, even a NaN one; one weight per row covers the row) and an
optional bool `mask` (rows or elements to count, broadcast alike). The mean
errors hold a `Mean` of the per-element errors; `R2Score` and `PearsonCorrCoef`
hold the weighted moments of the batch (weight, means, sums of squared
deviations and co-deviations), merged exactly by Chan's parallel formula, so
that no sum of squares minus a squared sum ever cancels.
"""

import abc
from typing import TypeVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from .accumulator import FoldAccumulator
from .aggregation import Mean
from .base import Metric
from .checks import float_input, same_shape, weights_for
from .inputs import counted_mask, float_dtype, is_concrete

_E = TypeVar("_E", bound="_MeanError")


def _observations(
    preds: ArrayLike,
    targets: ArrayLike,
    weights: ArrayLike | None,
    mask: ArrayLike | None,
    caller: str,
) -> tuple[Array, Array, Array]:
    """Flat float `preds`, `targets` and `weights` (ones when `None`, zero where
    `mask` is `False`); elements of weight 0 are zeroed so that a NaN there
    cannot leak into a sum."""
    p = float_input(preds, caller, "preds")
    t = float_input(targets, caller, "targets")
    same_shape(p, t, caller, ("preds", "targets"), "one prediction per target")
    w = weights_for(weights, t.shape, caller, "`targets`")
    if mask is not None:
        counted = counted_mask(
            mask, t.shape, caller, has_weights=True, target="`targets`"
        )
        w = jnp.where(counted, w, 0)
    dtype = jnp.promote_types(jnp.promote_types(p.dtype, t.dtype), w.dtype)
    keep = w != 0
    p, t = (jnp.where(keep, x, 0).astype(dtype).ravel() for x in (p, t))
    return p, t, w.astype(dtype).ravel()


class _MeanError(Metric):
    """The weighted mean of a per-element error of `preds` against `targets`."""

    errors: Mean

    def __init__(self) -> None:
        self.errors = Mean()

    def update(
        self: _E,
        preds: ArrayLike,
        targets: ArrayLike,
        weights: ArrayLike | None = None,
        mask: ArrayLike | None = None,
    ) -> _E:
        """Add a batch: `preds` and `targets` of the same (any) shape, `weights`
        `None` or broadcastable to it (weight 0: not counted; one value per row
        covers the row's other dimensions), `mask` `None` or bool, broadcast as
        `weights` (`False`: not counted, e.g. padding rows).

        **Raises:**

        `TypeError` for non-numeric input or a non-bool mask; `ValueError` for
        shapes that differ or weights or a mask that do not broadcast.
        """
        caller = f"{type(self).__name__}.update"
        p, t, w = _observations(preds, targets, weights, mask, caller)
        self._check(p, t, w, caller)
        errors = self._error(p, t).astype(float_dtype())
        unweighted = weights is None and mask is None
        update = self.errors.update(errors, None if unweighted else w)
        return self._with_children({"errors": update})

    @abc.abstractmethod
    def _error(self, preds: Array, targets: Array) -> Array:
        """The per-element error."""

    def _check(self, preds: Array, targets: Array, weights: Array, caller: str) -> None:
        """Raise for values known now that the error is not defined for."""

    def compute(self) -> Array:
        """The weighted mean error; NaN while the total weight is 0."""
        return self.errors.compute()


class MeanSquaredError(_MeanError):
    """Mean squared error, `sum(w (preds - targets)**2) / sum(w)` (scikit-learn's
    `mean_squared_error` on the flattened arrays); `squared=False` gives its square
    root, the RMSE (`root_mean_squared_error`).

    The state is a `Mean` of the squared errors (a compensated float sum and
    the weight), synced in the (sum, float) and (sum, int) all-reduces.

    **Arguments:**

    - `squared`: `True` (default) for the MSE, `False` for the RMSE.

    `compute()` is a float scalar, NaN while the total weight is 0.

    !!! Example

        ```python
        mse = ed.metrics.MeanSquaredError().update(preds, targets)
        rmse = ed.metrics.MeanSquaredError(squared=False)
        rmse = rmse.update(preds, targets, weights=w)
        ```
    """

    squared: bool = eqx.field(static=True)

    def __init__(self, squared: bool = True) -> None:
        if not isinstance(squared, bool):
            raise TypeError(
                f"MeanSquaredError: `squared` must be a bool, got {squared!r}."
            )
        super().__init__()
        self.squared = squared

    def _error(self, preds: Array, targets: Array) -> Array:
        return (preds - targets) ** 2

    def compute(self) -> Array:
        """The MSE (or RMSE); NaN while the total weight is 0."""
        mse = self.errors.compute()
        return mse if self.squared else jnp.sqrt(mse)


class MeanAbsoluteError(_MeanError):
    """Mean absolute error, `sum(w |preds - targets|) / sum(w)`
    (scikit-learn's `mean_absolute_error` on the flattened arrays). State and sync
    as `MeanSquaredError`'s.

    !!! Example

        ```python
        ed.metrics.MeanAbsoluteError().update(preds, targets).compute()
        ```
    """

    def _error(self, preds: Array, targets: Array) -> Array:
        return jnp.abs(preds - targets)


class MeanSquaredLogError(_MeanError):
    """Mean squared logarithmic error, `sum(w (log1p(preds) - log1p(targets))**2)
    / sum(w)` (scikit-learn's `mean_squared_log_error` on the flattened arrays),
    for targets that grow exponentially. State and sync as `MeanSquaredError`'s.

    A value <= -1 (whose `log1p` is undefined) with a non-zero weight is a
    `ValueError` when known at trace time; under `jit` it makes the result NaN.

    !!! Example

        ```python
        ed.metrics.MeanSquaredLogError().update(predicted_counts, counts).compute()
        ```
    """

    def _error(self, preds: Array, targets: Array) -> Array:
        return (jnp.log1p(preds) - jnp.log1p(targets)) ** 2

    def _check(self, preds: Array, targets: Array, weights: Array, caller: str) -> None:
        for name, x in (("preds", preds), ("targets", targets)):
            if not (is_concrete(x) and is_concrete(weights)):
                continue
            values = np.asarray(x)
            bad = (values <= -1) & np.asarray(weights != 0)
            if bad.any():
                index = int(np.argmax(bad))
                raise ValueError(
                    f"{caller}: `{name}` holds {values[index]} (flat index "
                    f"{index}), but the log error needs values > -1."
                )


def _moments(x: Array, y: Array, w: Array) -> Array:
    """`(weight, mean_x, mean_y, Cxx, Cyy, Cxy)` of a batch, in two passes (the
    means first, then the sums of products of deviations from them)."""
    total = jnp.sum(w)
    safe = jnp.where(total == 0, 1, total)
    mx, my = jnp.sum(w * x) / safe, jnp.sum(w * y) / safe
    dx, dy = x - mx, y - my
    return jnp.stack(
        [
            total,
            mx,
            my,
            jnp.sum(w * dx * dx),
            jnp.sum(w * dy * dy),
            jnp.sum(w * dx * dy),
        ]
    )


def _chan_comoments(a: Array, b: Array) -> Array:
    """Merge two `_moments` states (Chan et al.'s parallel formula), extended to
    co-moments; entries past the sixth are plain sums."""
    w = a[0] + b[0]
    share = jnp.where(w == 0, 0, b[0] / jnp.where(w == 0, 1, w))
    dx, dy = b[1] - a[1], b[2] - a[2]
    pair = a[0] * share  # wa * wb / w
    merged = jnp.stack(
        [
            w,
            a[1] + share * dx,
            a[2] + share * dy,
            a[3] + b[3] + dx * dx * pair,
            a[4] + b[4] + dy * dy * pair,
            a[5] + b[5] + dx * dy * pair,
        ]
    )
    return jnp.concatenate([merged, a[6:] + b[6:]])


def _moment_state(extra: int) -> FoldAccumulator:
    return FoldAccumulator(jnp.zeros(6 + extra, float_dtype()), _chan_comoments)


class R2Score(Metric):
    """Coefficient of determination, `1 - SS_res / SS_tot` with `SS_res =
    sum(w (targets - preds)**2)` and `SS_tot = sum(w (targets - mean)**2)`:
    scikit-learn's `r2_score` on the flattened arrays (`force_finite=True`).

    Constant targets (`SS_tot = 0`) give 1.0 for perfect predictions and 0.0
    otherwise, as scikit-learn does; fewer than two observations of non-zero
    weight give NaN (scikit-learn counts observations whatever their weight).

    The state is the weighted moments of (preds, targets) plus `SS_res` and the
    number of observations, merged by Chan's formula: a `FoldAccumulator` synced
    in its row of the (sum, float) all-reduce.

    !!! Example

        ```python
        ed.metrics.R2Score().update(preds, targets, weights=w).compute()
        ```
    """

    moments: FoldAccumulator

    def __init__(self) -> None:
        self.moments = _moment_state(2)

    def update(
        self,
        preds: ArrayLike,
        targets: ArrayLike,
        weights: ArrayLike | None = None,
        mask: ArrayLike | None = None,
    ) -> "R2Score":
        """Add a batch (as `MeanSquaredError.update`)."""
        p, t, w = _observations(preds, targets, weights, mask, "R2Score.update")
        residual = jnp.sum(w * (t - p) ** 2)
        batch = jnp.concatenate(
            [_moments(p, t, w), jnp.stack([residual, jnp.sum(w != 0).astype(w.dtype)])]
        ).astype(self.moments.local.dtype)
        return self._with_children({"moments": self.moments.update(batch)})

    def compute(self) -> Array:
        """R²; NaN with fewer than two observations."""
        state = self.moments.value
        ss_tot, ss_res, count = state[4], state[6], state[7]
        safe = jnp.where(ss_tot == 0, 1, ss_tot)
        r2 = jnp.where(ss_tot == 0, jnp.where(ss_res == 0, 1.0, 0.0), 1 - ss_res / safe)
        return jnp.where(count < 2, jnp.nan, r2)


class PearsonCorrCoef(Metric):
    """Pearson correlation coefficient of `preds` and `targets`,
    `Cxy / sqrt(Cxx Cyy)` over the weighted co-deviations (NumPy's
    `corrcoef(preds.ravel(), targets.ravel())[0, 1]` without weights).

    The state is the weight, both means and the three sums of products of
    deviations, merged exactly by Chan's formula (no sum of squares minus a
    squared sum): a `FoldAccumulator` synced in its row of the (sum, float)
    all-reduce.

    `compute()` is NaN while either side is constant (or nothing was counted).

    !!! Example

        ```python
        ed.metrics.PearsonCorrCoef().update(preds, targets).compute()
        ```
    """

    moments: FoldAccumulator

    def __init__(self) -> None:
        self.moments = _moment_state(0)

    def update(
        self,
        preds: ArrayLike,
        targets: ArrayLike,
        weights: ArrayLike | None = None,
        mask: ArrayLike | None = None,
    ) -> "PearsonCorrCoef":
        """Add a batch (as `MeanSquaredError.update`)."""
        p, t, w = _observations(preds, targets, weights, mask, "PearsonCorrCoef.update")
        batch = _moments(p, t, w).astype(self.moments.local.dtype)
        return self._with_children({"moments": self.moments.update(batch)})

    def compute(self) -> Array:
        """The correlation in [-1, 1]; NaN for a constant side."""
        _, _, _, cxx, cyy, cxy = self.moments.value
        denominator = jnp.sqrt(cxx * cyy)
        safe = jnp.where(denominator == 0, 1, denominator)
        return jnp.where(denominator == 0, jnp.nan, jnp.clip(cxy / safe, -1.0, 1.0))
