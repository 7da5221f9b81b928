"""Aux values out of a `Stacked`: a block may return `(x, aux)` (aux any pytree
of arrays, e.g. an MoE's load-balancing loss), and the stack returns `(x, aux)`
with every aux leaf stacked over the layers.

Without a pipeline the layers' loop stacks them (`split_aux` in its body). In a
pipeline each stage makes the aux of its own layers for each microbatch; they
are written into one accumulator per microbatch (`place_aux`) holding every
layer's, whose layout is that of the stack's output on the microbatch:

- blocks called per row (under the loss's `jax.vmap`): `(rows, L, ...)`, the
  row axis first, as `jax.vmap` stacks it;
- blocks called on a batch: `(L, rows, ...)`, each aux leaf required to carry
  the microbatch's rows as its leading axis (`accumulator_shapes`), so that the
  microbatches put back together along axis 1 are the batch's.

GPipe and the circular schedule add the stages' accumulators up once after
their loop (`from_stages`); 1F1B passes the accumulator on with the
activations, so the last stage's is whole when the loss after the stack runs.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def split_aux(out: Any, x: Any, caller: str) -> tuple[Any, Any, bool]:
    """A block's output `out` on the input `x` as `(y, aux, has_aux)`: `out`
    itself if it has `x`'s structure, else a 2-tuple `(y, aux)` whose `y` has
    it; a `ValueError` naming both structures otherwise."""
    structure = jax.tree.structure(x)
    if jax.tree.structure(out) == structure:  # type: ignore[operator]
        return out, None, False
    if (
        isinstance(out, tuple)
        and len(out) == 2
        and jax.tree.structure(out[0]) == structure  # type: ignore[operator]
    ):
        return out[0], out[1], True
    raise ValueError(
        f"{caller}: a block returned {jax.tree.structure(out)} for an input of "
        f"structure {structure}; a block of an ed.Stacked returns its input's "
        "structure (`x -> x`) or a pair `(x, aux)` whose first element has it "
        "(aux: a pytree of arrays, stacked over the layers). Return one of the two."
    )


def loop_output(out: Any, x: Any, found: list[bool]) -> tuple[Any, Any]:
    """A block's output in a `Stacked`'s loop over the layers, as the loop's
    `(carry, ys)`: `(x, None)`, or `(x, aux)` for a block returning `(x, aux)`
    (recorded in `found`), whose aux the loop stacks over the layers."""
    y, aux, has_aux = split_aux(out, x, "Stacked")
    found.append(has_aux)
    return y, aux


def block_aux(
    layer: Callable[..., Any], leaves: list[Any], x: Any, key: Any, caller: str
) -> Any:
    """The aux one block returns on `x` (`jax.ShapeDtypeStruct`s; `None` for a
    block that returns only `x`), from a shape-only trace of `layer` on one
    layer's leaves."""
    one = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in leaves]
    if key is not None:
        one.append(key)
    out = jax.eval_shape(layer, one, x)
    _, aux, has_aux = split_aux(out, x, caller)
    return aux if has_aux else None


def accumulator_shapes(
    aux: Any, *, rows: int, num_layers: int, per_row: bool, caller: str
) -> Any:
    """The accumulator of one microbatch of `rows` rows (see the module
    docstring) for a block's `aux` (`block_aux`: one row's, or, not `per_row`,
    the microbatch's); a `ValueError` naming an aux leaf of a batch call
    without the rows as its leading axis."""

    def shape(path: Any, s: Any) -> Any:
        if per_row:
            return jax.ShapeDtypeStruct((rows, num_layers, *s.shape), s.dtype)
        if len(s.shape) == 0 or s.shape[0] != rows:
            raise ValueError(
                f"{caller}: the aux leaf {jax.tree_util.keystr(path)!r} of a block "
                f"called on a batch of {rows} rows (a microbatch) has shape "
                f"{tuple(s.shape)}; under a pipeline a block called on a batch must "
                f"return aux leaves with the rows as their leading axis ({rows}, "
                "...), which the schedule puts back together over the "
                "microbatches. Return per-row aux values, or call the stack on "
                "one row under jax.vmap (its aux is then (rows, layers, ...))."
            )
        return jax.ShapeDtypeStruct((num_layers, *s.shape), s.dtype)

    return jax.tree_util.tree_map_with_path(shape, aux)


def zeros(shapes: Any, lead: tuple[int, ...] = ()) -> Any:
    """Zero arrays of `shapes` (`jax.ShapeDtypeStruct`s), each with `lead`
    axes first."""
    return jax.tree.map(lambda s: jnp.zeros((*lead, *s.shape), s.dtype), shapes)


def place_aux(acc: Any, aux: Any, first: Any, *, per_row: bool) -> Any:
    """`acc`, one microbatch's accumulator, with the aux of the layers `first`,
    `first + 1`, ... (`aux`, stacked over them: `(c, rows, ...)`) written in."""

    def put(a: Any, v: Any) -> Any:
        v = v.astype(a.dtype)
        if per_row:
            v = jnp.moveaxis(v, 0, 1)
            return jax.lax.dynamic_update_slice_in_dim(a, v, first, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(a, v, first, axis=0)

    return jax.tree.map(put, acc, aux)


def batch_of_accumulators(acc: Any, *, per_row: bool) -> Any:
    """The stack's aux from the accumulators of the microbatches in order
    (`(M, ...)`): the rows of microbatch m follow those of m - 1."""

    def whole(a: Any) -> Any:
        if not per_row:
            # (M, L, rows, ...) -> (L, M * rows, ...)
            a = jnp.moveaxis(a, 0, 1)
            return a.reshape(a.shape[0], -1, *a.shape[3:])
        return a.reshape(-1, *a.shape[2:])

    return jax.tree.map(whole, acc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def from_stages(acc: Any, axis: str, parts: bool) -> Any:
    """The stages' accumulators (each holding its own layers' aux, zeros
    elsewhere) added up: every layer's on every stage. Every stage runs what
    follows on it identically, so a stage's own entries take its own
    cotangent; where each stage's cotangent is a part of it (`parts`: the
    transpose of a `shard_map` output replicated over the stage axis), their
    sum."""
    return jax.tree.map(lambda a: jax.lax.psum(a, axis), acc)


def _from_stages_fwd(acc: Any, axis: str, parts: bool) -> tuple[Any, None]:
    return from_stages(acc, axis, parts), None


def _from_stages_bwd(axis: str, parts: bool, _: None, g: Any) -> tuple[Any]:
    if parts:
        g = jax.tree.map(
            lambda a: a if a.dtype == jax.dtypes.float0 else jax.lax.psum(a, axis), g
        )
    return (g,)


from_stages.defvjp(_from_stages_fwd, _from_stages_bwd)
