"""The train state: the model, the optimizer state, the step counter, the key,
the model's own state and which leaves are trained."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PRNGKeyArray

from .._utils import is_array_like, strong_types, typecheck


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
    ) -> "TrainState":
        """A fresh state: `optimizer.init` on the trainable leaves of the model,
        step 0.

        **Arguments:**

        - `model`: any Equinox model (or pytree of parameters).
        - `optimizer`: an Optax gradient transformation, or any object with Optax's
          `init`/`update` (e.g. `optax.MultiSteps`).
        - `key`: the PRNG key every step derives its randomness from
          (`fold_in(key, step)`); it stays the same from step to step.
        - `model_state`: the model's non-trained state (e.g. from
          `eqx.nn.make_with_state`), or `None`.
        - `trainable`: a filter spec as `eqx.partition` takes it (a callable on
          leaves, or a pytree prefix of `model` of bools/callables) selecting the
          trained leaves; only floating-point arrays among them are trained.
          `None`: every floating-point array (`eqx.is_inexact_array`).

        **Raises:**

        `ValueError` if `trainable` does not fit the model's structure or selects
        no floating-point array.

        !!! Example

            ```python
            # Fine-tune the head only.
            trainable = jax.tree.map(lambda _: False, model)
            trainable = eqx.tree_at(lambda m: m.head, trainable, True)
            state = ed.TrainState.create(model, optax.adam(1e-3), key,
                                         trainable=trainable)
            ```
        """
        optimizer = as_optimizer(optimizer, "TrainState.create")
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
        params = eqx.filter(model, trainable_mask_tree(model, mask))
        return cls(
            model,
            optimizer.init(params),
            jnp.zeros((), jnp.int32),
            key,
            model_state=model_state,
            trainable=mask,
        )

    def trainable_mask(self) -> Any:
        """A pytree of `model`'s structure: `True` at every trained leaf."""
        return trainable_mask_tree(self.model, self.trainable)

    def params(self) -> Any:
        """The trained leaves of `model` (`None` elsewhere): what the optimizer
        state belongs to."""
        return eqx.filter(self.model, self.trainable_mask())


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
            f"{type(optimizer).__name__}."
        )
    return optax.GradientTransformationExtraArgs(optimizer.init, optimizer.update)


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
