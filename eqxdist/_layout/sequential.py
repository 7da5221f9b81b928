"""A chain of `FSDP` blocks whose all-gathers run one block ahead
(`FSDPSequential`)."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh
from jaxtyping import PyTree

from .._utils import axis_is_bound, check_mesh, is_array
from .fsdp import FSDP
from .rules import DEFAULT_LAYOUT


def _tie(module: Any, plan: list[int | None], x: Any) -> tuple[Any, Any]:
    """Pass `module`'s shards (the leaves `plan` gathers) and `x` through one
    optimization barrier: the shards' gather then waits for `x` to exist."""
    leaves, treedef = jax.tree.flatten(module)
    shards = [leaf for leaf, dim in zip(leaves, plan, strict=True) if dim is not None]
    arrays, static = eqx.partition(x, is_array)
    shards, arrays = jax.lax.optimization_barrier((shards, arrays))
    it = iter(shards)
    leaves = [
        leaf if dim is None else next(it)
        for leaf, dim in zip(leaves, plan, strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves), eqx.combine(arrays, static)


class FSDPSequential(eqx.Module):
    """A chain of `FSDP` blocks, `x -> blocks[-1](...blocks[0](x))`, whose
    all-gathers run one block ahead.

    Inside `jax.shard_map`, block `i + 1`'s all-gather is tied to block `i`'s
    *input* (through an optimization barrier) rather than to its output, so a
    GPU/TPU can gather the next block's parameters while this block computes; it
    cannot run further ahead, so at most two blocks' full parameters are alive in
    the forward pass (one with separate `FSDP` blocks). With `remat=True` the
    backward pass re-gathers each block's parameters as `FSDP` does. Under plain
    `jit`, or eagerly, the blocks are simply called in turn.

    It holds only `FSDP` modules, so training steps (`make_train_step(...,
    strategy="fsdp")`) and `partition_specs` treat it like nested `FSDP` blocks.

    !!! Example

        ```python
        body = ed.FSDPSequential(blocks, mesh, min_weight_size=2**16,
                                 layout="leading", remat=True)
        y = body(x)
        ```
    """

    blocks: tuple[FSDP, ...]
    prefetch: bool = eqx.field(static=True)

    def __init__(
        self,
        blocks: Sequence[Any],
        mesh: Mesh,
        *,
        axis_name: str = "data",
        min_weight_size: int = 2**18,
        remat: bool = False,
        layout: str = DEFAULT_LAYOUT,
        prefetch: bool = True,
    ) -> None:
        """**Arguments:**

        - `blocks`: the modules to chain, each called on the previous one's output;
          an `FSDP` block is kept as it is, any other is wrapped in `FSDP` with the
          settings below.
        - `mesh`, `axis_name`, `min_weight_size`, `remat`, `layout`: as for `FSDP`.
        - `prefetch`: gather one block ahead (`False`: as separate `FSDP` blocks).

        **Raises:**

        As `FSDP`; `ValueError` for an empty `blocks` or an `FSDP` block over
        another axis.
        """
        check_mesh(mesh, "FSDPSequential")
        if len(blocks) == 0:
            raise ValueError("FSDPSequential: `blocks` is empty; pass at least one.")
        wrapped = []
        for i, block in enumerate(blocks):
            if isinstance(block, FSDP):
                if block.axis_name != axis_name:
                    raise ValueError(
                        f"FSDPSequential: `blocks[{i}]` is an FSDP module over axis "
                        f"{block.axis_name!r}, but `axis_name`={axis_name!r}; use "
                        "one data axis."
                    )
                wrapped.append(block)
            else:
                wrapped.append(
                    FSDP(
                        block,
                        mesh,
                        axis_name=axis_name,
                        min_weight_size=min_weight_size,
                        remat=remat,
                        layout=layout,
                    )
                )
        self.blocks = tuple(wrapped)
        self.prefetch = prefetch

    def partition_specs(self) -> PyTree[Any]:
        """The `PartitionSpec` of every array leaf (see `FSDP.partition_specs`)."""
        return jax.tree.map(
            lambda b: b.partition_specs(),
            self,
            is_leaf=lambda x: isinstance(x, FSDP),
        )

    def __call__(self, x: Any) -> Any:
        """Run the blocks in turn on `x`."""
        axis = self.blocks[0].axis_name
        if not self.prefetch or not axis_is_bound(axis):
            for block in self.blocks:
                x = block(x)
            return x
        plans = [block._gather_plan() for block in self.blocks]
        modules = [block.module for block in self.blocks]
        if any(d is not None for d in plans[0]):
            modules[0], x = _tie(modules[0], plans[0], x)
        for i, block in enumerate(self.blocks):
            nxt = i + 1
            if nxt < len(modules) and any(d is not None for d in plans[nxt]):
                # Block i+1's shards wait for block i's input, not its output.
                modules[nxt], x = _tie(modules[nxt], plans[nxt], x)
            if all(d is None for d in plans[i]):
                x = modules[i](x)
            else:
                x = block._call_gathered(
                    modules[i], plans[i], (x,), {}, tie_to_inputs=False
                )
        return x
