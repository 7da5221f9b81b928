"""Where a training or evaluation step keeps every array: the layout of a strategy
(`"dp"` / `"fsdp"` / `"zero1"`) over the data axes of a mesh, with tensor-parallel
rules over the other axes.

`Layout` answers the questions that are its own, from options checked once
(`options.LayoutOptions`): how a batch is split, where a model's leaves live (the
model plan, `plan.plan_model`, computed from the names-to-axes rules of `rules`,
once per structure), where the optimizer state and the rest of a `TrainState`
live, the mesh a step computes on and which compiler options it needs. It
computes nothing of the step itself."""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._data_parallel import local_shard_count
from .._long.order import balance
from .._mesh import compute_mesh
from .._utils import (
    check_rows,
    flatten_up_to,
    is_array,
    is_array_like,
    plural,
    state_like,
)
from .flags import CPU_FSDP_OPTIONS
from .options import LayoutOptions
from .pipeline import StagePlan, stage_plan
from .plan import ModelPlan, plan_model, structure_key, warn_if_unsharded
from .remat import UNSET
from .rules import (
    FsdpRule,
    ParamRules,
    entry_size,
    has_fsdp_modules,
    is_spec_leaf,
)
from .stacked import Stacked
from .stages import Seen, pipelined as pipelined_model

# Strategies that shard something over `fsdp_axis`: the parameters (and their
# optimizer state) under FSDP, only the optimizer state under ZeRO-1.
_SHARDED = ("fsdp", "zero1")


def _replicated(tree: Any) -> Any:
    return jax.tree.map(lambda x: P() if is_array_like(x) else None, tree)


def _is_stacked(x: Any) -> bool:
    return isinstance(x, Stacked)


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _state_names(opt_state: Any) -> str:
    """The optimizer state's node types, to name the optimizer in an error."""
    nodes = opt_state if isinstance(opt_state, tuple | list) else (opt_state,)
    return ", ".join(type(x).__name__ for x in nodes) or type(opt_state).__name__


def describe_state(opt_state: Any) -> str:
    """An optimizer state in a few words, for an error: its node types and how
    many array leaves it has (its full tree structure runs to pages)."""
    count = len(jax.tree.leaves(opt_state))
    leaves = "1 leaf" if count == 1 else f"{count} leaves"
    return f"({_state_names(opt_state)}) with {leaves}"


class Layout:
    """The placement of a step's arrays; see the module docstring.

    **Arguments:**

    - `mesh`: the step's mesh.
    - `options`: the layout's options (`LayoutOptions.parse`: checked once).
      `make_eval_step` passes `"zero1"` too: without an optimizer state it lays
      out the model as `"dp"` does.
    - `caller`: named in error messages.
    """

    def __init__(self, mesh: Mesh, options: LayoutOptions, *, caller: str) -> None:
        self.mesh = mesh
        self.options = options
        self.strategy = options.strategy
        self.caller = caller
        self.data_axes = data_axes = options.data_axes
        fsdp = options.fsdp
        sharded_over = fsdp.axis or data_axes[-1]
        rule = FsdpRule(
            sharded_over, mesh.shape[sharded_over], fsdp.min_weight_size, fsdp.layout
        )
        # The FSDP rule of the parameters (FSDP) and of the optimizer state (FSDP
        # through its parameters, ZeRO-1 on its own).
        self.fsdp = rule if self.strategy == "fsdp" else None
        self.opt_fsdp = rule if self.strategy == "zero1" else None
        self.fsdp_axis = sharded_over if self.strategy in _SHARDED else None
        self.rules = ParamRules(options.param_rules, mesh, data_axes, caller)
        rows = data_axes[0] if len(data_axes) == 1 else data_axes
        self.batch_spec = P(rows)
        self.batch_sharding = NamedSharding(mesh, self.batch_spec)
        self.num_shards = math.prod(mesh.shape[a] for a in data_axes)
        self.pipeline = options.pipeline
        self.context_axis = context = options.context_axis
        # Leaves of rank >= 2 (the sequence in dimension 1) are split over the
        # context axis too; rows and their per-row values only over the data axes.
        self.sequence_spec = self.batch_spec if context is None else P(rows, context)
        self.sequence_sharding = NamedSharding(mesh, self.sequence_spec)
        contexts = () if context is None else (context,)
        # The axes the loss and the gradients add up over: a device's tokens are
        # its rows' share of the sequence.
        self.reduce_axes = data_axes + contexts
        # The axes a device-view step's `shard_map` is manual over: those, and a
        # pipeline's stage axis (each stage holding its layers).
        self.manual_axes = (
            data_axes
            + (() if self.pipeline is None else (self.pipeline.axis,))
            + contexts
        )
        self._plans: dict[Any, ModelPlan] = {}
        self._state_specs: dict[Any, Any] = {}

    def plan(self, model: Any) -> ModelPlan:
        """Where `model`'s leaves live (`plan_model`), computed once per
        structure, shapes and dtypes (a step's slow path, its trace and
        `state_specs` all ask)."""
        key = structure_key(model)
        if key not in self._plans:
            stages = None
            if self.pipeline is not None:
                stages = stage_plan(self.pipeline, self.mesh, model, self.caller)
            self._plans[key] = plan_model(
                model,
                data_axes=self.data_axes,
                fsdp=self.fsdp,
                rules=self.rules,
                caller=self.caller,
                zero1=self.opt_fsdp,
                stages=stages,
            )
        return self._plans[key]

    def for_loss(
        self,
        model: Any,
        stages: StagePlan | None,
        *,
        view: str,
        marker: Seen | None = None,
        pipelined: bool = True,
    ) -> Any:
        """The model as a step's loss sees it: every `Stacked` with the step's
        `remat` and `unroll` (where given), the pipelined one running the pipeline's
        schedule (`stages`, the model's plan's; not with `pipelined=False`), or
        with a `marker` recording what it is called with (the 1F1B schedule's
        trace). In the global view the schedule makes the data axes manual
        too."""
        remat, unroll = self.options.remat, self.options.unroll
        if remat is not UNSET or unroll is not None:
            model = _with_stack_options(model, remat, unroll, self.caller)
        if stages is None or not pipelined:
            return model
        manual = self.data_axes if view == "global" else ()
        return pipelined_model(model, stages, manual, remat, marker)

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
        """Where a batch leaf of rank `ndim` lives: rows split over the data axes,
        with a context axis the sequence (dimension 1) over it too, 0-d leaves
        replicated."""
        if ndim == 0:
            return P()
        return self.sequence_spec if ndim >= 2 else self.batch_spec

    def batch_specs(self, batch_arrays: Any) -> Any:
        """The `shard_map` specs of a batch's arrays (`leaf_spec`)."""
        return jax.tree.map(lambda x: self.leaf_spec(np.ndim(x)), batch_arrays)

    def opt_state_specs(
        self, optimizer: optax.GradientTransformation, opt_state: Any, param_specs: Any
    ) -> Any:
        """The optimizer state laid out by `param_specs` (the spec of each trainable
        parameter, `None` at frozen leaves): each state leaf like the parameter it
        belongs to (`optax.tree_map_params`), other leaves replicated.

        An optimizer whose state Optax cannot map to the parameters is a
        `ValueError`, never a guess: two parameters of one shape may have
        different specs, and a guessed spec would silently lay out the wrong one."""
        if all(s == P() for s in jax.tree.leaves(param_specs)):
            return _replicated(opt_state)
        try:
            # Masked transformations (`optax.masked`, `multi_transform`, Muon)
            # hold an `optax.MaskedNode` where a parameter has no state: a node
            # without leaves, kept as it is so the specs keep the state's
            # structure.
            specs = optax.tree_map_params(
                optimizer,
                lambda leaf, spec: leaf if _is_masked(leaf) else spec,
                opt_state,
                param_specs,
                transform_non_params=lambda x: P() if is_array_like(x) else None,
                is_leaf=_is_masked,
            )
        except Exception as e:  # whatever the optimizer's `init` raises on it
            rules = " with param_rules" if self.rules else ""
            raise ValueError(
                f"{self.caller}: cannot lay out the optimizer state "
                f"({_state_names(opt_state)}) under strategy={self.strategy!r}"
                f"{rules}: optax.tree_map_params, which finds the parameter each "
                "optimizer-state leaf belongs to, fails on this optimizer "
                f"({type(e).__name__}: {e}). Use strategy='dp' without param_rules "
                "(the optimizer state is then replicated), or an optimizer whose "
                "state optax.tree_map_params can map (e.g. optax.adamw, optax.sgd, "
                "or an optax.chain of such)."
            ) from e
        return jax.tree.map(self._fits, opt_state, specs)

    def _fits(self, x: Any, spec: Any) -> Any:
        # Optimizer states whose leaves are not parameter-shaped (factored
        # moments, say) keep a spec only if it fits the leaf.
        if not is_array_like(x):
            return None
        if not isinstance(spec, P) or len(spec) > len(x.shape):
            return P()
        for dim, entry in enumerate(spec):
            if entry is not None and x.shape[dim] % entry_size(self.mesh, entry):
                return P()
        return spec

    def state_specs(self, state: Any, optimizer: Any) -> Any:
        """The specs of a whole `TrainState` (model, optimizer state, replicated
        model state, step and key), cached per structure, shapes and dtypes.
        `optimizer`: the state's optimizer, or with parts the dict of one per
        part (each part's state laid out by its parameters)."""
        key = structure_key(state)
        if key not in self._state_specs:
            self._state_specs[key] = self._compute_state_specs(state, optimizer)
        return self._state_specs[key]

    def _compute_state_specs(self, state: Any, optimizer: Any) -> Any:
        model_specs = self.plan(state.model).specs
        if state.parts is None:
            opt_specs = self.opt_state_specs(
                optimizer,
                state.opt_state,
                self._param_specs(state, model_specs, state.trainable_mask()),
            )
        else:
            opt_specs = {
                name: self.opt_state_specs(
                    optimizer[name],
                    state.opt_state[name],
                    self._param_specs(state, model_specs, state.trainable_mask(name)),
                )
                for name, _ in state.parts
            }
        return state_like(
            state,
            model_specs,
            opt_state=opt_specs,
            step=P(),
            key=_replicated(state.key),
            model_state=_replicated(state.model_state),
        )

    def _param_specs(self, state: Any, model_specs: Any, trained: Any) -> Any:
        """The specs optimizer state follows: each `trained` leaf's (under ZeRO-1,
        sharded by the FSDP rule), `None` at the others."""
        param_specs = jax.tree.map(
            lambda s, t: s if t else None, model_specs, trained, is_leaf=is_spec_leaf
        )
        if self.opt_fsdp is not None:
            # ZeRO-1: the parameters stay as their rules say; their optimizer state
            # is sharded over `fsdp_axis` as FSDP would shard the parameters.
            treedef = jax.tree.structure(state.model)
            leaves = jax.tree.leaves(state.model)
            spec_leaves = [
                None if s is None else self.opt_fsdp.spec(tuple(x.shape), s)
                for x, s in zip(
                    leaves, flatten_up_to(state.model, param_specs), strict=True
                )
            ]
            warn_if_unsharded(
                spec_leaves,
                [x for x, s in zip(leaves, spec_leaves, strict=True) if s is not None],
                self.opt_fsdp,
                self.caller,
                "strategy='zero1'",
                "optimizer state",
            )
            param_specs = jax.tree.unflatten(treedef, spec_leaves)
        return param_specs

    def compiler_options(self, model: Any, compute_dtype: Any) -> dict[str, Any] | None:
        """XLA options for a step of `model` on this layout (CPU only; `None`
        elsewhere): keep `FSDP` modules' optimisation barriers, and skip XLA:CPU's
        all-reduce promotion pass, which aborts the process when compiling
        bfloat16 collectives of tensor-parallel rules."""
        if self.mesh.devices.flat[0].platform != "cpu":
            return None
        passes = []
        if has_fsdp_modules(model):
            passes.append(CPU_FSDP_OPTIONS["xla_disable_hlo_passes"])
        if self.rules and compute_dtype is not None:
            passes.append("all-reduce-promotion")
        return {"xla_disable_hlo_passes": ",".join(passes)} if passes else None

    # -- batches -------------------------------------------------------------------

    def check_rows(
        self, batch: Any, num_minibatches: int, *, traced: bool = False
    ) -> None:
        """Rows must split evenly over the devices of the data axes and then the
        minibatches. In a multi-process run a host batch holds this process's rows
        only, so it is checked against this process's devices; global arrays (and
        the traced batch inside the step) against all of them."""
        shards = self.num_shards
        if not traced and not self.batch_sharding.is_fully_addressable:
            rows = [x for x in jax.tree.leaves(batch) if is_array(x) and np.ndim(x)]
            if not all(
                isinstance(x, jax.Array) and not x.is_fully_addressable for x in rows
            ):
                shards = local_shard_count(self.batch_sharding, self.num_shards)
        divisor = shards * num_minibatches
        check_rows(
            batch,
            divisor,
            self.caller,
            f"{plural(shards, 'device')} along {self.data_axes} x num_minibatches="
            f"{num_minibatches} = {divisor}",
        )
        if self.context_axis is not None:
            check_lengths(batch, self.mesh, self.context_axis, self.caller)


def balanced(batch: Any, axis: str | None) -> Any:
    """Inside a device view's `shard_map`: each leaf of rank >= 2 of this
    device's block of a batch sharded over the context `axis` in the natural
    order, in the balanced order `ed.attention` computes on (`_long.order`; two
    `ppermute`s of half a block each). `None`: `batch` as it is."""
    if axis is None:
        return batch

    def balance_leaf(x: Any) -> Any:
        if not is_array(x) or np.ndim(x) < 2:
            return x
        return jnp.moveaxis(balance(jnp.moveaxis(x, 1, 0), axis), 0, 1)

    return jax.tree.map(balance_leaf, batch)


def check_lengths(batch: Any, mesh: Mesh, axis: str, caller: str) -> None:
    """Sequences (dimension 1 of leaves of rank >= 2) must cut into 2 chunks per
    device of the context `axis` (the balanced order)."""
    size = mesh.shape[axis]
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if is_array(x) and np.ndim(x) >= 2 and np.shape(x)[1] % (2 * size):
            raise ValueError(
                f"{caller}: batch leaf {jax.tree_util.keystr(path)} has shape "
                f"{np.shape(x)}; with context_axis={axis!r} its dimension 1 (the "
                f"sequence) is split into 2 chunks per device of that axis, so it "
                f"must be a multiple of 2 x {size} = {2 * size}. Pad or crop the "
                "sequences; a leaf of rank >= 2 that is not a sequence (e.g. an "
                "image) cannot be in a context-parallel batch: flatten it or pass "
                "it per row."
            )


_STACK_OPTIONS = {
    "remat": "says what the backward pass keeps of a Stacked's blocks. Hold the "
    "blocks in an ed.Stacked, or use jax.checkpoint in the model.",
    "unroll": "says whether a Stacked's blocks run as a scan or a Python loop; a "
    "model without one has no loop over its layers. Leave `unroll` out.",
}


def _with_stack_options(model: Any, remat: Any, unroll: Any, caller: str) -> Any:
    """`model` with every `Stacked` keeping what `remat` says (`UNSET`: its
    own) and unrolled as `unroll` says (`None`: as built); a `ValueError`
    without one: the option would do nothing."""
    stacks = [
        x for x in jax.tree.leaves(model, is_leaf=_is_stacked) if isinstance(x, Stacked)
    ]
    if not stacks:
        name, value = ("remat", remat) if remat is not UNSET else ("unroll", unroll)
        raise ValueError(
            f"{caller}: `{name}`={value!r} is given, but the model holds no "
            f"ed.Stacked; {name} {_STACK_OPTIONS[name]}"
        )
    return jax.tree.map(
        lambda x: (
            x._with_options(remat=remat, unroll=unroll) if isinstance(x, Stacked) else x
        ),
        model,
        is_leaf=_is_stacked,
    )
