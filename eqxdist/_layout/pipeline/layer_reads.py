"""Whether a loss reads the pipelined `Stacked`'s layers outside the stack (a
penalty over them, `sum(w ** 2)`): the leaves a stage holds only its own share
of, used by the loss's program other than through the stack.

The device view's GPipe and circular schedules then give the loss every
stage's layers (`_layout.all_layers`), so that its value and metrics are one
device's; the written-out schedules refuse it (`one_f_one_b`). Read from a
shape-only trace of the loss on a model whose stack is a `MarkedStack`, which
reads none of the layers: any use of them is the loss's own."""

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex
from jax.sharding import PartitionSpec as P

from ..rules import is_spec_leaf


def stage_leaves(params: Any, specs: Any, axis: str) -> list[bool]:
    """Which of `params`' leaves (in `jax.tree.leaves` order) are a stage's own
    layers: their spec's first entry is the stage `axis`."""

    def own(spec: Any, leaf: Any) -> Any:
        if leaf is None:
            return None
        return isinstance(spec, P) and len(spec) > 0 and spec[0] == axis

    return list(jax.tree.leaves(jax.tree.map(own, specs, params, is_leaf=is_spec_leaf)))


def reads(jaxprs: Sequence[Any], mask: Sequence[bool]) -> bool:
    """Whether any of `jaxprs` (whose first inputs are the parameters' leaves)
    uses an input that `mask` marks."""
    for jaxpr in jaxprs:
        used = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, jex.Var)}
        used |= {v for v in jaxpr.outvars if isinstance(v, jex.Var)}
        if any(m and v in used for m, v in zip(mask, jaxpr.invars, strict=False)):
            return True
    return False


def loss_reads_layers(
    call: Callable[[Any], Any], params: Any, specs: Any, axis: str
) -> bool:
    """Whether `call(params)` (the loss on a model whose pipelined stack is
    marked; `params` may be shapes) reads the stack's layers itself."""
    jaxpr = jax.make_jaxpr(call)(params).jaxpr
    return reads([jaxpr], stage_leaves(params, specs, axis))
