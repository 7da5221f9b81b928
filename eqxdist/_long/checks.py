"""Plain checks of the public functions' arguments, run before the jaxtyping
annotations are checked: a mistake users make (a batch where one sequence goes, a
head's weight transposed, float labels) gets a few lines naming the argument, the
shape or dtype expected, the one seen and the fix, where jaxtyping would print every
parameter and annotation of the call."""

from typing import Any


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
