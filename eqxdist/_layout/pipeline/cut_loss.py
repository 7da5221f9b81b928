"""The loss cut at the pipelined stack, for the 1F1B schedule
(`one_f_one_b`): the loss is traced once on one microbatch with the stack
replaced by a marker (`stages.MarkedStack`, a `jax.jit` named
`MARKER`); its program is cut there into `pre` (the loss's inputs to the
stack's input: the embedding) and `post` (the stack's output, with the inputs,
to the loss and its metrics: the head). Both are ordinary functions JAX
differentiates.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex

from .stages import MARKER


@dataclasses.dataclass(frozen=True)
class CutLoss:
    """`loss(args)` cut at the stack: `pre(args) -> stack input leaves` and
    `post(args, stack output leaves) -> loss output leaves` (`out_tree`), both
    on the flattened `args`; `x_tree` the stack input's structure, `key` its
    key's (`None` without one), `key_rows` whether that key is per row,
    `per_row` whether the blocks take one row (the loss's `vmap`) or a batch;
    `jaxpr` is `post`'s program and `kinds` says what each of its inputs is
    (`"param"`, `"batch"`, `"key"`, `"stack"`: `hoist.analyse`), `pre_jaxpr`
    `pre`'s; `aux` the
    shapes of one microbatch's aux accumulator, for blocks that return `(x,
    aux)` (`_layout.stack_aux`; the stack's output leaves then end with its
    leaves), else `None`."""

    pre: Callable[..., Any]
    post: Callable[..., Any]
    out_tree: Any
    x_tree: Any
    key_tree: Any
    key_rows: bool
    per_row: bool
    jaxpr: Any = None
    kinds: tuple[str, ...] = ()
    aux: Any = None
    pre_jaxpr: Any = None


def cut(
    loss: Callable[..., Any], args: Any, seen: dict[str, Any], schedule: str
) -> CutLoss:
    """Trace `loss(*args)` (whose model holds a `MarkedStack`, which records
    what it sees in `seen`) and cut it at the marker."""
    closed, out_shape = jax.make_jaxpr(loss, return_shape=True)(*args)
    jaxpr = closed.jaxpr
    marks = [
        i
        for i, e in enumerate(jaxpr.eqns)
        if e.primitive.name in ("jit", "pjit") and e.params.get("name") == MARKER
    ]
    if len(marks) != 1:
        raise ValueError(
            f"pipeline (schedule={schedule!r}): the loss must call the pipelined "
            "Stacked exactly once (on its rows under jax.vmap, as `jax.vmap(model)(x)` "
            "does, or on a batch), outside any jax.jit, jax.checkpoint or loop of "
            f"its own; it is called {len(marks)} times so. Use schedule='gpipe', "
            "which has no such limit, or call the model so."
        )
    mark = jaxpr.eqns[marks[0]]
    others = [e for i, e in enumerate(jaxpr.eqns) if i != marks[0]]
    pre = _closed(closed, jaxpr.invars, list(mark.invars), _needed(others, mark.invars))
    post_eqns = _needed(others, jaxpr.outvars)
    post = _closed(closed, [*jaxpr.invars, *mark.outvars], jaxpr.outvars, post_eqns)
    kinds = [
        kind
        for kind, arg in zip(("param", "batch", "key"), args, strict=True)
        for _ in jax.tree.leaves(arg)
    ]
    return CutLoss(
        jex.jaxpr_as_fun(pre),
        jex.jaxpr_as_fun(post),
        jax.tree.structure(out_shape),
        seen["x"],
        seen["key"],
        seen["key_rows"],
        seen["per_row"],
        post,
        (*kinds, *["stack"] * len(mark.outvars)),
        seen.get("aux"),
        pre,
    )


def _needed(eqns: list[Any], outvars: list[Any]) -> list[Any]:
    """The equations `outvars` depend on, in order."""
    need = {v for v in outvars if isinstance(v, jex.Var)}
    kept = []
    for eqn in reversed(eqns):
        if eqn.effects or any(v in need for v in eqn.outvars):
            kept.append(eqn)
            need.update(v for v in eqn.invars if isinstance(v, jex.Var))
    return kept[::-1]


def _closed(closed: Any, invars: list[Any], outvars: list[Any], eqns: list[Any]) -> Any:
    jaxpr = closed.jaxpr
    new = jex.Jaxpr(
        jaxpr.constvars,
        invars,
        outvars,
        eqns,
        jaxpr.effects,
        jaxpr.debug_info.with_unknown_names()
        if hasattr(jaxpr.debug_info, "with_unknown_names")
        else jaxpr.debug_info,
    )
    return jex.ClosedJaxpr(new, closed.consts)
