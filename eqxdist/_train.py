"""Training: per-device randomness, the train state, gradient accumulation and what
one data-parallel / FSDP training step computes (`StepMath`).

Where the step's arrays live is `_layout.Layout`'s business, why it does not
recompile is `_compiled.CompiledStep`'s, and `_steps.make_train_step` puts the
three together."""

import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, PartitionSpec as P
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ._fsdp import sync_gradients
from ._layout import Layout
from ._metrics.tree import check_metrics, merge_metrics, reduce_metrics
from ._utils import (
    AxisName,
    cast_floating,
    check_axis_bound,
    check_rows,
    is_array,
    is_array_like,
    typecheck,
)

FSDP_GATHERS = ("step", "minibatch")
"""`make_train_step(fsdp_gather=...)`: gather once per step, or per minibatch."""


@typecheck
def fold_rng_over_axis(key: PRNGKeyArray, axis_name: AxisName) -> Array:
    """A different key on each device along `axis_name`, inside `jax.shard_map`.

    Folds the device's index along `axis_name` into `key`, so that e.g. dropout
    masks differ between the devices that hold different parts of a batch, while
    devices that differ only along other axes (say, a model axis) agree.

    **Arguments:**

    - `key`: a PRNG key (typed `jax.random.key` or raw `uint32[2]`), the same on
      every device.
    - `axis_name`: the mesh axis (or axes) to vary over.

    !!! Example

        ```python
        def loss_fn(model, batch, key):
            key = ed.fold_rng_over_axis(key, "data")  # per-device dropout key
            ...
        ```
    """
    names = check_axis_bound(axis_name, "fold_rng_over_axis")
    return jax.random.fold_in(key, jax.lax.axis_index(names))


def _is_inexact(x: Any) -> bool:
    return is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact)


class TrainState(eqx.Module):
    """Everything a training step reads and returns: the model, the optimizer
    state, the step counter, the PRNG key, the model's own state (e.g. BatchNorm
    statistics) and which parameters are trained.

    A plain pytree (no optimizer inside, so it can be checkpointed and sharded
    like any other); the optimizer goes to `make_train_step`. Under
    `strategy="fsdp"` the optimizer state is sharded exactly like the parameters
    it belongs to.

    - `model_state`: the non-trained state the model carries between steps, e.g.
      the `eqx.nn.State` of `eqx.nn.make_with_state`; `None` for models without.
    - `trainable`: which leaves of `model` are trained, one bool per leaf of
      `jax.tree.leaves(model)` (resolved by `create` from a filter spec); `None`
      means every floating-point array. Frozen leaves get no optimizer state and
      never change.

    !!! Example

        ```python
        model, model_state = eqx.nn.make_with_state(Net)(key)
        state = ed.TrainState.create(model, optax.adamw(1e-3), jax.random.key(0),
                                     model_state=model_state)
        ```
    """

    model: Any
    opt_state: Any
    step: Int[Array, ""]
    key: PRNGKeyArray
    model_state: Any = None
    trainable: tuple[bool, ...] | None = eqx.field(default=None, static=True)

    def __check_init__(self) -> None:
        step = self.step
        if not (
            is_array_like(step)
            and jnp.issubdtype(step.dtype, jnp.integer)
            and tuple(step.shape) == ()
        ):
            raise TypeError(
                "TrainState: `step` must be a 0-d integer JAX array, e.g. "
                f"`jnp.zeros((), jnp.int32)`; got {type(step).__name__} {step!r}. "
                "Use TrainState.create to build a fresh state."
            )

    @classmethod
    @typecheck
    def create(
        cls,
        model: Any,
        optimizer: Any,
        key: PRNGKeyArray,
        *,
        model_state: Any = None,
        trainable: Any = None,
    ) -> "TrainState":
        """A fresh state: `optimizer.init` on the trainable leaves of the model,
        step 0.

        **Arguments:**

        - `model`: any Equinox model (or pytree of parameters).
        - `optimizer`: an Optax gradient transformation, or any object with Optax's
          `init`/`update` (e.g. `optax.MultiSteps`).
        - `key`: the PRNG key every step derives its randomness from
          (`fold_in(key, step)`); it stays the same from step to step.
        - `model_state`: the model's non-trained state (e.g. from
          `eqx.nn.make_with_state`), or `None`.
        - `trainable`: a filter spec as `eqx.partition` takes it (a callable on
          leaves, or a pytree prefix of `model` of bools/callables) selecting the
          trained leaves; only floating-point arrays among them are trained.
          `None`: every floating-point array (`eqx.is_inexact_array`).

        **Raises:**

        `ValueError` if `trainable` does not fit the model's structure or selects
        no floating-point array.

        !!! Example

            ```python
            # Fine-tune the head only.
            trainable = jax.tree.map(lambda _: False, model)
            trainable = eqx.tree_at(lambda m: m.head, trainable, True)
            state = ed.TrainState.create(model, optax.adam(1e-3), key,
                                         trainable=trainable)
            ```
        """
        optimizer = as_optimizer(optimizer, "TrainState.create")
        mask: tuple[bool, ...] | None = None
        if trainable is not None:
            missing = object()
            try:
                chosen = eqx.filter(model, trainable, replace=missing)
            except (ValueError, TypeError) as e:
                raise ValueError(
                    "TrainState.create: `trainable` must be a callable on leaves or a "
                    "pytree prefix of `model` with bools/callables at its leaves; "
                    f"it does not fit the model: {e}"
                ) from None
            mask = tuple(
                x is not missing and _is_inexact(x) for x in jax.tree.leaves(chosen)
            )
            if not any(mask):
                raise ValueError(
                    "TrainState.create: `trainable` selects no floating-point array "
                    "of the model; nothing would be trained."
                )
        params = eqx.filter(model, trainable_mask_tree(model, mask))
        return cls(
            model,
            optimizer.init(params),
            jnp.zeros((), jnp.int32),
            key,
            model_state=model_state,
            trainable=mask,
        )

    def trainable_mask(self) -> Any:
        """A pytree of `model`'s structure: `True` at every trained leaf."""
        return trainable_mask_tree(self.model, self.trainable)

    def params(self) -> Any:
        """The trained leaves of `model` (`None` elsewhere): what the optimizer
        state belongs to."""
        return eqx.filter(self.model, self.trainable_mask())


def as_optimizer(optimizer: Any, caller: str) -> optax.GradientTransformation:
    """`optimizer` as an `optax.GradientTransformation`, or a `TypeError` unless it
    follows Optax's convention: `init(params)` and `update(updates, state,
    params)` (e.g. `optax.MultiSteps`, which is not a `GradientTransformation`)."""
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if not (
        callable(getattr(optimizer, "init", None))
        and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            f"{caller}: `optimizer` must be an Optax gradient transformation (an "
            "object with `init(params)` and `update(updates, state, params)`, e.g. "
            f"optax.adamw(1e-3) or optax.MultiSteps(...)); got "
            f"{type(optimizer).__name__}."
        )
    return optax.GradientTransformationExtraArgs(optimizer.init, optimizer.update)


def trainable_mask_tree(model: Any, trainable: tuple[bool, ...] | None) -> Any:
    """A pytree of `model`'s structure: `True` at every leaf `trainable` (a
    `TrainState.trainable`) trains."""
    leaves, treedef = jax.tree.flatten(model)
    if trainable is None:
        return jax.tree.unflatten(treedef, [_is_inexact(x) for x in leaves])
    if len(trainable) != len(leaves):
        raise ValueError(
            f"TrainState: `trainable` has {len(trainable)} entries but the model has "
            f"{len(leaves)} leaves; the model's structure changed since "
            "TrainState.create. Build the state again with TrainState.create."
        )
    mask = [t and _is_inexact(x) for t, x in zip(trainable, leaves, strict=True)]
    return jax.tree.unflatten(treedef, mask)


def check_num_minibatches(num_minibatches: int, caller: str) -> None:
    if num_minibatches < 1:
        raise ValueError(
            f"{caller}: `num_minibatches` must be >= 1; got {num_minibatches}."
        )


def _checked_loss(loss_fn: Callable[..., Any], with_state: bool) -> Callable[..., Any]:
    """`loss_fn` as `(model, model_state, batch, key) -> (loss, (metrics, state))`,
    its output validated: a clear error instead of one from deep inside
    `jax.grad`."""
    arity = "(loss, metrics, new_model_state)" if with_state else "(loss, metrics)"

    def wrapped(model: Any, model_state: Any, batch: Any, key: Any) -> Any:
        if with_state:
            out = loss_fn(model, model_state, batch, key)
        else:
            out = loss_fn(model, batch, key)
        if not (isinstance(out, tuple) and len(out) == (3 if with_state else 2)):
            raise TypeError(
                f"loss_fn must return a tuple `{arity}`"
                + (" (the state has a model_state)" if with_state else "")
                + f"; got {type(out).__name__}"
                + (f" of length {len(out)}." if isinstance(out, tuple) else ".")
            )
        loss, metrics = out[0], out[1]
        if not is_array(loss) or jnp.shape(loss) != ():
            raise ValueError(
                f"loss_fn must return a scalar loss; got {type(loss).__name__} of "
                f"shape {jnp.shape(loss)}. Reduce it, e.g. with `.mean()`."
            )
        if not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
            raise TypeError(
                f"loss_fn must return a floating-point loss; got dtype "
                f"{jnp.result_type(loss)}."
            )
        check_metrics(metrics, "loss_fn")
        new_state = _same_state(out[2], model_state) if with_state else None
        return loss, (metrics, new_state)

    return wrapped


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


def _accumulate(
    loss: Callable[..., Any],
    diff: Any,
    model_state: Any,
    batch: Any,
    key: Any,
    n: int,
    use_scan: bool,
) -> tuple[Any, Any, Any, Any]:
    """The engine of `accumulate_gradients`: `loss(diff, model_state, minibatch,
    key) -> (loss, (metrics, model_state))`, differentiated with respect to the
    floating-point arrays of `diff`, minibatch after minibatch (in order, each
    seeing the model state the previous one returned)."""
    grad_fn = eqx.filter_value_and_grad(loss, has_aux=True)
    keys = None if key is None else jax.random.split(key, n)

    def minibatch(i: Any, k: Any, state: Any) -> tuple[Any, Any, Any, Any]:
        def take(x: Any) -> Any:
            if not is_array(x) or jnp.ndim(x) == 0:
                return x
            rows = x.shape[0] // n
            return jax.lax.dynamic_slice_in_dim(x, i * rows, rows, axis=0)

        (value, (metrics, state)), grads = grad_fn(
            diff, state, jax.tree.map(take, batch), k
        )
        return grads, value.astype(jnp.float32), metrics, state

    def key_at(i: int) -> Any:
        return None if keys is None else keys[i]

    if n == 1:
        return minibatch(0, key_at(0), model_state)
    if use_scan:
        metric_static: list[Any] = []

        def body(carry: Any, xs: tuple[Any, Any]) -> tuple[Any, Any]:
            total, loss_total, state = carry
            grads, value, metrics, state = minibatch(*xs, state)
            dynamic, static = eqx.partition(metrics, eqx.is_array)
            metric_static[:] = [static]
            total = jax.tree.map(jnp.add, total, grads)
            return (total, loss_total + value, state), dynamic

        zeros = jax.tree.map(jnp.zeros_like, eqx.filter(diff, eqx.is_inexact_array))
        (grads, loss_sum, model_state), stacked = jax.lax.scan(
            body,
            (zeros, jnp.zeros((), jnp.float32), model_state),
            (jnp.arange(n), keys),
        )
        per_minibatch = [
            eqx.combine(jax.tree.map(lambda x, i=i: x[i], stacked), metric_static[0])
            for i in range(n)
        ]
        metrics = per_minibatch[0]
        for more in per_minibatch[1:]:
            metrics = merge_metrics(metrics, more)
    else:
        grads, loss_sum, metrics, model_state = minibatch(0, key_at(0), model_state)
        for i in range(1, n):
            more_grads, value, more, model_state = minibatch(i, key_at(i), model_state)
            grads = jax.tree.map(jnp.add, grads, more_grads)
            loss_sum = loss_sum + value
            metrics = merge_metrics(metrics, more)
    return jax.tree.map(lambda g: g / n, grads), loss_sum / n, metrics, model_state


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
      floating-point scalar (the minibatch mean); `metrics` a pytree of
      `(sum, count)` tuples, arrays and/or `Metric`s. With a `model_state`:
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
      fast compilation, lowest memory); `False` unrolls a Python loop (the
      tutorial's default; lets XLA overlap minibatches at the cost of compile time).

    **Returns:**

    `(grads, metrics)`, or `(grads, metrics, new_model_state)` when a
    `model_state` is given: `grads` is the mean of the minibatch gradients (the model's
    structure, `None` at non-trained leaves); `metrics` are added up over
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
    checked = _checked_loss(loss_fn, with_state)
    grads, _, metrics, model_state = _accumulate(
        checked, model, model_state, batch, key, n, use_scan
    )
    return (grads, metrics, model_state) if with_state else (grads, metrics)


def _first_device(x: Any, axes: tuple[str, ...]) -> Any:
    """`x` as the first device along `axes` holds it, on every device (exact for
    any dtype: every other device adds zeros)."""
    first = jax.lax.axis_index(axes) == 0
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _first_device(jax.random.key_data(x), axes)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if x.dtype == jnp.bool_:
        return jax.lax.psum(jnp.where(first, x, False).astype(jnp.int32), axes) > 0
    return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axes)


def sync_model_state(model_state: Any, axes: tuple[str, ...]) -> Any:
    """Floating-point leaves averaged over `axes` (a no-op for statistics the model
    already synchronises), every other array leaf taken from the first device."""

    def sync(x: Any) -> Any:
        if not is_array(x):
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.pmean(x, axes)
        return _first_device(x, axes)

    return jax.tree.map(sync, model_state)


def split_inputs(
    model: Any, mask: Any, model_state: Any, batch: Any
) -> tuple[tuple[Any, Any, Any], tuple[Any, Any], tuple[Any, Any]]:
    """What a step passes into `shard_map` and what it closes over:
    `((trained, frozen, static), (model-state arrays, static), (batch arrays,
    static))`, `mask` choosing the trained leaves of `model`."""
    arrays, static = eqx.partition(model, is_array)
    trained, frozen = eqx.partition(arrays, mask)
    return (
        (trained, frozen, static),
        eqx.partition(model_state, is_array),
        eqx.partition(batch, is_array),
    )


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


def shard_map_mesh(mesh: Mesh, axes: tuple[str, ...], with_state: bool) -> Mesh:
    """The mesh a step's `shard_map` runs on: `mesh`, with a trailing size-1 axis
    when a model state is carried and every axis of `mesh` is manual.

    Inside a fully manual `shard_map` traced values carry the manual mesh in their
    type while fresh constants do not, so `eqx.nn.State.set(index,
    jnp.array(False))` (BatchNorm's `mode="ema"` flag) fails Equinox's check that
    a value keeps its type. One automatic axis of size 1 leaves the computation
    unchanged and gives traced values and constants the same type."""
    if not with_state or not set(mesh.axis_names) <= set(axes):
        return mesh
    return Mesh(
        mesh.devices[..., None],
        (*mesh.axis_names, "_eqxdist_auto"),
        axis_types=(*mesh.axis_types, AxisType.Auto),
    )


class StepMath(eqx.Module):
    """What one training step computes, on global arrays: gradients and metrics
    inside `jax.shard_map` (manual over the data axes), then the optimizer update
    on the (possibly sharded) global arrays, which XLA keeps in the parameters'
    layout."""

    loss_fn: Callable[..., Any] = eqx.field(static=True)
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    num_minibatches: int = eqx.field(static=True)
    use_scan: bool = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)
    fsdp_gather: str = eqx.field(static=True)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        layout = self.layout
        axes = layout.data_axes
        layout.check_rows(batch, self.num_minibatches, traced=True)
        specs = layout.state_specs(state, self.optimizer)
        manual = layout.manual_specs(state.model, specs.model)
        gspecs = layout.gather_specs(state.model, specs.model)
        mask = state.trainable_mask()
        (
            (params, frozen, static),
            (ms_arrays, ms_static),
            (batch_arrays, batch_static),
        ) = split_inputs(state.model, mask, state.model_state, batch)
        batch_specs = layout.batch_specs(batch_arrays)
        with_state = state.model_state is not None
        loss = _checked_loss(self.loss_fn, with_state)
        cast = self.compute_dtype
        wants_value = reads_value(
            self.optimizer, eqx.filter(state.model, mask), state.opt_state
        )

        def gather(tree: Any) -> Any:
            return layout.gather(tree, gspecs)

        def materialise(p: Any) -> Any:
            # Cast before the gather, so that FSDP's all-gathers (and the
            # reduce-scatters of their gradients) move the compute dtype; back to
            # the parameters' dtype after, so gradients add up in it.
            full = gather(cast_floating(p, cast))
            return jax.tree.map(lambda f, x: f.astype(x.dtype), full, p)

        def per_device(
            p: Any, f: Any, ms: Any, key: Any, local_batch: Any
        ) -> tuple[Any, Any, Any, Any]:
            frozen_full = gather(f)
            local_batch = eqx.combine(local_batch, batch_static)

            def loss_of(full: Any, ms: Any, minibatch: Any, k: Any) -> Any:
                if k is not None:
                    k = fold_rng_over_axis(k, axes)
                model = eqx.combine(cast_floating(full, cast), frozen_full, static)
                return loss(model, eqx.combine(ms, ms_static), minibatch, k)

            def run(loss_of: Callable[..., Any], diff: Any) -> Any:
                return _accumulate(
                    loss_of,
                    diff,
                    ms,
                    local_batch,
                    key,
                    self.num_minibatches,
                    self.use_scan,
                )

            if self.fsdp_gather == "step":
                # Gather once, accumulate full-size gradients over the minibatches,
                # reduce-scatter once (the VJP of the gather).
                full, pullback = jax.vjp(materialise, p)
                grads, value, metrics, new_ms = run(loss_of, full)
                (grads,) = pullback(grads)
            else:
                grads, value, metrics, new_ms = run(
                    lambda q, *rest: loss_of(materialise(q), *rest), p
                )
            new_ms = eqx.filter(new_ms, is_array) if with_state else None
            return (
                sync_gradients(grads, manual, axes),
                jax.lax.pmean(value, axes) if wants_value else None,
                reduce_metrics(metrics, axes),
                sync_model_state(new_ms, axes),
            )

        # check_vma=False: gradients of replicated parameters stay per-device and
        # are averaged explicitly (sync_gradients), as in a hand-written step, and
        # the compiled step carries no replication checks. Manual over the data
        # axes only: tensor-parallel rule axes are left to XLA.
        grads, value, metrics, new_ms = jax.shard_map(
            per_device,
            mesh=shard_map_mesh(layout.mesh, axes, with_state),
            in_specs=(manual, manual, P(), P(), batch_specs),
            out_specs=(manual, P(), P(), P()),
            axis_names=frozenset(axes),
            check_vma=False,
        )(
            params,
            frozen,
            ms_arrays,
            jax.random.fold_in(state.key, state.step),
            batch_arrays,
        )
        trained = eqx.filter(state.model, mask)
        extra = {"value": value} if wants_value else {}
        updates, opt_state = self.optimizer.update(
            grads, state.opt_state, trained, **extra
        )
        new_params = jax.tree.map(
            lambda p, u: (p + u).astype(p.dtype), trained, updates
        )
        new_model = eqx.combine(new_params, eqx.filter(state.model, mask, inverse=True))
        new_state = TrainState(
            new_model,
            opt_state,
            state.step + 1,
            state.key,
            model_state=eqx.combine(new_ms, ms_static) if with_state else None,
            trainable=state.trainable,
        )
        return new_state, metrics


def check_train_state(state: Any, caller: str) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(
            f"{caller}: `state` must be an eqxdist.TrainState (see "
            f"TrainState.create); got {type(state).__name__}."
        )
