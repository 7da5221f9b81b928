"""The state of a stateful metric: `MetricAccumulator`, its numerics and its sync.

A `MetricAccumulator` holds one piece of metric state with a *local* version (this
device's, or this minibatch's) and a *synchronized* one (every device's, after
`sync`). Everything a metric needs to stay exact lives here:

- *Compensated float sums* keep the rounding error of every addition next to the
  sum (Knuth's TwoSum), so float32 sums carry about twice float32's precision.
- *Carried integer sums* (counts) keep a second integer word of carries, so a count
  never wraps past 2**31 (exact to 2**47 with int32 words).
- *Folded states* (`FoldAccumulator`) combine with an associative function that is
  not a sum, e.g. Chan's merge of (weight, mean, M2) for a standard deviation.

`sync_accumulators` reduces any number of accumulators with one collective per
(`ReduceOp`, dtype); every accumulator contributes "sync parts" to those groups.

The checks of metric inputs live in `_metric_inputs.py`.
"""

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, DTypeLike

from .._utils import AxisName, check_axis_bound
from .inputs import as_array, cast_into, check_broadcast


class ReduceOp(enum.StrEnum):
    """How an accumulator folds new values in and combines devices' states.

    `SUM = "sum"` (add), `MAX = "max"` (elementwise maximum), `MIN = "min"`
    (elementwise minimum). Wherever a `ReduceOp` is expected its string also works.
    """

    SUM = "sum"
    MAX = "max"
    MIN = "min"


_COMBINE: dict[ReduceOp, Callable[[Array, Array], Array]] = {
    ReduceOp.SUM: jnp.add,
    ReduceOp.MAX: jnp.maximum,
    ReduceOp.MIN: jnp.minimum,
}
_COLLECTIVE: dict[ReduceOp, Callable[[Array, tuple[str, ...]], Array]] = {
    ReduceOp.SUM: jax.lax.psum,
    ReduceOp.MAX: jax.lax.pmax,
    ReduceOp.MIN: jax.lax.pmin,
}

CARRY_BITS = 16
"""A carried integer sum keeps its low word in `[0, 2**CARRY_BITS)` and counts
carries in its high word. 16 bits: the low words of up to 32767 devices add up
in one int32 all-reduce without overflow, and int32 high words reach 2**47."""


def replace_fields(module: Any, **changes: Any) -> Any:
    """Like `dataclasses.replace`, without calling the public `__init__` (whose
    arguments are the user-facing ones, not the fields); this is how Equinox itself
    rebuilds modules when unflattening."""
    new = object.__new__(type(module))
    for field in dataclasses.fields(module):
        object.__setattr__(
            new, field.name, changes.get(field.name, getattr(module, field.name))
        )
    return new


# ------------------------------------------------------------------ numerics


def two_sum(a: Array, b: Array) -> tuple[Array, Array]:
    """`a + b` rounded, and its rounding error, exactly (Knuth's TwoSum: the two add
    up to `a + b` with no rounding at all). A non-finite sum has error 0, where the
    formula would give NaN."""
    total = a + b
    b_part = total - a
    error = (a - (total - b_part)) + (b - b_part)
    return total, jnp.where(jnp.isfinite(total), error, jnp.zeros_like(error))


def add_pairs(
    hi: Array, lo: Array, other_hi: Array, other_lo: Array
) -> tuple[Array, Array]:
    """The sum of two double-word numbers `hi + lo`, renormalised so that `lo` is
    within half a unit in the last place of `hi` (then `hi` is the sum rounded)."""
    total, error = two_sum(hi, other_hi)
    return two_sum(total, error + (lo + other_lo))


def _split_for_psum(hi: Array) -> tuple[Array, Array]:
    """`hi` as `top + bottom` exactly, `top` a multiple of `q = 2**ceil(p / 2)` (`p`
    the dtype's significand bits) and `|bottom| < q`.

    A collective sum of `hi`s rounds as soon as the total outgrows the precision of
    the parts (8 devices holding 16777218.0 and 16777216.0 do not add up exactly in
    float32). Summed separately, multiples of `q` stay exact up to `2**p * q` and
    integers below `q` stay exact for up to `2**p / q` devices: in float32, integer
    totals below 2**36 on up to 4096 devices are summed exactly.
    """
    precision = jnp.finfo(hi.dtype).nmant + 1
    q = jnp.asarray(2.0 ** -(-precision // 2), hi.dtype)
    finite = jnp.isfinite(hi)
    top = jnp.where(finite, jnp.trunc(hi / q) * q, hi)
    return top, jnp.where(finite, hi - top, jnp.zeros_like(hi))


def _can_carry(dtype: jnp.dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.signedinteger) and jnp.iinfo(dtype).bits >= 32


def _carry(lo: Array, hi: Array) -> tuple[Array, Array]:
    """Renormalise a carried integer `hi * 2**CARRY_BITS + lo` so that `lo` is in
    `[0, 2**CARRY_BITS)` (an arithmetic shift and a mask: right for negative `lo`
    too)."""
    carry = jnp.right_shift(lo, CARRY_BITS)
    return jnp.bitwise_and(lo, (1 << CARRY_BITS) - 1), hi + carry


def _add_carried(
    lo: Array, hi: Array, other_lo: Array, other_hi: Array
) -> tuple[Array, Array]:
    # Both `lo`s are below 2**CARRY_BITS, so their sum cannot overflow.
    return _carry(lo + other_lo, hi + other_hi)


# --------------------------------------------------------------- accumulator


_A = TypeVar("_A", bound="MetricAccumulator")


class MetricAccumulator(eqx.Module):
    """One linearly additive piece of metric state, with a *local* and a
    *synchronized* version (d9d's `MetricAccumulator`).

    `update` folds values into `local` (add, or elementwise max/min); `sync`, inside
    `jax.shard_map`, computes the reduction of every device's `local` and stores it
    as the synchronized state, while `local` stays this device's own: updates after a
    sync and a later sync therefore never count anything twice.

    Whether `value` means the local or the synchronized state is known when tracing
    (the synchronized state is an array or `None`), so that `value` is replicated,
    returnable with `out_specs=P()`, after a sync. Syncing therefore changes the
    pytree structure: a `jax.lax.scan` carry must be in the same state on entry and
    exit (update or merge inside the loop, sync after it).

    **Compensated sums** (`compensated=True`) do not lose what a plain sum loses:

    - *Float*: a float sum stops growing once it is 2**24 times larger than what is
      added to it (float32: `16777216.0 + 1.0 == 16777216.0`). A compensated sum
      keeps, next to `local`, the rounding error `local_lo` of every addition
      (Knuth's TwoSum), so that `local + local_lo` holds about twice the dtype's
      precision: float32 counts stay exact to about 2**48 through `update` and
      `merge`, and up to 2**36 through `sync`.
    - *Integer*: an int32 count wraps to negative numbers past 2**31 - 1 (a few
      billion tokens). A carried sum keeps `local` in `[0, 2**16)` and counts the
      carries in a second int32 word `local_hi`: the total is
      `local_hi * 2**16 + local`, exact to 2**47 through `update`, `merge` and
      `sync`. Both words join the (sum, int32) all-reduce of every other count: no
      extra collective, and the low words of up to 32767 devices cannot overflow.
      `value` is the total in the state's dtype, saturated at its largest value
      (never wrapped); `value_as(jnp.float32)` gives it as a float however large.

    **Arguments:**

    - `initial_value`: the starting state, also what `reset` returns to (e.g. `0.0`
      for a sum, `-jnp.inf` for a maximum). Its shape and dtype are the state's.
    - `reduce_op`: a `ReduceOp` or its string, `"sum"` (default), `"max"`, `"min"`.
    - `compensated`: keep a compensated float sum or a carried integer sum
      (default `False`); only for `"sum"`.

    **Raises:**

    `ValueError` for an unknown `reduce_op`, or `compensated=True` with a reduce op
    other than `"sum"`; `TypeError` for a missing (`None`), boolean or non-numeric
    `initial_value`, or `compensated=True` with an unsigned integer or one narrower
    than 32 bits.

    !!! Example

        ```python
        def per_device(x):
            acc = ed.MetricAccumulator(0.0).update(x.sum())   # this device's rows
            acc = acc.sync("data")                            # every device's rows
            return acc.value                                  # replicated

        jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P())(x)

        big = ed.MetricAccumulator(jnp.float32(2**24), compensated=True)
        big.update(1.0).update(1.0).value  # 16777218.0 (16777216.0 uncompensated)
        ```
    """

    initial: Array
    local: Array
    synchronized: Array | None
    # Rounding errors of a compensated float sum (`None` otherwise); the state is
    # `local + local_lo`, or `synchronized + synchronized_lo`.
    local_lo: Array | None
    synchronized_lo: Array | None
    # Carries of a carried integer sum (`None` otherwise); the state is
    # `local_hi * 2**CARRY_BITS + local`.
    local_hi: Array | None
    synchronized_hi: Array | None
    reduce_op: ReduceOp = eqx.field(static=True)

    def __init__(
        self,
        initial_value: ArrayLike,
        reduce_op: ReduceOp | str = "sum",
        *,
        compensated: bool = False,
    ):
        self.reduce_op = _reduce_op(reduce_op)
        initial = as_array(initial_value, "MetricAccumulator", "initial_value")
        if initial.dtype == jnp.bool_:
            raise TypeError(
                "MetricAccumulator: `initial_value` must have a numeric dtype, got "
                "bool; use an integer state to count."
            )
        # A Python scalar gives a weakly typed array, whose dtype would drift to that
        # of the first update (e.g. bfloat16); the state keeps the dtype it has now.
        initial = initial.astype(initial.dtype)
        if compensated and self.reduce_op is not ReduceOp.SUM:
            raise ValueError(
                "MetricAccumulator: `compensated=True` is for sums, got reduce_op "
                f"{self.reduce_op.value!r}."
            )
        floating = jnp.issubdtype(initial.dtype, jnp.floating)
        if compensated and not floating and not _can_carry(initial.dtype):
            raise TypeError(
                "MetricAccumulator: a carried integer sum (`compensated=True`) needs "
                f"signed 32- or 64-bit words, got dtype {initial.dtype}; use "
                "jnp.int32."
            )
        self.initial = initial
        self.synchronized = None
        self.synchronized_lo = None
        self.synchronized_hi = None
        self.local_lo = jnp.zeros_like(initial) if compensated and floating else None
        if compensated and not floating:
            self.local, self.local_hi = _carry(initial, jnp.zeros_like(initial))
        else:
            self.local, self.local_hi = initial, None

    @property
    def compensated(self) -> bool:
        """Whether this is a compensated float sum or a carried integer sum (a
        Python `bool`)."""
        return self.local_lo is not None or self.local_hi is not None

    @property
    def is_synchronized(self) -> bool:
        """Whether `sync` has run since the last `update` (a Python `bool`)."""
        return self.synchronized is not None

    @property
    def value(self) -> Array:
        """The synchronized state if `is_synchronized`, else the local one, in the
        state's dtype (a compensated float sum rounded; a carried integer sum
        saturated at the dtype's range)."""
        main, second = self._words(self.synchronized is not None)
        if second is None:
            return main
        if self.local_lo is not None:
            return main + second
        # A carried integer sum, saturated where it leaves the dtype's range.
        info = jnp.iinfo(main.dtype)
        limit = 1 << (info.bits - 1 - CARRY_BITS)
        exact = (second << CARRY_BITS) + main
        highest, lowest = (jnp.asarray(v, main.dtype) for v in (info.max, info.min))
        return jnp.where(
            second >= limit, highest, jnp.where(second < -limit, lowest, exact)
        )

    def value_as(self, dtype: DTypeLike) -> Array:
        """`value` converted to `dtype` from the full state: a carried integer sum
        beyond its dtype's range is converted exactly as far as `dtype` allows (e.g.
        a count of 3 * 2**31 to float32), a compensated float sum is rounded once."""
        main, second = self._words(self.synchronized is not None)
        dtype = jnp.dtype(dtype)
        if second is None:
            return main.astype(dtype)
        if self.local_hi is not None:
            scale = jnp.asarray(2**CARRY_BITS, dtype)
            return second.astype(dtype) * scale + main.astype(dtype)
        return main.astype(dtype) + second.astype(dtype)

    def update(self: _A, value: ArrayLike) -> _A:
        """Fold `value` into the local state (add for `"sum"`, elementwise max/min
        otherwise) and mark the accumulator unsynchronized.

        **Raises:**

        `ValueError` if `value`'s shape does not broadcast to the state's shape;
        `TypeError` if it is `None`, non-numeric, or its dtype cannot be cast into
        the state's without changing kind (floats into an integer state).
        """
        value = self._checked(value, "MetricAccumulator.update")
        if self.local_lo is not None:
            zero = jnp.zeros_like(value)
            return self._unsynchronized(
                *add_pairs(self.local, self.local_lo, value, zero)
            )
        if self.local_hi is not None:
            lo, hi = _carry(value, jnp.zeros_like(value))
            return self._unsynchronized(
                *_add_carried(self.local, self.local_hi, lo, hi)
            )
        return self._unsynchronized(_COMBINE[self.reduce_op](self.local, value))

    def merge(self: _A, other: "MetricAccumulator") -> _A:
        """Combine the local states of two accumulators (e.g. two minibatches') with
        the reduce op; the result is unsynchronized.

        **Raises:**

        `TypeError` if `other` is not an accumulator of the same kind; `ValueError`
        if the reduce ops, shapes, dtypes or compensation differ.
        """
        if type(other) is not type(self):
            raise TypeError(
                f"{type(self).__name__}.merge: `other` must be a "
                f"{type(self).__name__}, got {type(other).__name__}."
            )
        mine, theirs = (acc._signature() for acc in (self, other))
        if mine != theirs:
            raise ValueError(
                f"{type(self).__name__}.merge: cannot merge a (reduce_op, shape, "
                f"dtype, compensated) = {theirs} accumulator into a {mine} one."
            )
        return self._merged_local(other)

    def sync(self: _A, axis_name: AxisName | None = "data") -> _A:
        """Reduce the local states of every device along `axis_name`, inside
        `jax.shard_map`; `value` becomes that reduction (replicated over the axis),
        `local` is unchanged.

        `axis_name=None` is global mode (the state was built from global arrays and
        already covers every device): the synchronized state is the local one.

        A compensated float sum is reduced in three parts (a coarse and a fine part
        of `local`, and `local_lo`), a carried integer sum in its two words, in the
        same collective as the other sums of their dtype: integer-valued float32
        totals below 2**36 stay exact on up to 4096 devices, larger or fractional
        ones keep about twice the dtype's precision relative to the largest device's
        state; carried integers stay exact.

        **Raises:**

        `TypeError` if `axis_name` is not a string, a tuple of strings or `None`;
        `ValueError` if it is not bound here.
        """
        (synced,) = sync_accumulators([self], axis_name, f"{type(self).__name__}.sync")
        return synced

    def reset(self: _A) -> _A:
        """Back to the initial value, unsynchronized.

        Inside `jax.shard_map` the result varies over the same mesh axes as `local`,
        so a reset accumulator can seed a `jax.lax.scan` carry that is then updated
        with per-device data.
        """
        initial = self.initial
        missing = tuple(sorted(_varying_axes(self.local) - _varying_axes(initial)))
        if missing:
            initial = jax.lax.pcast(initial, missing, to="varying")
        if self.local_lo is not None:
            return self._unsynchronized(initial, jnp.zeros_like(initial))
        if self.local_hi is not None:
            return self._unsynchronized(*_carry(initial, jnp.zeros_like(initial)))
        return self._unsynchronized(initial)

    def state_dict(self) -> dict[str, Array]:
        """`{"local": ...}`, plus `"synchronized"` when synchronized, plus their
        second words (`"local_lo"`/`"synchronized_lo"` for a compensated float sum,
        `"local_hi"`/`"synchronized_hi"` for a carried integer sum): everything
        `load_state_dict` needs to rebuild this accumulator exactly."""
        state = {
            "local": self.local,
            "synchronized": self.synchronized,
            "local_lo": self.local_lo,
            "synchronized_lo": self.synchronized_lo,
            "local_hi": self.local_hi,
            "synchronized_hi": self.synchronized_hi,
        }
        return {key: arr for key, arr in state.items() if arr is not None}

    def load_state_dict(self: _A, state_dict: Mapping[str, ArrayLike]) -> _A:
        """An accumulator like this one (same initial value, reduce op and
        compensation) holding `state_dict` (from `state_dict()`); synchronized if it
        has a `"synchronized"` entry. A missing second word (`"local_lo"`,
        `"local_hi"`, ...) is taken as 0, so states saved before compensation load
        (a carried integer is renormalised: `{"local": 2**30}` loads as 2**30).

        **Raises:**

        `TypeError` if `state_dict` is not a mapping or an entry is not an array;
        `ValueError` for a missing or unexpected key, or an array whose shape or
        dtype differs from this accumulator's state.
        """
        caller = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"{caller}: `state_dict` must be a mapping such as "
                f"{{'local': array}}, got {type(state_dict).__name__}."
            )
        second = self._second_name()
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
            if arr.shape != self.local.shape or arr.dtype != self.local.dtype:
                raise ValueError(
                    f"{caller}: {key!r} has shape {arr.shape} and dtype {arr.dtype}, "
                    f"expected shape {self.local.shape} and dtype {self.local.dtype}."
                )
            arrays[key] = arr.astype(arr.dtype)  # not weakly typed
        words = {}
        for which in ("local", "synchronized"):
            if which not in arrays:
                continue
            main = arrays[which]
            other = arrays.get(f"{which}_{second}", jnp.zeros_like(main))
            if self.local_hi is not None:
                main, extra = _carry(main, jnp.zeros_like(main))
                other = other + extra
            words[which] = (main, other) if second else (main,)
        loaded = self._unsynchronized(*words["local"])
        if "synchronized" in words:
            loaded = loaded._synchronized(*words["synchronized"])
        return loaded

    # ------------------------------------------------------------ internals

    def _checked(self, value: Any, caller: str) -> Array:
        value = as_array(value, caller, "value")
        value = check_broadcast(value, self.local.shape, caller, "value", "the state")
        return cast_into(value, self.local.dtype, caller, "value")

    def _signature(self) -> tuple[Any, ...]:
        return (
            self.reduce_op.value,
            self.local.shape,
            self.local.dtype,
            self.compensated,
        )

    def _second_name(self) -> str:
        if self.local_lo is not None:
            return "lo"
        return "hi" if self.local_hi is not None else ""

    def _words(self, synchronized: bool) -> tuple[Array, Array | None]:
        if synchronized:
            assert self.synchronized is not None
            return self.synchronized, (
                self.synchronized_lo
                if self.local_lo is not None
                else self.synchronized_hi
            )
        return self.local, self.local_lo if self.local_lo is not None else self.local_hi

    def _merged_local(self: _A, other: "MetricAccumulator") -> _A:
        if self.local_lo is not None and other.local_lo is not None:
            return self._unsynchronized(
                *add_pairs(self.local, self.local_lo, other.local, other.local_lo)
            )
        if self.local_hi is not None and other.local_hi is not None:
            return self._unsynchronized(
                *_add_carried(self.local, self.local_hi, other.local, other.local_hi)
            )
        return self._unsynchronized(_COMBINE[self.reduce_op](self.local, other.local))

    def _unsynchronized(self: _A, local: Array, second: Array | None = None) -> _A:
        out: _A = replace_fields(
            self,
            local=local,
            local_lo=second if self.local_lo is not None else None,
            local_hi=second if self.local_hi is not None else None,
            synchronized=None,
            synchronized_lo=None,
            synchronized_hi=None,
        )
        return out

    def _synchronized(self: _A, synchronized: Array, second: Array | None = None) -> _A:
        out: _A = replace_fields(
            self,
            synchronized=synchronized,
            synchronized_lo=second if self.local_lo is not None else None,
            synchronized_hi=second if self.local_hi is not None else None,
        )
        return out

    def _synchronized_as_local(self: _A) -> _A:
        """The synchronized state as the (unsynchronized) local one."""
        main, second = self._words(self.synchronized is not None)
        return self._unsynchronized(main, second)

    def _synchronized_from_local(self: _A) -> _A:
        """Global mode: the local state is already every device's."""
        return self._synchronized(*self._words(False))

    def _sync_parts(self, names: tuple[str, ...]) -> list[Array]:
        """The arrays whose reductions (with `reduce_op`) over the devices make the
        synchronized state (see `_from_sync_parts`)."""
        if self.local_lo is not None:
            return [*_split_for_psum(self.local), self.local_lo]
        if self.local_hi is not None:
            return [self.local, self.local_hi]
        return [self.local]

    def _from_sync_parts(self: _A, parts: Sequence[Array]) -> _A:
        if self.local_lo is not None:
            top, bottom, lo = parts
            return self._synchronized(*add_pairs(top, jnp.zeros_like(lo), bottom, lo))
        if self.local_hi is not None:
            return self._synchronized(*_carry(*parts))
        (reduced,) = parts
        return self._synchronized(reduced)


_FA = TypeVar("_FA", bound="FoldAccumulator")


class FoldAccumulator(MetricAccumulator):
    """A state combined by an associative function `fold(earlier, later)` that is
    not an elementwise sum, maximum or minimum (e.g. Chan's merge of weighted
    moments, or "keep the later value if it has one").

    `update(value)` is `fold(local, value)` and `merge(other)` is
    `fold(local, other.local)`. `sync` places each device's state in its row of an
    `(axis_size, *shape)` array of zeros, adds those up in the (sum, dtype)
    all-reduce that the other sums of that dtype use (adding zeros is exact), and
    folds the rows in device order on every device, so the result is replicated and
    the same everywhere. The message grows with the number of devices, the state
    does not.

    **Arguments:**

    - `initial_value`: the identity of `fold` (`fold(initial, x) == x`).
    - `fold`: a module-level function of two states of `initial_value`'s shape.
    """

    fold: Callable[[Array, Array], Array] = eqx.field(static=True)

    def __init__(self, initial_value: ArrayLike, fold: Callable[[Array, Array], Array]):
        super().__init__(initial_value, "sum")
        self.fold = fold

    def update(self: _FA, value: ArrayLike) -> _FA:
        """`fold(local, value)`, unsynchronized."""
        value = self._checked(value, f"{type(self).__name__}.update")
        return self._unsynchronized(self.fold(self.local, value))

    def _signature(self) -> tuple[Any, ...]:
        return (*super()._signature(), self.fold)

    def _merged_local(self: _FA, other: MetricAccumulator) -> _FA:
        return self._unsynchronized(self.fold(self.local, other.local))

    def _sync_parts(self, names: tuple[str, ...]) -> list[Array]:
        size = 1
        for name in names:
            size *= jax.lax.axis_size(name)
        rows = jnp.zeros((size, *self.local.shape), self.local.dtype)
        return [rows.at[jax.lax.axis_index(names)].set(self.local)]

    def _from_sync_parts(self: _FA, parts: Sequence[Array]) -> _FA:
        (rows,) = parts

        def body(carry: Array, row: Array) -> tuple[Array, None]:
            return self.fold(carry, row), None

        folded, _ = jax.lax.scan(body, rows[0], rows[1:])
        return self._synchronized(folded)


# ----------------------------------------------------------------------- sync


def _reduce_op(reduce_op: Any) -> ReduceOp:
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


def _varying_axes(x: Array) -> frozenset[str]:
    return frozenset(jax.typeof(x).manual_axis_type.varying)


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


def sync_accumulators(
    accumulators: Sequence[_A], axis_name: AxisName | None, caller: str
) -> list[_A]:
    """Sync every accumulator with one collective per (reduce op, dtype): the sync
    parts of all accumulators of a group are flattened into one vector, reduced,
    and split back."""
    check_axis_name(axis_name, caller)
    if axis_name is None:
        return [acc._synchronized_from_local() for acc in accumulators]
    names = check_axis_bound(axis_name, caller)
    parts = [acc._sync_parts(names) for acc in accumulators]
    groups: dict[tuple[ReduceOp, jnp.dtype], list[tuple[int, int]]] = {}
    for i, (acc, arrays) in enumerate(zip(accumulators, parts, strict=True)):
        for j, arr in enumerate(arrays):
            groups.setdefault((acc.reduce_op, arr.dtype), []).append((i, j))
    reduced = [list(arrays) for arrays in parts]
    for (op, _), members in groups.items():
        inputs = [parts[i][j] for i, j in members]
        flat = jnp.concatenate([jnp.ravel(x) for x in inputs])
        summed = _COLLECTIVE[op](flat, names)
        offsets = np.cumsum([x.size for x in inputs])[:-1].tolist()
        for (i, j), x, piece in zip(
            members, inputs, jnp.split(summed, offsets), strict=True
        ):
            reduced[i][j] = piece.reshape(x.shape)
    return [
        acc._from_sync_parts(arrays)
        for acc, arrays in zip(accumulators, reduced, strict=True)
    ]
