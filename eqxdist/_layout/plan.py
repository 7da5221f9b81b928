"""The model plan: where every leaf of a model lives under a step's layout, and what
the step's `jax.shard_map` does with it, computed once per model structure.

A step asks three questions of a model (its specs, the part of them `shard_map`
handles by hand, and what the step all-gathers); `ModelPlan` answers all three from
one pass over the names-to-axes rules (`rules`); `Layout.plan` keeps one plan per
structure, shapes and dtypes.
"""

import dataclasses
import math
import warnings
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec as P

from .._utils import is_array, is_array_like, path_str
from .collectives import gather_tree, scatter_mean, unsynced_axes
from .partitioned import KeyPath, linear_paths
from .pipeline import StagePlan, to_chunk_order
from .rules import (
    FsdpRule,
    ParamRules,
    is_spec_leaf,
    leaf_plan,
    restrict,
    sharded_dim,
    spec_axes,
)

WEIGHT = jax.tree_util.GetAttrKey("weight")


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """The layout of one model structure; each field is a pytree of the model's
    structure with a `PartitionSpec` at every array leaf (`None` elsewhere).

    - `specs`: where each leaf lives (data, FSDP and rule axes).
    - `manual`: `specs` restricted to the data axes, the `in_specs`/`out_specs` of
      the step's `shard_map` (which is manual over the data axes only; the rule
      axes stay with XLA).
    - `gather`: the specs with which the step all-gathers the model inside
      `shard_map` (`fsdp_axis` only; `None` without FSDP).
    - `scatter`: under ZeRO-1, the data-axis specs of the gradients as they leave
      `shard_map`: reduce-scattered over `fsdp_axis` where the optimizer state
      is sharded, so each device updates its share; `None` otherwise (gradients
      leave as `manual` says).
    - `linears`: the key paths of the `eqx.nn.Linear` layers whose computation
      FSDP can partition instead of gathering their weights (`_partition`): the
      weight is the step's to gather and is sharded over `fsdp_axis` alone, on
      its output features.
    """

    specs: Any
    manual: Any
    gather: Any
    fsdp_axis: str | None
    scatter: Any = None
    linears: tuple[KeyPath, ...] = ()
    stages: StagePlan | None = None

    def in_stage_order(self, tree: Any, *, inverse: bool = False) -> Any:
        """`tree` (laid out like the model, `None` allowed at leaves) with the
        circular pipeline's `Stacked` leaves in chunk order along the layer axis
        (`pipeline.stage_order`), so that each stage's block holds its chunks
        (`inverse`: back to the natural order); `tree` itself otherwise. On
        global arrays, outside the step's `shard_map`: one collective per leaf."""
        stages = self.stages
        if stages is None or stages.pipeline.repeats == 1:
            return tree

        def permute(spec: P | None, x: Any) -> Any:
            staged = isinstance(spec, P) and len(spec) and spec[0] == stages.axis
            if not (staged and is_array(x)):
                return x
            return to_chunk_order(x, stages, inverse=inverse)

        return jax.tree.map(permute, self.specs, tree, is_leaf=is_spec_leaf)

    @property
    def grad_specs(self) -> Any:
        """The `out_specs` of the gradients of the step's `shard_map`."""
        return self.manual if self.scatter is None else self.scatter

    def sum_gradients(self, grads: Any, axes: tuple[str, ...]) -> Any:
        """Inside the step's `shard_map`: each device's gradients summed over the
        data `axes` where they are not averaged yet (`sync_gradients` without its
        division: `mean_counts` gives the divisors), and under ZeRO-1 first
        reduce-scattered (and averaged) to the optimizer state's shards, so the
        update runs on the shards (this reduce-scatter and the all-gather of the
        updated parameters move what data parallelism's all-reduce moves).

        The step divides by the counts in its update, where XLA fuses the
        division into the optimizer's own pass over the gradients; divided here,
        the mean is written out in full whenever it enters a loop (the update of
        `skip_nonfinite` runs in one)."""
        if self.scatter is None or self.fsdp_axis is None:
            return _sum_unsynced(grads, self.manual, axes)
        axis = self.fsdp_axis

        def scatter(spec: P | None, manual: P | None, g: Any) -> Any:
            dim = sharded_dim(spec, axis) if is_array(g) else None
            if dim is None or axis in spec_axes(manual):
                # A gradient already of its shard (an expert weight's) stays.
                return g
            return scatter_mean(g, dim, axis)

        # The specs lead: gradients of frozen leaves are `None` where specs are not.
        scattered = jax.tree.map(
            scatter,
            self.scatter,
            self.manual,
            grads,
            is_leaf=is_spec_leaf,
        )
        return _sum_unsynced(scattered, self.scatter, axes)

    def mean_counts(self, mesh: Mesh, axes: tuple[str, ...]) -> Any:
        """The number of devices `sum_gradients` adds each leaf's gradient up
        over (1 where it only averages): a tree like `grad_specs`, with an `int`
        at each array leaf."""

        def count(spec: P | None) -> int | None:
            if spec is None:
                return None
            return int(math.prod(mesh.shape[a] for a in unsynced_axes(spec, axes)))

        return jax.tree.map(count, self.grad_specs, is_leaf=is_spec_leaf)

    def gathered(
        self,
        tree: Any,
        *,
        combined: bool = False,
        partitioned: frozenset[KeyPath] = frozenset(),
    ) -> Any:
        """Inside the step's `shard_map`: `tree`'s FSDP shards all-gathered as
        `gather` says (`combined`: their gradients reduce-scattered in one
        collective per dtype, see `gather_tree`), except the weights of the
        `partitioned` layers (of `linears`), which stay sharded; `tree` itself
        without FSDP."""
        if self.gather is None or self.fsdp_axis is None:
            return tree
        specs = self.gather
        if partitioned:
            weights = {(*path, WEIGHT) for path in partitioned}
            specs = jax.tree_util.tree_map_with_path(
                lambda path, s: P() if path in weights else s,
                specs,
                is_leaf=is_spec_leaf,
            )
        return gather_tree(tree, specs, self.fsdp_axis, combined=combined)


def _sum_unsynced(grads: Any, specs: Any, axes: tuple[str, ...]) -> Any:
    """Inside `shard_map`: `grads` summed over the `axes` each leaf's `specs` leave
    unsynced (`unsynced_axes`): `sync_gradients` before its division."""

    def add(spec: P | None, g: Any) -> Any:
        if not is_array(g):
            return g
        rest = unsynced_axes(spec, axes)
        return jax.lax.psum(g, rest) if rest else g

    return jax.tree.map(add, specs, grads, is_leaf=is_spec_leaf)


def plan_model(
    model: Any,
    *,
    data_axes: tuple[str, ...],
    fsdp: FsdpRule | None,
    rules: ParamRules,
    caller: str,
    zero1: FsdpRule | None = None,
) -> ModelPlan:
    """The plan of `model` when its leaves are sharded by `fsdp` (`None`: not at all
    over the data axes) and `rules` over the other axes; under ZeRO-1 (`zero1`:
    the FSDP rule of the optimizer state) the gradients leave `shard_map` sharded
    as the optimizer state is.

    A leaf the step gathers that is sharded over rule axes too enters `shard_map`
    unsharded over the data axes: XLA's partitioner replicates the operand of a
    collective over the manual (data) axes across the automatic (rule) axes, so an
    FSDP all-gather inside `shard_map` would gather such a leaf over the rule axes
    as well, undoing tensor parallelism (every device would hold and multiply whole
    weights). Gathered at the `shard_map` boundary instead, XLA gathers it over the
    data axes only, keeping the rule axes sharded; its gradient is then averaged
    with an all-reduce over the data axes, and the update keeps its FSDP shard."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(model)
    leaves = [x for _, x in with_path]
    paths = [path_str(p) for p, _ in with_path]
    rule_specs = rules.match(paths, leaves)
    return _plan_model(
        model, with_path, rule_specs, data_axes, fsdp, caller, zero1, treedef
    )


def _plan_model(
    model: Any,
    with_path: list[Any],
    rule_specs: Any,
    data_axes: tuple[str, ...],
    fsdp: FsdpRule | None,
    caller: str,
    zero1: FsdpRule | None,
    treedef: Any,
) -> ModelPlan:
    leaves = [x for _, x in with_path]
    paths = [path_str(p) for p, _ in with_path]
    if fsdp is None:
        specs = [
            (r or P()) if is_array_like(x) else None
            for x, r in zip(leaves, rule_specs, strict=True)
        ]
        manual = [restrict(s, data_axes) for s in specs]
        scatter = None
        if zero1 is not None:
            scatter = jax.tree.unflatten(
                treedef,
                [
                    None
                    if s is None
                    else restrict(zero1.spec(tuple(x.shape), s), data_axes)
                    for x, s in zip(leaves, specs, strict=True)
                ],
            )
        return ModelPlan(
            jax.tree.unflatten(treedef, specs),
            jax.tree.unflatten(treedef, manual),
            None,
            None if zero1 is None else zero1.axis_name,
            scatter,
        )
    specs, own = leaf_plan(model, fsdp, rule_specs, paths, caller)
    warn_if_unsharded(specs, leaves, fsdp, caller, "strategy='fsdp'", "parameter")
    boundary = [
        o and s is not None and bool(spec_axes(s) - set(data_axes))
        for s, o in zip(specs, own, strict=True)
    ]
    manual = [
        P() if b else restrict(s, data_axes)
        for s, b in zip(specs, boundary, strict=True)
    ]
    gather = [
        restrict(s, (fsdp.axis_name,))
        if o and s is not None and not b
        else (P() if s is not None else None)
        for s, o, b in zip(specs, own, boundary, strict=True)
    ]

    # A layer's weight qualifies where it is exactly `P(fsdp_axis)` on its output
    # features (rows), in `specs` and `gather` alike: no rule axis, not gathered
    # by a module of its own or at the boundary.
    def rows_only(spec: P | None) -> bool:
        axis = fsdp.axis_name
        return sharded_dim(spec, axis) == 0 and spec_axes(spec) == {axis}

    by_path = {
        p: rows_only(s) and rows_only(g)
        for (p, _), s, g in zip(with_path, specs, gather, strict=True)
    }
    linears = tuple(
        path for path in linear_paths(model) if by_path.get((*path, WEIGHT), False)
    )
    return ModelPlan(
        jax.tree.unflatten(treedef, specs),
        jax.tree.unflatten(treedef, manual),
        jax.tree.unflatten(treedef, gather),
        fsdp.axis_name,
        linears=linears,
    )


def warn_if_unsharded(
    specs: list[P | None],
    leaves: list[Any],
    rule: FsdpRule,
    caller: str,
    strategy: str,
    what: str,
) -> None:
    """A `UserWarning` when a strategy asked to shard over `rule.axis_name`
    shards nothing (every leaf at or under `min_weight_size`): the user asked
    for FSDP (ZeRO-1) and would silently get data parallelism's memory."""
    sizes = [math.prod(x.shape) for x in leaves if is_array_like(x)]
    if not sizes or any(rule.axis_name in spec_axes(s) for s in specs):
        return
    largest = max(sizes)
    if largest > rule.min_weight_size:
        why = (
            f"no dimension of its arrays of more than min_weight_size="
            f"{rule.min_weight_size:,} elements is divisible by the "
            f"{rule.axis_size} devices of {rule.axis_name!r}"
        )
    else:
        why = (
            f"its largest array has {largest:,} elements, not more than "
            f"min_weight_size={rule.min_weight_size:,} (arrays this small stay "
            "replicated, as under 'dp'); pass a smaller `min_weight_size` (e.g. "
            f"{_smaller(largest)}) to shard them"
        )
    warnings.warn(
        f"{caller}: {strategy} shards no {what} of this model over "
        f"{rule.axis_name!r}: {why}.",
        stacklevel=2,
    )


def _smaller(size: int) -> str:
    # A power of two under the largest array, so that it is sharded.
    return f"2**{max(0, (size - 1).bit_length() - 1)}"


def structure_key(tree: Any) -> Any:
    """What a plan depends on: the tree structure and every array leaf's shape and
    dtype."""
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple((tuple(x.shape), str(x.dtype)) for x in leaves if is_array_like(x))
    return treedef, shapes
