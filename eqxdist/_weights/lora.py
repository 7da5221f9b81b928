"""LoRA: low-rank adapters on a model's `eqx.nn.Linear`s (`lora`, `LoRALinear`),
the filter that trains only them (`lora_trainable`) and their merge back into
plain Linears (`merge_lora`)."""

import math
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._layout.stack_options import with_layers
from .._layout.stacked import Stacked
from .names import dotted


class LoRALinear(eqx.Module):
    """An `eqx.nn.Linear` with a low-rank adapter: `y = weight @ x + bias +
    scale * lora_b @ (lora_a @ x)`.

    It has the Linear's fields (`weight` `(out_features, in_features)`, `bias`,
    `in_features`, `out_features`, `use_bias`) plus `lora_a` `(rank,
    in_features)`, `lora_b` `(out_features, rank)` and the static `scale =
    alpha / rank`. Made by `ed.lora` (inside an `ed.Stacked` its leaves carry the
    layer axis first); `ed.merge_lora` turns it back into a Linear.
    """

    weight: Array
    bias: Array | None
    lora_a: Array
    lora_b: Array
    in_features: int | str = eqx.field(static=True)
    out_features: int | str = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    scale: float = eqx.field(static=True)

    def __init__(
        self,
        linear: eqx.nn.Linear,
        *,
        rank: int,
        key: Array,
        alpha: float | int | None = None,
    ) -> None:
        """**Arguments:**

        - `linear`: the `eqx.nn.Linear` to adapt (its leaves may carry leading
          axes, e.g. a `Stacked`'s layer axis: the adapters get them too).
        - `rank`: the adapters' rank.
        - `key`: for `lora_a`, uniform in `±1/sqrt(in_features)` (as
          `eqx.nn.Linear` and PEFT initialise); `lora_b` is zeros, so the
          output is the Linear's.
        - `alpha`: `scale = alpha / rank`; `None` means `rank` (scale 1).
        """
        check_rank_alpha(rank, alpha, "LoRALinear")
        weight = linear.weight
        lead, (out, inp) = weight.shape[:-2], weight.shape[-2:]
        bound = 1 / math.sqrt(inp)
        self.weight = weight
        self.bias = linear.bias
        self.lora_a = jax.random.uniform(
            key, (*lead, rank, inp), weight.dtype, -bound, bound
        )
        self.lora_b = jnp.zeros((*lead, out, rank), weight.dtype)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.use_bias = linear.use_bias
        self.scale = float(rank if alpha is None else alpha) / rank

    def __call__(self, x: Array, *, key: Array | None = None) -> Array:
        """`x` of shape `(in_features,)` (or `()` for `"scalar"`), as
        `eqx.nn.Linear`; `key` is ignored."""
        if self.in_features == "scalar":
            x = jnp.broadcast_to(x, (1,))
        y = self.weight @ x
        if self.bias is not None:
            y = y + self.bias
        y = y + self.scale * (self.lora_b @ (self.lora_a @ x))
        if self.out_features == "scalar":
            y = jnp.squeeze(y, -1)
        return y


def check_rank_alpha(rank: Any, alpha: Any, caller: str) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{caller}: `rank` must be an int >= 1; got {rank!r}.")
    if alpha is not None and (
        isinstance(alpha, bool) or not isinstance(alpha, int | float)
    ):
        raise TypeError(f"{caller}: `alpha` must be a number or None; got {alpha!r}.")


def _selector(where: Any) -> Callable[[str, Any], bool]:
    if callable(where):
        return lambda name, linear: bool(where(name, linear))
    if not isinstance(where, str):
        raise TypeError(
            "lora: `where` must be a regular expression (searched in a Linear's "
            "name, e.g. 'layers.wq' inside a Stacked) or a callable (name, "
            f"linear) -> bool; got {where!r}."
        )
    try:
        pattern = re.compile(where)
    except re.error as e:
        raise ValueError(
            f"lora: `where`={where!r} is not a valid regex: {e}."
        ) from None
    return lambda name, linear: pattern.search(name) is not None


def _is_node(x: Any) -> bool:
    return isinstance(x, Stacked | eqx.nn.Linear)


def _is_linear(x: Any) -> bool:
    return isinstance(x, eqx.nn.Linear)


def lora(
    model: Any,
    *,
    rank: int,
    where: str | Callable[[str, Any], bool],
    key: Array,
    alpha: float | int | None = None,
) -> Any:
    """`model` with every `eqx.nn.Linear` that `where` selects made an
    `ed.LoRALinear` (`lora_a` random, `lora_b` zeros, `scale = alpha / rank`):
    at creation the model computes what it computed before.

    **Arguments:**

    - `model`: any pytree holding `eqx.nn.Linear`s.
    - `rank`: the adapters' rank.
    - `where`: a regular expression searched (`re.search`) in each Linear's
      name, its default tensor name without `.weight` (`blocks.3.lin`, and
      inside an `ed.Stacked` without the layer index: `layers.wq`); or a
      callable `(name, linear) -> bool` given the same name.
    - `key`: the adapters' randomness (one key folded per Linear).
    - `alpha`: `scale = alpha / rank`; `None` means `rank`.

    Inside an `ed.Stacked` every layer gets its own adapters (leaves with the
    layer axis). Train only the adapters with `TrainState.create(...,
    trainable=ed.lora_trainable(model))`; a `param_rules` rule for a wrapped
    Linear's `weight` places its adapters too.

    **Raises:**

    `ValueError` when `where` selects no Linear, or for a `rank` below 1;
    `TypeError` for a `where` that is neither a string nor a callable.

    !!! Example

        ```python
        model = ed.lora(model, rank=8, where=r"layers\\.(wq|wv)$", key=key)
        state = ed.TrainState.create(model, optax.adam(1e-3), key,
                                     trainable=ed.lora_trainable(model))
        ```
    """
    check_rank_alpha(rank, alpha, "lora")
    select = _selector(where)
    count = [0]
    names: list[str] = []

    def adapt(name: str, linear: eqx.nn.Linear) -> Any:
        names.append(name)
        if not select(name, linear):
            return linear
        count[0] += 1
        sub = jax.random.fold_in(key, count[0])
        return LoRALinear(linear, rank=rank, key=sub, alpha=alpha)

    flat, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_node)
    nodes = []
    for path, node in flat:
        if isinstance(node, eqx.nn.Linear):
            nodes.append(adapt(dotted(path), node))
        elif isinstance(node, Stacked):
            inner, inner_def = jax.tree_util.tree_flatten_with_path(
                node.layers, is_leaf=_is_linear
            )
            layers = [
                adapt(".".join(filter(None, (dotted(path), dotted(p)))), x)
                if _is_linear(x)
                else x
                for p, x in inner
            ]
            nodes.append(with_layers(node, jax.tree.unflatten(inner_def, layers)))
        else:
            nodes.append(node)
    if not count[0]:
        raise ValueError(
            f"lora: `where`={where!r} selects no eqx.nn.Linear of the model; its "
            f"Linears are named {names[:8] or 'nothing (it has none)'}."
        )
    return jax.tree.unflatten(treedef, nodes)


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoRALinear)


def lora_trainable(model: Any) -> Any:
    """The `trainable` filter of `TrainState.create` that trains exactly the
    adapters (`lora_a`, `lora_b`) of `model`'s `ed.LoRALinear`s: a pytree of
    the model's structure, `True` at those leaves and `False` everywhere else,
    so the frozen base gets no optimizer state."""

    def mark(x: Any) -> Any:
        frozen = jax.tree.map(lambda _: False, x)
        if not _is_lora(x):
            return frozen
        return eqx.tree_at(lambda m: (m.lora_a, m.lora_b), frozen, (True, True))

    return jax.tree.map(mark, model, is_leaf=_is_lora)


def merge_lora(model: Any) -> Any:
    """`model` with every `ed.LoRALinear` back to an `eqx.nn.Linear` whose weight
    is `weight + scale * lora_b @ lora_a` (in the weight's dtype; layer by
    layer inside an `ed.Stacked`)."""

    def merge(x: Any) -> Any:
        if not _is_lora(x):
            return x
        delta = jnp.matmul(x.lora_b, x.lora_a) * x.scale
        weight = (x.weight + delta).astype(x.weight.dtype)
        template = eqx.filter_eval_shape(
            eqx.nn.Linear,
            x.in_features,
            x.out_features,
            x.use_bias,
            dtype=x.weight.dtype,
            key=jax.random.key(0),
        )
        return eqx.tree_at(
            lambda m: (m.weight, m.bias),
            template,
            (weight, x.bias),
            is_leaf=lambda v: v is None,
        )

    def node(x: Any) -> Any:
        if isinstance(x, Stacked):  # its static shapes change with its leaves
            return with_layers(x, jax.tree.map(merge, x.layers, is_leaf=_is_lora))
        return merge(x)

    return jax.tree.map(node, model, is_leaf=lambda x: _is_lora(x) or _is_stacked(x))


def _is_stacked(x: Any) -> bool:
    return isinstance(x, Stacked)
