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

    **Arguments:**

    - `initial_value`: the starting state, also what `reset` returns to (e.g. `0.0`
      for a sum, `-jnp.inf` for a maximum). Its shape and dtype are the state's.
    - `reduce_op`: a `ReduceOp` or its string, `"sum"` (default), `"max"`, `"min"`.

    **Raises:**

    `ValueError` for an unknown `reduce_op`; `TypeError` for a non-numeric
    `initial_value`.

    !!! Example

        ```python
        def per_device(x):
            acc = ed.MetricAccumulator(0.0).update(x.sum())   # this device's rows
            acc = acc.sync("data")                            # every device's rows
            return acc.value                                  # replicated

        jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P())(x)
        ```
    """

    initial: Array
    local: Array
    synchronized: Array | None
    reduce_op: ReduceOp = eqx.field(static=True)

    def __init__(self, initial_value: ArrayLike, reduce_op: ReduceOp | str = "sum"):
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
        self.initial = initial
        self.local = initial
        self.synchronized = None

    @property
    def is_synchronized(self) -> bool:
        """Whether `sync` has run since the last `update` (a Python `bool`)."""
        return self.synchronized is not None

    @property
    def value(self) -> Array:
        """The synchronized state if `is_synchronized`, else the local one."""
        return self.synchronized if self.synchronized is not None else self.local

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
        return self._unsynchronized(_COMBINE[self.reduce_op](self.local, value))

    def merge(self, other: "MetricAccumulator") -> "MetricAccumulator":
        """Combine the local states of two accumulators (e.g. two minibatches') with
        the reduce op; the result is unsynchronized.

        **Raises:**

        `ValueError` if the reduce ops, shapes or dtypes differ.
        """
        if not isinstance(other, MetricAccumulator):
            raise TypeError(
                "MetricAccumulator.merge: `other` must be a MetricAccumulator, got "
                f"{type(other).__name__}."
            )
        mine = (self.reduce_op.value, self.local.shape, self.local.dtype)
        theirs = (other.reduce_op.value, other.local.shape, other.local.dtype)
        if mine != theirs:
            raise ValueError(
                "MetricAccumulator.merge: cannot merge a (reduce_op, shape, dtype) = "
                f"{theirs} accumulator into a {mine} one."
            )
        return self._unsynchronized(_COMBINE[self.reduce_op](self.local, other.local))

    def sync(self, axis_name: AxisName | None = "data") -> "MetricAccumulator":
        """Reduce the local states of every device along `axis_name`, inside
        `jax.shard_map`; `value` becomes that reduction (replicated over the axis),
        `local` is unchanged.

        `axis_name=None` is global mode (the state was built from global arrays and
        already covers every device): the synchronized state is the local one.

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
        return self._unsynchronized(initial)

    def state_dict(self) -> dict[str, Array]:
        """`{"local": ...}`, plus `"synchronized"` when synchronized: everything
        `load_state_dict` needs to rebuild this accumulator exactly."""
        state = {"local": self.local}
        if self.synchronized is not None:
            state["synchronized"] = self.synchronized
        return state

    def load_state_dict(
        self, state_dict: Mapping[str, ArrayLike]
    ) -> "MetricAccumulator":
        """An accumulator like this one (same initial value and reduce op) holding
        `state_dict` (from `state_dict()`); synchronized if it has a
        `"synchronized"` entry.

        **Raises:**

        `ValueError` for a missing or unexpected key, or an array whose shape or
        dtype differs from this accumulator's state.
        """
        unexpected = sorted(set(state_dict) - {"local", "synchronized"})
        if "local" not in state_dict or unexpected:
            raise ValueError(
                "MetricAccumulator.load_state_dict: expected the keys 'local' and "
                f"optionally 'synchronized', got {sorted(state_dict)}."
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
        loaded = self._unsynchronized(arrays["local"])
        if "synchronized" in arrays:
            loaded = loaded._synchronized(arrays["synchronized"])
        return loaded

    def _unsynchronized(self, local: Array) -> "MetricAccumulator":
        out: MetricAccumulator = _replace(self, local=local, synchronized=None)
        return out

    def _synchronized(self, synchronized: Array) -> "MetricAccumulator":
        out: MetricAccumulator = _replace(self, synchronized=synchronized)
        return out


def _sync_accumulators(
    accumulators: Sequence[MetricAccumulator], axis_name: AxisName | None, caller: str
) -> list[MetricAccumulator]:
    """Sync every accumulator with one collective per (reduce op, dtype): the local
    states of a group are flattened into one vector, reduced, and split back."""
    if axis_name is None:
        return [acc._synchronized(acc.local) for acc in accumulators]
    names = check_axis_bound(axis_name, caller)
    groups: dict[tuple[ReduceOp, jnp.dtype], list[int]] = {}
    for i, acc in enumerate(accumulators):
        groups.setdefault((acc.reduce_op, acc.local.dtype), []).append(i)
    synced = list(accumulators)
    for (op, _), members in groups.items():
        locals_ = [accumulators[i].local for i in members]
        flat = jnp.concatenate([jnp.ravel(x) for x in locals_])
        reduced = _COLLECTIVE[op](flat, names)
        offsets = np.cumsum([x.size for x in locals_])[:-1].tolist()
        for i, x, part in zip(
            members, locals_, jnp.split(reduced, offsets), strict=True
        ):
            synced[i] = accumulators[i]._synchronized(part.reshape(x.shape))
    return synced


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
        return self._with_accumulators(
            [acc._unsynchronized(acc.value) for acc in synced]
        )

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

    !!! Example

        ```python
        ed.Sum().update(jnp.array([1.0, 2.0])).update(3.0).compute()  # 6.0
        ```
    """

    total: MetricAccumulator

    def __init__(self, dtype: DTypeLike | None = None):
        self.total = MetricAccumulator(jnp.zeros((), _state_dtype(dtype)))

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
    beyond the 2**24 where float32 stops counting; float weights are added in the
    float state.

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
        self.total = MetricAccumulator(jnp.zeros((), dtype))
        self.weight = MetricAccumulator(jnp.zeros((), dtype))
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
