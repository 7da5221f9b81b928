"""The options a train step sets on every `ed.Stacked` of a model
(`make_train_step(..., remat=..., unroll=...)`): one function, so that the step
changes a `Stacked`'s static fields without reaching into the class."""

import copy
from typing import Any

import jax

from .._utils import is_array_like
from .remat import LEGACY, UNSET
from .stacked import Stacked

_STACK_OPTIONS = {
    "remat": "says what the backward pass keeps of a Stacked's blocks. Hold the "
    "blocks in an ed.Stacked, or use jax.checkpoint in the model.",
    "unroll": "says whether a Stacked's blocks run as a scan or a Python loop; a "
    "model without one has no loop over its layers. Leave `unroll` out.",
}


def _is_stacked(x: Any) -> bool:
    return isinstance(x, Stacked)


def _with_options(stacked: Stacked, remat: Any, unroll: Any) -> Stacked:
    """`stacked` with another `remat` (normal form, `check_remat`; `UNSET`: its
    own) and `unroll` (`None`: its own). Only static fields change, so the
    layers are the same arrays."""
    new = copy.copy(stacked)
    if remat is not UNSET:
        object.__setattr__(new, "remat", remat)
        if remat not in (None, LEGACY, "full"):
            object.__setattr__(new, "prefetch", False)
    if unroll is not None:
        object.__setattr__(new, "unroll", unroll)
    return new


def with_stack_options(model: Any, remat: Any, unroll: Any, caller: str) -> Any:
    """`model` with every `Stacked` keeping what `remat` says (`UNSET`: its
    own) and unrolled as `unroll` says (`None`: as built): what
    `make_train_step(..., remat=..., unroll=...)` gives the loss. Neither
    given: `model` itself; a model without a `Stacked` is a `ValueError` (the
    option would do nothing)."""
    if remat is UNSET and unroll is None:
        return model
    stacks = [x for x in jax.tree.leaves(model, is_leaf=_is_stacked) if _is_stacked(x)]
    if not stacks:
        name, value = ("remat", remat) if remat is not UNSET else ("unroll", unroll)
        raise ValueError(
            f"{caller}: `{name}`={value!r} is given, but the model holds no "
            f"ed.Stacked; {name} {_STACK_OPTIONS[name]}"
        )
    return jax.tree.map(
        lambda x: _with_options(x, remat, unroll) if _is_stacked(x) else x,
        model,
        is_leaf=_is_stacked,
    )


def with_layers(stacked: Stacked, layers: Any) -> Stacked:
    """`stacked` holding `layers` (the same number of layers, e.g. its blocks with
    modules swapped in: `ed.lora`), its options kept."""
    new = copy.copy(stacked)
    object.__setattr__(new, "layers", layers)
    object.__setattr__(
        new,
        "shapes",
        tuple(tuple(x.shape) for x in jax.tree.leaves(layers) if is_array_like(x)),
    )
    return new
