"""Stateful distributed metrics: the `Metric` base every metric implements
(update, merge, sync, compute) and `MetricCollection`, which syncs many metrics with
one all-reduce per (op, dtype). The metrics themselves live beside it
(`aggregation.py`, `classification.py`, `confusion.py`, `regression.py`, ...), and
the state they are all made of (`MetricAccumulator`) in `accumulator.py`.

A metric is an immutable `eqx.Module` made of `MetricAccumulator`s. Each accumulator
holds a *linearly additive* state (a sum, a count, a running maximum or minimum),
never a running average, so that the states of several devices or several
minibatches combine exactly with one reduction (`Std` and `LastValue` fold their
states with an associative function instead; see `FoldAccumulator`).

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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax

from .._utils import AxisName
from .accumulator import MetricAccumulator, replace_fields, sync_accumulators

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
    different devices and minibatches combine exactly (or, for a state whose merge
    is not a sum, a `FoldAccumulator` with an exact associative merge).

    !!! Example

        ```python
        class MaxAbs(ed.Metric):
            peak: ed.metrics.MetricAccumulator

            def __init__(self):
                self.peak = ed.metrics.MetricAccumulator(0.0, "max")

            def update(self, values):
                return eqx.tree_at(
                    lambda m: m.peak, self, self.peak.update(jnp.abs(values).max())
                )

            def compute(self):
                return self.peak.value
        ```
    """

    _added_states: ClassVar[frozenset[str]] = frozenset()
    """Names of states added after a release: a state dict without them (saved by
    that release) loads them at their initial value."""

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

        `TypeError` if `axis_name` is not a string, a tuple of strings or `None`;
        `ValueError` if it is not bound here (outside `shard_map`).
        """
        caller = f"{type(self).__name__}.sync"
        return self._with_accumulators(
            sync_accumulators(self._accumulators(), axis_name, caller)
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

        `TypeError` if `state_dict` (or a nested entry) is not a mapping, or an
        array is `None` or not numeric; `ValueError` for missing or unexpected
        names, or arrays whose shape or dtype differ from this metric's states.
        """
        children = self._children()
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"{type(self).__name__}.load_state_dict: `state_dict` must be a "
                f"mapping with the keys {sorted(children)}, got "
                f"{type(state_dict).__name__}."
            )
        # States a later version added load as empty from older state dicts.
        missing = set(children) - set(state_dict)
        if set(state_dict) - set(children) or missing - self._added_states:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: expected the keys "
                f"{sorted(children)}, got {sorted(state_dict)}."
            )
        loaded = {
            name: child.load_state_dict(state_dict[name])
            for name, child in children.items()
            if name not in missing
        }
        synced = any(child.is_synchronized for child in loaded.values())
        for name in missing:
            # Empty on every device: its synchronized state is its local one.
            empty = children[name].reset()
            loaded[name] = empty.sync(None) if synced else empty
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
        out: _M = replace_fields(self, **children)
        return out


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
    - `prefix`: prepended to every name in `compute()`'s keys (e.g. `"val/"`);
      `update`, `collection[name]` and `state_dict` use the names without it.

    **Raises:**

    `TypeError` if `metrics` is not a mapping, a name is not a string, a value is
    not a `Metric`, or `prefix` is not a string.

    !!! Example

        ```python
        metrics = ed.MetricCollection(
            {"acc": ed.metrics.Accuracy(), "loss": ed.metrics.Mean()}
        )
        metrics = metrics.update(acc=(logits, labels), loss={"values": losses})
        metrics.sync("data").compute()  # {"acc": ..., "loss": ...}, inside shard_map
        metrics["acc"]                  # the Accuracy child
        ```
    """

    names: tuple[str, ...] = eqx.field(static=True)
    children: tuple[Metric, ...]
    prefix: str = eqx.field(static=True)

    def __init__(self, metrics: Mapping[str, Metric], *, prefix: str = ""):
        if not isinstance(metrics, Mapping):
            raise TypeError(
                "MetricCollection: `metrics` must be a mapping from names to metrics, "
                f"e.g. {{'acc': ed.metrics.Accuracy()}}; got {type(metrics).__name__}."
            )
        if not isinstance(prefix, str):
            raise TypeError(
                f"MetricCollection: `prefix` must be a string, got {prefix!r}."
            )
        for name, metric in metrics.items():
            if not isinstance(name, str):
                raise TypeError(
                    f"MetricCollection: metric names must be strings, got {name!r}."
                )
            if not isinstance(metric, Metric):
                raise TypeError(
                    f"MetricCollection: `metrics`[{name!r}] must be a Metric (e.g. "
                    f"ed.metrics.Mean()), got {type(metric).__name__}."
                )
        self.names = tuple(metrics)
        self.children = tuple(metrics.values())
        self.prefix = prefix

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
        """`{prefix + name: metric.compute()}` in order."""
        return {self.prefix + name: m.compute() for name, m in self.metrics.items()}

    def _children(self) -> dict[str, "MetricAccumulator | Metric"]:
        return dict(self.metrics)

    def _with_children(self, children: Mapping[str, Any]) -> "MetricCollection":
        out: MetricCollection = replace_fields(
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
