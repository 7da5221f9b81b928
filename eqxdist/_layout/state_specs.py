"""Where a whole `TrainState` lives under a layout: the model as its plan says,
each optimizer-state leaf like the parameter it belongs to (as the parts say:
ZeRO-1 shards it where FSDP would shard the parameter), the rest replicated."""

from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import Mesh, PartitionSpec as P

from .._utils import is_array_like, state_like
from .parts.base import Part
from .parts.tensor import TensorPart
from .plan import ModelPlan, structure_key
from .rules import entry_size, is_spec_leaf


def _replicated(tree: Any) -> Any:
    return jax.tree.map(lambda x: P() if is_array_like(x) else None, tree)


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


class StateSpecs:
    """`specs(state, optimizer)`: the specs of a `TrainState` under a layout,
    cached per structure, shapes and dtypes. `optimizer`: the state's
    optimizer, or with parts the dict of one per part (each part's state laid
    out by its parameters).

    It is given what it reads of the layout (`plan`, the model's plan; its
    `parts`, `caller`, `strategy` and `mesh`), not the `Layout`, which holds
    one: the layout imports this module, never the other way round."""

    def __init__(
        self,
        plan: Callable[[Any], ModelPlan],
        parts: tuple[Part, ...],
        *,
        caller: str,
        strategy: str,
        mesh: Mesh,
    ) -> None:
        self.plan, self.parts, self.caller = plan, parts, caller
        self.strategy, self.mesh = strategy, mesh
        self._cache: dict[Any, Any] = {}

    def __call__(self, state: Any, optimizer: Any) -> Any:
        key = structure_key(state)
        if key not in self._cache:
            self._cache[key] = self._compute(state, optimizer)
        return self._cache[key]

    def _compute(self, state: Any, optimizer: Any) -> Any:
        model_specs = self.plan(state.model).specs
        if state.parts is None:
            opt_specs = self.optimizer_state(
                optimizer,
                state.opt_state,
                self._param_specs(state, model_specs, state.trainable_mask()),
            )
        else:
            opt_specs = {
                name: self.optimizer_state(
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
        """The specs optimizer state follows: each `trained` leaf's, as the
        parts say (`Part.optimizer_specs`), `None` at the others."""
        specs = jax.tree.map(
            lambda s, t: s if t else None, model_specs, trained, is_leaf=is_spec_leaf
        )
        for part in self.parts:
            specs = part.optimizer_specs(state.model, specs, self.caller)
        return specs

    def optimizer_state(
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
            tensor = any(isinstance(p, TensorPart) for p in self.parts)
            rules = " with param_rules" if tensor else ""
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
        mesh = self.mesh
        for dim, entry in enumerate(spec):
            if entry is not None and x.shape[dim] % entry_size(mesh, entry):
                return P()
        return spec
