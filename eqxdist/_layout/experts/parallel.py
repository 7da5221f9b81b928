"""`ExpertParallel`: an `ed.MoE` as the loss sees it under
`ed.Layout(..., expert_axis=AXIS)`. The layer routes its tokens and knows its
experts (`MoE.route`, `MoE.experts`) and no mesh; this subclass, the layout's,
adds where the experts are (the axis, whether it splits the tokens, how the
gradient is taken) and sends the tokens to them (`dispatch.py`), as
torchtitan's expert-parallel style takes over a mixture-of-experts module that
knows nothing of it. A subclass, not a wrapper: the loss reads the same fields
and `isinstance(layer, ed.MoE)` holds, as it did unsharded."""

import dataclasses
from typing import Any, TypeVar

import equinox as eqx
import jax
from jaxtyping import Array, Float

from ..._experts.moe import MoE, expert_leaves, is_moe
from ..._long.views import view_of
from .dispatch import experts_device_view, experts_global_view

_M = TypeVar("_M")


class ExpertParallel(MoE):
    """An `MoE` with its experts sharded by expert over `axis`: the same
    layer (an `ed.MoE`, its fields and leaves the same, so a loss that reads
    them or asks `isinstance(layer, ed.MoE)` sees what it saw unsharded; in
    the device view `w_in`, `w_gate` and `w_out` are this device's block of the
    experts), called the same way, its call routing by the layer's own
    `route` and sending the tokens to their experts' devices.

    - `tokens_split`: whether `axis` holds different tokens on each device (a
      data axis, the usual case) or the same tokens (an axis of its own).
    - `whole_loss`: whether the axis is bound by a `shard_map` that JAX
      differentiates whole (the global view's pipeline): the experts' gradient
      is then the loss's, not the mean over the devices' losses."""

    axis: str = eqx.field(static=True, default="")
    tokens_split: bool = eqx.field(static=True, default=True)
    whole_loss: bool = eqx.field(static=True, default=False)

    def __init__(
        self,
        moe: MoE,
        axis: str,
        tokens_split: bool = True,
        whole_loss: bool = False,
    ):
        # The layer's fields as they are (leaves shared), the placement added.
        for field in dataclasses.fields(MoE):
            setattr(self, field.name, getattr(moe, field.name))
        self.axis, self.tokens_split, self.whole_loss = axis, tokens_split, whole_loss

    def __call__(
        self, x: Float[Array, "T d"]
    ) -> tuple[Float[Array, "T d"], dict[str, Array]]:
        routing, aux = self.route(x)
        config, experts = self.config, self.experts
        if view_of(self.axis, "MoE", "expert_axis") == "device":
            y = experts_device_view(
                experts, routing, x,
                config=config, axis=self.axis, tokens_split=self.tokens_split,
                dispatch=self.dispatch, mean_grad=not self.whole_loss,
            )  # fmt: skip
        else:
            y = experts_global_view(
                experts, routing, x, config=config, axis=self.axis,
                dispatch=self.dispatch,
            )  # fmt: skip
        return y, aux


def with_expert_axis(model: _M, axis: str | None, *, tokens_split: bool = True) -> _M:
    """`model` with every `MoE` in it (inside an `ed.Stacked` too) an
    `ExpertParallel` over `axis` (`None` leaves the model as it is). Leaves
    shared, in the same order. `tokens_split`: whether
    `axis` holds different tokens on each device (a data axis) or the same."""
    if axis is None:
        return model
    if not isinstance(axis, str):
        raise TypeError(
            f"with_expert_axis: `axis` must be a mesh axis name (str) or None; got "
            f"{type(axis).__name__} {axis!r}."
        )

    def wrap(node: Any) -> Any:
        if isinstance(node, MoE):  # an `ExpertParallel` too: its axis replaced
            return ExpertParallel(node, axis, tokens_split)
        return node

    out: _M = jax.tree.map(wrap, model, is_leaf=is_moe)
    return out


def whole_loss(model: _M) -> _M:
    """`model` with every `ExpertParallel` in it differentiated as part of one
    program whose expert axis is bound (`ExpertParallel.whole_loss`): the
    global view's pipeline, a `shard_map` over the stage and data axes."""
    out: _M = jax.tree.map(
        lambda m: (
            ExpertParallel(m, m.axis, m.tokens_split, whole_loss=True)
            if isinstance(m, ExpertParallel)
            else m
        ),
        model,
        is_leaf=is_moe,
    )
    return out


def expert_axes(model: Any) -> tuple[str | bool, ...]:
    """Per leaf of `jax.tree.leaves(model)`: for an `MoE`'s expert weight
    (inside an `ed.Stacked` too, the layer axis first) the axis its
    `ExpertParallel` splits it over, or True when it has none; False for any
    other leaf."""
    marks: list[str | bool] = []
    for node in jax.tree.leaves(model, is_leaf=is_moe):
        mark = node.axis if isinstance(node, ExpertParallel) else True
        marks.extend(mark if e else False for e in expert_leaves(node))
    return tuple(marks)
