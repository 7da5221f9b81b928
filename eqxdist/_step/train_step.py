"""The train step: `make_train_step` puts a layout (`_layout`), the step math
(`train_math.TrainMath`) and the compiled-step cache (`compiled`) together into a
`TrainStep`."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import PyTree

from .._data_parallel import place
from .._hlo import compiled_cost
from .._jaxpr import matmul_flops
from .._layout.layout import Layout, describe_state
from .._layout.options import LayoutOptions, check_schedule_context
from .._layout.pipeline import Pipeline, with_data_axis
from .._layout.remat import UNSET
from .._metrics.tree import without_counts
from .._utils import (
    AxisName,
    batch_rows,
    check_array_leaves,
    check_mesh,
    check_not_consumed,
    checked_first,
    state_like,
    typecheck,
)
from .accumulate import check_loss_fn
from .compiled import CompiledStep, Placement
from .options import StepOptions
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
            sequence_sharding=self.layout.sequence_sharding,
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
        return self.layout.plan(model).specs

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


@checked_first(loss_fn=check_loss_fn, mesh=check_mesh)
def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: Any,
    mesh: Mesh,
    *,
    strategy: str = "dp",
    data_axis: AxisName = "data",
    num_minibatches: int = 1,
    min_weight_size: int = 2**18,
    donate: bool = True,
    compute_dtype: Any = None,
    fsdp_axis: str | None = None,
    param_rules: Sequence[tuple[str, P]] = (),
    fsdp_layout: str | None = None,
    fsdp_gather: str | None = None,
    use_scan: bool = True,
    max_steps_in_flight: int | None = 8,
    step_info: bool = False,
    skip_nonfinite: bool = False,
    fsdp_linears: str | None = None,
    view: str = "device",
    part: str | None = None,
    pipeline: Pipeline | None = None,
    remat: Any = None,
    context_axis: str | None = None,
    unroll: Any = None,  # True, False or None, checked to say so plainly
) -> TrainStep:
    """Build a compiled, sharded training step `step(state, batch) -> (state,
    metrics)`.

    Each call computes the gradients of `loss_fn` on every device's rows of
    `batch` (in `num_minibatches` blocks, `accumulate_gradients`), averages them
    across the devices of the data axes, applies `optimizer` to the trainable
    parameters and returns the new state and the step's metrics summed over every
    device and minibatch.

    - `strategy="dp"` (data parallel): the state is replicated on every device
      (except for the axes of `param_rules`); gradients are averaged with `pmean`.
    - `strategy="fsdp"`: parameters larger than `min_weight_size` (and the matching
      optimizer state) are sharded over `fsdp_axis` (`fsdp_specs`); they are
      all-gathered for the forward pass and their gradients reduce-scattered
      (`gather_params`), so `loss_fn` still sees the full model and the update
      equals data parallel's. `FSDP` submodules keep their own layout and gather
      themselves, one block at a time. Data axes other than `fsdp_axis` hold
      replicas (HSDP).
    - `strategy="zero1"` (ZeRO-1): parameters as under `"dp"`, but the optimizer
      state of parameters larger than `min_weight_size` is sharded over
      `fsdp_axis` by the FSDP rule, so each device holds and updates its share
      of it; the updated parameters are all-gathered back to every device.

    `loss_fn(model, minibatch, key) -> (loss, metrics)` is written as for a single
    device, for a minibatch of this device's rows. When `state.model_state` is not
    `None` it is `loss_fn(model, model_state, minibatch, key) -> (loss, metrics,
    new_model_state)`: minibatches run in order, each seeing the model state the
    previous one returned; after the step, floating-point leaves of the model
    state are averaged over the data axes (a no-op for statistics the model
    already synchronises, e.g. `eqx.nn.BatchNorm(..., axis_name=("batch",
    "data"))`), other leaves come from the first device. Its `key` differs on
    every step, minibatch and device: the step's key is `fold_in(state.key,
    state.step)`, split into one key per minibatch and folded over the data axes
    (`fold_rng_over_axis`), so dropout masks differ between devices and a run
    restarted from a checkpoint draws the same numbers.

    The step is compiled on the first call (and again only for a new structure or
    shape). The state the step returned last is donated (its buffers are reused
    for the new state); any other state, placed or not, is copied once on entry, so
    arrays the caller still holds stay valid, and a state an earlier step consumed
    is a `ValueError`. Unplaced (host or single-device) states and batches are
    placed as the layout needs, and the returned state is placed that way. At most
    `max_steps_in_flight` steps are queued before the step waits for the oldest,
    so a loop that never blocks cannot deadlock XLA's CPU collectives.

    **Arguments:**

    - `loss_fn`: see above.
    - `optimizer`: an Optax gradient transformation (the one the state was created
      with), or any object with Optax's `init`/`update` (e.g. `optax.MultiSteps`).
      It runs on the sharded global arrays, so even whole-tree transformations
      (e.g. global-norm clipping) see every parameter. When its `update` takes
      Optax's extra arguments and reads `value` (e.g.
      `optax.contrib.reduce_on_plateau`), it gets the step's loss as `value`
      (the mean over every device and minibatch); no other extra argument is
      passed.
    - `mesh`: the device mesh, its axes `Auto`, `Explicit` (`jax.make_mesh`'s
      default) or a mix: the state is placed on it and comes back on it, typed
      as it types arrays; the step computes with every axis `Auto` (the same
      program on either kind). Calling the step inside `jax.set_mesh(mesh)` is
      fine.
    - `strategy`: `"dp"`, `"fsdp"` or `"zero1"`.
    - `data_axis`: the mesh axis, or tuple of axes, the batch is split over (rows
      in mesh order); gradients and metrics are reduced over all of them.
    - `num_minibatches`: gradient accumulation steps per call.
    - `min_weight_size`: for `"fsdp"` (`"zero1"`), leaves (optimizer-state
      leaves) this small or smaller (full size) are not sharded over `fsdp_axis`;
      a model none of whose leaves is sharded gets a `UserWarning` saying so.
    - `donate`: reuse the buffers of the state the step returned last.
    - `compute_dtype`: e.g. `jnp.bfloat16`: trainable floating-point parameters
      are cast to it before `loss_fn` sees them (under FSDP before the all-gather,
      so gathers and gradient reduce-scatters move the smaller dtype); gradients
      come back in the parameters' dtype, and parameters and optimizer state keep
      theirs (float32 master weights). `None`: no cast.
    - `fsdp_axis`: under `"fsdp"`, the data axis parameters are sharded over
      (under `"zero1"`, the optimizer state); `None`: the last of the data axes.
    - `param_rules`: tensor parallelism: `(pattern, PartitionSpec)` pairs; a
      parameter whose path inside the model (`jax.tree_util.keystr`, e.g.
      `".layers[0].weight"`) `re.search`-matches `pattern` (first match wins) is
      sharded as the spec says over non-data mesh axes, and XLA partitions the
      computation over them; `loss_fn` still sees full-size arrays. Under
      `"fsdp"` the FSDP rule then shards one of the dimensions the spec leaves
      free over `fsdp_axis`.
    The FSDP options below apply to `"fsdp"` (`fsdp_axis` and `fsdp_layout` to
    `"zero1"` too); `None` means the default, and giving one under a strategy
    it does not apply to is a `ValueError`, never silently ignored.

    - `fsdp_layout`: which dimension the FSDP rule shards: `"leading"` (the
      default: the first divisible dimension, so each shard is one contiguous
      block and gathers need no transposing copies; docs/benchmarks.md compares
      the two) or `"largest"` (`fsdp_specs`' default rule). Both shard the same
      leaves, so memory is the same.
    - `fsdp_gather`: with `num_minibatches > 1` under `"fsdp"`: `"step"` (the
      default) gathers every parameter once per step and reduce-scatters its
      gradient once per step, holding the full parameters and one full-size
      gradient buffer for the whole step; `"minibatch"` gathers and
      reduce-scatters once per minibatch, holding only shards between
      minibatches (less memory, `num_minibatches` times the communication).
    - `fsdp_linears`: how `"fsdp"` runs an `eqx.nn.Linear` whose weight it shards
      on the output features (the `"leading"` layout's choice for `(out, in)`
      weights, unless `param_rules` name the weight or an `FSDP`/`Stacked`
      module holds it): `"gather"` all-gathers the weight and reduce-scatters
      its gradient (about `2 in out` elements received per device and step);
      `"partition"` keeps the weight sharded and moves the layer's activations:
      every device's input rows are all-gathered, each device computes its
      block of output features for the whole batch and an all-to-all returns
      every device its rows (about `2 rows (in + out / devices)` elements, for
      `rows` global rows through the layer per step), and the weight's gradient
      is computed where its block lives. `"auto"` (the default) chooses per
      layer whichever moves fewer elements, from the rows each layer sees in a
      shape-only trace of `loss_fn`: partitioning wins while the batch is small
      against the layer (a deep MLP), gathering for a language model's many
      tokens. The result is the same either way, up to rounding. A layer called
      under `lax.cond` or `lax.while_loop` is always gathered (devices may take
      different branches), as is one whose weight the loss replaces
      (`eqx.tree_at`, as `eqx.nn.SpectralNorm` and `WeightNorm` do: a partitioned
      layer holds a shard, not a weight to replace); one called on anything but
      a vector (outside `jax.vmap`) gathers its weight for that call. Reading a
      partitioned layer's `weight` (weight tying) all-gathers it.
    - `use_scan`: see `accumulate_gradients`.
    - `max_steps_in_flight`: the bound on queued steps (`None`: unbounded).
    - `step_info`: compute the step statistics, the returned `StepOutput`'s
      `.info`: a dict of replicated 0-d float32 arrays: `"grad_norm"` (the
      global L2 norm of the averaged gradient of the trained leaves, as
      `optax.global_norm` of the same gradient on one device), `"update_norm"`
      (of the update applied: 0 for a skipped step), `"param_norm"` (of the
      trained parameters after the step) and `"skipped"` (1.0 for a skipped
      step, else 0.0).
    - `skip_nonfinite`: a step whose loss or any gradient element is NaN or
      infinite on any device leaves the parameters, optimizer state and model
      state exactly as they were (decided identically on every device); the
      step counter still advances. Without it, non-finite values propagate as in
      plain Optax.
    - `view`: where `loss_fn` runs. `"device"` (the default): as described above,
      once per device on that device's rows inside `jax.shard_map`, the mesh axes
      bound (collectives and `axis_name`s allowed). `"global"`: once on the whole
      global batch, exactly as on one device: a loss over the whole batch
      (in-batch negatives, noise of the batch's shape, one key split over the
      rows) means what it means there; no mesh axis is bound (a collective or an
      `axis_name` naming a mesh axis is a `ValueError`; an `eqx.nn.BatchNorm`
      whose `axis_name` names only the loss's own `vmap` axis takes the whole
      batch's statistics), the key is `fold_in(state.key, state.step)` (split per
      minibatch), the same on every device, and the metrics it returns are
      already global (an `ed.Metric` needs no sync). Parameters and optimizer
      state are laid out by the same options and XLA partitions the computation.
      Every other option means what it means in the device view.
    - `part`: with a state of parts (`TrainState.create(model, optimizers, key,
      parts={name: where, ...})`), `optimizer` is that dict of one optimizer per
      part and `part` the name of the one this step trains: the step
      differentiates `loss_fn` with respect to that part's trainable leaves only,
      updates them with that part's optimizer and optimizer state, and returns
      every other part and its optimizer state as the same arrays, untouched (the
      model state as the loss returns it). The steps of a model's parts take and
      return the same `TrainState`, so they alternate with donation intact
      (`state, m = step_d(state, batch); state, m = step_g(state, batch)`).
    - `pipeline`: an `ed.Pipeline`: the model's `ed.Stacked` split over the
      pipeline's stage axis, microbatches flowing through the stages
      (docs/guides/pipeline.md); composes with every strategy over the data
      axes, `param_rules` over the others, and either view. The loss calls
      the `Stacked` on its rows under `jax.vmap`, or on a batch (blocks that
      take `(rows, ...)`): the input's leading axis is then the rows.
    - `remat`: what the backward pass keeps of every `ed.Stacked`'s blocks,
      overriding their own `remat`: `"none"`, `"full"`, `"dots"`, `"offload"` or
      a `jax.checkpoint` policy (`ed.Stacked`).
    - `unroll`: every `ed.Stacked`'s blocks as a Python loop (`True`: no `while`
      loop in the program, faster on GPUs) or a `jax.lax.scan` (`False`);
      `None` leaves each as built (`ed.Stacked(..., unroll=...)`).
    - `context_axis`: a mesh axis (not a data axis) the sequences are split
      over: every batch leaf of rank >= 2 is sharded over it along dimension 1
      as well as over the data axes along dimension 0 (its length a multiple of
      2 x the axis's size); parameters are replicated over it. In the device
      view a device's block is in the balanced order `ed.attention` computes on
      (`ed.to_context_order`; positions from `ed.context_positions`), the axis is
      bound, and the loss, gradients and metrics add up over it as over the data
      axes. In the global view the loss sees whole sequences in their order
      (positions `jnp.arange`); `ed.attention(..., context_axis=...)` shards
      itself. Not with `schedule="1f1b"` (a `ValueError`): use GPipe or the
      circular schedule. docs/guides/long_context.md.

    **Weighted losses.** `loss_fn` may return, in place of the scalar loss, a
    pair `(loss_sum, weight)` of scalars: e.g. the summed loss of a minibatch's
    real tokens and their number `mask.sum()`. The step then minimises
    `sum(loss_sum) / sum(weight)` over every minibatch of every device, so the
    gradient is the single-device gradient of the token-weighted mean over the
    whole global batch, however unevenly the real tokens fall (one more
    all-reduce, of two scalars). A global weight of 0 gives a zero gradient. A
    scalar loss keeps its meaning: every minibatch and device weighs the same.

    **Returns:**

    A `TrainStep`: call it as `step(state, batch) -> (state, metrics)` (a
    `StepOutput`, the pair whatever the options, its `.info` the statistics of
    `step_info`); build a state straight into its layout with
    `step.init_state(init_fn, *args)`. The metrics come back reduced across
    devices: `(sum, count)` parts summed, `Metric`s `reduce`d, a 0-d plain array
    summed with a `UserWarning`, a per-row one a `ValueError`. It also has
    `state_specs(state)`, `place_state(state)` and `lower(state, batch)`.

    **Raises:**

    `ValueError` for an unknown `strategy`, `view`, `fsdp_gather` or
    `fsdp_linears`, a `part` not among the optimizers', an FSDP option given
    under a strategy it does not apply to, `num_minibatches < 1`, a negative
    `min_weight_size`, a `data_axis` or `fsdp_axis` not in `mesh`, a rule
    naming an unknown or data axis; when
    called, `ValueError` for a batch leaf whose leading dimension is not
    divisible by (devices along the data axes) x `num_minibatches`, a non-scalar
    loss, a consumed state, an optimizer state made by another optimizer, a rule
    that matches nothing or does not divide its dimension, and `TypeError` if
    `state` is not a `TrainState` or `loss_fn` returns something else than
    documented; `TypeError` for a dict of optimizers without `part` or `part`
    with a single optimizer; when called, `ValueError` for a state whose parts
    are not the step's.

    !!! Example

        ```python
        step = ed.make_train_step(loss_fn, optax.adamw(1e-3), mesh,
                                  strategy="fsdp", num_minibatches=4,
                                  compute_dtype=jnp.bfloat16)
        state = ed.TrainState.create(model, optax.adamw(1e-3), jax.random.key(0))
        for batch in batches:
            state, metrics = step(state, batch)
        ed.print_metrics(metrics, "Last step")
        ```
    """
    caller = "make_train_step"
    mesh = with_data_axis(
        mesh, data_axis, pipeline is not None or context_axis is not None
    )
    layout = LayoutOptions.parse(
        caller,
        mesh,
        strategy=strategy,
        data_axis=data_axis,
        param_rules=param_rules,
        min_weight_size=min_weight_size,
        fsdp_axis=fsdp_axis,
        fsdp_layout=fsdp_layout,
        fsdp_gather=fsdp_gather,
        fsdp_linears=fsdp_linears,
        pipeline=pipeline,
        remat=UNSET if remat is None else remat,
        context_axis=context_axis,
        unroll=unroll,
    )
    check_schedule_context(caller, pipeline, context_axis)
    options = StepOptions.parse(
        caller,
        view=view,
        num_minibatches=num_minibatches,
        use_scan=use_scan,
        compute_dtype=compute_dtype,
        step_info=step_info,
        skip_nonfinite=skip_nonfinite,
    )
    if max_steps_in_flight is not None and max_steps_in_flight < 1:
        raise ValueError(
            f"{caller}: `max_steps_in_flight` must be >= 1 or None; got "
            f"{max_steps_in_flight}."
        )
    optimizers = _optimizers(optimizer, part, caller)
    math = TrainMath(
        loss_fn,
        optimizers[part],
        Layout(mesh, layout, caller=caller),
        options,
        part=part,
    )
    return TrainStep(
        math, optimizers, donate=donate, max_steps_in_flight=max_steps_in_flight
    )


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
