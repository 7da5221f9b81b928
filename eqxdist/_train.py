"""Training: per-device randomness, the train state, gradient accumulation and the
compiled data-parallel / FSDP training steps."""

import collections
import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ._data_parallel import (
    create_data_parallel_sharding,
    local_shard_count,
    place,
    shard_batch,
)
from ._fsdp import (
    CPU_FSDP_OPTIONS,
    gather_params,
    gather_specs,
    has_fsdp_modules,
    sharded_dim,
    sync_gradients,
    tree_specs,
)
from ._metrics import Metric
from ._utils import (
    AxisName,
    check_axis_bound,
    check_axis_in_mesh,
    check_min_weight_size,
    is_array,
    is_array_like,
    path_str,
    typecheck,
)

STRATEGIES = ("dp", "fsdp")


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


class TrainState(eqx.Module):
    """Everything a training step reads and returns: the model, the optimizer
    state, the step counter and the PRNG key.

    A plain pytree (no optimizer inside, so it can be checkpointed and sharded
    like any other); the optimizer goes to `make_train_step`. Under
    `strategy="fsdp"` the optimizer state is sharded exactly like the parameters
    it belongs to.

    !!! Example

        ```python
        state = ed.TrainState.create(model, optax.adamw(1e-3), jax.random.key(0))
        ```
    """

    model: Any
    opt_state: Any
    step: Int[Array, ""]
    key: PRNGKeyArray

    @classmethod
    @typecheck
    def create(
        cls, model: Any, optimizer: optax.GradientTransformation, key: PRNGKeyArray
    ) -> "TrainState":
        """A fresh state: `optimizer.init` on the model's floating-point arrays (the
        leaves `eqx.is_inexact_array` selects, which are the ones trained), step 0.

        **Arguments:**

        - `model`: any Equinox model (or pytree of parameters).
        - `optimizer`: an Optax gradient transformation.
        - `key`: the PRNG key every step derives its randomness from
          (`fold_in(key, step)`); it stays the same from step to step.
        """
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        return cls(model, opt_state, jnp.zeros((), jnp.int32), key)


def _is_metric(x: Any) -> bool:
    return isinstance(x, Metric)


def _addable(x: Any) -> bool:
    # Python numbers (e.g. a count of `batch.shape[0]`) stay Python numbers: summed
    # over minibatches and devices at trace time, they cost no collective.
    return is_array(x) or (isinstance(x, int | float) and not isinstance(x, bool))


def merge_metrics(a: Any, b: Any) -> Any:
    """Combine two metric pytrees of the same structure: arrays and numbers (e.g.
    the parts of `(sum, count)` tuples) add, `Metric`s `merge`, other leaves are
    kept."""

    def merge(x: Any, y: Any) -> Any:
        if _is_metric(x):
            return x.merge(y)
        return x + y if _addable(x) else x

    return jax.tree.map(merge, a, b, is_leaf=_is_metric)


def _reduce_metrics(metrics: Any, axis_name: str) -> Any:
    """Every device's metrics, summed over `axis_name` (`Metric`s: `reduce`d), so
    that they are replicated and can leave `shard_map` with `out_specs=P()`."""

    def reduce(x: Any) -> Any:
        if _is_metric(x):
            return x.reduce(axis_name)
        return jax.lax.psum(x, axis_name) if _addable(x) else x

    return jax.tree.map(reduce, metrics, is_leaf=_is_metric)


def _check_num_minibatches(num_minibatches: int, caller: str) -> None:
    if num_minibatches < 1:
        raise ValueError(
            f"{caller}: `num_minibatches` must be >= 1; got {num_minibatches}."
        )


def _check_rows(batch: Any, divisor: int, caller: str, why: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if is_array(leaf) and np.ndim(leaf) > 0 and np.shape(leaf)[0] % divisor:
            raise ValueError(
                f"{caller}: batch leaf {path_str(path)} has leading dimension "
                f"{np.shape(leaf)[0]}, which is not divisible by {why}; make the "
                f"batch size a multiple of {divisor}."
            )


def _checked_loss(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`loss_fn` with its output validated: a clear error instead of one from deep
    inside `jax.grad`."""

    def wrapped(model: Any, batch: Any, key: Any) -> tuple[Array, Any]:
        out = loss_fn(model, batch, key)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "loss_fn must return a pair `(loss, metrics)`; got "
                f"{type(out).__name__}."
            )
        loss, metrics = out
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
        return loss, metrics

    return wrapped


@typecheck
def accumulate_gradients(
    loss_fn: Callable[..., Any],
    model: PyTree[Any],
    batch: PyTree[Any],
    key: PRNGKeyArray | None,
    num_minibatches: int,
    *,
    use_scan: bool = True,
) -> tuple[PyTree[Any], PyTree[Any]]:
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
      `(sum, count)` tuples, arrays and/or `Metric`s.
    - `model`: any Equinox model; gradients are taken with respect to its
      floating-point arrays (`eqx.filter_value_and_grad`).
    - `batch`: pytree whose array leaves (rank >= 1) are split along axis 0; 0-d
      arrays and other leaves go to every minibatch unchanged.
    - `key`: split into one key per minibatch (`jax.random.split`), or `None`.
    - `num_minibatches`: how many blocks to split the batch into.
    - `use_scan`: `jax.lax.scan` over the minibatches (one compiled loop body:
      fast compilation, lowest memory); `False` unrolls a Python loop (the
      tutorial's default; lets XLA overlap minibatches at the cost of compile time).

    **Returns:**

    `(grads, metrics)`: `grads` is the mean of the minibatch gradients (the model's
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
    _check_num_minibatches(num_minibatches, "accumulate_gradients")
    n = num_minibatches
    _check_rows(batch, n, "accumulate_gradients", f"num_minibatches={n}")
    grad_fn = eqx.filter_value_and_grad(_checked_loss(loss_fn), has_aux=True)
    keys = None if key is None else jax.random.split(key, n)

    def minibatch_grads(i: Any, k: Any) -> tuple[Any, Any]:
        def take(x: Any) -> Any:
            if not is_array(x) or jnp.ndim(x) == 0:
                return x
            rows = x.shape[0] // n
            return jax.lax.dynamic_slice_in_dim(x, i * rows, rows, axis=0)

        (_, metrics), grads = grad_fn(model, jax.tree.map(take, batch), k)
        return grads, metrics

    def key_at(i: int) -> Any:
        return None if keys is None else keys[i]

    if n == 1:
        return minibatch_grads(0, key_at(0))
    if use_scan:
        metric_static: list[Any] = []

        def body(carry: Any, xs: tuple[Any, Any]) -> tuple[Any, Any]:
            grads, metrics = minibatch_grads(*xs)
            dynamic, static = eqx.partition(metrics, eqx.is_array)
            metric_static[:] = [static]
            return jax.tree.map(jnp.add, carry, grads), dynamic

        zeros = jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array))
        grads, stacked = jax.lax.scan(body, zeros, (jnp.arange(n), keys))
        per_minibatch = [
            eqx.combine(jax.tree.map(lambda x, i=i: x[i], stacked), metric_static[0])
            for i in range(n)
        ]
        metrics = functools.reduce(merge_metrics, per_minibatch)
    else:
        grads, metrics = minibatch_grads(0, key_at(0))
        for i in range(1, n):
            more_grads, more_metrics = minibatch_grads(i, key_at(i))
            grads = jax.tree.map(jnp.add, grads, more_grads)
            metrics = merge_metrics(metrics, more_metrics)
    return jax.tree.map(lambda g: g / n, grads), metrics


def _metric_lines(name: str, value: Any) -> list[str]:
    if isinstance(value, Metric):
        value = value.compute()
        if isinstance(value, Mapping):
            return [
                line
                for sub, v in value.items()
                for line in _metric_lines(f"{name}/{sub}", v)
            ]
    elif isinstance(value, tuple) and len(value) == 2:
        total, count = (np.asarray(jax.device_get(v)) for v in value)
        value = total / count
    value = np.asarray(jax.device_get(value))
    if value.ndim != 0:
        raise TypeError(
            f"print_metrics: metric {name!r} is not a scalar, a `(sum, count)` pair "
            f"or a Metric; got a value of shape {value.shape}."
        )
    return [f"{name}: {float(value):.6f}"]


@typecheck
def print_metrics(metrics: Mapping[str, Any], title: str | None = None) -> None:
    """Print one line per metric, `name: value` with six decimals, under an
    optional title centred in `=` signs (the UvA tutorial's format). Prints on
    process 0 only, so a multi-process run prints each line once.

    **Arguments:**

    - `metrics`: a mapping from names to `(sum, count)` pairs (printed as
      `sum / count`), `Metric`s (printed as `compute()`; a collection prints one
      `name/child` line per child) or scalars.
    - `title`: the heading, if any.

    **Raises:**

    `TypeError` naming a metric whose value is not a scalar.

    !!! Example

        ```python
        ed.print_metrics({"accuracy": (correct, count), "loss": (loss_sum, count)},
                         "Final")
        # ===== Final ======
        # accuracy: 0.884375
        # loss: 0.510231
        ```
    """
    lines = [line for name, v in metrics.items() for line in _metric_lines(name, v)]
    if jax.process_index() != 0:
        return
    if title:
        # The tutorial's rule: the title centred in `=` to the longest line's width;
        # a title at least that wide still gets one `=` on each side.
        heading = f" {title} "
        width = max(map(len, lines), default=0)
        width = width if width > len(heading) else len(heading) + 2
        lines = [heading.center(width, "="), *lines]
    print("\n".join(lines))


def _fill(template: list[Any], positions: tuple[int, ...], arrays: Any) -> list[Any]:
    out = list(template)
    for i, a in zip(positions, arrays, strict=True):
        out[i] = a
    return out


class _Layout:
    """One compiled step for one structure of (state, batch): where the array
    leaves are, the non-array leaves to put back, and the jitted function.

    The state's arrays are passed to the jitted function in two groups: those the
    step replaces (donated) and the key, which it only reads (each step's
    randomness is `fold_in(key, step)`), so the same key object goes back into the
    new state at no cost."""

    def __init__(
        self,
        state_leaves: list[Any],
        state_def: Any,
        num_key_leaves: int,
        batch_leaves: list[Any],
        batch_def: Any,
    ) -> None:
        self.state_def = state_def
        self.batch_def = batch_def
        arrays = [i for i, x in enumerate(state_leaves) if is_array_like(x)]
        first_key_leaf = len(state_leaves) - num_key_leaves
        self.updated = tuple(i for i in arrays if i < first_key_leaf)
        self.kept = tuple(i for i in arrays if i >= first_key_leaf)
        self.state_others = tuple(
            i for i, x in enumerate(state_leaves) if not is_array_like(x)
        )
        self.batch_arrays = tuple(
            i for i, x in enumerate(batch_leaves) if is_array_like(x)
        )
        self.batch_others = tuple(
            i for i, x in enumerate(batch_leaves) if not is_array_like(x)
        )
        self.state_static = tuple(state_leaves[i] for i in self.state_others)
        self.batch_static = tuple(batch_leaves[i] for i in self.batch_others)
        self.state_template = [None if is_array_like(x) else x for x in state_leaves]
        self.batch_template = [None if is_array_like(x) else x for x in batch_leaves]
        self.fn: Any = None
        self.state_shardings: tuple[list[Any], list[Any]] = ([], [])

    def placed(self, state_leaves: list[Any]) -> bool:
        """Whether the state's arrays already lie where the step keeps them (else
        the step places a copy, as on its first call)."""
        updated, kept = self.state_shardings
        return all(
            isinstance(x := state_leaves[i], jax.Array)
            and x.sharding.is_equivalent_to(sharding, x.ndim)
            for indices, shardings in ((self.updated, updated), (self.kept, kept))
            for i, sharding in zip(indices, shardings, strict=True)
        )

    def batch_matches(self, batch_leaves: list[Any], batch_def: Any) -> bool:
        if batch_def != self.batch_def:
            return False
        return _same(
            tuple(batch_leaves[i] for i in self.batch_others), self.batch_static
        )

    def matches(
        self,
        state_leaves: list[Any],
        state_def: Any,
        batch_leaves: list[Any],
        batch_def: Any,
    ) -> bool:
        return (
            state_def == self.state_def
            and _same(
                tuple(state_leaves[i] for i in self.state_others), self.state_static
            )
            and self.batch_matches(batch_leaves, batch_def)
        )

    def state(self, updated: list[Any], kept: list[Any]) -> Any:
        leaves = list(self.state_template)
        for i, x in zip(self.updated, updated, strict=True):
            leaves[i] = x
        for i, x in zip(self.kept, kept, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(self.state_def, leaves)

    def batch(self, arrays: list[Any]) -> Any:
        return jax.tree.unflatten(
            self.batch_def, _fill(self.batch_template, self.batch_arrays, arrays)
        )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    try:
        # Tuple equality checks identity first, so the usual case (the very same
        # functions and numbers as last time) costs no comparisons.
        return bool(a == b)
    except (ValueError, TypeError):  # an array where a number was: no match
        return False


class TrainStep:
    """The callable `make_train_step` returns: `step(state, batch) -> (state,
    metrics)`. See `make_train_step`."""

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        *,
        strategy: str,
        data_axis: str,
        num_minibatches: int,
        min_weight_size: int,
        donate: bool,
        use_scan: bool,
        max_steps_in_flight: int | None,
    ) -> None:
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.mesh = mesh
        self.strategy = strategy
        self.data_axis = data_axis
        self.num_minibatches = num_minibatches
        self.min_weight_size = min_weight_size
        self.donate = donate
        self.use_scan = use_scan
        self.max_steps_in_flight = max_steps_in_flight
        self.axis_size = mesh.shape[data_axis]
        self.batch_sharding = create_data_parallel_sharding(mesh, data_axis)
        self._layouts: list[_Layout] = []
        self._last: _Layout | None = None
        # The state the last call returned (weakly: the step must not keep a state
        # the caller dropped alive), with its arrays in the groups the jitted
        # function takes: passed straight back in, it needs no flattening.
        self._last_state: weakref.ref[Any] | None = None
        self._last_arrays: tuple[list[Any], list[Any]] = ([], [])
        self._in_flight: collections.deque[Array] = collections.deque()

    # -- layouts -----------------------------------------------------------------

    def model_specs(self, model: Any) -> Any:
        """The `PartitionSpec` of every array leaf of `model` under this step's
        strategy (`None` at other leaves)."""
        if self.strategy == "dp":
            return jax.tree.map(_replicated_spec, model)
        return tree_specs(model, self.axis_size, self.data_axis, self.min_weight_size)

    def _opt_state_specs(self, state: TrainState, model_specs: Any) -> Any:
        if self.strategy == "dp":
            return jax.tree.map(_replicated_spec, state.opt_state)
        param_specs = jax.tree.map(
            lambda x, s: s if _is_param(x) else None, state.model, model_specs
        )
        try:
            specs = optax.tree_map_params(
                self.optimizer,
                lambda _, spec: spec,
                state.opt_state,
                param_specs,
                transform_non_params=_replicated_spec,
            )
        except (TypeError, ValueError, AttributeError, KeyError):
            # An optimizer whose `init` cannot run on Optax's placeholder (or a
            # state not made by this optimizer): apply the FSDP rule to the state
            # itself, which gives parameter-shaped moments the parameters' layout.
            return tree_specs(
                state.opt_state, self.axis_size, self.data_axis, self.min_weight_size
            )
        return jax.tree.map(self._compatible_spec, state.opt_state, specs)

    def _compatible_spec(self, x: Any, spec: Any) -> Any:
        # Optimizer states whose leaves are not parameter-shaped (factored
        # moments, say) keep a spec only if it fits the leaf.
        if not is_array_like(x):
            return None
        dim = sharded_dim(spec, self.data_axis) if isinstance(spec, P) else None
        if not isinstance(spec, P) or len(spec) > len(x.shape):
            return P()
        if dim is not None and x.shape[dim] % self.axis_size:
            return P()
        return spec

    def state_specs(self, state: TrainState) -> Any:
        """The `PartitionSpec` of every array leaf of `state` under this step's
        strategy, as a pytree of `state`'s structure: `P()` everywhere for `"dp"`;
        for `"fsdp"` the `fsdp_specs` rule (or an `FSDP` wrapper's own layout) for
        the model and the same layout for the matching optimizer-state leaves.
        Useful for checkpoint restore targets and custom placements."""
        model_specs = self.model_specs(state.model)
        opt_specs = self._opt_state_specs(state, model_specs)
        parts = [
            _flatten_up_to(part, specs)
            for part, specs in (
                (state.model, model_specs),
                (state.opt_state, opt_specs),
                (state.step, P()),
                (state.key, P()),
            )
        ]
        return jax.tree.unflatten(
            jax.tree.structure(state), [s for part in parts for s in part]
        )

    def place_state(self, state: TrainState) -> TrainState:
        """A copy of `state` placed on the mesh as this step keeps it (a copy, so
        that the step's donation never deletes arrays the caller still holds, such
        as those of the model the state was created from)."""
        placed: TrainState = place(state, self.state_specs(state), self.mesh, copy=True)
        return placed

    def _place_batch(self, batch: Any) -> Any:
        self._check_batch(batch)
        return shard_batch(batch, self.batch_sharding)

    def _check_batch(self, batch: Any, *, traced: bool = False) -> None:
        """Rows must split evenly over the devices and then the minibatches. In a
        multi-process run a host batch holds this process's rows only, so it is
        checked against this process's devices; global arrays (and the traced
        batch inside the step) against all of them."""
        shards = self.axis_size
        if not traced and not self.batch_sharding.is_fully_addressable:
            rows = [x for x in jax.tree.leaves(batch) if is_array(x) and np.ndim(x)]
            if not all(
                isinstance(x, jax.Array) and not x.is_fully_addressable for x in rows
            ):
                shards = local_shard_count(self.batch_sharding, self.axis_size)
        _check_rows(
            batch,
            shards * self.num_minibatches,
            "train step",
            f"{shards} devices along {self.data_axis!r} x num_minibatches="
            f"{self.num_minibatches} = {shards * self.num_minibatches}",
        )

    def _layout(self, state: Any, batch: Any) -> tuple[_Layout, Any, Any]:
        """The slow path: find or build the layout for this structure; place the
        state on the mesh.

        A host batch is left to `jit`, which moves it as its `in_shardings` say:
        placing it here would give the first call a different input type from
        the next host batches, and a second compilation."""
        if not isinstance(state, TrainState):
            raise TypeError(
                "train step: `state` must be an eqxdist.TrainState (see "
                f"TrainState.create); got {type(state).__name__}."
            )
        abstract = any(
            isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)
        )
        state = state if abstract else self.place_state(state)
        self._check_batch(batch)
        state_leaves, state_def = jax.tree.flatten(state)
        batch_leaves, batch_def = jax.tree.flatten(batch)
        for layout in self._layouts:
            if layout.matches(state_leaves, state_def, batch_leaves, batch_def):
                return layout, state, batch
        num_key_leaves = len(jax.tree.leaves(state.key))
        layout = _Layout(
            state_leaves, state_def, num_key_leaves, batch_leaves, batch_def
        )
        layout.fn = self._compile(layout, state, batch_leaves)
        self._layouts.append(layout)
        return layout, state, batch

    def _compile(
        self, layout: _Layout, state: TrainState, batch_leaves: list[Any]
    ) -> Any:
        state_specs = layout.state_def.flatten_up_to(self.state_specs(state))
        updated = [NamedSharding(self.mesh, state_specs[i]) for i in layout.updated]
        replicated = NamedSharding(self.mesh, P())
        kept = [replicated for _ in layout.kept]
        layout.state_shardings = (updated, kept)
        batch_shardings = [
            NamedSharding(
                self.mesh, P(self.data_axis) if batch_leaves[i].shape else P()
            )
            for i in layout.batch_arrays
        ]

        def run(
            updated_arrays: list[Array], kept_arrays: list[Array], batch: list[Array]
        ) -> Any:
            state = layout.state(updated_arrays, kept_arrays)
            batch = layout.batch(batch)
            self._check_batch(batch, traced=True)
            new_state, metrics = self._update(state, batch)
            leaves, new_def = jax.tree.flatten(new_state)
            if new_def != layout.state_def:
                raise ValueError(
                    "train step: the update changed the structure of the state "
                    f"from {layout.state_def} to {new_def}; the optimizer state "
                    "must keep its structure between steps."
                )
            return [leaves[i] for i in layout.updated], metrics, new_state.step

        on_cpu = self.mesh.devices.flat[0].platform == "cpu"
        return jax.jit(
            run,
            in_shardings=(updated, kept, batch_shardings),
            out_shardings=(updated, replicated, replicated),
            donate_argnums=(0,) if self.donate else (),
            compiler_options=(
                CPU_FSDP_OPTIONS if on_cpu and has_fsdp_modules(state.model) else None
            ),
        )

    # -- the step ------------------------------------------------------------------

    def _update(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        """One optimizer step on global arrays: gradients and metrics inside
        `shard_map`, then the optimizer update on the (possibly sharded) global
        arrays, which XLA keeps in the parameters' layout."""
        step_key = jax.random.fold_in(state.key, state.step)
        model = state.model
        model_specs = self.model_specs(model)
        grad_specs = jax.tree.map(
            lambda x, s: s if _is_param(x) else None, model, model_specs
        )
        top_specs = (
            gather_specs(model, self.axis_size, self.data_axis, self.min_weight_size)
            if self.strategy == "fsdp"
            else None
        )
        model_arrays, model_static = eqx.partition(model, eqx.is_array)
        batch_arrays, batch_static = eqx.partition(batch, eqx.is_array)
        batch_specs = jax.tree.map(
            lambda x: P(self.data_axis) if jnp.ndim(x) else P(), batch_arrays
        )
        axis = self.data_axis

        def local_loss(m: Any, minibatch: Any, k: Any) -> Any:
            if k is not None:
                k = fold_rng_over_axis(k, axis)
            if top_specs is not None:
                m = gather_params(m, top_specs, axis)
            return self.loss_fn(m, minibatch, k)

        def per_device(arrays: Any, k: Any, local_batch: Any) -> tuple[Any, Any]:
            grads, metrics = accumulate_gradients(
                local_loss,
                eqx.combine(arrays, model_static),
                eqx.combine(local_batch, batch_static),
                k,
                self.num_minibatches,
                use_scan=self.use_scan,
            )
            return (
                sync_gradients(grads, model_specs, (axis,)),
                _reduce_metrics(metrics, axis),
            )

        # check_vma=False: gradients of replicated parameters stay per-device and
        # are averaged explicitly (sync_gradients), as in a hand-written step, and
        # the compiled step carries no replication checks.
        grads, metrics = jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(model_specs, P(), batch_specs),
            out_specs=(grad_specs, P()),
            check_vma=False,
        )(model_arrays, step_key, batch_arrays)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, params)
        new_params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
        new_model = eqx.combine(new_params, model)
        return TrainState(new_model, opt_state, state.step + 1, state.key), metrics

    def _forget(self, _: Any) -> None:
        self._last_arrays = ([], [])

    def _arrays(
        self, layout: _Layout, state: Any, batch: Any
    ) -> tuple[list[Any], list[Any], list[Any]]:
        state_leaves = jax.tree.leaves(state)
        batch_leaves = jax.tree.leaves(batch)
        return (
            [state_leaves[i] for i in layout.updated],
            [state_leaves[i] for i in layout.kept],
            [batch_leaves[i] for i in layout.batch_arrays],
        )

    def lower(self, state: TrainState, batch: PyTree[Any]) -> Any:
        """`jax.jit(...).lower` of the step for these arguments (placed first), e.g.
        for `.compile().memory_analysis()` or `.as_text()`. `state` may be abstract
        (`eqx.filter_eval_shape(TrainState.create, ...)`), to inspect the step of a
        model too large to allocate here."""
        layout, state, batch = self._layout(state, batch)
        return layout.fn.lower(*self._arrays(layout, state, batch))

    def __call__(self, state: TrainState, batch: PyTree[Any]) -> tuple[TrainState, Any]:
        """One training step; see `make_train_step`."""
        # The hot path: the state the last call returned needs no flattening, the
        # batch one C++ flatten and a structure check; then one call to the jitted
        # function over the array leaves. No per-leaf filtering.
        batch_leaves, batch_def = jax.tree.flatten(batch)
        layout = self._last
        if (
            layout is not None
            and self._last_state is not None
            and state is self._last_state()
            and layout.batch_matches(batch_leaves, batch_def)
        ):
            updated, kept = self._last_arrays
        else:
            state_leaves, state_def = jax.tree.flatten(state)
            if layout is None or not layout.matches(
                state_leaves, state_def, batch_leaves, batch_def
            ):
                layout, state, batch = self._layout(state, batch)
                self._last = layout
                state_leaves = jax.tree.leaves(state)
                batch_leaves = jax.tree.leaves(batch)
            elif not layout.placed(state_leaves):
                # A new state of a known structure (a fresh model, say): place a
                # copy, so that donation never deletes the caller's arrays.
                state_leaves = jax.tree.leaves(self.place_state(state))
            updated = [state_leaves[i] for i in layout.updated]
            kept = [state_leaves[i] for i in layout.kept]
        batch_arrays = [batch_leaves[i] for i in layout.batch_arrays]
        if not self.batch_sharding.is_fully_addressable and not all(
            isinstance(x, jax.Array) for x in batch_arrays
        ):
            # Each process passes its own rows: only `shard_batch` can assemble them.
            placed = jax.tree.leaves(self._place_batch(batch))
            batch_arrays = [placed[i] for i in layout.batch_arrays]
        try:
            new_arrays, metrics, token = layout.fn(updated, kept, batch_arrays)
        except ValueError:
            # A batch already on the mesh in another layout: jit rejects it rather
            # than moving it. (The state was placed above.) Place it; try again.
            placed = jax.tree.leaves(self._place_batch(batch))
            batch_arrays = [placed[i] for i in layout.batch_arrays]
            new_arrays, metrics, token = layout.fn(updated, kept, batch_arrays)
        new_state: TrainState = layout.state(new_arrays, kept)
        self._last_state = weakref.ref(new_state, self._forget)
        self._last_arrays = (new_arrays, kept)
        if self.max_steps_in_flight is not None:
            self._in_flight.append(token)
            if len(self._in_flight) > self.max_steps_in_flight:
                self._in_flight.popleft().block_until_ready()
        return new_state, metrics


def _flatten_up_to(tree: Any, specs: Any) -> list[Any]:
    """`specs`' leaves, one per leaf of `tree` (`None` at non-array leaves)."""
    treedef: Any = jax.tree.structure(tree)
    leaves: list[Any] = treedef.flatten_up_to(specs)
    return leaves


def _is_param(x: Any) -> bool:
    return is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _replicated_spec(x: Any) -> P | None:
    return P() if is_array_like(x) else None


@typecheck
def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    strategy: str = "dp",
    data_axis: str = "data",
    num_minibatches: int = 1,
    min_weight_size: int = 2**18,
    donate: bool = True,
    use_scan: bool = True,
    max_steps_in_flight: int | None = 8,
) -> TrainStep:
    """Build a compiled, sharded training step `step(state, batch) -> (state,
    metrics)`.

    Each call computes the gradients of `loss_fn` on every
    device's rows of `batch` (in `num_minibatches` blocks, `accumulate_gradients`),
    averages them across devices, applies `optimizer` and returns the new state and
    the step's metrics summed over every device and minibatch.

    - `strategy="dp"` (data parallel): the state is replicated on every device;
      gradients are averaged with `pmean`.
    - `strategy="fsdp"`: parameters larger than `min_weight_size` (and the matching
      optimizer state) are sharded over `data_axis` (`fsdp_specs`); they are
      all-gathered for the forward pass and their gradients reduce-scattered
      (`gather_params`), so `loss_fn` still sees the full model and the update
      equals data parallel's. `FSDP` submodules keep their own layout and gather
      themselves, one block at a time.

    `loss_fn(model, minibatch, key) -> (loss, metrics)` is written as for a single
    device, for a minibatch of this device's rows. Its `key` differs on every step,
    minibatch and device: the step's key is `fold_in(state.key, state.step)`, split
    into one key per minibatch (`accumulate_gradients`) and folded over
    `data_axis` (`fold_rng_over_axis`), so dropout masks differ between devices and
    a run restarted from a checkpoint draws the same numbers.

    The step is compiled on the first call (and again only for a new structure or
    shape). The hot path does no per-leaf filtering: it flattens the state once and
    calls the jitted `shard_map` over its arrays. The state is donated (its buffers
    are reused for the new state). Unplaced (host or single-device) states and
    batches are placed as the strategy needs, and the returned state is placed
    that way. At most `max_steps_in_flight` steps are queued before the step waits
    for the oldest, so a loop that never blocks cannot deadlock XLA's CPU
    collectives.

    **Arguments:**

    - `loss_fn`: see above.
    - `optimizer`: an Optax gradient transformation. Under `"fsdp"` it runs on the
      sharded global arrays, so even whole-tree transformations (e.g. global-norm
      clipping) see every parameter.
    - `mesh`: the device mesh; `data_axis` must be one of its axes.
    - `strategy`: `"dp"` or `"fsdp"`.
    - `data_axis`: the mesh axis the batch (and, for FSDP, the state) is split over.
    - `num_minibatches`: gradient accumulation steps per call.
    - `min_weight_size`: for `"fsdp"`, leaves this small or smaller are replicated.
    - `donate`: reuse the input state's buffers for the output (do not use the
      state you passed in after the call).
    - `use_scan`: see `accumulate_gradients`.
    - `max_steps_in_flight`: the bound on queued steps (`None`: unbounded).

    **Returns:**

    A `TrainStep`: call it as `step(state, batch)`. The metrics come back already
    reduced across devices (arrays and `(sum, count)` parts summed, `Metric`s
    `reduce`d). It also has `state_specs(state)`, `place_state(state)` and
    `lower(state, batch)` (for inspecting the compiled step).

    **Raises:**

    `ValueError` for an unknown `strategy`, `num_minibatches < 1`, a negative
    `min_weight_size`, a `data_axis` not in `mesh`; when called, `ValueError` for
    a batch leaf whose leading dimension is not divisible by (devices along
    `data_axis`) x `num_minibatches`, or a non-scalar loss, and `TypeError` if
    `state` is not a `TrainState`.

    !!! Example

        ```python
        step = ed.make_train_step(loss_fn, optax.adamw(1e-3), mesh,
                                  strategy="fsdp", num_minibatches=4)
        state = ed.TrainState.create(model, optax.adamw(1e-3), jax.random.key(0))
        for batch in batches:
            state, metrics = step(state, batch)
        ed.print_metrics(metrics, "Last step")
        ```
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"make_train_step: unknown strategy {strategy!r}; use one of "
            f"{list(STRATEGIES)}."
        )
    _check_num_minibatches(num_minibatches, "make_train_step")
    check_min_weight_size(min_weight_size, "make_train_step")
    if max_steps_in_flight is not None and max_steps_in_flight < 1:
        raise ValueError(
            "make_train_step: `max_steps_in_flight` must be >= 1 or None; got "
            f"{max_steps_in_flight}."
        )
    check_axis_in_mesh(mesh, data_axis, "make_train_step", "data_axis")
    return TrainStep(
        loss_fn,
        optimizer,
        mesh,
        strategy=strategy,
        data_axis=data_axis,
        num_minibatches=num_minibatches,
        min_weight_size=min_weight_size,
        donate=donate,
        use_scan=use_scan,
        max_steps_in_flight=max_steps_in_flight,
    )
