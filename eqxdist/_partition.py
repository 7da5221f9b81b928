"""The FSDP sharding rule: which dimension of each parameter to split over devices.

Written once here and used by `shard_model_state(..., "shard")`, `shard_params`, the
`FSDP` wrapper, `Stacked` and the training steps, so every place agrees on the
layout. Modules that gather their own parameters (`FSDP`, `Stacked`) derive from
`SelfGathering`; `leaf_plan` asks them for their specs, so a train step needs no
knowledge of either.
"""

import abc
from typing import Any

import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from ._utils import check_min_weight_size, is_array_like, typecheck

LAYOUTS = ("largest", "leading")
"""The FSDP layouts: `"largest"` (the tutorial's rule: the largest divisible
dimension, ties to the later one) and `"leading"` (the first divisible dimension, so
every shard is one contiguous block of the row-major array)."""


def check_layout(layout: str, caller: str, argument: str = "layout") -> None:
    if layout not in LAYOUTS:
        raise ValueError(
            f"{caller}: `{argument}`={layout!r} is not a layout; expected one of "
            f"{LAYOUTS}."
        )


def leaf_spec(
    shape: tuple[int, ...],
    axis_size: int,
    axis_name: str,
    min_weight_size: int,
    *,
    prefer: str = "largest",
) -> P:
    """The FSDP rule for one array of `shape` (see `fsdp_specs`); `prefer` is the
    layout: `"largest"` or `"leading"` divisible dimension."""
    size = 1
    for d in shape:
        size *= d
    if size <= min_weight_size:
        return P()
    divisible = [(d, i) for i, d in enumerate(shape) if d % axis_size == 0]
    if not divisible:
        return P()
    if prefer == "leading":
        _, dim = divisible[0]
    else:
        _, dim = max(divisible)  # largest dimension; ties go to the later one
    return P(*[axis_name if i == dim else None for i in range(len(shape))])


@typecheck
def fsdp_specs(
    tree: PyTree[Any],
    axis_size: int,
    *,
    axis_name: str = "data",
    min_weight_size: int = 2**18,
    layout: str = "largest",
) -> PyTree[Any]:
    """The `PartitionSpec` FSDP gives each array leaf of `tree`.

    The rule (the UvA scaling tutorial's): a leaf with `size <= min_weight_size` is
    replicated (`P()`); otherwise its largest dimension that `axis_size` divides is
    sharded over `axis_name` (on a tie, the later dimension); if no dimension divides,
    it is replicated. Small leaves stay whole because splitting them saves little
    memory and costs a collective each.

    With `layout="leading"` the *first* divisible dimension is sharded instead. Each
    device's shard is then one contiguous block of the row-major array, so an
    all-gather delivers the full array as it is laid out in memory and a
    reduce-scatter reads contiguous blocks: no transposing copies around the
    collectives (an `eqx.nn.Linear` weight, stored `(out, in)`, is sharded on `out`).
    PyTorch's FSDP2 shards dimension 0 for the same reason. See the FSDP guide for
    measurements.

    **Arguments:**

    - `tree`: parameters, a whole model, an optimizer state or a `TrainState`; array
      leaves may be concrete or abstract (`jax.ShapeDtypeStruct`).
    - `axis_size`: the number of devices along `axis_name`.
    - `axis_name`: the mesh axis parameters are sharded over.
    - `min_weight_size`: leaves with at most this many elements are replicated.
    - `layout`: `"largest"` (the tutorial's rule, the default) or `"leading"`.

    **Returns:**

    A pytree of the structure of `tree`: a `PartitionSpec` with one entry per
    dimension (or `P()`) for each array leaf, `None` for every other leaf.

    **Raises:**

    `ValueError` for `axis_size < 1`, a negative `min_weight_size` or an unknown
    `layout`.

    !!! Example

        ```python
        ed.fsdp_specs({"w": jnp.zeros((784, 512)), "b": jnp.zeros(10)}, 8,
                      min_weight_size=16)
        # {"w": P("data", None), "b": P()}
        ed.fsdp_specs({"w": jnp.zeros((256, 512))}, 8, layout="leading")
        # {"w": P("data", None)}  (the tutorial's rule: P(None, "data"))
        ```
    """
    if axis_size < 1:
        raise ValueError(f"fsdp_specs: `axis_size` must be >= 1; got {axis_size}.")
    check_min_weight_size(min_weight_size, "fsdp_specs")
    check_layout(layout, "fsdp_specs")
    return jax.tree.map(
        lambda x: (
            leaf_spec(
                tuple(x.shape), axis_size, axis_name, min_weight_size, prefer=layout
            )
            if is_array_like(x)
            else None
        ),
        tree,
    )


class SelfGathering(eqx.Module):
    """A module that all-gathers its own parameters when called inside `shard_map`
    (`FSDP`, `Stacked`). An enclosing FSDP layout leaves its leaves to it: it
    gives their specs (`own_specs`) and does not gather them."""

    @abc.abstractmethod
    def own_specs(
        self, axis_size: int, axis_name: str, min_weight_size: int, layout: str
    ) -> list[P | None]:
        """The spec of each of `jax.tree.leaves(self)`, given the enclosing layout's
        settings (which a module with its own settings may ignore)."""


def _is_self_gathering(x: Any) -> bool:
    return isinstance(x, SelfGathering)


def leaf_plan(
    tree: Any,
    axis_size: int,
    axis_name: str,
    min_weight_size: int,
    *,
    layout: str = "largest",
) -> tuple[list[P | None], list[bool]]:
    """Per leaf of `jax.tree.leaves(tree)`: its FSDP spec, and whether it is gathered
    at this level (`False` inside nested `FSDP`/`Stacked` modules, which gather their
    own leaves and give their own specs)."""
    specs: list[P | None] = []
    own: list[bool] = []
    for part in jax.tree.leaves(tree, is_leaf=_is_self_gathering):
        if isinstance(part, SelfGathering):
            inner = part.own_specs(axis_size, axis_name, min_weight_size, layout)
            specs.extend(inner)
            own.extend([False] * len(inner))
        else:
            specs.append(
                leaf_spec(
                    tuple(part.shape),
                    axis_size,
                    axis_name,
                    min_weight_size,
                    prefer=layout,
                )
                if is_array_like(part)
                else None
            )
            own.append(True)
    return specs, own


def tree_specs(
    tree: Any,
    axis_size: int,
    axis_name: str,
    min_weight_size: int,
    *,
    layout: str = "largest",
) -> Any:
    """`fsdp_specs` of `tree`, except that `FSDP`/`Stacked` submodules give their own
    specs."""
    specs, _ = leaf_plan(tree, axis_size, axis_name, min_weight_size, layout=layout)
    return jax.tree.unflatten(jax.tree.structure(tree), specs)


def gather_specs(
    tree: Any,
    axis_size: int,
    axis_name: str,
    min_weight_size: int,
    *,
    layout: str = "largest",
) -> Any:
    """Like `tree_specs`, but `P()` inside `FSDP`/`Stacked` submodules: the specs
    with which to gather `tree` at the top, leaving nested modules to gather
    themselves."""
    specs, own = leaf_plan(tree, axis_size, axis_name, min_weight_size, layout=layout)
    top = [s if o or s is None else P() for s, o in zip(specs, own, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(tree), top)


def has_fsdp_modules(tree: Any) -> bool:
    """Whether `tree` holds an `FSDP` or `Stacked` module."""
    return any(
        isinstance(p, SelfGathering)
        for p in jax.tree.leaves(tree, is_leaf=_is_self_gathering)
    )
