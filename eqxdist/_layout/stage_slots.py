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
layer's products) in `pending`; W, in a later slot, computes the weights'
gradients from the stash and `pending`, and frees both. BW is B and W in one
entry. An idle entry computes nothing.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .engine import run_slots
from .schedules import SlotArrays
from .stage_passes import StagePasses, held


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
        kept = jax.eval_shape(
            lambda p, h, k: self.passes.forward(p, h, k, 0, 0)[1], self.params, h, key
        )
        saved = jax.eval_shape(
            lambda p, kept, h, k: self.passes.input_grad(p, kept, h, k, 0, 0)[1],
            self.params,
            kept,
            h,
            key,
        )
        stash, inbox_f, inbox_b, pending = (
            [jnp.zeros((n, *a.shape), a.dtype) for a in like]
            for n, like in zip(table.sizes, (kept, h, h, saved), strict=True)
        )
        out_shapes = jax.eval_shape(
            self._post, self.params, [r[0] for r in self.rest], [x[0] for x in self.xs]
        )
        init = (
            stash,
            inbox_f,
            inbox_b,
            pending,
            [jnp.zeros_like(x) for x in self.params],
            [jnp.zeros_like(x) for x in self.xs],
            [jnp.zeros((micro, *o.shape), o.dtype) for o in out_shapes],
        )
        slot = functools.partial(self._slot, table.chunks)
        *_, grads, dx, outs = run_slots(
            table, _TABLES, axis=self.axis, step=slot, init=init
        )
        return grads, dx, outs

    def _post(self, p: list[Any], r: list[Any], y: list[Any]) -> list[Any]:
        # Arrays: a Python number in the metrics (a `(sum, count)` pair's
        # count) is a literal of the traced program.
        return [jnp.asarray(o) for o in self.post(*p, *r, *y)]

    def _key(self, m: Any) -> Any:
        if self.key_tree is None:
            return None
        return jax.tree.unflatten(self.key_tree, [_index(k, m) for k in self.keys])

    def _zeros(self) -> list[Any]:
        return [jnp.zeros_like(x[0]) for x in self.xs]

    def _forward(self, chunks: int, c: Any, e: dict[str, Any]) -> Any:
        stash, inbox_f, inbox_b, pending, grads, dx, outs = c
        s, m, r = jax.lax.axis_index(self.axis), e["micro"], e["chunk"]
        h = [
            jnp.where((s == 0) & (r == 0), _index(x, m), _index(f, e["read"]))
            for x, f in zip(self.xs, inbox_f, strict=True)
        ]
        y, kept = self.passes.forward(self.params, h, self._key(m), r, m)
        stash = [_set(b, e["stash"], v) for b, v in zip(stash, kept, strict=True)]

        def last(args: Any) -> Any:
            inbox_b, grads, outs = args
            rest = [_index(x, m) for x in self.rest]
            out, vjp = jax.vjp(lambda p, y: self._post(p, rest, y), self.params, y)
            dp, dy = vjp([_seed(o, i == 0) for i, o in enumerate(out)])
            grads = [a + b for a, b in zip(grads, dp, strict=True)]
            dy = [held(d, v) for d, v in zip(dy, y, strict=True)]
            inbox_b = [_set(b, e["own"], v) for b, v in zip(inbox_b, dy, strict=True)]
            outs = [_set(b, m, v) for b, v in zip(outs, out, strict=True)]
            return inbox_b, grads, outs

        at_end = (s == self.stages - 1) & (r == chunks - 1)
        inbox_b, grads, outs = jax.lax.cond(
            at_end, last, lambda a: a, (inbox_b, grads, outs)
        )
        c = (stash, inbox_f, inbox_b, pending, grads, dx, outs)
        return c, y, self._zeros()

    def _backward(self, wrt: str, c: Any, e: dict[str, Any]) -> Any:
        """A backward entry: `wrt` `"both"` (BW), `"input"` (B: the input's
        cotangent, passed back; what W reads left in `pending`) or
        `"weights"` (W: the parameters' gradient, added up), from what the
        forward kept (`stage_passes`)."""
        stash, inbox_f, inbox_b, pending, grads, dx, outs = c
        s, m, r = jax.lax.axis_index(self.axis), e["micro"], e["chunk"]
        kept = [_index(b, e["stash"]) for b in stash]
        key, params, passes = self._key(m), self.params, self.passes
        dh = None
        if wrt == "weights":
            saved = [_index(b, e["pending"]) for b in pending]
        else:
            dy = [_index(b, e["read"]) for b in inbox_b]
            dh, saved = passes.input_grad(params, kept, dy, key, r, m)
        if wrt == "input":
            pending = [
                _set(b, e["pending"], v) for b, v in zip(pending, saved, strict=True)
            ]
        else:
            dp = passes.weight_grad(params, kept, saved, key, r, m)
            grads = [a + b for a, b in zip(grads, dp, strict=True)]
        if dh is None:
            c = (stash, inbox_f, inbox_b, pending, grads, dx, outs)
            return c, *([self._zeros()] * 2)
        first = (s == 0) & (r == 0)
        dx = [_set_if(b, m, v, first) for b, v in zip(dx, dh, strict=True)]
        c = (stash, inbox_f, inbox_b, pending, grads, dx, outs)
        return c, self._zeros(), dh

    def _idle(self, c: Any, e: dict[str, Any]) -> Any:
        return c, self._zeros(), self._zeros()

    def _slot(self, chunks: int, c: Any, entry: dict[str, Any]) -> Any:
        """One slot: this stage's entry (`run_slots`), then the messages
        (round the ring with several chunks)."""
        actions: list[
            Callable[..., Any]
        ] = [  # in the order of the action codes (`slot_arrays`)
            self._idle,
            functools.partial(self._forward, chunks),
            functools.partial(self._backward, "both"),
            functools.partial(self._backward, "input"),
            functools.partial(self._backward, "weights"),
        ]
        c, send_f, send_b = jax.lax.switch(entry["action"], actions, c, entry)
        stash, inbox_f, inbox_b, pending, grads, dx, outs = c
        got_f, got_b = _exchange(send_f, send_b, self.axis, self.stages, chunks > 1)
        inbox_f = [
            _set_if(b, entry["prev_at"], v, entry["from_prev"] == 1)
            for b, v in zip(inbox_f, got_f, strict=True)
        ]
        inbox_b = [
            _set_if(b, entry["next_at"], v, entry["from_next"] == 1)
            for b, v in zip(inbox_b, got_b, strict=True)
        ]
        return (stash, inbox_f, inbox_b, pending, grads, dx, outs)


def _exchange(
    send_f: list[Any], send_b: list[Any], axis: str, stages: int, ring: bool
) -> tuple[list[Any], list[Any]]:
    """The activations sent on to the next stage and the cotangents back to
    the previous one (round the ring: the last stage's to stage 0 and back;
    one stage on a ring sends to itself)."""
    if stages == 1:
        return send_f, send_b
    ends = stages if ring else stages - 1
    ahead = [(i, (i + 1) % stages) for i in range(ends)]
    back = [((i + 1) % stages, i) for i in range(ends)]
    got_f = [jax.lax.ppermute(v, axis, ahead) for v in send_f]
    got_b = [jax.lax.ppermute(v, axis, back) for v in send_b]
    return got_f, got_b
