"""Single-device references the distributed tests compare against: plain Equinox
and Optax on the global batch (`train_one_device`), and the largest difference of
two models (`max_diff`)."""

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np


class Trained(NamedTuple):
    """What `train_one_device` ends with: the model and its model state, the
    optimizer state, the loss of each step (on the model before that step's
    update, as a step's metrics are) and the last step's gradient and update."""

    model: Any
    model_state: Any
    opt_state: Any
    losses: list[float]
    grads: Any
    updates: Any


def global_minibatches(batch: Any, n: int, devices: int) -> list[Any]:
    """The rows minibatch m of `n` sees across `devices` devices that each hold a
    block of `batch`'s rows: each device's m-th block, in device order (all of
    `batch` when `n` is 1)."""
    if n == 1:
        return [batch]

    def split(x: Any) -> list[Any]:
        per = x.reshape(devices, n, -1, *x.shape[1:])
        return [per[:, m].reshape(-1, *x.shape[1:]) for m in range(n)]

    parts = {k: split(v) for k, v in batch.items()}
    return [{k: parts[k][m] for k in batch} for m in range(n)]


def train_one_device(
    model: Any,
    data: Iterable[Any],
    optimizer: Any,
    loss: Callable[..., Any],
    trainable: Any = eqx.is_inexact_array,
    *,
    model_state: Any = None,
    minibatches: int = 1,
    devices: int = 1,
    value: bool = False,
    key: Any = None,
) -> Trained:
    """`model` after one `optimizer` step per batch of `data`, on one device, in
    plain Equinox and Optax.

    `loss` is a train step's loss function, called with the key `None`:
    `loss(model, batch, key)` giving the loss or `(loss, metrics)`, or, with a
    `model_state`, `loss(model, model_state, batch, key)` giving
    `(loss, metrics, model_state)`; the model state is carried from minibatch to
    minibatch and step to step. `trainable` (a filter, as `eqx.partition` takes
    it) picks the leaves trained. With `minibatches` > 1 each step takes the mean
    gradient of the batch's minibatches in order, minibatch m being the m-th row
    block of each of `devices` devices (`global_minibatches`), as the step splits
    a batch. `value=True` passes the step's mean loss to the optimizer as Optax's
    `value` (what `optax.contrib.reduce_on_plateau` reads). With a `key`, the
    loss gets step `s`'s key as a global-view step gives it: `fold_in(key, s)`,
    split into one key per minibatch when there are several."""
    params, static = eqx.partition(model, trainable)
    opt_state = optimizer.init(params)

    @jax.jit
    def value_and_grad(params: Any, model_state: Any, batch: Any, k: Any) -> Any:
        def scalar(params: Any, model_state: Any) -> Any:
            full = eqx.combine(params, static)
            if model_state is None:
                out = loss(full, batch, k)
                return (out[0] if isinstance(out, tuple) else out), None
            out = loss(full, model_state, batch, k)
            return out[0], out[2]

        return jax.value_and_grad(scalar, has_aux=True)(params, model_state)

    losses, grads, updates = [], None, None
    for s, batch in enumerate(data):
        step_grads, step_losses = [], []
        keys = [None] * minibatches
        if key is not None:
            step_key = jax.random.fold_in(key, s)
            keys = (
                [step_key]
                if minibatches == 1
                else list(jax.random.split(step_key, minibatches))
            )
        parts = global_minibatches(batch, minibatches, devices)
        for mb, k in zip(parts, keys, strict=True):
            (loss_value, model_state), g = value_and_grad(params, model_state, mb, k)
            step_grads.append(g)
            step_losses.append(loss_value)
        grads = jax.tree.map(lambda *g: sum(g) / minibatches, *step_grads)
        mean_loss = sum(step_losses) / minibatches
        extra = {"value": mean_loss} if value else {}
        updates, opt_state = optimizer.update(grads, opt_state, params, **extra)
        params = eqx.apply_updates(params, updates)
        losses.append(float(mean_loss))
    return Trained(
        eqx.combine(params, static), model_state, opt_state, losses, grads, updates
    )


def max_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between the array leaves of `a` and `b`
    (in float32, so that bfloat16 leaves compare too)."""
    la = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    lb = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    return max(
        float(np.max(np.abs(_numbers(x) - _numbers(y))))
        for x, y in zip(la, lb, strict=True)
    )


def _numbers(x: Any) -> np.ndarray:
    """`x` in float32; a typed PRNG key as its key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x, np.float32)
