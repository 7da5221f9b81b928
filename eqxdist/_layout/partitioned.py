"""FSDP's second way to run a linear layer: partition its computation over the
devices instead of gathering its weight.

An FSDP step normally all-gathers each weight for the forward pass and
reduce-scatters its gradient: a device receives about `2 m n` elements per step for
an `(m, n)` weight, however few rows the batch has. A `PartitionedLinear` keeps
the weight's row block (the `out` rows FSDP's leading layout puts on this device)
and moves the layer's activations instead: every device's input rows are
all-gathered, each device computes its own block of output features for the whole
global batch, and an all-to-all hands every device its own rows back with all the
features. Autodiff makes the backward pass of the same shape (an all-to-all of the
output gradients, a reduce-scatter of the input gradients), and the weight's
gradient is computed from the whole batch on the device that owns its block: no
weight moves at all. A device receives about `2 B (n + m / D)` elements for a global
batch of `B` rows, far fewer while `B` is small against the layer.

Which layers run this way is decided per layer when a train step is traced
(`choose`): from the rows each layer actually sees in one forward pass of the loss
(a shape-only trace, `jax.make_jaxpr`), the elements each way moves are compared.
"""

import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._jaxpr import sub_jaxprs
from .._utils import is_array_like
from .collectives import gather_leaf

KeyPath = tuple[Any, ...]

LINEAR_MODES = ("auto", "gather", "partition")
"""`make_train_step(fsdp_linears=...)`: choose per layer by the elements each way
moves, always gather the weights, or partition every layer that can be."""


def is_candidate(module: Any) -> bool:
    """An Equinox `Linear` exactly (a subclass may compute something else) with
    vector inputs and outputs, whose weight is therefore `(out, in)`."""
    return (
        type(module) is eqx.nn.Linear
        and isinstance(module.in_features, int)
        and isinstance(module.out_features, int)
    )


def linear_paths(model: Any) -> list[KeyPath]:
    """The key path of every candidate `Linear` of `model`."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_candidate)
    return [path for path, x in with_path if is_candidate(x)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _mean_gradient(shard: jax.Array, axis_name: str) -> jax.Array:
    return shard


def _mean_gradient_fwd(shard: jax.Array, axis_name: str) -> tuple[jax.Array, None]:
    return shard, None


def _mean_gradient_bwd(axis_name: str, _: None, g: jax.Array) -> tuple[jax.Array]:
    # Autodiff through the layer's collectives gives this block the gradient of
    # the sum of every device's loss; an FSDP gather's gradient (and so every
    # other leaf's) is the mean over devices (`scatter_mean`).
    return (g / jax.lax.axis_size(axis_name),)


_mean_gradient.defvjp(_mean_gradient_fwd, _mean_gradient_bwd)


class PartitionedLinear(eqx.Module):
    """Inside a step's `shard_map`: an `eqx.nn.Linear` whose weight stays sharded
    over `axis_name` on its output features, called on one input vector (under
    the model's `jax.vmap`, as a `Linear` is) as the module docstring says.

    `weight` is the whole weight, all-gathered on access (with the FSDP gather's
    mean gradient), so a model that reads it directly (weight tying) still
    computes the right thing."""

    shard: jax.Array
    bias: jax.Array | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    @property
    def weight(self) -> jax.Array:
        return gather_leaf(self.shard, 0, self.axis_name)

    def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
        del key
        if jnp.ndim(x) != 1:
            # `Linear` accepts what `weight @ x` accepts; only a vector has the
            # row-by-row meaning the partitioned form relies on.
            y = self.weight @ x
        else:
            shard = _mean_gradient(self.shard, self.axis_name)
            # Row i of `rows` is this vector's position on device i: the layer's
            # input for the whole global batch, once the model's vmap is applied.
            rows = jax.lax.all_gather(x, self.axis_name)
            blocks = rows @ shard.T  # (devices, this device's output features)
            # Every device's block of this row's output features, in device order:
            # the order of the weight's row blocks.
            y = jax.lax.all_to_all(blocks, self.axis_name, 0, 0, tiled=True)
            y = y.reshape(self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y


def partitioned(model: Any, paths: frozenset[KeyPath], axis_name: str) -> Any:
    """`model` with the `Linear`s at `paths` (weights already sharded, biases
    gathered) replaced by `PartitionedLinear`s."""
    if not paths:
        return model

    def swap(path: KeyPath, x: Any) -> Any:
        if path not in paths or not is_candidate(x):
            return x
        return PartitionedLinear(
            x.weight, x.bias, x.in_features, x.out_features, x.use_bias, axis_name
        )

    return jax.tree_util.tree_map_with_path(swap, model, is_leaf=is_candidate)


# -- choosing ------------------------------------------------------------------

_TAG = "eqxdist_linear_"
_TAG_RE = re.compile(_TAG + r"(\d+)")


class _Replaced:
    """The indices of the tagged layers whose weight the traced loss replaces
    (hashed by identity: one object per trace, held as a static field)."""

    def __init__(self) -> None:
        self.indices: set[int] = set()


class _Tagged(eqx.Module):
    """A `Linear` whose operations carry a name scope, so that a trace says which
    layer each matrix product belongs to.

    Reading its `weight` as anything but an array means `eqx.tree_at` is looking
    for the leaf to replace (`eqx.nn.SpectralNorm` and `WeightNorm` replace their
    layer's weight before calling it): a partitioned layer holds a shard, not a
    weight to replace, so such a layer is noted in `replaced` and gathered."""

    linear: eqx.nn.Linear
    index: int = eqx.field(static=True)
    replaced: _Replaced = eqx.field(static=True)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.linear, name)
        if name == "weight" and not is_array_like(value):
            self.replaced.indices.add(self.index)
        return value

    def __call__(self, x: Any, *, key: Any = None) -> Any:
        with jax.named_scope(f"{_TAG}{self.index}"):
            return self.linear(x, key=key)


def _tagged(model: Any, paths: Sequence[KeyPath], replaced: _Replaced) -> Any:
    index = {p: i for i, p in enumerate(paths)}

    def tag(path: KeyPath, x: Any) -> Any:
        if path in index and is_candidate(x):
            return _Tagged(x, index[path], replaced)
        return x

    return jax.tree_util.tree_map_with_path(tag, model, is_leaf=is_candidate)


def _walk(
    jaxpr: Any,
    times: int,
    branched: bool,
    rows: dict[int, int],
    unsure: set[int],
    in_features: Sequence[int],
) -> None:
    """Add up, per tagged layer, the input rows of its matrix products in
    `jaxpr` (each run `times` times); a layer used under a `cond` or a
    `while_loop` goes to `unsure` (devices may take different branches or trip
    counts, and the partitioned layer's collectives need every device)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            found = _TAG_RE.search(str(eqn.source_info.name_stack))
            if found is not None:
                i = int(found.group(1))
                if branched:
                    unsure.add(i)
                # `Linear` computes `weight @ x`: the second operand is the input.
                size = math.prod(eqn.invars[1].aval.shape)
                rows[i] = rows.get(i, 0) + times * size // in_features[i]
            continue
        inner_times = (
            times * int(eqn.params.get("length", 1)) if name == "scan" else times
        )
        inner_branched = branched or name in ("cond", "while")
        for value in eqn.params.values():
            for sub in sub_jaxprs(value):
                _walk(sub, inner_times, inner_branched, rows, unsure, in_features)


def partition_pays(
    in_features: int, out_features: int, rows: int, devices: int, weight_moves: int
) -> bool:
    """Whether partitioning a layer moves fewer elements per device and step than
    gathering its weight `weight_moves` times: `rows` global input rows cost about
    `2 rows (in + out / devices)` (an all-gather and a reduce-scatter of the
    inputs, two all-to-alls of `out / devices` features), a weight about
    `2 in out` per gather (its all-gather and its gradient's reduce-scatter)."""
    moved = rows * (in_features + out_features / devices)
    return moved < weight_moves * in_features * out_features


def choose(
    mode: str,
    paths: Sequence[KeyPath],
    model: Any,
    call_loss: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    devices: int,
    calls_per_step: int,
    weight_moves: int,
) -> frozenset[KeyPath]:
    """The candidate `Linear`s (at `paths` in `model`, whose arrays may be shape
    structs) to partition under `mode` (`LINEAR_MODES`). `call_loss(m, *args)`
    runs the loss on one minibatch's per-device rows with model `m`; it is traced
    for shapes only (`args` may be shape structs). It runs `calls_per_step` times
    per step on each of `devices` devices, while a gathered weight moves
    `weight_moves` times per step."""
    if mode == "gather" or not paths:
        return frozenset()
    with_path, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_candidate)
    layers = dict(with_path)
    in_features = [layers[p].in_features for p in paths]
    replaced = _Replaced()
    arrays, rest = eqx.partition(_tagged(model, paths, replaced), is_array_like)
    jaxpr = jax.make_jaxpr(lambda a, *xs: call_loss(eqx.combine(a, rest), *xs))(
        arrays, *args
    ).jaxpr
    rows: dict[int, int] = {}
    unsure = set(replaced.indices)
    _walk(jaxpr, 1, False, rows, unsure, in_features)
    chosen = []
    for i, path in enumerate(paths):
        if i in unsure:
            continue
        layer = layers[path]
        global_rows = rows.get(i, 0) * devices * calls_per_step
        if mode == "partition" or partition_pays(
            layer.in_features, layer.out_features, global_rows, devices, weight_moves
        ):
            chosen.append(path)
    return frozenset(chosen)
