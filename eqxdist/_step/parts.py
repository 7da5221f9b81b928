"""Parts of a model with optimizers of their own (`TrainState.create(...,
parts=...)`, `make_train_step(..., part=...)`): a GAN's generator and
discriminator, an actor and a critic, a teacher and a student.

A part is named by a function `where(model)` returning a sub-pytree of the
model, as `eqx.tree_at` takes it; the state keeps, per part, one bool per leaf
of the model. Parts are disjoint; a leaf in no part is never trained."""

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax

PartMasks = tuple[tuple[str, tuple[bool, ...]], ...]
"""Per part name, one bool per leaf of `jax.tree.leaves(model)`: `True` in the
part. The form a `TrainState` keeps (a static, hashable field)."""


def resolve_parts(
    model: Any, parts: Mapping[str, Callable[[Any], Any]], caller: str
) -> PartMasks:
    """The leaf masks of `parts` (`{name: where}`), or a `ValueError` naming the
    part: a `where` that does not select a sub-pytree of `model`, a part with no
    array, two parts sharing a leaf."""
    if not parts:
        raise ValueError(f"{caller}: `parts` is empty; name at least one part.")
    leaves = jax.tree.leaves(model)
    masks: list[tuple[str, tuple[bool, ...]]] = []
    owner: dict[int, str] = {}
    for name, where in parts.items():
        if not isinstance(name, str) or not callable(where):
            raise TypeError(
                f"{caller}: `parts` maps names to functions `where(model)` (as "
                f"`eqx.tree_at` takes them); got {name!r}: {where!r}."
            )
        mask = _leaf_mask(model, where, name, caller)
        if not any(m and eqx.is_array(x) for m, x in zip(mask, leaves, strict=True)):
            raise ValueError(
                f"{caller}: part {name!r} holds no array of the model; its `where` "
                "must select the part's layers (e.g. `lambda m: m.generator`)."
            )
        for i, m in enumerate(mask):
            if m and i in owner:
                raise ValueError(
                    f"{caller}: parts {owner[i]!r} and {name!r} overlap (both hold "
                    f"leaf {i} of the model); parts must be disjoint."
                )
            if m:
                owner[i] = name
        masks.append((name, mask))
    return tuple(masks)


def _leaf_mask(
    model: Any, where: Callable[[Any], Any], name: str, caller: str
) -> tuple[bool, ...]:
    falses = jax.tree.map(lambda _: False, model)
    try:
        chosen = where(falses)
        marked = eqx.tree_at(
            where, falses, replace=jax.tree.map(lambda _: True, chosen)
        )
    except Exception as e:  # whatever `where` raises on the model
        raise ValueError(
            f"{caller}: part {name!r}: `where` does not select a sub-pytree of the "
            f"model ({type(e).__name__}: {e}); write it as for `eqx.tree_at`, e.g. "
            "`lambda model: model.generator`."
        ) from None
    return tuple(bool(x) for x in jax.tree.leaves(marked))


def part_names(parts: PartMasks | None) -> tuple[str, ...]:
    return () if parts is None else tuple(name for name, _ in parts)


def part_leaves(parts: PartMasks, name: str, caller: str) -> tuple[bool, ...]:
    """The leaf mask of part `name`, or a `ValueError` naming the parts there
    are."""
    for part, mask in parts:
        if part == name:
            return mask
    raise ValueError(
        f"{caller}: part {name!r} is not a part of this state; its parts are "
        f"{list(part_names(parts))}."
    )


def in_any_part(parts: PartMasks) -> tuple[bool, ...]:
    """One bool per leaf: `True` in some part."""
    return tuple(any(bits) for bits in zip(*(mask for _, mask in parts), strict=True))
