"""What one training step computes (`TrainMath`), in two phases with named
values between them: the gradients (`gradients.DeviceGradients` gives
`gradients.Gradients`) and the update (`update.Update`), then the step
statistics.

Where the step's arrays live is the layout's business (`_layout`), why the step
does not recompile is the compiled-step cache's (`compiled`), and
`train_step.make_train_step` puts the three together."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array

from .._layout.layout import Layout
from .._mesh import retyped
from .._metrics.tree import check_summed
from .accumulate import CheckedLoss
from .gradients import (
    DeviceGradients,
    GlobalGradients,
    Gradients,
    statistics_kinds,
    unplaced_shapes,
)
from .inputs import StepInputs
from .options import StepOptions
from .state import TrainState
from .statistics import NONFINITE, SQUARES, TreeSums, global_sums
from .update import Update, keep_if, reads_value, step_statistics, update_unless


class TrainMath(eqx.Module):
    """What one training step computes on global arrays: `math(state, batch) ->
    (state, (metrics, info))`, `info` the step statistics (`None` without
    `step_info`). Traced with `layout.compute_mesh(...)` as the context mesh."""

    loss_fn: Any = eqx.field(static=True)
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    options: StepOptions = eqx.field(static=True)
    part: str | None = eqx.field(static=True, default=None)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        layout, options = self.layout, self.options
        state, batch = retyped((state, batch), layout.mesh)
        layout.check_rows(batch, options.num_minibatches, traced=True)
        # A part's step trains its leaves with its optimizer and state; the other
        # parts are frozen for it, their optimizer states kept as they are.
        mask = state.trainable_mask(self.part)
        opt_state = state.opt_state if self.part is None else state.opt_state[self.part]
        inputs = StepInputs.split(
            layout,
            state.model,
            mask,
            state.model_state,
            batch,
            stack=(options.remat, options.unroll),
        )
        trained = eqx.filter(state.model, mask)
        wants_value = reads_value(self.optimizer, trained, opt_state)
        plan = inputs.plan
        grads, counts = self._gradients(state, inputs, wants_value)
        # The `Summed` counts leave the step (static) for `TrainStep`'s warning.
        check_summed(grads.metrics, "loss_fn")
        _, update_kinds = statistics_kinds(options)
        update = Update(
            self.optimizer,
            grads.sums,
            counts,
            grads.scale,
            {"value": grads.loss} if wants_value else {},
            # Built here, so that a skipped step reads no update.
            TreeSums(
                plan.specs,
                plan.grad_specs,
                layout.manual_axes,
                inputs.mesh,
                update_kinds,
            )
            if update_kinds
            else None,
        )
        new_model_state = (
            inputs.model_state(grads.model_state) if inputs.with_state else None
        )
        skipped = None
        if options.skip_nonfinite:
            skipped = _nonfinite(grads)
            new_params, opt_state, update_sums = update_unless(
                skipped, update, trained, opt_state, update_kinds
            )
            new_model_state = keep_if(skipped, state.model_state, new_model_state)
        else:
            new_params, opt_state, update_sums = update(trained, opt_state)
        if self.part is not None:
            opt_state = {**state.opt_state, self.part: opt_state}
        new_model = eqx.combine(new_params, eqx.filter(state.model, mask, inverse=True))
        new_state = TrainState(
            new_model,
            opt_state,
            state.step + 1,
            state.key,
            model_state=new_model_state,
            trainable=state.trainable,
            parts=state.parts,
        )
        if not options.step_info:
            return new_state, (grads.metrics, None)
        where = (plan.specs, plan.manual, layout.manual_axes, inputs.mesh)
        param_sums = global_sums(new_params, *where, (SQUARES,))
        info = step_statistics(grads.statistics, update_sums, param_sums, skipped)
        return new_state, (grads.metrics, info)

    def _gradients(
        self, state: TrainState, inputs: StepInputs, wants_value: bool
    ) -> tuple[Gradients, Any]:
        """The gradient phase in the step's view, and the divisors of its sums
        (`ModelPlan.mean_counts`)."""
        layout, options = self.layout, self.options
        key = jax.random.fold_in(state.key, state.step)
        whole = _global_gradients(layout, options)
        # No mesh axis is bound where a global view's loss runs (`CheckedLoss`
        # says so); its metrics' arrays are counted (`check_summed` below).
        axes = () if whole else layout.reduce_axes
        loss = CheckedLoss(self.loss_fn, inputs.with_state, axes, counted=True)
        # The device view's gradients leave the map as sums; the update divides
        # them (see `ModelPlan.sum_gradients`).
        counts = inputs.plan.mean_counts(layout.mesh, axes)
        if whole:
            return GlobalGradients(loss, inputs, options).compute(key), counts
        grads = DeviceGradients(
            loss,
            inputs,
            options,
            layout.fsdp_options,
            counts,
            wants_loss=wants_value or options.skip_nonfinite,
            model=unplaced_shapes(state.model),
        ).compute(key)
        return grads, counts


def _global_gradients(layout: Layout, options: StepOptions) -> bool:
    """Whether the loss runs once on the global batch (`GlobalGradients`).
    Not under 1F1B, which runs the loss once per microbatch on each device's
    rows whichever the view: each microbatch's loss is its share of the rows'
    (`hoist`: the device's in the device view, the whole batch's in the
    global view), which the sums over the microbatches and devices add up."""
    return options.view == "global" and not layout.loss_per_microbatch


def _nonfinite(grads: Gradients) -> Array:
    """Whether the step's loss or any gradient element is NaN or infinite (the
    same on every device: both are global). The step asked for the loss
    (`wants_loss`)."""
    assert grads.loss is not None
    return jnp.logical_or(
        jnp.logical_not(jnp.isfinite(grads.loss)),
        jnp.isnan(grads.statistics[NONFINITE]),
    )
