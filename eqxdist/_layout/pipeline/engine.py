"""The one engine every pipeline schedule runs on: `run_slots`, a loop over the
slots of a schedule's table (`schedules.SlotArrays`) in which each stage reads
its own entry (action, microbatch, chunk, the messages arriving) and runs it.

Two slot bodies drive it. `ForwardEngine` runs the forward half of GPipe and
the circular schedule (only F entries: the stage runs its chunk on every slot,
an idle slot's result unused, so that the loop stays one straight program JAX
differentiates; autodiff runs the table's backward half). The body of the
schedules whose backward is written out (`stage_slots.StageSlots`: 1F1B,
interleaved 1F1B, ZB-H1) runs F, BW, B and W entries, each doing only its own
work (`stage_passes`), the loss after the stack a callback of the step's. One
body for both would put an inbox indexed by microbatch into GPipe's
differentiated loop (an update and a read more per slot, kept for its backward
pass). The layers of one stage are a loop (`StageLayers`: `layer_loop`,
`stage_layers`), which GPipe's body runs (`StageLayers.run`) and the
written-out schedules' passes run apart.
"""

import dataclasses
import functools
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._jaxpr import counted_scaled
from ..remat import UNSET, loop_blocks
from ..stack_aux import (
    batch_of_accumulators,
    from_stages,
    place_aux,
    split_aux,
    zeros,
)
from ..stacked import Stacked, layer_function
from .config import StagePlan
from .messages import exchange
from .schedules import FORWARD, SlotArrays, forward_arrays


def run_slots(
    arrays: SlotArrays,
    fields: tuple[str, ...],
    *,
    axis: str,
    step: Callable[..., Any],
    init: Any,
) -> Any:
    """The carry after every slot of `arrays`: at slot t, `step(carry, entry)`
    with `entry` this stage's (the stage axis `axis`) values at t of the
    tables named by `fields` (a dict by name; only those are read). A table of
    one value a row (`(slots,)`) gives every stage the same value: a
    predicate the stages agree on, which may guard a collective."""
    tables = [jnp.asarray(getattr(arrays, f)) for f in fields]

    def slot(carry: Any, t: Any) -> tuple[Any, None]:
        rows = [_take(x, t) for x in tables]
        s = jax.lax.axis_index(axis)
        entry = {
            f: _take(x, s) if x.ndim else x for f, x in zip(fields, rows, strict=True)
        }
        return step(carry, entry), None

    carry, _ = jax.lax.scan(slot, init, jnp.arange(arrays.slots))
    return carry


def microbatch_key(
    key: Any, micro: Any, microbatches: int, data: tuple[str, ...] = ()
) -> Any:
    """The key microbatch `micro` (of `microbatches`, a traced index) calls the
    stack's layers with when the stack's `key` is not per row: `fold_in(key,
    g)`, g the microbatch's index among the rows the stack was called on: `micro`
    in the device view (each device's key is its own), d M + `micro` in the
    global view, d the data shard's index over the axes `data` (bound), whose
    rows come d-th. Each layer's key is then `jax.random.split(fold_in(key, g),
    L)[layer]`, the global layer's: no two microbatches (or data shards) draw
    the same noise, and how many stages hold the layers changes no key."""
    g = micro
    if data:
        g = jax.lax.axis_index(data) * microbatches + micro
    return jax.random.fold_in(key, g)


def stage_layers(
    stacked: Stacked,
    plan: StagePlan,
    key: Any,
    *,
    key_rows: bool,
    per_row: bool,
    remat: Any,
    chunk: Any = 0,
    micro: Any = 0,
    data: tuple[str, ...] = (),
) -> "StageLayers":
    """This stage's layers of the pipelined `stacked` (its leaves this stage's
    L/P layers, in chunk order with `repeats`; the stage axis bound), as
    `layer_loop` gives them, for microbatch `micro` (a traced index): with R >
    1 repeats, only its `chunk` (a traced index) of L/(P R) layers, global
    chunk `chunk` P + s. A `key` not per row is the microbatch's
    (`microbatch_key`; `data`: the global view's data axes). `remat`: the
    step's (`UNSET`: the stack's own)."""
    leaves, layer = layer_function(stacked, with_key=key is not None)
    if key is not None and not key_rows:
        key = microbatch_key(key, micro, plan.pipeline.microbatches, data)
    repeats = plan.pipeline.repeats
    count = stacked.num_layers // (plan.stages * repeats)
    s = jax.lax.axis_index(plan.axis)
    first, offset = s * count, 0
    if repeats > 1:
        # One chunk (1F1B): the layers as they are; at a traced offset only
        # where there are several.
        offset = chunk * count
        first = (chunk * plan.stages + s) * count
    return layer_loop(
        layer,
        leaves,
        key,
        key_rows=key_rows,
        first=first,
        num_layers=stacked.num_layers,
        remat=stacked.remat if remat is UNSET else remat,
        unroll=stacked.unroll,
        per_row=per_row,
        offset=offset,
        count=count,
    )


@dataclasses.dataclass(frozen=True)
class ForwardEngine:
    """One stage's program (the stage axis bound): the forward half of the
    table of GPipe (`repeats == 1`) or the circular schedule
    (`schedules.forward_arrays`), run by `run_slots`; JAX differentiates it.

    At each slot the stage runs its entry's chunk r of layers on microbatch m:
    stage 0 takes the microbatch from the input (r = 0) or from the loop-back
    buffer (r > 0, filled by the messages from the last stage round the ring),
    the others the activation the previous stage passed on in the slot before.
    Idle slots run too (on entry (0, 0)), their results unused, so that the
    loop is one straight program. The last stage's outputs of the last chunk
    are collected, then given to every stage."""

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
    aux: Any = None  # blocks returning `(x, aux)`: one microbatch's accumulator
    data: tuple[str, ...] = ()  # the global view's data axes (`microbatch_key`)

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

        def slot(carry: Any, entry: dict[str, Any]) -> Any:
            buf, loop, out, acc = carry
            m, r = entry["micro"], entry["chunk"]
            first = _take(xm, m)
            if repeats > 1:
                first = _where(r == 0, first, _take(loop, m))
            h = _where(s == 0, first, buf)

            # Idle slots run too, on garbage, their results unused: the loop
            # stays one straight program, whose collectives inside the layers
            # (ring attention over a context axis, FSDP's gathers) every
            # device runs. Their work is not model work (`counted_scaled`).
            y = self._chunk(leaves, h, r, None if key is None else (key, keys, m))
            if self.aux is not None:
                y, aux = y
                acc = self._place(acc, aux, entry, s)
            done = (entry["action"] == FORWARD) & (s == stages - 1) & (r == repeats - 1)
            out = _put(out, m, y, done)
            # On to the next stage (round the ring with several chunks).
            out_leaves, tree = jax.tree.flatten(y)
            sent, _ = exchange(
                out_leaves, None, axis=self.axis, stages=stages, ring=repeats > 1
            )
            nxt = jax.tree.unflatten(tree, sent or [])
            if repeats > 1:
                # What comes round the ring waits in stage 0's loop-back buffer.
                back = (s == 0) & (entry["from_prev"] == 1)
                loop = _put(loop, entry["prev_micro"], nxt, back)
            return nxt, loop, out, acc

        init = (
            _take(xm, 0),
            xm if repeats > 1 else None,
            jax.tree.map(jnp.zeros_like, xm),
            None if self.aux is None else zeros(self.aux, (m_total,)),
        )
        arrays = forward_arrays(stages, m_total, repeats)

        def loop(init: Any) -> Any:
            fields = ("action", "micro", "chunk", "from_prev", "prev_micro")
            return run_slots(arrays, fields, axis=self.axis, step=slot, init=init)

        # Model FLOPs: each slot's body is one chunk's work, of which only the
        # R M slots of each stage's entries count (not its P - 1 idle ones).
        scale = Fraction(repeats * m_total, arrays.slots)
        _, _, out, acc = counted_scaled(loop, scale)(init)
        out = _from_last(out, self.axis, not self.sum_input)
        out = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), out)
        if self.aux is None:
            return out
        acc = from_stages(acc, self.axis, not self.sum_input)
        return out, batch_of_accumulators(acc, per_row=self.per_row)

    def _place(self, acc: Any, aux: Any, entry: dict[str, Any], s: Any) -> Any:
        """The microbatches' accumulators `acc` with the aux of this slot's
        chunk written into its microbatch's (a forward entry only: an idle
        slot's result is unused)."""
        m, r = entry["micro"], entry["chunk"]
        c = self.num_layers // (self.stages * self.repeats)
        first = (r * self.stages + s) * c
        mine = place_aux(_take(acc, m), aux, first, per_row=self.per_row)
        return _put(acc, m, mine, entry["action"] == FORWARD)

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
            else:
                key = microbatch_key(key, m, self.microbatches, self.data)
            keys = key
        loop = layer_loop(
            self.layer,
            chunk,
            keys,
            key_rows=self.key_rows,
            first=first,
            num_layers=self.num_layers,
            remat=self.remat,
            unroll=self.unroll,
            per_row=self.per_row,
        )
        h, ys = loop.run(h)
        # Blocks returning `(x, aux)`: the aux stacked over these layers.
        return h if ys is None else (h, ys)


@dataclasses.dataclass(frozen=True)
class StageLayers:
    """A run of a stack's layers as a loop: `body(h, x) -> (h, aux)` one layer
    on the rows `h` (`aux` `None` for blocks that return only `x`), the
    layers' inputs (`xs`, or one layer's, `layer(i)`), `first` the global
    index of the first (for the aux's place), and how the loop runs (`remat`,
    `unroll`; `per_row`: each row its own call of the block). `run` runs it;
    the written-out schedules run its layers' forward and backward passes
    apart (`stage_passes`).

    The layers are `count` of the stage's layer leaves (`leaves`) from
    `offset` (a traced index: one chunk of interleaved 1F1B), then their keys
    (`keys`, stacked over these layers; `None` without a key). `layer(i)`
    reads layer i where the stage's leaves are: taking a chunk first
    (`xs`) copies its weights, which on few rows a microbatch cost as much
    as the chunk's products (interleaved 1F1B's F and B entries read their
    layers so)."""

    body: Callable[[Any, list[Any]], tuple[Any, Any]]
    leaves: list[Any]
    keys: Any
    offset: Any
    count: int
    first: Any
    remat: Any
    unroll: bool
    per_row: bool

    @property
    def xs(self) -> list[Any]:
        """The loop's inputs stacked over these layers: each layer's leaves,
        then its key."""
        start, count = self.offset, self.count
        leaves = list(self.leaves)
        if not isinstance(start, (int, np.integer)):
            leaves = [jax.lax.dynamic_slice_in_dim(a, start, count) for a in leaves]
        elif (start, count) != (0, leaves[0].shape[0]):  # else all, as they are
            leaves = [a[start : start + count] for a in leaves]
        return leaves if self.keys is None else [*leaves, self.keys]

    def layer(self, i: Any) -> list[Any]:
        """Layer i's inputs (i < `count`, traced or not), as `xs` holds them
        at i, read in place."""
        leaves = [_index(a, self.offset + i) for a in self.leaves]
        return leaves if self.keys is None else [*leaves, _index(self.keys, i)]

    def run(self, h: Any) -> tuple[Any, Any]:
        """The layers in turn on `h`: `(h, ys)`, `ys` the aux stacked over the
        layers (`(count, rows, ...)`; `None` without aux)."""
        return loop_blocks(
            self.body,
            h,
            self.xs,
            remat=self.remat,
            unroll=self.unroll,
            length=self.count,
        )

    def finish(self, h: Any, ys: Any, acc: Any) -> Any:
        """The stage's output: `h`, or for blocks that
        return `(x, aux)` `(h, acc)` with these layers' aux written into the
        microbatch's accumulator `acc` (`stack_aux.place_aux`; linear in `ys`
        and `acc`)."""
        if acc is None:
            return h
        return h, place_aux(acc, ys, self.first, per_row=self.per_row)


def _index(x: Any, i: Any) -> Any:
    if isinstance(i, (int, np.integer)):
        return x[int(i)]
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def layer_loop(
    layer: Callable[..., Any],
    leaves: list[Any],
    key: Any,
    *,
    key_rows: bool,
    first: Any,
    num_layers: int,
    remat: Any,
    unroll: bool = False,
    per_row: bool = True,
    offset: Any = 0,
    count: int | None = None,
) -> StageLayers:
    """`count` (all) of `leaves`' layers from `offset` (global layers
    `first`, `first + 1`, ... of a stack of `num_layers`) as a loop over the
    rows (each row its own call of the block, as under the loss's `vmap`; not
    `per_row`: one call on all of them, for blocks that take a batch). With a
    `key` (one per row if `key_rows`), each layer gets its key as the
    `Stacked` would give it: `jax.random.split(key, num_layers)[layer]`. With
    `unroll`, a Python loop over the layers, not a scan (`loop_blocks`)."""
    if count is None:
        count = int(jax.tree.leaves(leaves)[0].shape[0])
    in_axes: list[int | None] = [None] * len(leaves)
    keys = None
    if key is not None:

        def per_layer(k: Any) -> Any:
            return jax.lax.dynamic_slice_in_dim(
                jax.random.split(k, num_layers), first, count, axis=0
            )

        if key_rows:
            keys = jnp.swapaxes(jax.vmap(per_layer)(key), 0, 1)
            in_axes.append(0)
        else:
            keys = per_layer(key)
            in_axes.append(None)

    def body(h: Any, layer_leaves: list[Any]) -> tuple[Any, Any]:
        if not per_row:
            out = layer(layer_leaves, h)
        else:
            out = jax.vmap(layer, in_axes=(in_axes, 0))(layer_leaves, h)
        y, aux, _ = split_aux(out, h, "pipeline")
        return y, aux

    return StageLayers(
        body, list(leaves), keys, offset, count, first, remat, unroll, per_row
    )


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
