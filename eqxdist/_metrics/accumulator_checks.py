"""The checks of `MetricAccumulator`'s arguments, each raising a `ValueError` or
`TypeError` that names the caller, the argument, the value seen and the fix: the
initial value, the reduce op, `compensated=True` (which also picks the
representation), a state dict, an axis name."""

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array

from .inputs import as_array
from .numerics import Carried, Compensated, ReduceOp, Representation, can_carry


def initial_state(initial_value: Any) -> Array:
    """`initial_value` as the state's first word, of a numeric dtype it keeps."""
    initial = as_array(initial_value, "MetricAccumulator", "initial_value")
    if initial.dtype == jnp.bool_:
        raise TypeError(
            "MetricAccumulator: `initial_value` must have a numeric dtype, got "
            "bool; use an integer state to count."
        )
    # A Python scalar gives a weakly typed array, whose dtype would drift to that
    # of the first update (e.g. bfloat16); the state keeps the dtype it has now.
    return initial.astype(initial.dtype)


def compensated_representation(
    initial: Array, op: ReduceOp, initial_value: Any
) -> Representation:
    """The representation of a `compensated=True` sum: `Compensated` for a float
    state, `Carried` for a signed 32- or 64-bit integer one."""
    if op is not ReduceOp.SUM:
        raise ValueError(
            "MetricAccumulator: `compensated=True` is for sums, got reduce_op "
            f"{op.value!r}."
        )
    if jnp.issubdtype(initial.dtype, jnp.floating):
        return Compensated()
    if isinstance(initial_value, int):
        # `0` may mean a float sum as much as a count: make the caller say which.
        raise TypeError(
            f"MetricAccumulator: `compensated=True` with the Python int "
            f"{initial_value!r} as `initial_value` is ambiguous; pass a float (e.g. "
            "0.0) for a compensated float sum, or an int32 array (e.g. "
            "jnp.int32(0)) for a carried integer count."
        )
    if not can_carry(initial.dtype):
        raise TypeError(
            "MetricAccumulator: a carried integer sum (`compensated=True`) needs "
            f"signed 32- or 64-bit words, got dtype {initial.dtype}; use jnp.int32."
        )
    return Carried()


def checked_state_dict(
    state_dict: Any, second: str, like: Array, caller: str
) -> dict[str, Array]:
    """The arrays of a state dict, checked against the keys a state with second
    word `second` has and against `like`'s shape and dtype."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{caller}: `state_dict` must be a mapping such as "
            f"{{'local': array}}, got {type(state_dict).__name__}."
        )
    allowed = {"local", "synchronized"}
    if second:
        allowed |= {f"local_{second}", f"synchronized_{second}"}
    if "local" not in state_dict or set(state_dict) - allowed:
        optional = ", ".join(repr(key) for key in sorted(allowed - {"local"}))
        raise ValueError(
            f"{caller}: expected the key 'local' and optionally {optional}, got "
            f"{sorted(state_dict)}."
        )
    if f"synchronized_{second}" in state_dict and "synchronized" not in state_dict:
        raise ValueError(
            f"{caller}: 'synchronized_{second}' is the second word of "
            f"'synchronized', which is missing; got {sorted(state_dict)}."
        )
    arrays = {}
    for key, raw in state_dict.items():
        arr = as_array(raw, caller, f"state_dict[{key!r}]")
        if arr.shape != like.shape or arr.dtype != like.dtype:
            raise ValueError(
                f"{caller}: {key!r} has shape {arr.shape} and dtype {arr.dtype}, "
                f"expected shape {like.shape} and dtype {like.dtype}."
            )
        arrays[key] = arr.astype(arr.dtype)  # not weakly typed
    return arrays


def parse_reduce_op(reduce_op: Any) -> ReduceOp:
    if not isinstance(reduce_op, str):
        raise TypeError(
            "MetricAccumulator: `reduce_op` must be a ReduceOp or one of the strings "
            f"{[op.value for op in ReduceOp]}, got {reduce_op!r} of type "
            f"{type(reduce_op).__name__}."
        )
    try:
        return ReduceOp(reduce_op)
    except ValueError:
        raise ValueError(
            f"MetricAccumulator: Unknown `reduce_op` {reduce_op!r}; valid "
            f"operations are {[op.value for op in ReduceOp]}."
        ) from None


def check_axis_name(axis_name: Any, caller: str) -> None:
    """A `TypeError` for an `axis_name` that is not a string, a tuple of strings or
    `None`."""
    ok = axis_name is None or isinstance(axis_name, str)
    ok = ok or (
        isinstance(axis_name, tuple) and all(isinstance(n, str) for n in axis_name)
    )
    if not ok:
        raise TypeError(
            f"{caller}: `axis_name` must be a mesh axis name (a string such as "
            f"'data'), a tuple of names, or None for global mode; got {axis_name!r}."
        )
