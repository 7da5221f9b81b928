"""Plain checks of the public functions' arguments, run before the jaxtyping
annotations are checked: a mistake users make (a batch where one sequence goes, a
head's weight transposed, float labels) gets a few lines naming the argument, the
shape or dtype expected, the one seen and the fix, where jaxtyping would print every
parameter and annotation of the call."""

import functools
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def checked_first(check: Callable[..., None]) -> Callable[[_F], _F]:
    """Decorate a (type-checked) function so that `check(*args, **kwargs)` runs
    first, on the same arguments. Put it above `@typecheck` (jaxtyping's import
    hook adds its own checks below every decorator, so those run after it too)."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            check(*args, **kwargs)
            return fn(*args, **kwargs)

        return checked  # type: ignore[return-value]

    return decorate


def shape_and_dtype(x: Any, caller: str, name: str) -> tuple[tuple[int, ...], Any]:
    """`x`'s shape and dtype, or a `TypeError` naming `caller` and the argument
    `name` when `x` is not an array."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if not isinstance(shape, tuple) or dtype is None:
        raise TypeError(
            f"{caller}: `{name}` is a {type(x).__name__}, not an array; pass a JAX "
            "or NumPy array (`jnp.asarray(...)`)."
        )
    return shape, dtype
