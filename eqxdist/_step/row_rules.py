"""The row axis through one operation of a loss (`hoist.analyse`): for an
equation some of whose inputs are indexed by the rows (each with its row axis
known), the row axis of each output, or why the operation mixes rows.

An allowlist, sound rather than hopeful: an operation is per-row only where the
rule below proves it (elementwise arithmetic; broadcasts, reshapes and
transposes that keep the row axis whole; reductions, products, slices, pads,
sorts and the like over *other* axes; gathers whose row axis is a batch axis of
both sides or kept whole). A sum over the row axis is a `SHARE` (the whole
batch's is the sum of the slices'). Anything else that touches the row axis
(slices, gathers, concatenation, padding, rolls, sorts, top-k, cumulative sums
along the rows, reshaping rows into groups, a product of two row-indexed
arrays over the rows, ...) gets no row axis: `None` with the reason.
"""

import math
from typing import Any

from .._jax import source_line

ROWS, SHARE = "rows", "share"

# Elementwise: the output's element i depends on the inputs' element i only
# (a size-1 axis of an input broadcast).
ELEMENTWISE = frozenset(
    [
        "add",
        "sub",
        "mul",
        "div",
        "rem",
        "pow",
        "integer_pow",
        "max",
        "min",
        "neg",
        "sign",
        "floor",
        "ceil",
        "round",
        "is_finite",
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "tanh",
        "logistic",
        "sin",
        "cos",
        "tan",
        "asin",
        "acos",
        "atan",
        "atan2",
        "sinh",
        "cosh",
        "asinh",
        "acosh",
        "atanh",
        "sqrt",
        "rsqrt",
        "cbrt",
        "abs",
        "square",
        "erf",
        "erfc",
        "erf_inv",
        "lgamma",
        "digamma",
        "igamma",
        "igammac",
        "polygamma",
        "zeta",
        "bessel_i0e",
        "bessel_i1e",
        "not",
        "and",
        "or",
        "xor",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "select_n",
        "clamp",
        "convert_element_type",
        "bitcast_convert_type",
        "reduce_precision",
        "copy",
        "copy_p",
        "add_any",
        "nextafter",
        "shift_left",
        "shift_right_logical",
        "shift_right_arithmetic",
        "population_count",
        "clz",
        "stop_gradient",
        "real",
        "imag",
        "conj",
        "complex",
        "threefry2x32",
        "random_bits",
        "random_split",
        "random_fold_in",
        "random_wrap",
        "random_unwrap",
    ]
)
# Reductions over `axes`, per row when the row axis is not among them.
_REDUCE = frozenset(
    [
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
    ]
)
# Operations along one axis (param), per row when it is not the row axis.
_ALONG = {
    "cumsum": "axis",
    "cumprod": "axis",
    "cummax": "axis",
    "cummin": "axis",
    "cumlogsumexp": "axis",
    "sort": "dimension",
    "concatenate": "dimension",
    "split": "axis",
}
# Random operations: fresh noise drawn over the rows from one key.
NOISE = frozenset(("random_bits", "random_split", "random_seed", "threefry2x32"))

Out = tuple[list[tuple[str, int | None]], str | None]


def where(eqn: Any) -> str:
    """`eqn`'s source line in the user's code (as JAX names it), or ''."""
    try:
        line = source_line(eqn.source_info)
    except Exception:  # a missing internal only loses the line
        return ""
    return f" (at {line})" if line else ""


def coupled(eqn: Any, what: str = "on the row axis") -> Out:
    name = eqn.primitive.name
    return [], f"`{name}` {what}{where(eqn)}"


def row_rule(eqn: Any, other: Any, ins: list[tuple[str, int | None]]) -> Out:
    """The `(class, axis)` of each output of `eqn` (`other`: the same equation
    on the whole batch's shapes) whose inputs `ins` (`(class, axis)`, class
    `ROWS` for some) hold no `SHARE`; `([], why)` where it mixes rows."""
    outs, why = _row_rule(eqn, other, ins)
    # An equation's parameters may hold NumPy integers (the `axes` of the
    # `reduce_sum` of `x.mean(0)`), and arithmetic on them stays NumPy: every
    # axis leaves here a Python int.
    return [(c, None if a is None else int(a)) for c, a in outs], why


def _row_rule(
    eqn: Any, other: Any, ins: list[tuple[str, int | None]]
) -> tuple[list[tuple[str, Any]], str | None]:
    """`row_rule`, each axis as computed from the equation's parameters (a
    Python or a NumPy integer)."""
    name, p = eqn.primitive.name, eqn.params
    axes = {a for c, a in ins if c == ROWS}
    if len(axes) != 1:
        return coupled(eqn, "on values whose rows lie on different axes")
    (a,) = axes
    assert a is not None
    n_out = len(eqn.outvars)
    rows = [v for v, (c, _) in zip(eqn.invars, ins, strict=True) if c == ROWS]
    if name in ELEMENTWISE:
        return [(ROWS, a)] * n_out, None
    if name == "broadcast_in_dim":
        return [(ROWS, p["broadcast_dimensions"][a])], None
    if name == "transpose":
        return [(ROWS, list(p["permutation"]).index(a))], None
    if name == "squeeze":
        dims = p["dimensions"]
        if a in dims:
            return coupled(eqn)
        return [(ROWS, a - sum(d < a for d in dims))], None
    if name == "reshape":
        return _reshape(eqn, a)
    if name == "reduce_sum":
        if a in p["axes"]:
            return [(SHARE, None)], None
        return [(ROWS, a - sum(d < a for d in p["axes"]))], None
    if name in _REDUCE:
        if a in p["axes"]:
            return coupled(eqn, "over the row axis")
        return [(ROWS, a - sum(d < a for d in p["axes"]))] * n_out, None
    if name in _ALONG:
        if p[_ALONG[name]] == a:
            return coupled(eqn, "along the row axis")
        return [(ROWS, a)] * n_out, None
    if name in ("rev", "top_k", "pad", "slice", "dynamic_slice"):
        return _kept_whole(eqn, other, a, rows[0])
    if name == "dot_general":
        return _dot(eqn, ins)
    if name == "gather":
        return _gather(eqn, other, ins)
    return coupled(eqn, "on a value indexed by the rows")


def _reshape(eqn: Any, a: int) -> Out:
    """A reshape keeps the rows when the row axis stays whole: the same number
    of elements before it (and so after it) in and out."""
    if eqn.params.get("dimensions") is not None:
        return coupled(eqn)
    shape, new = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    before = math.prod(shape[:a])
    for b in range(len(new)):
        if math.prod(new[:b]) == before and new[b] == shape[a]:
            return [(ROWS, b)], None
    return coupled(eqn, "reshaping the rows into groups")


def _kept_whole(eqn: Any, other: Any, a: int, operand: Any) -> Out:
    """Per row when the row axis is the operation's operand, untouched: not
    reversed, padded, sliced or the axis of a top-k."""
    name, p, q = eqn.primitive.name, eqn.params, other.params
    if operand is not eqn.invars[0]:
        return coupled(eqn)
    whole = other.invars[0].aval.shape[a]
    n = operand.aval.shape[a]
    ok = {
        "rev": lambda: a not in p["dimensions"],
        "top_k": lambda: a != operand.aval.ndim - 1,
        "pad": lambda: tuple(p["padding_config"][a]) == (0, 0, 0),
        "slice": lambda: (
            p["start_indices"][a] == 0
            and p["limit_indices"][a] == n
            and q["limit_indices"][a] == whole
            and (p["strides"] is None or p["strides"][a] == 1)
        ),
        "dynamic_slice": lambda: (
            p["slice_sizes"][a] == n and q["slice_sizes"][a] == whole
        ),
    }[name]()
    if not ok:
        return coupled(eqn)
    return [(ROWS, a)] * len(eqn.outvars), None


def _dot(eqn: Any, ins: list[tuple[str, int | None]]) -> Out:
    """A product: per row where the rows are a free axis of one side or a batch
    axis of both; a sum over the rows (`SHARE`) where both contract them
    together; anything else (an outer product of rows, rows contracted with a
    value of no rows) mixes them."""
    ((lc, rc), (lb, rb)) = eqn.params["dimension_numbers"]
    (cl, al), (cr, ar) = ins
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    lfree = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    if cl == ROWS and cr == ROWS:
        if al in lc and ar in rc and lc.index(al) == rc.index(ar):
            return [(SHARE, None)], None
        if al in lb and ar in rb and lb.index(al) == rb.index(ar):
            return [(ROWS, lb.index(al))], None
        return coupled(eqn, "on two arrays indexed by the rows, over the rows")
    if cl == ROWS and al in lfree:
        return [(ROWS, len(lb) + lfree.index(al))], None
    if cr == ROWS and ar in rfree:
        return [(ROWS, len(lb) + len(lfree) + rfree.index(ar))], None
    return coupled(eqn, "contracting the rows with a value of no rows")


def _gather(eqn: Any, other: Any, ins: list[tuple[str, int | None]]) -> Out:
    """A gather: per row where the indices carry the rows (a table looked up
    per row), where the rows are a batch axis of both operand and indices (a
    per-row pick), or where the operand's row axis is taken whole."""
    d = eqn.params["dimension_numbers"]
    (co, ao), (ci, ai) = ins[0], ins[1]
    operand, indices = eqn.invars[0].aval, eqn.invars[1].aval
    out_ndim = eqn.outvars[0].aval.ndim
    batch_out = [i for i in range(out_ndim) if i not in d.offset_dims]
    if ci == ROWS and ai is not None and ai < indices.ndim - 1:
        if co != ROWS:
            return [(ROWS, batch_out[ai])], None
        ob, ib = d.operand_batching_dims, d.start_indices_batching_dims
        if ao in ob and ib[list(ob).index(ao)] == ai:
            return [(ROWS, batch_out[ai])], None
        return coupled(eqn, "picking rows by row-indexed indices")
    if co == ROWS and ao is not None and ci != ROWS:
        sizes, whole = eqn.params["slice_sizes"], other.params["slice_sizes"]
        taken = ao not in d.start_index_map and ao not in d.collapsed_slice_dims
        whole_axis = sizes[ao] == operand.shape[ao]
        if taken and whole_axis and whole[ao] == other.invars[0].aval.shape[ao]:
            kept = [
                i
                for i in range(operand.ndim)
                if i not in d.collapsed_slice_dims and i not in d.operand_batching_dims
            ]
            return [(ROWS, d.offset_dims[kept.index(ao)])], None
    return coupled(eqn)
