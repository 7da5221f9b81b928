"""The global view's loss under the 1F1B schedule: what follows the pipelined
`Stacked` (`post`) runs once per microbatch on one device's rows (a slice), yet
the loss must be the one of the whole batch, as on one device.

`post` is traced twice, on a slice's shapes and on the whole minibatch's, and
the two programs are read side by side (a value "has rows" where its shapes
differ). Every value of the slice's program gets a class:

- `GLOBAL`: the same on every slice as on the whole batch: the parameters,
  literals (a count of the rows takes the whole batch's), and the values that
  depend on the batch only and reduce over its rows (`mask.sum()`), which are
  *hoisted*: computed once on the whole batch (gathered over the data axes).
- `ROWS`: per row (the stack's output, a row's loss).
- `SHARE`: a sum over the rows and the linear combinations of such sums with
  global factors (`sum(ce * mask) / mask.sum()`, `losses.mean()`): the slices'
  values add up to the whole batch's.
- `COUPLED`: anything else (`log(losses.mean())`, `ce - ce.mean()`): no sum of
  per-slice values gives it, and the step says so rather than train on another
  loss.

A global term added to a share (a regulariser of the parameters) enters each
slice divided by the number of slices. Metrics keep their per-microbatch
meaning: they come from `post` as traced, summed as in the device view."""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

GLOBAL, SHARE, ROWS, COUPLED = "global", "share", "rows", "coupled"

_CALLS: tuple[str, ...] = ("jit", "pjit", "closed_call", "core_call")
_CALLS += ("custom_jvp_call", "custom_vjp_call", "checkpoint", "remat")
_ADDS = ("add", "sub", "add_any")
_LINEAR: tuple[str, ...] = ("neg", "reduce_sum", "reshape", "squeeze")
_LINEAR += ("broadcast_in_dim",)
_LINEAR += ("expand_dims", "copy", "copy_p", "transpose", "stop_gradient")
# Primitives that mix values along an axis they name (param), kept as rows.
_ALONG = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis"}
_ALONG |= {"cumlogsumexp": "axis", "sort": "dimension", "rev": "dimensions"}

FIXES = (
    "Use schedule='gpipe' (or 'circular'), which runs the loss once on the "
    "whole batch, or return the loss as a pair `(loss_sum, weight)` of sums "
    "over the rows (e.g. `(jnp.sum(ce * mask), jnp.sum(mask))`)."
)


@dataclasses.dataclass
class Found:
    """What `analyse` finds in `post`: each value's class (`classes`), why a
    value is `COUPLED` (`why`), the hoisted values (slice's and whole batch's
    variables), and the whole batch's literals that replace the slice's
    (`literals`, by `(equation, operand)`; `(-1, output)` for an output)."""

    classes: dict[Any, str] = dataclasses.field(default_factory=dict)
    model: dict[Any, bool] = dataclasses.field(default_factory=dict)
    why: dict[Any, str] = dataclasses.field(default_factory=dict)
    hoisted: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    literals: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)

    def cls(self, v: Any) -> str:
        return GLOBAL if isinstance(v, jex.Literal) else self.classes[v]


def _var(v: Any) -> bool:
    return isinstance(v, jex.Var)


def _rows(a: Any, b: Any) -> bool:
    if isinstance(a, jex.Literal):
        return False
    return tuple(a.aval.shape) != tuple(b.aval.shape)


def _ratio(a: Any, b: Any) -> float:
    return float(np.prod(b.aval.shape)) / max(float(np.prod(a.aval.shape)), 1.0)


def _inner(eqn: Any) -> Any:
    j = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return getattr(j, "jaxpr", j)


def _mismatch(name: str) -> ValueError:
    return ValueError(
        "make_train_step (schedule='1f1b', view='global'): the loss's program "
        f"after the pipelined Stacked differs between a microbatch's rows and the "
        f"whole batch's (at `{name}`), so the whole batch's loss cannot be cut "
        "into the microbatches' shares. Make the loss's operations independent "
        f"of the number of rows. {FIXES}"
    )


def analyse(local: Any, whole: Any, kinds: list[str], top: bool = True) -> Found:
    """The classes of `local`'s values (a `Jaxpr`), read beside `whole` (the
    same program on the whole batch's shapes); `kinds` says what each input
    is: `"param"`, `"batch"`, `"key"`, `"stack"` (the stack's output), or a
    class (inside a call)."""
    found = Found()
    for v in local.constvars:
        found.classes[v], found.model[v] = GLOBAL, False
    for v, w, kind in zip(local.invars, whole.invars, kinds, strict=True):
        if kind in (GLOBAL, SHARE, ROWS, COUPLED):
            found.classes[v], found.model[v] = kind, kind != GLOBAL
        else:
            found.classes[v] = ROWS if kind != "param" and _rows(v, w) else GLOBAL
            found.classes[v] = ROWS if kind == "key" else found.classes[v]
            found.model[v] = kind != "batch"
    if len(local.eqns) != len(whole.eqns):
        raise _mismatch("the number of operations")
    for i, (eqn, other) in enumerate(zip(local.eqns, whole.eqns, strict=True)):
        _visit(found, i, eqn, other, top)
    for j, (v, w) in enumerate(zip(local.outvars, whole.outvars, strict=True)):
        if isinstance(v, jex.Literal) and not np.array_equal(v.val, w.val):
            found.literals[(-1, j)] = w
    return found


def _visit(found: Found, i: int, eqn: Any, other: Any, top: bool) -> None:
    name = eqn.primitive.name
    if name != other.primitive.name or len(eqn.invars) != len(other.invars):
        raise _mismatch(name)
    pairs = list(zip(eqn.invars, other.invars, strict=True))
    outs = list(zip(eqn.outvars, other.outvars, strict=True))
    ins = [found.cls(v) for v in eqn.invars]
    named = [v for v in eqn.invars if isinstance(v, jex.Var)]
    model = any(found.model.get(v, False) for v in named)
    rows_in = any(_rows(a, b) for a, b in pairs)
    rows_out = [_rows(a, b) for a, b in outs]
    why = next((found.why[v] for v in named if v in found.why), None)
    differs = [
        j
        for j, (a, b) in enumerate(pairs)
        if isinstance(a, jex.Literal) and not np.array_equal(a.val, b.val)
    ]
    if top:
        found.literals.update({(i, j): pairs[j][1] for j in differs})
    if top and not model and rows_in and not any(rows_out):
        classes = [GLOBAL] * len(outs)  # hoisted: computed on the whole batch
        found.hoisted += outs
    elif differs and not top:
        classes = [COUPLED] * len(outs)
        why = f"a count of the rows inside `{name}`"
    elif why is not None:
        classes = [COUPLED] * len(outs)
    elif name in _CALLS and set(ins) != {GLOBAL}:
        inner = analyse(_inner(eqn), _inner(other), ins, top=False)
        classes = [inner.cls(v) for v in _inner(eqn).outvars]
        whys = [inner.why.get(v) for v in _inner(eqn).outvars if _var(v)]
        why = next((w for w in whys if w), None)
    elif not top and name in _ADDS and {SHARE, GLOBAL} <= set(ins):
        # Only the outer program's global terms are divided among the slices.
        classes = [COUPLED] * len(outs)
        why = f"a term of the whole batch added to a sum over the rows inside `{name}`"
    else:
        classes, why = _rule(eqn, other, ins, rows_out)
    for (v, _), c in zip(outs, classes, strict=True):
        found.classes[v], found.model[v] = c, model
        if c == COUPLED:
            found.why[v] = why or f"`{name}`"


def _rule(eqn: Any, other: Any, ins: list[str], rows_out: list[bool]) -> Any:
    """The classes of `eqn`'s outputs (with a reason for `COUPLED`)."""
    name = eqn.primitive.name
    if set(ins) == {GLOBAL} or not ins:
        return [ROWS if r else GLOBAL for r in rows_out], None
    if SHARE in ins:
        return [_linear(eqn, ins)] * len(rows_out), (
            f"`{name}` to a sum over the rows of the stack's output"
        )
    pairs = list(zip(eqn.invars, other.invars, strict=True))
    outs = list(zip(eqn.outvars, other.outvars, strict=True))
    if any(_rows(a, b) for a, b in pairs) and not any(rows_out):
        # A reduction over the rows: a sum adds up over the slices.
        if name in ("reduce_sum", "dot_general"):
            return [SHARE] * len(outs), None
        return [COUPLED] * len(outs), f"`{name}` over the rows of the stack's output"
    if name in _ALONG:
        axes = eqn.params[_ALONG[name]]
        axes = axes if isinstance(axes, tuple) else (axes,)
        a, b = pairs[0]
        if any(a.aval.shape[d] != b.aval.shape[d] for d in axes):
            return [COUPLED] * len(outs), f"`{name}` along the rows"
    ratios = {_ratio(a, b) for a, b in pairs + outs if _rows(a, b)}
    if len(ratios) > 1:
        return [COUPLED] * len(outs), f"`{name}`, which drops or adds rows"
    return [ROWS] * len(outs), None


def _linear(eqn: Any, ins: list[str]) -> str:
    """The class of an operation on a share: a share if it is linear in it."""
    name, shares = eqn.primitive.name, ins.count(SHARE)
    if ROWS in ins:
        return COUPLED
    if name in _ADDS or name in _LINEAR:
        return SHARE
    if name == "convert_element_type":
        floating = jnp.issubdtype(eqn.params["new_dtype"], jnp.inexact)
        return SHARE if floating else COUPLED
    if name in ("mul", "dot_general") and shares == 1:
        return SHARE
    if name == "div" and ins == [SHARE, GLOBAL]:
        return SHARE
    return COUPLED


@dataclasses.dataclass(frozen=True)
class Shares:
    """`post`'s loss outputs (`(loss_sum, weight)`) as shares of the whole
    batch's: `evaluate(globals, slices, *args)` on a slice's `args`, with the
    hoisted values `globals` (`whole(batch)` on the whole batch's leaves)."""

    local: Any  # ClosedJaxpr
    found: Found
    whole: Callable[..., Any]
    outputs: tuple[str, ...]
    order: tuple[int, ...]

    def evaluate(self, globals: list[Any], slices: int, *args: Any) -> list[Any]:
        jaxpr, found = self.local.jaxpr, self.found
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, self.local.consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        env.update(zip([v for v, _ in found.hoisted], globals, strict=True))

        def read(v: Any, at: tuple[int, int]) -> Any:
            v = found.literals.get(at, v)
            return v.val if isinstance(v, jex.Literal) else env[v]

        for i in self.order:
            eqn = jaxpr.eqns[i]
            vals = [read(v, (i, j)) for j, v in enumerate(eqn.invars)]
            classes = [found.cls(v) for v in eqn.invars]
            if eqn.primitive.name in _ADDS and SHARE in classes:
                # A global term of a share: each slice adds its part.
                vals = [
                    _part(x, v, slices) if c == GLOBAL else x
                    for x, v, c in zip(vals, eqn.invars, classes, strict=True)
                ]
            with eqn.ctx.manager:
                out = eqn.primitive.bind(
                    *vals, **eqn.primitive.get_bind_params(eqn.params)
                )
            out = out if eqn.primitive.multiple_results else [out]
            env.update(zip(eqn.outvars, out, strict=True))
        outs = [read(v, (-1, j)) for j, v in enumerate(jaxpr.outvars[:2])]
        return [
            o if c == SHARE else _part(o, v, slices)
            for o, v, c in zip(outs, jaxpr.outvars, self.outputs, strict=False)
        ]


def _part(x: Any, v: Any, slices: int) -> Any:
    return (jnp.asarray(x) / slices).astype(v.aval.dtype)


def shares(local: Any, whole: Any, kinds: list[str], weighted: bool) -> Shares:
    """`Shares` of `post` (`local` on a slice's shapes, `whole` on the whole
    batch's, both `ClosedJaxpr`s) or a `ValueError` saying what couples the
    microbatches."""
    found = analyse(local.jaxpr, whole.jaxpr, kinds)
    outvars = local.jaxpr.outvars[: 2 if weighted else 1]
    outputs = tuple(found.cls(v) for v in outvars)
    for what, v, c in zip(("loss", "weight"), outvars, outputs, strict=False):
        if c not in (SHARE, GLOBAL):
            cause = found.why.get(v) if _var(v) else None
            cause = cause or "a value per row or per microbatch"
            raise ValueError(
                "make_train_step (schedule='1f1b', view='global'): the 1F1B "
                "schedule runs the loss once per microbatch, and the whole "
                f"batch's {what} is no sum of the microbatches' parts: it applies "
                f"{cause}, which couples the microbatches. Sums over the rows, "
                "scaled by whole-batch quantities of the batch alone (`mask.sum()`, "
                f"the row count), are exact. {FIXES}"
            )
    hoisted = {v for v, _ in found.hoisted}
    order = _order(local.jaxpr, local.jaxpr.outvars[:2], hoisted)
    used = {v for i in order for v in local.jaxpr.eqns[i].invars if _var(v)}
    used |= {v for v in local.jaxpr.outvars[:2] if _var(v)}
    found.hoisted = [(v, w) for v, w in found.hoisted if v in used]
    wanted = [w for v, w in found.hoisted]
    eqns = _order(whole.jaxpr, wanted, set())
    sub = jex.Jaxpr(
        whole.jaxpr.constvars,
        [v for v, k in zip(whole.jaxpr.invars, kinds, strict=True) if k == "batch"],
        wanted,
        [whole.jaxpr.eqns[i] for i in eqns],
        whole.jaxpr.effects,
        whole.jaxpr.debug_info,
    )
    fun = jex.jaxpr_as_fun(jex.ClosedJaxpr(sub, whole.consts))
    return Shares(local, found, fun, outputs, order)


def _order(jaxpr: Any, outvars: list[Any], stop: set[Any]) -> tuple[int, ...]:
    """The indices of the equations `outvars` depend on, not past `stop`."""
    need = {v for v in outvars if isinstance(v, jex.Var) and v not in stop}
    kept = []
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if any(v in need for v in eqn.outvars):
            kept.append(i)
            need.update(
                v for v in eqn.invars if isinstance(v, jex.Var) and v not in stop
            )
    return tuple(kept[::-1])
