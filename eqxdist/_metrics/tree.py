"""Metric pytrees as training and evaluation steps return them: adding two up,
reducing them over the data axes, and printing them.

A metrics pytree mixes `Metric`s, arrays, Python numbers and `(sum, count)` tuples;
the functions here give each its own rule, so a step can treat the whole tree at
once."""

import warnings
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array

from .._utils import AxisName, is_array, is_key_array, path_str, typecheck
from .base import Metric


def is_metric(x: Any) -> bool:
    return isinstance(x, Metric)


def _addable(x: Any) -> bool:
    # Python numbers (e.g. a count of `batch.shape[0]`) stay Python numbers: summed
    # over minibatches and devices at trace time, they cost no collective.
    return is_array(x) or (isinstance(x, int | float) and not isinstance(x, bool))


def check_metrics(metrics: Any, caller: str) -> None:
    """Raise a `TypeError` naming the first leaf a step cannot add up and return:
    anything but a `Metric`, an array, a Python number or `None`."""
    leaves = jax.tree_util.tree_flatten_with_path(metrics, is_leaf=is_metric)[0]
    for path, leaf in leaves:
        if is_array(leaf) and is_key_array(leaf):
            raise TypeError(
                f"{caller}: metrics leaf {path_str(path)} is an array of PRNG keys "
                f"({leaf.dtype}); a step adds its metrics up over minibatches and "
                "devices, and keys cannot be added. Leave the key out of the "
                "metrics, or return `jax.random.key_data(key)` for its bits."
            )
        if is_metric(leaf) or _addable(leaf) or leaf is None:
            continue
        raise TypeError(
            f"{caller}: metrics leaf {path_str(path)} is a {type(leaf).__name__} "
            f"({leaf!r}); metrics must be arrays, numbers, `(sum, count)` tuples or "
            "eqxdist Metrics. Return strings and other values outside the step."
        )


class Summed(eqx.Module):
    """An array of a train step's metrics while the step adds it up, with how
    many values went into it (one per call of the loss: minibatches,
    microbatches, devices) and the rows of the batch the loss was given, so
    that the step can refuse per-row values and say what it summed
    (`with_counts`, `check_summed`, `without_counts`). Static fields: the counts are
    known when the step is traced and leave its `jax.jit` in the structure.

    - `plain`: the array is a metric of its own, not a part of a `(sum, count)`
      pair (a pair's parts are meant to be summed).
    """

    value: Array
    count: int = eqx.field(static=True)
    rows: int | None = eqx.field(static=True)
    plain: bool = eqx.field(static=True)


def _is_counted(x: Any) -> bool:
    return is_metric(x) or isinstance(x, Summed)


def _is_pair(x: Any) -> bool:
    return type(x) is tuple and len(x) == 2 and all(_addable(v) for v in x)


def with_counts(metrics: Any, rows: int | None) -> Any:
    """`metrics` (as a loss returned them, for a batch of `rows` rows) with
    every array leaf a `Summed` of one value; `Metric`s and numbers as they
    are."""

    def count(x: Any, plain: bool = True) -> Any:
        return Summed(x, 1, rows, plain) if is_array(x) else x

    def wrap(x: Any) -> Any:
        if _is_pair(x):
            return tuple(count(v, plain=False) for v in x)
        return x if is_metric(x) else count(x)

    return jax.tree.map(wrap, metrics, is_leaf=lambda x: is_metric(x) or _is_pair(x))


def is_per_row(shape: tuple[int, ...], rows: int | None) -> bool:
    """The one rule of what a metric that holds per-row values looks like: an
    array whose leading axis has one entry per row the loss was given."""
    return rows is not None and len(shape) > 0 and shape[0] == rows


def per_row_error(
    caller: str, path: str, shape: tuple[int, ...], rows: int, summed: str
) -> ValueError:
    """The error for a per-row metrics leaf (`is_per_row`) that a step would add
    up (`summed`: over what, and why that is wrong)."""
    return ValueError(
        f"{caller}: metrics leaf {path} has shape {shape}, one entry per row of "
        f"the {rows} rows it was given; {summed}, which would sum different rows. "
        "Return a metric instead: `ed.metrics.Mean().update(values)` or a "
        "`(sum, count)` pair `(values.sum(), values.shape[0])`. For per-row "
        "outputs (predictions, per-example losses) use "
        "make_eval_step(..., per_row=True) and return `(metrics, rows)`."
    )


def _summed_leaves(metrics: Any) -> list[tuple[str, Summed]]:
    leaves = jax.tree_util.tree_flatten_with_path(metrics, is_leaf=_is_counted)[0]
    return [(path_str(p), x) for p, x in leaves if isinstance(x, Summed)]


def check_summed(metrics: Any, caller: str) -> None:
    """A `ValueError` for a per-row array among `with_counts` metrics that were
    added up over more than one value."""
    for path, x in _summed_leaves(metrics):
        if x.count > 1 and x.rows is not None and is_per_row(x.value.shape, x.rows):
            raise per_row_error(
                caller,
                path,
                x.value.shape,
                x.rows,
                f"the train step adds its metrics up over {x.count} values (one "
                "per call of loss_fn, on every device and minibatch)",
            )


def without_counts(metrics: Any, caller: str, stacklevel: int = 2) -> Any:
    """`with_counts` metrics as the user returned them, after one `UserWarning`
    for the plain 0-d arrays among them that were summed over more than one
    value (a mean summed over 8 devices is 8 times the mean; arrays of other
    shapes, such as per-class counts, are meant to add up)."""
    summed = {
        p: x.count
        for p, x in _summed_leaves(metrics)
        if x.plain and x.count > 1 and not x.value.shape
    }
    if summed:
        n = " or ".join(str(c) for c in sorted(set(summed.values())))
        leaves = (
            f"leaf {next(iter(summed))} is a plain 0-d array, the sum of"
            if len(summed) == 1
            else f"leaves {', '.join(summed)} are plain 0-d arrays, each the sum of"
        )
        warnings.warn(
            f"{caller}: metrics {leaves} {n} values (one per call of "
            f"loss_fn): a mean comes back {n} times too large. For a mean, "
            "return `ed.metrics.Mean().update(values)` or a `(sum, count)` pair "
            "such as `(losses.sum(), losses.shape[0])`; for a total, "
            "`ed.metrics.Sum().update(value)`.",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    return jax.tree.map(
        lambda x: x.value if isinstance(x, Summed) else x,
        metrics,
        is_leaf=_is_counted,
    )


def merge_metrics(a: Any, b: Any) -> Any:
    """Combine two metric pytrees of the same structure: arrays and numbers (e.g.
    the parts of `(sum, count)` tuples) add, `Metric`s `merge`, other leaves are
    kept."""

    def merge(x: Any, y: Any) -> Any:
        if is_metric(x):
            return x.merge(y)
        if isinstance(x, Summed):
            return Summed(x.value + y.value, x.count + y.count, x.rows, x.plain)
        return x + y if _addable(x) else x

    return jax.tree.map(merge, a, b, is_leaf=_is_counted)


def reduce_metrics(metrics: Any, axis_name: AxisName) -> Any:
    """Every device's metrics, summed over `axis_name` (`Metric`s: `reduce`d), so
    that they are replicated and can leave `shard_map` with `out_specs=P()`."""

    def reduce(x: Any) -> Any:
        if is_metric(x):
            return x.reduce(axis_name)
        if isinstance(x, Summed):
            count = x.count * jax.lax.axis_size(axis_name)
            return Summed(jax.lax.psum(x.value, axis_name), count, x.rows, x.plain)
        return jax.lax.psum(x, axis_name) if _addable(x) else x

    return jax.tree.map(reduce, metrics, is_leaf=_is_counted)


def _format(value: Any) -> str:
    value = np.asarray(jax.device_get(value))
    if value.ndim == 0:
        return f"{float(value):.6f}"
    # Per-class values and confusion matrices: the whole array on one line.
    return np.array2string(
        value, precision=6, separator=", ", max_line_width=2**31 - 1
    ).replace("\n", "")


def _metric_lines(name: str, value: Any) -> list[str]:
    if is_metric(value):
        value = value.compute()
    if isinstance(value, Mapping):
        return [
            line
            for sub, v in value.items()
            for line in _metric_lines(f"{name}/{sub}" if name else str(sub), v)
        ]
    if isinstance(value, tuple) and len(value) == 2:
        total, count = (np.asarray(jax.device_get(v)) for v in value)
        value = total / count
    if not (is_array(value) or isinstance(value, int | float)):
        raise TypeError(
            f"print_metrics: metric {name!r} is a {type(value).__name__}; expected "
            "a scalar, an array, a `(sum, count)` pair or a Metric."
        )
    return [f"{name}: {_format(value)}"]


@typecheck
def print_metrics(
    metrics: Mapping[str, Any] | Metric, title: str | None = None
) -> None:
    """Print one line per metric, `name: value` with six decimals, under an
    optional title centred in `=` signs. Prints on
    process 0 only, so a multi-process run prints each line once.

    **Arguments:**

    - `metrics`: a `Metric` (a `MetricCollection` prints one line per child, named
      as its `compute()` names them), or a mapping from names to `(sum, count)`
      pairs (printed as `sum / count`), `Metric`s (printed as `compute()`; a
      collection prints one `name/child` line per child) or scalars. Non-scalar
      values (per-class scores, a confusion matrix) print as one-line arrays.
    - `title`: the heading, if any.

    **Raises:**

    `TypeError` naming a metric whose value is neither an array, a number, a
    `(sum, count)` pair nor a `Metric`.

    !!! Example

        ```python
        ed.print_metrics({"accuracy": (correct, count), "loss": (loss_sum, count)},
                         "Final")
        # ===== Final ======
        # accuracy: 0.884375
        # loss: 0.510231
        ```
    """
    if isinstance(metrics, Metric):
        computed = metrics.compute()
        name = "" if isinstance(computed, Mapping) else type(metrics).__name__
        lines = _metric_lines(name, computed)
    else:
        lines = [line for n, v in metrics.items() for line in _metric_lines(n, v)]
    if jax.process_index() != 0:
        return
    if title:
        # The tutorial's rule: the title centred in `=` to the longest line's width;
        # a title at least that wide still gets one `=` on each side.
        heading = f" {title} "
        width = max(map(len, lines), default=0)
        width = width if width > len(heading) else len(heading) + 2
        lines = [heading.center(width, "="), *lines]
    print("\n".join(lines))
