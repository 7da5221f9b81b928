"""`ed.Layout`: every decision about where a step's arrays live, made and checked
once, as one value the train step, the evaluation step and the loader share.

A layout is its mesh and its parts (`parts/`): data (always), FSDP or ZeRO-1,
tensor rules, a pipeline, a context axis, one module each. `Layout` asks the
parts every question (`parts.base.Part`) and composes their answers: how a
batch is split, where a model's leaves live (the model plan, `plan.plan_model`,
once per structure), where the optimizer state and the rest of a `TrainState`
live, the mesh a step computes on and its compiler options. It computes
nothing of the step itself."""

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._data_parallel import local_shard_count
from .._mesh import compute_mesh
from .._utils import check_mesh, check_rows, is_array, plural
from .flags import CPU_FSDP_OPTIONS, in_one_order
from .options import LAYOUT_DEFAULTS, parse_parts
from .parts.base import Part
from .parts.data import DataPart
from .parts.fsdp import (
    GLOBAL_VIEW_LAYOUT,
    FsdpOptions as FsdpOptions,  # the step reads it here
)
from .pipeline import with_data_axis
from .plan import ModelPlan, plan_model, structure_key
from .rules import ParamRules, has_fsdp_modules
from .state_specs import StateSpecs
from .step_questions import StepQuestions


class Layout(StepQuestions):
    """Where every array of a step lives: the batch, the model, the optimizer
    state. Build it once and pass it to `make_train_step`, `make_eval_step` and
    `BatchLoader` in place of a mesh.

    **Arguments:**

    - `mesh`: the device mesh, its axes `Auto`, `Explicit` (`jax.make_mesh`'s
      default) or a mix. With a `pipeline` or `context_axis` and a `data_axis`
      the mesh lacks, the rows are not split: `layout.mesh` is `mesh` with a
      trailing data axis of size 1.
    - `strategy`: over the data axes, `"dp"` (the state replicated, gradients
      averaged), `"fsdp"` (parameters larger than `min_weight_size`, and their
      optimizer state, sharded over `fsdp_axis`; gathered for the loss, their
      gradients reduce-scattered; data axes other than `fsdp_axis` hold replicas:
      HSDP) or `"zero1"` (parameters as under `"dp"`, their optimizer state
      sharded; each device updates its share, the new parameters gathered back).
    - `data_axis`: the mesh axis, or tuple of axes, the batch's rows are split
      over (in mesh order); the loss, gradients and metrics add up over them.
    - `param_rules`: tensor parallelism: `(pattern, PartitionSpec)` pairs; a
      parameter whose path (`jax.tree_util.keystr`, e.g. `".layers[0].weight"`)
      `re.search`-matches `pattern` (first match wins) is sharded as the spec
      says over non-data axes, and XLA partitions the computation over them; the
      loss still sees full-size arrays. Under `"fsdp"` the FSDP rule then shards
      one of the dimensions the spec leaves free.
    - `min_weight_size`: under `"fsdp"` (`"zero1"`), leaves (optimizer-state
      leaves) of at most this many elements stay replicated; a model none of
      whose leaves is sharded gets a `UserWarning` saying so.
    - `fsdp_axis`: under `"fsdp"`/`"zero1"`, the data axis leaves are sharded
      over; `None`: the last data axis.
    - `fsdp_layout`: under `"fsdp"`/`"zero1"`, the dimension the FSDP rule
      shards: `"leading"` (the first divisible one, so a shard is one contiguous
      block and the device view's gathers need no transposing copies),
      `"largest"` (`fsdp_specs`' rule: the largest divisible one, ties to the
      later) or `"outputs"` (under `"fsdp"`: each `eqx.nn.Linear` weight, stored
      `(out, in)`, on its leading dimension, every other leaf on its largest, so
      a square `x @ W` weight on its columns: a weight split on its output
      features). All three shard the same leaves. Not given (`None`):
      `"leading"`, except that a step of `view="global"` under `"fsdp"` takes
      `"outputs"`, which lets XLA's partitioner split each product instead of
      gathering the weight: on a deep MLP of plain `x @ W` layers `"leading"`
      is 1.1-1.3x Equinox's own GSPMD step and `"outputs"` 1.0x, and on one of
      `eqx.nn.Linear` layers `"largest"` is 10x `"leading"`
      (docs/guides/fsdp.md). That step's `step.layout` is then this layout with
      `fsdp_layout="outputs"` (`for_view`); a step sharing its state takes it.
    - `fsdp_gather`: under `"fsdp"` with `num_minibatches > 1`: `"step"` (the
      default: gather every parameter and reduce-scatter its gradient once per
      step) or `"minibatch"` (once per minibatch: only shards held between
      minibatches, `num_minibatches` times the communication).
    - `fsdp_linears`: under `"fsdp"`, how an `eqx.nn.Linear` whose weight is
      sharded on its output features runs: `"gather"` (all-gather the weight,
      reduce-scatter its gradient), `"partition"` (keep the weight sharded: the
      rows are all-gathered, each device computes its block of output features
      and an all-to-all returns every device its rows; the gradient is computed
      where its block lives) or `"auto"` (the default: per layer, whichever moves
      fewer elements, from a shape-only trace of the loss). A layer under
      `lax.cond`/`while_loop`, one whose weight the loss replaces (`eqx.tree_at`,
      `SpectralNorm`), or one called outside `jax.vmap` is gathered.
    - `pipeline`: an `ed.Pipeline`: the model's `ed.Stacked` split over the
      pipeline's stage axis, the device's rows cut into microbatches flowing
      through the stages (docs/guides/pipeline.md).
    - `context_axis`: a mesh axis (not a data axis) the sequences are split over:
      every batch leaf of rank >= 2 is sharded over it along dimension 1 (its
      length a multiple of 2 x the axis's size) as well as over the data axes
      along dimension 0; parameters are replicated over it. A device-view loss
      sees its block in the balanced order `ed.attention` computes on
      (`ed.to_context_order`, positions `ed.context_positions`) and adds up over
      the axis too; a global-view loss sees whole sequences
      (docs/guides/long_context.md).
    - `expert_axis`: a mesh axis every `ed.MoE`'s expert weights (`w_in`,
      `w_gate`, `w_out`) are split over on their expert dimension (`num_experts`
      a multiple of its size; the router replicated): each device holds and
      computes with its experts, the tokens travel to them and back (an
      all-gather and a reduce-scatter of the tokens per call), no expert weight
      is gathered. A data axis (the usual case: experts spread over the data
      devices) or an axis of its own (docs/guides/experts.md).

    Every keyword means what it meant on v0.4's `make_train_step`, which still
    takes them (with a mesh) as a shorthand that builds this value.

    **Raises:**

    `ValueError`/`TypeError` naming the keyword and the value for an unknown
    strategy or choice, an option the strategy does not use, an axis not in the
    mesh, an axis with two roles (a rule naming a data, stage or context axis),
    a negative `min_weight_size`; when a step first meets a model, for a rule
    that matches nothing or does not divide its dimension.

    !!! Example

        ```python
        layout = ed.Layout(mesh, strategy="fsdp", param_rules=rules)
        print(layout)  # one line per mesh axis and its roles
        step = ed.make_train_step(loss_fn, optimizer, layout)
        eval_step = ed.make_eval_step(eval_fn, layout)
        loader = ed.BatchLoader(data, 64, layout)
        ```
    """

    mesh: Mesh
    parts: tuple[Part, ...]
    caller: str
    strategy: str
    data_axes: tuple[str, ...]
    manual_axes: tuple[str, ...]
    reduce_axes: tuple[str, ...]
    batch_spec: P
    batch_sharding: NamedSharding
    num_shards: int
    _given: dict[str, Any]
    _source: tuple[Any, dict[str, Any]]
    _views: dict[str, "Layout"]
    _plans: dict[Any, ModelPlan]
    _shardings: dict[int, NamedSharding]
    _state_specs: "StateSpecs"

    def __init__(
        self,
        mesh: Mesh,
        *,
        strategy: str = "dp",
        data_axis: str | tuple[str, ...] = "data",
        param_rules: Any = (),
        min_weight_size: int = 2**18,
        fsdp_axis: str | None = None,
        fsdp_layout: str | None = None,
        fsdp_gather: str | None = None,
        fsdp_linears: str | None = None,
        pipeline: Any = None,  # an ed.Pipeline, checked to say so plainly
        context_axis: Any = None,  # a str, checked to say so plainly
        expert_axis: Any = None,  # a str, checked to say so plainly
    ) -> None:
        keywords = dict(
            strategy=strategy,
            data_axis=data_axis,
            param_rules=param_rules,
            min_weight_size=min_weight_size,
            fsdp_axis=fsdp_axis,
            fsdp_layout=fsdp_layout,
            fsdp_gather=fsdp_gather,
            fsdp_linears=fsdp_linears,
            pipeline=pipeline,
            context_axis=context_axis,
            expert_axis=expert_axis,
        )
        self._build("Layout", mesh, keywords)

    @classmethod
    def of(cls, caller: str, mesh: Mesh, keywords: dict[str, Any]) -> "Layout":
        """The layout of `keywords` (a subset of the constructor's) over `mesh`,
        its errors naming `caller`: v0.4's shorthand (a mesh and the keywords)."""
        layout = cls.__new__(cls)
        layout._build(caller, mesh, {**LAYOUT_DEFAULTS, **keywords})
        return layout

    def _build(self, caller: str, mesh: Any, keywords: dict[str, Any]) -> None:
        check_mesh(mesh, caller)
        source_mesh = mesh
        split_elsewhere = (keywords["pipeline"], keywords["context_axis"]) != (
            None,
        ) * 2
        mesh = with_data_axis(mesh, keywords["data_axis"], split_elsewhere)
        parts = parse_parts(caller, mesh, keywords)
        data = parts[0]
        assert isinstance(data, DataPart)
        given = {
            k: v
            for k, v in keywords.items()
            if v is not LAYOUT_DEFAULTS[k] and v != LAYOUT_DEFAULTS[k]
        }
        batch_spec = self._compose_spec(parts, 1)
        specs = StateSpecs(
            self.plan, parts, caller=caller, strategy=keywords["strategy"], mesh=mesh
        )
        own = dict(
            mesh=mesh,
            parts=parts,
            caller=caller,
            strategy=keywords["strategy"],
            data_axes=data.axes,
            manual_axes=sum((p.manual_axes() for p in parts), ()),
            reduce_axes=sum((p.reduce_axes() for p in parts), ()),
            batch_spec=batch_spec,
            batch_sharding=NamedSharding(mesh, batch_spec),
            _shardings={},
            num_shards=math.prod(mesh.shape[a] for a in data.axes),
            _given=given,
            _source=(source_mesh, dict(keywords)),
            _views={},
            _plans={},
            _state_specs=specs,
        )
        for name, value in own.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"Layout is immutable (setting `{name}`); build another: "
            "ed.Layout(mesh, ...)."
        )

    @staticmethod
    def _compose_spec(parts: tuple[Part, ...], ndim: int) -> P:
        spec = P()
        for part in parts:
            spec = part.leaf_spec(ndim, spec)
        return spec

    def for_view(self, view: str) -> "Layout":
        """The layout a step of `view` places its state by: this one, except
        that under `strategy="fsdp"` without `fsdp_layout` a global view's step
        shards each weight on its output features (`"outputs"`,
        `parts.fsdp.GLOBAL_VIEW_LAYOUT`) where the device view's shards every
        leaf on its leading dimension: the same layout with
        `fsdp_layout="outputs"`, built once."""
        return _for_view(self, view)

    # -- what a user reads -----------------------------------------------------

    def describe(self) -> str:
        """One line per mesh axis: its name, size and every role it has."""
        roles: dict[str, list[str]] = {axis: [] for axis in self.mesh.axis_names}
        for part in self.parts:
            for axis, role in part.roles(self.mesh).items():
                roles[axis].append(role)
        width = max(len(str(a)) for a in self.mesh.axis_names)
        lines = [f"Layout (strategy={self.strategy!r}) over {len(roles)} mesh axes:"]
        for axis, held in roles.items():
            what = "; ".join(held) if held else "replicated (no role)"
            lines.append(f"  {axis:<{width}}  {self.mesh.shape[axis]:>4}  {what}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        given = "".join(f", {k}={v!r}" for k, v in self._given.items())
        return f"Layout({dict(self.mesh.shape)}{given})"

    def model_specs(self, model: Any) -> Any:
        """The `PartitionSpec` of every array leaf of `model` under this layout
        (`None` at other leaves): what `step.state_specs(state).model` gives."""
        return self.plan(model).specs

    # -- what the steps and the loader ask ---------------------------------------

    def plan(self, model: Any) -> ModelPlan:
        """Where `model`'s leaves live (`plan_model`, from every part's
        `plan_keywords`, then each part's `apply_to_plan` in turn), computed
        once per structure, shapes and dtypes (a step's slow path, its trace
        and `state_specs` all ask)."""
        key = structure_key(model)
        if key not in self._plans:
            keywords: dict[str, Any] = {
                "fsdp": None,
                "rules": ParamRules((), self.mesh, self.data_axes, self.caller),
            }
            for part in self.parts:
                keywords.update(part.plan_keywords(self.mesh, model, self.caller))
            plan = plan_model(model, caller=self.caller, **keywords)
            for part in self.parts:
                plan = part.apply_to_plan(plan, self.mesh, model, self.caller)
            self._plans[key] = plan
        return self._plans[key]

    def compute_mesh(self, with_state: bool) -> Mesh:
        """The mesh a step computes on (`_mesh.compute_mesh`, `_mesh.retyped`):
        every axis `Auto`, and, when a model state is carried and the data axes
        are every axis of the mesh, a trailing `Auto` axis of size 1.

        Inside a fully manual `shard_map` traced values carry the manual mesh in
        their type while constants made there do not, so `eqx.nn.State.set(index,
        jnp.array(False))` (BatchNorm's `mode="ema"` flag) fails Equinox's check
        that a value keeps its type. One automatic axis of size 1 leaves the
        computation unchanged and gives traced values and constants one type."""
        fully_manual = set(self.mesh.axis_names) <= set(self.data_axes)
        return compute_mesh(self.mesh, with_state and fully_manual)

    def leaf_spec(self, ndim: int) -> P:
        """Where a batch leaf of rank `ndim` lives (every part's `leaf_spec`)."""
        return self._compose_spec(self.parts, ndim)

    def leaf_sharding(self, ndim: int) -> NamedSharding:
        """`leaf_spec` on this layout's mesh."""
        if ndim not in self._shardings:
            self._shardings[ndim] = NamedSharding(self.mesh, self.leaf_spec(ndim))
        return self._shardings[ndim]

    def batch_specs(self, batch_arrays: Any) -> Any:
        """The `shard_map` specs of a batch's arrays (`leaf_spec`)."""
        return jax.tree.map(lambda x: self.leaf_spec(np.ndim(x)), batch_arrays)

    def device_batch(self, batch: Any) -> Any:
        """Inside a device view's `shard_map`: this device's block of `batch` as
        the loss sees it (every part's `device_batch`)."""
        for part in self.parts:
            batch = part.device_batch(batch)
        return batch

    def row_multiple(self) -> int:
        """What each device's rows must be a multiple of (every part's)."""
        return math.prod(part.row_multiple() for part in self.parts)

    def state_specs(self, state: Any, optimizer: Any) -> Any:
        """The specs of a whole `TrainState` (`state_specs.StateSpecs`)."""
        return self._state_specs(state, optimizer)

    def compiler_options(self, model: Any, compute_dtype: Any) -> dict[str, Any] | None:
        """XLA options for a step of `model` on this layout (CPU only; `None`
        elsewhere): keep `FSDP` modules' optimisation barriers, and the passes
        the parts disable."""
        if self.mesh.devices.flat[0].platform != "cpu":
            return None
        passes = []
        if has_fsdp_modules(model) or self.fences:
            passes.append(CPU_FSDP_OPTIONS["xla_disable_hlo_passes"])
        for part in self.parts:
            passes.extend(part.compiler_passes(model, compute_dtype))
        return {"xla_disable_hlo_passes": ",".join(passes)} if passes else None

    @property
    def fences(self) -> bool:
        """Whether `fence` orders anything: on CPU devices, with a pipeline's
        stages or a context ring (`ppermute`s inside loops)."""
        loops = set(self.manual_axes) - set(self.data_axes)
        return bool(loops) and self.mesh.devices.flat[0].platform == "cpu"

    def fence(self, tree: Any) -> Any:
        """`tree` through `flags.in_one_order` where `fences` (else `tree`): the
        steps fence what enters the loss (the gathered parameters, the batch)
        and what leaves it (gradients, loss, metrics), so every collective
        outside the loss runs before or after all of it on every device."""
        return in_one_order(tree) if self.fences else tree

    def check_rows(
        self, batch: Any, num_minibatches: int, *, traced: bool = False
    ) -> None:
        """Rows must split evenly over the devices of the data axes and then the
        minibatches, and every part must be able to split the batch. In a
        multi-process run a host batch holds this process's rows only, so it is
        checked against this process's devices; global arrays (and the traced
        batch inside the step) against all of them."""
        _check_rows(self, batch, num_minibatches, traced)

    def check_batch(self, batch: Any, caller: str) -> None:
        """Every part's `check_batch`."""
        for part in self.parts:
            part.check_batch(batch, caller)


def _check_rows(layout: Layout, batch: Any, num_minibatches: int, traced: bool) -> None:
    """`Layout.check_rows`, out of the class (its size)."""
    shards = layout.num_shards
    if not traced and not layout.batch_sharding.is_fully_addressable:
        rows = [x for x in jax.tree.leaves(batch) if is_array(x) and np.ndim(x)]
        if not all(
            isinstance(x, jax.Array) and not x.is_fully_addressable for x in rows
        ):
            shards = local_shard_count(layout.batch_sharding, layout.num_shards)
    divisor = shards * num_minibatches
    check_rows(
        batch,
        divisor,
        layout.caller,
        f"{plural(shards, 'device')} along {layout.data_axes} x num_minibatches="
        f"{num_minibatches} = {divisor}",
    )
    layout.check_batch(batch, layout.caller)


def _for_view(layout: Layout, view: str) -> Layout:
    """`Layout.for_view`: `layout`, or once per view its keywords with
    `fsdp_layout=GLOBAL_VIEW_LAYOUT` (the global view under `"fsdp"` without a
    given `fsdp_layout`)."""
    given = layout._given
    if view != "global" or layout.strategy != "fsdp" or "fsdp_layout" in given:
        return layout
    if view not in layout._views:
        mesh, keywords = layout._source
        resolved = Layout.__new__(Layout)
        resolved._build(
            layout.caller, mesh, {**keywords, "fsdp_layout": GLOBAL_VIEW_LAYOUT}
        )
        layout._views[view] = resolved
    return layout._views[view]


def check_layout(value: Any, caller: str, argument: str) -> None:
    """A `TypeError` naming the value when it is neither a `Layout` nor a mesh
    (v0.4's form, with the layout's keywords beside it)."""
    if isinstance(value, Layout | Mesh):
        return
    axis = value if isinstance(value, str) and value else "data"
    raise TypeError(
        f"{caller}: `{argument}` must be an ed.Layout or a jax.sharding.Mesh; got "
        f"{type(value).__name__} {value!r}. Build one, e.g. "
        f"`ed.Layout(ed.create_device_mesh({{{axis!r}: {jax.device_count()}}}), "
        "strategy='dp')`, or pass the mesh (`jax.make_mesh(...)`) with the layout's "
        "keywords."
    )


def resolve_layout(caller: str, layout: Any, keywords: dict[str, Any]) -> Layout:
    """`caller`'s layout: `layout` itself when it is a `Layout` (any layout
    keyword beside it is a `ValueError` naming it: the layout has decided
    already), or the `Layout` of a mesh and `keywords` (v0.4's shorthand).
    v0.4 named the argument `mesh`: `mesh=` in `keywords` is taken for it."""
    keywords = dict(keywords)
    argument = "layout"
    if "mesh" in keywords:
        if layout is not None:
            raise TypeError(
                f"{caller}: both `layout` and `mesh` are given; pass one (`mesh` "
                "is v0.4's name of the argument that takes a Layout or a mesh)."
            )
        layout, argument = keywords.pop("mesh"), "mesh"
    elif layout is None:
        raise TypeError(
            f"{caller}: missing the `layout` argument: an ed.Layout, or a mesh "
            "with the layout's keywords."
        )
    check_layout(layout, caller, argument)
    unknown = sorted(set(keywords) - set(LAYOUT_DEFAULTS))
    if unknown:
        raise TypeError(
            f"{caller} got an unexpected keyword argument {unknown[0]!r}; the "
            f"layout's keywords are {sorted(LAYOUT_DEFAULTS)}."
        )
    if isinstance(layout, Layout):
        if keywords:
            name = next(iter(keywords))
            raise ValueError(
                f"{caller}: `{name}`={keywords[name]!r} is given with an ed.Layout, "
                "which has made every layout decision already; pass it to "
                f"ed.Layout(mesh, ..., {name}=...) instead, or pass the mesh in "
                "place of the layout."
            )
        return layout
    return Layout.of(caller, layout, keywords)
