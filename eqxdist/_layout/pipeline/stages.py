"""How a pipelined `Stacked` is called in a step: the stack the loss sees
(`PipelinedStack`, which runs the GPipe and circular schedules on the engine,
and `MarkedStack`, which marks where the 1F1B schedule cuts the loss), and the
per-step move of a circular pipeline's chunks (`to_chunk_order`). `pipeline`
holds the configuration and the layout, `schedules` every schedule's table,
`engine` the loop that runs a table and the layers of one stage.

**Where the stages run.** The loss is written as for one device (or one data
shard). When it calls the pipelined `Stacked` on its rows under `jax.vmap` (as
`jax.vmap(model)(x)` does), a `jax.custom_batching.custom_vmap` rule receives
the rows together; when it calls it on a batch (blocks that take `(rows, ...)`,
no `vmap`: `under_vmap` tells), the input's leading axis is the rows. Either
way the rows are cut into microbatches and the schedule runs with the stage
axis bound: in the device view the step's own `shard_map` binds it (each
stage holds its layers); in the global view the stack runs a `shard_map` of its
own over the stage and data axes. Activations move to the next stage
(`messages.exchange`); the last stage's output is given to every stage with one
all-reduce, so what comes after the `Stacked` (head, loss) runs as in the other
strategies, and JAX differentiates the whole: the backward pass of the
schedule's loop is the GPipe backward pass (all forwards, then all backwards).

**Circular** (`repeats = R > 1`): stage p holds the chunks of c = L/(P R)
layers p, p + P, ...; a microbatch goes round the ring R times. The state keeps
L/P consecutive layers per stage, so each step moves the chunks that change
stage there (`to_chunk_order`) and their gradients back. The loop runs the
table's R M + P - 1 forward slots for M microbatches: bubble (P - 1)/(R M + P -
1).
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..._utils import is_array
from ..experts import expert_axes, whole_loss
from ..remat import UNSET
from ..stack_aux import accumulator_shapes, block_aux, zeros
from ..stacked import Stacked, layer_function
from . import all_layers
from .config import StagePlan, where_fn
from .engine import ForwardEngine


class PipelinedStack(eqx.Module):
    """The pipelined `Stacked` as a step's loss sees it: called like the
    `Stacked` (`stack(x)`, `stack(x, key=key)`) on a device's rows under
    `jax.vmap`, it runs the schedule over the stage axis (see the module
    docstring). Called without `vmap` (blocks that take a batch), its input's
    leading axis is the rows: they are cut into microbatches the same way, and
    each block is called on a microbatch whole.

    - `stacked`: the `Stacked`, its leaves as the step has them: in the device
      view this stage's layers (in chunk order for the circular schedule, the
      step's `ModelPlan.to_stage_order`), in the global view all of them.
    - `plan`: the resolved pipeline.
    - `manual`: the data axes, which the schedule's own `shard_map` makes
      manual with the stage axis in the global view; `()` in the device view,
      where the step's `shard_map` binds both.
    - `remat`: what the backward pass keeps of each layer (normal form).
    - `gathered`: in the device view, `stacked` holds every stage's layers (the
      loss reads them outside the stack: `all_layers`); the schedule takes
      this stage's.
    """

    stacked: Stacked
    plan: StagePlan = eqx.field(static=True)
    manual: tuple[str, ...] = eqx.field(static=True)
    remat: Any = eqx.field(static=True)
    gathered: bool = eqx.field(static=True, default=False)

    def __call__(self, x: Any, *, key: Any = None) -> Any:
        # In the global view the schedule's own `shard_map` binds the data axes
        # and JAX differentiates it whole: an MoE's experts take the loss's
        # gradient there, not the device view's mean over the devices' losses.
        stacked = whole_loss(self.stacked) if self.manual else self.stacked
        if self.gathered:
            stacked = all_layers.own(stacked, self.plan)
        leaves, layer = layer_function(stacked, with_key=key is not None)

        if not under_vmap((x, key)):
            # Blocks that take a batch: `x`'s leading axis is the device's rows
            # (in the global view, the batch's), each block called on a
            # microbatch whole.
            micro = self.plan.pipeline.microbatches
            return self._run(
                layer, leaves, x, key, key_rows=False, micro=micro, per_row=False
            )

        def one_row(leaves: Any, x: Any, key: Any) -> Any:
            # Traced for the output's type only: an unbatched call never gets
            # here (above), a batched one runs the rule.
            aux = block_aux(layer, leaves, x, key, "pipeline")
            if aux is None:
                return x
            return x, zeros(aux, (self.plan.num_layers,))

        stack = jax.custom_batching.custom_vmap(one_row)

        @stack.def_vmap
        def rows(
            axis_size: int, in_batched: Any, leaves: Any, x: Any, key: Any
        ) -> tuple[Any, Any]:
            leaves_batched, x_batched, key_batched = in_batched
            if any(jax.tree.leaves(leaves_batched)):
                raise ValueError(
                    "pipeline: the pipelined Stacked's parameters are batched by "
                    "`jax.vmap`; vmap over the rows of its input only."
                )
            x = jax.tree.map(
                lambda a, b: a if b else jnp.broadcast_to(a, (axis_size, *a.shape)),
                x,
                x_batched,
            )
            key_rows = any(jax.tree.leaves(key_batched))
            micro = self.plan.pipeline.microbatches
            out = self._run(layer, leaves, x, key, key_rows=key_rows, micro=micro)
            return out, jax.tree.map(lambda _: True, out)

        return stack(leaves, x, key)

    def _run(
        self,
        layer: Callable[..., Any],
        leaves: list[Any],
        x: Any,
        key: Any,
        *,
        key_rows: bool,
        micro: int,
        per_row: bool = True,
    ) -> Any:
        """The schedule on `x`'s rows (its leading dimension) in `micro`
        microbatches (in the global view, each data shard's rows); each block
        called once per row (`per_row`, the loss's `vmap`) or on a whole
        microbatch."""
        plan, pipeline = self.plan, self.plan.pipeline
        stages, repeats = plan.stages, pipeline.repeats
        n = _rows(x, micro)
        data = self.manual
        if data:
            mesh = jax.sharding.get_abstract_mesh()
            n //= int(np.prod([mesh.shape[a] for a in data]))
        if n % micro:
            raise ValueError(
                f"pipeline: each device's {n} rows (of a minibatch) do not split "
                f"into microbatches={micro}; use a number of microbatches that "
                "divides them, or more rows per step."
            )
        if repeats > 1 and micro < stages:
            raise ValueError(
                f"pipeline: the forward pass of schedule={pipeline.schedule!r} "
                "(round the ring, as the circular schedule) needs at least as many "
                f"microbatches as stages ({micro} < {stages}): a microbatch coming "
                "round the ring must find its stage free."
            )
        aux = self._accumulator(
            layer, leaves, (x, key), key_rows=key_rows, per_row=per_row, rows=n // micro
        )
        engine = ForwardEngine(
            layer=layer,
            axis=plan.axis,
            stages=stages,
            microbatches=micro,
            repeats=repeats,
            num_layers=plan.num_layers,
            key_rows=key_rows,
            remat=self.remat,
            unroll=self.stacked.unroll,
            per_row=per_row,
            # In the global view the transpose of the schedule's own `shard_map`
            # sums the stages' input cotangents and splits the output's among
            # them (both replicated over the stage axis); in the step's, whose
            # transpose is never taken, the engine does both.
            sum_input=not self.manual,
            aux=aux,
            data=data,
        )
        if not self.manual:  # the device view: the step's shard_map binds the stages
            return engine(leaves, x, key)
        if repeats > 1:
            leaves = [to_chunk_order(a, plan) for a in leaves]
        row_spec = P(data[0] if len(data) == 1 else data) if data else P()
        out_specs: Any = jax.tree.map(lambda _: row_spec, x)
        if aux is not None:
            # The aux's rows: its first axis per row, its second on a batch.
            out_specs = (out_specs, row_spec if per_row else P(None, *row_spec))
        return jax.shard_map(
            engine,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(
                self._leaf_specs(),
                jax.tree.map(lambda _: row_spec, x),
                None if key is None else (row_spec if key_rows else P()),
            ),
            out_specs=out_specs,
            axis_names=frozenset({plan.axis, *data}),
            check_vma=False,
        )(leaves, x, key)

    def _leaf_specs(self) -> list[P]:
        """The stack's leaves in the global view's `shard_map`: their layer
        axis over the stages; an MoE's expert weights, split over a data axis
        (expert parallelism), also on their expert dimension, each device's
        block as the layer computes with it (never gathered)."""
        axes = expert_axes(eqx.filter(self.stacked.layers, is_array))
        return [
            P(self.plan.axis, a) if a in self.manual else P(self.plan.axis)
            for a in axes
        ]

    def _accumulator(
        self,
        layer: Callable[..., Any],
        leaves: list[Any],
        inputs: tuple[Any, Any],
        *,
        key_rows: bool,
        per_row: bool,
        rows: int,
    ) -> Any:
        """One microbatch's aux accumulator (`stack_aux.accumulator_shapes`)
        for blocks that return `(x, aux)`, else `None`: a shape-only trace of
        one block on one row (`per_row`) or on a microbatch of `rows` rows."""
        x, key = inputs

        def one(a: Any) -> Any:
            shape = a.shape[1:] if per_row else (rows, *a.shape[1:])
            return jax.ShapeDtypeStruct(shape, a.dtype)

        if key_rows:
            key = _one_row(key)
        aux = block_aux(layer, leaves, jax.tree.map(one, x), key, "pipeline")
        if aux is None:
            return None
        return accumulator_shapes(
            aux,
            rows=rows,
            num_layers=self.plan.num_layers,
            per_row=per_row,
            caller="pipeline",
        )


def _one_row(tree: Any) -> Any:
    """The shapes of one row of `tree`'s leaves (their leading axis)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)


def under_vmap(x: Any) -> bool:
    """Whether a leaf of `x` is batched by a `jax.vmap` inside the loss (the
    pipelined stack called on rows) or not (on a batch): a `custom_vmap` probe
    whose rule runs only then. Its input carries no tangent (`stop_gradient`),
    so that under differentiation it is no `custom_vmap` to linearize (which
    JAX cannot); its result is unused."""
    found: list[bool] = []

    def nothing(x: Any) -> Any:
        return jnp.zeros((), jnp.int32)

    probe = jax.custom_batching.custom_vmap(nothing)

    @probe.def_vmap
    def rule(axis_size: int, in_batched: Any, x: Any) -> tuple[Any, bool]:
        found.append(True)
        return jnp.zeros((), jnp.int32), False

    probe(jax.tree.map(jax.lax.stop_gradient, x))
    return bool(found)


def _rows(x: Any, micro: int) -> int:
    """The rows of the stack's input `x`: the leading size shared by its
    leaves."""
    sizes = {int(a.shape[0]) if jnp.ndim(a) else 0 for a in jax.tree.leaves(x)}
    if len(sizes) != 1 or 0 in sizes:
        shapes = [tuple(jnp.shape(a)) for a in jax.tree.leaves(x)]
        raise ValueError(
            "pipeline: the pipelined Stacked's input has leaves of shapes "
            f"{shapes}; every leaf needs the rows as its leading axis (one size), "
            f"which the schedule cuts into microbatches={micro}. Outside "
            "jax.vmap the leading axis is the rows; carry per-batch values in "
            "the blocks, or broadcast them over the rows."
        )
    (n,) = sizes
    return n


MARKER = "eqxdist_pipeline_stack"
"""The name of the `jax.jit` a `MarkedStack` leaves where the stack is called,
so the 1F1B schedule can cut the loss's program there."""


class MarkedStack(eqx.Module):
    """The pipelined `Stacked` as the 1F1B schedule's trace of the loss sees it:
    called on the loss's rows under `jax.vmap`, it returns its input through a
    `jax.jit` named `MARKER` (with its key as a second input) and records in
    `seen` the input's structure, whether the key is per row and whether the
    blocks take one row (`per_row`). Called without `vmap` (blocks that take a
    batch) it marks its input the same way, the rows its leading axis."""

    stacked: Stacked
    seen: "Seen" = eqx.field(static=True)

    def __call__(self, x: Any, *, key: Any = None) -> Any:
        seen = self.seen.values
        leaves, layer = layer_function(self.stacked, with_key=key is not None)
        layers = self.stacked.num_layers

        def mark(x: Any, key: Any, per_row: bool, aux: Any) -> Any:
            seen["x"] = jax.tree.structure(x)
            seen["key"] = None if key is None else jax.tree.structure(key)
            seen["per_row"] = per_row
            if aux is not None:
                aux = accumulator_shapes(
                    aux,
                    rows=_rows(x, 1),
                    num_layers=layers,
                    per_row=per_row,
                    caller="pipeline",
                )
            # The aux's accumulator, which the stages fill (`stack_aux`).
            seen["aux"] = aux

            def eqxdist_pipeline_stack(x: Any, key: Any) -> Any:
                return x if aux is None else (x, zeros(aux))

            return jax.jit(eqxdist_pipeline_stack)(x, key)

        if not under_vmap((x, key)):
            # Blocks that take a batch: `x`'s leading axis is the rows.
            seen["key_rows"] = False
            aux = block_aux(layer, leaves, x, key, "pipeline")
            return mark(x, key, per_row=False, aux=aux)

        def one_row(x: Any, key: Any) -> Any:
            aux = block_aux(layer, leaves, x, key, "pipeline")
            return x if aux is None else (x, zeros(aux, (layers,)))

        stack = jax.custom_batching.custom_vmap(one_row)

        @stack.def_vmap
        def rows(axis_size: int, in_batched: Any, x: Any, key: Any) -> tuple[Any, Any]:
            x_batched, key_batched = in_batched
            x = jax.tree.map(
                lambda a, b: a if b else jnp.broadcast_to(a, (axis_size, *a.shape)),
                x,
                x_batched,
            )
            key_rows = any(jax.tree.leaves(key_batched))
            seen["key_rows"] = key_rows
            row_key = _one_row(key) if key_rows else key
            aux = block_aux(layer, leaves, _one_row(x), row_key, "pipeline")
            out = mark(x, key, per_row=True, aux=aux)
            return out, jax.tree.map(lambda _: True, out)

        return stack(x, key)


class Seen:
    """What a `MarkedStack` saw (`values`: the input's and the key's
    structures, whether the key is per row); hashed by identity, as a static
    field."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}


def to_chunk_order(x: Any, plan: StagePlan, *, inverse: bool = False) -> Any:
    """A circular pipeline's `Stacked` leaf `x` (global, its layer axis sharded
    over the stage axis in contiguous blocks) with each stage's block holding its
    chunks p, p + P, ... in repeat order (`inverse`: back).

    The layer axis as `(R, P, c)` chunks, swapped to `(P, R, c)`, kept sharded
    over the stage axis: a transpose XLA's partitioner runs as all-to-alls
    (only the chunks that change stage move). It was P - 1 rounds of
    `ppermute` per leaf, a stage's chunks gathered and scattered by tables:
    on the 8 CPU devices, the `x @ W` benchmark's stack there and back took
    13.6 ms, this 6.2 ms (a gather along the sharded axis would all-gather
    the whole stack). On an Explicit stage axis, inside `auto_axes`, the
    result typed as `x`."""
    stages, repeats, axis = plan.stages, plan.pipeline.repeats, plan.axis
    lead = (stages, repeats) if inverse else (repeats, stages)

    def move(a: Any) -> Any:
        c = a.shape[0] // (stages * repeats)
        moved = a.reshape(*lead, c, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
        rest = [P.UNCONSTRAINED] * (a.ndim - 1)
        return jax.lax.with_sharding_constraint(moved, P(axis, *rest))

    if axis in jax.sharding.get_abstract_mesh().explicit_axes:
        spec = jax.typeof(x).sharding.spec
        return jax.sharding.auto_axes(move, out_sharding=spec)(x)
    return move(x)


def pipelined(
    model: Any,
    plan: StagePlan,
    manual: tuple[str, ...],
    remat: Any,
    marker: Any = None,
    gather: bool = False,
) -> Any:
    """`model` with its pipelined `Stacked` replaced by the `PipelinedStack` a
    loss calls (`manual`: the data axes the schedule makes manual too, in the
    global view), or with `marker` (a `stages.Seen`) by a `MarkedStack`
    recording into it. `gather`: in the device view, the loss reads the
    stack's layers outside it; it gets every stage's (`all_layers`)."""
    where = where_fn(plan.pipeline)
    stacked = where(model)
    if marker is not None:
        return eqx.tree_at(where, model, MarkedStack(stacked, marker))
    kept = stacked.remat if remat is UNSET else remat
    gather = gather and not manual
    if gather:
        stacked = all_layers.gathered(stacked, plan)
    wrapped = PipelinedStack(stacked, plan, manual, kept, gathered=gather)
    return eqx.tree_at(where, model, wrapped)
