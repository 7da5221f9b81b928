"""Gradient accumulation: the gradients of a loss over a batch, one block of rows
(minibatch) at a time, with the loss function's output checked."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from .._metrics.tree import check_metrics, merge_metrics, with_counts
from .._utils import (
    batch_rows,
    call_with_axes,
    check_callable_takes,
    check_function,
    check_rows,
    is_array,
    typecheck,
)

check_loss_fn = check_function("loss_fn(model, batch, key) -> (loss, metrics)")


def check_num_minibatches(num_minibatches: int, caller: str) -> None:
    if num_minibatches < 1:
        raise ValueError(
            f"{caller}: `num_minibatches` must be >= 1; got {num_minibatches}."
        )


class CheckedLoss:
    """`loss_fn` as `(model, model_state, batch, key) -> (loss_sum, (weight,
    metrics, state))`, its output validated: a clear error instead of one from
    deep inside `jax.grad`.

    A scalar loss is its own sum with weight 1; a `(loss_sum, weight)` pair is
    taken as it is. `weighted` says which one `loss_fn` returned (known once it
    has been traced). `counted`: its metrics' arrays come as `Summed` (the train
    step's, to say what it summed)."""

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        with_state: bool,
        axes: tuple[str, ...] = (),
        counted: bool = False,
    ) -> None:
        self.loss_fn = loss_fn
        self.with_state = with_state
        self.axes = axes  # the mesh axes bound where it runs, for errors
        self.counted = counted
        self.weighted: bool | None = None

    def __call__(self, model: Any, model_state: Any, batch: Any, key: Any) -> Any:
        with_state = self.with_state
        if with_state:
            check_callable_takes(
                self.loss_fn,
                ("model", "model_state", "batch", "key"),
                "loss_fn",
                " (the state has a model_state)",
            )
            args: tuple[Any, ...] = (model, model_state, batch, key)
        else:
            check_callable_takes(self.loss_fn, ("model", "batch", "key"), "loss_fn")
            args = (model, batch, key)
        out = call_with_axes(self.loss_fn, args, "loss_fn", self.axes)
        _check_output(out, with_state)
        loss, metrics = out[0], out[1]
        self.weighted = isinstance(loss, tuple)
        loss_sum, weight = _loss_and_weight(loss)
        check_metrics(metrics, "loss_fn")
        if self.counted:
            metrics = with_counts(metrics, batch_rows(batch, "loss_fn"))
        new_state = _same_state(out[2], model_state) if with_state else None
        return loss_sum, (weight, metrics, new_state)


def _check_output(out: Any, with_state: bool) -> None:
    """A `TypeError` for a `loss_fn` output that is not `(loss, metrics)` (with
    the new model state third where the state has one), naming what came
    instead: a lone loss, the pair swapped, a tuple of another length."""
    arity = "(loss, metrics, new_model_state)" if with_state else "(loss, metrics)"
    state = " (the state has a model_state)" if with_state else ""
    if is_array(out):
        # A traced array's class (`LinearizeTracer`, ...) says nothing to a user.
        raise TypeError(
            f"make_train_step: `loss_fn` returned the loss alone (an array of "
            f"shape {jnp.shape(out)}); it must return a tuple `{arity}`{state}. "
            "Return `(loss, {})` for no metrics, or `(loss, metrics)` with a "
            "dict of ed.metrics values."
        )
    if not (isinstance(out, tuple) and len(out) == (3 if with_state else 2)):
        raise TypeError(
            f"make_train_step: `loss_fn` must return a tuple `{arity}`{state}; "
            f"got {type(out).__name__}"
            + (f" of length {len(out)}." if isinstance(out, tuple) else ".")
        )
    first, second = out[0], out[1]
    if not is_array(first) and not isinstance(first, tuple) and is_array(second):
        raise TypeError(
            f"make_train_step: `loss_fn` returned a {type(first).__name__} first "
            f"and an array of shape {jnp.shape(second)} second: the loss comes "
            f"first, `{arity}` (the pair looks swapped: return `(loss, metrics)`)."
        )


def _scalar(x: Any, what: str) -> None:
    if not is_array(x) or jnp.shape(x) != ():
        # A traced array's class (`LinearizeTracer`, ...) says nothing to a user.
        kind = (
            f"an array of shape {jnp.shape(x)}"
            if is_array(x)
            else f"a {type(x).__name__}"
        )
        raise ValueError(
            f"loss_fn must return {what}; got {kind}. Reduce it, e.g. with "
            "`.mean()` (or `.sum()` for a weighted loss's sum)."
        )


def _loss_and_weight(loss: Any) -> tuple[Any, Any]:
    """The `(loss_sum, weight)` of `loss_fn`'s loss (weight 1 for a scalar loss),
    checked: scalars, a floating-point loss, a numeric weight."""
    if isinstance(loss, tuple):
        if len(loss) != 2:
            raise TypeError(
                "loss_fn must return a scalar loss or a pair `(loss_sum, weight)`; "
                f"got a tuple of length {len(loss)}."
            )
        loss, weight = loss
        if isinstance(weight, int | float) and not isinstance(weight, bool):
            weight = jnp.asarray(weight, jnp.float32)  # e.g. `batch.shape[0]`
        _scalar(loss, "a scalar `loss_sum` in `(loss_sum, weight)`")
        _scalar(weight, "a scalar `weight` in `(loss_sum, weight)`")
        kind = jnp.result_type(weight)
        if not (
            jnp.issubdtype(kind, jnp.floating) or jnp.issubdtype(kind, jnp.integer)
        ):
            raise TypeError(
                "loss_fn: the `weight` of `(loss_sum, weight)` must be a floating-"
                f"point or integer scalar (e.g. `mask.sum()`); got dtype {kind}."
            )
    else:
        _scalar(loss, "a scalar loss")
        weight = jnp.ones((), jnp.float32)
    if not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
        raise TypeError(
            f"loss_fn must return a floating-point loss; got dtype "
            f"{jnp.result_type(loss)}."
        )
    return loss, jnp.asarray(weight, jnp.float32)


def _same_state(new: Any, old: Any) -> Any:
    """The model state `loss_fn` returned, checked against the one it got and cast
    to its dtypes (e.g. statistics computed in bfloat16 stay float32), so that it
    can be carried from minibatch to minibatch."""
    new_def: Any = jax.tree.structure(new)
    old_def: Any = jax.tree.structure(old)
    if new_def != old_def:
        raise ValueError(
            f"loss_fn returned a model state of structure {new_def}, but got one of "
            f"structure {old_def}; return the updated state of the same model."
        )
    return jax.tree.map(
        lambda n, o: n.astype(o.dtype) if is_array(n) and is_array(o) else n, new, old
    )


class Accumulated(NamedTuple):
    """What `accumulate` adds up over the minibatches. For a scalar loss,
    `grads` and `loss` are the means over the minibatches and `weight` is `None`;
    for a `(loss_sum, weight)` loss, they are the sums, and `weight` the summed
    weight (the caller divides, after adding up over devices)."""

    grads: Any
    loss: Any
    weight: Any
    metrics: Any
    model_state: Any


def accumulate(
    loss: Callable[..., Any],
    checked: CheckedLoss,
    diff: Any,
    model_state: Any,
    batch: Any,
    key: Any,
    n: int,
    use_scan: bool,
    *,
    state_from_first: bool = False,
    take: Callable[[Any, Any, int], Any] | None = None,
    whole_key: bool = False,
) -> Accumulated:
    """The engine of `accumulate_gradients`: `loss(diff, model_state, minibatch,
    key)` (`checked`, or a function calling it) differentiated with respect to
    the floating-point arrays of `diff`, minibatch after minibatch (in order,
    each seeing the model state the previous one returned). `state_from_first`:
    see `_scan` (only needed under `check_vma=True`; it compiles the minibatch
    twice). `take(leaf, i, n)`: minibatch `i` of `n` of a batch leaf of rank >= 1
    (default: the `i`-th block of its rows). `whole_key`: one minibatch gets
    `key` itself, not the one key `jax.random.split(key, 1)` gives."""
    grad_fn = eqx.filter_value_and_grad(loss, has_aux=True)
    if key is None:
        keys = None
    elif whole_key and n == 1:
        keys = key[None]
    else:
        keys = jax.random.split(key, n)
    take_rows = _block_of_rows if take is None else take

    def minibatch(i: Any, k: Any, state: Any) -> tuple[Any, Any, Any, Any, Any]:
        def part(x: Any) -> Any:
            if not is_array(x) or jnp.ndim(x) == 0:
                return x
            return take_rows(x, i, n)

        (value, (weight, metrics, state)), grads = grad_fn(
            diff, state, jax.tree.map(part, batch), k
        )
        return grads, value.astype(jnp.float32), weight, metrics, state

    if n == 1:
        grads, total, weight, metrics, model_state = minibatch(
            0, None if keys is None else keys[0], model_state
        )
    elif use_scan:
        grads, total, weight, metrics, model_state = _scan(
            minibatch, diff, model_state, keys, n, state_from_first
        )
    else:
        grads, total, weight, metrics, model_state = _unrolled(
            minibatch, model_state, keys, n
        )
    if checked.weighted:
        return Accumulated(grads, total, weight, metrics, model_state)
    if n == 1:  # its own mean: no division, the program a hand-written step has
        return Accumulated(grads, total, None, metrics, model_state)
    mean = jax.tree.map(lambda g: g / n, grads)
    return Accumulated(mean, total / n, None, metrics, model_state)


def _block_of_rows(x: Any, i: Any, n: int) -> Any:
    rows = x.shape[0] // n
    return jax.lax.dynamic_slice_in_dim(x, i * rows, rows, axis=0)


def weight_scale(weight: Any) -> Any:
    """`1 / weight`, or 0 where `weight` is 0: what `divide_by_weight` multiplies
    by."""
    return jnp.where(weight > 0, 1 / jnp.where(weight > 0, weight, 1), 0)


def divide_by_weight(tree: Any, weight: Any) -> Any:
    """`tree / weight`, or zeros where `weight` is 0 (never NaN)."""
    scale = weight_scale(weight)
    return jax.tree.map(lambda x: (x * scale).astype(x.dtype), tree)


def _scan(
    minibatch: Callable[..., Any],
    diff: Any,
    model_state: Any,
    keys: Any,
    n: int,
    state_from_first: bool,
) -> tuple[Any, Any, Any, Any, Any]:
    """The minibatches as one `jax.lax.scan` body: gradients summed in the carry
    (zeros like the parameters: the type their gradients have), losses, weights
    and metrics stacked and added up after, in order.

    Inside `shard_map` with `check_vma=True` a loop's carry must enter with the
    type its body returns. A loss depends on the device's rows, so it is not
    carried; a model state that the minibatches make device-varying would not
    match the incoming one, so with `state_from_first` the first minibatch runs
    before the loop and the loop carries the state it returns."""
    metric_static: list[Any] = []

    def body(carry: Any, xs: tuple[Any, Any]) -> tuple[Any, Any]:
        total, state = carry
        grads, value, weight, metrics, state = minibatch(*xs, state)
        dynamic, static = eqx.partition(metrics, eqx.is_array)
        metric_static[:] = [static]
        total = jax.tree.map(jnp.add, total, grads)
        return (total, state), (value, weight, dynamic)

    indices = jnp.arange(n)
    first: list[Any] = []
    if state_from_first:
        grads, value, weight, metrics, model_state = minibatch(
            0, None if keys is None else keys[0], model_state
        )
        first = [(value, weight, metrics)]
        indices, keys = indices[1:], None if keys is None else keys[1:]
    else:
        grads = jax.tree.map(jnp.zeros_like, eqx.filter(diff, eqx.is_inexact_array))
    (grads, model_state), (values, weights, stacked) = jax.lax.scan(
        body, (grads, model_state), (indices, keys)
    )
    rest = [
        (
            values[i],
            weights[i],
            eqx.combine(jax.tree.map(lambda x, i=i: x[i], stacked), metric_static[0]),
        )
        for i in range(len(indices))
    ]
    (total, weight, metrics), *more = first + rest
    for value, w, m in more:
        total, weight = total + value, weight + w
        metrics = merge_metrics(metrics, m)
    return grads, total, weight, metrics, model_state


def _unrolled(
    minibatch: Callable[..., Any], model_state: Any, keys: Any, n: int
) -> tuple[Any, Any, Any, Any, Any]:
    """The minibatches as a Python loop (XLA may overlap them)."""

    def key_at(i: int) -> Any:
        return None if keys is None else keys[i]

    grads, total, weight, metrics, model_state = minibatch(0, key_at(0), model_state)
    for i in range(1, n):
        more_grads, value, w, more, model_state = minibatch(i, key_at(i), model_state)
        grads = jax.tree.map(jnp.add, grads, more_grads)
        total, weight = total + value, weight + w
        metrics = merge_metrics(metrics, more)
    return grads, total, weight, metrics, model_state


@typecheck
def accumulate_gradients(
    loss_fn: Callable[..., Any],
    model: PyTree[Any],
    batch: PyTree[Any],
    key: PRNGKeyArray | None,
    num_minibatches: int,
    *,
    use_scan: bool = True,
    model_state: Any = None,
) -> tuple[Any, ...]:
    """Gradients of `loss_fn` over `batch`, computed one block of rows (minibatch) at
    a time so that only one minibatch's activations are alive at once.

    Works anywhere: eagerly, under `jit`, or inside `jax.shard_map` on each
    device's rows (as `make_train_step` uses it). Inside `shard_map` with JAX's
    default `check_vma=True`, JAX itself sums the gradients of replicated
    parameters over the devices; with `check_vma=False` they stay per-device
    (average them with `sync_gradients` or `all_reduce_gradients`).

    **Arguments:**

    - `loss_fn`: `loss_fn(model, minibatch, key) -> (loss, metrics)`; `loss` a
      floating-point scalar (the minibatch mean), or a pair `(loss_sum, weight)`
      (e.g. the summed loss of the real tokens and their number) to weight
      minibatches by `weight`; `metrics` a pytree of `(sum, count)` tuples,
      arrays and/or `Metric`s. With a `model_state`:
      `loss_fn(model, model_state, minibatch, key) -> (loss, metrics,
      new_model_state)`.
    - `model`: any Equinox model; gradients are taken with respect to its
      floating-point arrays (`eqx.filter_value_and_grad`).
    - `batch`: pytree whose array leaves (rank >= 1) are split along axis 0; 0-d
      arrays and other leaves go to every minibatch unchanged.
    - `key`: split into one key per minibatch (`jax.random.split`), or `None`.
    - `num_minibatches`: how many blocks to split the batch into.
    - `model_state`: the model's non-trained state (e.g. BatchNorm statistics) or
      `None`. Minibatches run in order, each seeing the state the previous one
      returned (cast back to the incoming dtypes).
    - `use_scan`: `jax.lax.scan` over the minibatches (one compiled loop body:
      fast compilation, lowest memory; with a `model_state`, the first minibatch
      runs before the loop, so that the loop carries the state as `loss_fn`
      returns it, which `check_vma=True` requires); `False` unrolls a Python loop
      (the tutorial's default; lets XLA overlap minibatches at the cost of compile
      time).

    **Returns:**

    `(grads, metrics)`, or `(grads, metrics, new_model_state)` when a
    `model_state` is given: `grads` is the mean of the minibatch gradients (the
    model's structure, `None` at non-trained leaves); for a `(loss_sum, weight)`
    loss, the gradient of the summed `loss_sum` divided by the summed `weight`
    (zero when that is 0); `metrics` are added up over
    minibatches (`(sum, count)` tuples add elementwise, `Metric`s `merge`; Python
    numbers such as a count of `batch.shape[0]` stay numbers, added at trace time).

    **Raises:**

    `ValueError` if `num_minibatches < 1`, a batch leaf's leading dimension is not
    divisible by it, or the loss is not a scalar; `TypeError` if `loss_fn` does
    not return `(loss, metrics)` or the loss is not floating point.

    !!! Example

        ```python
        grads, metrics = ed.accumulate_gradients(loss_fn, model, batch, key, 4)
        ```
    """
    check_num_minibatches(num_minibatches, "accumulate_gradients")
    n = num_minibatches
    check_rows(batch, n, "accumulate_gradients", f"num_minibatches={n}")
    with_state = model_state is not None
    checked = CheckedLoss(loss_fn, with_state)
    # Maybe inside a `shard_map` with `check_vma=True`, where a model state the
    # minibatches make device-varying must enter the scan so (see `_scan`).
    out = accumulate(
        checked,
        checked,
        model,
        model_state,
        batch,
        key,
        n,
        use_scan,
        state_from_first=with_state,
    )
    grads = out.grads
    if out.weight is not None:
        grads = divide_by_weight(grads, out.weight)
    metrics, model_state = out.metrics, out.model_state
    return (grads, metrics, model_state) if with_state else (grads, metrics)
