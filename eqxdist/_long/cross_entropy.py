"""`cross_entropy` and `linear_cross_entropy`: softmax cross-entropy with integer
labels, summed and weighted, from logits sharded over a vocabulary axis without
gathering them, or from the hidden states chunk by chunk of rows without ever
holding the whole `(tokens, vocab)` logits."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from .._utils import checked_first, typecheck
from .checks import shape_and_dtype
from .views import run_global, shard_over, size_in_context, view_of

# Labels and weights may be NumPy arrays: a host batch's, passed as they are.
Labels = Int[Array, "*rows"] | Int[np.ndarray, "*rows"]
Weights = (
    Float[Array, "*rows"]
    | Bool[Array, "*rows"]
    | Float[np.ndarray, "*rows"]
    | Bool[np.ndarray, "*rows"]
)
LossSum = tuple[Float[Array, ""], Float[Array, ""]]


def token_losses(
    logits: Float[Array, "N V"], labels: Int[Array, " N"], vocab_axis: str | None
) -> Float[Array, " N"]:
    """Each row's cross-entropy (float32), NaN for a label outside the vocabulary.
    With `vocab_axis` (bound) `logits` is this device's block of the vocabulary
    and `labels` global ids: one `pmax` (no gradient) and one `psum` of two
    numbers per row."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    block = logits.shape[-1]
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    first: Any = 0
    vocab = block
    if vocab_axis is not None:
        peak = jax.lax.pmax(peak, vocab_axis)
        first = jax.lax.axis_index(vocab_axis) * block
        vocab = block * jax.lax.axis_size(vocab_axis)
    shifted = logits - peak[:, None]
    local = labels - first
    here = (local >= 0) & (local < block)
    picked = jnp.take_along_axis(shifted, jnp.clip(local, 0, block - 1)[:, None], -1)
    label_logit = jnp.where(here, picked[:, 0], 0.0)
    total = jnp.sum(jnp.exp(shifted), axis=-1)
    if vocab_axis is not None:
        total, label_logit = jax.lax.psum((total, label_logit), vocab_axis)
    losses = jnp.log(total) - label_logit
    return jnp.where((labels >= 0) & (labels < vocab), losses, jnp.nan)


def weighted_sum(losses: Array, weights: Array | None) -> Array:
    """`sum(weights * losses)`; a row of weight 0 (padding) adds nothing, whatever
    its label."""
    if weights is None:
        return jnp.sum(losses)
    return jnp.sum(jnp.where(weights == 0, 0.0, weights * losses))


def total_weight(weights: Array | None, rows: int) -> Array:
    if weights is None:
        return jnp.asarray(rows, jnp.float32)
    return jnp.sum(weights.astype(jnp.float32))


def flat_rows(labels: Any, weights: Any) -> tuple[Array, Array | None]:
    """The labels and the float32 weights (`None` stays `None`) as JAX arrays of
    one row each."""
    rows = int(np.size(labels))
    flat = jnp.asarray(labels).reshape(rows)
    return flat, None if weights is None else jnp.asarray(weights, jnp.float32).reshape(
        rows
    )


def check_labels(labels: Any, weights: Any, vocab: int, caller: str) -> None:
    """A `ValueError` for a concrete label outside `[0, vocab)` in a row of
    nonzero weight (traced labels cannot be read: their rows' losses are NaN)."""
    if isinstance(labels, jax.core.Tracer) or isinstance(weights, jax.core.Tracer):
        return
    values = np.asarray(labels)
    if weights is not None:
        values = values[np.asarray(weights) != 0]
    bad = values[(values < 0) | (values >= vocab)]
    if bad.size:
        raise ValueError(
            f"{caller}: `labels` has {bad.size} value(s) outside the vocabulary "
            f"[0, {vocab}), e.g. {int(bad[0])}; give every row a label below "
            f"{vocab}, or weight 0 in `weights` (padding rows may then hold any "
            "label, e.g. -100)."
        )


def check_rows(
    rows: tuple[tuple[int, ...], str], labels: Any, weights: Any, caller: str
) -> None:
    """`labels` (and `weights`) are arrays of the `rows` of the array named
    `rows[1]` (its dimensions but the last), the labels integer class ids."""
    expected, source = rows
    shape, dtype = shape_and_dtype(labels, caller, "labels")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"{caller}: `labels` has dtype {dtype} (shape {shape}); expected integer "
            f"class ids of shape {expected}.\nFix: `labels.astype(jnp.int32)`; for "
            "one-hot or soft targets, `optax.softmax_cross_entropy`."
        )
    for name, x in (("labels", labels), ("weights", weights)):
        seen = None if x is None else shape_and_dtype(x, caller, name)[0]
        if seen is not None and seen != expected:
            raise ValueError(
                f"{caller}: `{name}` has shape {seen}; expected {expected}, the rows "
                f"of `{source}` (its shape but the last dimension).\nFix: one "
                f"{name[:-1]} per row, in the rows' shape."
            )


def _check_logits(logits: Any, labels: Any, **options: Any) -> None:
    shape, dtype = shape_and_dtype(logits, "cross_entropy", "logits")
    if not shape or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"cross_entropy: `logits` has shape {shape} and dtype {dtype}; expected "
            "floats of shape (*rows, V).\nFix: pass the output head's logits."
        )
    rows = (shape[:-1], "logits")
    check_rows(rows, labels, options.get("weights"), "cross_entropy")


def vocab_size(block: int, axis: str | None, caller: str) -> tuple[int, str]:
    """The whole vocabulary's size from this device's `block` (device view) or the
    whole (global view), and the view."""
    if axis is None:
        return block, "device"
    view = view_of(axis, caller, "vocab_axis")
    if view == "device":
        return block * jax.lax.axis_size(axis), view
    size = size_in_context(axis)
    if block % size:
        raise ValueError(
            f"{caller}: the vocabulary has {block} entries, which is not divisible "
            f"by the {size} devices of `vocab_axis`={axis!r}; pad it (and the "
            f"head) to a multiple of {size}."
        )
    return block, view


@checked_first(_check_logits)
@typecheck
def cross_entropy(
    logits: Float[Array, "*rows V"],
    labels: Labels,
    *,
    weights: Weights | None = None,
    vocab_axis: str | None = None,
) -> LossSum:
    """Softmax cross-entropy with integer labels, summed over the rows: as
    `(optax.softmax_cross_entropy_with_integer_labels(logits, labels) *
    weights).sum()`, with the total weight, ready to return from a loss as a
    weighted loss `(loss_sum, weight)` (`make_train_step` then divides by the
    weight of the whole global batch).

    With `vocab_axis`, the logits' last dimension is sharded over that mesh axis
    (as a column-parallel output head gives them) and the loss is computed
    without gathering them: a device's block gives its maximum and its sum of
    exponentials, combined over the axis in two small all-reduces per row (a
    `pmax`, which carries no gradient, and one `psum` of the sum and the label's
    logit). The gradient stays sharded as the logits are.

    - *Device view* (`vocab_axis` bound, inside `jax.shard_map` or a step's loss
      with `view="device"`): `logits` is this device's block of the vocabulary
      (device `i` holding entries `i * V_block ... (i + 1) * V_block - 1`),
      `labels` are ids in the whole vocabulary; the result is the same on every
      device of the axis.
    - *Global view* (`vocab_axis` an axis of the context mesh, not bound): whole
      logits; the function shards them over the axis itself (`jax.shard_map`
      over that axis alone).

    Computed in float32 (at least). A traced label outside the vocabulary makes
    its row's loss NaN (unless its weight is 0); a concrete one is an error.

    **Arguments:**

    - `logits`: `(*rows, V)` (this device's `(*rows, V_block)` in the device
      view).
    - `labels`: integer class ids, `(*rows)`.
    - `weights`: optional float or boolean weights (e.g. a padding mask),
      `(*rows)`; rows of weight 0 add nothing and may hold any label.
    - `vocab_axis`: the mesh axis the vocabulary is sharded over, or `None`.

    **Returns:**

    `(loss_sum, weight)`: float32 scalars, the (weighted) sum of the rows' losses
    and the sum of the weights (the number of rows without `weights`).

    **Raises:**

    `ValueError` for a concrete label outside `[0, V)` in a row of nonzero
    weight, `labels` or `weights` whose shape is not the logits' rows, a
    `vocab_axis` neither bound nor an axis of the context mesh, or (in the global
    view) a vocabulary not divisible by the axis's size; `TypeError` for labels
    that are not integers or logits that are not floats.

    !!! Example

        ```python
        def loss_fn(model, batch, key):
            logits = jax.vmap(model)(batch["tokens"])         # (B, T, V)
            return ed.cross_entropy(logits, batch["targets"], weights=batch["mask"])
        ```
    """
    caller = "cross_entropy"
    vocab, view = vocab_size(logits.shape[-1], vocab_axis, caller)
    check_labels(labels, weights, vocab, caller)
    rows = labels.size
    flat_labels, scales = flat_rows(labels, weights)
    flat = (logits.reshape(rows, -1), flat_labels)

    def device(logits: Array, labels: Array, scales: Array | None) -> Array:
        return weighted_sum(token_losses(logits, labels, vocab_axis), scales)

    if view == "global":
        assert vocab_axis is not None
        specs = (P(None, vocab_axis), P(), None if scales is None else P())
        loss_sum = run_global(
            lambda *a: shard_over(device, vocab_axis, a, specs, P()),
            vocab_axis,
            (*flat, scales),
            P(),
        )
    else:
        loss_sum = device(*flat, scales)
    return loss_sum, total_weight(scales, rows)
