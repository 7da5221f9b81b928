"""Building an `ed.Stacked` from its blocks: their array leaves stacked on a
leading layer axis, and the error naming the first static field (or structure)
where a block differs from the first."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._utils import is_array


def stack_blocks(blocks: Sequence[Any]) -> Any:
    if len(blocks) == 0:
        raise ValueError("Stacked: `blocks` is empty; pass at least one block.")
    first_def = jax.tree.structure(blocks[0])
    first = jax.tree.leaves(blocks[0])
    for i, block in enumerate(blocks[1:], start=1):
        leaves, treedef = jax.tree.flatten(block)
        if treedef != first_def:  # type: ignore[operator]
            raise ValueError(structure_error(blocks[0], block, i))
        for a, b in zip(first, leaves, strict=True):
            if is_array(a) != is_array(b) or (
                is_array(a) and (a.shape != b.shape or a.dtype != b.dtype)
            ):
                raise ValueError(
                    f"Stacked: `blocks[{i}]` has a leaf of shape/dtype "
                    f"{getattr(b, 'shape', b)} {getattr(b, 'dtype', '')} where "
                    f"`blocks[0]` has {getattr(a, 'shape', a)} "
                    f"{getattr(a, 'dtype', '')}; expected identical blocks."
                )
    return jax.tree.map(
        lambda *xs: jnp.stack(xs) if is_array(xs[0]) else xs[0], *blocks
    )


def structure_error(first: Any, block: Any, i: int) -> str:
    """What `_stack` says of `blocks[i]`, whose structure differs from
    `blocks[0]`'s: the first field (path) where they part, and its two values."""
    found = _first_difference(first, block, "")
    if found is None:
        return (
            f"Stacked: `blocks[{i}]` has a different structure from `blocks[0]`; "
            f"expected identical blocks. Got {jax.tree.structure(block)} and "
            f"{jax.tree.structure(first)}."
        )
    path, a, b = found
    if type(a) is not type(b) and not _plain(a) and not _plain(b):
        return (
            f"Stacked: `blocks[{i}]{path}` is {_a(_type_name(b))} where "
            f"`blocks[0]{path}` is {_a(_type_name(a))}; the blocks of a Stacked "
            "are one type of module (one block's program runs every layer). Stack "
            "blocks of one type, or keep blocks of several types in a list."
        )
    return (
        f"Stacked: `blocks[{i}]{path}` is {_brief(b)} where `blocks[0]{path}` is "
        f"{_brief(a)}; the blocks of a Stacked share every field that is not an "
        "array (one block's program runs every layer). Make the field equal in "
        "every block, or hold it as an array (one value per layer), or keep the "
        "blocks in a list."
    )


def _plain(x: Any) -> bool:
    """A value whose repr is short and says what it is (numbers, strings, ...)."""
    return x is None or isinstance(x, bool | int | float | complex | str | bytes)


def _type_name(x: Any) -> str:
    kind = type(x)
    return kind.__name__ if kind.__module__ == "builtins" else kind.__qualname__


def _a(name: str) -> str:
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _brief(x: Any, width: int = 60) -> str:
    """`repr(x)`, or for an array its shape, for a long repr (a module, a
    function) its type name."""
    if is_array(x):
        return f"an array of shape {tuple(x.shape)}"
    text = repr(x)
    if len(text) <= width and "\n" not in text:
        return text
    return _a(_type_name(x))


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first path at which the pytrees `a` and `b` differ in structure (a
    static field's value, a type, a container's keys or length), with the two
    values there; `None` if none is found."""
    if type(a) is not type(b):
        return path, a, b
    if dataclasses.is_dataclass(a) and isinstance(a, eqx.Module):
        for field in dataclasses.fields(a):
            x, y = getattr(a, field.name, None), getattr(b, field.name, None)
            where = f"{path}.{field.name}"
            if field.metadata.get("static", False):
                if not _same(x, y):
                    return where, x, y
            elif (found := _first_difference(x, y, where)) is not None:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return path, a, b
        pairs: list[tuple[str, Any, Any]] = [
            (f"{path}[{k}]", x, y) for k, (x, y) in enumerate(zip(a, b, strict=True))
        ]
    elif isinstance(a, dict):
        if set(a) != set(b):
            return path, a, b
        pairs = [(f"{path}[{k!r}]", a[k], b[k]) for k in a]
    else:
        same = jax.tree.structure(a) == jax.tree.structure(b)  # type: ignore[operator]
        return None if same else (path, a, b)
    for where, x, y in pairs:
        if (found := _first_difference(x, y, where)) is not None:
            return found
    return None


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values whose `==` is not a bool (arrays)
        return a is b
