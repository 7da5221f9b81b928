"""Context parallelism: every batch leaf of rank >= 2 (a sequence in dimension 1)
split over a context axis as well as its rows over the data axes; the
parameters replicated over it; the loss and the gradients added up over it.

The one place that says which leaves are sequences: `is_sequence`."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from ..._long.order import balance
from ..._utils import is_array
from .base import Part, check_axis_keyword
from .tensor import check_rules_spare


def is_sequence(ndim: int) -> bool:
    """Whether a batch leaf of rank `ndim` is a sequence (in dimension 1), split
    over a context axis: rank >= 2. Rows and per-row values (rank 1) are not."""
    return ndim >= 2


@dataclasses.dataclass(frozen=True)
class ContextPart(Part):
    """The sequences over `axis` (of `size` devices). Build it with `parse`."""

    axis: str
    size: int

    @classmethod
    def parse(
        cls,
        caller: str,
        mesh: Mesh,
        context_axis: Any,
        taken: dict[str, str],
        param_rules: Sequence[tuple[str, P]],
    ) -> "ContextPart":
        """`context_axis` checked: one axis of `mesh`, none of the axes other
        parts have `taken` (`{axis: what it is}`), named by no rule."""
        check_axis_keyword(caller, mesh, context_axis, "context_axis")
        if context_axis in taken:
            raise ValueError(
                f"{caller}: `context_axis`={context_axis!r} is also "
                f"{taken[context_axis]}; rows are split over the data axes, "
                "sequences over the context axis: name different axes (e.g. "
                "jax.make_mesh((2, 4), ('data', 'context')))."
            )
        check_rules_spare(caller, param_rules, context_axis, "context axis")
        return cls(context_axis, int(mesh.shape[context_axis]))

    def roles(self, mesh: Mesh) -> dict[str, str]:
        return {self.axis: "context"}

    def manual_axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def reduce_axes(self) -> tuple[str, ...]:
        # A device's tokens are its rows' share of the sequence.
        return (self.axis,)

    def leaf_spec(self, ndim: int, spec: P) -> P:
        return P(*spec, self.axis) if is_sequence(ndim) else spec

    def device_batch(self, batch: Any) -> Any:
        """Each sequence of this device's block (sharded in the natural order)
        in the balanced order `ed.attention` computes on (`_long.order`; two
        `ppermute`s of half a block each)."""

        def balance_leaf(x: Any) -> Any:
            if not is_array(x) or not is_sequence(np.ndim(x)):
                return x
            return jnp.moveaxis(balance(jnp.moveaxis(x, 1, 0), self.axis), 0, 1)

        return jax.tree.map(balance_leaf, batch)

    def check_batch(self, batch: Any, caller: str) -> None:
        """Sequences must cut into 2 chunks per device (the balanced order)."""
        for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if (
                is_array(x)
                and is_sequence(np.ndim(x))
                and np.shape(x)[1] % (2 * self.size)
            ):
                raise ValueError(
                    f"{caller}: batch leaf {jax.tree_util.keystr(path)} has shape "
                    f"{np.shape(x)}; with context_axis={self.axis!r} its dimension "
                    f"1 (the sequence) is split into 2 chunks per device of that "
                    f"axis, so it must be a multiple of 2 x {self.size} = "
                    f"{2 * self.size}. Pad or crop the sequences; a leaf of rank >= 2 "
                    "that is not a sequence (e.g. an image) cannot be in a "
                    "context-parallel batch: flatten it or pass it per row."
                )
