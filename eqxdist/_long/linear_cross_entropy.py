"""`linear_cross_entropy`: the cross-entropy of a linear output head's logits,
computed chunk by chunk of rows so that the `(tokens, vocab)` logits never exist
whole, in the forward pass or the backward."""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from .._utils import checked_first, typecheck
from .checks import shape_and_dtype
from .cross_entropy import (
    Labels,
    LossSum,
    Weights,
    check_labels,
    check_rows,
    flat_rows,
    token_losses,
    total_weight,
    vocab_size,
    weighted_sum,
)
from .views import run_global, shard_over


def _chunked(
    hidden: Array,
    weight: Array,
    bias: Array | None,
    labels: Array,
    scales: Array | None,
    chunk: int,
    vocab_axis: str | None,
) -> Array:
    """The weighted loss sum of `(N, d)` rows, `chunk` rows at a time: a
    `lax.scan` whose body is rematerialised (`jax.checkpoint`), so the backward
    pass recomputes one chunk's logits at a time too."""
    rows = hidden.shape[0]
    count = -(-rows // chunk)
    pad = count * chunk - rows
    if pad:  # padded rows: weight 0, label 0
        scales = jnp.ones(rows, jnp.float32) if scales is None else scales
        hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
        labels = jnp.pad(labels, (0, pad))
        scales = jnp.pad(scales, (0, pad))

    def split(x: Array | None) -> Array | None:
        return None if x is None else x.reshape(count, chunk, *x.shape[1:])

    @jax.checkpoint
    def body(
        total: Array, piece: tuple[Array, Array, Array | None]
    ) -> tuple[Array, None]:
        h, y, w = piece
        logits = jnp.einsum("nd,vd->nv", h, weight, preferred_element_type=jnp.float32)
        if bias is not None:
            logits = logits + bias
        return total + weighted_sum(token_losses(logits, y, vocab_axis), w), None

    pieces = (split(hidden), split(labels), split(scales))
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), pieces)
    return total


def _check_head(hidden: Any, weight: Any, labels: Any, **options: Any) -> None:
    """`weight` is `(V, d)` (`eqx.nn.Linear`'s layout) for `hidden` of `(*rows,
    d)`, `bias` `(V,)`, and the labels (and weights) fit the rows."""
    caller = "linear_cross_entropy"
    shape = shape_and_dtype(hidden, caller, "hidden")[0]
    seen = shape_and_dtype(weight, caller, "weight")[0]
    d = shape[-1] if shape else "d"
    if len(seen) != 2 or seen[1] != d:
        fix = "pass `head.weight` of the `eqx.nn.Linear(d, V)` head"
        if seen[:1] == (d,):
            fix += "; a `(d, V)` matrix is its transpose: pass `weight.T`"
        raise ValueError(
            f"{caller}: `weight` has shape {seen}; expected (V, d) = (V, {d}), "
            f"`eqx.nn.Linear`'s layout, d the last dimension of `hidden` {shape}."
            f"\nFix: {fix}."
        )
    bias = options.get("bias")
    if bias is not None and shape_and_dtype(bias, caller, "bias")[0] != seen[:1]:
        raise ValueError(
            f"{caller}: `bias` has shape {bias.shape}; expected (V,) = {seen[:1]}, "
            "one per row of `weight`.\nFix: pass `head.bias` with `head.weight`."
        )
    check_rows((shape[:-1], "hidden"), labels, options.get("weights"), caller)


@checked_first(_check_head)
@typecheck
def linear_cross_entropy(
    hidden: Float[Array, "*rows d"],
    weight: Float[Array, "V d"],
    labels: Labels,
    *,
    bias: Float[Array, " V"] | None = None,
    weights: Weights | None = None,
    vocab_axis: str | None = None,
    chunk_size: int = 4096,
) -> LossSum:
    """The cross-entropy of the logits `hidden @ weight.T + bias` of a linear
    output head, as `ed.cross_entropy` of those logits gives it, computed
    `chunk_size` rows at a time in the forward and the backward pass, so the
    `(rows, V)` logits never exist whole: a device holds one chunk's `(chunk_size,
    V)` logits (and their gradient) at a time. The gradients with respect to
    `hidden`, `weight` and `bias` are exact; the backward pass computes each
    chunk's logits again (one more matrix product than on whole logits).

    `weight` is laid out as `eqx.nn.Linear`'s, `(V, d)`: pass the head's
    `head.weight` and `head.bias`. With `vocab_axis` the vocabulary is sharded
    over that mesh axis as in `ed.cross_entropy`: in the device view `weight`
    (and `bias`) are this device's block of rows of the head (a column-parallel
    head) and the logits are combined over the axis as there, chunk by chunk; in
    the global view the whole head, which the function shards over the axis
    itself.

    **Arguments:**

    - `hidden`: the head's inputs, `(*rows, d)`.
    - `weight`: the head's weight, `(V, d)` (this device's `(V_block, d)` in the
      device view).
    - `labels`: integer class ids, `(*rows)`.
    - `bias`: the head's bias, `(V,)`, or `None`.
    - `weights`: optional float or boolean weights, `(*rows)`, as in
      `ed.cross_entropy`.
    - `vocab_axis`: the mesh axis the vocabulary is sharded over, or `None`.
    - `chunk_size`: rows per chunk; the rows are padded (with weight 0) to a
      multiple of it, or taken in one chunk when there are fewer. Memory falls
      with it, time rises once chunks are too small to keep the device busy.

    **Returns:**

    `(loss_sum, weight)`: float32 scalars, as `ed.cross_entropy`'s.

    **Raises:**

    `ValueError` for `chunk_size < 1`, shapes that do not fit together (`weight`
    not `(V, d)` for `hidden`'s last dimension `d`, `bias` not `(V,)`, `labels`
    or `weights` not `hidden`'s rows) and what `ed.cross_entropy` raises for;
    `TypeError` for labels that are not integers.

    !!! Example

        ```python
        def loss_fn(model, batch, key):
            hidden = jax.vmap(model.trunk)(batch["tokens"])   # (B, T, d)
            return ed.linear_cross_entropy(
                hidden, model.head.weight, batch["targets"], bias=model.head.bias,
                weights=batch["mask"], chunk_size=2048)
        ```
    """
    caller = "linear_cross_entropy"
    if isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(
            f"{caller}: `chunk_size` must be an int >= 1 (rows per chunk); got "
            f"{chunk_size!r}."
        )
    vocab, view = vocab_size(weight.shape[0], vocab_axis, caller)
    check_labels(labels, weights, vocab, caller)
    rows = labels.size
    chunk = min(chunk_size, max(rows, 1))
    flat_labels, scales = flat_rows(labels, weights)
    flat = hidden.reshape(rows, hidden.shape[-1]), flat_labels

    def device(
        hidden: Array, labels: Array, weight: Array, bias: Array | None, w: Array | None
    ) -> Array:
        return _chunked(hidden, weight, bias, labels, w, chunk, vocab_axis)

    args = (*flat, weight, bias, scales)
    if view == "global":
        assert vocab_axis is not None
        specs = (
            P(),
            P(),
            P(vocab_axis, None),
            None if bias is None else P(vocab_axis),
            None if scales is None else P(),
        )
        loss_sum = run_global(
            lambda *a: shard_over(device, vocab_axis, a, specs, P()),
            vocab_axis,
            args,
            P(),
        )
    else:
        loss_sum = device(*args)
    return loss_sum, total_weight(scales, rows)
