"""Checks shared by the regression, ranking, retrieval, calibration and image
metrics (boolean masks are `inputs.counted_mask`): float inputs of equal shapes,
positive hyperparameters.
Each raises a `ValueError`/`TypeError` naming the caller, the argument, the value
seen and what was expected."""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .inputs import as_array, check_broadcast, float_dtype


def float_input(x: ArrayLike, caller: str, argument: str) -> Array:
    """`x` as an array of JAX's default float (or wider), from numbers (not
    booleans)."""
    x = as_array(x, caller, argument)
    if x.dtype == jnp.bool_:
        raise TypeError(f"{caller}: `{argument}` must hold numbers, got dtype bool.")
    return x.astype(jnp.promote_types(x.dtype, float_dtype()))


def same_shape(
    x: Array, y: Array, caller: str, names: tuple[str, str], what: str
) -> None:
    """A `ValueError` unless `x` and `y` have the same shape."""
    if x.shape != y.shape:
        raise ValueError(
            f"{caller}: `{names[0]}` of shape {x.shape} and `{names[1]}` of shape "
            f"{y.shape} must have the same shape ({what})."
        )


def weights_for(
    weights: ArrayLike | None, shape: tuple[int, ...], caller: str, target: str
) -> Array:
    """`weights` (numbers, or booleans as 0/1) as floats broadcast to `shape`
    (ones when `None`)."""
    if weights is None:
        return jnp.ones(shape, float_dtype())
    weights = as_array(weights, caller, "weights")
    weights = weights.astype(jnp.promote_types(weights.dtype, float_dtype()))
    return check_broadcast(weights, shape, caller, "weights", target)


def positive_int(value: Any, caller: str, argument: str, minimum: int = 1) -> int:
    """`value` if it is an int >= `minimum`, else a `TypeError`/`ValueError`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{caller}: `{argument}` must be an int, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{caller}: `{argument}` must be >= {minimum}, got {value}.")
    return value


def positive_float(value: Any, caller: str, argument: str) -> float:
    """`value` as a float if it is a finite number > 0, else a `TypeError` or
    `ValueError`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{caller}: `{argument}` must be a number, got {value!r}.")
    if not 0 < value < float("inf"):
        raise ValueError(
            f"{caller}: `{argument}` must be a finite number > 0, got {value}."
        )
    return float(value)
