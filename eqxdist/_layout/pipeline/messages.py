"""The messages between neighbouring stages, once per slot of a schedule's
loop (`engine.ForwardEngine`, `stage_slots.StageSlots`): activations to the
next stage, cotangents back to the previous one, sent the way the backend
runs fastest.

On XLA:CPU a `ppermute` (a collective-permute) is the slow collective: on
the 8 simulated devices of a `{"stage": 4, "data": 2}` mesh, a slot sending
a 16 x 128 float32 block each way costs 0.28 ms by two `ppermute`s (0.14 ms
one way) and 0.11 ms by one `all_to_all` of a 4 x 2 x 16 x 128 block
carrying both (P times the bytes; `python benchmarks/bench_pipeline.py
--only messages`, 2026-12-04). There each slot's messages are one
`all_to_all` per leaf carrying both directions. Elsewhere (GPUs, TPUs) they
are `ppermute`s: point-to-point sends of only the bytes needed, which XLA
runs asynchronously (no GPU was measured).

The values received are the same either way: where no stage sends to a
stage (the ends of a pipeline that is not a ring), zeros.
"""

from typing import Any

import jax
import jax.numpy as jnp


def by_all_to_all() -> bool:
    """Whether messages go by `all_to_all` (XLA:CPU; see the module
    docstring)."""
    return jax.default_backend() == "cpu"


def exchange(
    ahead: list[Any] | None,
    back: list[Any] | None,
    *,
    axis: str,
    stages: int,
    ring: bool,
) -> tuple[list[Any] | None, list[Any] | None]:
    """`ahead`'s leaves sent on to the next stage over `axis` (of `stages`)
    and `back`'s to the previous one (`None`: nothing that way), what each
    stage receives: on a `ring` the last stage's `ahead` goes to stage 0 and
    stage 0's `back` to the last stage; otherwise those ends receive zeros.
    One stage on a ring sends to itself."""
    if stages == 1:
        return ahead, back
    if by_all_to_all():
        return _all_to_all(ahead, back, axis, stages, ring)
    ends = stages if ring else stages - 1
    forward = [(i, (i + 1) % stages) for i in range(ends)]
    backward = [((i + 1) % stages, i) for i in range(ends)]

    def send(values: list[Any] | None, perm: list[tuple[int, int]]) -> Any:
        if values is None:
            return None
        return [jax.lax.ppermute(v, axis, perm) for v in values]

    return send(ahead, forward), send(back, backward)


def _all_to_all(
    ahead: list[Any] | None,
    back: list[Any] | None,
    axis: str,
    stages: int,
    ring: bool,
) -> tuple[list[Any] | None, list[Any] | None]:
    """`exchange` by `all_to_all`: each stage writes its leaf for the next
    stage at that stage's row of a `(stages, 2, ...)` block (column 0) and
    its leaf for the previous stage at that one's (column 1); a leaf of each
    way of the same shape and dtype share one block (a stage's activations and
    their cotangents do)."""
    s = jax.lax.axis_index(axis)
    nxt, prev = (s + 1) % stages, (s - 1) % stages
    # What arrives at a stage no stage sends to (off a ring): zeros.
    first, last = (s == 0) & (not ring), (s == stages - 1) & (not ring)
    fwd, bwd = list(ahead or []), list(back or [])
    got_f: list[Any] = [None] * len(fwd)
    got_b: list[Any] = [None] * len(bwd)

    def send(a: Any, b: Any) -> tuple[Any, Any]:
        like = a if a is not None else b
        block = jnp.zeros((stages, 2, *like.shape), like.dtype)
        if a is not None:
            block = block.at[nxt, 0].set(a)
        if b is not None:
            block = block.at[prev, 1].set(b)
        got = jax.lax.all_to_all(block, axis, 0, 0, tiled=False)
        came_f = jnp.where(first, jnp.zeros_like(got[prev, 0]), got[prev, 0])
        came_b = jnp.where(last, jnp.zeros_like(got[nxt, 1]), got[nxt, 1])
        return came_f, came_b

    for i in range(max(len(fwd), len(bwd))):
        a = fwd[i] if i < len(fwd) else None
        b = bwd[i] if i < len(bwd) else None
        if a is not None and b is not None and (a.shape, a.dtype) != (b.shape, b.dtype):
            got_f[i], _ = send(a, None)
            _, got_b[i] = send(None, b)
            continue
        came_f, came_b = send(a, b)
        if a is not None:
            got_f[i] = came_f
        if b is not None:
            got_b[i] = came_b
    return (got_f if ahead is not None else None), (got_b if back is not None else None)
