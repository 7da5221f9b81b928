"""The pipeline schedules whose backward is written out (`Pipeline(...,
schedule="1f1b" | "interleaved" | "zb-h1")`, `schedules.WRITTEN_OUT`): the
gradients of a loss whose model holds a pipelined `Stacked`, each stage
alternating the forward pass of one microbatch and the backward pass of
another, so that at most P microbatches' activations are alive on a stage
(GPipe keeps all M; interleaved 1F1B more, for its smaller bubble).

The backward pass of a microbatch starts as soon as its forward pass has left
the last stage, long before the other microbatches' forward passes end, so the
schedule is written out rather than left to JAX's autodiff of a forward loop:

- **The loss, cut at the stack** (`cut_loss`): `pre` (the loss's inputs to the
  stack's input: the embedding) and `post` (the stack's output, with the
  inputs, to the loss and its metrics: the head), both ordinary functions JAX
  differentiates.
- **The slots.** The table is the pipeline's (`_layout.pipeline.schedules.table`:
  1F1B, interleaved 1F1B over the stage's chunks, or ZB-H1 with each backward
  split into B and W); the layout's engine runs it (`StageSlots`, from
  `_layout.pipeline`): every slot, every stage runs its entry, a forward (on
  the last stage with `post`'s VJP, which gives the loss, the metrics and the
  output's cotangent), an input-gradient pass B, a weight-gradient pass W or
  both (`StagePasses`: each from what the forward kept, no recompute), then
  sends its activation to the next stage and its cotangent to the previous
  one.
- **After the loop**, `pre`'s VJP runs on stage 0's input cotangents.

The stages' layer gradients stay on their stage; the other gradients (`pre`'s
on stage 0, `post`'s on the last stage) are summed over the stage axis.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .._layout.pipeline import (
    CutLoss,
    Seen,
    StagePasses,
    StagePlan,
    StageSlots,
    cotangent,
    cut,
    reads,
    slot_arrays,
    stage_leaves,
    table,
)
from .._layout.rules import is_spec_leaf
from .._layout.stack_aux import zeros
from .._metrics.tree import merge_metrics
from .._utils import is_array
from .accumulate import Accumulated, CheckedLoss
from .hoist import Where, check_pre, shares

# -- the schedule's program ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OneFOneB:
    """The 1F1B gradients of one step's rows on one device (inside the step's
    `shard_map`, the stage axis bound).

    - `marked`: `marked(params, model_state, minibatch, key, seen)`, the checked
      loss (`CheckedLoss`'s output) on a model whose pipelined stack is a
      `MarkedStack` recording into `seen`.
    - `layers`: `layers(params, key, key_rows, per_row, chunk, micro)`, this
      stage's layers (chunk `chunk`) for microbatch `micro` as a loop
      (`_layout.pipeline.engine.StageLayers`; `key`: the rows' keys (`key_rows`) or the
      stack's key, or `None`; `per_row`: each block called per row, else on
      all the rows), whose passes `StagePasses` runs apart.
    - `plan`: the pipeline; `specs`: the model's specs (`ModelPlan.specs`),
      which say which leaves are a stage's own layers.
    - `checked`: the user's loss, checked (`weighted` is read after tracing).
    - `whole_batch`: in the global view, the data axes: the loss is the whole
      batch's, each microbatch's `post` giving its share (`hoist`); `None` in
      the device view.
    """

    marked: Callable[..., Any]
    layers: Callable[..., Any]
    plan: StagePlan
    specs: Any
    checked: CheckedLoss
    whole_batch: tuple[str, ...] | None = None

    def __call__(
        self, params: Any, model_state: Any, batch: Any, key: Any, n: int
    ) -> Accumulated:
        if model_state is not None:
            schedule = self.plan.pipeline.schedule
            raise ValueError(
                f"pipeline (schedule={schedule!r}): the state carries a "
                "model_state; this schedule runs the loss once per microbatch out "
                "of order, which a model state carried from call to call cannot "
                "follow. Use schedule='gpipe' (or 'circular')."
            )
        if key is None:
            keys = None
        elif self.whole_batch is not None and n == 1:
            keys = key[None]  # the global view: the one-device key itself
        else:
            keys = jax.random.split(key, n)
        micro = self.plan.pipeline.microbatches
        # The minibatches in turn (unrolled: each is a loop of its own).
        outs = [
            self._minibatch(
                params,
                jax.tree.map(lambda x, i=i: _block(x, i, n), batch),
                None if keys is None else keys[i],
                micro,
            )
            for i in range(n)
        ]
        grads, total, weight, metrics = outs[0]
        for g, value, w, more in outs[1:]:
            grads = jax.tree.map(jnp.add, grads, g)
            total, weight = total + value, weight + w
            metrics = merge_metrics(metrics, more)
        if self.checked.weighted:
            return Accumulated(grads, total, weight, metrics, None)
        calls = n * micro
        mean = jax.tree.map(lambda g: g / calls, grads)
        return Accumulated(mean, total / calls, None, metrics, None)

    def _minibatch(self, params: Any, batch: Any, key: Any, micro: int) -> Any:
        """The sums over the microbatches of `batch` (microbatch m with the key
        `fold_in(key, m)`; in the global view `key` itself, the one-device
        key): gradient, loss, weight and the minibatch's metrics."""
        axis, stages = self.plan.axis, self.plan.stages
        p_leaves, p_tree = jax.tree.flatten(params)
        parts = [
            jax.tree.map(lambda x, m=m: _block(x, m, micro), batch)
            for m in range(micro)
        ]
        same = self.whole_batch is not None
        mkeys = [
            None if key is None else key if same else jax.random.fold_in(key, m)
            for m in range(micro)
        ]
        whole, gathered = self._whole(params, batch, key)
        seen = Seen()
        loss = cut(
            lambda p, b, k: self.marked(p, None, b, k, seen),
            (params, parts[0], mkeys[0]),
            seen.values,
            self.plan.pipeline.schedule,
        )
        cut_loss = loss
        loss = self._shares(loss, whole, gathered, micro, params)
        # The microbatches' own arguments, stacked; the parameters are shared.
        rest = [
            jnp.stack(xs)
            for xs in zip(
                *[jax.tree.leaves((parts[m], mkeys[m])) for m in range(micro)],
                strict=True,
            )
        ]
        inputs = jax.lax.map(lambda r: loss.pre(*p_leaves, *r), rest)
        n_x = loss.x_tree.num_leaves
        keys = inputs[n_x:]
        # Blocks returning `(x, aux)`: each microbatch's aux accumulator travels
        # with its activations, each stage writing its layers' in; the last
        # stage's is whole, as `post` takes it.
        accs = jax.tree.leaves(zeros(loss.aux, (micro,)))
        acc_tree = jax.tree.structure(loss.aux)

        def layers(p: list[Any], key: Any, chunk: Any, m: Any) -> Any:
            params = jax.tree.unflatten(p_tree, p)
            return self.layers(params, key, loss.key_rows, loss.per_row, chunk, m)

        slots = StageSlots(
            post=loss.post,
            key_tree=loss.key_tree,
            passes=StagePasses(
                layers, loss.x_tree, None if loss.aux is None else acc_tree
            ),
            params=p_leaves,
            rest=rest,
            xs=[*inputs[:n_x], *accs],
            keys=keys,
            axis=axis,
            stages=stages,
        )
        # The step runs exactly the schedule's table (`pipeline.table`).
        rows = table(self.plan.pipeline, stages)
        g_leaves, dx, outs = slots.run(slot_arrays(rows))

        # `pre`'s VJP on stage 0's input cotangents (zeros on the others).
        def pre_grads(total: list[Any], a: Any) -> tuple[list[Any], None]:
            r, d = a
            _, vjp = jax.vjp(lambda p: loss.pre(*p, *r)[:n_x], p_leaves)
            (dp,) = vjp([cotangent(a, a) for a in d])
            return [x + y for x, y in zip(total, dp, strict=True)], None

        zero = [jnp.zeros_like(x) for x in p_leaves]
        pre_leaves, _ = jax.lax.scan(pre_grads, zero, (rest, dx[:n_x]))
        grads = jax.tree.unflatten(
            p_tree, [a + b for a, b in zip(g_leaves, pre_leaves, strict=True)]
        )
        grads = self._over_stages(grads)
        last = jax.lax.axis_index(axis) == stages - 1
        outs = [jax.lax.psum(jnp.where(last, o, jnp.zeros_like(o)), axis) for o in outs]
        k = 2 if self.checked.weighted else 1
        total = outs[0].sum(0).astype(jnp.float32)
        weight = outs[1].sum(0) if k == 2 else jnp.zeros((), jnp.float32)
        args = (p_leaves, gathered, jax.tree.leaves(key))
        metrics = _metrics(cut_loss, whole, args, outs[k:], self.whole_batch)
        return grads, total, weight, metrics

    def _devices(self) -> int:
        """The devices whose rows make the loss's: the data axes' (global
        view), else 1."""
        if self.whole_batch is None:
            return 1
        mesh = jax.sharding.get_abstract_mesh()
        return int(np.prod([mesh.shape[a] for a in self.whole_batch]))

    def _whole(self, params: Any, batch: Any, key: Any) -> tuple[CutLoss, list[Any]]:
        """The loss cut on the whole rows (the minibatch; in the global view
        every device's, gathered), and those rows' batch leaves."""
        devices = self._devices()

        def whole_rows(x: Any) -> Any:
            if not is_array(x) or jnp.ndim(x) == 0:
                return x
            # Typed as the rows are (their sharding and varying axes), so the
            # two traces differ only where the row count does: else JAX adds
            # a `reshard` to the whole's program that the slice's lacks.
            t = jax.typeof(x)
            return jax.ShapeDtypeStruct(
                (x.shape[0] * devices, *x.shape[1:]),
                x.dtype,
                sharding=t.sharding,
                manual_axis_type=getattr(t, "manual_axis_type", None),
            )

        seen = Seen()
        whole = cut(
            lambda p, b, k: self.marked(p, None, b, k, seen),
            (params, jax.tree.map(whole_rows, batch), key),
            seen.values,
            self.plan.pipeline.schedule,
        )
        leaves = jax.tree.leaves(batch)
        if self.whole_batch is not None:
            # The whole minibatch: each device's block of it, in device order.
            leaves = [
                jax.lax.all_gather(x, self.whole_batch, axis=0, tiled=True)
                if jnp.ndim(x)
                else x
                for x in leaves
            ]
        return whole, leaves

    def _shares(
        self,
        loss: CutLoss,
        whole: CutLoss,
        gathered: list[Any],
        micro: int,
        params: Any,
    ) -> CutLoss:
        """`loss` whose `post` gives the microbatch's share of the loss (and
        weight) of the whole rows (`hoist`; a mean loss times the number of
        shares, as the schedule averages them), then the stack's output (kept
        for the metrics, which come from the whole rows: `_metrics`)."""
        view = "device" if self.whole_batch is None else "global"
        at = Where(self.plan.pipeline.schedule, view)
        n_stack = list(loss.kinds).count("stack")
        kinds = list(loss.kinds)[:-n_stack]
        n_x = loss.x_tree.num_leaves
        rows = [True] * n_x + [loss.key_rows] * (
            len(loss.pre_jaxpr.jaxpr.outvars) - n_x
        )
        check_pre(loss.pre_jaxpr, whole.pre_jaxpr, kinds, rows, at)
        _no_layers_outside(loss, at, params, self.specs, self.plan.axis)
        weighted = bool(self.checked.weighted)
        found = shares(loss.jaxpr, whole.jaxpr, list(loss.kinds), weighted, at)
        hoisted = found.whole(*gathered)
        slices = self._devices() * micro

        def shared(*args: Any) -> list[Any]:
            parts = found.evaluate(hoisted, slices, *args)
            if not weighted:
                parts = [parts[0] * slices]
            return [*parts, *args[len(args) - n_stack :]]

        return dataclasses.replace(loss, post=shared)

    def _over_stages(self, grads: Any) -> Any:
        """The gradients of the leaves that are not a stage's own layers (those
        of `pre`, on stage 0, and of `post`, on the last stage) summed over the
        stage axis, so that every stage holds them."""
        axis = self.plan.axis

        def total(spec: Any, g: Any) -> Any:
            if g is None:
                return None
            own = isinstance(spec, P) and len(spec) > 0 and spec[0] == axis
            return g if own else jax.lax.psum(g, axis)

        return jax.tree.map(total, self.specs, grads, is_leaf=is_spec_leaf)


def _block(x: Any, i: int, n: int) -> Any:
    if not is_array(x) or jnp.ndim(x) == 0:
        return x
    rows = x.shape[0] // n
    return x[i * rows : (i + 1) * rows]


def _metrics(loss: CutLoss, whole: CutLoss, args: Any, ys: list[Any], axes: Any) -> Any:
    """The metrics of `whole`'s `post` (the loss on the whole rows) on the
    stack's outputs `ys` (per microbatch) put together (and gathered over the
    data axes `axes` in the global view, else `None`); `args`: the parameter,
    whole batch and key leaves."""
    n_stack = len(ys)
    local = loss.jaxpr.jaxpr.invars[-n_stack:]
    full = whole.jaxpr.jaxpr.invars[-n_stack:]
    together = []
    for y, v, w in zip(ys, local, full, strict=True):
        d = [i for i in range(v.aval.ndim) if v.aval.shape[i] != w.aval.shape[i]]
        if not d:
            together.append(y[0])
            continue
        t = jnp.moveaxis(y, 0, d[0])
        t = t.reshape(*t.shape[: d[0]], -1, *t.shape[d[0] + 2 :])
        if axes is not None:
            t = jax.lax.all_gather(t, axes, axis=d[0], tiled=True)
        together.append(t)
    p_leaves, batch, key = args
    out = whole.post(*p_leaves, *batch, *key, *together)
    # Arrays: a constant of the program (a count) comes back as a NumPy value.
    out = [jnp.asarray(o) for o in out]
    _, (_, metrics, _) = jax.tree.unflatten(whole.out_tree, out)
    return metrics


def _no_layers_outside(
    loss: CutLoss, at: Where, params: Any, specs: Any, axis: str
) -> None:
    """A `ValueError` where the loss reads the pipelined stack's layers
    outside the stack (a penalty over them): there a stage holds only its
    own layers, and what follows the stack runs on the last stage only."""
    mask = stage_leaves(params, specs, axis)
    if reads([loss.jaxpr.jaxpr, loss.pre_jaxpr.jaxpr], mask):
        raise at.refuse(
            "the pipelined Stacked's layers",
            "a function of the Stacked's parameters outside the stack (a "
            "penalty over them, say), while each stage holds only its own "
            "layers; put such a term in the optimizer "
            "(`optax.add_decayed_weights`) or on parameters outside the "
            "Stacked",
        )
