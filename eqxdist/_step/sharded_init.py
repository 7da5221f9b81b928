"""Building a train state straight into its shardings (`TrainStep.init_state`), a
group of leaves at a time.

One `jax.jit` of the whole initialiser draws every layer's random numbers in the
same program, and XLA may schedule them side by side: on CPU its default scheduler
keeps each layer's random-number working arrays alive together, about one
parameter shard per layer on top of the state. Built as a few programs, each
returning a run of consecutive leaves (XLA drops the rest of the initialiser from
each), a device holds at most the leaves already built, one group's leaves and one
group's working arrays. A small state (`MIN_GROUP_BYTES` per device) is one
program: each group is a compilation of its own.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from .._utils import is_array, is_array_like, strong_types
from .state import TrainState

INIT_GROUPS = 8
"""Groups of leaves `init_state` builds the state in, each at most this fraction
of a device's share of the state (a larger leaf is a group of its own)."""

MIN_GROUP_BYTES = 2**20
"""The least a group may hold per device. Below it the grouping buys less than
half a MiB of peak memory (one program holds at most about 1.5x the share) and
costs a compilation per group, each about as long as the whole initialiser's
(0.4 s on CPU for the transformer example's): a state of at most this many bytes
per device is one program."""


def leaf_groups(
    sizes: Sequence[int],
    groups: int = INIT_GROUPS,
    min_bytes: int = MIN_GROUP_BYTES,
) -> list[list[int]]:
    """Consecutive runs of the indices of `sizes`, each adding up to at most
    `max(sum(sizes) / groups, min_bytes)` (or holding a single larger entry); an
    entry of size 0 (a key) joins the run before it."""
    budget = max(sum(sizes) / groups, min_bytes)
    out: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i, size in enumerate(sizes):
        if current and size and held + size > budget:
            out.append(current)
            current, held = [], 0
        current.append(i)
        held += size
    return [*out, current] if current else out


def _device_bytes(leaf: Any, sharding: Any) -> int:
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return 0  # a key: a few bytes
    return int(math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize)


@dataclasses.dataclass(frozen=True)
class ShardedInit:
    """`init_fn(*args)` as a few jitted programs (`programs`, in order), each
    building one group of the state's array leaves into its sharding."""

    programs: list[Any]
    dynamic: Any
    static: Any
    treedef: Any

    def lower(self) -> list[Any]:
        return [program.lower(self.dynamic) for program in self.programs]

    def __call__(self) -> Any:
        leaves: list[Any] = []
        for program in self.programs:
            # One group at a time: the next starts once this one's working arrays
            # are gone.
            leaves += jax.block_until_ready(program(self.dynamic))
        return eqx.combine(jax.tree.unflatten(self.treedef, leaves), self.static)


def sharded_init(
    caller: str,
    init_fn: Callable[..., Any],
    args: tuple[Any, ...],
    state_specs: Callable[[TrainState], Any],
    mesh: Mesh,
) -> ShardedInit:
    """`init_fn(*args)`, which must return a `TrainState`, built into the
    shardings `state_specs` gives its abstract value on `mesh`."""
    abstract = eqx.filter_eval_shape(init_fn, *args)
    if not isinstance(abstract, TrainState):
        raise TypeError(
            f"{caller}: `init_fn(*args)` must return an eqxdist.TrainState (e.g. "
            "`lambda key: ed.TrainState.create(Net(key), optimizer, key)`); it "
            f"returns {type(abstract).__name__}."
        )
    arrays, static = eqx.partition(abstract, is_array_like)
    shapes, treedef = jax.tree.flatten(arrays)
    # A sharding at each array leaf, `None` (no leaf) elsewhere: in leaf order.
    targets = jax.tree.leaves(
        jax.tree.map(
            lambda x, spec: NamedSharding(mesh, spec) if is_array_like(x) else None,
            abstract,
            state_specs(abstract),
            is_leaf=lambda x: x is None,
        )
    )
    dynamic, args_static = eqx.partition(args, is_array)

    def build(indices: list[int], dynamic: Any) -> list[Any]:
        state = strong_types(init_fn(*eqx.combine(dynamic, args_static)))
        leaves = jax.tree.leaves(eqx.filter(state, is_array))
        return [leaves[i] for i in indices]

    sizes = [_device_bytes(x, s) for x, s in zip(shapes, targets, strict=True)]
    programs = [
        jax.jit(
            functools.partial(build, indices),
            out_shardings=[targets[i] for i in indices],
        )
        for indices in leaf_groups(sizes)
    ]
    return ShardedInit(programs, dynamic, static, treedef)


def peak_bytes(lowered: Sequence[Any]) -> int:
    """The most bytes a device holds while the `lowered` programs of a
    `ShardedInit` run in turn: the outputs of those before, and one program's
    outputs and temporaries."""
    held = peak = 0
    for program in lowered:
        memory = program.compile().memory_analysis()
        out = memory.output_size_in_bytes
        peak = max(peak, held + out + memory.temp_size_in_bytes)
        held += out
    return peak
