"""Single-device references the distributed tests compare against: plain Equinox
and Optax on the global batch, and the largest difference of two models."""

from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import numpy as np


def train_one_device(
    model: Any,
    data: Iterable[Any],
    optimizer: Any,
    loss: Callable[[Any, Any], Any],
    trainable: Any = eqx.is_inexact_array,
) -> Any:
    """`model` after one `optimizer` step on `loss(model, batch) -> scalar` per
    batch of `data`, on one device; `trainable` (a filter, as `eqx.partition`
    takes it) picks the leaves trained."""
    params, static = eqx.partition(model, trainable)
    opt_state = optimizer.init(params)
    for batch in data:
        grads = jax.grad(lambda p, b: loss(eqx.combine(p, static), b))(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = eqx.apply_updates(params, updates)
    return eqx.combine(params, static)


def max_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between the array leaves of `a` and `b`
    (in float32, so that bfloat16 leaves compare too)."""
    la = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    lb = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    return max(
        float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
        for x, y in zip(la, lb, strict=True)
    )
