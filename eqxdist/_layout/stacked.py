"""`Stacked`: identical blocks with their parameters stacked on a leading layer
axis, run with `jax.lax.scan` (or, with `unroll=True`, a Python loop over the
layers), whose FSDP all-gathers run one layer ahead."""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._experts import expert_leaves
from .._utils import axis_is_bound, is_array, is_array_like
from .collectives import gather_leaf
from .remat import LEGACY, check_remat, check_unroll, loop_blocks
from .rules import OUTPUTS, FsdpRule, SelfGathering, has_fsdp_modules, in_linear
from .stack_aux import loop_output
from .stack_blocks import stack_blocks


def _zero_cotangent(x: Any) -> Any:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


class Stacked(SelfGathering):
    """`n` identical blocks held as one module whose array leaves have a leading
    layer axis of size `n`, run in turn with `jax.lax.scan`: the model is traced
    and compiled once per block type, not once per layer, so compile time stays
    flat in depth. It is an ordinary `eqx.Module` pytree: optimizers, checkpoints
    and `eqx.tree_at` see arrays of shape `(n, ...)`.

    Under FSDP (`make_train_step(..., strategy="fsdp")`, or `FSDP(stacked, mesh)`)
    the layer axis is never sharded; each leaf is sharded by the FSDP rule applied
    to its per-layer shape (dimensions shifted by one, the spec starting with
    `None`), and inside `jax.shard_map` each layer's slice is all-gathered inside
    the scan body, just before that layer runs. With `prefetch=True` (the default)
    layer `i + 1`'s slice is gathered while layer `i` computes (tied to layer `i`'s
    input; at most two layers' full parameters alive in the forward pass). Under
    a data-parallel step, plain `jit` or eagerly, it simply scans.

    `remat` says what the backward pass keeps of each layer: `None` (everything),
    `"full"` (only the layer's input: the layer is recomputed), `"dots"` (the
    matrix products), `"offload"` (the layer's input, in host memory where the
    backend has it) or any `jax.checkpoint` policy. Under FSDP with prefetch,
    `"full"` recomputes the layer from its input and re-gathered shards (only
    the layer inputs and the parameter shards are kept); the other policies
    gather each layer inside its rematerialised body, without prefetch (a
    prefetched copy would be kept whole for every layer). `remat=True`, the
    earlier boolean, keeps its meaning: `"dots"` without prefetch, `"full"`
    with it. `make_train_step(..., remat=...)` sets it for every `Stacked` of
    the model.

    `unroll=True` runs the layers as a loop of the Python program over static
    slices of the stacked leaves instead of a `jax.lax.scan`: the compiled
    program has no `while` loop over the layers (compile time grows with depth
    again). Parameters, results and sharding are the same, on every path
    above and in a pipeline's stages. On GPUs XLA's loop costs a 350M
    transformer about a quarter of its speed (docs/benchmarks.md);
    `make_train_step(..., unroll=...)` sets it for every `Stacked` of the model
    (`make_eval_step`, which has no `remat` either, runs each as built).

    Each block maps an array (or pytree of arrays) to one of the same shape and
    dtype: `x -> block(x)`, or `block(x, key=...)` when the stack is called with a
    `key` (split into one key per layer).

    A block may instead return a pair `(x, aux)`, aux any pytree of arrays (an
    MoE's load-balancing loss, say); the stack then returns `(x, aux)` with
    every aux leaf stacked over the layers: `(n, ...)` per call, so
    `(rows, n, ...)` under `jax.vmap` (the mapped axis first). It is told
    from the block's output (a 2-tuple whose first element has the input's
    structure). The aux's gradient reaches every layer's parameters, with a
    scan, unrolled, under FSDP and in every pipeline schedule. Under a
    pipeline a block called on a batch (no `vmap`) runs on microbatches: its
    aux leaves must have the rows as their leading axis, and the stack
    returns them as `(n, rows, ...)` (the microbatches in order along axis
    1); a leaf without them (a per-batch scalar) is a `ValueError` naming it.

    !!! Example

        ```python
        blocks = [Block(512, k) for k in jax.random.split(key, 16)]
        model = Model(embed, ed.Stacked(blocks, remat=True), head)
        step = ed.make_train_step(loss_fn, optimizer, mesh, strategy="fsdp")
        ```
    """

    layers: Any
    num_layers: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    remat: Any = eqx.field(static=True)
    prefetch: bool = eqx.field(static=True)
    unroll: bool = eqx.field(static=True)
    shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)

    def __init__(
        self,
        blocks: Sequence[Any] | Any,
        *,
        axis_name: str = "data",
        remat: Any = None,
        prefetch: bool | None = None,
        unroll: Any = False,  # a bool, checked here to say so plainly
    ) -> None:
        """**Arguments:**

        - `blocks`: a list or tuple of modules of one structure (array leaves of
          equal shapes and dtypes, other leaves equal), stacked here; or one module
          whose array leaves already carry the leading layer axis, e.g.
          `eqx.filter_vmap(make_block)(jax.random.split(key, n))`.
        - `axis_name`: the data axis the layers' parameters are sharded over.
        - `remat`: what the backward pass keeps of each layer (see above):
          `None`/`"none"`, `"full"`, `"dots"`, `"offload"` or a `jax.checkpoint`
          policy.
        - `prefetch`: under FSDP, gather the next layer during this one (`None`:
          wherever `remat` allows it, i.e. with `None` or `"full"`).
        - `unroll`: run the layers as a Python loop, not a scan (see above).

        **Raises:**

        `ValueError` for no blocks, blocks of different structures or shapes,
        stacked leaves of different leading sizes, `FSDP`/`Stacked` modules
        inside a block (wrap the `Stacked` instead), an unknown `remat`, or
        `prefetch=True` with a `remat` that gathers inside its body;
        `TypeError` for an `unroll` that is not a bool.
        """
        remat = check_remat(remat, "Stacked")
        self.unroll = check_unroll(unroll, "Stacked")
        prefetches = remat in (None, LEGACY, "full")
        if prefetch and not prefetches:
            raise ValueError(
                f"Stacked: `prefetch=True` with `remat`={remat!r}: a prefetched "
                "layer's gathered parameters would be kept for the backward pass "
                "of every layer; with this policy each layer is gathered inside "
                "its rematerialised body. Leave `prefetch` out, or use remat="
                "'full'."
            )
        layers = stack_blocks(blocks) if isinstance(blocks, (list, tuple)) else blocks
        if has_fsdp_modules(layers):
            raise ValueError(
                "Stacked: a block holds an FSDP or Stacked module; pass the plain "
                "blocks (Stacked gathers each layer itself under FSDP), or wrap "
                "the Stacked module in FSDP."
            )
        sizes = {int(x.shape[0]) for x in jax.tree.leaves(layers) if is_array_like(x)}
        if any(x.ndim == 0 for x in jax.tree.leaves(layers) if is_array_like(x)):
            raise ValueError(
                "Stacked: `blocks` is one module with a scalar array leaf; every "
                "array leaf needs the leading layer axis."
            )
        if len(sizes) != 1:
            raise ValueError(
                "Stacked: the array leaves of `blocks` must share one leading "
                f"(layer) size; got sizes {sorted(sizes)}."
            )
        self.layers = layers
        (self.num_layers,) = sizes
        self.axis_name = axis_name
        self.remat = remat
        self.prefetch = prefetches if prefetch is None else prefetch
        # Global shapes, as built: inside shard_map the leaves may be shards.
        self.shapes = tuple(
            tuple(x.shape) for x in jax.tree.leaves(layers) if is_array_like(x)
        )

    def _own_specs(
        self,
        fsdp: FsdpRule,
        rules: Sequence[P | None],
        paths: Sequence[str],
        caller: str,
    ) -> list[P | None]:
        """The FSDP rule applied to each leaf's per-layer shape, on a dimension its
        parameter rule leaves free; the layer axis is never sharded (a leading
        `None`)."""
        if fsdp.axis_name != self.axis_name:
            raise ValueError(
                f"A Stacked module gathers over axis {self.axis_name!r}, but its "
                f"parent shards over {fsdp.axis_name!r}; use one data axis."
            )
        specs: list[P | None] = []
        leaves = jax.tree.leaves(self.layers)
        linear = in_linear(self.layers) if fsdp.layout == OUTPUTS else None
        for i, (x, rule, path) in enumerate(zip(leaves, rules, paths, strict=True)):
            is_linear = False if linear is None else linear[i]
            if not is_array_like(x):
                specs.append(None)
            elif rule is None:
                inner = fsdp.spec(tuple(x.shape[1:]), linear=is_linear)
                specs.append(P(None, *inner) if len(inner) else P())
            elif len(rule) and rule[0] is not None:
                raise ValueError(
                    f"{caller}: param_rules shard dimension 0 of {path}, the layer "
                    "axis of a Stacked module, which is never sharded; start the "
                    "spec with None."
                )
            else:
                inner = fsdp.spec(tuple(x.shape[1:]), P(*rule[1:]), is_linear)
                specs.append(P(None, *inner))
        return specs

    def _plan(self, leaves: list[Any], shapes: list[tuple[int, ...]]) -> list[Any]:
        """Per stacked array leaf, the per-layer dimension to gather, or `None`.
        An MoE's expert weights are their experts' shards (expert parallelism,
        over whichever axis), computed with where they are, never gathered."""
        size = jax.lax.axis_size(self.axis_name)
        experts = expert_leaves(eqx.filter(self.layers, is_array))
        plan: list[int | None] = []
        for leaf, full, expert in zip(leaves, shapes, experts, strict=True):
            if leaf.shape[0] != self.num_layers:
                raise ValueError(
                    f"Stacked: a parameter of global shape "
                    f"{(self.num_layers, *full)} arrived with shape {leaf.shape}; "
                    "the layer axis must not be sharded."
                )
            local = tuple(leaf.shape[1:])
            if local == full or expert:
                plan.append(None)
                continue
            differ = [
                i for i, (a, b) in enumerate(zip(local, full, strict=False)) if a != b
            ]
            if (
                len(local) != len(full)
                or len(differ) != 1
                or local[differ[0]] * size != full[differ[0]]
            ):
                raise ValueError(
                    f"Stacked: a parameter of global shape {full} arrived with "
                    f"shape {local}; expected the whole array or a shard over "
                    f"{self.axis_name!r} of one non-layer dimension (pass it into "
                    "shard_map with the specs make_train_step or FSDP give it)."
                )
            plan.append(differ[0])
        return plan

    def __call__(self, x: PyTree[Any], *, key: Any = None) -> PyTree[Any]:
        """Run the layers in order on `x`; with a `key`, layer `i` is called as
        `block(x, key=jax.random.split(key, n)[i])` (e.g. for dropout)."""
        leaves, layer = layer_function(self, with_key=key is not None)

        # Shapes as built (static); the traced leaves may be local shards.
        shapes = [shape[1:] for shape in self.shapes]
        if not axis_is_bound(self.axis_name):
            plan: list[Any] = [None] * len(leaves)
        else:
            plan = self._plan(leaves, shapes)
        if key is not None:
            # The layers' keys travel with the layers' leaves, never gathered.
            leaves = [*leaves, jax.random.split(key, self.num_layers)]
            plan = [*plan, None]
        loop = functools.partial(loop_blocks, remat=self.remat, unroll=self.unroll)
        if all(d is None for d in plan):
            return _scan_plain(layer, leaves, x, loop=loop)
        if self.prefetch:
            return _scan_prefetch(
                layer,
                leaves,
                plan,
                x,
                axis_name=self.axis_name,
                remat=self.remat,
                num_layers=self.num_layers,
                unroll=self.unroll,
            )
        return _scan_gather(layer, leaves, plan, x, axis_name=self.axis_name, loop=loop)


def per_row_error(block: Any, x: Any, error: Exception) -> str:
    """What `Stacked` says when its block's matrix product fails on `x`: a
    block written for one row (`eqx.nn.Linear` computes `weight @ x`) called
    on a batch."""
    shapes = [tuple(jnp.shape(a)) for a in jax.tree.leaves(x)]
    shown = shapes[0] if len(shapes) == 1 else shapes
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return (
        f"Stacked: called on `x` of shape {shown}, its block "
        f"({type(block).__name__}) fails ({first}). A block written for one "
        "row (as eqx.nn.Linear, which computes `weight @ x`) takes one row: "
        "call the Stacked under `jax.vmap` (`jax.vmap(stack)(x)`, each row its "
        "own call), or write the block for a batch (its input's leading axis "
        "the rows)."
    )


# The scans `Stacked.__call__` chooses between. `layer(layer_leaves, x)` runs one
# layer on its (full) leaves; `plan` gives, per leaf, the dimension to gather over
# `axis_name`, or `None` for a leaf used as it arrives; `loop(body, x, leaves)`
# is `loop_blocks` with the stack's `remat` and `unroll`.


def layer_function(
    stacked: Stacked, *, with_key: bool
) -> tuple[list[Any], Callable[..., Any]]:
    """`stacked`'s layers' array leaves (each with the layer axis first) and
    `layer(layer_leaves, x)`, one block on one layer's leaves; with a key, the
    layer's key is the last of `layer_leaves`. The stages of a pipeline run
    their layers with it."""
    arrays, static = eqx.partition(stacked.layers, is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    num_params = len(leaves)

    def layer(layer_leaves: list[Any], x: Any) -> Any:
        params = jax.tree.unflatten(treedef, layer_leaves[:num_params])
        block = eqx.combine(params, static)
        try:
            if not with_key:
                return block(x)
            return block(x, key=layer_leaves[num_params])
        except TypeError as e:
            if "dot_general" not in str(e):
                raise
            raise ValueError(per_row_error(block, x, e)) from e

    return leaves, layer


def _scan_plain(
    layer: Callable[..., Any], leaves: list[Any], x: Any, *, loop: Callable[..., Any]
) -> Any:
    found: list[bool] = []

    def body(x: Any, layer_leaves: list[Any]) -> tuple[Any, Any]:
        return loop_output(layer(layer_leaves, x), x, found)

    x, ys = loop(body, x, leaves)
    return (x, ys) if any(found) else x


def _gather(
    shards: list[Any], dims: list[int], axis_name: str, *, grad: bool
) -> list[Any]:
    if grad:
        return [gather_leaf(s, d, axis_name) for s, d in zip(shards, dims, strict=True)]
    # A prefetched copy: its gradient reaches the shards another way.
    return [
        jax.lax.stop_gradient(jax.lax.all_gather(s, axis_name, axis=d, tiled=True))
        for s, d in zip(shards, dims, strict=True)
    ]


def _scan_gather(
    layer: Callable[..., Any],
    leaves: list[Any],
    plan: list[Any],
    x: Any,
    *,
    axis_name: str,
    loop: Callable[..., Any],
) -> Any:
    """Each layer gathers its own slice once its input exists (no prefetch)."""
    dims = [d for d in plan if d is not None]
    found: list[bool] = []

    def body(x: Any, layer_leaves: list[Any]) -> tuple[Any, Any]:
        shards = [s for s, d in zip(layer_leaves, plan, strict=True) if d is not None]
        shards, x = jax.lax.optimization_barrier((shards, x))
        full = iter(_gather(shards, dims, axis_name, grad=True))
        merged = [
            s if d is None else next(full)
            for s, d in zip(layer_leaves, plan, strict=True)
        ]
        return loop_output(layer(merged, x), x, found)

    x, ys = loop(body, x, leaves)
    return (x, ys) if any(found) else x


def _scan_prefetch(
    layer: Callable[..., Any],
    leaves: list[Any],
    plan: list[Any],
    x: Any,
    *,
    axis_name: str,
    remat: Any,
    num_layers: int,
    unroll: bool,
) -> Any:
    """Layer i runs on parameters gathered during layer i - 1 (the scan's
    carry); layer 0's are gathered before the scan, once its input exists, and
    the last layer runs after it on the last carry. Unrolled, the same body
    runs on each layer's static slices: the same order of gathers."""
    gathered = [i for i, d in enumerate(plan) if d is not None]
    dims = [plan[i] for i in gathered]
    rest = [i for i, d in enumerate(plan) if d is None]

    def merge(full: list[Any], rest_leaves: list[Any]) -> list[Any]:
        out: list[Any] = [None] * len(plan)
        for i, f in zip(gathered, full, strict=True):
            out[i] = f
        for i, r in zip(rest, rest_leaves, strict=True):
            out[i] = r
        return out

    def run(shards: list[Any], full: list[Any], rest_leaves: list[Any], x: Any) -> Any:
        if not remat:
            return layer(merge(full, rest_leaves), x)
        run_remat = _remat_layer(layer, merge, dims, axis_name)
        return run_remat(shards, full, rest_leaves, x)

    def slice_of(i: int | slice, which: list[int]) -> list[Any]:
        return [leaves[j][i] for j in which]

    first = slice_of(0, gathered)
    first, x = jax.lax.optimization_barrier((first, x))
    full = _gather(first, dims, axis_name, grad=not remat)
    found: list[bool] = []
    ys = None
    if num_layers > 1:

        def body(carry: Any, xs: Any) -> tuple[Any, Any]:
            x, full = carry
            shards, rest_leaves, next_shards = xs
            # Layer i+1's shards wait for layer i's input, not its output.
            next_shards, x = jax.lax.optimization_barrier((next_shards, x))
            nxt = _gather(next_shards, dims, axis_name, grad=not remat)
            y, aux = loop_output(run(shards, full, rest_leaves, x), x, found)
            return (y, nxt), aux

        xs = (
            # Only remat's backward pass needs this layer's shards again.
            slice_of(slice(0, -1), gathered) if remat else [],
            slice_of(slice(0, -1), rest),
            slice_of(slice(1, None), gathered),
        )
        # `run` rematerialises each layer itself: the loop's body is not.
        (x, full), ys = loop_blocks(body, (x, full), xs, remat=None, unroll=unroll)
    last = num_layers - 1
    out = run(slice_of(last, gathered), full, slice_of(last, rest), x)
    x, aux = loop_output(out, x, found)
    if not any(found):
        return x
    if ys is None:
        return x, jax.tree.map(lambda a: a[None], aux)
    return x, jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ys, aux)


def _remat_layer(
    layer: Callable[..., Any],
    merge: Callable[[list[Any], list[Any]], list[Any]],
    dims: list[Any],
    axis: str,
) -> Callable[..., Any]:
    """One layer on prefetched parameters `full` whose backward pass keeps only
    the shards, the other leaves and the input: it re-gathers the parameters
    and recomputes the layer.

    The parameters' gradient leaves through `port`, a stand-in of their full
    shape whose own backward pass reduce-scatters it onto the shards (the mean
    over the axis). Under `jax.vmap(model)` the layer's backward pass is
    batched, but the gradient reaching `port` is already summed over the
    batch: one reduce-scatter per parameter, not one per example. `full`'s
    own gradient is zero: it is a copy of the shards."""

    @jax.custom_vjp
    def port(shards: Any) -> Any:
        size = jax.lax.axis_size(axis)
        return [
            jnp.zeros((*s.shape[:d], s.shape[d] * size, *s.shape[d + 1 :]), s.dtype)
            for s, d in zip(shards, dims, strict=True)
        ]

    def port_fwd(shards: Any) -> Any:
        return port(shards), None

    def port_bwd(_: None, g: Any) -> Any:
        size = jax.lax.axis_size(axis)
        return (
            [
                jax.lax.psum_scatter(gi, axis, scatter_dimension=d, tiled=True) / size
                for gi, d in zip(g, dims, strict=True)
            ],
        )

    port.defvjp(port_fwd, port_bwd)

    @jax.custom_vjp
    def apply(grad_port: Any, shards: Any, full: Any, rest_leaves: Any, x: Any) -> Any:
        return layer(merge(full, rest_leaves), x)

    def fwd(grad_port: Any, shards: Any, full: Any, rest_leaves: Any, x: Any) -> Any:
        out = apply(grad_port, shards, full, rest_leaves, x)
        return out, (shards, rest_leaves, x)

    def bwd(res: Any, g: Any) -> Any:
        shards, rest_leaves, x = res
        full = [
            jax.lax.all_gather(s, axis, axis=d, tiled=True)
            for s, d in zip(shards, dims, strict=True)
        ]
        _, vjp = jax.vjp(lambda f, r, x: layer(merge(f, r), x), full, rest_leaves, x)
        d_full, d_rest, d_x = vjp(g)
        no_shards = [_zero_cotangent(s) for s in shards]
        no_full = [_zero_cotangent(f) for f in full]
        return d_full, no_shards, no_full, d_rest, d_x

    apply.defvjp(fwd, bwd)

    def run(shards: Any, full: Any, rest_leaves: Any, x: Any) -> Any:
        return apply(port(shards), shards, full, rest_leaves, x)

    return run
