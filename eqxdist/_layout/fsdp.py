"""Placing a model by FSDP's rule (fully sharded data parallelism, ZeRO-3):
`shard_model_state` for a whole state, and the `FSDP` module, whose large
parameters live split over the devices of the data axis and are all-gathered
just before it is called (`collectives.py`), their gradients reduce-scattered
back to the shards.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from .._data_parallel import place, replicate_params
from .._utils import (
    axis_is_bound,
    check_array_leaves,
    check_axis_in_mesh,
    check_mesh,
    check_min_weight_size,
    is_array,
    typecheck,
)
from .collectives import gather_leaf
from .rules import (
    DEFAULT_LAYOUT,
    FsdpRule,
    SelfGathering,
    check_layout,
    fsdp_specs,
    leaf_plan,
    merge_specs,
    restrict,
    sharded_dim,
    spec_axes,
)


@typecheck
def shard_model_state(
    state: PyTree[Any],
    mesh: Mesh,
    param_sharding: str = "replicate",
    *,
    axis_name: str | None = None,
    min_weight_size: int = 2**18,
) -> PyTree[Any]:
    """Place model state (parameters, optimizer state, a whole `TrainState`) on `mesh`.

    **Arguments:**

    - `state`: any pytree; non-array leaves are kept, so an `eqx.Module` in is the
      same `eqx.Module` type out.
    - `mesh`: the device mesh.
    - `param_sharding`: `"replicate"` gives every array leaf `P()` (data
      parallelism); `"shard"` applies the FSDP rule of `fsdp_specs` over `axis_name`
      (ZeRO-3 style state sharding).
    - `axis_name`: the axis to shard over with `"shard"`; default the mesh's first.
    - `min_weight_size`: with `"shard"`, leaves this small or smaller are replicated.

    **Raises:**

    `ValueError` for any other `param_sharding`, or an `axis_name` not in the mesh.

    !!! Example

        ```python
        model = ed.shard_model_state(model, mesh, "shard", min_weight_size=2**10)
        ```
    """
    check_array_leaves(state, "shard_model_state", "state")
    if param_sharding == "replicate":
        return replicate_params(state, mesh)
    if param_sharding != "shard":
        raise ValueError(
            f"shard_model_state: unknown param_sharding {param_sharding!r}; use "
            "'replicate' (data parallel) or 'shard' (FSDP)."
        )
    axis = mesh.axis_names[0] if axis_name is None else axis_name
    check_axis_in_mesh(mesh, axis, "shard_model_state", "axis_name")
    specs = fsdp_specs(
        state, mesh.shape[axis], axis_name=axis, min_weight_size=min_weight_size
    )
    return place(state, specs, mesh)


# `FSDP(..., remat=True)` keeps only matrix-product results (activations) for the
# backward pass; everything else, the gathered parameters and any casts of them
# included, is recomputed from the shards. (A policy that only refuses to save the
# gathered values would save the identical output of the gather's custom VJP.)
REMAT_POLICY = jax.checkpoint_policies.dots_saveable


def _typed_gathered(module: Any, axis_name: str) -> Any:
    """`module` with `axis_name` dropped from the types of its leaves where an
    `Explicit` mesh axis puts it there (`jax.sharding.reshard`: an all-gather,
    whose gradient is a reduce-scatter), so the wrapped module computes on full
    parameters under plain `jax.jit` as it does under an `Auto` mesh, where XLA
    decides. Leaves whose types name no such axis are kept as they are."""

    def gather(x: Any) -> Any:
        if not isinstance(x, jax.Array):  # tracers are `jax.Array`s too
            return x
        sharding = jax.typeof(x).sharding
        others = spec_axes(sharding.spec) - {axis_name}
        if len(others) == len(spec_axes(sharding.spec)):
            return x
        spec = restrict(sharding.spec, tuple(others)) or P()
        return jax.sharding.reshard(x, NamedSharding(sharding.mesh, spec))

    return jax.tree.map(gather, module)


class FSDP(SelfGathering):
    """Wrap an Equinox module so that its parameters live sharded over the data axis
    and are all-gathered only when it is called.

    - Inside `jax.shard_map` (the data axis bound), with this module's leaves
      passed in as shards (`in_specs=module.partition_specs()`, as
      `make_train_step(..., strategy="fsdp")` does), calling it all-gathers its
      large parameters (`gather_params`: the gradient is the data-parallel mean,
      reduce-scattered to the shards) and then calls the wrapped module. Leaves that
      arrive whole (e.g. under a data-parallel step) are used as they are.
    - Under plain `jax.jit` on global arrays, or eagerly, it just calls the wrapped
      module: XLA inserts the communication the shardings need.

    Wrapping each block of a deep model separately (rather than the whole model)
    means the forward pass holds one block's full parameters at a time: a block
    gathers only once its inputs exist, just before use. The backward pass needs
    them again: by default the gathered parameters are kept from the forward pass;
    with `remat=True` (ZeRO-3 with selective rematerialisation) only the block's
    matrix-product results are kept, and the backward pass gathers the parameters
    again and recomputes the rest of the block, so about one block's full
    parameters are alive at any time, for one more all-gather per block
    (`benchmarks/bench_memory.py` measures both on a deep MLP).

    To let a block's all-gather run while the previous block computes (prefetch,
    two blocks' full parameters alive), chain the blocks with `FSDPSequential`.

    !!! Example

        ```python
        blocks = [ed.FSDP(block, mesh, min_weight_size=2**16, remat=True)
                  for block in blocks]
        ```
    """

    module: Any
    axis_name: str = eqx.field(static=True)
    remat: bool = eqx.field(static=True)
    leaf_specs: tuple[P | None, ...] = eqx.field(static=True)
    gather_shapes: tuple[tuple[int, ...] | None, ...] = eqx.field(static=True)

    def __init__(
        self,
        module: Any,
        mesh: Mesh,
        *,
        axis_name: str = "data",
        min_weight_size: int = 2**18,
        remat: bool = False,
        layout: str = DEFAULT_LAYOUT,
    ) -> None:
        """**Arguments:**

        - `module`: any Equinox module (or pytree) whose `__call__` to wrap. It may
          itself contain `FSDP` or `Stacked` modules, which keep their own layout.
        - `mesh`: the device mesh; array leaves are placed on it, sharded by the
          rule of `fsdp_specs` over `axis_name`.
        - `axis_name`: the data axis parameters are sharded over.
        - `min_weight_size`: leaves with at most this many elements are replicated.
        - `remat`: re-gather the parameters in the backward pass instead of keeping
          them from the forward pass (less memory, one more all-gather).
        - `layout`: `"leading"` (the default, as `make_train_step`'s:
          contiguous shards, no transposing copies around the collectives) or
          `"largest"` (`fsdp_specs`' rule); see `fsdp_specs`.

        **Raises:**

        `TypeError` if `mesh` is not a `jax.sharding.Mesh`; `ValueError` if
        `axis_name` is not an axis of `mesh`, `min_weight_size` is negative,
        `layout` is unknown, or it is built inside `jax.shard_map` (build it
        outside and pass it in).
        """
        check_mesh(mesh, "FSDP")
        check_axis_in_mesh(mesh, axis_name, "FSDP", "axis_name")
        check_min_weight_size(min_weight_size, "FSDP")
        check_layout(layout, "FSDP")
        if axis_is_bound(axis_name):
            raise ValueError(
                f"FSDP: built inside `jax.shard_map` (mesh axis {axis_name!r} is "
                "bound here), where `module`'s arrays are per-device values that "
                "cannot be placed on the mesh. Build the FSDP module outside, once, "
                "and pass it in with `in_specs=module.partition_specs()` (or let "
                "make_train_step(..., strategy='fsdp') do it)."
            )
        specs, own = leaf_plan(
            module, FsdpRule(axis_name, mesh.shape[axis_name], min_weight_size, layout)
        )
        leaves = jax.tree.leaves(module)
        self.leaf_specs = tuple(specs)
        self.gather_shapes = tuple(
            tuple(x.shape) if o and sharded_dim(s, axis_name) is not None else None
            for x, s, o in zip(leaves, specs, own, strict=True)
        )
        self.module = place(
            module, jax.tree.unflatten(jax.tree.structure(module), specs), mesh
        )
        self.axis_name = axis_name
        self.remat = remat

    def _own_specs(
        self,
        fsdp: FsdpRule,
        rules: Sequence[P | None],
        paths: Sequence[str],
        caller: str,
    ) -> list[P | None]:
        """This module's own specs (it keeps the layout it was built with), with
        the axes of its leaves' parameter rules added."""
        if fsdp.axis_name != self.axis_name:
            raise ValueError(
                f"A nested FSDP module shards over axis {self.axis_name!r}, but "
                f"its parent uses {fsdp.axis_name!r}; use one data axis."
            )
        return [
            merge_specs(rule, own, path, caller)
            for rule, own, path in zip(rules, self.leaf_specs, paths, strict=True)
        ]

    def partition_specs(self) -> PyTree[Any]:
        """The `PartitionSpec` of every array leaf of this module (`None` for other
        leaves), as a pytree of this module's structure: the `in_specs`/`out_specs`
        for passing it through `jax.shard_map`."""
        return jax.tree.unflatten(jax.tree.structure(self), list(self.leaf_specs))

    def _gather_plan(self) -> list[int | None]:
        """Inside `shard_map`: per leaf of `self.module`, the dimension to gather it
        on, or `None` (not sharded here, or arrived whole)."""
        leaves = jax.tree.leaves(self.module)
        size = jax.lax.axis_size(self.axis_name)
        plan: list[int | None] = []
        for leaf, spec, shape in zip(
            leaves, self.leaf_specs, self.gather_shapes, strict=True
        ):
            dim = sharded_dim(spec, self.axis_name)
            if shape is None or dim is None or tuple(leaf.shape) == shape:
                plan.append(None)
                continue
            shard = (*shape[:dim], shape[dim] // size, *shape[dim + 1 :])
            if tuple(leaf.shape) != shard:
                raise ValueError(
                    f"FSDP: a parameter of global shape {shape} arrived with shape "
                    f"{tuple(leaf.shape)}; expected the whole array or its shard "
                    f"{shard} (pass the module into shard_map with "
                    "`in_specs=module.partition_specs()`)."
                )
            plan.append(dim)
        return plan

    def _call_gathered(
        self,
        module: Any,
        plan: list[int | None],
        args: Any,
        kwargs: Any,
        *,
        tie_to_inputs: bool,
    ) -> Any:
        """Gather `module`'s (this module's, or a copy whose shards went through an
        optimization barrier) sharded leaves as `plan` says and call it.
        `tie_to_inputs`: gather only once `args`/`kwargs` exist."""
        treedef = jax.tree.structure(module)

        def call(module: Any, args: Any, kwargs: Any) -> Any:
            leaves = jax.tree.leaves(module)
            shards = [x for x, dim in zip(leaves, plan, strict=True) if dim is not None]
            inputs, static = eqx.partition((args, kwargs), is_array)
            if tie_to_inputs:
                # Gather only once the inputs exist, i.e. just before use:
                # otherwise XLA may hoist every block's all-gather to the start of
                # the step and hold all the full parameters at once.
                shards, inputs = jax.lax.optimization_barrier((shards, inputs))
            gathered = iter(shards)
            full = [
                x if dim is None else gather_leaf(next(gathered), dim, self.axis_name)
                for x, dim in zip(leaves, plan, strict=True)
            ]
            args, kwargs = eqx.combine(inputs, static)
            return jax.tree.unflatten(treedef, full)(*args, **kwargs)

        if self.remat:
            call = eqx.filter_checkpoint(call, policy=REMAT_POLICY)
        return call(module, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module with full parameters (gathered if sharded)."""
        if not axis_is_bound(self.axis_name):
            return _typed_gathered(self.module, self.axis_name)(*args, **kwargs)
        plan = self._gather_plan()
        if all(dim is None for dim in plan):
            return self.module(*args, **kwargs)
        return self._call_gathered(self.module, plan, args, kwargs, tie_to_inputs=True)
