"""The first phase of a training step: the gradients of the loss, with the loss,
the metrics and the model state, as a `Gradients` value for the update phase
(`update`), in either view: the device view (`DeviceGradients`: `loss_fn` runs
once per device on that device's rows, inside `jax.shard_map` manual over the
data axes) or the global view (`GlobalGradients`: once on the whole global
batch, as on one device, XLA partitioning the computation).

Per device: the FSDP-sharded parameters are gathered (or their `Linear` layers
partitioned, `_layout.partitioned`), the loss is differentiated minibatch by
minibatch (`accumulate`), and the gradients leave the map as sums over the
devices where they are not averaged yet (`ModelPlan.sum_gradients`): the update
divides them, fused into the optimizer's pass."""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from .._data_parallel import fold_rng_over_axis
from .._layout.partitioned import KeyPath, choose
from .._layout.pipeline import WRITTEN_OUT, Seen, loss_reads_layers, stage_layers
from .._layout.plan import WEIGHT
from .._layout.step_questions import FsdpOptions
from .._metrics.tree import reduce_metrics
from .._utils import cast_floating, is_array
from .accumulate import (
    Accumulated,
    CheckedLoss,
    accumulate,
    divide_by_weight,
    weight_scale,
)
from .inputs import StepInputs, sync_model_state
from .one_f_one_b import OneFOneB
from .options import StepOptions
from .statistics import NONFINITE, SQUARES, global_sums, local_sums
from .update import gradient_finishers


class Gradients(NamedTuple):
    """What the gradient phase gives the update phase, on global arrays.

    - `sums`: each trained leaf's gradient, summed over the devices `counts`
      says (`ModelPlan.mean_counts`; 1 where it is averaged already).
    - `loss`: the step's loss over every device (`None` where nothing reads it).
    - `scale`: a weighted loss's `1 / global weight` (`None`: a mean loss).
    - `metrics`: the loss's metrics, reduced over the devices.
    - `model_state`: the model state's arrays as the loss returned them,
      averaged over the devices (`None` without one).
    - `statistics`: the global sums of the finished gradients that
      `statistics_kinds` asks for (`{}` for none).
    """

    sums: Any
    loss: Array | None
    scale: Array | None
    metrics: Any
    model_state: Any
    statistics: dict[str, Array]


def statistics_kinds(options: StepOptions) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The sums a step computes (`statistics`): of its gradients (the sum of
    squares for `step_info`'s norm, the finiteness sum for `skip_nonfinite`'s
    check), and of its update (the sum of squares, for `step_info`). Each is a
    pass over the tree, so only those read."""
    grads: tuple[str, ...] = (SQUARES,) if options.step_info else ()
    if options.skip_nonfinite:
        grads += (NONFINITE,)
    return grads, (SQUARES,) if options.step_info else ()


def unplaced_shapes(tree: Any) -> Any:
    """`tree` with a `jax.ShapeDtypeStruct` of no sharding at each array leaf: the
    model as the loss sees it inside the step's `shard_map`, whole and typed by
    the mesh there (a struct keeping its global placement would name the
    `Auto` mesh, which a gather at traced indices rejects in a manual one)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if is_array(x) else x, tree
    )


def shapes(tree: Any) -> Any:
    """`tree` with a `jax.ShapeDtypeStruct` at each array leaf, of the leaf's type
    (its sharding too: inside `shard_map` under a mesh context a value's type
    names the manual mesh, and Equinox's `State.set` compares types)."""

    def shape(x: Any) -> Any:
        if not is_array(x):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.typeof(x).sharding)

    return jax.tree.map(shape, tree)


@dataclasses.dataclass(frozen=True)
class DeviceGradients:
    """The gradient phase of one trace of a step in the device view: call
    `compute(key)` for the `Gradients`.

    - `loss`: the user's `loss_fn`, checked (`CheckedLoss`).
    - `inputs`: the split model, model state and batch.
    - `options`, `fsdp`: the step's and FSDP's options.
    - `counts`: the divisors of the gradient sums (`ModelPlan.mean_counts`).
    - `wants_loss`: whether the loss over every device is needed.
    - `model`: the model as shape structs, for the partitioned-linear choice.
    """

    loss: CheckedLoss
    inputs: StepInputs
    options: StepOptions
    fsdp: FsdpOptions
    counts: Any
    wants_loss: bool
    model: Any

    def compute(self, key: Any) -> Gradients:
        plan = self.inputs.plan
        # The `out_specs`: a `Gradients` of specs, replicated but for the sums.
        specs = Gradients._make([plan.grad_specs, P(), P(), P(), P(), P()])
        out: Gradients = self.inputs.shard_map(self._per_device, key, P(), specs)
        # A circular pipeline's layers went in in chunk order (`shard_map`).
        return out._replace(sums=plan.in_stage_order(out.sums, inverse=True))

    def _per_device(
        self, trained: Any, frozen: Any, state: Any, batch: Any, key: Any
    ) -> Gradients:
        inputs, axes = self.inputs, self.inputs.layout.reduce_axes
        batch = inputs.layout.device_batch(batch)
        full_frozen = inputs.plan.gathered(frozen)
        partitioned = self._partitioned(trained, state, batch, key)
        compute_dtype = self.options.compute_dtype
        stages = inputs.plan.stages
        # The global view under a written-out schedule: the loss is the whole
        # batch's, its key the one-device key and its metrics the whole's.
        whole = (
            stages is not None
            and stages.pipeline.schedule in WRITTEN_OUT
            and self.options.view == "global"
        )

        reads = self._reads_layers(trained, state, batch, key, full_frozen, partitioned)

        def loss_of(
            params: Any, state: Any, minibatch: Any, key: Any, seen: Any = None
        ) -> Any:
            if key is not None and not whole:
                key = fold_rng_over_axis(key, axes)
            params = cast_floating(params, compute_dtype)
            model = inputs.model(
                params, full_frozen, partitioned, marker=seen, reads_layers=reads
            )
            return self.loss(model, inputs.model_state(state), minibatch, key)

        def materialise(params: Any, combined: bool = False) -> Any:
            # Cast before the gather, so that FSDP's all-gathers (and the
            # reduce-scatters of their gradients) move the compute dtype; back to
            # the parameters' dtype after, so gradients add up in it.
            full = inputs.plan.gathered(
                cast_floating(params, compute_dtype),
                combined=combined,
                partitioned=partitioned,
            )
            return jax.tree.map(lambda f, x: f.astype(x.dtype), full, params)

        def run(loss: Any, params: Any) -> Accumulated:
            n, scan = self.options.num_minibatches, self.options.use_scan
            local = inputs.batch(batch)
            stages = inputs.plan.stages
            if stages is not None and stages.pipeline.schedule in WRITTEN_OUT:
                one_f_one_b = OneFOneB(
                    loss,
                    self._stage(full_frozen),
                    stages,
                    inputs.plan.specs,
                    self.loss,
                    # The global view's loss is the whole batch's.
                    inputs.layout.data_axes if self.options.view == "global" else None,
                )
                return one_f_one_b(params, inputs.model_state(state), local, key, n)
            return accumulate(loss, self.loss, params, state, local, key, n, scan)

        # The loss between two fences (`Layout.fence`): every collective before
        # it (gathers, the context's balancing) and after it (the sums below)
        # in one order on every device.
        fence = inputs.layout.fence
        if self.fsdp.gather == "step":
            # Gather once, accumulate full-size gradients over the minibatches,
            # reduce-scatter once (the VJP of the gather), all of them together.
            full, pullback = jax.vjp(lambda p: materialise(p, combined=True), trained)
            full, batch, full_frozen = fence((full, batch, full_frozen))
            out = run(loss_of, full)
            (grads,) = pullback(out.grads)
        else:
            batch, full_frozen = fence((batch, full_frozen))
            out = run(lambda p, *rest: loss_of(materialise(p), *rest), trained)
            grads = out.grads
        grads, out = fence((grads, out))
        sums = inputs.plan.sum_gradients(grads, axes)
        loss, scale = _over_devices(out, axes, self.wants_loss)
        metrics = out.metrics if whole else reduce_metrics(out.metrics, axes)
        new_state = eqx.filter(out.model_state, is_array) if inputs.with_state else None
        new_state = sync_model_state(new_state, axes)
        return Gradients(
            sums, loss, scale, metrics, new_state, self._statistics(sums, scale)
        )

    def _reads_layers(
        self,
        trained: Any,
        state: Any,
        batch: Any,
        key: Any,
        frozen: Any,
        partitioned: frozenset[KeyPath],
    ) -> bool:
        """Inside the step's `shard_map`, in the device view under GPipe or the
        circular schedule: whether the loss reads the pipelined stack's layers
        outside the stack (then it gets every stage's: `_layout.all_layers`),
        from a shape-only trace with the stack marked (`layer_reads`). The
        written-out schedules refuse such a loss (`one_f_one_b`)."""
        inputs, stages = self.inputs, self.inputs.plan.stages
        if (
            stages is None
            or self.options.view == "global"
            or stages.pipeline.schedule in WRITTEN_OUT
        ):
            return False

        def marked(params: Any) -> Any:
            model = inputs.model(params, frozen, partitioned, marker=Seen())
            return self.loss(model, inputs.model_state(state), inputs.batch(batch), key)

        full = jax.eval_shape(
            lambda p: inputs.plan.gathered(p, partitioned=partitioned), trained
        )
        return loss_reads_layers(marked, full, inputs.plan.specs, stages.axis)

    def _stage(self, frozen: Any) -> Callable[..., Any]:
        """Inside the step's `shard_map`: `layers(params, key, key_rows,
        per_row, chunk, micro)`, this stage's layers (its `chunk` of them, with
        repeats) of the pipelined `Stacked` for microbatch `micro`, as a loop
        (`_layout.pipeline.engine.StageLayers`: the schedules whose backward is written
        out run its layers' passes apart; `params`: the trained leaves). A
        stack key not per row is the microbatch's (`engine.microbatch_key`; in
        the global view numbered over the batch's data shards)."""
        inputs = self.inputs
        stages = inputs.plan.stages
        assert stages is not None
        remat = self.options.remat
        data = inputs.layout.data_axes if self.options.view == "global" else ()

        def layers(
            params: Any,
            key: Any,
            key_rows: bool,
            per_row: bool,
            chunk: Any,
            micro: Any,
        ) -> Any:
            params = cast_floating(params, self.options.compute_dtype)
            model = inputs.model(params, frozen, pipelined=False)
            return stage_layers(
                stages.where(model),
                stages,
                key,
                key_rows=key_rows,
                per_row=per_row,
                remat=remat,
                chunk=chunk,
                micro=micro,
                data=data,
            )

        return layers

    def _partitioned(
        self, trained: Any, state: Any, batch: Any, key: Any
    ) -> frozenset[KeyPath]:
        """Inside the step's `shard_map`: the FSDP `Linear` layers whose
        computation this step partitions instead of gathering their weights
        (`_layout.partitioned.choose`, from a shape-only trace of the loss on one
        minibatch). Only trained weights: a frozen one has no gradient to save."""
        inputs, plan = self.inputs, self.inputs.plan
        if plan.fsdp_axis is None or not plan.linears:
            return frozenset()
        leaves = {path for path, _ in jax.tree_util.tree_flatten_with_path(trained)[0]}
        paths = [q for q in plan.linears if (*q, WEIGHT) in leaves]
        n = self.options.num_minibatches
        minibatch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype),
            batch,
        )

        def call_loss(model: Any, state: Any, minibatch: Any, key: Any) -> Any:
            model = cast_floating(model, self.options.compute_dtype)
            return self.loss(
                model, inputs.model_state(state), inputs.batch(minibatch), key
            )

        return choose(
            self.fsdp.linears,
            paths,
            self.model,
            call_loss,
            (shapes(state), minibatch, shapes(key)),
            devices=inputs.layout.mesh.shape[plan.fsdp_axis],
            calls_per_step=n,
            weight_moves=1 if self.fsdp.gather == "step" else n,
        )

    def _statistics(self, sums: Any, scale: Array | None) -> dict[str, Array]:
        """Inside the step's `shard_map`: the global sums (`statistics_kinds`) of
        the step's gradients, finished (`gradient_finishers`) on the slice each
        device reads."""
        kinds, _ = statistics_kinds(self.options)
        if not kinds:
            return {}
        inputs, plan = self.inputs, self.inputs.plan
        axes = inputs.layout.manual_axes
        local = local_sums(
            sums,
            plan.specs,
            plan.grad_specs,
            axes,
            inputs.layout.mesh,
            kinds,
            finish=gradient_finishers(self.counts, scale),
        )
        total: dict[str, Array] = jax.lax.psum(local, axes)
        return total


def _over_devices(
    out: Accumulated, axes: tuple[str, ...], wants_loss: bool
) -> tuple[Any, Any]:
    """Inside `shard_map`: the step's loss over every device, and the factor that
    turns the gradient averaged over the devices into the step's gradient
    (`None`: the average is).

    A `(loss_sum, weight)` loss divides by the global weight, found (with the
    global loss sum) in one all-reduce of two scalars; a scalar loss needs one
    only when the loss itself is wanted."""
    if out.weight is None:
        return jax.lax.pmean(out.loss, axes) if wants_loss else None, None
    weight, loss_sum = jax.lax.psum(jnp.stack([out.weight, out.loss]), axes)
    devices = jax.lax.psum(1, axes)
    return divide_by_weight(loss_sum, weight), weight_scale(weight / devices)


@dataclasses.dataclass(frozen=True)
class GlobalGradients:
    """The gradient phase of one trace of a step in the global view: `loss_fn`
    runs once on the whole global batch (each minibatch of it), exactly as on
    one device, on the parameters as the layout places them; XLA partitions the
    computation. Call `compute(trained, frozen, state, batch, key)`.

    Minibatch `m` holds the `m`-th block of every device's rows, in device
    order: the rows the device view's minibatch `m` holds, so every device
    computes on every minibatch and no row moves between devices.

    - `loss`: the user's `loss_fn`, checked, with no mesh axis bound.
    - `inputs`: the split model, model state and batch (for their static parts).
    - `options`: the step's options.
    """

    loss: CheckedLoss
    inputs: StepInputs
    options: StepOptions

    def compute(self, key: Any) -> Gradients:
        inputs, options = self.inputs, self.options
        n = options.num_minibatches
        frozen = inputs.frozen

        def loss_of(params: Any, state: Any, minibatch: Any, key: Any) -> Any:
            params = cast_floating(params, options.compute_dtype)
            model = inputs.model(params, frozen, view="global")
            return self.loss(model, inputs.model_state(state), minibatch, key)

        batch = inputs.batch(inputs.batch_arrays)
        out = accumulate(
            loss_of,
            self.loss,
            inputs.trained,
            inputs.state_arrays,
            self._minibatches(batch, n),
            key,
            n,
            options.use_scan,
            take=self._minibatch,
            whole_key=True,  # the loss gets `fold_in(state.key, state.step)`
        )
        loss, scale = out.loss, None
        if out.weight is not None:
            loss, scale = (
                divide_by_weight(out.loss, out.weight),
                weight_scale(out.weight),
            )
        new_state = eqx.filter(out.model_state, is_array) if inputs.with_state else None
        return Gradients(
            out.grads,
            loss,
            scale,
            out.metrics,
            new_state,
            self._statistics(out.grads, scale),
        )

    def _sharded(self, x: Any, spec: P) -> Any:
        sharding = jax.sharding.NamedSharding(self.inputs.mesh, spec)
        return jax.lax.with_sharding_constraint(x, sharding)

    def _minibatches(self, batch: Any, n: int) -> Any:
        """`batch` with every leaf of rank >= 1 as `(n, rows / n, ...)`, row `j` of
        minibatch `m` the `j % b`-th row of device `j // b`'s `m`-th block (`b`
        its rows per minibatch), kept on the device that holds it."""
        if n == 1:
            return batch
        layout = self.inputs.layout
        devices = layout.num_shards

        def stack(x: Any) -> Any:
            if not is_array(x) or jnp.ndim(x) == 0:
                return x
            rows, rest = x.shape[0], x.shape[1:]
            blocks = x.reshape(devices, n, rows // (devices * n), *rest)
            stacked = jnp.swapaxes(blocks, 0, 1).reshape(n, rows // n, *rest)
            return self._sharded(stacked, P(None, *layout.leaf_spec(x.ndim)))

        return jax.tree.map(stack, batch)

    def _minibatch(self, x: Any, i: Any, n: int) -> Any:
        if n == 1:
            return x
        row = jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
        return self._sharded(row, self.inputs.layout.leaf_spec(row.ndim))

    def _statistics(self, grads: Any, scale: Array | None) -> dict[str, Array]:
        """The global sums (`statistics_kinds`) of the step's gradients."""
        kinds, _ = statistics_kinds(self.options)
        if not kinds:
            return {}
        plan = self.inputs.plan
        finished = jax.tree.map(
            lambda g: g if scale is None else (g * scale).astype(g.dtype), grads
        )
        return global_sums(
            finished,
            plan.specs,
            plan.manual,
            self.inputs.layout.manual_axes,
            self.inputs.mesh,
            kinds,
        )
