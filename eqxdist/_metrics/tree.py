"""Metric pytrees as training and evaluation steps return them: adding two up,
reducing them over the data axes, and printing them.

A metrics pytree mixes `Metric`s, arrays, Python numbers and `(sum, count)` tuples;
the functions here give each its own rule, so a step can treat the whole tree at
once."""

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

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


def merge_metrics(a: Any, b: Any) -> Any:
    """Combine two metric pytrees of the same structure: arrays and numbers (e.g.
    the parts of `(sum, count)` tuples) add, `Metric`s `merge`, other leaves are
    kept."""

    def merge(x: Any, y: Any) -> Any:
        if is_metric(x):
            return x.merge(y)
        return x + y if _addable(x) else x

    return jax.tree.map(merge, a, b, is_leaf=is_metric)


def reduce_metrics(metrics: Any, axis_name: AxisName) -> Any:
    """Every device's metrics, summed over `axis_name` (`Metric`s: `reduce`d), so
    that they are replicated and can leave `shard_map` with `out_specs=P()`."""

    def reduce(x: Any) -> Any:
        if is_metric(x):
            return x.reduce(axis_name)
        return jax.lax.psum(x, axis_name) if _addable(x) else x

    return jax.tree.map(reduce, metrics, is_leaf=is_metric)


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
