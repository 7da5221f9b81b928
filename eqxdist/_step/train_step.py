"""The train step: `make_train_step` puts a layout (`_layout`), the step math
(`train_math.TrainMath`) and the compiled-step cache (`compiled`) together into a
`TrainStep`."""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from jax.sharding import Mesh
from jaxtyping import PyTree

from .._data_parallel import place
from .._hlo import compiled_cost
from .._jaxpr import matmul_flops
from .._layout.layout import Layout, check_layout, resolve_layout
from .._layout.state_specs import describe_state
from .._metrics.tree import without_counts
from .._utils import (
    batch_rows,
    check_array_leaves,
    check_not_consumed,
    checked_first,
    state_like,
    typecheck,
)
from .accumulate import check_loss_fn
from .compiled import CompiledStep, Placement
from .options import EXECUTION_DEFAULTS, ExecutionOptions, StepOptions
from .output import StepOutput
from .sharded_init import ShardedInit, peak_bytes, sharded_init
from .state import TrainState, as_optimizer, check_train_state
from .train_math import TrainMath


class TrainStep:
    """The callable `make_train_step` returns: `step(state, batch) -> (state,
    metrics)` (a `StepOutput`). See `make_train_step`."""

    def __init__(
        self,
        math: TrainMath,
        optimizers: dict[str | None, optax.GradientTransformation],
        *,
        donate: bool,
        max_steps_in_flight: int | None,
    ) -> None:
        self.math = math
        self.layout = math.layout
        self.optimizer = math.optimizer
        # Every part's optimizer (under `None` without parts): laying out a state
        # lays out all of its parts.
        self.optimizers = optimizers
        self.part = math.part
        self.mesh = math.layout.mesh
        self._cache = CompiledStep(
            math,
            self.mesh,
            describe=self._placement,
            batch_sharding=self.layout.batch_sharding,
            leaf_sharding=self.layout.leaf_sharding,
            donate=donate,
            max_in_flight=max_steps_in_flight,
            check_batch=self._check_batch,
            # A model's part steps alternate on one state with donation intact.
            family=None if self.part is None else frozenset(optimizers),
            name="train step",
        )

    def _placement(self, state: TrainState) -> Placement:
        """Where a state of this structure lives and how its step compiles; the
        key (each step's randomness is `fold_in(key, step)`), the frozen
        parameters and the other parts (their parameters and optimizer states)
        are only read."""
        layout = self.layout
        part = self.part
        check_parts(state, self.optimizers)
        kept = state_like(
            state,
            jax.tree.map(lambda t: not t, state.trainable_mask(part)),
            opt_state=(
                jax.tree.map(lambda _: False, state.opt_state)
                if part is None
                else {
                    name: jax.tree.map(lambda _, keep=name != part: keep, opt)
                    for name, opt in state.opt_state.items()
                }
            ),
            step=False,
            key=jax.tree.map(lambda _: True, state.key),
            model_state=jax.tree.map(lambda _: False, state.model_state),
        )
        return Placement(
            self.state_specs(state),
            kept,
            layout.compute_mesh(state.model_state is not None),
            layout.compiler_options(state.model, self.math.options.compute_dtype),
        )

    def _check_batch(self, batch: Any) -> None:
        check_array_leaves(batch, "train step", "batch")
        if batch_rows(batch, "train step") == 0:
            raise ValueError(
                "train step: the batch has 0 rows; a step needs at least one row per "
                "device (the loss of an empty batch is 0/0). Skip empty batches."
            )
        self.layout.check_rows(batch, self.math.options.num_minibatches)

    def model_specs(self, model: Any) -> Any:
        """The `PartitionSpec` of every array leaf of `model` under this step's
        layout (`None` at other leaves)."""
        return self.layout.model_specs(model)

    def state_specs(self, state: TrainState) -> Any:
        """The `PartitionSpec` of every array leaf of `state` under this step's
        layout, as a pytree of `state`'s structure: `P()` everywhere for `"dp"`
        without rules; the rule axes of `param_rules`; for `"fsdp"` the
        `fsdp_specs` rule over `fsdp_axis` (or an `FSDP` wrapper's own layout);
        optimizer-state leaves as their parameters; the model state, step and key
        replicated. Useful for checkpoint restore targets and custom placements.

        **Raises:**

        `TypeError` if `state` is not a `TrainState`; `ValueError` if its optimizer
        state was not made by this step's optimizer, or a rule does not fit.
        """
        check_train_state(state, "train step")
        check_parts(state, self.optimizers)
        for part, optimizer in self.optimizers.items():
            made = jax.eval_shape(optimizer.init, state.params(part))
            held = state.opt_state if part is None else state.opt_state[part]
            expected: Any = jax.tree.structure(made)
            if expected != jax.tree.structure(held):
                which = "" if part is None else f"[{part!r}]"
                raise ValueError(
                    f"train step: `state.opt_state{which}` is not what this step's "
                    f"optimizer makes: `optimizer.init` gives {describe_state(made)}, "
                    f"the state holds {describe_state(held)}. Create the state with "
                    "the same optimizer you pass to make_train_step."
                )
        optimizers = self.optimizers.get(None, self.optimizers)
        return self.layout.state_specs(state, optimizers)

    def place_state(self, state: TrainState) -> TrainState:
        """A copy of `state` placed on the mesh as this step keeps it (a copy, so
        that the step's donation never deletes arrays the caller still holds, such
        as those of the model the state was created from)."""
        check_not_consumed(state, "place_state")
        placed: TrainState = place(state, self.state_specs(state), self.mesh, copy=True)
        return placed

    def lower(self, state: TrainState, batch: PyTree[Any]) -> Any:
        """`jax.jit(...).lower` of the step for these arguments (placed first), e.g.
        for `.compile().memory_analysis()` or `.as_text()`. `state` may be abstract
        (`eqx.filter_eval_shape(TrainState.create, ...)`), to inspect the step of a
        model too large to allocate here."""
        check_train_state(state, "train step")
        return self._cache.lower(state, batch)

    def cost(self, state: TrainState, batch: PyTree[Any]) -> dict[str, float]:
        """The cost of one step for these arguments, all devices together.
        `state` may be abstract, as for `lower`.

        - `"flops"` and XLA's other entries: XLA's cost analysis of the compiled
          step, totalled over the mesh's devices. It counts a loop's body once (a
          `lax.scan` over `num_minibatches`, or a `Stacked` model's layers) and, on
          a GPU, leaves out what XLA hands to libraries such as cuBLAS.
        - `"model_flops"`: the FLOPs of every matrix product and convolution of the
          step as JAX traced it, each loop's body counted as often as it runs
          (`while_loop`s once), the same on every backend: what `ed.mfu` wants,
          and what `ed.train_loop` uses."""
        check_train_state(state, "train step")
        traced = self._cache.trace(state, batch)
        cost = compiled_cost(traced.lower(), self.mesh.size)
        cost["model_flops"] = float(matmul_flops(traced.jaxpr))
        return cost

    def _init(self, caller: str, init_fn: Callable[..., Any], args: Any) -> ShardedInit:
        return sharded_init(caller, init_fn, args, self.state_specs, self.mesh)

    def init_state(self, init_fn: Callable[..., Any], *args: Any) -> TrainState:
        """A fresh state built straight into this step's layout: `init_fn(*args)`
        (e.g. `lambda key: ed.TrainState.create(Net(key), optimizer, key)`) runs
        under `jax.jit` with the step's state shardings as its output shardings,
        so no device ever holds more than its share of the parameters and the
        optimizer state. Use it for a model too large for one device.

        The state is built in a few groups of consecutive leaves, each of at most
        an eighth of a device's share, one compiled program per group, so that
        the initialisers' working arrays (random bits being drawn) are those of
        one group: `init_peak_bytes` tells what a device holds at most.

        The result equals `step.place_state(init_fn(*args))` leaf for leaf
        (bit-identical for initialisers whose values do not change under `jit`,
        such as Equinox's defaults) and is placed as `place_state` places it.
        With `jax.config.jax_threefry_partitionable` off (it is on by default),
        XLA cannot split random number generation over the devices, and builds
        each random array whole before sharding it.

        **Raises:**

        `TypeError` if `init_fn(*args)` does not return a `TrainState`; the
        errors of `state_specs` for a state this step cannot take.
        """
        state: TrainState = self._init("init_state", init_fn, args)()
        return state

    def lower_init(self, init_fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`jax.jit(...).lower` of each program `init_state(init_fn, *args)` runs,
        in order, e.g. for `.compile().memory_analysis()` or `.as_text()`."""
        return self._init("lower_init", init_fn, args).lower()

    def init_peak_bytes(self, init_fn: Callable[..., Any], *args: Any) -> int:
        """The most bytes a device holds while `init_state(init_fn, *args)` runs,
        from XLA's memory analysis of its compiled programs (the groups already
        built, and one group's outputs and temporaries); nothing is allocated."""
        return peak_bytes(self._init("init_peak_bytes", init_fn, args).lower())

    def __call__(self, state: TrainState, batch: PyTree[Any]) -> StepOutput:
        """One training step; see `make_train_step`."""
        check_train_state(state, "train step")
        new_state, (metrics, info) = self._cache(state, batch)
        return StepOutput(new_state, without_counts(metrics, "train step"), info)


@typecheck
def check_parts(state: TrainState, optimizers: dict[Any, Any]) -> None:
    """A `ValueError` when a step of parts meets a state without them, or parts
    other than its own."""
    names = set(optimizers) - {None}
    held = {name for name, _ in state.parts or ()}
    if names != held:
        raise ValueError(
            f"train step: the step has the parts {sorted(names)} (its optimizers), "
            f"the state {sorted(held)}; create the state with "
            "`TrainState.create(model, optimizers, key, parts=...)` of the same "
            "parts, and the step with `make_train_step(..., optimizers, part=...)`."
        )


@checked_first(loss_fn=check_loss_fn, layout=check_layout)
def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: Any,
    layout: Layout | Mesh | None = None,
    *,
    num_minibatches: int = 1,
    compute_dtype: Any = None,
    view: str = "device",
    part: str | None = None,
    step_info: bool = False,
    skip_nonfinite: bool = False,
    remat: Any = None,
    unroll: Any = None,  # True, False or None, checked to say so plainly
    **settings: Any,
) -> TrainStep:
    """Build a compiled, sharded training step `step(state, batch) -> (state,
    metrics)`.

    Each call computes the gradients of `loss_fn` on the batch (in
    `num_minibatches` blocks), averages them over the data axes, applies
    `optimizer` to the trainable parameters and returns the new state and the
    step's metrics summed over every device and minibatch. Where every array
    lives is `layout`'s (`ed.Layout`: DP, FSDP, ZeRO-1, tensor rules, a pipeline,
    a context axis).

    `loss_fn(model, minibatch, key) -> (loss, metrics)` is written as for one
    device; with a `state.model_state` it is `loss_fn(model, model_state,
    minibatch, key) -> (loss, metrics, new_model_state)` (minibatches in order,
    each seeing the state the previous returned; floating-point leaves averaged
    over the data axes after the step, others from the first device). Its `key`
    is `fold_in(state.key, state.step)`, split per minibatch and, in the device
    view, folded over the data axes (`fold_rng_over_axis`). The loss may be a
    pair `(loss_sum, weight)`: the step then minimises `sum(loss_sum) /
    sum(weight)` over every minibatch and device (the token-weighted mean of the
    whole batch, one more all-reduce of two scalars; a weight of 0 gives a zero
    gradient).

    The step compiles on the first call (again only for a new structure or
    shape), donates the state it returned last (any other state is copied once
    on entry; a consumed state is a `ValueError`) and places unplaced states and
    batches as the layout says.

    **Arguments:**

    - `loss_fn`: see above.
    - `optimizer`: an Optax transformation (the state's), or anything with
      Optax's `init`/`update` (`optax.MultiSteps`); it sees the sharded global
      arrays, so whole-tree transformations see every parameter. An `update`
      that reads `value` (`optax.contrib.reduce_on_plateau`) gets the step's loss.
      With `part`, the dict of one optimizer per part.
    - `layout`: an `ed.Layout`; or, as in v0.4, a mesh with the layout's keywords
      (`strategy`, `data_axis`, `param_rules`, `min_weight_size`, `fsdp_axis`,
      `fsdp_layout`, `fsdp_gather`, `fsdp_linears`, `pipeline`, `context_axis`)
      beside it, which build the same `Layout` (the same program).
    - `num_minibatches`: gradient accumulation steps per call.
    - `compute_dtype`: e.g. `jnp.bfloat16`: trainable floating-point parameters
      cast to it before the loss (under FSDP before the gather); gradients,
      parameters and optimizer state keep their dtype. `None`: no cast.
    - `view`: `"device"`: `loss_fn` runs once per device on its rows inside
      `jax.shard_map`, the mesh axes bound. `"global"`: once on the whole batch,
      as on one device (in-batch negatives mean what they mean there); no axis
      bound, one key for the whole batch, metrics already global.
    - `part`: with a state of parts (`TrainState.create(..., parts=...)`), the
      part this step trains; the others, and their optimizer states, come back
      as the same arrays, so the parts' steps alternate on one state.
    - `step_info`: the statistics of the returned `StepOutput`'s `.info`:
      `"grad_norm"`, `"update_norm"`, `"param_norm"` (global L2 norms, as
      `optax.global_norm` on one device) and `"skipped"`.
    - `skip_nonfinite`: a step whose loss or gradient is not finite on any device
      leaves the parameters, optimizer state and model state as they were (the
      step counter still advances).
    - `remat`: what the backward pass keeps of every `ed.Stacked`'s blocks
      (`"none"`, `"full"`, `"dots"`, `"offload"` or a `jax.checkpoint` policy);
      `None`: each its own.
    - `unroll`: every `ed.Stacked` as a Python loop (`True`: no `while` loop in
      the program, faster on GPUs) or a scan (`False`); `None`: each as built.
    - `donate`, `use_scan`, `max_steps_in_flight` (keywords, rarely changed):
      reuse the buffers of the state the step returned last (`True`); the
      minibatches as one `lax.scan` (`True`; see `accumulate_gradients`); at
      most this many steps queued before the step waits for the oldest (`8`;
      XLA's CPU collectives deadlock when too many are; `None`: unbounded).

    **Returns:**

    A `TrainStep`: `step(state, batch)` gives a `StepOutput` `(state, metrics)`
    (`.info` the `step_info` statistics), metrics reduced over the devices:
    `(sum, count)` pairs summed, `Metric`s `reduce`d, a 0-d plain array summed
    with a `UserWarning`, a per-row array a `ValueError`. It has `layout`,
    `state_specs(state)`, `place_state(state)`, `init_state(init_fn, *args)`,
    `lower(state, batch)` and `cost(state, batch)`.

    **Raises:**

    The `ed.Layout` errors for its keywords, and a `ValueError` for a `Layout`
    given with layout keywords; `ValueError` for an unknown `view`,
    `num_minibatches < 1`, a `part` not among the optimizers'; `TypeError` for
    an unknown keyword, a dict of optimizers without `part` or `part` with one
    optimizer. When called: `ValueError` for rows not divisible by the data
    devices x `num_minibatches`, a non-scalar loss, a consumed state, an
    optimizer state made by another optimizer, a state whose parts are not the
    step's; `TypeError` for a state that is not a `TrainState`.

    !!! Example

        ```python
        layout = ed.Layout(mesh, strategy="fsdp")
        step = ed.make_train_step(loss_fn, optax.adamw(1e-3), layout,
                                  num_minibatches=4, compute_dtype=jnp.bfloat16)
        state = step.init_state(lambda k: ed.TrainState.create(Net(k), opt, k), key)
        for batch in batches:
            state, metrics = step(state, batch)
        ```
    """
    caller = "make_train_step"
    chosen, execution = _settings(caller, layout, settings)
    options = StepOptions.parse(
        caller,
        view=view,
        num_minibatches=num_minibatches,
        use_scan=execution.use_scan,
        compute_dtype=compute_dtype,
        step_info=step_info,
        skip_nonfinite=skip_nonfinite,
        remat=remat,
        unroll=unroll,
    )
    chosen = chosen.for_view(options.view)
    chosen.check_training(caller)
    optimizers = _optimizers(optimizer, part, caller)
    math = TrainMath(loss_fn, optimizers[part], chosen, options, part=part)
    return TrainStep(
        math,
        optimizers,
        donate=execution.donate,
        max_steps_in_flight=execution.max_steps_in_flight,
    )


def _settings(
    caller: str, layout: Any, settings: dict[str, Any]
) -> tuple[Layout, ExecutionOptions]:
    """`make_train_step`'s keywords beyond its named ones: the layout's (with a
    mesh) and the execution settings, each checked."""
    execution = {k: settings.pop(k) for k in EXECUTION_DEFAULTS if k in settings}
    chosen = resolve_layout(caller, layout, settings)
    return chosen, ExecutionOptions.parse(caller, {**EXECUTION_DEFAULTS, **execution})


def _optimizers(
    optimizer: Any, part: str | None, caller: str
) -> dict[str | None, optax.GradientTransformation]:
    """`make_train_step`'s optimizer (under `None`), or its dict of one per part
    with `part` among them."""
    if part is None:
        if isinstance(optimizer, Mapping):
            raise TypeError(
                f"{caller}: `optimizer` is a dict of parts ({list(optimizer)}) but "
                "no `part` is given; name the part this step trains, e.g. "
                f"part={next(iter(optimizer), 'name')!r}."
            )
        return {None: as_optimizer(optimizer, caller)}
    if not isinstance(optimizer, Mapping):
        raise TypeError(
            f"{caller}: `part`={part!r} is given with a single optimizer; pass the "
            "dict of every part's optimizer that the state was created with "
            "(`TrainState.create(model, optimizers, key, parts=...)`)."
        )
    if part not in optimizer:
        raise ValueError(
            f"{caller}: `part`={part!r} is not one of the optimizers' parts "
            f"{list(optimizer)}."
        )
    return {name: as_optimizer(opt, caller) for name, opt in optimizer.items()}
