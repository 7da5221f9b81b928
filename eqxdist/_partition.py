"""The FSDP sharding rule: which dimension of each parameter to split over devices.

Written once here and used by `shard_model_state(..., "shard")`, `shard_params`, the
`FSDP` wrapper and the training steps, so every place agrees on the layout.
"""

from typing import Any

import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from ._utils import check_min_weight_size, is_array_like, typecheck


def leaf_spec(
    shape: tuple[int, ...], axis_size: int, axis_name: str, min_weight_size: int
) -> P:
    """The FSDP rule for one array of `shape` (see `fsdp_specs`)."""
    size = 1
    for d in shape:
        size *= d
    if size <= min_weight_size:
        return P()
    divisible = [(d, i) for i, d in enumerate(shape) if d % axis_size == 0]
    if not divisible:
        return P()
    _, dim = max(divisible)  # largest dimension; ties go to the later one
    return P(*[axis_name if i == dim else None for i in range(len(shape))])


@typecheck
def fsdp_specs(
    tree: PyTree[Any],
    axis_size: int,
    *,
    axis_name: str = "data",
    min_weight_size: int = 2**18,
) -> PyTree[Any]:
    """The `PartitionSpec` FSDP gives each array leaf of `tree`.

    The rule (the UvA scaling tutorial's): a leaf with `size <= min_weight_size` is
    replicated (`P()`); otherwise its largest dimension that `axis_size` divides is
    sharded over `axis_name` (on a tie, the later dimension); if no dimension divides,
    it is replicated. Small leaves stay whole because splitting them saves little
    memory and costs a collective each.

    **Arguments:**

    - `tree`: parameters, a whole model, an optimizer state or a `TrainState`; array
      leaves may be concrete or abstract (`jax.ShapeDtypeStruct`).
    - `axis_size`: the number of devices along `axis_name`.
    - `axis_name`: the mesh axis parameters are sharded over.
    - `min_weight_size`: leaves with at most this many elements are replicated.

    **Returns:**

    A pytree of the structure of `tree`: a `PartitionSpec` with one entry per
    dimension (or `P()`) for each array leaf, `None` for every other leaf.

    !!! Example

        ```python
        ed.fsdp_specs({"w": jnp.zeros((784, 512)), "b": jnp.zeros(10)}, 8,
                      min_weight_size=16)
        # {"w": P("data", None), "b": P()}
        ```
    """
    if axis_size < 1:
        raise ValueError(f"fsdp_specs: `axis_size` must be >= 1; got {axis_size}.")
    check_min_weight_size(min_weight_size, "fsdp_specs")
    return jax.tree.map(
        lambda x: (
            leaf_spec(tuple(x.shape), axis_size, axis_name, min_weight_size)
            if is_array_like(x)
            else None
        ),
        tree,
    )
