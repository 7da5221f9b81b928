"""The train state: the model, the optimizer state, the step counter, the key,
the model's own state and which leaves are trained."""

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PRNGKeyArray

from .._utils import is_array_like, strong_types, typecheck
from .parts import PartMasks, in_any_part, part_leaves, part_names, resolve_parts


def _is_inexact(x: Any) -> bool:
    return is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact)


class TrainState(eqx.Module):
    """Everything a training step reads and returns: the model, the optimizer
    state, the step counter, the PRNG key, the model's own state (e.g. BatchNorm
    statistics) and which parameters are trained.

    A plain pytree (no optimizer inside, so it can be checkpointed and sharded
    like any other); the optimizer goes to `make_train_step`. Under
    `strategy="fsdp"` the optimizer state is sharded exactly like the parameters
    it belongs to.

    - `model_state`: the non-trained state the model carries between steps, e.g.
      the `eqx.nn.State` of `eqx.nn.make_with_state`; `None` for models without.
    - `trainable`: which leaves of `model` are trained, one bool per leaf of
      `jax.tree.leaves(model)` (resolved by `create` from a filter spec); `None`
      means every floating-point array. Frozen leaves get no optimizer state and
      never change.
    - `parts`: the parts of a model with optimizers of their own (see
      `create`): per part name, one bool per leaf; `None` for one optimizer.
      With parts, `opt_state` is a dict of each part's optimizer state, and a
      leaf in no part is not trained.

    !!! Example

        ```python
        model, model_state = eqx.nn.make_with_state(Net)(key)
        state = ed.TrainState.create(model, optax.adamw(1e-3), jax.random.key(0),
                                     model_state=model_state)
        ```
    """

    model: Any
    opt_state: Any
    step: Int[Array, ""]
    key: PRNGKeyArray
    model_state: Any = None
    trainable: tuple[bool, ...] | None = eqx.field(default=None, static=True)
    parts: PartMasks | None = eqx.field(default=None, static=True)

    def __check_init__(self) -> None:
        step = self.step
        if not (
            is_array_like(step)
            and jnp.issubdtype(step.dtype, jnp.integer)
            and tuple(step.shape) == ()
        ):
            raise TypeError(
                "TrainState: `step` must be a 0-d integer JAX array, e.g. "
                f"`jnp.zeros((), jnp.int32)`; got {type(step).__name__} {step!r}. "
                "Use TrainState.create to build a fresh state."
            )

    @classmethod
    @typecheck
    def create(
        cls,
        model: Any,
        optimizer: Any,
        key: PRNGKeyArray,
        *,
        model_state: Any = None,
        trainable: Any = None,
        parts: Mapping[str, Callable[[Any], Any]] | None = None,
    ) -> "TrainState":
        """A fresh state: `optimizer.init` on the trainable leaves of the model,
        step 0.

        **Arguments:**

        - `model`: any Equinox model (or pytree of parameters).
        - `optimizer`: an Optax gradient transformation, or any object with Optax's
          `init`/`update` (e.g. `optax.MultiSteps`); with `parts`, a dict of one
          per part, with the same keys.
        - `key`: the PRNG key every step derives its randomness from
          (`fold_in(key, step)`); it stays the same from step to step.
        - `model_state`: the model's non-trained state (e.g. from
          `eqx.nn.make_with_state`), or `None`.
        - `trainable`: a filter spec as `eqx.partition` takes it (a callable on
          leaves, or a pytree prefix of `model` of bools/callables) selecting the
          trained leaves; only floating-point arrays among them are trained.
          `None`: every floating-point array (`eqx.is_inexact_array`).
        - `parts`: `{name: where}`, `where(model)` returning the sub-pytree of a
          part, as for `eqx.tree_at` (e.g. `{"gen": lambda m: m.generator, "disc":
          lambda m: m.discriminator}`); parts are disjoint. Each part's trainable
          leaves get the optimizer of its name, and `opt_state` is the dict of
          their states; `make_train_step(..., part=name)` trains one part.

        **Raises:**

        `ValueError` if `trainable` does not fit the model's structure or selects
        no floating-point array; for parts that overlap, hold no array or whose
        `where` does not fit the model; `TypeError` for an optimizer that is not
        one (or, with `parts`, not a dict of one per part).

        !!! Example

            ```python
            # Fine-tune the head only.
            trainable = jax.tree.map(lambda _: False, model)
            trainable = eqx.tree_at(lambda m: m.head, trainable, True)
            state = ed.TrainState.create(model, optax.adam(1e-3), key,
                                         trainable=trainable)
            ```
        """
        caller = "TrainState.create"
        model, model_state = strong_types(model), strong_types(model_state)
        mask: tuple[bool, ...] | None = None
        if trainable is not None:
            missing = object()
            try:
                chosen = eqx.filter(model, trainable, replace=missing)
            except (ValueError, TypeError) as e:
                raise ValueError(
                    "TrainState.create: `trainable` must be a callable on leaves or a "
                    "pytree prefix of `model` with bools/callables at its leaves; "
                    f"it does not fit the model: {e}"
                ) from None
            mask = tuple(
                x is not missing and _is_inexact(x) for x in jax.tree.leaves(chosen)
            )
            if not any(mask):
                raise ValueError(
                    "TrainState.create: `trainable` selects no floating-point array "
                    "of the model; nothing would be trained."
                )
        resolved = None if parts is None else resolve_parts(model, parts, caller)
        optimizers = per_part(optimizer, part_names(resolved), caller)
        if resolved is None:
            params = eqx.filter(model, trainable_mask_tree(model, mask))
            opt_state = optimizers[None].init(params)
        else:
            opt_state = {
                name: optimizers[name].init(
                    eqx.filter(model, part_mask_tree(model, mask, leaves))
                )
                for name, leaves in resolved
            }
        return cls(
            model,
            opt_state,
            jnp.zeros((), jnp.int32),
            key,
            model_state=model_state,
            trainable=mask,
            parts=resolved,
        )

    def trainable_mask(self, part: str | None = None) -> Any:
        """A pytree of `model`'s structure: `True` at every trained leaf (of
        `part`; of any part where the state has parts)."""
        if self.parts is None:
            if part is not None:
                raise ValueError(
                    f"TrainState: part {part!r} is asked for, but this state has no "
                    "parts (create it with `parts=`)."
                )
            return trainable_mask_tree(self.model, self.trainable)
        leaves = (
            in_any_part(self.parts)
            if part is None
            else part_leaves(self.parts, part, "TrainState")
        )
        return part_mask_tree(self.model, self.trainable, leaves)

    def params(self, part: str | None = None) -> Any:
        """The trained leaves of `model` (of `part`), `None` elsewhere: what the
        optimizer state (of `part`) belongs to."""
        return eqx.filter(self.model, self.trainable_mask(part))


def as_optimizer(optimizer: Any, caller: str) -> optax.GradientTransformation:
    """`optimizer` as an `optax.GradientTransformation`, or a `TypeError` unless it
    follows Optax's convention: `init(params)` and `update(updates, state,
    params)` (e.g. `optax.MultiSteps`, which is not a `GradientTransformation`)."""
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if not (
        callable(getattr(optimizer, "init", None))
        and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            f"{caller}: `optimizer` must be an Optax gradient transformation (an "
            "object with `init(params)` and `update(updates, state, params)`, e.g. "
            f"optax.adamw(1e-3) or optax.MultiSteps(...)); got "
            f"{type(optimizer).__name__} {optimizer!r}."
        )
    return optax.GradientTransformationExtraArgs(optimizer.init, optimizer.update)


def per_part(
    optimizer: Any, names: tuple[str, ...], caller: str
) -> dict[str | None, optax.GradientTransformation]:
    """The optimizer (under `None`), or with parts `names` the dict of one per
    part, each checked (`as_optimizer`); a `TypeError` naming the mismatch."""
    if not names:
        if isinstance(optimizer, Mapping):
            raise TypeError(
                f"{caller}: `optimizer` is a dict ({list(optimizer)}) but no parts "
                "are given; pass `parts={name: where, ...}` with the same names, "
                "or one optimizer."
            )
        return {None: as_optimizer(optimizer, caller)}
    if not isinstance(optimizer, Mapping) or set(optimizer) != set(names):
        got = list(optimizer) if isinstance(optimizer, Mapping) else type(optimizer)
        raise TypeError(
            f"{caller}: with parts {list(names)}, `optimizer` must be a dict of one "
            f"optimizer per part, with the same names; got {got}."
        )
    return {name: as_optimizer(optimizer[name], caller) for name in names}


def part_mask_tree(
    model: Any, trainable: tuple[bool, ...] | None, leaves: tuple[bool, ...]
) -> Any:
    """A pytree of `model`'s structure: `True` at the trained leaves that
    `leaves` (one bool per leaf) holds."""
    mask = jax.tree.leaves(trainable_mask_tree(model, trainable))
    return jax.tree.unflatten(
        jax.tree.structure(model),
        [m and p for m, p in zip(mask, leaves, strict=True)],
    )


def trainable_mask_tree(model: Any, trainable: tuple[bool, ...] | None) -> Any:
    """A pytree of `model`'s structure: `True` at every leaf `trainable` (a
    `TrainState.trainable`) trains."""
    leaves, treedef = jax.tree.flatten(model)
    if trainable is None:
        return jax.tree.unflatten(treedef, [_is_inexact(x) for x in leaves])
    if len(trainable) != len(leaves):
        raise ValueError(
            f"TrainState: `trainable` has {len(trainable)} entries but the model has "
            f"{len(leaves)} leaves; the model's structure changed since "
            "TrainState.create. Build the state again with TrainState.create."
        )
    mask = [t and _is_inexact(x) for t, x in zip(trainable, leaves, strict=True)]
    return jax.tree.unflatten(treedef, mask)


def check_train_state(state: Any, caller: str) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(
            f"{caller}: `state` must be an eqxdist.TrainState (see "
            f"TrainState.create); got {type(state).__name__}."
        )
