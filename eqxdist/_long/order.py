"""The balanced (head-tail) order of a sequence sharded over a context axis, and
each device's positions in it.

The sequence is cut into `2 * cp` equal chunks; device `i` of the `cp` devices of
the axis holds chunks `i` and `2 * cp - 1 - i`, in that order. Under a causal mask a
query sees every key before it, so an early chunk has little to do and a late one
much: pairing them gives every device the same number of (query, key) pairs.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Shaped

from .._utils import typecheck
from .views import check_bound


def _check_order_args(length: int, context_size: int, caller: str) -> None:
    if isinstance(context_size, bool) or context_size < 1:
        raise ValueError(
            f"{caller}: `context_size` must be the number of devices of the context "
            f"axis, an int >= 1; got {context_size!r}."
        )
    if length % (2 * context_size):
        raise ValueError(
            f"{caller}: the sequence has length {length}, which is not divisible by "
            f"2 * context_size = {2 * context_size} (the balanced order cuts it into "
            f"2 chunks per device); pad or crop it to a multiple of "
            f"{2 * context_size}."
        )


def _module(x: Any) -> Any:
    """NumPy for NumPy arrays (a loader's host batches stay on the host), else
    `jax.numpy`."""
    return np if isinstance(x, np.ndarray) else jnp


@typecheck
def to_context_order(
    x: Shaped[Array, "..."] | Shaped[np.ndarray, "..."],
    context_size: int,
    *,
    axis: int = 0,
) -> Shaped[Array, "..."] | Shaped[np.ndarray, "..."]:
    """Put a sequence into the balanced order that context parallelism shards:
    split along `axis` into `context_size` equal blocks, block `i` holds the
    sequence's chunks `i` and `2 * context_size - 1 - i` of `2 * context_size`.

    Sharding the result evenly over the context axis (`P(..., "context")` at
    `axis`) gives each device the same causal work in `ed.attention`;
    `from_context_order` undoes it. `ed.attention` in the global view does both
    itself: use these for what goes into a device view (token batches, targets,
    masks), or to read a device view's outputs back in the natural order.

    **Arguments:**

    - `x`: a JAX or NumPy array (a NumPy array stays one: host batches are
      reordered on the host).
    - `context_size`: the number of devices of the context axis.
    - `axis`: the sequence dimension of `x` (`1` for a `(batch, length)` batch).

    **Returns:**

    `x` reordered along `axis`, of the same shape and kind.

    **Raises:**

    `ValueError` if `context_size < 1` or the length along `axis` is not divisible
    by `2 * context_size`.

    !!! Example

        ```python
        ed.to_context_order(np.arange(8), 2)  # [0 1 6 7 2 3 4 5]
        # device 0 holds [0 1 6 7], device 1 [2 3 4 5]
        ```
    """
    xp = _module(x)
    axis = axis % x.ndim
    length = x.shape[axis]
    _check_order_args(length, context_size, "to_context_order")
    chunk = length // (2 * context_size)
    shape = x.shape
    # (2, cp, chunk): the first cp chunks, and the last cp reversed, interleaved.
    blocks = x.reshape(*shape[:axis], 2, context_size, chunk, *shape[axis + 1 :])
    early = xp.take(blocks, 0, axis=axis)
    late = xp.flip(xp.take(blocks, 1, axis=axis), axis=axis)
    ordered: Array | np.ndarray = xp.stack([early, late], axis=axis + 1)
    return ordered.reshape(shape)


@typecheck
def from_context_order(
    x: Shaped[Array, "..."] | Shaped[np.ndarray, "..."],
    context_size: int,
    *,
    axis: int = 0,
) -> Shaped[Array, "..."] | Shaped[np.ndarray, "..."]:
    """Undo `to_context_order`: a sequence in the balanced order back in its natural
    order. Arguments, result and errors as `to_context_order`'s.

    !!! Example

        ```python
        ed.from_context_order(np.array([0, 1, 6, 7, 2, 3, 4, 5]), 2)  # [0 1 ... 7]
        ```
    """
    xp = _module(x)
    axis = axis % x.ndim
    length = x.shape[axis]
    _check_order_args(length, context_size, "from_context_order")
    chunk = length // (2 * context_size)
    shape = x.shape
    pairs = x.reshape(*shape[:axis], context_size, 2, chunk, *shape[axis + 1 :])
    early = xp.take(pairs, 0, axis=axis + 1)
    late = xp.flip(xp.take(pairs, 1, axis=axis + 1), axis=axis)
    natural: Array | np.ndarray = xp.concatenate([early, late], axis=axis)
    return natural.reshape(shape)


@typecheck
def context_positions(local_length: int, context_axis: str) -> Int[Array, " L"]:
    """The index in the whole sequence of each of this device's `local_length`
    positions, when the sequence is sharded over `context_axis` in the balanced
    order (`to_context_order`; what `ed.attention` expects in the device view).

    Call it in the device view (inside `jax.shard_map`, `context_axis` bound): for
    position embeddings (`embed[positions]`), rotary phases and masks of a
    device's chunk. In the global view the positions are `jnp.arange(length)`.

    **Arguments:**

    - `local_length`: the length of this device's chunk (even: it holds two
      halves of equal length).
    - `context_axis`: the mesh axis the sequence is sharded over.

    **Returns:**

    An int32 array of shape `(local_length,)`: on device `i` of `cp`, the
    positions `i * h ... (i + 1) * h - 1` then `(2 cp - 1 - i) * h ... (2 cp - i) *
    h - 1`, for `h = local_length // 2`.

    **Raises:**

    `ValueError` if `local_length` is odd or below 2, or `context_axis` is not bound
    (called outside `jax.shard_map`).

    !!! Example

        ```python
        def embed(tokens):  # this device's (local_length,) tokens
            positions = ed.context_positions(tokens.shape[0], "context")
            return token_embedding[tokens] + position_embedding[positions]
        ```
    """
    caller = "context_positions"
    if isinstance(local_length, bool) or local_length < 2 or local_length % 2:
        raise ValueError(
            f"{caller}: `local_length` must be even and >= 2 (a device holds two "
            f"halves of equal length of the sequence); got {local_length!r}. Make "
            "the sequence length a multiple of 2 * (devices of the context axis)."
        )
    check_bound(context_axis, caller, "context_axis")
    size = jax.lax.axis_size(context_axis)
    return balanced_positions(local_length, jax.lax.axis_index(context_axis), size)


def balanced_positions(local_length: int, device: Any, size: int) -> Array:
    """The positions in the whole sequence of the `local_length` positions that
    device `device` (an int or a traced index) of `size` holds in the balanced
    order: chunks `device` and `2 size - 1 - device` of `2 size`."""
    half = local_length // 2
    steps = jnp.arange(half, dtype=jnp.int32)
    early = device * half + steps
    late = (2 * size - 1 - device) * half + steps
    return jnp.concatenate([early, late]).astype(jnp.int32)


def _destination(chunk: int, size: int) -> int:
    """The device that holds `chunk` (of `2 * size`) in the balanced order."""
    return chunk if chunk < size else 2 * size - 1 - chunk


def balance(x: Shaped[Array, "L ..."], axis: str) -> Shaped[Array, "L ..."]:
    """In the device view of `axis`: this device's block of a sequence sharded in
    its natural order (chunks `2 i` and `2 i + 1` of `2 cp`) becomes its block of
    the balanced order (chunks `i` and `2 cp - 1 - i`): two `ppermute`s of half
    a block, whose transposes are `ppermute`s again (XLA's partitioner, asked
    for the same reorder on whole arrays, gathers the gradients instead)."""
    size = jax.lax.axis_size(axis)
    if size == 1:
        return x
    half = x.shape[0] // 2
    even = jax.lax.ppermute(
        x[:half], axis, [(d, _destination(2 * d, size)) for d in range(size)]
    )
    odd = jax.lax.ppermute(
        x[half:], axis, [(d, _destination(2 * d + 1, size)) for d in range(size)]
    )
    # Device j holds chunks j and 2 cp - 1 - j, one even and one odd.
    j_is_even = jax.lax.axis_index(axis) % 2 == 0
    early, late = jnp.where(j_is_even, even, odd), jnp.where(j_is_even, odd, even)
    return jnp.concatenate([early, late])


def unbalance(x: Shaped[Array, "L ..."], axis: str) -> Shaped[Array, "L ..."]:
    """The inverse of `balance`: this device's block of the balanced order back to
    its block of the natural order."""
    size = jax.lax.axis_size(axis)
    if size == 1:
        return x
    half = x.shape[0] // 2
    j_is_even = jax.lax.axis_index(axis) % 2 == 0
    early, late = x[:half], x[half:]
    even = jnp.where(j_is_even, early, late)
    odd = jnp.where(j_is_even, late, early)
    first = jax.lax.ppermute(
        even, axis, [(_destination(2 * d, size), d) for d in range(size)]
    )
    second = jax.lax.ppermute(
        odd, axis, [(_destination(2 * d + 1, size), d) for d in range(size)]
    )
    return jnp.concatenate([first, second])
