"""The slot body of a schedule whose backward is written out rather than left
to JAX's autodiff (1F1B): `StageSlots` runs a table's F and BW entries on this
stage through the engine's loop (`engine.run_slots`).

A forward entry stores the stage's input (a stash of P entries) and passes the
stage's output on; on the last stage it also runs the step's `post` (the loss
after the stack, a callback: `_step.one_f_one_b`) and its VJP, which gives the
loss, the metrics, `post`'s parameter gradients and the cotangent of the
stage's output. A backward entry recomputes the stage from its stored input
under `jax.vjp` (the stack's `remat` policy says what that recomputation
keeps) and passes the input's cotangent back; on stage 0 it is kept for the
step (the VJP of what comes before the stack).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .engine import run_slots
from .schedules import SlotArrays


def _seed(out: Any, loss: bool) -> Any:
    """The cotangent of one of `post`'s outputs: 1 for the loss, zero for the
    rest (`float0` for integers)."""
    if not jnp.issubdtype(out.dtype, jnp.inexact):
        return np.zeros(out.shape, jax.dtypes.float0)
    return jnp.ones_like(out) if loss else jnp.zeros_like(out)


def cotangent(ct: Any, primal: Any) -> Any:
    """A cotangent as `jax.vjp` takes it for `primal`: `float0` zeros where
    `primal` is not floating (an integer leaf carried beside the activations:
    a mask, positions)."""
    if jnp.issubdtype(primal.dtype, jnp.inexact):
        return ct
    return np.zeros(primal.shape, jax.dtypes.float0)


def _held(ct: Any, primal: Any) -> Any:
    """A cotangent as the schedule's buffers and messages hold it: zeros of
    `primal`'s dtype for a `float0` one (buffers are of the activations'
    dtypes)."""
    if ct.dtype == jax.dtypes.float0:
        return jnp.zeros(primal.shape, primal.dtype)
    return ct


def _index(x: Any, i: Any) -> Any:
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _set(x: Any, i: Any, v: Any) -> Any:
    return jax.lax.dynamic_update_index_in_dim(x, v, i, 0)


def _set_if(x: Any, i: Any, v: Any, when: Any) -> Any:
    return _set(x, i, jnp.where(when, v, _index(x, i)))


_TABLES = ("action", "micro", "from_prev", "prev_micro", "from_next", "next_micro")


@dataclasses.dataclass(frozen=True)
class StageSlots:
    """One minibatch's schedule on this stage: `run(table)` runs its slots and
    gives the stage's parameter gradients (leaves), stage 0's input cotangents
    per microbatch, and the last stage's outputs of `post` per microbatch.

    The loop's carry: `stash` (this stage's inputs of the microbatches in
    flight), `inbox_f` (activations received, not yet run), `inbox_b`
    (cotangents received, or made by `post` on the last stage), the gradient
    leaves, `dx` (stage 0's input cotangents) and `outs` (`post`'s outputs);
    buffers of P entries are indexed by microbatch modulo P.

    - `post`: `post(*params, *r, *y)`, the loss after the stack on one
      microbatch's other inputs `r` and the stack's output `y` (leaves), its
      outputs' first the loss (the step's callback: `_step.cut_loss`).
    - `key_tree`: the structure of the stack's key (`None` without one).
    - `stage`: `stage(params, h, key) -> y`, this stage's layers on the rows
      `h` (leaves in, leaves out).
    - `params`: the parameter leaves; `rest`: the microbatches' other inputs
      of `post`, stacked; `xs`, `keys`: the stack's input and key leaves per
      microbatch (stage 0 reads `xs`).
    - `axis`, `stages`: the stage axis and its size."""

    post: Callable[..., Any]
    key_tree: Any
    stage: Callable[..., Any]
    params: list[Any]
    rest: list[Any]
    xs: list[Any]
    keys: list[Any]
    axis: str
    stages: int

    def run(self, table: SlotArrays) -> tuple[list[Any], list[Any], list[Any]]:
        micro = int(self.xs[0].shape[0])
        buf = [jnp.zeros((self.stages, *x.shape[1:]), x.dtype) for x in self.xs]
        out_shapes = jax.eval_shape(
            self._post, self.params, [r[0] for r in self.rest], [x[0] for x in self.xs]
        )
        init = (
            buf,
            buf,
            buf,
            [jnp.zeros_like(x) for x in self.params],
            [jnp.zeros_like(x) for x in self.xs],
            [jnp.zeros((micro, *o.shape), o.dtype) for o in out_shapes],
        )
        _, _, _, grads, dx, outs = run_slots(
            table, _TABLES, axis=self.axis, step=self._slot, init=init
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

    def _forward(self, c: Any, m: Any) -> Any:
        stash, inbox_f, inbox_b, grads, dx, outs = c
        s, stages = jax.lax.axis_index(self.axis), self.stages
        h = [
            jnp.where(s == 0, _index(x, m), _index(f, m % stages))
            for x, f in zip(self.xs, inbox_f, strict=True)
        ]
        stash = [_set(b, m % stages, v) for b, v in zip(stash, h, strict=True)]
        y = self.stage(self.params, h, self._key(m))

        def last(args: Any) -> Any:
            inbox_b, grads, outs = args
            r = [_index(x, m) for x in self.rest]
            out, vjp = jax.vjp(lambda p, y: self._post(p, r, y), self.params, y)
            dp, dy = vjp([_seed(o, i == 0) for i, o in enumerate(out)])
            grads = [a + b for a, b in zip(grads, dp, strict=True)]
            dy = [_held(d, v) for d, v in zip(dy, y, strict=True)]
            inbox_b = [_set(b, m % stages, v) for b, v in zip(inbox_b, dy, strict=True)]
            outs = [_set(b, m, v) for b, v in zip(outs, out, strict=True)]
            return inbox_b, grads, outs

        inbox_b, grads, outs = jax.lax.cond(
            s == stages - 1, last, lambda a: a, (inbox_b, grads, outs)
        )
        return (stash, inbox_f, inbox_b, grads, dx, outs), y, self._zeros()

    def _backward(self, c: Any, m: Any) -> Any:
        stash, inbox_f, inbox_b, grads, dx, outs = c
        s, stages = jax.lax.axis_index(self.axis), self.stages
        h = [_index(b, m % stages) for b in stash]
        dy = [_index(b, m % stages) for b in inbox_b]
        key = self._key(m)
        y, vjp = jax.vjp(lambda p, h: self.stage(p, h, key), self.params, h)
        dp, dh = vjp([cotangent(d, v) for d, v in zip(dy, y, strict=True)])
        dh = [_held(d, v) for d, v in zip(dh, h, strict=True)]
        grads = [a + b for a, b in zip(grads, dp, strict=True)]
        dx = [_set_if(b, m, v, s == 0) for b, v in zip(dx, dh, strict=True)]
        return (stash, inbox_f, inbox_b, grads, dx, outs), self._zeros(), dh

    def _idle(self, c: Any, m: Any) -> Any:
        return c, self._zeros(), self._zeros()

    def _slot(self, c: Any, entry: dict[str, Any]) -> Any:
        """One slot: this stage's entry (`run_slots`), then the messages."""
        stages, axis = self.stages, self.axis
        actions = [self._idle, self._forward, self._backward]
        c, send_f, send_b = jax.lax.switch(entry["action"], actions, c, entry["micro"])
        if stages == 1:
            return c
        stash, inbox_f, inbox_b, grads, dx, outs = c
        ahead = [(i, i + 1) for i in range(stages - 1)]
        back = [(i + 1, i) for i in range(stages - 1)]
        got_f = [jax.lax.ppermute(v, axis, ahead) for v in send_f]
        got_b = [jax.lax.ppermute(v, axis, back) for v in send_b]
        inbox_f = [
            _set_if(b, entry["prev_micro"] % stages, v, entry["from_prev"] == 1)
            for b, v in zip(inbox_f, got_f, strict=True)
        ]
        inbox_b = [
            _set_if(b, entry["next_micro"] % stages, v, entry["from_next"] == 1)
            for b, v in zip(inbox_b, got_b, strict=True)
        ]
        return (stash, inbox_f, inbox_b, grads, dx, outs)
