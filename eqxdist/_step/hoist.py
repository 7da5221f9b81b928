"""The loss under a schedule that runs what follows the pipelined `Stacked`
(`post`) once per microbatch (1F1B, interleaved, ZB-H1), one device's rows (a
slice) at a time, while the loss must be the one of the rows the step was
given: each device's minibatch (device view) or the whole batch (global view).

`post` is traced twice, on a slice's shapes and on the whole's, and the two
programs are read side by side; each value of the slice's program gets a class,
and a value with rows its row axis, followed operation by operation
(`row_rules`):

- `GLOBAL`: the same on every slice as on the whole: the parameters, literals
  (a count of the rows takes the whole's), and the values that depend on the
  batch only and reduce over its rows (`mask.sum()`), which are *hoisted*:
  computed once on the whole rows.
- `ROWS`: per row along its row axis: the whole's value is the slices' put
  together along it (the stack's output, a row's loss).
- `SHARE`: a sum over the rows and the linear combinations of such sums with
  global factors (`sum(ce * mask) / mask.sum()`, `losses.mean()`): the slices'
  values add up to the whole's.
- `COUPLED`: anything not proven one of those (`log(losses.mean())`,
  `s[: n // 2]`, `jnp.arange(n)`, a sort of the rows): no sum of per-slice
  values gives it, and the step says so rather than train on another loss.

A global term added to a share (a regulariser of the parameters) enters each
slice divided by the number of slices, so that it counts once. The loss's value
and metrics are not read from the slices (`one_f_one_b` runs `post` on the
whole rows for them); only the gradients are."""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from .row_rules import NOISE, coupled, row_rule, where

GLOBAL, SHARE, ROWS, COUPLED = "global", "share", "rows", "coupled"

_CALLS: tuple[str, ...] = ("jit", "pjit", "closed_call", "core_call")
_CALLS += ("custom_jvp_call", "custom_vjp_call", "checkpoint", "remat")
_ADDS = ("add", "sub", "add_any")
_LINEAR: tuple[str, ...] = ("neg", "reduce_sum", "reshape", "squeeze")
_LINEAR += ("broadcast_in_dim",)
_LINEAR += ("expand_dims", "copy", "copy_p", "transpose", "stop_gradient")


def fixes(schedule: str) -> str:
    return (
        f"Use schedule='gpipe', which runs the loss once on the rows it is given "
        f"(schedule={schedule!r} runs it once per microbatch), or return the loss "
        "as a pair `(loss_sum, weight)` of sums over the rows (e.g. "
        "`(jnp.sum(ce * mask), jnp.sum(mask))`)."
    )


class Mismatch(Exception):
    """The slice's and the whole's programs differ (at the operation named)."""


@dataclasses.dataclass
class Found:
    """What `analyse` finds in `post`: each value's class (`classes`) and row
    axis (`axes`, for `ROWS`), why a value is `COUPLED` (`why`), the hoisted
    values (slice's and whole batch's variables), and the whole batch's
    literals that replace the slice's (`literals`, by `(equation, operand)`;
    `(-1, output)` for an output)."""

    classes: dict[Any, str] = dataclasses.field(default_factory=dict)
    axes: dict[Any, int | None] = dataclasses.field(default_factory=dict)
    model: dict[Any, bool] = dataclasses.field(default_factory=dict)
    why: dict[Any, str] = dataclasses.field(default_factory=dict)
    hoisted: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    literals: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    noise: bool = False  # the key differs per slice: noise over the rows is fine

    def cls(self, v: Any) -> str:
        return GLOBAL if isinstance(v, jex.Literal) else self.classes[v]

    def of(self, v: Any) -> tuple[str, int | None]:
        if isinstance(v, jex.Literal):
            return GLOBAL, None
        return self.classes[v], self.axes.get(v)

    def set(self, v: Any, c: str, axis: int | None, model: bool, why: Any) -> None:
        self.classes[v], self.axes[v], self.model[v] = c, axis, model
        if c == COUPLED:
            self.why[v] = why


def _same(a: Any, b: Any) -> bool:
    """Whether two literals are the same constant: a NaN equals a NaN (`jnp.var`
    writes one into its program for an empty reduction)."""
    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if np.issubdtype(x.dtype, np.inexact):
        return bool(np.array_equal(x, y, equal_nan=True))
    return bool(np.array_equal(x, y))


def _var(v: Any) -> bool:
    return isinstance(v, jex.Var)


def _diff(a: Any, b: Any) -> list[int]:
    """The axes on which `a` (slice) and `b` (whole) differ in size."""
    if isinstance(a, jex.Literal):
        return []
    x, y = tuple(a.aval.shape), tuple(b.aval.shape)
    if len(x) != len(y):
        raise Mismatch("a value's rank")
    return [d for d in range(len(x)) if x[d] != y[d]]


def _inner(eqn: Any) -> Any:
    j = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return getattr(j, "jaxpr", j)


def analyse(
    local: Any, whole: Any, kinds: list[Any], top: bool = True, noise: bool = False
) -> Found:
    """The classes of `local`'s values (a `Jaxpr`), read beside `whole` (the
    same program on the whole rows' shapes); `kinds` says what each input is:
    `"param"`, `"batch"`, `"key"`, `"stack"` (the stack's output), or a
    `(class, axis)` pair (inside a call). `top`: the outer program (whose
    literals and batch-only reductions `Shares` replaces by the whole's);
    `noise`: the key differs per slice, so random draws over the rows are
    per-row noise (the device view), not the whole's."""
    found = Found(noise=noise)
    for v in local.constvars:
        found.set(v, GLOBAL, None, False, None)
    for v, w, kind in zip(local.invars, whole.invars, kinds, strict=True):
        if isinstance(kind, tuple):
            c, axis = kind
            found.set(v, c, axis, c != GLOBAL, "an input")
            continue
        d = [] if kind == "param" else _diff(v, w)
        c = GLOBAL if not d else ROWS if len(d) == 1 else COUPLED
        found.set(v, c, d[0] if c == ROWS else None, kind != "batch", "an input")
    if len(local.eqns) != len(whole.eqns):
        raise Mismatch("the number of operations")
    for i, (eqn, other) in enumerate(zip(local.eqns, whole.eqns, strict=True)):
        _visit(found, i, eqn, other, top)
    for j, (v, w) in enumerate(zip(local.outvars, whole.outvars, strict=True)):
        if isinstance(v, jex.Literal) and not _same(v.val, w.val):
            found.literals[(-1, j)] = w
    return found


def _visit(found: Found, i: int, eqn: Any, other: Any, top: bool) -> None:
    name = eqn.primitive.name
    if name != other.primitive.name or len(eqn.invars) != len(other.invars):
        raise Mismatch(name)
    pairs = list(zip(eqn.invars, other.invars, strict=True))
    outs = list(zip(eqn.outvars, other.outvars, strict=True))
    ins = [found.of(v) for v in eqn.invars]
    named = [v for v in eqn.invars if isinstance(v, jex.Var)]
    model = any(found.model.get(v, False) for v in named)
    rows_in = any(c == ROWS for c, _ in ins)
    rows_out = [_diff(a, b) for a, b in outs]
    why = next((found.why[v] for v in named if v in found.why), None)
    differs = [
        j
        for j, (a, b) in enumerate(pairs)
        if isinstance(a, jex.Literal) and not _same(a.val, b.val)
    ]
    if top:
        found.literals.update({(i, j): pairs[j][1] for j in differs})
    result: list[tuple[str, int | None]]
    if top and not model and rows_in and not any(rows_out):
        result = [(GLOBAL, None)] * len(outs)  # hoisted: computed on the whole
        found.hoisted += outs
    elif differs and not top:
        result, why = [], f"a count of the rows inside `{name}`{where(eqn)}"
    elif why is not None:
        result = []
    elif name in _CALLS and (rows_in or any(rows_out) or SHARE in dict(ins)):
        inner = analyse(_inner(eqn), _inner(other), ins, top=False, noise=found.noise)
        result = [inner.of(v) for v in _inner(eqn).outvars]
        whys = [inner.why.get(v) for v in _inner(eqn).outvars if _var(v)]
        why = next((w for w in whys if w), None)
        if why is not None and " (at " not in why:
            why += where(eqn)  # the user's call of a function JAX jits
    elif not top and name in _ADDS and {SHARE, GLOBAL} <= {c for c, _ in ins}:
        # Only the outer program's global terms are divided among the slices.
        result = []
        why = f"a term added to a sum over the rows inside `{name}`{where(eqn)}"
    else:
        result, why = _rule(found, eqn, other, ins, rows_out)
    if len(result) != len(outs):
        result = [(COUPLED, None)] * len(outs)
    for (v, _), (c, axis), d in zip(outs, result, rows_out, strict=True):
        if c != COUPLED and d != ([axis] if c == ROWS else []):
            # What the rule says does not match the whole's shapes: not proven.
            c, why = COUPLED, why or coupled(eqn)[1]
        found.set(v, c, axis, model, why or f"`{name}`{where(eqn)}")


def _rule(
    found: Found, eqn: Any, other: Any, ins: list[Any], rows_out: list[list[int]]
) -> Any:
    """The `(class, axis)` of `eqn`'s outputs (`[]` and a reason: coupled)."""
    name = eqn.primitive.name
    classes = {c for c, _ in ins}
    if classes <= {GLOBAL}:
        if not any(rows_out):
            return [(GLOBAL, None)] * len(rows_out), None
        # A value of no rows made as long as the rows: a broadcast is the same
        # on every row; an iota, or noise drawn over them, is not.
        if len(rows_out) == 1 and len(rows_out[0]) == 1:
            (axis,) = rows_out[0]
            if _constant_over(eqn, axis) or (found.noise and name in NOISE):
                return [(ROWS, axis)], None
        if name in NOISE:
            return [], (
                f"`{name}`{where(eqn)}, noise drawn over the rows from one key "
                "(`jax.random.split(key, rows)`, a draw of the rows' shape): one "
                "device draws it over all the rows at once"
            )
        return coupled(eqn, "making a value as long as the rows (an iota)")
    if SHARE in classes:
        c = _linear(eqn, [c for c, _ in ins])
        why = f"`{name}`{where(eqn)} to a sum over the rows"
        return [(c, None)] * len(rows_out), why
    return row_rule(eqn, other, ins)


def _constant_over(eqn: Any, axis: int) -> bool:
    """Whether `eqn` (of no rows in) makes a value the same on every index of
    its output's `axis`: a broadcast along it, an iota along another axis."""
    name, p = eqn.primitive.name, eqn.params
    if name == "iota":
        return bool(p["dimension"] != axis)
    if name != "broadcast_in_dim":
        return False
    dims = list(p["broadcast_dimensions"])
    return axis not in dims or eqn.invars[0].aval.shape[dims.index(axis)] == 1


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


@dataclasses.dataclass(frozen=True)
class Where:
    """The step asking: its schedule and view, for the errors' texts."""

    schedule: str
    view: str

    def refuse(self, what: str, cause: str) -> ValueError:
        return ValueError(
            f"make_train_step (schedule={self.schedule!r}, view={self.view!r}): "
            f"this schedule runs the loss once per microbatch, and {what} is not "
            f"proven the microbatches' own: the loss applies {cause}, which mixes "
            "rows of different microbatches. Sums over the rows of per-row values, "
            "scaled by quantities of the batch alone (`mask.sum()`, the row "
            f"count), are exact. {fixes(self.schedule)}"
        )

    def found(self, local: Any, whole: Any, kinds: list[Any], **kw: Any) -> Found:
        try:
            return analyse(local.jaxpr, whole.jaxpr, kinds, **kw)
        except Mismatch as e:
            raise self.refuse(
                "the loss's program",
                f"operations that differ between a microbatch's rows and the "
                f"whole rows' (at {e})",
            ) from None


def check_pre(
    local: Any, whole: Any, kinds: list[Any], rows: list[bool], at: Where
) -> None:
    """A `ValueError` unless each output of `pre` (the stack's input leaves,
    then its key's) is per row on axis 0 where `rows` says so, else the same on
    every microbatch (`GLOBAL`; in the device view a key may differ)."""
    found = at.found(local, whole, kinds, top=False, noise=at.view == "device")
    for v, per_row in zip(local.jaxpr.outvars, rows, strict=True):
        c, axis = found.of(v)
        if (c, axis) != ((ROWS, 0) if per_row else (GLOBAL, None)):
            cause = found.why.get(v) if _var(v) else None
            cause = cause or "an operation that leaves a value not per row"
            raise at.refuse("the pipelined Stacked's input", cause)


def shares(
    local: Any, whole: Any, kinds: list[str], weighted: bool, at: Where
) -> Shares:
    """`Shares` of `post` (`local` on a slice's shapes, `whole` on the whole
    rows', both `ClosedJaxpr`s) or a `ValueError` saying what mixes the
    microbatches' rows."""
    found = at.found(local, whole, kinds, noise=at.view == "device")
    outvars = local.jaxpr.outvars[: 2 if weighted else 1]
    outputs = tuple(found.cls(v) for v in outvars)
    for what, v, c in zip(("loss", "weight"), outvars, outputs, strict=False):
        if c not in (SHARE, GLOBAL):
            cause = found.why.get(v) if _var(v) else None
            raise at.refuse(f"the {what}", cause or "a value per row")
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
