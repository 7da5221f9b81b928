"""Aggregations of values: `Sum`, `Mean`, `Max`, `Min`, `Std`, `LastValue`.

Which aggregation to use: `Mean` for losses and any per-example score (weighted,
masks as weights); `Sum` for totals (tokens seen); `Max`/`Min` for extremes; `Std`
for a spread (gradient norms, per-example losses); `LastValue` for a value that is
set rather than aggregated (learning rate, step).

`nan_strategy` (`"propagate"` or `"ignore"`) on `Sum`, `Mean`, `Max`, `Min` and
`Std` says what a NaN value does: make the result NaN (default), or count as if it
were not there.
"""

from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, DTypeLike

from .accumulator import FoldAccumulator, MetricAccumulator, ReduceOp, two_sum
from .base import Metric
from .inputs import (
    as_array,
    cast_into,
    check_broadcast,
    count_dtype,
    state_dtype,
)

NAN_STRATEGIES = ("propagate", "ignore")


def check_nan_strategy(nan_strategy: Any, caller: str) -> str:
    """`nan_strategy` if it is one of `NAN_STRATEGIES`, else a `ValueError`."""
    if nan_strategy not in NAN_STRATEGIES:
        raise ValueError(
            f"{caller}: unknown `nan_strategy` {nan_strategy!r}; expected one of "
            f"{list(NAN_STRATEGIES)}."
        )
    return str(nan_strategy)


def _extreme(dtype: jnp.dtype, op: ReduceOp) -> Array:
    """The identity of max (lowest value) or min (highest value) for `dtype`."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(-jnp.inf if op is ReduceOp.MAX else jnp.inf, dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if op is ReduceOp.MAX else info.max, dtype)


class Sum(Metric):
    """Sum of every value seen; use it for totals (tokens, examples, a loss sum).

    **Arguments:**

    - `dtype`: the state's dtype; default JAX's default float (float32). Use an
      integer dtype to add up integers exactly.
    - `nan_strategy`: `"propagate"` (default: a NaN makes the sum NaN) or
      `"ignore"` (NaN values are skipped).

    `update(values)` adds `values.sum()`; `compute()` is the total, 0 when empty.
    A float total is a compensated sum and an integer total a carried sum (see
    `MetricAccumulator`): float32 keeps growing past 2**24 times each addition
    (integers stay exact to about 2**48; state dict keys `"local"` and
    `"local_lo"`, whose sum is the total), an int32 total never wraps (exact to
    2**47; keys `"local"` and `"local_hi"`; `compute()` saturates at 2**31 - 1).
    Syncs in the (sum, dtype) all-reduce.

    **Raises:**

    `TypeError` for a `dtype` that is not an integer or float dtype; `ValueError`
    for an unknown `nan_strategy`.

    !!! Example

        ```python
        ed.metrics.Sum().update(jnp.array([1.0, 2.0])).update(3.0).compute()  # 6.0
        ```
    """

    total: MetricAccumulator
    nan_strategy: str = eqx.field(static=True)

    def __init__(
        self, dtype: DTypeLike | None = None, *, nan_strategy: str = "propagate"
    ):
        dtype = state_dtype(dtype, "Sum")
        self.nan_strategy = check_nan_strategy(nan_strategy, "Sum")
        # Unsigned or narrow integers do not carry; they sum in their own dtype.
        signed = jnp.issubdtype(dtype, jnp.signedinteger)
        wide = jnp.issubdtype(dtype, jnp.floating) or (
            signed and jnp.iinfo(dtype).bits >= 32
        )
        self.total = MetricAccumulator(jnp.zeros((), dtype), compensated=wide)

    def update(self, values: ArrayLike) -> "Sum":
        """Add `values.sum()` (any shape, empty included); integers exactly, host
        integers wider than int32 included (to 2**47)."""
        dtype = self.total.local.dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            return self._with_children({"total": self.total.update_sum(values)})
        values = as_array(values, "Sum.update", "values", wide_to_float=True)
        values = cast_into(values, dtype, "Sum.update", "values")
        if self.nan_strategy == "ignore":
            values = jnp.where(jnp.isnan(values), jnp.zeros_like(values), values)
        return self._with_children({"total": self.total.update(jnp.sum(values))})

    def compute(self) -> Array:
        """The sum."""
        return self.total.value


def _weighted(
    values: ArrayLike,
    weights: ArrayLike | None,
    dtype: jnp.dtype,
    nan_strategy: str,
    caller: str,
) -> tuple[Array, Array | None]:
    """`values` cast to `dtype` and `weights` broadcast to their shape (`None` for
    unweighted), with NaN values given weight 0 under `nan_strategy="ignore"`."""
    values = as_array(values, caller, "values", wide_to_float=True)
    values = cast_into(values, dtype, caller, "values")
    if weights is not None:
        weights = as_array(weights, caller, "weights", wide_to_float=True)
        weights = check_broadcast(weights, values.shape, caller, "weights", "`values`")
    if nan_strategy == "ignore":
        keep = ~jnp.isnan(values)
        weights = (
            keep
            if weights is None
            else jnp.where(keep, weights, 0).astype(weights.dtype)
        )
    return values, weights


def _add_sum(acc: MetricAccumulator, values: Array) -> MetricAccumulator:
    """Add `values.sum()` to a compensated float sum. A dtype narrower than
    float32 sums in float32 and adds the result as two words (rounded, and what
    rounding lost), so a float16 batch sum is not rounded before it is kept."""
    dtype = acc.local.dtype
    wide = jnp.promote_types(dtype, jnp.float32)
    if wide == dtype:
        return acc.update(jnp.sum(values))
    total = jnp.sum(values.astype(wide))
    hi = total.astype(dtype)
    return acc.update(hi).update((total - hi.astype(wide)).astype(dtype))


class Mean(Metric):
    """Weighted mean, `sum(values * weights) / sum(weights)`, kept as sums; use it
    for losses and any per-example score (a mask of padding as the weights).

    The total weight is kept in two parts: unweighted values (`weights=None`) and
    integer or boolean weights (masks) are *counted* in a carried integer sum,
    exact to 2**47 and never wrapping; float weights are added in a compensated
    float sum (see `MetricAccumulator`), which does not stop at 2**24 either: 0/1
    float weights stay exact counts to about 2**48 through `update` and `merge`,
    and to 2**36 through `sync` (as long as each update's own weights add up to
    less than 2**24). The weighted sum of the values is a compensated sum too, so
    that a mean of many small values does not drift. Syncs in the (sum, float) and
    (sum, int) all-reduces.

    Every float dtype works, float16 and bfloat16 included: `compute()` divides in
    at least float32 and rounds once to `dtype`.

    **Arguments:**

    - `dtype`: float dtype of the weighted sum and of the float weights; default
      JAX's default float (float32).
    - `nan_strategy`: `"propagate"` (default: a NaN value with a non-zero weight
      makes the mean NaN) or `"ignore"` (NaN values get weight 0).

    `compute()` is NaN while the total weight is 0.

    **Raises:**

    `TypeError` for a `dtype` that is not a float dtype; `ValueError` for an
    unknown `nan_strategy`.

    !!! Example

        ```python
        m = ed.metrics.Mean().update(jnp.array([1.0, 3.0]))                  # mean 2
        m = m.update(jnp.array([10.0, 0.0]), weights=jnp.array([1, 0]))
        m.compute()  # (1 + 3 + 10) / 3
        ```
    """

    total: MetricAccumulator
    weight: MetricAccumulator
    count: MetricAccumulator
    nan_strategy: str = eqx.field(static=True)

    def __init__(
        self, dtype: DTypeLike | None = None, *, nan_strategy: str = "propagate"
    ):
        dtype = state_dtype(dtype, "Mean", kinds="float")
        self.nan_strategy = check_nan_strategy(nan_strategy, "Mean")
        self.total = MetricAccumulator(jnp.zeros((), dtype), compensated=True)
        self.weight = MetricAccumulator(jnp.zeros((), dtype), compensated=True)
        self.count = MetricAccumulator(jnp.zeros((), count_dtype()), compensated=True)

    def update(self, values: ArrayLike, weights: ArrayLike | None = None) -> "Mean":
        """Add a batch of `values` (any shape), each with weight 1 or with the
        matching entry of `weights`.

        **Arguments:**

        - `values`: the values to average.
        - `weights`: `None`, or an array that broadcasts to `values`' shape (e.g. a
          0/1 or boolean mask of padded examples, or per-example weights). Values
          with weight 0 are ignored, even NaN or inf ones.

        **Raises:**

        `TypeError` if `values` or `weights` are `None` (values) or not numeric;
        `ValueError` if `weights` does not broadcast to `values`' shape.
        """
        dtype = self.total.local.dtype
        values, weights = _weighted(
            values, weights, dtype, self.nan_strategy, "Mean.update"
        )
        if weights is None:
            return self._with_children(
                {
                    "total": _add_sum(self.total, values),
                    "count": self.count.update(values.size),
                }
            )
        # Weight 0 excludes a value outright, so padding may hold NaN or inf.
        weighted = jnp.where(weights != 0, values * weights.astype(dtype), 0)
        total = _add_sum(self.total, weighted)
        if jnp.issubdtype(weights.dtype, jnp.floating):
            counted = {"weight": _add_sum(self.weight, weights.astype(dtype))}
        else:
            # Counted exactly: integer weights of 2**30 add up past 2**31.
            counted = {"count": self.count.update_sum(weights)}
        return self._with_children({"total": total, **counted})

    def compute(self) -> Array:
        """The weighted mean; NaN while the total weight is 0."""
        # In at least float32, rounded once: a float16 state's count alone may be
        # past float16's range (65504).
        dtype = self.total.local.dtype
        wide = jnp.promote_types(dtype, jnp.float32)
        total = self.total.value_as(wide)
        weight = self.weight.value_as(wide) + self.count.value_as(wide)
        return jnp.where(weight == 0, jnp.nan, total / weight).astype(dtype)


_E = TypeVar("_E", bound="_Extremum")


class _Extremum(Metric):
    best: MetricAccumulator
    nan_strategy: str = eqx.field(static=True)
    _op: ClassVar[ReduceOp]

    def __init__(
        self, dtype: DTypeLike | None = None, *, nan_strategy: str = "propagate"
    ):
        name = type(self).__name__
        self.nan_strategy = check_nan_strategy(nan_strategy, name)
        self.best = MetricAccumulator(
            _extreme(state_dtype(dtype, name), self._op), self._op
        )

    def update(self: _E, values: ArrayLike) -> _E:
        """Fold in the extreme of `values` (any shape, empty included)."""
        caller = f"{type(self).__name__}.update"
        dtype = self.best.local.dtype
        floating = jnp.issubdtype(dtype, jnp.floating)
        values = as_array(values, caller, "values", wide_to_float=floating)
        values = cast_into(values, dtype, caller, "values")
        if self.nan_strategy == "ignore":
            values = jnp.where(jnp.isnan(values), self.best.initial, values)
        reduce = jnp.max if self.best.reduce_op is ReduceOp.MAX else jnp.min
        # `initial` makes an empty batch a no-op instead of an error.
        extreme = reduce(values, initial=self.best.initial)
        return self._with_children({"best": self.best.update(extreme)})

    def compute(self) -> Array:
        """The extreme value seen (the empty value if none)."""
        return self.best.value


class Max(_Extremum):
    """Largest value seen; `-inf` before any (the dtype's lowest value for integer
    dtypes). Syncs in the (max, dtype) all-reduce.

    **Arguments:**

    - `dtype`: the state's dtype; default JAX's default float (float32).
    - `nan_strategy`: `"propagate"` (default: a NaN makes the result NaN) or
      `"ignore"` (NaN values are skipped).

    **Raises:**

    `TypeError` for a `dtype` that is not an integer or float dtype (e.g. `bool`);
    `ValueError` for an unknown `nan_strategy`.

    !!! Example

        ```python
        ed.metrics.Max().update(jnp.array([1.0, 5.0])).update(3.0).compute()  # 5.0
        ```
    """

    _op = ReduceOp.MAX


class Min(_Extremum):
    """Smallest value seen; `+inf` before any (the dtype's highest value for integer
    dtypes). Syncs in the (min, dtype) all-reduce.

    **Arguments:**

    - `dtype`: the state's dtype; default JAX's default float (float32).
    - `nan_strategy`: `"propagate"` (default) or `"ignore"` (NaN values skipped).

    **Raises:**

    `TypeError` for a `dtype` that is not an integer or float dtype (e.g. `bool`);
    `ValueError` for an unknown `nan_strategy`.

    !!! Example

        ```python
        ed.metrics.Min().update(jnp.array([1.0, 5.0])).compute()  # 1.0
        ```
    """

    _op = ReduceOp.MIN


def _chan_merge(a: Array, b: Array) -> Array:
    """Merge two `(weight, mean, mean_lo, M2)` moment states (Chan et al.'s
    parallel algorithm), M2 being the weighted sum of squared deviations from the
    mean. The mean is a double-word number `mean + mean_lo`: rounded to float32
    alone, at |mean| = 10**4 x the deviation, each merge would misplace it by
    10**-4 deviations and the squared differences of means would pick that up."""
    w = a[0] + b[0]
    share = jnp.where(w == 0, 0, b[0] / jnp.where(w == 0, 1, w))
    diff_hi, diff_lo = b[1] - a[1], b[2] - a[2]
    hi, error = two_sum(a[1], share * diff_hi)
    hi, lo = two_sum(hi, a[2] + error + share * diff_lo)
    delta = diff_hi + diff_lo
    m2 = a[3] + b[3] + delta * delta * a[0] * share
    return jnp.stack([w, hi, lo, m2])


class Std(Metric):
    """Weighted population standard deviation, `sqrt(sum(w (x - mean)**2) / sum(w))`;
    use it for the spread of per-example values (losses, norms).

    A sum of squares minus a squared sum loses everything when the mean is large
    against the deviation (float32 at |mean| = 10**4 x the deviation has nothing
    left). So the state is the weight, the mean (as a double-word number) and the
    sum of squared deviations `M2` of the values seen: each update computes them
    for its batch in two passes (mean first, then deviations, with the rounding of
    the mean corrected), and states are combined with Chan's merge, which only
    ever adds deviations. The result is accurate to float32 rounding whatever the
    mean. (The weight is a float: past 2**24 examples it is rounded, by a relative
    6e-8, which moves the result by no more.)

    That state is not a sum, so it syncs as a `FoldAccumulator`: every device's
    four numbers travel in its row of the (sum, dtype) all-reduce and every device
    merges the rows in device order (no extra collective; the message is
    `4 x axis_size` numbers).

    **Arguments:**

    - `dtype`: float dtype of the state; default JAX's default float (float32).
    - `nan_strategy`: `"propagate"` (default) or `"ignore"` (NaN values get weight
      0).

    `compute()` is NaN while the total weight is 0. `update(values, weights=None)`
    as `Mean`'s; negative weights are not supported.

    **Raises:**

    `TypeError` for a `dtype` that is not a float dtype; `ValueError` for an
    unknown `nan_strategy`.

    !!! Example

        ```python
        ed.metrics.Std().update(jnp.array([1e4 + 1, 1e4 - 1])).compute()  # 1.0
        ```
    """

    moments: FoldAccumulator
    nan_strategy: str = eqx.field(static=True)

    def __init__(
        self, dtype: DTypeLike | None = None, *, nan_strategy: str = "propagate"
    ):
        dtype = state_dtype(dtype, "Std", kinds="float")
        self.nan_strategy = check_nan_strategy(nan_strategy, "Std")
        self.moments = FoldAccumulator(jnp.zeros(4, dtype), _chan_merge)

    def update(self, values: ArrayLike, weights: ArrayLike | None = None) -> "Std":
        """Add a batch of `values` (any shape) with optional `weights` (broadcast to
        `values`' shape; weight-0 values are ignored, even NaN or inf ones).

        **Raises:**

        `TypeError` for non-numeric input; `ValueError` if `weights` does not
        broadcast to `values`' shape.
        """
        dtype = self.moments.local.dtype
        values, weights = _weighted(
            values, weights, dtype, self.nan_strategy, "Std.update"
        )
        w = jnp.ones_like(values) if weights is None else weights.astype(dtype)
        kept = w != 0
        x = jnp.where(kept, values, 0)
        total = jnp.sum(w)
        safe = jnp.where(total == 0, 1, total)
        mean = jnp.sum(w * x) / safe
        dev = jnp.where(kept, x - mean, 0)
        # The rounding error of `mean` would add its square to every deviation;
        # the mean of the deviations is that error, and subtracting it fixes both.
        shift = jnp.sum(w * dev) / safe
        m2 = jnp.sum(w * (dev - shift) ** 2)
        batch = jnp.stack([total, *two_sum(mean, shift), m2]).astype(dtype)
        return self._with_children({"moments": self.moments.update(batch)})

    def compute(self) -> Array:
        """The weighted population standard deviation; NaN while the weight is 0."""
        w, _, _, m2 = self.moments.value
        return jnp.where(
            w == 0, jnp.nan, jnp.sqrt(jnp.maximum(m2, 0) / jnp.where(w == 0, 1, w))
        )


def _keep_later(a: Array, b: Array) -> Array:
    """Of two `(has_value, *value)` states, the later one if it has a value."""
    return jnp.where(b[0] != 0, b, a)


class LastValue(Metric):
    """The last value given to `update`; use it for something that is set, not
    aggregated (a learning rate, a step number, a temperature).

    After `sync`, the last value of the highest-indexed device along the axis that
    has one, replicated (devices that never updated are skipped). The state is a
    flag and the value; it syncs as a `FoldAccumulator` (each device's row in the
    (sum, dtype) all-reduce, then the last row with a value is taken), and `merge`
    keeps `other`'s value when it has one.

    **Arguments:**

    - `shape`: the value's shape (default `()`, a scalar).
    - `dtype`: the value's dtype; default JAX's default float (float32).

    `compute()` is the value; NaN (0 for an integer dtype) before any update.

    **Raises:**

    `TypeError` for a `dtype` that is not an integer or float dtype.

    !!! Example

        ```python
        ed.metrics.LastValue().update(0.1).update(0.05).compute()  # 0.05
        ```
    """

    last: FoldAccumulator
    shape: tuple[int, ...] = eqx.field(static=True)

    def __init__(self, shape: Sequence[int] = (), dtype: DTypeLike | None = None):
        dtype = state_dtype(dtype, "LastValue")
        self.shape = tuple(int(d) for d in shape)
        size = 1
        for d in self.shape:
            size *= d
        self.last = FoldAccumulator(jnp.zeros(1 + size, dtype), _keep_later)

    def update(self, value: ArrayLike) -> "LastValue":
        """Replace the value (`value` must broadcast to `shape`).

        **Raises:**

        `TypeError` for a non-numeric value or a float into an integer state;
        `ValueError` if it does not broadcast to `shape`.
        """
        caller = "LastValue.update"
        value = as_array(value, caller, "value")
        value = check_broadcast(value, self.shape, caller, "value", "the metric")
        value = cast_into(value, self.last.local.dtype, caller, "value")
        one = jnp.ones(1, value.dtype)
        return self._with_children(
            {"last": self.last.update(jnp.concatenate([one, value.ravel()]))}
        )

    def compute(self) -> Array:
        """The last value; NaN (integers: 0) before any update."""
        state = self.last.value
        value = state[1:].reshape(self.shape)
        if jnp.issubdtype(value.dtype, jnp.floating):
            return jnp.where(state[0] != 0, value, jnp.nan)
        return value
