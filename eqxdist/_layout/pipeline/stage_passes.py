"""The passes of one stage's layers under a schedule whose backward is written
out (`stage_slots`), each doing only its own work:

- **F** (`forward`) runs the layers once, each under `jax.vjp` of the block
  as the stack's `remat` wraps it, and keeps each layer's residuals — what
  that block's backward reads (`None`: everything it needs; `"full"`: the
  block's input; a policy: what it saves) — stacked over the layers. A
  residual that is one of the layer's own inputs (its weights, its key) is
  not kept: the backward passes take it from the stage's parameters again,
  so the stash never holds a copy of the weights.
- **B** (`input_grad`) runs the layers' backward passes in reverse, each
  pruned to the input's cotangent (`split_backward`), from the kept
  residuals: no forward (unless a remat policy left it to recompute), no
  weight products. Each layer hands W what its weights' gradients read
  beyond the residuals (the cotangents between its products).
- **W** (`weight_grad`) runs, layer by layer in any order, only the weight
  products, from the residuals and what B handed it: no forward, no
  input-gradient chain.

The stage's own glue around its layers (slicing a chunk of the stage's
layers, the key each layer draws, placing the layers' aux in the microbatch's
accumulator) is cheap and re-run where a pass needs it; placing the aux is
linear, so its transpose needs no kept values.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..remat import check_remat, rematerialised
from ..stacked import layer_function
from .engine import StageLayers, layer_loop
from .split_backward import SplitBackward


def _inexact(x: Any) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def cotangent(ct: Any, primal: Any) -> Any:
    """A cotangent as `jax.vjp` takes it for `primal`: `float0` zeros where
    `primal` is not floating (an integer leaf carried beside the activations:
    a mask, positions)."""
    if jnp.issubdtype(primal.dtype, jnp.inexact):
        return ct
    return np.zeros(primal.shape, jax.dtypes.float0)


def held(ct: Any, primal: Any) -> Any:
    """A cotangent as the schedule's buffers and messages hold it: zeros of
    `primal`'s dtype for a `float0` one (buffers are of the activations'
    dtypes)."""
    if ct.dtype == jax.dtypes.float0:
        return jnp.zeros(primal.shape, primal.dtype)
    return ct


def _in_device_memory(x: Any) -> Any:
    """A residual as the stash holds it: in device memory. `remat="offload"`
    saves a block's input in host memory where the backend has it; the stash,
    a buffer the loop updates in place, is device memory (the schedule keeps
    at most P microbatches' residuals there), and a pullback reads the value
    from either."""
    if jax.typeof(x).memory_space == jax.memory.Space.Host:
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def _loop(
    step: Callable[..., Any],
    carry: Any,
    xs: Any,
    *,
    length: int,
    unroll: bool,
    reverse: bool = False,
) -> tuple[Any, Any]:
    """`jax.lax.scan(step, carry, xs, reverse=reverse)`, or with `unroll` the
    same in a Python loop (no `while` in the program: the stack's `unroll`)."""
    if not unroll:
        return jax.lax.scan(step, carry, xs, length=length, reverse=reverse)
    ys: list[Any] = [None] * length
    for i in reversed(range(length)) if reverse else range(length):
        carry, ys[i] = step(carry, jax.tree.map(lambda x: x[i], xs))  # noqa: B023
    return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)


@dataclasses.dataclass
class _Learned:
    """What the first trace of a layer's `jax.vjp` showed, the same for every
    layer and microbatch: the pullback's structure, which residuals are the
    layer's inputs `xs` (their index, else `None`), the output's and the
    stage's structures, and (on first use) the split of the pullback."""

    tree: Any = None
    from_x: list[int | None] | None = None
    out_tree: Any = None
    ys: Any = None  # the aux stacked over the layers, as shapes (or None)
    split: SplitBackward | None = None


@dataclasses.dataclass(frozen=True)
class StagePasses:
    """F, B and W of one stage's layers on one microbatch (see the module
    docstring), on the stage's activations as leaves: the stack's input `x`
    (the first `n_x` leaves, of structure `x_tree`), then the aux accumulator
    (`acc_tree`, `None` without aux).

    `layers(params, key, chunk, micro) -> StageLayers`: the stage's layers
    (chunk `chunk`) for microbatch `micro` from the parameter leaves."""

    layers: Callable[..., StageLayers]
    x_tree: Any
    acc_tree: Any
    learned: _Learned = dataclasses.field(default_factory=_Learned)

    # -- F ------------------------------------------------------------------

    def forward(
        self, params: list[Any], h: list[Any], key: Any, chunk: Any, micro: Any
    ) -> tuple[list[Any], list[Any]]:
        """The stage's output leaves and what its backward passes need: each
        layer's residuals (leaves stacked over the layers)."""
        loop = self.layers(params, key, chunk, micro)
        n_x = self.x_tree.num_leaves
        x = jax.tree.unflatten(self.x_tree, h[:n_x])
        acc = None
        if self.acc_tree is not None:
            acc = jax.tree.unflatten(self.acc_tree, h[n_x:])
        # B and W run the recomputation in programs (switch branches) of their
        # own, apart from any forward: nothing for XLA to merge it with.
        block = rematerialised(loop.body, loop.remat, prevent_cse=False)

        def step(h: Any, i: Any) -> tuple[Any, Any]:
            xs = loop.layer(i)
            out, pullback = jax.vjp(block, h, xs)
            res, tree = jax.tree.flatten(pullback)
            mine = jax.tree.leaves(xs)
            from_x = [
                next((j for j, a in enumerate(mine) if a is r), None) for r in res
            ]
            self._learn(tree, from_x)
            y, aux = out
            kept = [
                _in_device_memory(r)
                for r, j in zip(res, from_x, strict=True)
                if j is None
            ]
            return y, (aux, kept)

        h_out, (ys, kept) = _loop(
            step, x, _layers(loop), length=loop.count, unroll=loop.unroll
        )
        out = loop.finish(h_out, ys, acc)
        self.learned.out_tree = jax.tree.structure(out)
        self.learned.ys = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), ys
        )
        return jax.tree.leaves(out), kept

    def _learn(self, tree: Any, from_x: list[int | None]) -> None:
        learned = self.learned
        if learned.tree is None:
            learned.tree, learned.from_x = tree, from_x
        elif from_x != learned.from_x:
            raise AssertionError(
                "pipeline: a layer's backward keeps other values in another trace"
            )

    # -- B ------------------------------------------------------------------

    def input_grad(
        self,
        params: list[Any],
        kept: list[Any],
        dy: list[Any],
        key: Any,
        chunk: Any,
        micro: Any,
    ) -> tuple[list[Any], list[Any]]:
        """The cotangent of the stage's input leaves (zeros of their dtype for
        integer leaves) for the cotangent `dy` of its output leaves, and what
        each layer's W reads (leaves stacked over the layers)."""
        loop = self.layers(params, key, chunk, micro)
        learned = self.learned
        n_x = self.x_tree.num_leaves
        d_out = jax.tree.unflatten(learned.out_tree, [cotangent(d, d) for d in dy])
        zeros = jax.tree.unflatten(self.x_tree, [jnp.zeros_like(d) for d in dy[:n_x]])
        ys = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), learned.ys)
        acc = None
        if self.acc_tree is not None:
            acc = jax.tree.unflatten(
                self.acc_tree, [jnp.zeros_like(d) for d in dy[n_x:]]
            )
        # The glue after the layers is linear: its transpose at zeros.
        _, glue = jax.vjp(loop.finish, zeros, ys, acc)
        d_h, d_ys, d_acc = jax.tree.map(held, glue(d_out), (zeros, ys, acc))

        def step(dh: Any, a: Any) -> tuple[Any, Any]:
            kept_i, i, dys_i = a
            xs_i = loop.layer(i)
            res = self._residuals(kept_i, xs_i)
            ct = [c for c in jax.tree.leaves((dh, dys_i)) if _inexact(c)]
            split = self._split(res, dh, dys_i, xs_i)
            d_in, saved = split.input_grad(res, ct)
            return self.held(d_in, dh), saved

        d_h, saved = _loop(
            step,
            d_h,
            (kept, _layers(loop), d_ys),
            length=loop.count,
            unroll=loop.unroll,
            reverse=True,
        )
        return [*jax.tree.leaves(d_h), *jax.tree.leaves(d_acc)], saved

    def _residuals(self, kept: list[Any], xs: list[Any]) -> list[Any]:
        """A layer's residual leaves: those kept, with the layer's own inputs
        put back where they were residuals."""
        mine = jax.tree.leaves(xs)
        it = iter(kept)
        assert self.learned.from_x is not None
        return [next(it) if j is None else mine[j] for j in self.learned.from_x]

    def held(self, d_in: list[Any], like: Any) -> Any:
        """The input's cotangent leaves (inexact ones only) as a tree like
        `like`, zeros of their dtype for the integer leaves."""
        it = iter(d_in)
        return jax.tree.map(
            lambda a: next(it) if _inexact(a) else jnp.zeros_like(a), like
        )

    def _split(self, res: list[Any], dh: Any, dys: Any, xs: list[Any]) -> SplitBackward:
        """The layer's pullback split in B and W (traced once)."""
        learned = self.learned
        if learned.split is not None:
            return learned.split
        tree = learned.tree
        outs = (dh, dys)
        out_leaves, out_tree = jax.tree.flatten(outs)
        floats = [_inexact(c) for c in out_leaves]
        n_dh = sum(_inexact(a) for a in jax.tree.leaves(dh))
        xs_floats = [_inexact(a) for a in jax.tree.leaves(xs)]

        def pullback(r: list[Any], ct: list[Any]) -> list[Any]:
            it = iter(ct)
            full = [
                next(it) if f else np.zeros(np.shape(c), jax.dtypes.float0)
                for f, c in zip(floats, out_leaves, strict=True)
            ]
            d_h, d_xs = jax.tree.unflatten(tree, r)(jax.tree.unflatten(out_tree, full))
            keep = [a for a in jax.tree.leaves(d_h) if _inexact(a)]
            d_xs = jax.tree.leaves(d_xs)
            return [*keep, *(d for d, f in zip(d_xs, xs_floats, strict=True) if f)]

        ct = [c for c in out_leaves if _inexact(c)]
        learned.split = SplitBackward.trace(pullback, res, ct, n_dh)
        return learned.split

    def in_stash(self, kept: list[Any], saved: list[Any]) -> list["Room | None"]:
        """For each leaf B hands W (`saved`, shapes stacked over the layers),
        the room it takes in a kept residual leaf of the stash (`kept`,
        likewise), or `None`: a residual only B reads (W's program does not,
        `SplitBackward.w_reads`) is dead once B has run, and values of its
        dtype that B hands W can be written where it was, side by side within
        each layer's part while they fit. The stash entry lives until W
        either way, so what B hands W then costs no memory of its own
        (ZB-H1's W waits several slots after its B: without this its values
        took a buffer of P entries beside the stash). First fit, in order."""
        split, from_x = self.learned.split, self.learned.from_x
        assert split is not None and from_x is not None  # B was traced
        # The kept leaves are the residuals that are not the layer's inputs.
        reads = [r for r, j in zip(split.w_reads, from_x, strict=True) if j is None]
        used = {k: 0 for k, r in enumerate(reads) if not r}
        rooms: list[Room | None] = []
        for v in saved:
            n = _per_layer(v)
            k = next(
                (
                    k
                    for k, at in used.items()
                    if kept[k].shape[0] == v.shape[0]
                    and kept[k].dtype == v.dtype
                    and at + n <= _per_layer(kept[k])
                ),
                None,
            )
            if k is None:
                rooms.append(None)
                continue
            rooms.append(Room(k, used[k], used[k] + n))
            used[k] += n
        return rooms

    # -- W ------------------------------------------------------------------

    def weight_grad(
        self,
        params: list[Any],
        kept: list[Any],
        saved: list[Any],
        key: Any,
        chunk: Any,
        micro: Any,
    ) -> list[Any]:
        """The gradient of the parameter leaves from the layers' residuals and
        what B handed each layer's W."""
        found: list[StageLayers] = []

        def inputs(p: list[Any]) -> list[Any]:
            found.append(self.layers(p, key, chunk, micro))
            return found[-1].xs

        xs, glue = jax.vjp(inputs, params)
        loop = found[0]
        split = self.learned.split
        assert split is not None  # B of the same table traced it

        def step(carry: None, a: Any) -> tuple[None, Any]:
            kept_i, xs_i, saved_i = a
            return None, split.weight_grad(self._residuals(kept_i, xs_i), saved_i)

        _, d_floats = _loop(
            step, None, (kept, xs, saved), length=loop.count, unroll=loop.unroll
        )
        it = iter(d_floats)
        d_xs = [
            next(it) if _inexact(x) else np.zeros(x.shape, jax.dtypes.float0)
            for x in xs
        ]
        (dp,) = glue(d_xs)
        return list(dp)


def _per_layer(a: Any) -> int:
    """The elements of one layer's part of `a` (stacked over the layers)."""
    return int(np.prod(a.shape[1:], dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class Room:
    """Where a value B hands W is kept in a stash entry
    (`StagePasses.in_stash`): in kept leaf `leaf`, elements `start:stop` of
    each layer's part (flattened)."""

    leaf: int
    start: int
    stop: int

    def put(self, buffer: Any, i: Any, value: Any) -> Any:
        """`buffer` (the leaf's stash, entries first) with `value` in the room
        of entry `i`: one update of the room alone, in place."""
        n, layers = buffer.shape[:2]
        flat = buffer.reshape(n, layers, -1)
        room = value.reshape(1, layers, -1)
        flat = jax.lax.dynamic_update_slice(flat, room, (i, 0, self.start))
        return flat.reshape(buffer.shape)

    def get(self, entry: Any, like: Any) -> Any:
        """The value in the room of `entry`, of `like`'s shape."""
        flat = entry.reshape(entry.shape[0], -1)
        return flat[:, self.start : self.stop].reshape(like.shape)


def _layers(loop: StageLayers) -> Any:
    """The index each step of a loop over `loop`'s layers reads its layer at
    (`StageLayers.layer`): Python ints where the loop is unrolled."""
    if loop.unroll:
        return np.arange(loop.count)
    return jnp.arange(loop.count)


def pass_flops(
    stacked: Any, x: Any, *, remat: Any = None, per_row: bool = True
) -> dict[str, float]:
    """What each entry of a written-out schedule computes on one stage holding
    all of `stacked`'s layers, for the rows `x`: XLA's FLOPs of each pass
    compiled on its own (the layers unrolled, so every layer counts), `"F"`,
    `"B"`, `"W"` and `"BW"` (B then W in one program). Measures the passes'
    work (the pipeline guide's table, `benchmarks/bench_pipeline.py`, the
    tests)."""
    leaves, layer = layer_function(stacked, with_key=False)
    count = stacked.num_layers

    def layers(p: list[Any], key: Any, chunk: Any, micro: Any) -> StageLayers:
        return layer_loop(
            layer,
            p,
            None,
            key_rows=False,
            first=0,
            num_layers=count,
            remat=check_remat(remat, "pass_flops"),
            unroll=True,
            per_row=per_row,
        )

    passes = StagePasses(layers, jax.tree.structure(x), None)
    h = jax.tree.leaves(x)
    y, kept = passes.forward(leaves, h, None, 0, 0)
    _, saved = passes.input_grad(leaves, kept, y, None, 0, 0)

    def flops(fn: Callable[..., Any], *args: Any) -> float:
        cost: Any = jax.jit(fn).lower(*args).compile().cost_analysis()
        return float(cost["flops"])

    def both(p: list[Any], kept: list[Any], dy: list[Any]) -> Any:
        dh, saved = passes.input_grad(p, kept, dy, None, 0, 0)
        return dh, passes.weight_grad(p, kept, saved, None, 0, 0)

    return {
        "F": flops(lambda p, h: passes.forward(p, h, None, 0, 0), leaves, h),
        "B": flops(
            lambda p, k, d: passes.input_grad(p, k, d, None, 0, 0), leaves, kept, y
        ),
        "W": flops(
            lambda p, k, s: passes.weight_grad(p, k, s, None, 0, 0), leaves, kept, saved
        ),
        "BW": flops(both, leaves, kept, y),
    }
