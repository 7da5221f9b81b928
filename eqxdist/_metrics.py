"""Stateful distributed metrics (d9d `Metric`/`MetricAccumulator`, torchmetrics, CLU).

A metric is an immutable `eqx.Module` made of `MetricAccumulator`s. Each accumulator
holds a *linearly additive* state (a sum, a count, a running maximum or minimum),
never a running average, so that the states of several devices or several
minibatches combine exactly with one reduction.

Three ways to use them, all with the same objects:

- *Eagerly or under `jax.jit` on global arrays* (possibly sharded over a mesh):
  `update` sees the whole global batch, so the state is already the global one and
  no `sync` is needed.
- *Inside `jax.shard_map`*: each device `update`s with its own rows, then
  `sync(axis_name)` reduces the states of every device with one collective per
  (`ReduceOp`, dtype), and `compute()` gives a replicated result that can leave
  `shard_map` with `out_specs=P()`.
- *Across minibatches or steps*: `merge` combines two states of the same metric.
"""

import abc
import dataclasses
import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, DTypeLike

from ._utils import AxisName, check_axis_bound


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


def _as_array(x: ArrayLike, caller: str, argument: str) -> Array:
    try:
        arr = jnp.asarray(x)
    except TypeError:
        arr = None
    if arr is None or not (
        jnp.issubdtype(arr.dtype, jnp.number) or jnp.issubdtype(arr.dtype, jnp.bool_)
    ):
        seen = np.asarray(x).dtype if arr is None else arr.dtype
        raise TypeError(
            f"{caller}: `{argument}` must hold numbers or booleans, got dtype {seen}."
        )
    return arr


def _cast_into(x: Array, dtype: jnp.dtype, caller: str, argument: str) -> Array:
    """`x` as `dtype`, refusing casts that change its kind (floats into an integer
    state would be silently truncated)."""
    if not jnp.can_cast(x.dtype, dtype, casting="same_kind"):
        raise TypeError(
            f"{caller}: `{argument}` has dtype {x.dtype}, which cannot be folded into "
            f"a state of dtype {dtype} without truncation; construct the metric with "
            "a matching dtype."
        )
    return x.astype(dtype)


def _check_broadcast(
    x: Array, shape: tuple[int, ...], caller: str, argument: str, target: str
) -> Array:
    """`x` broadcast to `shape`, which must not grow (a value may not be counted
    several times)."""
    try:
        fits = jnp.broadcast_shapes(x.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{caller}: `{argument}` of shape {x.shape} does not broadcast to the "
            f"shape of {target}, {shape}."
        )
    return jnp.broadcast_to(x, shape)


def _varying_axes(x: Array) -> frozenset[str]:
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def _replace(module: Any, **changes: Any) -> Any:
    # Like `dataclasses.replace`, without calling the public `__init__` (whose
    # arguments are the user-facing ones, not the fields); this is how Equinox
    # itself rebuilds modules when unflattening.
    new = object.__new__(type(module))
    for field in dataclasses.fields(module):
        object.__setattr__(
            new, field.name, changes.get(field.name, getattr(module, field.name))
        )
    return new


def _two_sum(a: Array, b: Array) -> tuple[Array, Array]:
    """`a + b` rounded, and its rounding error, exactly (Knuth's TwoSum: the two add
    up to `a + b` with no rounding at all). A non-finite sum has error 0, where the
    formula would give NaN."""
    total = a + b
    b_part = total - a
    error = (a - (total - b_part)) + (b - b_part)
    return total, jnp.where(jnp.isfinite(total), error, jnp.zeros_like(error))


def _add_pairs(
    hi: Array, lo: Array, other_hi: Array, other_lo: Array
) -> tuple[Array, Array]:
    """The sum of two double-word numbers `hi + lo`, renormalised so that `lo` is
    within half a unit in the last place of `hi` (then `hi` is the sum rounded)."""
    total, error = _two_sum(hi, other_hi)
    return _two_sum(total, error + (lo + other_lo))


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

    A float sum stops growing once it is 2**24 times larger than what is added to
    it (float32: `16777216.0 + 1.0 == 16777216.0`). A *compensated* sum keeps, next
    to `local`, the rounding error `local_lo` of every addition (Knuth's TwoSum), so
    that `local + local_lo` holds about twice the dtype's precision: float32
    counts stay exact to about 2**48 through `update` and `merge`, and up to 2**36
    through `sync` (see `sync`). `Sum` and `Mean` use it for their float states.

    **Arguments:**

    - `initial_value`: the starting state, also what `reset` returns to (e.g. `0.0`
      for a sum, `-jnp.inf` for a maximum). Its shape and dtype are the state's.
    - `reduce_op`: a `ReduceOp` or its string, `"sum"` (default), `"max"`, `"min"`.
    - `compensated`: keep a float sum compensated (default `False`); only for
      `"sum"` with a float `initial_value`.

    **Raises:**

    `ValueError` for an unknown `reduce_op`, or `compensated=True` with a reduce op
    other than `"sum"`; `TypeError` for a non-numeric `initial_value`, or
    `compensated=True` with a non-float one.

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
    # Rounding errors of a compensated sum (`None` when not compensated); the state
    # is `local + local_lo`, or `synchronized + synchronized_lo`.
    local_lo: Array | None
    synchronized_lo: Array | None
    reduce_op: ReduceOp = eqx.field(static=True)

    def __init__(
        self,
        initial_value: ArrayLike,
        reduce_op: ReduceOp | str = "sum",
        *,
        compensated: bool = False,
    ):
        self.reduce_op = _reduce_op(reduce_op)
        initial = _as_array(initial_value, "MetricAccumulator", "initial_value")
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
        if compensated and not jnp.issubdtype(initial.dtype, jnp.floating):
            raise TypeError(
                "MetricAccumulator: `compensated=True` needs a float "
                f"`initial_value`, got dtype {initial.dtype} (integer sums are "
                "exact already)."
            )
        self.initial = initial
        self.local = initial
        self.synchronized = None
        self.local_lo = jnp.zeros_like(initial) if compensated else None
        self.synchronized_lo = None

    @property
    def compensated(self) -> bool:
        """Whether this is a compensated sum (a Python `bool`)."""
        return self.local_lo is not None

    @property
    def is_synchronized(self) -> bool:
        """Whether `sync` has run since the last `update` (a Python `bool`)."""
        return self.synchronized is not None

    @property
    def value(self) -> Array:
        """The synchronized state if `is_synchronized`, else the local one (for a
        compensated sum: `local + local_lo`, rounded to the state's dtype)."""
        if self.synchronized is not None:
            hi, lo = self.synchronized, self.synchronized_lo
        else:
            hi, lo = self.local, self.local_lo
        return hi if lo is None else hi + lo

    def update(self, value: ArrayLike) -> "MetricAccumulator":
        """Fold `value` into the local state (add for `"sum"`, elementwise max/min
        otherwise) and mark the accumulator unsynchronized.

        **Raises:**

        `ValueError` if `value`'s shape does not broadcast to the state's shape;
        `TypeError` if its dtype cannot be cast into the state's without changing kind
        (floats into an integer state).
        """
        value = _as_array(value, "MetricAccumulator.update", "value")
        value = _check_broadcast(
            value, self.local.shape, "MetricAccumulator.update", "value", "the state"
        )
        value = _cast_into(value, self.local.dtype, "MetricAccumulator.update", "value")
        if self.local_lo is not None:
            zero = jnp.zeros_like(value)
            return self._unsynchronized(
                *_add_pairs(self.local, self.local_lo, value, zero)
            )
        return self._unsynchronized(_COMBINE[self.reduce_op](self.local, value))

    def merge(self, other: "MetricAccumulator") -> "MetricAccumulator":
        """Combine the local states of two accumulators (e.g. two minibatches') with
        the reduce op; the result is unsynchronized.

        **Raises:**

        `ValueError` if the reduce ops, shapes, dtypes or compensation differ.
        """
        if not isinstance(other, MetricAccumulator):
            raise TypeError(
                "MetricAccumulator.merge: `other` must be a MetricAccumulator, got "
                f"{type(other).__name__}."
            )
        mine, theirs = (
            (acc.reduce_op.value, acc.local.shape, acc.local.dtype, acc.compensated)
            for acc in (self, other)
        )
        if mine != theirs:
            raise ValueError(
                "MetricAccumulator.merge: cannot merge a (reduce_op, shape, dtype, "
                f"compensated) = {theirs} accumulator into a {mine} one."
            )
        if self.local_lo is not None and other.local_lo is not None:
            return self._unsynchronized(
                *_add_pairs(self.local, self.local_lo, other.local, other.local_lo)
            )
        return self._unsynchronized(_COMBINE[self.reduce_op](self.local, other.local))

    def sync(self, axis_name: AxisName | None = "data") -> "MetricAccumulator":
        """Reduce the local states of every device along `axis_name`, inside
        `jax.shard_map`; `value` becomes that reduction (replicated over the axis),
        `local` is unchanged.

        `axis_name=None` is global mode (the state was built from global arrays and
        already covers every device): the synchronized state is the local one.

        A compensated sum is reduced in three parts (a coarse and a fine part of
        `local`, and `local_lo`), in the same collective as the other sums of its
        dtype: integer-valued float32 totals below 2**36 stay exact on up to 4096
        devices, larger or fractional ones keep about twice the dtype's precision
        relative to the largest device's state.

        **Raises:**

        `ValueError` if `axis_name` is not bound here.
        """
        (synced,) = _sync_accumulators([self], axis_name, "MetricAccumulator.sync")
        return synced

    def reset(self) -> "MetricAccumulator":
        """Back to the initial value, unsynchronized.

        Inside `jax.shard_map` the result varies over the same mesh axes as `local`,
        so a reset accumulator can seed a `jax.lax.scan` carry that is then updated
        with per-device data.
        """
        initial = self.initial
        missing = tuple(sorted(_varying_axes(self.local) - _varying_axes(initial)))
        if missing:
            initial = jax.lax.pcast(initial, missing, to="varying")
        lo = None if self.local_lo is None else jnp.zeros_like(initial)
        return self._unsynchronized(initial, lo)

    def state_dict(self) -> dict[str, Array]:
        """`{"local": ...}`, plus `"synchronized"` when synchronized, plus (for a
        compensated sum) their rounding errors `"local_lo"` and `"synchronized_lo"`:
        everything `load_state_dict` needs to rebuild this accumulator exactly."""
        state = {
            "local": self.local,
            "synchronized": self.synchronized,
            "local_lo": self.local_lo,
            "synchronized_lo": self.synchronized_lo,
        }
        return {key: arr for key, arr in state.items() if arr is not None}

    def load_state_dict(
        self, state_dict: Mapping[str, ArrayLike]
    ) -> "MetricAccumulator":
        """An accumulator like this one (same initial value, reduce op and
        compensation) holding `state_dict` (from `state_dict()`); synchronized if it
        has a `"synchronized"` entry. A compensated sum missing `"local_lo"` or
        `"synchronized_lo"` takes them as 0.

        **Raises:**

        `ValueError` for a missing or unexpected key, or an array whose shape or
        dtype differs from this accumulator's state.
        """
        allowed = {"local", "synchronized"}
        if self.local_lo is not None:
            allowed |= {"local_lo", "synchronized_lo"}
        if "local" not in state_dict or set(state_dict) - allowed:
            optional = ", ".join(repr(key) for key in sorted(allowed - {"local"}))
            raise ValueError(
                "MetricAccumulator.load_state_dict: expected the key 'local' and "
                f"optionally {optional}, got {sorted(state_dict)}."
            )
        if "synchronized_lo" in state_dict and "synchronized" not in state_dict:
            raise ValueError(
                "MetricAccumulator.load_state_dict: 'synchronized_lo' is the rounding "
                "error of 'synchronized', which is missing; got "
                f"{sorted(state_dict)}."
            )
        arrays = {}
        for key, raw in state_dict.items():
            arr = jnp.asarray(raw)
            if arr.shape != self.local.shape or arr.dtype != self.local.dtype:
                raise ValueError(
                    f"MetricAccumulator.load_state_dict: {key!r} has shape "
                    f"{arr.shape} and dtype {arr.dtype}, expected shape "
                    f"{self.local.shape} and dtype {self.local.dtype}."
                )
            arrays[key] = arr.astype(arr.dtype)  # not weakly typed
        if self.local_lo is not None:
            for key in ("local", "synchronized"):
                if key in arrays:
                    arrays.setdefault(f"{key}_lo", jnp.zeros_like(arrays[key]))
        loaded = self._unsynchronized(arrays["local"], arrays.get("local_lo"))
        if "synchronized" in arrays:
            loaded = loaded._synchronized(
                arrays["synchronized"], arrays.get("synchronized_lo")
            )
        return loaded

    def _unsynchronized(
        self, local: Array, local_lo: Array | None = None
    ) -> "MetricAccumulator":
        out: MetricAccumulator = _replace(
            self,
            local=local,
            local_lo=local_lo,
            synchronized=None,
            synchronized_lo=None,
        )
        return out

    def _synchronized(
        self, synchronized: Array, synchronized_lo: Array | None = None
    ) -> "MetricAccumulator":
        out: MetricAccumulator = _replace(
            self, synchronized=synchronized, synchronized_lo=synchronized_lo
        )
        return out

    def _synchronized_as_local(self) -> "MetricAccumulator":
        """The synchronized state as the (unsynchronized) local one."""
        if self.synchronized is None:
            return self._unsynchronized(self.local, self.local_lo)
        return self._unsynchronized(self.synchronized, self.synchronized_lo)

    def _sync_parts(self) -> list[Array]:
        """The arrays whose reductions over the devices make the synchronized state
        (see `_from_sync_parts`)."""
        if self.local_lo is None:
            return [self.local]
        return [*_split_for_psum(self.local), self.local_lo]

    def _from_sync_parts(self, parts: Sequence[Array]) -> "MetricAccumulator":
        if self.local_lo is None:
            (reduced,) = parts
            return self._synchronized(reduced)
        top, bottom, lo = parts
        return self._synchronized(*_add_pairs(top, jnp.zeros_like(lo), bottom, lo))


def _sync_accumulators(
    accumulators: Sequence[MetricAccumulator], axis_name: AxisName | None, caller: str
) -> list[MetricAccumulator]:
    """Sync every accumulator with one collective per (reduce op, dtype): the parts
    of the local states of a group are flattened into one vector, reduced, and split
    back."""
    if axis_name is None:
        return [acc._synchronized(acc.local, acc.local_lo) for acc in accumulators]
    names = check_axis_bound(axis_name, caller)
    parts = [acc._sync_parts() for acc in accumulators]
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


_M = TypeVar("_M", bound="Metric")


def _is_accumulator(x: Any) -> bool:
    return isinstance(x, MetricAccumulator)


def _structure(metric: Any) -> Any:
    """Pytree structure down to the accumulators (whatever their sync state)."""
    return jax.tree.structure(metric, is_leaf=_is_accumulator)


class Metric(eqx.Module):
    """Base class of stateful metrics: an immutable module whose state is made of
    `MetricAccumulator` fields (or, for collections, child metrics).

    Subclasses implement `update` (returning a new metric) and `compute`; `merge`,
    `sync`, `reduce`, `reset`, `state_dict` and `load_state_dict` come from the
    accumulators. Store sums and counts, never running averages, so that states of
    different devices and minibatches combine exactly.

    !!! Example

        ```python
        class MaxAbs(ed.Metric):
            peak: ed.MetricAccumulator

            def __init__(self):
                self.peak = ed.MetricAccumulator(0.0, "max")

            def update(self, values):
                return eqx.tree_at(
                    lambda m: m.peak, self, self.peak.update(jnp.abs(values).max())
                )

            def compute(self):
                return self.peak.value
        ```
    """

    @abc.abstractmethod
    def update(self: _M, *args: Any, **kwargs: Any) -> _M:
        """Fold a batch into the local state; returns the updated metric."""

    @abc.abstractmethod
    def compute(self) -> Any:
        """The metric's value from the current state (the synchronized one after
        `sync`)."""

    @property
    def is_synchronized(self) -> bool:
        """Whether every accumulator is synchronized (no update since the last
        `sync`)."""
        return all(acc.is_synchronized for acc in self._accumulators())

    def merge(self: _M, other: _M) -> _M:
        """Combine the states of two metrics of the same kind, e.g. the metrics of
        two minibatches (sums and counts add, maxima take the maximum). The result is
        unsynchronized; merging synchronized metrics merges their local states.

        **Raises:**

        `TypeError` if `other` is not the same kind of metric with the same
        structure.
        """
        other_treedef = _structure(other)
        if type(other) is not type(self) or other_treedef != _structure(self):
            raise TypeError(
                f"{type(self).__name__}.merge: `other` must be a "
                f"{type(self).__name__} with the same structure, got "
                f"{type(other).__name__} with structure {other_treedef}."
            )
        pairs = zip(self._accumulators(), other._accumulators(), strict=True)
        return self._with_accumulators([a.merge(b) for a, b in pairs])

    def sync(self: _M, axis_name: AxisName | None = "data") -> _M:
        """Reduce the state over the devices of `axis_name`, inside `jax.shard_map`,
        with one collective per (`ReduceOp`, dtype) however many accumulators there
        are. `compute()` then gives the metric of every device's data, replicated
        over the axis (returnable with `out_specs=P()`); the local states stay each
        device's own, so further updates and a later sync never double count.

        `axis_name=None` is global mode (updates saw global arrays): nothing to
        reduce, the metric is just marked synchronized.

        **Raises:**

        `ValueError` if `axis_name` is not bound here (outside `shard_map`).
        """
        caller = f"{type(self).__name__}.sync"
        return self._with_accumulators(
            _sync_accumulators(self._accumulators(), axis_name, caller)
        )

    def reduce(self: _M, axis_name: AxisName | None = "data") -> _M:
        """The metric of every device's data as a plain (unsynchronized) metric:
        like `sync`, but the reduced state becomes the local state, so the whole
        metric is replicated and can itself leave `jax.shard_map` with
        `out_specs=P()`, e.g. as a training step's returned metrics, to be `merge`d
        with other steps' metrics outside.

        Do not `sync`/`reduce` the result again over the same axis: every device
        already holds every device's data, so it would be counted `axis_size` times.
        """
        synced = self.sync(axis_name)._accumulators()
        return self._with_accumulators([acc._synchronized_as_local() for acc in synced])

    def reset(self: _M) -> _M:
        """The metric with every accumulator back to its initial value (what a fresh
        metric holds), unsynchronized."""
        return self._with_accumulators([acc.reset() for acc in self._accumulators()])

    def state_dict(self) -> dict[str, Any]:
        """A nested dict of arrays, `{state name: accumulator.state_dict()}` (for a
        collection: `{metric name: metric.state_dict()}`), for checkpoints."""
        return {name: child.state_dict() for name, child in self._children().items()}

    def load_state_dict(self: _M, state_dict: Mapping[str, Any]) -> _M:
        """This metric holding `state_dict` (as returned by `state_dict()`); round
        trips exactly, synchronization included.

        **Raises:**

        `ValueError` for missing or unexpected names, or arrays whose shape or
        dtype differ from this metric's states.
        """
        children = self._children()
        if set(state_dict) != set(children):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: expected the keys "
                f"{sorted(children)}, got {sorted(state_dict)}."
            )
        loaded = {
            name: child.load_state_dict(state_dict[name])
            for name, child in children.items()
        }
        return self._with_children(loaded)

    def _accumulators(self) -> list[MetricAccumulator]:
        leaves = jax.tree.leaves(self, is_leaf=_is_accumulator)
        return [x for x in leaves if _is_accumulator(x)]

    def _with_accumulators(self: _M, accumulators: Sequence[MetricAccumulator]) -> _M:
        # Other leaves (e.g. arrays of a subclass's configuration) stay as they are.
        leaves, treedef = jax.tree.flatten(self, is_leaf=_is_accumulator)
        replacements = iter(accumulators)
        out: _M = jax.tree.unflatten(
            treedef, [next(replacements) if _is_accumulator(x) else x for x in leaves]
        )
        return out

    def _children(self) -> dict[str, "MetricAccumulator | Metric"]:
        # The named states: fields holding an accumulator or a metric.
        return {
            field.name: value
            for field in dataclasses.fields(self)
            if isinstance(
                value := getattr(self, field.name), MetricAccumulator | Metric
            )
        }

    def _with_children(self: _M, children: Mapping[str, Any]) -> _M:
        out: _M = _replace(self, **children)
        return out


def _state_dtype(dtype: DTypeLike | None) -> jnp.dtype:
    # `float` is JAX's default float type: float32, or float64 with x64 enabled.
    return jnp.dtype(jax.dtypes.canonicalize_dtype(float if dtype is None else dtype))


def _count_dtype() -> jnp.dtype:
    # int32 (int64 with x64 enabled): exact up to 2**31 - 1, far beyond float32's
    # 2**24.
    return jnp.dtype(jax.dtypes.canonicalize_dtype(int))


def _extreme(dtype: jnp.dtype, op: ReduceOp) -> Array:
    """The identity of max (lowest value) or min (highest value) for `dtype`."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(-jnp.inf if op is ReduceOp.MAX else jnp.inf, dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if op is ReduceOp.MAX else info.max, dtype)


class Sum(Metric):
    """Sum of every value seen.

    **Arguments:**

    - `dtype`: the state's dtype; default JAX's default float (float32). Use an
      integer dtype to add up integers exactly.

    `update(values)` adds `values.sum()`; `compute()` is the total, 0 when empty.
    A float total is a compensated sum (see `MetricAccumulator`): it keeps
    growing past 2**24 times the size of each addition, and float32 integers stay
    exact to about 2**48 (state dict keys `"local"` and `"local_lo"`, whose sum is
    the total); `compute()` rounds it to the dtype.

    !!! Example

        ```python
        ed.Sum().update(jnp.array([1.0, 2.0])).update(3.0).compute()  # 6.0
        ```
    """

    total: MetricAccumulator

    def __init__(self, dtype: DTypeLike | None = None):
        dtype = _state_dtype(dtype)
        self.total = MetricAccumulator(
            jnp.zeros((), dtype), compensated=jnp.issubdtype(dtype, jnp.floating)
        )

    def update(self, values: ArrayLike) -> "Sum":
        """Add `values.sum()` (any shape, empty included)."""
        values = _as_array(values, "Sum.update", "values")
        values = _cast_into(values, self.total.local.dtype, "Sum.update", "values")
        return self._with_children({"total": self.total.update(jnp.sum(values))})

    def compute(self) -> Array:
        """The sum."""
        return self.total.value


class Mean(Metric):
    """Weighted mean, `sum(values * weights) / sum(weights)`, kept as sums.

    The total weight is kept in two parts: unweighted values (`weights=None`) and
    integer or boolean weights (masks) are *counted* in an integer state, exact far
    beyond the 2**24 where float32 stops counting; float weights are added in a
    compensated float sum (see `MetricAccumulator`), which does not stop at 2**24
    either: 0/1 float weights stay exact counts to about 2**48 through `update` and
    `merge`, and to 2**36 through `sync` (as long as each update's own weights add
    up to less than 2**24). The weighted sum of the values is a
    compensated sum too, so that a mean of many small values does not drift.
    Compensated states have two entries in `state_dict()`, `"local"` and
    `"local_lo"` (its rounding error; the state is their exact sum).

    **Arguments:**

    - `dtype`: float dtype of the weighted sum and of the float weights; default
      JAX's default float (float32).

    `compute()` is NaN while the total weight is 0.

    !!! Example

        ```python
        m = ed.Mean().update(jnp.array([1.0, 3.0]))                  # mean 2
        m = m.update(jnp.array([10.0, 0.0]), weights=jnp.array([1, 0]))
        m.compute()  # (1 + 3 + 10) / 3
        ```
    """

    total: MetricAccumulator
    weight: MetricAccumulator
    count: MetricAccumulator

    def __init__(self, dtype: DTypeLike | None = None):
        dtype = _state_dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"Mean: `dtype` must be a float dtype, got {dtype}.")
        self.total = MetricAccumulator(jnp.zeros((), dtype), compensated=True)
        self.weight = MetricAccumulator(jnp.zeros((), dtype), compensated=True)
        self.count = MetricAccumulator(jnp.zeros((), _count_dtype()))

    def update(self, values: ArrayLike, weights: ArrayLike | None = None) -> "Mean":
        """Add a batch of `values` (any shape), each with weight 1 or with the
        matching entry of `weights`.

        **Arguments:**

        - `values`: the values to average.
        - `weights`: `None`, or an array that broadcasts to `values`' shape (e.g. a
          0/1 or boolean mask of padded examples, or per-example weights). Values
          with weight 0 are ignored, even NaN or inf ones.

        **Raises:**

        `ValueError` if `weights` does not broadcast to `values`' shape.
        """
        values = _as_array(values, "Mean.update", "values")
        dtype = self.total.local.dtype
        values = _cast_into(values, dtype, "Mean.update", "values")
        if weights is None:
            return self._with_children(
                {
                    "total": self.total.update(jnp.sum(values)),
                    "count": self.count.update(values.size),
                }
            )
        weights = _as_array(weights, "Mean.update", "weights")
        weights = _check_broadcast(
            weights, values.shape, "Mean.update", "weights", "`values`"
        )
        # Weight 0 excludes a value outright, so padding may hold NaN or inf.
        weighted = jnp.where(weights != 0, values * weights.astype(dtype), 0)
        total = self.total.update(jnp.sum(weighted))
        if jnp.issubdtype(weights.dtype, jnp.floating):
            counted = {"weight": self.weight.update(jnp.sum(weights.astype(dtype)))}
        else:
            counted = {
                "count": self.count.update(jnp.sum(weights, dtype=_count_dtype()))
            }
        return self._with_children({"total": total, **counted})

    def compute(self) -> Array:
        """The weighted mean; NaN while the total weight is 0."""
        total = self.total.value
        weight = self.weight.value + self.count.value.astype(total.dtype)
        return jnp.where(weight == 0, jnp.nan, total / weight)


_E = TypeVar("_E", bound="_Extremum")


class _Extremum(Metric):
    best: MetricAccumulator
    _op: ClassVar[ReduceOp]

    def __init__(self, dtype: DTypeLike | None = None):
        self.best = MetricAccumulator(_extreme(_state_dtype(dtype), self._op), self._op)

    def update(self: _E, values: ArrayLike) -> _E:
        """Fold in the extreme of `values` (any shape, empty included)."""
        caller = f"{type(self).__name__}.update"
        values = _cast_into(
            _as_array(values, caller, "values"), self.best.local.dtype, caller, "values"
        )
        reduce = jnp.max if self.best.reduce_op is ReduceOp.MAX else jnp.min
        # `initial` makes an empty batch a no-op instead of an error.
        extreme = reduce(values, initial=self.best.initial)
        return self._with_children({"best": self.best.update(extreme)})

    def compute(self) -> Array:
        """The extreme value seen (the empty value if none)."""
        return self.best.value


class Max(_Extremum):
    """Largest value seen; `-inf` before any (the dtype's lowest value for integer
    dtypes).

    **Arguments:**

    - `dtype`: the state's dtype; default JAX's default float (float32).

    !!! Example

        ```python
        ed.Max().update(jnp.array([1.0, 5.0])).update(3.0).compute()  # 5.0
        ```
    """

    _op = ReduceOp.MAX


class Min(_Extremum):
    """Smallest value seen; `+inf` before any (the dtype's highest value for integer
    dtypes).

    **Arguments:**

    - `dtype`: the state's dtype; default JAX's default float (float32).

    !!! Example

        ```python
        ed.Min().update(jnp.array([1.0, 5.0])).compute()  # 1.0
        ```
    """

    _op = ReduceOp.MIN


class Accuracy(Metric):
    """Fraction of correct predictions, kept as integer counts (exact far beyond
    2**24 examples).

    `update(logits_or_predictions, labels, mask=None)`:

    - `labels`: integer class labels, any shape (e.g. `(batch,)` or
      `(batch, tokens)`).
    - `logits_or_predictions`: integer (or boolean) predictions of `labels`' shape,
      compared directly; or float scores with one more trailing axis (classes),
      which go through `argmax` over that axis.
    - `mask`: optional, broadcastable to `labels`' shape, boolean or 0/1; examples
      where it is 0/False (padding) are not counted.

    `compute()` is NaN while nothing has been counted.

    !!! Example

        ```python
        acc = ed.Accuracy().update(logits, labels, mask=labels >= 0)
        acc.compute()
        ```
    """

    correct: MetricAccumulator
    total: MetricAccumulator

    def __init__(self) -> None:
        self.correct = MetricAccumulator(jnp.zeros((), _count_dtype()))
        self.total = MetricAccumulator(jnp.zeros((), _count_dtype()))

    def update(
        self,
        logits_or_predictions: ArrayLike,
        labels: ArrayLike,
        mask: ArrayLike | None = None,
    ) -> "Accuracy":
        """Count a batch of predictions.

        **Raises:**

        `TypeError` if `labels` are not integers; `ValueError` if the shapes of
        predictions (or logits) and labels, or of mask and labels, do not match.
        """
        caller = "Accuracy.update"
        preds = _as_array(logits_or_predictions, caller, "logits_or_predictions")
        labels = _as_array(labels, caller, "labels")
        if not jnp.issubdtype(labels.dtype, jnp.integer):
            raise TypeError(
                f"{caller}: `labels` must be integer class labels, got dtype "
                f"{labels.dtype}."
            )
        if jnp.issubdtype(preds.dtype, jnp.floating):
            if preds.ndim != labels.ndim + 1 or preds.shape[:-1] != labels.shape:
                raise ValueError(
                    f"{caller}: float `logits_or_predictions` of shape {preds.shape} "
                    f"must have the shape of `labels` {labels.shape} plus a trailing "
                    "class axis; pass integer class predictions of shape "
                    f"{labels.shape} instead to compare them directly."
                )
            preds = jnp.argmax(preds, axis=-1)
        elif preds.shape != labels.shape:
            raise ValueError(
                f"{caller}: integer `logits_or_predictions` of shape {preds.shape} "
                f"must have the shape of `labels`, {labels.shape}."
            )
        hits = preds == labels
        if mask is None:
            counted = jnp.ones_like(hits)
        else:
            mask = _as_array(mask, caller, "mask")
            counted = _check_broadcast(mask, labels.shape, caller, "mask", "`labels`")
            counted = counted != 0
        return self._with_children(
            {
                "correct": self.correct.update(
                    jnp.sum(hits & counted, dtype=_count_dtype())
                ),
                "total": self.total.update(jnp.sum(counted, dtype=_count_dtype())),
            }
        )

    def compute(self) -> Array:
        """Correct / counted; NaN while nothing has been counted."""
        correct, total = self.correct.value, self.total.value
        return jnp.where(total == 0, jnp.nan, correct / jnp.maximum(total, 1))


class _UnknownMetricError(ValueError, KeyError):
    """An unknown metric name: a `ValueError` (bad argument) that is also the
    `KeyError` a mapping lookup raises."""

    def __str__(self) -> str:
        return str(self.args[0])


class MetricCollection(Metric):
    """Several named metrics updated, merged and synchronized together.

    `sync` reduces every child with at most one collective per (`ReduceOp`,
    dtype) in use (e.g. 16 metrics: typically 3 or 4 all-reduces), instead of one per
    state. A collection is itself a `Metric`, so it can be merged, reset, nested and
    returned as the metrics of a training step.

    **Arguments:**

    - `metrics`: a mapping from names to metrics; the order is kept.

    **Raises:**

    `TypeError` if a name is not a string or a value is not a `Metric`.

    !!! Example

        ```python
        metrics = ed.MetricCollection({"acc": ed.Accuracy(), "loss": ed.Mean()})
        metrics = metrics.update(acc=(logits, labels), loss={"values": losses})
        metrics.sync("data").compute()  # {"acc": ..., "loss": ...}, inside shard_map
        metrics["acc"]                  # the Accuracy child
        ```
    """

    names: tuple[str, ...] = eqx.field(static=True)
    children: tuple[Metric, ...]

    def __init__(self, metrics: Mapping[str, Metric]):
        for name, metric in metrics.items():
            if not isinstance(name, str):
                raise TypeError(
                    f"MetricCollection: metric names must be strings, got {name!r}."
                )
            if not isinstance(metric, Metric):
                raise TypeError(
                    f"MetricCollection: `metrics`[{name!r}] must be a Metric (e.g. "
                    f"ed.Mean()), got {type(metric).__name__}."
                )
        self.names = tuple(metrics)
        self.children = tuple(metrics.values())

    @property
    def metrics(self) -> dict[str, Metric]:
        """The child metrics by name, in order."""
        return dict(zip(self.names, self.children, strict=True))

    def __getitem__(self, name: str) -> Metric:
        return self.metrics[self._check_name(name, "MetricCollection[...]")]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def update(self, /, **updates: Any) -> "MetricCollection":
        """Update the named children: each value is a tuple of positional arguments
        or a dict of keyword arguments for that child's `update`. Children not named
        are unchanged.

        **Raises:**

        `ValueError` for a name that is not in the collection; `TypeError` for an
        argument that is not a tuple or a dict.
        """
        metrics = self.metrics
        for name, args in updates.items():
            child = metrics[self._check_name(name, "MetricCollection.update")]
            if isinstance(args, tuple):
                metrics[name] = child.update(*args)
            elif isinstance(args, Mapping):
                metrics[name] = child.update(**args)
            else:
                raise TypeError(
                    f"MetricCollection.update: the arguments for {name!r} must be a "
                    "tuple of positional arguments or a dict of keyword arguments, "
                    f"got {type(args).__name__} (wrap one array as `(x,)`)."
                )
        return self._with_children(metrics)

    def compute(self) -> dict[str, Any]:
        """`{name: metric.compute()}` in order."""
        return {name: metric.compute() for name, metric in self.metrics.items()}

    def _children(self) -> dict[str, "MetricAccumulator | Metric"]:
        return dict(self.metrics)

    def _with_children(self, children: Mapping[str, Any]) -> "MetricCollection":
        out: MetricCollection = _replace(
            self, children=tuple(children[n] for n in self.names)
        )
        return out

    def _check_name(self, name: str, caller: str) -> str:
        if name not in self.names:
            raise _UnknownMetricError(
                f"{caller}: no metric named {name!r}; the collection has "
                f"{list(self.names)}."
            )
        return name
