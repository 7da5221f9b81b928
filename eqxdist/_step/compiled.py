"""The compiled-step cache: one `jax.jit` per structure of `(state, batch)`, with
donation that never deletes the caller's arrays and a fast path for the state the
last call returned.

It knows nothing of optimizers, FSDP or metrics: its owner gives it a pure
function `fn(state, batch) -> (new_state, aux)` and, once per new structure of
state, a `Placement`: where every state leaf lives and how to compile. The train
and evaluation steps are built on it."""

import collections
import contextlib
import weakref
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._data_parallel import place, shard_batch
from .._utils import (
    check_not_consumed,
    flatten_up_to,
    is_array_like,
    note_donated,
    was_donated,
)


class Placement(NamedTuple):
    """What the owner of a `CompiledStep` says about one structure of state.

    - `specs`: the `PartitionSpec` of every state leaf (`None` at non-arrays).
    - `kept`: a tree of bools, `True` at leaves `fn` only reads; `fn` must return
      them unchanged (they are not donated and go back as they came).
    - `context_mesh`: the mesh `fn` is traced and run under (`jax.set_mesh`
      around each call, whatever mesh the caller set); `None`: the caller's.
    - `compiler_options`: XLA options for `jax.jit` (`None`: none).
    """

    specs: Any
    kept: Any
    context_mesh: Mesh | None = None
    compiler_options: dict[str, Any] | None = None


# States returned by a donating step of a family (the steps of one model's parts,
# `family` naming them), and states a donating step was given and consumed, by
# `id` (weakly: an entry goes with its state). A state a step of its family
# returned holds the family's own arrays, so a step may donate it as it donates
# its own (a GAN's steps alternate on one state) instead of copying it; a step's
# fast path, which looks at one of its own arrays, asks here whether another
# step consumed its last state (the arrays it kept, such as another part's
# parameters, may be the ones donated).
_RETURNED: dict[int, tuple["weakref.ref[Any]", Hashable]] = {}
_CONSUMED: dict[int, tuple["weakref.ref[Any]", Hashable]] = {}


def _note(registry: dict[int, Any], state: Any, family: Hashable = None) -> None:
    key = id(state)
    # A state type without weak references is not recorded.
    with contextlib.suppress(TypeError):
        ref = weakref.ref(state, lambda _: registry.pop(key, None))
        registry[key] = (ref, family)


def _noted(registry: dict[int, Any], state: Any) -> Hashable | bool:
    """The family `state` is noted with (`True` for none), or `False`."""
    entry = registry.get(id(state))
    if entry is None or entry[0]() is not state:
        return False
    return True if entry[1] is None else entry[1]


def _context(mesh: Mesh | None) -> Any:
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    try:
        # Tuple equality checks identity first, so the usual case (the very same
        # functions and numbers as last time) costs no comparisons.
        return bool(a == b)
    except (ValueError, TypeError):  # an array where a number was: no match
        return False


class _Entry:
    """One compiled function for one structure of (state, batch): where the array
    leaves are, the non-array leaves to put back, and the jitted function.

    The state's arrays go to the jitted function in two groups: those the step
    replaces (donated), and those it only reads (`kept`: a PRNG key, frozen
    parameters), which go back into the new state as they are, at no cost."""

    def __init__(
        self,
        state_leaves: list[Any],
        state_def: Any,
        kept_mask: list[bool],
        batch_leaves: list[Any],
        batch_def: Any,
    ) -> None:
        self.state_def = state_def
        self.batch_def = batch_def
        arrays = [i for i, x in enumerate(state_leaves) if is_array_like(x)]
        self.updated = tuple(i for i in arrays if not kept_mask[i])
        self.kept = tuple(i for i in arrays if kept_mask[i])
        self.state_others = tuple(
            i for i, x in enumerate(state_leaves) if not is_array_like(x)
        )
        self.batch_arrays = tuple(
            i for i, x in enumerate(batch_leaves) if is_array_like(x)
        )
        self.batch_others = tuple(
            i for i, x in enumerate(batch_leaves) if not is_array_like(x)
        )
        self.state_static = tuple(state_leaves[i] for i in self.state_others)
        self.batch_static = tuple(batch_leaves[i] for i in self.batch_others)
        self.state_template = [None if is_array_like(x) else x for x in state_leaves]
        self.batch_template = [None if is_array_like(x) else x for x in batch_leaves]
        self.fn: Any = None
        self.mesh: Any = None  # the context mesh `fn` is traced and run under
        self.specs: Any = None
        # The mesh and the spec of every state leaf: a state another step placed
        # the same way needs no placing.
        self.layout: Hashable = None
        self.shardings: tuple[list[Any], list[Any], list[Any]] = ([], [], [])

    def batch_matches(self, batch_leaves: list[Any], batch_def: Any) -> bool:
        if batch_def != self.batch_def:
            return False
        return _same(
            tuple(batch_leaves[i] for i in self.batch_others), self.batch_static
        )

    def matches(
        self,
        state_leaves: list[Any],
        state_def: Any,
        batch_leaves: list[Any],
        batch_def: Any,
    ) -> bool:
        return (
            state_def == self.state_def
            and _same(
                tuple(state_leaves[i] for i in self.state_others), self.state_static
            )
            and self.batch_matches(batch_leaves, batch_def)
        )

    def state(self, updated: list[Any], kept: list[Any]) -> Any:
        leaves = list(self.state_template)
        for i, x in zip(self.updated, updated, strict=True):
            leaves[i] = x
        for i, x in zip(self.kept, kept, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(self.state_def, leaves)

    def batch(self, arrays: list[Any]) -> Any:
        leaves = list(self.batch_template)
        for i, x in zip(self.batch_arrays, arrays, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(self.batch_def, leaves)


class CompiledStep:
    """A cached, sharded `jax.jit` of `fn(state, batch) -> (new_state, aux)`.

    - `describe(state)`: the `Placement` of a state of this structure, asked
      once per new structure.
    - `batch_sharding`: the sharding of the rows (a batch already on the mesh in
      another layout is moved).
    - `leaf_sharding(ndim)`: that of a batch leaf of rank `ndim` >= 1 (0-d
      leaves are replicated): `Layout.leaf_sharding`.
    - `check_batch(batch)`: raises for a batch `fn` cannot take (called whenever
      the batch's shapes change: `jit` would otherwise reject rows that do not
      split evenly before `fn` is traced, with an error of its own).
    - `aux` (metrics) comes back replicated.
    - `donate`: the updated leaves are donated, but only for the state that this
      object returned last; any other state is placed as a copy first, so the
      caller's arrays stay valid. A consumed state is a `ValueError`, never a
      crash.
    - `max_in_flight`: at most this many calls are queued before the oldest is
      waited for (XLA's CPU collectives deadlock when too many are queued;
      `None`: unbounded).
    - `family`: steps of one family (`None`: none) donate the states each other
      returned, as their own; any other state is copied first.
    """

    def __init__(
        self,
        fn: Callable[[Any, Any], tuple[Any, Any]],
        mesh: Mesh,
        *,
        describe: Callable[[Any], Placement],
        batch_sharding: NamedSharding,
        leaf_sharding: Callable[[int], NamedSharding],
        donate: bool,
        max_in_flight: int | None,
        check_batch: Callable[[Any], None] | None = None,
        family: Hashable = None,
        name: str = "step",
    ) -> None:
        self.fn = fn
        self.family = family
        self.mesh = mesh
        self.describe = describe
        self.batch_sharding = batch_sharding
        self.leaf_sharding = leaf_sharding
        self.donate = donate
        self.max_in_flight = max_in_flight
        self.check_batch = check_batch
        self._checked_shapes: Any = None
        self.name = name
        self._entries: list[_Entry] = []
        self._last: _Entry | None = None
        # The state the last call returned (weakly: the cache must not keep a state
        # the caller dropped alive), with its arrays in the groups the jitted
        # function takes: passed straight back in, it needs no flattening.
        self._last_state: weakref.ref[Any] | None = None
        self._last_arrays: tuple[list[Any], list[Any]] = ([], [])
        self._in_flight: collections.deque[Any] = collections.deque()

    # -- the slow path: find or build the entry, place a copy of the state -------

    def entry(self, state: Any, batch: Any) -> tuple[_Entry, Any]:
        """The entry for this structure (compiled on first use) and `state` placed
        as it wants it (a copy when the step donates; abstract states as given)."""
        check_not_consumed(state, self.name)
        state_leaves, state_def = jax.tree.flatten(state)
        batch_leaves, batch_def = jax.tree.flatten(batch)
        for entry in self._entries:
            if entry.matches(state_leaves, state_def, batch_leaves, batch_def):
                break
        else:
            placement = self.describe(state)
            kept_mask = flatten_up_to(state, placement.kept)
            entry = _Entry(state_leaves, state_def, kept_mask, batch_leaves, batch_def)
            entry.specs = placement.specs
            entry.mesh = placement.context_mesh
            entry.layout = (
                self.mesh,
                tuple(flatten_up_to(state, placement.specs)),
            )
            entry.fn = self._compile(
                entry,
                flatten_up_to(state, placement.specs),
                batch,
                placement.compiler_options,
            )
            self._entries.append(entry)
        if not any(isinstance(x, jax.ShapeDtypeStruct) for x in state_leaves):
            # Another step's state is copied, unless a step of this one's family
            # returned it (see `_RETURNED`); placed as this entry places it (the
            # part steps of one layout), it is passed on as it is.
            noted = _noted(_RETURNED, state)
            family, layout = noted if isinstance(noted, tuple) else (None, None)
            ours = self.family is not None and family == self.family
            if not (ours and layout == entry.layout):
                state = place(
                    state, entry.specs, self.mesh, copy=self.donate and not ours
                )
        return entry, state

    def _compile(
        self,
        entry: _Entry,
        spec_leaves: list[Any],
        batch: Any,
        options: dict[str, Any] | None,
    ) -> Any:
        updated = [NamedSharding(self.mesh, spec_leaves[i]) for i in entry.updated]
        kept = [NamedSharding(self.mesh, spec_leaves[i]) for i in entry.kept]
        replicated = NamedSharding(self.mesh, P())
        leaves = jax.tree.leaves(batch)
        batch_shardings = [
            self._leaf_sharding(jnp.ndim(leaves[i]), replicated)
            for i in entry.batch_arrays
        ]
        entry.shardings = (updated, kept, batch_shardings)

        def run(
            updated_arrays: list[Any], kept_arrays: list[Any], batch_arrays: list[Any]
        ) -> Any:
            new_state, aux = self.fn(
                entry.state(updated_arrays, kept_arrays), entry.batch(batch_arrays)
            )
            new_leaves, new_def = jax.tree.flatten(new_state)
            if new_def != entry.state_def:
                raise ValueError(
                    f"{self.name}: the update changed the structure of the state "
                    f"from {entry.state_def} to {new_def}; the optimizer state and "
                    "the model state must keep their structure between steps."
                )
            # A token that is ready when the step is: never donated, so the bound on
            # steps in flight can wait on it.
            token = jnp.zeros((), jnp.int32)
            return [new_leaves[i] for i in entry.updated], aux, token

        return jax.jit(
            run,
            in_shardings=(updated, kept, batch_shardings),
            out_shardings=(updated, replicated, replicated),
            donate_argnums=(0,) if self.donate else (),
            compiler_options=options,
        )

    def _leaf_sharding(self, ndim: int, replicated: NamedSharding) -> NamedSharding:
        if ndim == 0:
            return replicated
        return self.leaf_sharding(ndim)

    @staticmethod
    def _state_arrays(entry: _Entry, state: Any) -> tuple[list[Any], list[Any]]:
        leaves = jax.tree.leaves(state)
        return [leaves[i] for i in entry.updated], [leaves[i] for i in entry.kept]

    # -- calling -------------------------------------------------------------------

    def trace(self, state: Any, batch: Any) -> Any:
        """`jax.jit(...).trace` of the compiled function for these arguments: its
        `jaxpr`, and `.lower()`."""
        if self.check_batch is not None:
            self.check_batch(batch)
        entry, state = self.entry(state, batch)
        batch_leaves = jax.tree.leaves(batch)
        with _context(entry.mesh):
            return entry.fn.trace(
                *self._state_arrays(entry, state),
                [batch_leaves[i] for i in entry.batch_arrays],
            )

    def lower(self, state: Any, batch: Any) -> Any:
        """`jax.jit(...).lower` of the compiled function for these arguments."""
        return self.trace(state, batch).lower()

    def _forget(self, _: Any) -> None:
        self._last_arrays = ([], [])

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        # The hot path: the state the last call returned needs no flattening and no
        # copy, the batch one C++ flatten and a structure check; then one call to
        # the jitted function over the array leaves.
        given = state
        batch_leaves, batch_def = jax.tree.flatten(batch)
        entry = self._last
        if (
            entry is not None
            and self._last_state is not None
            and state is self._last_state()
            and entry.batch_matches(batch_leaves, batch_def)
        ):
            updated, kept = self._last_arrays
            # Donation deletes every donated array at once: one look is enough to
            # catch a state that this step consumed since, and the registry says
            # whether another step did.
            if (updated and was_donated(updated[0])) or _noted(_CONSUMED, state):
                check_not_consumed(state, self.name)
        else:
            entry, state = self.entry(state, batch)
            self._last = entry
            updated, kept = self._state_arrays(entry, state)
        batch_arrays = [batch_leaves[i] for i in entry.batch_arrays]
        if self.check_batch is not None:
            # dtypes too: string labels after numeric ones of the same shape.
            shapes = [(x.shape, x.dtype) for x in batch_arrays]
            if shapes != self._checked_shapes:
                self.check_batch(batch)
                self._checked_shapes = shapes
        batch_arrays = _placed_batch(
            entry, batch_arrays, batch, rows=self.batch_sharding
        )
        with _context(entry.mesh):
            new_arrays, aux, token = entry.fn(updated, kept, batch_arrays)
        new_state = entry.state(new_arrays, kept)
        if self.donate and updated:
            note_donated(updated[0])
            _note(_CONSUMED, given)
            _note(_RETURNED, new_state, (self.family, entry.layout))
        try:
            self._last_state = weakref.ref(new_state, self._forget)
            self._last_arrays = (new_arrays, kept)
        except TypeError:  # a state type without weak references: no fast path
            self._last_state, self._last_arrays = None, ([], [])
        if self.max_in_flight is not None:
            self._in_flight.append(token)
            if len(self._in_flight) > self.max_in_flight:
                self._in_flight.popleft().block_until_ready()
        return new_state, aux


def _placed_batch(
    entry: _Entry, arrays: list[Any], batch: Any, *, rows: NamedSharding
) -> list[Any]:
    """The batch's arrays where `entry`'s compiled function takes them (`rows`:
    the sharding of the batch's rows). Host arrays are left to `jit`, which
    moves them; arrays already on the mesh in another layout are moved here
    (`jit` would reject them); in a multi-process run each process's host rows
    are assembled by `shard_batch`."""
    if not rows.is_fully_addressable:
        if all(isinstance(x, jax.Array) for x in arrays):
            return arrays
        placed = jax.tree.leaves(shard_batch(batch, rows))
        # Rows placed; a context axis then splits the sequences (the
        # compiled step's `in_shardings` would reject them as they are).
        return [
            _resharded(placed[i], want)
            for i, want in zip(entry.batch_arrays, entry.shardings[2], strict=True)
        ]
    out = arrays
    for j, (x, want) in enumerate(zip(arrays, entry.shardings[2], strict=True)):
        if (
            isinstance(x, jax.Array)
            and x.committed
            and x.sharding != want
            and not x.sharding.is_equivalent_to(want, x.ndim)
        ):
            out = list(out) if out is arrays else out
            out[j] = jax.device_put(x, want)
    return out


def _resharded(x: Any, want: NamedSharding) -> Any:
    """`x` (a global array, possibly over several processes) laid out as `want`,
    moved as the single-process path moves a batch in another layout (a fresh
    `jax.jit` here would compile again on every step)."""
    if x.sharding.is_equivalent_to(want, x.ndim):
        return x
    return jax.device_put(x, want)
