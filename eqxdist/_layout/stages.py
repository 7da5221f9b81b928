"""How a pipelined `Stacked` runs in a step: the stack the loss sees
(`PipelinedStack`, which runs the GPipe and circular schedules, and
`MarkedStack`, which marks where the 1F1B schedule cuts the loss), the layers
of one stage (`run_layers`), and the per-step move of a circular pipeline's
chunks (`to_chunk_order`). `pipeline` holds the configuration and the layout.

**Where the stages run.** The loss is written as for one device (or one data
shard). When it calls the pipelined `Stacked` on its rows under `jax.vmap` (as
`jax.vmap(model)(x)` does), a `jax.custom_batching.custom_vmap` rule receives
the rows together; when it calls it on a batch (blocks that take `(rows, ...)`,
no `vmap`: `under_vmap` tells), the input's leading axis is the rows. Either
way the rows are cut into microbatches and the schedule runs with the stage
axis bound: in the device view the step's own `shard_map` binds it (each
stage holds its layers); in the global view the stack runs a `shard_map` of its
own over the stage and data axes. Activations move to the next stage with
`ppermute`; the last stage's output is given to every stage with one
all-reduce, so what comes after the `Stacked` (head, loss) runs as in the other
strategies, and JAX differentiates the whole: the backward pass of the
schedule's loop is the GPipe backward pass (all forwards, then all backwards).

**Circular** (`repeats = R > 1`): stage p holds the chunks of c = L/(P R)
layers p, p + P, ...; a microbatch goes round the ring R times. The state keeps
L/P consecutive layers per stage, so each step moves the chunks that change
stage there (`to_chunk_order`) and their gradients back. The loop runs R M +
P - 1 iterations for M microbatches: bubble (P - 1)/(R M + P - 1).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .pipeline import StagePlan, where_fn
from .remat import UNSET, loop_blocks
from .stacked import Stacked


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
    """

    stacked: Stacked
    plan: StagePlan = eqx.field(static=True)
    manual: tuple[str, ...] = eqx.field(static=True)
    remat: Any = eqx.field(static=True)

    def __call__(self, x: Any, *, key: Any = None) -> Any:
        leaves, layer = self.stacked._layer_fn(with_key=key is not None)

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
            return x

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
        if pipeline.schedule == "circular" and micro < stages:
            raise ValueError(
                f"pipeline: the circular schedule needs at least as many "
                f"microbatches as stages ({micro} < {stages}): a microbatch coming "
                "round the ring must find its stage free."
            )
        engine = _Engine(
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
        )
        if not self.manual:  # the device view: the step's shard_map binds the stages
            return engine(leaves, x, key)
        if repeats > 1:
            leaves = [to_chunk_order(a, plan) for a in leaves]
        row_spec = P(data[0] if len(data) == 1 else data) if data else P()
        return jax.shard_map(
            engine,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(
                [P(plan.axis)] * len(leaves),
                jax.tree.map(lambda _: row_spec, x),
                None if key is None else (row_spec if key_rows else P()),
            ),
            out_specs=jax.tree.map(lambda _: row_spec, x),
            axis_names=frozenset({plan.axis, *data}),
            check_vma=False,
        )(leaves, x, key)


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

        def mark(x: Any, key: Any, per_row: bool) -> Any:
            seen["x"] = jax.tree.structure(x)
            seen["key"] = None if key is None else jax.tree.structure(key)
            seen["per_row"] = per_row

            def eqxdist_pipeline_stack(x: Any, key: Any) -> Any:
                return x

            return jax.jit(eqxdist_pipeline_stack)(x, key)

        if not under_vmap((x, key)):
            # Blocks that take a batch: `x`'s leading axis is the rows.
            seen["key_rows"] = False
            return mark(x, key, per_row=False)

        def one_row(x: Any, key: Any) -> Any:
            return x

        stack = jax.custom_batching.custom_vmap(one_row)

        @stack.def_vmap
        def rows(axis_size: int, in_batched: Any, x: Any, key: Any) -> tuple[Any, Any]:
            x_batched, key_batched = in_batched
            x = jax.tree.map(
                lambda a, b: a if b else jnp.broadcast_to(a, (axis_size, *a.shape)),
                x,
                x_batched,
            )
            seen["key_rows"] = any(jax.tree.leaves(key_batched))
            out = mark(x, key, per_row=True)
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
    chunks p, p + P, ... in repeat order (`inverse`: back). Only the chunks that
    change stage move: in P - 1 rounds of `ppermute` (round k sends to the stage
    k further on), each as large as the most chunks one stage sends in it; a
    gather (`jnp.take`) along a sharded axis would all-gather the whole stack."""
    stages, repeats = plan.stages, plan.pipeline.repeats
    slots = stages * repeats
    # Slot g (stage g // R, position g % R) holds chunk `held[g]` in chunk order.
    held = [(g % repeats) * stages + g // repeats for g in range(slots)]
    source = held if not inverse else [held.index(g) for g in range(slots)]
    # source[g]: the slot (in the other order) whose chunk slot g receives.
    rounds: list[tuple[int, np.ndarray, np.ndarray]] = []
    for k in range(stages):
        sends: list[list[tuple[int, int]]] = [[] for _ in range(stages)]
        for g in range(slots):
            dest, src = g // repeats, source[g] // repeats
            if (dest - src) % stages == k:
                sends[src].append((source[g] % repeats, g % repeats))
        width = max(len(x) for x in sends)
        if width == 0:
            continue
        send = np.zeros((stages, width), np.int32)
        place = np.full((stages, width), repeats, np.int32)  # `repeats`: discard
        for src, items in enumerate(sends):
            for n, (from_pos, to_pos) in enumerate(items):
                send[src, n] = from_pos
                place[(src + k) % stages, n] = to_pos
        rounds.append((k, send, place))
    axis = plan.axis
    # Each stage's rows of the tables come in sharded over the stage axis:
    # `axis_index` in a `shard_map` manual over only some of the mesh's axes is a
    # partition id, which XLA's SPMD partitioner rejects in some programs (a
    # model of a dozen stacked leaves).
    tables = [(jnp.asarray(send), jnp.asarray(place)) for _, send, place in rounds]

    def move(local: Any, tables: Any) -> Any:
        chunks = local.reshape(repeats, local.shape[0] // repeats, *local.shape[1:])
        out = jnp.zeros((repeats + 1, *chunks.shape[1:]), chunks.dtype)
        for (k, _, _), (send, place) in zip(rounds, tables, strict=True):
            message = chunks[send[0]]
            if k:
                shift = [(d, (d + k) % stages) for d in range(stages)]
                message = jax.lax.ppermute(message, axis, shift)
            out = out.at[place[0]].set(message)
        return out[:repeats].reshape(local.shape)

    return jax.shard_map(
        move,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(P(axis), P(axis)),
        out_specs=P(axis),
        axis_names=frozenset({axis}),
        check_vma=False,
    )(x, tables)


# The two places the stages exchange more than activations, with the gradients
# a pipeline needs whatever `shard_map`'s `check_vma`: every stage holds the
# step's input rows and runs what follows the stack on its output, identically.


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _from_first(x: Any, axis: str) -> Any:
    """`x`, which only the first stage reads: its gradient is the sum of the
    stages' (the first stage's; zero elsewhere), the same on every stage."""
    return x


def _from_first_fwd(x: Any, axis: str) -> tuple[Any, None]:
    return x, None


def _from_first_bwd(axis: str, _: None, g: Any) -> tuple[Any]:
    return (jax.tree.map(lambda a: jax.lax.psum(a, axis), g),)


_from_first.defvjp(_from_first_fwd, _from_first_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _from_last(x: Any, axis: str, parts: bool) -> Any:
    """The last stage's `x` on every stage (one all-reduce). Every stage runs
    what follows on it identically, so the gradient is the last stage's own;
    where each stage's cotangent is a part of it (`parts`: the transpose of a
    `shard_map` output replicated over the stage axis), their sum."""
    last = jax.lax.axis_index(axis) == jax.lax.axis_size(axis) - 1
    return jax.tree.map(
        lambda a: jax.lax.psum(jnp.where(last, a, jnp.zeros_like(a)), axis), x
    )


def _from_last_fwd(x: Any, axis: str, parts: bool) -> tuple[Any, None]:
    return _from_last(x, axis, parts), None


def _from_last_bwd(axis: str, parts: bool, _: None, g: Any) -> tuple[Any]:
    last = jax.lax.axis_index(axis) == jax.lax.axis_size(axis) - 1
    if parts:
        g = jax.tree.map(lambda a: jax.lax.psum(a, axis), g)
    return (jax.tree.map(lambda a: jnp.where(last, a, jnp.zeros_like(a)), g),)


_from_last.defvjp(_from_last_fwd, _from_last_bwd)


@dataclasses.dataclass(frozen=True)
class _Engine:
    """One stage's program (the stage axis bound): the forward schedule of GPipe
    (`repeats == 1`) and the circular schedule; JAX differentiates it.

    Iteration t, stage s: k = t - s; if 0 <= k < R M, the stage runs chunk
    r = k // M of its layers on microbatch m = k % M; stage 0 takes microbatch m
    from the input (r = 0) or from the loop-back buffer (r > 0), the others the
    activation the previous stage passed on. The last stage's outputs of the
    last repeat are collected, then given to every stage."""

    layer: Callable[..., Any]
    axis: str
    stages: int
    microbatches: int
    repeats: int
    num_layers: int
    key_rows: bool
    remat: Any
    per_row: bool
    sum_input: bool
    unroll: bool = False

    def __call__(self, leaves: list[Any], x: Any, key: Any) -> Any:
        stages, m_total, repeats = self.stages, self.microbatches, self.repeats
        s = jax.lax.axis_index(self.axis)
        xm = jax.tree.map(
            lambda a: a.reshape(m_total, a.shape[0] // m_total, *a.shape[1:]), x
        )
        if self.sum_input:
            xm = _from_first(xm, self.axis)
        keys = None
        if key is not None and self.key_rows:
            keys = key.reshape(m_total, key.shape[0] // m_total)
        if stages == 1:
            perm: list[tuple[int, int]] = []
        elif repeats > 1:
            perm = [(i, (i + 1) % stages) for i in range(stages)]
        else:
            perm = [(i, i + 1) for i in range(stages - 1)]
        work = repeats * m_total

        def iteration(carry: Any, t: Any) -> tuple[Any, None]:
            buf, loop, out = carry
            k = t - s
            kk = jnp.clip(k, 0, work - 1)
            r, m = kk // m_total, kk % m_total
            first = _take(xm, m)
            if repeats > 1:
                first = _where(r == 0, first, _take(loop, m))
            h = _where(s == 0, first, buf)
            y = self._chunk(leaves, h, r, None if key is None else (key, keys, m))
            done = (k >= 0) & (k < work) & (s == stages - 1) & (r == repeats - 1)
            out = _put(out, m, y, done)
            nxt = y
            if perm:
                nxt = jax.tree.map(lambda a: jax.lax.ppermute(a, self.axis, perm), y)
            if repeats > 1:
                k2 = t - (stages - 1)
                back = (s == 0) & (k2 >= 0) & (k2 < work - m_total)
                loop = _put(loop, jnp.clip(k2, 0, work - 1) % m_total, nxt, back)
            return (nxt, loop, out), None

        init = (
            _take(xm, 0),
            xm if repeats > 1 else None,
            jax.tree.map(jnp.zeros_like, xm),
        )
        (_, _, out), _ = jax.lax.scan(iteration, init, jnp.arange(work + stages - 1))
        out = _from_last(out, self.axis, not self.sum_input)
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), out)

    def _chunk(self, leaves: list[Any], h: Any, r: Any, keys: Any) -> Any:
        """Chunk `r` of this stage's layers on the microbatch `h`."""
        c = self.num_layers // (self.stages * self.repeats)
        # One chunk (GPipe): the layers as they are, loop-invariant. A slice at
        # the traced `r` would be kept for the backward pass at every iteration:
        # M + P - 1 copies of the stage's parameters.
        chunk = leaves
        if self.repeats > 1:
            chunk = [jax.lax.dynamic_slice_in_dim(a, r * c, c, axis=0) for a in leaves]
        first = (r * self.stages + jax.lax.axis_index(self.axis)) * c
        if keys is not None:
            key, rows_keys, m = keys
            if self.key_rows:
                key = jax.lax.dynamic_index_in_dim(rows_keys, m, 0, keepdims=False)
            keys = key
        return run_layers(
            self.layer,
            chunk,
            h,
            keys,
            key_rows=self.key_rows,
            first=first,
            num_layers=self.num_layers,
            remat=self.remat,
            unroll=self.unroll,
            per_row=self.per_row,
        )


def run_layers(
    layer: Callable[..., Any],
    leaves: list[Any],
    h: Any,
    key: Any,
    *,
    key_rows: bool,
    first: Any,
    num_layers: int,
    remat: Any,
    unroll: bool = False,
    per_row: bool = True,
) -> Any:
    """`leaves`' layers (global layers `first`, `first + 1`, ... of a stack of
    `num_layers`) in turn on the rows `h` (each row its own call of the block,
    as under the loss's `vmap`; not `per_row`: one call on all of `h`, for
    blocks that take a batch). With a `key` (one per row if `key_rows`), each
    layer gets its key as the `Stacked` would give it: `jax.random.split(key,
    num_layers)[layer]`. With `unroll`, a Python loop over the layers, not a
    scan (`loop_blocks`)."""
    count = int(jax.tree.leaves(leaves)[0].shape[0])
    chunk = list(leaves)
    in_axes: list[int | None] = [None] * len(leaves)
    if key is not None:

        def per_layer(k: Any) -> Any:
            return jax.lax.dynamic_slice_in_dim(
                jax.random.split(k, num_layers), first, count, axis=0
            )

        if key_rows:
            chunk.append(jnp.swapaxes(jax.vmap(per_layer)(key), 0, 1))
            in_axes.append(0)
        else:
            chunk.append(per_layer(key))
            in_axes.append(None)

    def body(h: Any, layer_leaves: list[Any]) -> tuple[Any, None]:
        if not per_row:
            return layer(layer_leaves, h), None
        return jax.vmap(layer, in_axes=(in_axes, 0))(layer_leaves, h), None

    h, _ = loop_blocks(body, h, chunk, remat=remat, unroll=unroll, length=count)
    return h


def _take(tree: Any, i: Any) -> Any:
    return jax.tree.map(
        lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree
    )


def _put(tree: Any, i: Any, value: Any, when: Any) -> Any:
    """`tree[i] = value` where `when`, else unchanged."""
    return jax.tree.map(
        lambda a, v: jax.lax.dynamic_update_index_in_dim(
            a, jnp.where(when, v, jax.lax.dynamic_index_in_dim(a, i, 0, False)), i, 0
        ),
        tree,
        value,
    )


def _where(c: Any, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda u, v: jnp.where(c, u, v), a, b)


def pipelined(
    model: Any,
    plan: StagePlan,
    manual: tuple[str, ...],
    remat: Any,
    marker: Any = None,
) -> Any:
    """`model` with its pipelined `Stacked` replaced by the `PipelinedStack` a
    loss calls (`manual`: the data axes the schedule makes manual too, in the
    global view), or with `marker` (a `stages.Seen`) by a `MarkedStack`
    recording into it."""
    where = where_fn(plan.pipeline)
    stacked = where(model)
    if marker is not None:
        return eqx.tree_at(where, model, MarkedStack(stacked, marker))
    own = stacked.remat if remat is UNSET else remat
    wrapped = PipelinedStack(stacked, plan, manual, own)
    return eqx.tree_at(where, model, wrapped)
