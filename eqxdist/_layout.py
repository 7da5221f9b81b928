"""Where a training or evaluation step keeps every array: the layout of a strategy
(`"dp"` / `"fsdp"`) over the data axes of a mesh, with tensor-parallel rules over
the other axes.

One object answers every placement question of a step: the `PartitionSpec` of each
model, optimizer-state and model-state leaf, the part of those specs that
`jax.shard_map` handles by hand (the data axes) and the part left to XLA (rule axes),
what the FSDP gather collects, and how a batch is split. It computes nothing of the
step itself."""

import math
import re
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ._data_parallel import local_shard_count
from ._fsdp import CPU_FSDP_OPTIONS, gather_params, sharded_dim, spec_axes
from ._layers import Stacked
from ._partition import (
    SelfGathering,
    check_layout,
    has_fsdp_modules,
    leaf_plan,
    leaf_spec,
)
from ._utils import (
    AxisName,
    axis_names,
    check_axis_in_mesh,
    check_min_weight_size,
    check_rows,
    flatten_up_to,
    is_array,
    is_array_like,
    path_str,
    state_like,
)

STRATEGIES = ("dp", "fsdp")

ParamRules = Sequence[tuple[str, P]]


def _restrict(spec: P | None, keep: tuple[str, ...]) -> P | None:
    """`spec` with only the axes in `keep` (the others become `None`)."""
    if spec is None:
        return None
    out: list[Any] = []
    for entry in spec:
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(n for n in names if n in keep)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _entry_size(mesh: Mesh, entry: Any) -> int:
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return math.prod(mesh.shape[n] for n in names)


def _in_stacked(model: Any) -> list[bool]:
    """Per leaf of `jax.tree.leaves(model)`: whether a `Stacked` module holds it."""
    out: list[bool] = []
    for part in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, SelfGathering)):
        n = len(jax.tree.leaves(part)) if isinstance(part, SelfGathering) else 1
        out.extend([isinstance(part, Stacked)] * n)
    return out


class Layout:
    """The placement of a step's arrays; see the module docstring.

    **Arguments:**

    - `mesh`, `strategy`, `data_axis`, `fsdp_axis`, `min_weight_size`,
      `param_rules`, `fsdp_layout`: as `make_train_step` takes them (validated
      here, once).
    - `caller`: named in error messages.
    """

    def __init__(
        self,
        mesh: Mesh,
        *,
        strategy: str,
        data_axis: AxisName,
        fsdp_axis: str | None,
        min_weight_size: int,
        param_rules: ParamRules,
        fsdp_layout: str = "leading",
        caller: str,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(
                f"{caller}: unknown strategy {strategy!r}; use one of "
                f"{list(STRATEGIES)}."
            )
        data_axes = axis_names(data_axis)
        if not data_axes:
            raise ValueError(f"{caller}: `data_axis` is empty; name a mesh axis.")
        if len(set(data_axes)) != len(data_axes):
            raise ValueError(f"{caller}: `data_axis`={data_axis!r} repeats an axis.")
        for axis in data_axes:
            check_axis_in_mesh(mesh, axis, caller, "data_axis")
        check_min_weight_size(min_weight_size, caller)
        check_layout(fsdp_layout, caller, "fsdp_layout")
        if fsdp_axis is not None and strategy != "fsdp":
            raise ValueError(
                f"{caller}: `fsdp_axis`={fsdp_axis!r} is given but strategy is "
                f"{strategy!r}; it only applies to strategy='fsdp'."
            )
        if fsdp_axis is not None and fsdp_axis not in data_axes:
            raise ValueError(
                f"{caller}: `fsdp_axis`={fsdp_axis!r} is not one of the data axes "
                f"{data_axes}; parameters are sharded over one of the axes the "
                "batch is split over."
            )
        self.mesh = mesh
        self.strategy = strategy
        self.caller = caller
        self.data_axes = data_axes
        self.fsdp_axis = (fsdp_axis or data_axes[-1]) if strategy == "fsdp" else None
        self.min_weight_size = min_weight_size
        self.fsdp_layout = fsdp_layout
        self.rules = self._check_rules(param_rules)
        self.batch_spec = P(data_axes[0] if len(data_axes) == 1 else data_axes)
        self.batch_sharding = NamedSharding(mesh, self.batch_spec)
        self.num_shards = math.prod(mesh.shape[a] for a in data_axes)
        self._specs_cache: dict[Any, Any] = {}

    # -- rules ---------------------------------------------------------------------

    def _check_rules(self, rules: ParamRules) -> tuple[tuple[re.Pattern[str], P], ...]:
        checked = []
        for i, rule in enumerate(rules):
            if not (isinstance(rule, tuple | list) and len(rule) == 2):
                raise TypeError(
                    f"{self.caller}: param_rules[{i}] is {rule!r}; expected a pair "
                    "(pattern, PartitionSpec)."
                )
            pattern, spec = rule
            if not isinstance(pattern, str) or not isinstance(spec, P):
                raise TypeError(
                    f"{self.caller}: param_rules[{i}] is ({pattern!r}, {spec!r}); "
                    "expected (a regular expression string, a PartitionSpec)."
                )
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"{self.caller}: param_rules pattern {pattern!r} is not a valid "
                    f"regular expression: {e}."
                ) from None
            for axis in spec_axes(spec):
                if axis not in self.mesh.axis_names:
                    raise ValueError(
                        f"{self.caller}: param_rules pattern {pattern!r}: spec {spec} "
                        f"names axis {axis!r}, which is not an axis of the mesh "
                        f"{tuple(self.mesh.axis_names)}."
                    )
                if axis in self.data_axes:
                    raise ValueError(
                        f"{self.caller}: param_rules pattern {pattern!r}: spec {spec} "
                        f"names the data axis {axis!r}; rules shard parameters over "
                        "the other (model) axes, the strategy handles data axes."
                    )
            checked.append((compiled, spec))
        return tuple(checked)

    def _rule_specs(self, paths: list[str], leaves: list[Any]) -> list[P | None]:
        """The rule spec of each leaf (`None`: no rule matched or not an array),
        every mistake a `ValueError` naming the pattern, leaf and dimension."""
        out: list[P | None] = [None] * len(leaves)
        used = [False] * len(self.rules)
        for j, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
            if not is_array_like(leaf):
                continue
            for r, (pattern, spec) in enumerate(self.rules):
                if not pattern.search(path):
                    continue
                used[r] = True
                shape = tuple(leaf.shape)
                if len(spec) > len(shape):
                    raise ValueError(
                        f"{self.caller}: param_rules pattern {pattern.pattern!r} "
                        f"gives spec {spec} to {path} of shape {shape}; the spec has "
                        f"more entries than the leaf has dimensions."
                    )
                for dim, entry in enumerate(spec):
                    size = _entry_size(self.mesh, entry)
                    if entry is not None and shape[dim] % size:
                        raise ValueError(
                            f"{self.caller}: param_rules pattern "
                            f"{pattern.pattern!r}: dimension {dim} of {path} (shape "
                            f"{shape}) has size {shape[dim]}, not divisible by the "
                            f"{size} devices of {entry!r}."
                        )
                out[j] = spec
                break
        for r, was_used in enumerate(used):
            if not was_used:
                raise ValueError(
                    f"{self.caller}: param_rules pattern "
                    f"{self.rules[r][0].pattern!r} matches no array of the model "
                    "(paths are written as jax.tree_util.keystr writes them, e.g. "
                    f"{paths[0] if paths else '.layers[0].weight'!r})."
                )
        return out

    def _fsdp_spec(self, shape: tuple[int, ...], rule: P | None) -> P:
        """The FSDP rule (`leaf_spec`) on the dimensions `rule` leaves unsharded;
        `min_weight_size` compares the leaf's full size."""
        assert self.fsdp_axis is not None
        rule = rule or P()
        if math.prod(shape) <= self.min_weight_size:
            return rule
        taken = {d for d, e in enumerate(rule) if e is not None}
        free_shape = tuple(1 if d in taken else n for d, n in enumerate(shape))
        size = self.mesh.shape[self.fsdp_axis]
        spec = leaf_spec(free_shape, size, self.fsdp_axis, 0, prefer=self.fsdp_layout)
        dim = sharded_dim(spec, self.fsdp_axis)
        if dim is None or dim in taken:
            return rule
        entries = list(rule) + [None] * (len(shape) - len(rule))
        entries[dim] = self.fsdp_axis
        return P(*entries)

    # -- specs ---------------------------------------------------------------------

    def model_specs(self, model: Any) -> Any:
        """The `PartitionSpec` of every array leaf of `model` (`None` at other
        leaves): rule axes, plus `fsdp_axis` under FSDP. `FSDP`/`Stacked`
        submodules keep their own FSDP layout, to which rules add their axes."""
        return self._cached("model", model, lambda: self._model_specs(model))

    def _model_specs(self, model: Any) -> Any:
        with_path = jax.tree_util.tree_flatten_with_path(model)[0]
        leaves = [x for _, x in with_path]
        paths = [path_str(p) for p, _ in with_path]
        rules = self._rule_specs(paths, leaves)
        if self.fsdp_axis is None:
            specs: list[Any] = [
                (r or P()) if is_array_like(x) else None
                for x, r in zip(leaves, rules, strict=True)
            ]
        else:
            own_specs, own = leaf_plan(
                model,
                self.mesh.shape[self.fsdp_axis],
                self.fsdp_axis,
                self.min_weight_size,
                layout=self.fsdp_layout,
            )
            stacked = _in_stacked(model)
            specs = []
            for path, x, r, s, o, in_stack in zip(
                paths, leaves, rules, own_specs, own, stacked, strict=True
            ):
                if not is_array_like(x):
                    specs.append(None)
                elif o:
                    specs.append(self._fsdp_spec(tuple(x.shape), r))
                elif in_stack and r is not None:
                    specs.append(self._stacked_spec(path, tuple(x.shape), r))
                else:
                    specs.append(self._merge(path, r, s))
        return jax.tree.unflatten(jax.tree.structure(model), specs)

    def _stacked_spec(self, path: str, shape: tuple[int, ...], rule: P) -> P:
        """A ruled leaf of a `Stacked` module: the FSDP rule on the per-layer shape,
        on a dimension the rule leaves free (`Stacked` finds the gathered dimension
        by shape); the layer axis is never sharded."""
        if len(rule) and rule[0] is not None:
            raise ValueError(
                f"{self.caller}: param_rules shard dimension 0 of {path}, the layer "
                "axis of a Stacked module, which is never sharded; start the spec "
                "with None."
            )
        inner = self._fsdp_spec(shape[1:], P(*rule[1:]))
        return P(None, *inner)

    def _merge(self, path: str, rule: P | None, own: P | None) -> P | None:
        """A rule's axes added to the FSDP spec a `FSDP`/`Stacked` module gives
        its own leaf, or a `ValueError` when both claim one dimension."""
        if rule is None or own is None:
            return own if rule is None else rule
        n = max(len(rule), len(own))
        a = list(rule) + [None] * (n - len(rule))
        b = list(own) + [None] * (n - len(own))
        for dim, (x, y) in enumerate(zip(a, b, strict=True)):
            if x is not None and y is not None:
                raise ValueError(
                    f"{self.caller}: param_rules shard dimension {dim} of {path} "
                    f"over {x!r}, which its FSDP/Stacked module already shards over "
                    f"{y!r}; write the rule for another dimension (a Stacked leaf's "
                    "dimension 0 is the layer axis)."
                )
        return P(*[x if x is not None else y for x, y in zip(a, b, strict=True)])

    def has_rule_axes(self, spec: P | None) -> bool:
        """Whether `spec` shards over a mesh axis that is not a data axis (a
        `param_rules` axis)."""
        return bool(spec_axes(spec) - set(self.data_axes))

    def _gathered_at_boundary(self, model: Any, specs: Any) -> list[bool]:
        """Per leaf of `model`: sharded over `fsdp_axis` and over rule axes, and
        gathered by the step (not by an `FSDP`/`Stacked` module)."""
        spec_leaves = flatten_up_to(model, specs)
        if self.fsdp_axis is None:
            return [False] * len(spec_leaves)
        _, own = leaf_plan(
            model,
            self.mesh.shape[self.fsdp_axis],
            self.fsdp_axis,
            self.min_weight_size,
            layout=self.fsdp_layout,
        )
        return [
            o and s is not None and self.has_rule_axes(s)
            for s, o in zip(spec_leaves, own, strict=True)
        ]

    def manual_specs(self, model: Any, specs: Any) -> Any:
        """`specs` (of `model`) restricted to the data axes: what `shard_map`
        (manual over the data axes only) takes; the rule axes stay with XLA.

        A leaf the step gathers that is sharded over rule axes too enters
        unsharded over the data axes: XLA's partitioner replicates the operand of a
        collective over the manual (data) axes across the automatic (rule) axes, so
        an FSDP all-gather inside `shard_map` would gather such a leaf over the
        rule axes as well, undoing tensor parallelism (every device would hold and
        multiply whole weights). Gathered at the `shard_map` boundary instead, XLA
        gathers it over the data axes only, keeping the rule axes sharded; its
        gradient is then averaged with an all-reduce over the data axes, and the
        update keeps its FSDP shard."""
        boundary = self._gathered_at_boundary(model, specs)
        spec_leaves = flatten_up_to(model, specs)
        out = [
            P() if b else _restrict(s, self.data_axes)
            for s, b in zip(spec_leaves, boundary, strict=True)
        ]
        return jax.tree.unflatten(jax.tree.structure(model), out)

    def gather_specs(self, model: Any, specs: Any) -> Any:
        """The specs with which the step gathers `model` at the top: `fsdp_axis`
        only, and nothing inside `FSDP`/`Stacked` submodules (they gather
        themselves) nor of leaves gathered at the `shard_map` boundary (see
        `manual_specs`)."""
        if self.fsdp_axis is None:
            return None
        size = self.mesh.shape[self.fsdp_axis]
        _, own = leaf_plan(
            model, size, self.fsdp_axis, self.min_weight_size, layout=self.fsdp_layout
        )
        boundary = self._gathered_at_boundary(model, specs)
        spec_leaves = flatten_up_to(model, specs)
        top = [
            _restrict(s, (self.fsdp_axis,))
            if o and s is not None and not b
            else (P() if s is not None else None)
            for s, o, b in zip(spec_leaves, own, boundary, strict=True)
        ]
        return jax.tree.unflatten(jax.tree.structure(model), top)

    def gather(self, tree: Any, gspecs: Any) -> Any:
        """Inside the step's `shard_map`: `tree`'s FSDP shards all-gathered as
        `gspecs` (from `gather_specs`) say; as it is without FSDP."""
        if gspecs is None or self.fsdp_axis is None:
            return tree
        return gather_params(tree, gspecs, self.fsdp_axis)

    def batch_specs(self, batch_arrays: Any) -> Any:
        """The `shard_map` specs of a batch's arrays: rows split over the data axes,
        0-d leaves replicated."""
        return jax.tree.map(
            lambda x: self.batch_spec if np.ndim(x) else P(), batch_arrays
        )

    def opt_state_specs(
        self,
        optimizer: optax.GradientTransformation,
        opt_state: Any,
        params: Any,
        param_specs: Any,
    ) -> Any:
        """The optimizer state laid out like the parameters it belongs to
        (`optax.tree_map_params`); other leaves replicated."""

        def replicated(x: Any) -> P | None:
            return P() if is_array_like(x) else None

        if all(s == P() for s in jax.tree.leaves(param_specs)):
            return jax.tree.map(replicated, opt_state)
        try:
            specs = optax.tree_map_params(
                optimizer,
                lambda _, spec: spec,
                opt_state,
                param_specs,
                transform_non_params=replicated,
            )
        except (TypeError, ValueError, AttributeError, KeyError):
            # An optimizer whose `init` cannot run on Optax's placeholder: give
            # parameter-shaped leaves the layout of the parameter of that shape.
            by_shape = {
                tuple(p.shape): s
                for p, s in zip(
                    jax.tree.leaves(params), jax.tree.leaves(param_specs), strict=True
                )
            }
            return jax.tree.map(
                lambda x: (
                    by_shape.get(tuple(x.shape), P()) if is_array_like(x) else None
                ),
                opt_state,
            )
        return jax.tree.map(self._fits, opt_state, specs)

    def _fits(self, x: Any, spec: Any) -> Any:
        # Optimizer states whose leaves are not parameter-shaped (factored
        # moments, say) keep a spec only if it fits the leaf.
        if not is_array_like(x):
            return None
        if not isinstance(spec, P) or len(spec) > len(x.shape):
            return P()
        for dim, entry in enumerate(spec):
            if entry is not None and x.shape[dim] % _entry_size(self.mesh, entry):
                return P()
        return spec

    def state_specs(self, state: Any, optimizer: optax.GradientTransformation) -> Any:
        """The specs of a whole `TrainState` (model, optimizer state, replicated
        model state, step and key), cached per structure and shapes."""
        return self._cached("state", state, lambda: self._state_specs(state, optimizer))

    def _cached(self, kind: str, tree: Any, compute: Any) -> Any:
        """`compute()`, once per kind, structure and shapes of `tree`: the slow path
        of a step and its trace ask for the same specs."""
        leaves, treedef = jax.tree.flatten(tree)
        key = (
            kind,
            treedef,
            tuple((tuple(x.shape), str(x.dtype)) for x in leaves if is_array_like(x)),
        )
        if key not in self._specs_cache:
            self._specs_cache[key] = compute()
        return self._specs_cache[key]

    def _state_specs(self, state: Any, optimizer: optax.GradientTransformation) -> Any:
        model_specs = self.model_specs(state.model)
        mask = state.trainable_mask()
        param_specs = jax.tree.map(
            lambda s, t: s if t else None,
            model_specs,
            mask,
            is_leaf=lambda x: x is None or isinstance(x, P),
        )
        params = eqx.filter(state.model, mask)
        opt_specs = self.opt_state_specs(
            optimizer, state.opt_state, params, param_specs
        )

        def replicated(tree: Any) -> Any:
            return jax.tree.map(lambda x: P() if is_array_like(x) else None, tree)

        return state_like(
            state,
            model_specs,
            opt_state=opt_specs,
            step=P(),
            key=replicated(state.key),
            model_state=replicated(state.model_state),
        )

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
            f"{shards} devices along {self.data_axes} x num_minibatches="
            f"{num_minibatches} = {divisor}",
        )
