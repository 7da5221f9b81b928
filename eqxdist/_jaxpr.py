"""Reading traced programs (jaxprs): the sub-programs of an equation, and the
matrix-product FLOPs of a whole step (with the programs `counted_as` marks, an
MoE's expert products, counted as marked).

XLA's cost analysis is no model-FLOP count: it counts a loop's body once (a
`lax.scan` over minibatches or over a `Stacked` model's layers, whatever its
length), and on a GPU it leaves out work XLA hands to libraries. The jaxpr still
has every loop's length and every product as JAX traced it, so the count here is
the same on every backend.
"""

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import jax
from jax.extend import core as jex_core

from ._jax import shard_map_manual_axes


def sub_jaxprs(value: Any) -> list[Any]:
    """The jaxprs in one parameter of an equation (a `scan`'s body, a `cond`'s
    branches, a nested `jit`'s program, ...), open."""
    if isinstance(value, jex_core.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, jex_core.Jaxpr):
        return [value]
    if isinstance(value, tuple | list):
        return [j for v in value for j in sub_jaxprs(v)]
    return []


def _dot_flops(eqn: Any) -> int:
    # Two FLOPs (a multiply and an add) per output element and contracted index.
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return int(2 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract))


def _conv_flops(eqn: Any) -> int:
    # Each output element is a dot over the kernel's window and its group's input
    # features: the kernel's size over its output features.
    rhs = eqn.invars[1].aval.shape
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    out = eqn.outvars[0].aval.shape
    return int(2 * math.prod(out) * (math.prod(rhs) // out_features))


# The name of a nested `jax.jit` program whose FLOPs are stated, not counted:
# `{_COUNTED}_{numerator}_{denominator}` (`counted_as`).
_COUNTED = "eqxdist_model_flops"


def counted_as(fn: Callable[..., Any], flops: Fraction | int) -> Callable[..., Any]:
    """`fn` as a nested `jax.jit` program that `matmul_flops` counts as `flops`
    model FLOPs, whatever products it runs: a grouped product by padded tiles,
    `jax.lax.ragged_dot` (which has no `dot_general`) or a recomputed forward.
    A fraction is a device's share of a count the devices complete together."""
    flops = Fraction(flops)

    def program(*args: Any) -> Any:
        return fn(*args)

    program.__name__ = f"{_COUNTED}_{flops.numerator}_{flops.denominator}"
    return jax.jit(program)


# The name of a nested `jax.jit` program whose products count a fraction of
# what it runs (`counted_scaled`): `{_SCALED}_{numerator}_{denominator}`.
_SCALED = "eqxdist_flops_scaled"


def counted_scaled(fn: Callable[..., Any], scale: Fraction) -> Callable[..., Any]:
    """`fn` as a nested `jax.jit` program whose products `matmul_flops` counts
    times `scale`, in its forward and in its gradient alike (JAX keeps a nested
    program's name through differentiation): a loop whose body runs one
    entry's work, of which only a `scale` of the iterations do work that
    counts (a pipeline's forward loop, its idle slots computing nothing)."""
    scale = Fraction(scale)

    def program(*args: Any) -> Any:
        return fn(*args)

    program.__name__ = f"{_SCALED}_{scale.numerator}_{scale.denominator}"
    return jax.jit(program)


def _scale(eqn: Any) -> Fraction:
    name = eqn.params.get("name")
    if not isinstance(name, str) or not name.startswith(_SCALED + "_"):
        return Fraction(1)
    numerator, denominator = name[len(_SCALED) + 1 :].split("_")
    return Fraction(int(numerator), int(denominator))


def _stated(eqn: Any) -> Fraction | None:
    name = eqn.params.get("name")
    if not isinstance(name, str) or not name.startswith(_COUNTED + "_"):
        return None
    numerator, denominator = name[len(_COUNTED) + 1 :].split("_")
    return Fraction(int(numerator), int(denominator))


def matmul_flops(jaxpr: Any) -> int:
    """The FLOPs of the matrix products (`dot_general`) and convolutions of
    `jaxpr` (a `ClosedJaxpr` or `Jaxpr`) for one run of it: a `scan`'s body
    counted `length` times, a `jax.shard_map`'s body once per device of its manual
    axes (its shapes are one device's), a `cond`'s costliest branch, and a
    `while_loop`'s body once (its trip count is known only when it runs). A
    program marked by `counted_as` (an MoE's expert products, a pipeline's
    written-out schedule) counts as marked, one marked by `counted_scaled` (a
    pipeline's forward loop) its products times its scale."""
    return round(_flops(jaxpr))


def _flops(jaxpr: Any) -> Fraction:
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    total = Fraction(0)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        stated = _stated(eqn)
        if stated is not None:
            total += stated
        elif name == "dot_general":
            total += _dot_flops(eqn)
        elif name == "conv_general_dilated":
            total += _conv_flops(eqn)
        elif name == "cond":
            total += max(_flops(b) for b in eqn.params["branches"])
        else:
            times: Fraction | int = 1
            if name == "scan":
                times = int(eqn.params["length"])
            elif name == "shard_map":
                shape = eqn.params["mesh"].shape
                times = math.prod(shape[a] for a in shard_map_manual_axes(eqn.params))
            times *= _scale(eqn)
            inner = sum(
                (_flops(sub) for v in eqn.params.values() for sub in sub_jaxprs(v)),
                Fraction(0),
            )
            total += times * inner
    return total
