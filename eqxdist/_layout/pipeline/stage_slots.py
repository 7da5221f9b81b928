"""The slot body of a schedule whose backward is written out rather than left
to JAX's autodiff (1F1B, interleaved 1F1B, ZB-H1): `StageSlots` runs a
table's F, B, W and BW entries on this stage through the engine's loop
(`engine.run_slots`), each doing only its own work (`stage_passes`).

A forward entry keeps what its backward passes need (each layer's residuals,
as `remat` says) in the stash and passes the stage's output on; on the last
stage (of the last chunk) it also runs the step's `post` (the loss after the
stack, a callback: `_step.one_f_one_b`) and its VJP, which gives the loss,
the metrics, `post`'s parameter gradients and the cotangent of the stage's
output. B computes the input's cotangent from the stash and passes it back
at once (on stage 0, chunk 0, it is kept for the step: the VJP of what comes
before the stack), leaving W what it reads (the cotangents between each
layer's products) in the stash entry, in the room of residuals only B read
(`StagePasses.in_stash`), and what does not fit there in `pending`; W, in a
later slot, computes the weights' gradients from the stash and `pending`,
and frees both. So a W that waits (ZB-H1's) holds no memory beyond its
stash entry where the block's dead residuals make room (they do in the
tests' blocks and the benchmark's `x @ W` MLP). BW is B and W in one entry.
An idle entry computes nothing; a row where no stage receives a message one
way runs no exchange that way (`_exchange`).
"""

import dataclasses
import functools
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._jaxpr import counted_as, matmul_flops
from .engine import run_slots
from .messages import exchange
from .schedules import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, SlotArrays
from .stage_passes import Room, StagePasses, held


def _seed(out: Any, loss: bool) -> Any:
    """The cotangent of one of `post`'s outputs: 1 for the loss, zero for the
    rest (`float0` for integers)."""
    if not jnp.issubdtype(out.dtype, jnp.inexact):
        return np.zeros(out.shape, jax.dtypes.float0)
    return jnp.ones_like(out) if loss else jnp.zeros_like(out)


def _index(x: Any, i: Any) -> Any:
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _set(x: Any, i: Any, v: Any) -> Any:
    return jax.lax.dynamic_update_index_in_dim(x, v, i, 0)


def _set_if(x: Any, i: Any, v: Any, when: Any) -> Any:
    return _set(x, i, jnp.where(when, v, _index(x, i)))


_TABLES = (
    "action",
    "micro",
    "chunk",
    "stash",
    "read",
    "own",
    "from_prev",
    "prev_at",
    "from_next",
    "next_at",
    "pending",
    "sends_f",
    "sends_b",
)


@dataclasses.dataclass(frozen=True)
class StageSlots:
    """One minibatch's schedule on this stage: `run(table)` runs its slots and
    gives the stage's parameter gradients (leaves), stage 0's input cotangents
    per microbatch, and the last stage's outputs of `post` per microbatch.

    The loop's carry: `stash` (what F kept for the backward of the
    (microbatch, chunk) pairs in flight), `inbox_f` (activations received, not
    yet run), `inbox_b` (cotangents received, or made by `post` on the last
    stage), `pending` (what B left for W), the gradient leaves, `dx` (stage
    0's input cotangents) and `outs` (`post`'s outputs); the table's array
    form says which entry of each buffer a pair takes (`slot_arrays`).

    - `post`: `post(*params, *r, *y)`, the loss after the stack on one
      microbatch's other inputs `r` and the stack's output `y` (leaves), its
      outputs' first the loss (the step's callback: `_step.cut_loss`).
    - `key_tree`: the structure of the stack's key (`None` without one).
    - `passes`: this stage's F, B and W (`stage_passes.StagePasses`); each
      backward pass gets the forward's key and microbatch, so the layers'
      noise is the forward's.
    - `params`: the parameter leaves; `rest`: the microbatches' other inputs
      of `post`, stacked; `xs`, `keys`: the stack's input and key leaves per
      microbatch (stage 0 reads `xs`).
    - `axis`, `stages`: the stage axis and its size."""

    post: Callable[..., Any]
    key_tree: Any
    passes: StagePasses
    params: list[Any]
    rest: list[Any]
    xs: list[Any]
    keys: list[Any]
    axis: str
    stages: int

    def run(self, table: SlotArrays) -> tuple[list[Any], list[Any], list[Any]]:
        micro = int(self.xs[0].shape[0])
        h = [x[0] for x in self.xs]
        key = self._key(0)
        passes, params = self.passes, self.params
        f_jaxpr, (_, kept) = jax.make_jaxpr(
            lambda p, h, k: passes.forward(p, h, k, 0, 0), return_shape=True
        )(params, h, key)
        b_jaxpr, (_, saved) = jax.make_jaxpr(
            lambda p, kept, dy, k: passes.input_grad(p, kept, dy, k, 0, 0),
            return_shape=True,
        )(params, kept, h, key)
        w_jaxpr = jax.make_jaxpr(
            lambda p, kept, saved, k: passes.weight_grad(p, kept, saved, k, 0, 0)
        )(params, kept, saved, key)
        # What B hands W goes where residuals only B read were, in the stash
        # entry W frees; the rest in `pending`.
        where = passes.in_stash(kept, saved)
        pended = [v for v, k in zip(saved, where, strict=True) if k is None]
        # `pending` with a spare last entry where the table has BW entries,
        # for their B (`_slot`).
        spare = (0, 0, 0, int((table.action == BACKWARD).any()))
        stash, inbox_f, inbox_b, pending = (
            [jnp.zeros((n + k, *a.shape), a.dtype) for a in like]
            for n, k, like in zip(table.sizes, spare, (kept, h, h, pended), strict=True)
        )
        rest = [r[0] for r in self.rest]

        def post(p: list[Any], r: list[Any], y: list[Any]) -> Any:
            out, vjp = jax.vjp(lambda p, y: self._post(p, r, y), p, y)
            return out, vjp([_seed(o, i == 0) for i, o in enumerate(out)])

        post_jaxpr, (out_shapes, _) = jax.make_jaxpr(post, return_shape=True)(
            params, rest, h
        )
        init = (
            stash,
            inbox_f,
            inbox_b,
            pending,
            [jnp.zeros_like(x) for x in params],
            [jnp.zeros_like(x) for x in self.xs],
            [jnp.zeros((micro, *o.shape), o.dtype) for o in out_shapes],
        )
        # The model FLOPs of the loop, what its entries compute: each pass's
        # products times its entries in the table (a device's share), and the
        # loss after the stack once per microbatch on the last stage. Counted
        # from the loop's program, every slot would count every pass.
        work = [matmul_flops(j) for j in (f_jaxpr, b_jaxpr, w_jaxpr)]
        entries = [
            int((table.action == code).sum())
            for code in (FORWARD, INPUT_GRAD, WEIGHT_GRAD, BACKWARD)
        ]
        per_pass = [*work, work[1] + work[2]]
        flops = Fraction(
            sum(n * f for n, f in zip(entries, per_pass, strict=True))
            + micro * matmul_flops(post_jaxpr),
            self.stages,
        )
        slot = functools.partial(self._slot, table.chunks, (where, saved))

        def loop(init: Any) -> Any:
            return run_slots(table, _TABLES, axis=self.axis, step=slot, init=init)

        *_, grads, dx, outs = counted_as(loop, flops)(init)
        return grads, dx, outs

    def _post(self, p: list[Any], r: list[Any], y: list[Any]) -> list[Any]:
        # Arrays: a Python number in the metrics (a `(sum, count)` pair's
        # count) is a literal of the traced program.
        return [jnp.asarray(o) for o in self.post(*p, *r, *y)]

    def _key(self, m: Any) -> Any:
        if self.key_tree is None:
            return None
        return jax.tree.unflatten(self.key_tree, [_index(k, m) for k in self.keys])

    def _slot(self, chunks: int, handed: Any, c: Any, e: dict[str, Any]) -> Any:
        """One slot: this stage's entry (`run_slots`), then the messages
        (round the ring with several chunks).

        Each kind of work is a `lax.cond` of its own that updates the buffers
        it writes (F the stash, the last stage's F the gradients, its
        cotangent and `post`'s outputs, B `pending`, W the gradients): XLA
        updates a two-way conditional's operand in place, where a `switch`
        over the five actions copied every buffer it updated on every slot,
        and a switch's outputs need zeros from the branches that make
        nothing, the size of the stash and of the gradients (on the CPU
        devices, most of the step's time)."""
        stash, inbox_f, inbox_b, pending, grads, dx, outs = c
        # For each value B hands W: its room in the stash (`None`: in
        # `pending`), and its shape.
        where, saved_like = handed
        s, m, r, a = (
            jax.lax.axis_index(self.axis),
            e["micro"],
            e["chunk"],
            e["action"],
        )
        key, params, passes = self._key(m), self.params, self.passes
        zeros = [jnp.zeros_like(x[0]) for x in self.xs]

        def forward(stash: list[Any]) -> tuple[list[Any], list[Any]]:
            h = [
                jnp.where((s == 0) & (r == 0), _index(x, m), _index(f, e["read"]))
                for x, f in zip(self.xs, inbox_f, strict=True)
            ]
            y, kept = passes.forward(params, h, key, r, m)
            return _put(stash, e["stash"], kept, True), y

        stash, y = jax.lax.cond(
            a == FORWARD, forward, lambda stash: (stash, zeros), stash
        )

        def post(args: Any) -> Any:
            """The loss after the stack on the last stage's output: its
            parameters' gradient, the output's cotangent and its outputs."""
            grads, inbox_b, outs = args
            rest = [_index(x, m) for x in self.rest]
            out, vjp = jax.vjp(lambda p, y: self._post(p, rest, y), params, y)
            dp, dy = vjp([_seed(o, i == 0) for i, o in enumerate(out)])
            grads = [g + d for g, d in zip(grads, dp, strict=True)]
            dy = [held(d, v) for d, v in zip(dy, y, strict=True)]
            inbox_b = _put(inbox_b, e["own"], dy, True)
            return grads, inbox_b, _put(outs, m, out, True)

        at_end = (s == self.stages - 1) & (r == chunks - 1)
        grads, inbox_b, outs = jax.lax.cond(
            (a == FORWARD) & at_end, post, lambda args: args, (grads, inbox_b, outs)
        )
        # Where B leaves what its W reads: the stash entry, where residuals
        # only B read were (`where`), else its entry of `pending`; BW's
        # B, whose W runs in the same slot, the spare last entry.
        at_pending = e["pending"]
        if pending:
            at_pending = jnp.where(a == BACKWARD, pending[0].shape[0] - 1, at_pending)

        def backward(bufs: Any) -> tuple[Any, list[Any]]:
            stash, pending = bufs
            kept = [_index(b, e["stash"]) for b in stash]
            dy = [_index(b, e["read"]) for b in inbox_b]
            dh, saved = passes.input_grad(params, kept, dy, key, r, m)
            stash = _in_rooms(stash, e["stash"], saved, where)
            rest = [v for v, k in zip(saved, where, strict=True) if k is None]
            return (stash, _put(pending, at_pending, rest, True)), dh

        is_b = (a == INPUT_GRAD) | (a == BACKWARD)
        (stash, pending), dh = jax.lax.cond(
            is_b, backward, lambda bufs: (bufs, zeros), (stash, pending)
        )

        def weights(grads: list[Any]) -> list[Any]:
            kept = [_index(b, e["stash"]) for b in stash]
            pended = iter([_index(b, at_pending) for b in pending])
            saved = [
                next(pended) if room is None else room.get(kept[room.leaf], like)
                for room, like in zip(where, saved_like, strict=True)
            ]
            dp = passes.weight_grad(params, kept, saved, key, r, m)
            return [g + d for g, d in zip(grads, dp, strict=True)]

        is_w = (a == WEIGHT_GRAD) | (a == BACKWARD)
        grads = jax.lax.cond(is_w, weights, lambda grads: grads, grads)
        dx = _put(dx, m, dh, (s == 0) & (r == 0) & is_b)
        got_f, got_b = _exchange(
            (y, e["sends_f"]), (dh, e["sends_b"]), self.axis, self.stages, chunks > 1
        )
        inbox_f = _put(inbox_f, e["prev_at"], got_f, e["from_prev"] == 1)
        inbox_b = _put(inbox_b, e["next_at"], got_b, e["from_next"] == 1)
        return (stash, inbox_f, inbox_b, pending, grads, dx, outs)


def _in_rooms(
    stash: list[Any], i: Any, saved: list[Any], rooms: list[Room | None]
) -> list[Any]:
    """`stash` with each value of `saved` that has a room (`rooms`,
    `StagePasses.in_stash`) written there in entry `i`."""
    stash = list(stash)
    for v, room in zip(saved, rooms, strict=True):
        if room is not None:
            stash[room.leaf] = room.put(stash[room.leaf], i, v)
    return stash


def _put(buffers: list[Any], i: Any, values: list[Any], when: Any) -> list[Any]:
    return [_set_if(b, i, v, when) for b, v in zip(buffers, values, strict=True)]


def _exchange(
    send_f: tuple[list[Any], Any],
    send_b: tuple[list[Any], Any],
    axis: str,
    stages: int,
    ring: bool,
) -> tuple[list[Any], list[Any]]:
    """The activations sent on to the next stage and the cotangents back to
    the previous one (`messages.exchange`), each with the row's flag
    (`SlotArrays.sends_f`, `sends_b`): a row where no stage receives one way
    sends nothing that way, and a row where none receives either way runs no
    exchange (the flags are the row's, the same on every stage, so every
    stage takes the same branch round the collectives). At P = 4, M = 8
    1F1B's table sends both ways in 15 of its 30 rows, one way in 13, and
    interleaved 1F1B's (R = 2) both ways in 24 of 54, one way in 28."""
    (ys, f), (dhs, b) = send_f, send_b

    def zeros(v: list[Any]) -> list[Any]:
        return [jnp.zeros_like(x) for x in v]

    def both(v: Any) -> Any:
        return exchange(*v, axis=axis, stages=stages, ring=ring)

    def ahead(v: Any) -> Any:
        return exchange(v[0], None, axis=axis, stages=stages, ring=ring)[0], zeros(v[1])

    def back(v: Any) -> Any:
        return zeros(v[0]), exchange(None, v[1], axis=axis, stages=stages, ring=ring)[1]

    def none(v: Any) -> Any:
        return zeros(v[0]), zeros(v[1])

    # 0: none, 1: ahead only, 2: back only, 3: both.
    which = (f == 1).astype(jnp.int32) + 2 * (b == 1).astype(jnp.int32)
    got: tuple[list[Any], list[Any]] = jax.lax.switch(
        which, [none, ahead, back, both], (ys, dhs)
    )
    return got
