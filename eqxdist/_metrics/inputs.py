"""Checks and conversions of metric inputs, shared by every metric's `update`: an
array of numbers, a dtype a state can hold, shapes that broadcast, integer labels in
range. Each raises a `ValueError`/`TypeError` naming the caller, the argument, the
value seen and what was expected."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike


def host_integers(x: Any) -> np.ndarray | None:
    """`x` as a NumPy integer array when it is host data (a Python int, a list of
    them, a NumPy array) holding integers that JAX's default integer cannot hold
    (int32 without x64); `None` otherwise (JAX arrays and tracers included)."""
    if isinstance(x, jax.Array | jax.core.Tracer | bool):
        return None
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError, OverflowError):
        return None
    if arr.dtype == object:
        try:
            arr = np.asarray(x, np.int64)
        except (TypeError, ValueError, OverflowError):
            return None
    if not jnp.issubdtype(arr.dtype, jnp.integer) or arr.size == 0:
        return None
    info = jnp.iinfo(count_dtype())
    if arr.min() >= info.min and arr.max() <= info.max:
        return None
    return arr


def as_array(
    x: Any, caller: str, argument: str, *, wide_to_float: bool = False
) -> Array:
    """`x` as a JAX array of numbers or booleans, or a `TypeError` naming
    `argument`.

    Host integers beyond JAX's default integer (int32 without x64: a NumPy int64
    of 3e9 would silently wrap, a Python int raise an `OverflowError`) become
    JAX's default float with `wide_to_float=True` (for a float state), and are a
    `ValueError` otherwise.
    """
    if x is None:
        raise TypeError(
            f"{caller}: `{argument}` must be an array of numbers or booleans, got None."
        )
    wide = host_integers(x)
    if wide is not None:
        if wide_to_float:
            return jnp.asarray(wide.astype(np.float64), float_dtype())
        worst = wide.max() if wide.max() > jnp.iinfo(count_dtype()).max else wide.min()
        raise ValueError(
            f"{caller}: `{argument}` holds the integer {int(worst)}, outside "
            f"{count_dtype()}'s range, which is how JAX holds integers without "
            "`jax_enable_x64`; pass values that fit (class labels do), or enable "
            "x64."
        )
    try:
        arr = jnp.asarray(x)
    except TypeError:
        arr = None
    if arr is None or not (
        jnp.issubdtype(arr.dtype, jnp.number) or jnp.issubdtype(arr.dtype, jnp.bool_)
    ):
        seen = np.asarray(x).dtype if arr is None else arr.dtype
        raise TypeError(
            f"{caller}: `{argument}` must hold numbers or booleans, got dtype {seen} "
            f"({type(x).__name__})."
        )
    return arr


def cast_into(x: Array, dtype: jnp.dtype, caller: str, argument: str) -> Array:
    """`x` as `dtype`, refusing casts that change its kind (floats into an integer
    state would be silently truncated)."""
    if not jnp.can_cast(x.dtype, dtype, casting="same_kind"):
        raise TypeError(
            f"{caller}: `{argument}` has dtype {x.dtype}, which cannot be folded into "
            f"a state of dtype {dtype} without truncation; construct the metric with "
            "a matching dtype."
        )
    return x.astype(dtype)


def check_broadcast(
    x: Array, shape: tuple[int, ...], caller: str, argument: str, target: str
) -> Array:
    """`x` broadcast to `shape`, which must not grow (a value may not be counted
    several times). A value per row (`x.shape` a leading part of `shape`, e.g.
    weights `(B,)` for targets `(B, 1, 16, 16)`) covers the rest of its row's
    dimensions; otherwise NumPy's rule (trailing dimensions) applies."""
    rank = len(x.shape)
    if 0 < rank < len(shape) and tuple(x.shape) == tuple(shape[:rank]):
        x = x.reshape(*x.shape, *(1,) * (len(shape) - rank))
    try:
        fits = jnp.broadcast_shapes(x.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{caller}: `{argument}` of shape {x.shape} does not broadcast to the "
            f"shape of {target}, {shape}; pass one value per row, shape "
            f"{tuple(shape[:1])}, or an array that broadcasts to {shape}."
        )
    return jnp.broadcast_to(x, shape)


def state_dtype(dtype: Any, caller: str, *, kinds: str = "numeric") -> jnp.dtype:
    """The dtype of a metric's state: `None` is JAX's default float (float32, or
    float64 with x64). `kinds` is `"numeric"` (integers or floats) or `"float"`."""
    try:
        resolved = jnp.dtype(
            jax.dtypes.canonicalize_dtype(float if dtype is None else dtype)
        )
    except TypeError:
        resolved = None
    wanted = "a float dtype" if kinds == "float" else "an integer or float dtype"
    ok = resolved is not None and (
        jnp.issubdtype(resolved, jnp.floating)
        or (kinds != "float" and jnp.issubdtype(resolved, jnp.integer))
    )
    if not ok:
        raise TypeError(
            f"{caller}: `dtype` must be {wanted} (e.g. jnp.float32), got {dtype!r}."
        )
    assert resolved is not None
    return resolved


def float_dtype() -> jnp.dtype:
    """JAX's default float (float32, or float64 with x64): what ratios of counts
    are computed in."""
    return jnp.dtype(jax.dtypes.canonicalize_dtype(float))


def count_dtype() -> jnp.dtype:
    """JAX's default integer (int32, or int64 with x64): the words of a count."""
    return jnp.dtype(jax.dtypes.canonicalize_dtype(int))


def is_concrete(x: Any) -> bool:
    """Whether `x`'s values are known now (not a tracer), so they can be checked at
    trace time."""
    return not isinstance(x, jax.core.Tracer)


# ------------------------------------------------------------ class labels


def counted_mask(
    mask: ArrayLike | None,
    shape: tuple[int, ...],
    caller: str,
    *,
    has_weights: bool = False,
    target: str = "`labels`",
) -> Array:
    """The boolean mask of the examples to count (all when `mask` is `None`),
    broadcast to `shape` (that of `target`, as error messages name it).

    A mask is boolean: a float such as `[0.5, 1, 0]` (sample weights, in other
    libraries) or an int such as -1 has no single reading, so it is a `TypeError`
    that points to `weights=` when the metric has it (`has_weights`)."""
    if mask is None:
        return jnp.ones(shape, bool)
    mask = as_array(mask, caller, "mask")
    mask = check_broadcast(mask, shape, caller, "mask", target)
    if mask.dtype != jnp.bool_:
        hint = (
            "pass per-example weights as `weights=` instead"
            if has_weights
            else "this metric takes no weights"
        )
        raise TypeError(
            f"{caller}: `mask` must be boolean (True: count the example), got dtype "
            f"{mask.dtype}; write e.g. `mask=labels >= 0` or `mask.astype(bool)` "
            f"for a 0/1 mask, and {hint}."
        )
    return mask


def example_weights(
    weights: ArrayLike | None, shape: tuple[int, ...], caller: str
) -> Array | None:
    """`weights` (per example) broadcast to `shape`, in their own dtype (integer
    weights can be counted exactly); `None` stays `None` (unweighted)."""
    if weights is None:
        return None
    weights = as_array(weights, caller, "weights", wide_to_float=True)
    return check_broadcast(weights, shape, caller, "weights", "`labels`")


def integer_labels(labels: ArrayLike, caller: str) -> Array:
    labels = as_array(labels, caller, "labels")
    if not (jnp.issubdtype(labels.dtype, jnp.integer) or labels.dtype == jnp.bool_):
        raise TypeError(
            f"{caller}: `labels` must be integer class labels, got dtype "
            f"{labels.dtype}."
        )
    return labels


def check_range(
    x: Array,
    counted: Array,
    low: float | int,
    high: float | int,
    caller: str,
    argument: str,
    fix: str,
) -> None:
    """When `x` and `counted` are known now: a `ValueError` naming the first counted
    value of `x` outside `[low, high]` (NaN included)."""
    if not (is_concrete(x) and is_concrete(counted)):
        return
    values = np.asarray(x)
    bad = np.asarray(counted) & ~((values >= low) & (values <= high))
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{caller}: `{argument}`{list(index)} is {values[index].item()!r}, outside "
            f"[{low:g}, {high:g}]; {fix}"
        )


def class_predictions(
    preds: ArrayLike, labels: Array, num_classes: int | None, caller: str
) -> Array:
    """Integer predictions of `labels`' shape: integer input as it is, float scores
    (one more trailing axis) through `argmax`."""
    preds = as_array(preds, caller, "logits_or_predictions")
    if jnp.issubdtype(preds.dtype, jnp.floating):
        if preds.ndim != labels.ndim + 1 or preds.shape[:-1] != labels.shape:
            raise ValueError(
                f"{caller}: float `logits_or_predictions` of shape {preds.shape} "
                f"must have the shape of `labels` {labels.shape} plus a trailing "
                "class axis; pass integer class predictions of shape "
                f"{labels.shape} instead to compare them directly."
            )
        if num_classes is not None and preds.shape[-1] != num_classes:
            raise ValueError(
                f"{caller}: float `logits_or_predictions` have {preds.shape[-1]} "
                f"classes on their last axis, expected num_classes={num_classes}."
            )
        return jnp.argmax(preds, axis=-1)
    if preds.shape != labels.shape:
        raise ValueError(
            f"{caller}: integer `logits_or_predictions` of shape {preds.shape} "
            f"must have the shape of `labels`, {labels.shape}."
        )
    return preds


def count_true(x: Array, where: Array | None = None) -> Array:
    return jnp.sum(x if where is None else x & where, dtype=count_dtype())


def binned_scores(
    scores: ArrayLike,
    labels: ArrayLike,
    mask: ArrayLike | None,
    num_thresholds: int,
    caller: str,
) -> tuple[Array, Array]:
    """The binary ranking metrics' histogram cells (`AUROC`, `AveragePrecision`):
    `(valid, cell)`, where `cell = label * num_thresholds + bin` of each counted
    example with a score in [0, 1] and a 0/1 label (`valid`), the scores cut into
    `num_thresholds` equal-width bins. Checks the inputs as those metrics take
    them."""
    scores = as_array(scores, caller, "scores", wide_to_float=True)
    if not jnp.issubdtype(scores.dtype, jnp.floating):
        raise TypeError(
            f"{caller}: `scores` must be floats in [0, 1], got dtype {scores.dtype}."
        )
    labels = integer_labels(labels, caller)
    if scores.shape != labels.shape:
        raise ValueError(
            f"{caller}: `scores` of shape {scores.shape} and `labels` of shape "
            f"{labels.shape} must have the same shape (one score per label)."
        )
    counted = counted_mask(mask, labels.shape, caller, has_weights=True)
    fix = "pass probabilities (e.g. jax.nn.sigmoid of logits)."
    check_range(scores, counted, 0, 1, caller, "scores", fix)
    check_range(labels, counted, 0, 1, caller, "labels", "labels must be 0 or 1.")
    t = num_thresholds
    valid = counted & ~jnp.isnan(scores) & ((labels == 0) | (labels == 1))
    bins = jnp.clip(jnp.floor(jnp.nan_to_num(scores) * t), 0, t - 1)
    cell = jnp.where(valid, labels.astype(jnp.int32) * t + bins.astype(jnp.int32), 0)
    return valid, cell
