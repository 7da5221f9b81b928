"""The evaluation step: metrics of a model (or a `TrainState`) on a batch of any
number of rows, padded and masked inside, reduced across devices like a training
step's."""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from .._data_parallel import local_shard_count
from .._layout.layout import Layout, check_layout, resolve_layout
from .._layout.pipeline import Seen, loss_reads_layers
from .._mesh import retyped
from .._metrics.tree import (
    check_metrics,
    is_metric,
    is_per_row,
    per_row_error,
    reduce_metrics,
)
from .._utils import (
    batch_rows,
    call_with_axes,
    cast_floating,
    check_array_leaves,
    check_callable_takes,
    check_compute_dtype,
    check_function,
    checked_first,
    flatten_up_to,
    is_array,
    path_str,
    typecheck,
)
from .compiled import CompiledStep, Placement
from .gradients import shapes
from .inputs import StepInputs
from .options import check_view
from .state import TrainState, trainable_mask_tree


class EvalInput(eqx.Module):
    """What an evaluation reads of a state: the model, its model state and which
    leaves are trained (cast to `compute_dtype` as in training)."""

    model: Any
    model_state: Any
    trainable: tuple[bool, ...] | None = eqx.field(static=True)

    def cast_mask(self) -> Any:
        return trainable_mask_tree(self.model, self.trainable)


class EvalMath(eqx.Module):
    """What one evaluation computes: `eval_fn` on every device's rows inside
    `jax.shard_map` (manual over the data axes), with the FSDP-sharded
    parameters gathered first, and its metrics reduced over the data axes
    (the device view); or `eval_fn` once on the whole padded batch (the global
    view). Returns `(metrics, rows, mask)`: `rows` what a `per_row` `eval_fn`
    returns per row (`None` without `per_row`), `mask` the batch's."""

    eval_fn: Callable[..., Any] = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)
    view: str = eqx.field(static=True, default="device")
    per_row: bool = eqx.field(static=True, default=False)

    def __call__(self, inputs: EvalInput, batch: Any) -> tuple[EvalInput, Any]:
        """Traced with `layout.compute_mesh(...)` as the context mesh."""
        layout = self.layout
        inputs, (batch, mask) = retyped((inputs, batch), layout.mesh)
        split = StepInputs.split(
            layout, inputs.model, inputs.cast_mask(), inputs.model_state, batch
        )
        if split.with_state:
            arguments: tuple[str, ...] = ("model", "model_state", "batch", "mask")
            why = " (the state has a model_state)"
        else:
            arguments, why = ("model", "batch", "mask"), ""
        check_callable_takes(self.eval_fn, arguments, "eval_fn", why)
        # The global view runs on the global arrays, placed as they are (XLA
        # gathers what it needs); the device view gathers FSDP's shards itself.
        axes = () if self.view == "global" else layout.reduce_axes
        gather = split.plan.gathered if axes else _unchanged

        def evaluate(
            trained: Any, frozen: Any, state: Any, batch: Any, mask: Any
        ) -> Any:
            trained = gather(cast_floating(trained, self.compute_dtype))
            frozen = gather(frozen)
            if axes:
                batch = layout.device_batch(batch)
                # Collectives before and after `eval_fn` in one order on every
                # device (`Layout.fence`).
                trained, frozen, batch = layout.fence((trained, frozen, batch))
            batch = split.batch(batch)

            def call(trained: Any, marker: Any = None, reads: bool = False) -> Any:
                model = split.model(
                    trained, frozen, view=self.view, marker=marker, reads_layers=reads
                )
                args: tuple[Any, ...] = (model, batch, mask)
                if split.with_state:
                    args = (model, split.model_state(state), batch, mask)
                return call_with_axes(self.eval_fn, args, "eval_fn", axes)

            stages = split.plan.stages
            # An `eval_fn` that reads the pipelined stack's layers itself gets
            # every stage's in the device view (`_layout/pipeline/layer_reads`).
            reads = (
                bool(axes)
                and stages is not None
                and loss_reads_layers(
                    lambda t: call(t, marker=Seen()),
                    shapes(trained),
                    split.plan.specs,
                    stages.axis,
                )
            )
            out = call(trained, reads=reads)
            metrics, rows = self._outputs(out, mask.shape[0])
            if not axes:
                return metrics, rows
            return reduce_metrics(layout.fence(metrics), axes), rows

        if self.view == "global":
            metrics, rows = evaluate(
                split.trained,
                split.frozen,
                split.state_arrays,
                split.batch_arrays,
                mask,
            )
        else:
            metrics, rows = split.shard_map(
                evaluate, mask, layout.batch_spec, (P(), layout.batch_spec)
            )
        return inputs, (metrics, rows, mask if self.per_row else None)

    def _outputs(self, out: Any, rows: int) -> tuple[Any, Any]:
        """`eval_fn`'s `(metrics, rows)` (`rows` `None` without `per_row`),
        checked: metrics a step can add up, and no array of `rows` rows among
        them (it would be summed over the devices)."""
        if self.per_row:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    "eval_fn must return `(metrics, rows)` with per_row=True (`rows` "
                    "a pytree of arrays with one entry per row it was given); got "
                    f"{type(out).__name__}"
                    + (f" of length {len(out)}." if isinstance(out, tuple) else ".")
                )
            metrics, per_row = out
            _check_per_row(per_row, rows)
        else:
            metrics, per_row = out, None
            _check_no_rows(metrics, rows)
        check_metrics(metrics, "eval_fn")
        return metrics, per_row


def _unchanged(tree: Any) -> Any:
    return tree


def _check_per_row(tree: Any, rows: int) -> None:
    """`ValueError` unless every leaf of `tree` is an array with `rows` rows."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not (is_array(leaf) and jnp.ndim(leaf) and jnp.shape(leaf)[0] == rows):
            raise ValueError(
                f"eval_fn: per-row output {path_str(path)} is "
                f"{getattr(leaf, 'shape', type(leaf).__name__)}; with per_row=True "
                f"each leaf of `rows` is an array with one entry per row eval_fn "
                f"was given ({rows}), e.g. the predictions `jnp.argmax(logits, -1)`."
            )


def _check_no_rows(metrics: Any, rows: int) -> None:
    """`ValueError` for an array among the metrics with one entry per row: the
    device view adds metrics up over the devices, which would sum different
    rows, and in either view it would hold the padding rows."""
    leaves = jax.tree_util.tree_flatten_with_path(metrics, is_leaf=is_metric)[0]
    for path, leaf in leaves:
        if is_array(leaf) and is_per_row(jnp.shape(leaf), rows):
            raise per_row_error(
                "eval_fn",
                path_str(path),
                jnp.shape(leaf),
                rows,
                "they include the padding rows, and metrics are added up over the "
                "devices",
            )


check_eval_fn = check_function("eval_fn(model, batch, mask) -> metrics")


def padded_rows(rows: int, shards: int) -> int:
    """`rows` rounded up to a multiple of `shards`, with rows per shard rounded up
    to one of about eight sizes per power of two (at most 12.5% padding), so that
    a stream of batches of different sizes compiles a handful of steps, not one
    per size."""
    per_shard = max(1, math.ceil(rows / shards))
    quantum = 1 << max(0, (per_shard - 1).bit_length() - 3)
    return math.ceil(per_shard / quantum) * quantum * shards


def _pad(x: Any, target: int) -> Any:
    extra = target - x.shape[0]
    if extra == 0:
        return x
    if isinstance(x, np.ndarray | np.generic):
        zeros = np.zeros((extra, *x.shape[1:]), x.dtype)
        return np.concatenate([x, zeros])
    return jnp.concatenate([x, jnp.zeros((extra, *x.shape[1:]), x.dtype)])


class EvalStep:
    """The callable `make_eval_step` returns: `eval_step(state_or_model, batch) ->
    metrics`. See `make_eval_step`."""

    def __init__(self, math_: EvalMath) -> None:
        self.math = math_
        self.layout = math_.layout
        self._cache = CompiledStep(
            math_,
            self.layout.mesh,
            describe=self._placement,
            batch_sharding=self.layout.batch_sharding,
            leaf_sharding=self.layout.leaf_sharding,
            donate=False,
            max_in_flight=8,
            name="eval step",
        )

    def _placement(self, inputs: EvalInput) -> Placement:
        """Where the model and its model state live (everything is only read),
        and how the evaluation compiles."""
        layout = self.layout
        return Placement(
            self._specs(inputs),
            jax.tree.map(lambda _: True, inputs),
            layout.compute_mesh(inputs.model_state is not None),
            layout.compiler_options(inputs.model, self.math.compute_dtype),
        )

    def _specs(self, inputs: EvalInput) -> Any:
        model = self.layout.model_specs(inputs.model)
        model_state = jax.tree.map(
            lambda x: P() if is_array(x) else None, inputs.model_state
        )
        leaves = [
            *flatten_up_to(inputs.model, model),
            *flatten_up_to(inputs.model_state, model_state),
        ]
        return jax.tree.unflatten(jax.tree.structure(inputs), leaves)

    def _rows(self, batch: Any) -> int:
        check_array_leaves(batch, "eval step", "batch")
        rows = batch_rows(batch, "eval step")
        if rows is None:
            raise ValueError(
                "eval step: the batch has no array with rows (rank >= 1); pass the "
                "examples to evaluate as arrays with a leading batch dimension."
            )
        return rows

    def _inputs(self, state_or_model: Any) -> EvalInput:
        if isinstance(state_or_model, TrainState):
            s = state_or_model
            return EvalInput(s.model, s.model_state, s.trainable)
        return EvalInput(state_or_model, None, None)

    def padded(self, batch: Any) -> tuple[Any, Any]:
        """`batch` padded along axis 0 as the step pads it, and its mask."""
        rows = self._rows(batch)
        self.layout.check_batch(batch, "eval step")
        sharding = self.layout.batch_sharding
        shards = self.layout.num_shards
        if not sharding.is_fully_addressable:
            shards = local_shard_count(sharding, shards)
        target = padded_rows(rows, shards)
        # Each device's rows split as the parts need (a pipeline's microbatches).
        multiple = shards * self.layout.row_multiple()
        target = math.ceil(target / multiple) * multiple
        padded = jax.tree.map(
            lambda x: _pad(x, target) if is_array(x) and np.ndim(x) else x, batch
        )
        return padded, np.arange(target) < rows

    def lower(self, state_or_model: Any, batch: Any) -> Any:
        """`jax.jit(...).lower` of the evaluation for these arguments."""
        return self._cache.lower(self._inputs(state_or_model), self.padded(batch))

    def __call__(self, state_or_model: Any, batch: Any) -> Any:
        """Evaluate; see `make_eval_step`."""
        _, (metrics, rows, mask) = self._cache(
            self._inputs(state_or_model), self.padded(batch)
        )
        if not self.math.per_row:
            return metrics
        # Replicated (the step returns what it computes on every device): every
        # process reads all rows, and keeps those the mask says are real.
        real = np.asarray(mask)
        return metrics, jax.tree.map(lambda x: np.asarray(x)[real], rows)


@checked_first(eval_fn=check_eval_fn, layout=check_layout)
@typecheck
def make_eval_step(
    eval_fn: Callable[..., Any],
    layout: Layout | Mesh | None = None,
    *,
    compute_dtype: Any = None,
    view: str = "device",
    per_row: bool = False,
    **layout_keywords: Any,
) -> EvalStep:
    """Build a compiled, sharded evaluation step `eval_step(state_or_model, batch)
    -> metrics` for batches of any number of rows.

    Each call pads every batch leaf along axis 0 to a multiple of the devices on
    the data axes (rounded up further to one of a few sizes, so that batches of
    many sizes compile only a few steps), runs `eval_fn` on every device's rows
    with a `mask` that is `False` on the padding, and returns the metrics reduced
    across devices as the training step's are. When `eval_fn` honours `mask`
    (e.g. `ed.metrics.Accuracy().update(logits, labels, mask)`,
    `ed.metrics.Mean().update(losses, mask)`), the result equals `eval_fn` on the whole
    unpadded batch on one device. No gradients, no donation.

    **Arguments:**

    - `eval_fn`: `eval_fn(model, batch, mask) -> metrics`, or
      `eval_fn(model, model_state, batch, mask)` when called with a `TrainState`
      whose `model_state` is not `None`. `mask` is a bool vector over the rows
      `eval_fn` sees. Metrics as a training step's: `Metric`s, arrays, numbers,
      `(sum, count)` tuples (sum them with the mask).
    - `layout`: an `ed.Layout`, the training step's (so that its state needs no
      copy); or, as in v0.4, a mesh with the layout's keywords beside it.
      `"zero1"` lays out the model as `"dp"` (an evaluation has no optimizer
      state); FSDP's `fsdp_gather` and `fsdp_linears` are the training step's
      (an evaluation gathers every sharded leaf). With a context axis in the
      device view, metrics add up over it too, and `per_row` needs the global
      view.
    - `compute_dtype`: the dtype trained parameters are cast to, as in training.
    - `view`: `"device"` (the default): `eval_fn` runs once per device on that
      device's rows, the mesh axes bound. `"global"`: once on the whole padded
      batch (and its mask), as on one device, no mesh axis bound; its outputs
      are global (see `make_train_step`'s `view`).
    - `per_row`: `eval_fn` returns `(metrics, rows)`, `rows` a pytree of arrays
      whose leading dimension is the rows it was given (predictions, per-example
      losses); the step returns `(metrics, rows)` with `rows` as NumPy arrays
      holding one entry per row of the batch, in its order, the padding dropped.
      Without it, a metrics array with one entry per row is a `ValueError` (the
      device view adds metrics up over the devices, which would sum different
      rows), never a silent sum.

    **Returns:**

    An `EvalStep`: call it as `eval_step(state_or_model, batch)` with a
    `TrainState` or a bare model; it returns the metrics, or with `per_row`
    `(metrics, rows)`. In a multi-process run each process passes its own rows,
    the same number on every process, and every process gets the metrics and
    the rows of all processes' batches (process 0's rows first).

    **Raises:**

    The `ed.Layout` errors for its keywords, a `ValueError` for a `Layout` given
    with layout keywords, a `TypeError` for an unknown keyword; when called, for
    batch leaves with different numbers of rows, a batch without rows, or a state
    consumed by a training step; `TypeError` for metrics that are not arrays,
    numbers or `Metric`s.

    !!! Example

        ```python
        def eval_fn(model, batch, mask):
            logits = jax.vmap(model)(batch["x"])
            return {"accuracy": ed.metrics.Accuracy().update(logits, batch["y"], mask)}

        eval_step = ed.make_eval_step(eval_fn, layout)  # the train step's
        metrics = eval_step(state, {"x": x_test, "y": y_test})  # any number of rows
        ```
    """
    caller = "make_eval_step"
    chosen = resolve_layout(caller, layout, layout_keywords)
    context = chosen.context_axis
    if per_row and context is not None and view == "device":
        raise ValueError(
            f"{caller}: per_row=True with context_axis={context!r} in the "
            "device view: a device sees a share of each row's sequence, so its "
            "per-row outputs are not the rows'. Use view='global' (eval_fn sees "
            "whole sequences; ed.attention shards itself)."
        )
    check_view(view, caller)
    dtype = check_compute_dtype(compute_dtype, caller)
    chosen = chosen.for_view(view)
    return EvalStep(EvalMath(eval_fn, chosen, dtype, view=view, per_row=per_row))
