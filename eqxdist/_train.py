"""What one training step computes (`StepMath`), and what the train and
evaluation steps share: the layout built from a step builder's arguments, the
inputs of the step's `shard_map` (`StepInputs`), per-device randomness and the
model state after a step.

Where the step's arrays live is `_layout.Layout`'s business, why it does not
recompile is `_compiled.CompiledStep`'s, and `_steps.make_train_step` puts the
three together."""

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray

from ._accumulate import (
    Accumulated,
    CheckedLoss,
    accumulate,
    divide_by_weight,
    weight_scale,
)
from ._layout import Layout
from ._mesh import retyped
from ._metrics.tree import reduce_metrics
from ._partition import KeyPath, choose, partitioned as partitioned_layers
from ._plan import WEIGHT, ModelPlan
from ._state import TrainState
from ._statistics import NONFINITE, SQUARES, global_sums, local_sums
from ._update import (
    apply_update,
    finish_gradients,
    gradient_finishers,
    keep_if,
    reads_value,
    step_statistics,
    update_unless,
)
from ._utils import AxisName, cast_floating, check_axis_bound, is_array, typecheck

FSDP_GATHERS = ("step", "minibatch")
"""`make_train_step(fsdp_gather=...)`: gather once per step, or per minibatch."""

LAYOUT_ARGUMENTS = (
    "strategy",
    "data_axis",
    "fsdp_axis",
    "min_weight_size",
    "param_rules",
    "fsdp_layout",
)
"""The arguments of `make_train_step` and `make_eval_step` that choose the layout."""


def step_layout(mesh: Mesh, caller: str, arguments: Mapping[str, Any]) -> Layout:
    """The layout of the step `caller` builds, from its arguments (its `locals()`):
    the train and evaluation steps take the same layout options."""
    options = {name: arguments[name] for name in LAYOUT_ARGUMENTS}
    return Layout(mesh, caller=caller, **options)


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


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What a step's `jax.shard_map` takes, split from the model, its model state
    and the batch (arrays go in, everything else is put back inside), with the
    specs they go in with: the preamble the train and evaluation math share."""

    layout: Layout
    trained: Any
    frozen: Any
    static: Any
    ms_arrays: Any
    ms_static: Any
    batch_arrays: Any
    batch_static: Any
    plan: ModelPlan
    with_state: bool

    @classmethod
    def split(
        cls, layout: Layout, model: Any, mask: Any, model_state: Any, batch: Any
    ) -> "StepInputs":
        """`mask` chooses the trained leaves of `model` (cast to the compute
        dtype; the others are frozen)."""
        arrays, static = eqx.partition(model, is_array)
        trained, frozen = eqx.partition(arrays, mask)
        ms_arrays, ms_static = eqx.partition(model_state, is_array)
        batch_arrays, batch_static = eqx.partition(batch, is_array)
        return cls(
            layout,
            trained,
            frozen,
            static,
            ms_arrays,
            ms_static,
            batch_arrays,
            batch_static,
            layout.plan(model),
            model_state is not None,
        )

    @property
    def manual(self) -> Any:
        """The model's specs over the data axes: how its leaves enter the map."""
        return self.plan.manual

    @property
    def mesh(self) -> Mesh:
        """The mesh the step computes on (`Layout.compute_mesh`)."""
        return self.layout.compute_mesh(self.with_state)

    def gather(
        self,
        tree: Any,
        *,
        combined: bool = False,
        partitioned: frozenset[KeyPath] = frozenset(),
    ) -> Any:
        """Inside `shard_map`: FSDP-sharded leaves of `tree` all-gathered
        (`ModelPlan.gathered`)."""
        return self.plan.gathered(tree, combined=combined, partitioned=partitioned)

    def model(
        self, trained: Any, frozen: Any, partitioned: frozenset[KeyPath] = frozenset()
    ) -> Any:
        """Inside `shard_map`: the model from its (gathered) array parts, the
        `partitioned` layers (`_partition`) computing on their weights' shards."""
        model = eqx.combine(trained, frozen, self.static)
        axis = self.plan.fsdp_axis
        return model if axis is None else partitioned_layers(model, partitioned, axis)

    def model_state(self, ms_arrays: Any) -> Any:
        return eqx.combine(ms_arrays, self.ms_static)

    def local_batch(self, batch_arrays: Any) -> Any:
        return eqx.combine(batch_arrays, self.batch_static)

    def shard_map(
        self,
        per_device: Callable[..., Any],
        extra: tuple[Any, ...],
        extra_specs: tuple[Any, ...],
        out_specs: Any,
    ) -> Any:
        """`per_device(trained, frozen, ms_arrays, batch_arrays, *extra)` on every
        device's rows, manual over the data axes only (tensor-parallel rule axes
        are left to XLA).

        `check_vma=False`: gradients of replicated parameters stay per-device and
        are averaged explicitly (`sync_gradients`), as in a hand-written step, and
        the compiled step carries no replication checks."""
        layout = self.layout
        batch_specs = layout.batch_specs(self.batch_arrays)
        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(self.manual, self.manual, P(), batch_specs, *extra_specs),
            out_specs=out_specs,
            axis_names=frozenset(layout.data_axes),
            check_vma=False,
        )(self.trained, self.frozen, self.ms_arrays, self.batch_arrays, *extra)


class StepMath(eqx.Module):
    """What one training step computes, on global arrays: gradients and metrics
    inside `jax.shard_map` (manual over the data axes), then the optimizer update
    on the (possibly sharded) global arrays, which XLA keeps in the parameters'
    layout. Returns `(state, metrics)`, or `(state, (metrics, info))` with
    `step_info`."""

    loss_fn: Callable[..., Any] = eqx.field(static=True)
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    num_minibatches: int = eqx.field(static=True)
    use_scan: bool = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)
    fsdp_gather: str = eqx.field(static=True)
    step_info: bool = eqx.field(static=True, default=False)
    skip_nonfinite: bool = eqx.field(static=True, default=False)
    fsdp_linears: str = eqx.field(static=True, default="auto")

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        """Traced with `layout.compute_mesh(...)` as the context mesh."""
        state, batch = retyped((state, batch), self.layout.mesh)
        self.layout.check_rows(batch, self.num_minibatches, traced=True)
        mask = state.trainable_mask()
        inputs = StepInputs.split(
            self.layout, state.model, mask, state.model_state, batch
        )
        trained = eqx.filter(state.model, mask)
        wants_value = reads_value(self.optimizer, trained, state.opt_state)
        plan, layout = inputs.plan, self.layout
        # The gradients leave the map as sums; the update divides them (see
        # `ModelPlan.sum_gradients`).
        counts = plan.mean_counts(layout.mesh, layout.data_axes)
        grad_kinds, update_kinds = statistics_kinds(self.step_info, self.skip_nonfinite)
        per_device = functools.partial(
            self._per_device,
            inputs,
            counts,
            grad_kinds,
            wants_value or self.skip_nonfinite,
            _shapes(state.model),
        )
        grads, value, scale, metrics, new_ms, *grad_sums = inputs.shard_map(
            per_device,
            (jax.random.fold_in(state.key, state.step),),
            (P(),),
            (inputs.plan.grad_specs, P(), P(), P(), P())
            + ((P(),) if grad_kinds else ()),
        )
        update = functools.partial(
            apply_update,
            self.optimizer,
            functools.partial(finish_gradients, grads, counts, scale),
            {"value": value} if wants_value else {},
            (
                functools.partial(
                    global_sums,
                    specs=plan.specs,
                    manual=plan.grad_specs,
                    axes=layout.data_axes,
                    mesh=inputs.mesh,
                    kinds=update_kinds,
                )
                if update_kinds  # here, so that a skipped step reads no update
                else None
            ),
        )
        new_ms = inputs.model_state(new_ms) if inputs.with_state else None
        skipped = None
        if self.skip_nonfinite:
            skipped = jnp.logical_or(
                jnp.logical_not(jnp.isfinite(value)), jnp.isnan(grad_sums[0][NONFINITE])
            )
            new_params, opt_state, update_sums = update_unless(
                skipped, update, trained, state.opt_state, update_kinds
            )
            new_ms = keep_if(skipped, state.model_state, new_ms)
        else:
            new_params, opt_state, update_sums = update(trained, state.opt_state)
        new_model = eqx.combine(new_params, eqx.filter(state.model, mask, inverse=True))
        new_state = TrainState(
            new_model,
            opt_state,
            state.step + 1,
            state.key,
            model_state=new_ms,
            trainable=state.trainable,
        )
        if not self.step_info:
            return new_state, metrics
        param_sums = global_sums(
            new_params,
            plan.specs,
            plan.manual,
            layout.data_axes,
            inputs.mesh,
            (SQUARES,),
        )
        info = step_statistics(grad_sums[0], update_sums, param_sums, skipped)
        return new_state, (metrics, info)

    def _materialise(
        self,
        inputs: StepInputs,
        partitioned: frozenset[KeyPath],
        p: Any,
        combined: bool = False,
    ) -> Any:
        # Cast before the gather, so that FSDP's all-gathers (and the
        # reduce-scatters of their gradients) move the compute dtype; back to the
        # parameters' dtype after, so gradients add up in it.
        full = inputs.gather(
            cast_floating(p, self.compute_dtype),
            combined=combined,
            partitioned=partitioned,
        )
        return jax.tree.map(lambda f, x: f.astype(x.dtype), full, p)

    def _partitioned(
        self, inputs: StepInputs, shapes: Any, p: Any, ms: Any, local: Any, key: Any
    ) -> frozenset[KeyPath]:
        """Inside the step's `shard_map`: the FSDP `Linear` layers whose
        computation this step partitions instead of gathering their weights
        (`_partition.choose`, from a shape-only trace of the loss on one
        minibatch). Only trained weights: a frozen one has no gradient to save."""
        plan = inputs.plan
        if plan.fsdp_axis is None or not plan.linears:
            return frozenset()
        trained = {path for path, _ in jax.tree_util.tree_flatten_with_path(p)[0]}
        paths = [q for q in plan.linears if (*q, WEIGHT) in trained]
        n = self.num_minibatches
        loss = CheckedLoss(self.loss_fn, inputs.with_state, self.layout.data_axes)
        minibatch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype),
            local,
        )

        def call_loss(model: Any, ms: Any, minibatch: Any, key: Any) -> Any:
            model = cast_floating(model, self.compute_dtype)
            return loss(
                model, inputs.model_state(ms), inputs.local_batch(minibatch), key
            )

        return choose(
            self.fsdp_linears,
            paths,
            shapes,
            call_loss,
            (_shapes(ms), minibatch, _shapes(key)),
            devices=self.layout.mesh.shape[plan.fsdp_axis],
            calls_per_step=n,
            weight_moves=1 if self.fsdp_gather == "step" else n,
        )

    def _per_device(
        self,
        inputs: StepInputs,
        counts: Any,
        grad_kinds: tuple[str, ...],
        wants_value: bool,
        shapes: Any,
        p: Any,
        f: Any,
        ms: Any,
        local_batch: Any,
        key: Any,
    ) -> tuple[Any, ...]:
        axes = self.layout.data_axes
        frozen_full = inputs.gather(f)
        loss = CheckedLoss(self.loss_fn, inputs.with_state, self.layout.data_axes)
        partitioned = self._partitioned(inputs, shapes, p, ms, local_batch, key)

        def loss_of(full: Any, ms: Any, minibatch: Any, k: Any) -> Any:
            if k is not None:
                k = fold_rng_over_axis(k, axes)
            model = inputs.model(
                cast_floating(full, self.compute_dtype), frozen_full, partitioned
            )
            return loss(model, inputs.model_state(ms), minibatch, k)

        def run(loss_of: Callable[..., Any], diff: Any) -> Accumulated:
            local = inputs.local_batch(local_batch)
            n = self.num_minibatches
            return accumulate(loss_of, loss, diff, ms, local, key, n, self.use_scan)

        if self.fsdp_gather == "step":
            # Gather once, accumulate full-size gradients over the minibatches,
            # reduce-scatter once (the VJP of the gather), all of them together.
            materialise = functools.partial(
                self._materialise, inputs, partitioned, combined=True
            )
            full, pullback = jax.vjp(materialise, p)
            out = run(loss_of, full)
            (grads,) = pullback(out.grads)
        else:
            materialise = functools.partial(self._materialise, inputs, partitioned)
            out = run(lambda q, *rest: loss_of(materialise(q), *rest), p)
            grads = out.grads
        plan = inputs.plan
        grads = plan.sum_gradients(grads, axes)
        value, scale = _over_devices(out, axes, wants_value)
        new_ms = eqx.filter(out.model_state, is_array) if inputs.with_state else None
        outputs = (
            grads,
            value,
            scale,
            reduce_metrics(out.metrics, axes),
            sync_model_state(new_ms, axes),
        )
        if not grad_kinds:
            return outputs
        return (
            *outputs,
            _gradient_sums(grads, plan, counts, scale, self.layout, grad_kinds),
        )


def _shapes(tree: Any) -> Any:
    """`tree` with a `jax.ShapeDtypeStruct` at each array leaf, of the leaf's type
    (its sharding too: inside `shard_map` under a mesh context a value's type
    names the manual mesh, and Equinox's `State.set` compares types)."""

    def shape(x: Any) -> Any:
        if not is_array(x):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.typeof(x).sharding)

    return jax.tree.map(shape, tree)


def statistics_kinds(
    step_info: bool, skip_nonfinite: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The sums a step computes (`_statistics`): of its gradients, returned by
    its `shard_map` (the sum of squares for `step_info`'s norm, the finiteness
    sum for `skip_nonfinite`'s check), and of its update (the sum of squares,
    for `step_info`; what `apply_update` returns, so what `update_unless` starts
    from). Each is a pass over the tree, so only those read."""
    grads = ((SQUARES,) if step_info else ()) + ((NONFINITE,) if skip_nonfinite else ())
    return grads, (SQUARES,) if step_info else ()


def _gradient_sums(
    grads: Any,
    plan: ModelPlan,
    counts: Any,
    scale: Array | None,
    layout: Layout,
    kinds: tuple[str, ...],
) -> dict[str, Array]:
    """Inside the step's `shard_map`: the global sums `kinds` of the step's
    gradients from the sums `sum_gradients` returns, finished
    (`gradient_finishers`) on the slice each device reads."""
    axes = layout.data_axes
    local = local_sums(
        grads,
        plan.specs,
        plan.grad_specs,
        axes,
        layout.mesh,
        kinds,
        finish=gradient_finishers(counts, scale),
    )
    total: dict[str, Array] = jax.lax.psum(local, axes)
    return total


def _over_devices(
    out: Accumulated, axes: tuple[str, ...], wants_value: bool
) -> tuple[Any, Any]:
    """Inside `shard_map`: the step's loss over every device, and the factor
    that turns the gradient averaged over the devices into the step's gradient
    (`None`: the average is).

    A `(loss_sum, weight)` loss divides by the global weight, found (with the
    global loss sum) in one all-reduce of two scalars; a scalar loss needs one
    only when the loss itself is wanted (`value`)."""
    if out.weight is None:
        return jax.lax.pmean(out.loss, axes) if wants_value else None, None
    weight, loss_sum = jax.lax.psum(jnp.stack([out.weight, out.loss]), axes)
    devices = jax.lax.psum(1, axes)
    return divide_by_weight(loss_sum, weight), weight_scale(weight / devices)
