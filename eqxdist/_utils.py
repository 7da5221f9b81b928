"""Small helpers shared by every module: type checking, pytree walking, axis checks."""

from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import equinox as eqx
import jax
import numpy as np
from beartype import beartype
from jaxtyping import jaxtyped

_F = TypeVar("_F", bound=Callable[..., Any])

AxisName: TypeAlias = str | tuple[str, ...]
"""A mesh axis name, or a tuple of names to act over several axes at once."""


def typecheck(fn: _F) -> _F:
    """Check `fn`'s annotations (jaxtyping shapes/dtypes too) with beartype on every
    call. A mismatch raises `jaxtyping.TypeCheckError`, a `TypeError` whose message
    names the parameter, the value seen and the type expected."""
    checked: _F = jaxtyped(typechecker=beartype)(fn)
    return checked


def is_array(x: Any) -> bool:
    """`jax.Array`, `np.ndarray` and NumPy scalars: the leaves our functions act on."""
    return eqx.is_array(x)


def is_array_like(x: Any) -> bool:
    """An array leaf, concrete or abstract (`jax.ShapeDtypeStruct`, e.g. from
    `eqx.filter_eval_shape`): what layouts and restore targets are computed from."""
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def map_arrays(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply `fn` to every array leaf of `tree`; every other leaf is kept as it is."""
    return jax.tree.map(lambda x: fn(x) if is_array(x) else x, tree)


def map_arrays_with_path(fn: Callable[[str, Any], Any], tree: Any) -> Any:
    """Like `map_arrays`, but `fn` also gets the leaf's path (for error messages)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(path_str(path), x) if is_array(x) else x, tree
    )


def path_str(path: tuple[Any, ...]) -> str:
    """A readable pytree path: `['params']['w']`, or `<root>` for the tree itself."""
    return jax.tree_util.keystr(path) or "<root>"


def axis_names(axis_name: AxisName) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def check_axis_bound(
    axis_name: AxisName, caller: str, *, has_global_mode: bool = False
) -> tuple[str, ...]:
    """Raise a `ValueError` telling the user what to do if `axis_name` is not bound.

    A collective (`psum`, `all_gather`, `axis_index`, ...) only means something inside
    `jax.shard_map` (or `vmap` with that `axis_name`); outside it JAX raises a bare
    `NameError`. `has_global_mode`: the caller also accepts `axis_name=None`, so the
    message offers it. Returns the names as a tuple."""
    names = axis_names(axis_name)
    if not names:
        raise ValueError(f"{caller}: `axis_name` is an empty tuple; name a mesh axis.")
    for name in names:
        try:
            jax.lax.axis_size(name)
        except NameError:
            alternative = (
                ", or pass `axis_name=None` to reduce global (sharded) arrays instead"
                if has_global_mode
                else ""
            )
            raise ValueError(
                f"{caller}: mesh axis {name!r} is not bound here. Call it inside "
                f"`jax.shard_map` over a mesh that has an axis {name!r}{alternative}."
            ) from None
    return names


def axis_size(names: tuple[str, ...]) -> int:
    """Number of devices along the (bound) axes `names`."""
    return int(np.prod([jax.lax.axis_size(n) for n in names]))
