"""Every stage's layers of a pipelined `Stacked`, in the device view, for a loss
that reads them outside the stack (a penalty over them, `sum(w ** 2)`).

In the device view a stage holds only its own layers, and what follows the
stack runs on every stage alike; a loss that reads the stack's leaves itself
would see this stage's share of them, and report a different loss on each stage
(the gradient of each stage's own layers is still right). So when the step's
shape-only trace finds such a read (`layer_reads.py`), the loss gets the
`Stacked` with every stage's layers (`gathered`, one all-gather over the stage
axis per step, in layer order) and the schedule takes its own from them
(`own`). Every stage computes the same loss from the same layers, so the
gradient of a stage's layers is the own block of that loss's gradient, not a
sum over the stages: `gathered`'s backward takes the block (each stage adds
the schedule's gradient of its layers there through `own`)."""

import functools
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ..._utils import is_array
from .config import StagePlan


def gathered(stacked: Any, plan: StagePlan) -> Any:
    """`stacked` (this stage's layers; in chunk order for the circular
    schedule) with every stage's, in layer order."""
    arrays, rest = eqx.partition(stacked, is_array)
    args = (plan.axis, plan.stages, plan.pipeline.repeats)
    return eqx.combine(jax.tree.map(lambda a: _gathered(a, *args), arrays), rest)


def own(stacked: Any, plan: StagePlan) -> Any:
    """`gathered`'s inverse: this stage's layers of `stacked`."""
    arrays, rest = eqx.partition(stacked, is_array)
    args = (plan.axis, plan.stages, plan.pipeline.repeats)
    return eqx.combine(jax.tree.map(lambda a: _own(a, *args), arrays), rest)


def _slots(stages: int, repeats: int) -> np.ndarray:
    """Slot g (stage g // R, position g % R) holds chunk `(g % R) * P + g // R`
    (`stages.to_chunk_order`); the identity without repeats."""
    g = np.arange(stages * repeats)
    return np.asarray((g % repeats) * stages + g // repeats)


def _reorder(x: Any, order: np.ndarray) -> Any:
    if np.array_equal(order, np.arange(order.size)):
        return x
    chunks = x.reshape(order.size, x.shape[0] // order.size, *x.shape[1:])
    return chunks[order].reshape(x.shape)


def _own(x: Any, axis: str, stages: int, repeats: int) -> Any:
    rows = x.shape[0] // stages
    slot_order = _reorder(x, _slots(stages, repeats))
    start = jax.lax.axis_index(axis) * rows
    return jax.lax.dynamic_slice_in_dim(slot_order, start, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gathered(x: Any, axis: str, stages: int, repeats: int) -> Any:
    slot_order = jax.lax.all_gather(x, axis, axis=0, tiled=True)
    return _reorder(slot_order, np.argsort(_slots(stages, repeats)))


def _gathered_fwd(x: Any, axis: str, stages: int, repeats: int) -> tuple[Any, None]:
    return _gathered(x, axis, stages, repeats), None


def _gathered_bwd(axis: str, stages: int, repeats: int, _: None, g: Any) -> Any:
    return (_own(g, axis, stages, repeats),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)
