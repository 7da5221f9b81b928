"""The state of a stateful metric: `MetricAccumulator`, and its sync.

A `MetricAccumulator` holds one piece of metric state with a *local* version (this
device's, or this minibatch's) and a *synchronized* one (every device's, after
`sync`). How the numbers are held (plain, compensated float, carried integer or
folded) is one representation object from `numerics.py`; the accumulator does the
bookkeeping around it: checks, local vs synchronized, state dicts.

`sync_accumulators` reduces any number of accumulators with one collective per
(`ReduceOp`, dtype); every accumulator contributes "sync parts" to those groups.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, DTypeLike

from .._utils import AxisName, check_axis_bound
from .accumulator_checks import (
    check_axis_name,
    checked_state_dict,
    compensated_representation,
    initial_state,
    parse_reduce_op,
)
from .inputs import as_array, cast_into, check_broadcast, host_integers
from .numerics import (
    CARRY_BITS as CARRY_BITS,
    Carried,
    Compensated,
    Folded,
    Plain,
    ReduceOp as ReduceOp,
    Representation,
    Words,
    add_pairs as add_pairs,
    carried_total,
    two_sum as two_sum,
)

_COLLECTIVE: dict[ReduceOp, Callable[[Array, tuple[str, ...]], Array]] = {
    ReduceOp.SUM: jax.lax.psum,
    ReduceOp.MAX: jax.lax.pmax,
    ReduceOp.MIN: jax.lax.pmin,
}


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


_A = TypeVar("_A", bound="MetricAccumulator")


class MetricAccumulator(eqx.Module):
    """One linearly additive piece of metric state, with a *local* and a
    *synchronized* version.

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
      `local_hi * 2**16 + local`, exact to 2**47 through `update`, `update_sum`,
      `merge` and `sync`. Both words join the (sum, int32) all-reduce of every
      other count: no extra collective. `value` is the total in the state's dtype,
      saturated at its largest value (never wrapped); `value_as(jnp.float32)` gives
      it as a float however large.

    **Arguments:**

    - `initial_value`: the starting state, also what `reset` returns to (e.g. `0.0`
      for a sum, `-jnp.inf` for a maximum). Its shape and dtype are the state's.
    - `reduce_op`: a `ReduceOp` or its string, `"sum"` (default), `"max"`, `"min"`.
    - `compensated`: keep a compensated float sum or a carried integer sum
      (default `False`); only for `"sum"`.

    **Raises:**

    `ValueError` for an unknown `reduce_op`, or `compensated=True` with a reduce op
    other than `"sum"`; `TypeError` for a missing (`None`), boolean or non-numeric
    `initial_value`, `compensated=True` with a Python int (say `0.0` for a float
    sum or `jnp.int32(0)` for a count), or with an unsigned integer or one narrower
    than 32 bits.

    !!! Example

        ```python
        def per_device(x):
            # This device's rows:
            acc = ed.metrics.MetricAccumulator(0.0).update(x.sum())
            acc = acc.sync("data")                            # every device's rows
            return acc.value                                  # replicated

        jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P())(x)

        big = ed.metrics.MetricAccumulator(jnp.float32(2**24), compensated=True)
        big.update(1.0).update(1.0).value  # 16777218.0 (16777216.0 uncompensated)
        ```
    """

    initial: Array
    words: Words
    synchronized_words: Words | None
    representation: Representation = eqx.field(static=True)

    def __init__(
        self,
        initial_value: ArrayLike,
        reduce_op: ReduceOp | str = "sum",
        *,
        compensated: bool = False,
    ):
        op = parse_reduce_op(reduce_op)
        initial = initial_state(initial_value)
        representation: Representation = Plain(op)
        if compensated:
            representation = compensated_representation(initial, op, initial_value)
        self.initial = initial
        self.representation = representation
        self.words = representation.start(initial)
        self.synchronized_words = None

    # ------------------------------------------------------------- views

    @property
    def reduce_op(self) -> ReduceOp:
        """The `ReduceOp` of this state."""
        return self.representation.op

    @property
    def compensated(self) -> bool:
        """Whether this is a compensated float sum or a carried integer sum (a
        Python `bool`)."""
        return isinstance(self.representation, Compensated | Carried)

    @property
    def is_synchronized(self) -> bool:
        """Whether `sync` has run since the last `update` (a Python `bool`)."""
        return self.synchronized_words is not None

    @property
    def local(self) -> Array:
        """The main word of the local state."""
        return self.words[0]

    @property
    def synchronized(self) -> Array | None:
        """The main word of the synchronized state (`None` before a sync)."""
        return None if self.synchronized_words is None else self.synchronized_words[0]

    # The second words under their state-dict names; `None` where the
    # representation has no such word.
    local_lo = property(lambda self: self._second(self.words, "lo"))
    local_hi = property(lambda self: self._second(self.words, "hi"))
    synchronized_lo = property(lambda self: self._second(self.synchronized_words, "lo"))
    synchronized_hi = property(lambda self: self._second(self.synchronized_words, "hi"))

    @property
    def value(self) -> Array:
        """The synchronized state if `is_synchronized`, else the local one, in the
        state's dtype (a compensated float sum rounded; a carried integer sum
        saturated at the dtype's range)."""
        return self.representation.value(self._current())

    def value_as(self, dtype: DTypeLike) -> Array:
        """`value` converted to `dtype` from the full state: a carried integer sum
        beyond its dtype's range is converted exactly as far as `dtype` allows (e.g.
        a count of 3 * 2**31 to float32), a compensated float sum is rounded once."""
        return self.representation.value_as(self._current(), jnp.dtype(dtype))

    # ------------------------------------------------------------ updates

    def update(self: _A, value: ArrayLike) -> _A:
        """Fold `value` into the local state (add for `"sum"`, elementwise max/min
        otherwise) and mark the accumulator unsynchronized.

        **Raises:**

        `ValueError` if `value`'s shape does not broadcast to the state's shape;
        `TypeError` if it is `None`, non-numeric, or its dtype cannot be cast into
        the state's without changing kind (floats into an integer state).
        """
        value = self._checked(value, f"{type(self).__name__}.update")
        rep = self.representation
        return self._unsynchronized(rep.add(self.words, rep.encode(value)))

    def update_sum(self: _A, values: ArrayLike) -> _A:
        """Add the sum of every entry of `values` to a scalar `"sum"` state.

        Unlike `update(values.sum())`, a carried integer sum adds the entries
        exactly however many there are (`jnp.sum` of int32 wraps past 2**31), host
        integers wider than int32 (NumPy int64, Python ints) included, to 2**47.

        **Raises:**

        `TypeError` for non-numeric `values`, floats into an integer state, or a
        non-scalar or non-sum state; `ValueError` for a total beyond 2**47.
        """
        caller = f"{type(self).__name__}.update_sum"
        if self.local.shape != () or self.reduce_op is not ReduceOp.SUM:
            raise TypeError(
                f"{caller}: only for scalar sums, this state has shape "
                f"{self.local.shape} and reduce_op {self.reduce_op.value!r}."
            )
        rep, dtype = self.representation, self.local.dtype
        host = host_integers(values)
        if isinstance(rep, Carried) and host is not None:
            # Exact in Python ints, whatever NumPy's width.
            words = rep.encode_int(int(host.astype(object).sum()), dtype, caller)
            return self._unsynchronized(rep.add(self.words, words))
        values = cast_into(as_array(values, caller, "values"), dtype, caller, "values")
        if isinstance(rep, Carried):
            return self._unsynchronized(
                rep.add(self.words, carried_total(values, dtype))
            )
        return self._unsynchronized(rep.add(self.words, rep.encode(jnp.sum(values))))

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
        if mine != theirs or self.representation != other.representation:
            raise ValueError(
                f"{type(self).__name__}.merge: cannot merge a (reduce_op, shape, "
                f"dtype, compensated) = {theirs} accumulator into a {mine} one."
            )
        return self._unsynchronized(self.representation.add(self.words, other.words))

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
        return self._unsynchronized(self.representation.start(initial))

    # -------------------------------------------------------- state dicts

    def state_dict(self) -> dict[str, Array]:
        """`{"local": ...}`, plus `"synchronized"` when synchronized, plus their
        second words (`"local_lo"`/`"synchronized_lo"` for a compensated float sum,
        `"local_hi"`/`"synchronized_hi"` for a carried integer sum): everything
        `load_state_dict` needs to rebuild this accumulator exactly."""
        second = self.representation.second
        state = {"local": self.local, "synchronized": self.synchronized}
        if second:
            state[f"local_{second}"] = self.words[1]
            state[f"synchronized_{second}"] = self._second(
                self.synchronized_words, second
            )
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
        arrays = checked_state_dict(
            state_dict, self.representation.second, self.local, caller
        )
        second, rep = self.representation.second, self.representation
        words = {
            which: rep.load(arrays[which], arrays.get(f"{which}_{second}"))
            for which in ("local", "synchronized")
            if which in arrays
        }
        loaded = self._unsynchronized(words["local"])
        if "synchronized" in words:
            loaded = replace_fields(loaded, synchronized_words=words["synchronized"])
        return loaded

    # ---------------------------------------------------------- internals

    def _second(self, words: Words | None, name: str) -> Array | None:
        if words is None or self.representation.second != name:
            return None
        return words[1]

    def _current(self) -> Words:
        return (
            self.words if self.synchronized_words is None else self.synchronized_words
        )

    def _checked(self, value: Any, caller: str) -> Array:
        local = self.local
        # What metrics pass is already checked and cast: validate it only once.
        if (
            isinstance(value, jax.Array)
            and value.shape == local.shape
            and value.dtype == local.dtype
        ):
            return value
        floating = jnp.issubdtype(local.dtype, jnp.floating)
        value = as_array(value, caller, "value", wide_to_float=floating)
        value = check_broadcast(value, local.shape, caller, "value", "the state")
        return cast_into(value, local.dtype, caller, "value")

    def _signature(self) -> tuple[Any, ...]:
        return (
            self.reduce_op.value,
            self.local.shape,
            self.local.dtype,
            self.compensated,
        )

    def _unsynchronized(self: _A, words: Words) -> _A:
        out: _A = replace_fields(self, words=tuple(words), synchronized_words=None)
        return out

    def _synchronized_as_local(self: _A) -> _A:
        """The synchronized state as the (unsynchronized) local one."""
        return self._unsynchronized(self._current())

    def _synchronized_from_local(self: _A) -> _A:
        """Global mode: the local state is already every device's."""
        out: _A = replace_fields(self, synchronized_words=self.words)
        return out

    def _sync_parts(self, names: tuple[str, ...]) -> list[Array]:
        """The arrays whose reductions (with `reduce_op`) over the devices make the
        synchronized state (see `_from_sync_parts`)."""
        return self.representation.sync_parts(self.words, names)

    def _from_sync_parts(self: _A, parts: Sequence[Array]) -> _A:
        words = tuple(self.representation.from_sync_parts(parts))
        out: _A = replace_fields(self, synchronized_words=words)
        return out


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

    def __init__(self, initial_value: ArrayLike, fold: Callable[[Array, Array], Array]):
        initial = initial_state(initial_value)
        self.initial = initial
        self.representation = Folded(fold=fold)
        self.words = (initial,)
        self.synchronized_words = None

    @property
    def fold(self) -> Callable[[Array, Array], Array]:
        """The associative function that combines two states."""
        assert isinstance(self.representation, Folded)
        return self.representation.fold


# ----------------------------------------------------------------------- sync


def _varying_axes(x: Array) -> frozenset[str]:
    return frozenset(jax.typeof(x).manual_axis_type.varying)


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
