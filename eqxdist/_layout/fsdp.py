"""Fully sharded data parallelism (FSDP, ZeRO-3): every large parameter is split over
the devices of the data axis, all-gathered just before it is used, and its gradient
is reduce-scattered back to the shards.

All layouts come from the one rule of `fsdp_specs`; the functions here act on
a parameter pytree together with its specs, inside `jax.shard_map`.
"""

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from .._data_parallel import place
from .._utils import (
    check_axis_bound,
    check_axis_in_mesh,
    check_mesh,
    check_min_weight_size,
    is_array,
    path_str,
    typecheck,
)
from .rules import (
    DEFAULT_LAYOUT,
    FsdpRule,
    SelfGathering,
    check_layout,
    fsdp_specs,
    is_spec_leaf,
    leaf_plan,
    merge_specs,
    restrict,
    sharded_dim,
    spec_axes,
)


def _spec_leaves(
    tree: Any, specs: Any, caller: str, argument: str
) -> tuple[list[Any], list[Any], Any]:
    """Flatten `tree` and `specs` side by side, with a clear error when they differ.

    `specs` leads (a `PartitionSpec` or `None` per leaf), so `tree` may hold `None`
    where `specs` has a spec: gradients of non-differentiable leaves are `None`."""
    spec_def: Any
    with_path, spec_def = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=is_spec_leaf
    )
    try:
        leaves = spec_def.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{caller}: `specs` do not match the structure of `{argument}`; build "
            f"them from the same tree (e.g. with `fsdp_specs`). Details: {e}"
        ) from None
    spec_leaves = [s for _, s in with_path]
    paths = [path_str(p) for p, _ in with_path]
    for path, leaf, spec in zip(paths, leaves, spec_leaves, strict=True):
        if not is_array(leaf):
            continue
        if not isinstance(spec, P):
            raise ValueError(
                f"{caller}: `{argument}` leaf {path} is an array of shape "
                f"{jnp.shape(leaf)} but its spec is {spec!r}; expected a "
                "PartitionSpec."
            )
        if len(spec) > jnp.ndim(leaf):
            raise ValueError(
                f"{caller}: spec {spec} of leaf {path} has {len(spec)} entries but "
                f"the leaf has shape {jnp.shape(leaf)}; expected at most "
                f"{jnp.ndim(leaf)}."
            )
    return leaves, spec_leaves, spec_def


@typecheck
def shard_params(
    params: PyTree[Any], axis_name: str = "data", min_weight_size: int = 2**18
) -> tuple[PyTree[Any], PyTree[Any]]:
    """Keep only this device's shard of each large parameter, inside `jax.shard_map`.

    For parameters that arrive replicated (the same full value on every device), e.g.
    freshly initialised ones. Each leaf is split as `fsdp_specs` says; this device
    keeps the block at its index along `axis_name`.

    **Arguments:**

    - `params`: a pytree of replicated arrays (an Equinox model works; non-array
      leaves pass through).
    - `axis_name`: the mesh axis to shard over.
    - `min_weight_size`: leaves with at most this many elements stay whole.

    **Returns:**

    `(local_shards, specs)`: the local pytree and the `PartitionSpec`s (of the full
    parameters) that `gather_params`, `sync_gradients` and `out_specs` take.

    **Raises:**

    `ValueError` if `axis_name` is not bound (called outside `shard_map`).

    !!! Example

        ```python
        def init(params):
            shards, specs = ed.shard_params(params, "data", min_weight_size=2**4)
            return shards
        ```
    """
    (name,) = check_axis_bound(axis_name, "shard_params")
    size = jax.lax.axis_size(name)
    specs = fsdp_specs(params, size, axis_name=name, min_weight_size=min_weight_size)
    index = jax.lax.axis_index(name)

    def split(x: Any, spec: Any) -> Any:
        dim = sharded_dim(spec, name) if is_array(x) else None
        if dim is None:
            return x
        block = x.shape[dim] // size
        return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=dim)

    return jax.tree.map(split, params, specs), specs


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x: jax.Array, dim: int, axis_name: str) -> jax.Array:
    full: jax.Array = jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)
    return full


def _gather_fwd(x: jax.Array, dim: int, axis_name: str) -> tuple[jax.Array, None]:
    return _gather(x, dim, axis_name), None


def scatter_mean(g: jax.Array, dim: int, axis_name: str) -> jax.Array:
    """Inside `shard_map`: the mean over `axis_name` of every device's `g`, each
    device keeping its block along `dim` (a reduce-scatter)."""
    size = jax.lax.axis_size(axis_name)
    scattered = jax.lax.psum_scatter(g, axis_name, scatter_dimension=dim, tiled=True)
    mean: jax.Array = scattered / size
    return mean


def _gather_bwd(dim: int, axis_name: str, _: None, g: jax.Array) -> tuple[jax.Array]:
    # Each device's cotangent is its own gradient of the full parameter; summing
    # them onto the owning shard and dividing gives the data-parallel mean.
    return (scatter_mean(g, dim, axis_name),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather_leaf(x: jax.Array, dim: int, axis_name: str) -> jax.Array:
    """All-gather one shard along `dim`; gradient: mean over the axis, scattered."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return _gather(x, dim, axis_name)
    full: jax.Array = jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)
    return full


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_all(xs: list[jax.Array], dims: tuple[int, ...], axis_name: str) -> Any:
    return [
        jax.lax.all_gather(x, axis_name, axis=d, tiled=True)
        for x, d in zip(xs, dims, strict=True)
    ]


def _gather_all_fwd(
    xs: list[jax.Array], dims: tuple[int, ...], axis_name: str
) -> tuple[Any, None]:
    return _gather_all(xs, dims, axis_name), None


def _gather_all_bwd(
    dims: tuple[int, ...], axis_name: str, _: None, gs: list[jax.Array]
) -> tuple[list[jax.Array]]:
    # The gradients of all the leaves in one reduce-scatter per dtype: each full
    # gradient as rows of the device blocks of its sharded dimension, the rows of
    # every leaf side by side, so that device i's block of every leaf lands on
    # device i. One collective instead of one per leaf matters where each costs a
    # synchronisation of every device (XLA:CPU, which combines no reduce-scatters).
    size = jax.lax.axis_size(axis_name)
    moved = [jnp.moveaxis(g, d, 0) for g, d in zip(gs, dims, strict=True)]
    rows = [m.reshape(size, -1) for m in moved]
    out: list[Any] = [None] * len(gs)
    for dtype in sorted({r.dtype for r in rows}, key=str):
        which = [i for i, r in enumerate(rows) if r.dtype == dtype]
        flat = jnp.concatenate([rows[i] for i in which], axis=1)
        mean = scatter_mean(flat, 0, axis_name)[0]
        ends = list(itertools.accumulate(rows[i].shape[1] for i in which))
        for i, part in zip(which, jnp.split(mean, ends[:-1]), strict=True):
            block = part.reshape(moved[i].shape[0] // size, *moved[i].shape[1:])
            out[i] = jnp.moveaxis(block, 0, dims[i])
    return (out,)


_gather_all.defvjp(_gather_all_fwd, _gather_all_bwd)


# The largest full gradient `gather_tree(combined=True)` puts into the combined
# reduce-scatter. Combining saves a synchronisation of every device per leaf but
# copies the leaf's full gradient into one buffer: a win for small leaves (a
# transformer's), a loss for large ones, whose own reduce-scatters already take
# far longer than the synchronisation and whose copies double the temporaries
# (measured in docs/benchmarks.md, "FSDP on the transformer").
COMBINE_MAX_BYTES = 2**20


def gather_tree(
    params: PyTree[Any],
    specs: PyTree[Any],
    axis_name: str,
    *,
    combined: bool,
) -> PyTree[Any]:
    """`gather_params`; `combined=True` reduce-scatters the gradients of the
    floating-point leaves of at most `COMBINE_MAX_BYTES` together (one collective
    per dtype, which needs their full gradients at once: for a step that holds them
    all anyway, as one that gathers once per step does)."""
    size = jax.lax.axis_size(axis_name)
    leaves, spec_leaves, spec_def = _spec_leaves(
        params, specs, "gather_params", "params"
    )
    out = list(leaves)
    together: list[tuple[int, int]] = []
    for i, (leaf, spec) in enumerate(zip(leaves, spec_leaves, strict=True)):
        dim = sharded_dim(spec, axis_name) if is_array(leaf) else None
        if dim is None:
            continue
        small = leaf.size * size * leaf.dtype.itemsize <= COMBINE_MAX_BYTES
        if combined and small and jnp.issubdtype(leaf.dtype, jnp.inexact):
            together.append((i, dim))
        else:
            out[i] = gather_leaf(leaf, dim, axis_name)
    if together:
        full = _gather_all(
            [leaves[i] for i, _ in together], tuple(d for _, d in together), axis_name
        )
        for (i, _), x in zip(together, full, strict=True):
            out[i] = x
    return jax.tree.unflatten(spec_def, out)


@typecheck
def gather_params(
    params: PyTree[Any], specs: PyTree[Any], axis_name: str = "data"
) -> PyTree[Any]:
    """All-gather every parameter that `specs` shards over `axis_name`, inside
    `jax.shard_map`, so the model can run with full weights.

    The backward pass is a reduce-scatter divided by the axis size: each shard
    receives the *mean* over devices of the gradient of its block, exactly what a
    data-parallel step gets from `lax.pmean` of full gradients. So an FSDP step needs
    no further reduction for sharded leaves (see `sync_gradients`).

    **Arguments:**

    - `params`: this device's shards (as returned by `shard_params`, or the inside
      of a `shard_map` whose `in_specs` are `specs`). Non-array leaves pass through.
    - `specs`: the `PartitionSpec` of each leaf's *full* array, e.g. from
      `fsdp_specs`. A leaf may be sharded on any dimension.
    - `axis_name`: the mesh axis to gather over.

    **Returns:**

    `params` with every leaf sharded over `axis_name` gathered to full size.

    **Raises:**

    `ValueError` if `axis_name` is not bound, or if `specs` do not match `params`
    (structure, or a spec with more entries than its leaf has dimensions).

    !!! Example

        ```python
        def loss(shards, x):
            model = ed.gather_params(shards, specs)
            return jnp.mean(model(x) ** 2)
        ```
    """
    (name,) = check_axis_bound(axis_name, "gather_params")
    return gather_tree(params, specs, name, combined=False)


def unsynced_axes(spec: Any, axis_names: tuple[str, ...]) -> tuple[str, ...]:
    """The axes of `axis_names` over which the gradient of a leaf laid out by
    `spec` is still a per-device value (`sync_gradients` averages over them): the
    ones `spec` does not shard over, whose gather already averaged."""
    names = spec_axes(spec)
    return tuple(a for a in axis_names if a not in names)


@typecheck
def sync_gradients(
    grads: PyTree[Any],
    specs: PyTree[Any],
    axis_names: str | Sequence[str] = ("data",),
) -> PyTree[Any]:
    """Average gradients across devices where they are not averaged yet, inside
    `jax.shard_map` (with `check_vma=False`, as in the training steps).

    Gradients of replicated leaves are per-device values and are `pmean`-ed over all
    of `axis_names`; gradients of leaves sharded over some of the names (which
    `gather_params` already averaged over those) are `pmean`-ed over the others only.

    **Arguments:**

    - `grads`: the gradient pytree; `None` leaves (non-differentiable parameters)
      and other non-array leaves pass through.
    - `specs`: the parameters' `PartitionSpec`s (as for `gather_params`).
    - `axis_names`: every mesh axis the batch is split over.

    **Raises:**

    `ValueError` if an axis is not bound or `specs` do not match `grads`.

    !!! Example

        ```python
        grads = ed.sync_gradients(grads, specs, ("data",))
        ```
    """
    axis_names = check_axis_bound(
        axis_names if isinstance(axis_names, str) else tuple(axis_names),
        "sync_gradients",
    )
    leaves, spec_leaves, spec_def = _spec_leaves(
        grads, specs, "sync_gradients", "grads"
    )

    def sync(g: Any, spec: Any) -> Any:
        if not is_array(g):
            return g
        rest = unsynced_axes(spec, axis_names)
        return jax.lax.pmean(g, rest) if rest else g

    out = [sync(g, s) for g, s in zip(leaves, spec_leaves, strict=True)]
    return jax.tree.unflatten(spec_def, out)


# `FSDP(..., remat=True)` keeps only matrix-product results (activations) for the
# backward pass; everything else, the gathered parameters and any casts of them
# included, is recomputed from the shards. (A policy that only refuses to save the
# gathered values would save the identical output of the gather's custom VJP.)
REMAT_POLICY = jax.checkpoint_policies.dots_saveable


# XLA:CPU removes optimization barriers early (before its last CSE pass and before
# scheduling), which would let it hoist every `FSDP` module's all-gather to the
# start of the step and merge rematerialised all-gathers back into the forward
# ones. Keeping the barriers makes `FSDP` modules behave on CPU as on GPU and TPU.
CPU_FSDP_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def axis_is_bound(axis_name: str) -> bool:
    """Whether `axis_name` is bound here (inside `shard_map` over it)."""
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return False
    return True


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
