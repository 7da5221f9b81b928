"""The optimizer update of a training step, on the global (possibly sharded)
arrays after its `shard_map`: the gradients finished from the sums the map
returns, the update applied (or skipped, bit for bit, for a non-finite step),
and the step statistics of `step_info`."""

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array

from .._utils import is_array
from .statistics import SQUARES, TreeSums


def reads_value(optimizer: Any, params: Any, opt_state: Any) -> bool:
    """Whether `optimizer.update` takes Optax's extra argument `value` (the loss,
    as `optax.contrib.reduce_on_plateau` needs it) and reads it: only then does
    the step reduce the loss across devices for it."""
    try:
        signature = inspect.signature(optimizer.update)
    except (TypeError, ValueError):
        return False
    if not any(
        p.name == "value" or p.kind is inspect.Parameter.VAR_KEYWORD
        for p in signature.parameters.values()
    ):
        return False

    def update(value: Any) -> Any:
        return optimizer.update(params, opt_state, params, value=value)

    jaxpr = jax.make_jaxpr(update)(jnp.zeros((), jnp.float32)).jaxpr
    value = jaxpr.invars[0]
    return value in jaxpr.outvars or any(value in e.invars for e in jaxpr.eqns)


def _finished(g: Array, count: int | None, scale: Array | None) -> Array:
    """A leaf's gradient from its sum over `count` devices (`sum_gradients`): the
    mean's division as `lax.pmean` does it, then `scale`."""
    if count is not None and count > 1:
        g = g / count
    return g if scale is None else (g * scale).astype(g.dtype)


def gradient_finishers(counts: Any, scale: Array | None) -> Any:
    """A tree like `counts` (`ModelPlan.mean_counts`) with, at each array leaf,
    the elementwise function that turns that leaf's gradient sum into the step's
    gradient: the update applies it to whole leaves (`finish_gradients`), the
    gradient statistics to the slices each device reads (`local_sums`)."""
    return jax.tree.map(
        lambda c: functools.partial(_finished, count=c, scale=scale), counts
    )


def finish_gradients(grads: Any, counts: Any, scale: Array | None) -> Any:
    """The step's gradients from what its `shard_map` returns: the sums over
    devices `counts` (`ModelPlan.mean_counts`) says, and the weighted loss's
    `scale`."""

    def finish(count: int | None, g: Any) -> Any:
        return _finished(g, count, scale) if is_array(g) else g

    return jax.tree.map(finish, counts, grads, is_leaf=lambda x: x is None)


def _applied(p: Any, u: Any) -> Any:
    return (p + u).astype(p.dtype)


@dataclasses.dataclass(frozen=True)
class Update:
    """The optimizer update of one trace of a step: `update(params, opt_state)
    -> (params, opt_state, sums)`.

    - `optimizer`: the Optax transformation.
    - `sums`, `counts`, `scale`: the gradients as the gradient phase returns
      them, finished here (`finish_gradients`), so that where the update runs in
      a loop (`update_unless`) the gradients' last elementwise steps run inside
      it, fused into the optimizer's pass, instead of being written out as the
      loop's operand.
    - `extra`: the keyword arguments the optimizer reads (e.g. `value`).
    - `statistics`: the sums of the update to return (`statistics.TreeSums`), or
      `None` (`{}` is returned).
    """

    optimizer: optax.GradientTransformation
    sums: Any
    counts: Any
    scale: Array | None
    extra: dict[str, Any]
    statistics: TreeSums | None

    def __call__(
        self, params: Any, opt_state: Any
    ) -> tuple[Any, Any, dict[str, Array]]:
        grads = finish_gradients(self.sums, self.counts, self.scale)
        updates, opt_state = self.optimizer.update(
            grads, opt_state, params, **self.extra
        )
        if self.statistics is None:
            new_params = jax.tree.map(_applied, params, updates)
            return new_params, opt_state, {}
        sums = self.statistics(updates)
        # An update that reads the parameters (weight decay) makes the sums read
        # the old parameters, which the step overwrites in place; unless the writes
        # depend on the sums, XLA copies every parameter to keep it for that read.
        # `always` is true (a sum of squares is never negative; NaN < 0 is false)
        # but XLA cannot know, so the select orders them.
        always = jnp.logical_not(sums[SQUARES] < 0)
        new_params = jax.tree.map(
            lambda p, u: jnp.where(always, _applied(p, u), p), params, updates
        )
        return new_params, opt_state, sums


def update_unless(
    skipped: Array,
    update: Update,
    params: Any,
    opt_state: Any,
    kinds: tuple[str, ...],
) -> tuple[Any, Any, dict[str, Array]]:
    """`update(params, opt_state)`, or the inputs unchanged (and zero update sums
    of `kinds`, those `update` returns) where `skipped`. A loop run once or not
    at all: XLA updates a loop's carry in place, so a step that is not skipped
    reads and writes what a plain step does (selects, or a `lax.cond`, make XLA
    copy the state)."""

    def body(carry: Any) -> Any:
        _, params, opt_state, _ = carry
        return (jnp.ones((), bool), *update(params, opt_state))

    _, new_params, opt_state, sums = jax.lax.while_loop(
        lambda carry: jnp.logical_not(carry[0]),
        body,
        (skipped, params, opt_state, {k: jnp.zeros((), jnp.float32) for k in kinds}),
    )
    return new_params, opt_state, sums


def keep_if(skipped: Array, old: Any, new: Any) -> Any:
    """`old` where `skipped`, else `new`, leaf by leaf (a select: the kept values
    are bit-identical)."""

    def pick(o: Any, n: Any) -> Any:
        return jnp.where(skipped, o, n) if is_array(n) else n

    return jax.tree.map(pick, old, new)


def step_statistics(
    grad_sums: dict[str, Array],
    update_sums: dict[str, Array],
    param_sums: dict[str, Array],
    skipped: Array | None,
) -> dict[str, Array]:
    """`step_info` from the sums of squares (`global_sums`) of the gradients,
    the update (zeros when the step was skipped) and the parameters."""
    no = jnp.zeros((), jnp.float32)
    return {
        "grad_norm": jnp.sqrt(grad_sums[SQUARES]),
        "update_norm": jnp.sqrt(update_sums[SQUARES]),
        "param_norm": jnp.sqrt(param_sums[SQUARES]),
        "skipped": no if skipped is None else skipped.astype(jnp.float32),
    }
