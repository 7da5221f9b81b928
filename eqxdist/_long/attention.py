"""`attention`: scaled dot-product attention on one device (through
`jax.nn.dot_product_attention`), or over a sequence sharded over a context axis
(ring attention, `ring.py`), in the device or the global view (`views.py`)."""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from .._utils import checked_first, typecheck
from .checks import shape_and_dtype
from .order import balance, unbalance
from .ring import ring_attention
from .views import run_global, shard_over, size_in_context, view_of

SegmentIds = Int[Array, " Tq"] | tuple[Int[Array, " Tq"], Int[Array, " Skv"]]

_CALLER = "attention"
_LAYOUTS = {"q": "(T, H, D)", "k": "(S, K_heads, D)", "v": "(S, K_heads, D)"}


def _check_sequences(q: Any, k: Any, v: Any, *_: Any, **options: Any) -> None:
    """`q`, `k` and `v` are float arrays of one sequence each, and the segment
    ids int arrays of one dimension: a batch is the mistake this catches."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        shape, dtype = shape_and_dtype(x, _CALLER, name)
        if len(shape) != 3:
            fix = (
                "map it over the batch's rows: `jax.vmap(functools.partial("
                "ed.attention, causal=...))(q, k, v)`"
                if len(shape) > 3
                else "give it a heads axis, e.g. `x[:, None, :]` for one head"
            )
            raise ValueError(
                f"{_CALLER}: `{name}` has shape {shape}; expected {_LAYOUTS[name]}, "
                f"one sequence ({len(shape)} dimensions seen, 3 expected).\n"
                f"Fix: {fix}."
            )
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{_CALLER}: `{name}` has dtype {dtype}; expected a floating dtype. "
                f"Fix: `{name}.astype(jnp.float32)` (or bfloat16)."
            )
    segments = options.get("segment_ids")
    pair = segments if isinstance(segments, tuple) else (segments,)
    for seg in (s for s in pair if s is not None):
        shape, dtype = shape_and_dtype(seg, _CALLER, "segment_ids")
        if len(shape) != 1 or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(
                f"{_CALLER}: `segment_ids` has shape {shape} and dtype {dtype}; "
                "expected int arrays of shape (T,) (and (S,) for the keys), one "
                "sequence's. Fix: `jax.vmap` over a batch's rows, ids as int32."
            )


def _check_shapes(q: Array, k: Array, v: Array) -> None:
    (_, heads, dim), (_, kv_heads, kv_dim) = q.shape, k.shape
    if kv_dim != dim:
        raise ValueError(
            f"{_CALLER}: `q` has head dimension {dim} (shape {q.shape}) and `k` "
            f"{kv_dim} (shape {k.shape}); queries and keys must have the same head "
            "dimension D, the last one: project them to the same size."
        )
    if v.shape != k.shape:
        raise ValueError(
            f"{_CALLER}: `v` has shape {v.shape} and `k` {k.shape}; values must "
            "have the keys' shape (S, K_heads, D), as in "
            "`jax.nn.dot_product_attention`."
        )
    if heads % kv_heads:
        raise ValueError(
            f"{_CALLER}: `k` and `v` have {kv_heads} heads, which does not divide "
            f"`q`'s {heads}; grouped-query attention needs the number of key/value "
            f"heads to divide the number of query heads (e.g. 1, 2 or 4 for 8)."
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            f"{_CALLER}: `q`, `k` and `v` have dtypes {q.dtype}, {k.dtype} and "
            f"{v.dtype}; cast them to one dtype."
        )


def _check_broadcast(x: Array | None, name: str, shape: tuple[int, ...]) -> None:
    if x is None:
        return
    try:
        fits = x.ndim <= 3 and np.broadcast_shapes(x.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits or (x.ndim == 3 and x.shape[0] not in (1, shape[0])):
        raise ValueError(
            f"{_CALLER}: `{name}` has shape {x.shape}, which does not broadcast to "
            f"(heads, T, S) = {shape}; give it shape (T, S), (1, T, S) or "
            f"(heads, T, S) (vmap `ed.attention` for a batch)."
        )


def _segments(
    segment_ids: Any, length: tuple[int, int]
) -> tuple[Array | None, Array | None]:
    """`(q_segments, kv_segments)` from `segment_ids`, checked against the
    lengths of the queries and the keys."""
    if segment_ids is None:
        return None, None
    pair = segment_ids if isinstance(segment_ids, tuple) else None
    if pair is None and length[0] != length[1]:
        raise ValueError(
            f"{_CALLER}: `segment_ids` is one array, for queries and keys alike, "
            f"but `q` has {length[0]} positions and `k` {length[1]}; pass a pair "
            "`(q_segments, kv_segments)`."
        )
    q_seg, kv_seg = pair if pair is not None else (segment_ids, segment_ids)
    for name, seg, n in (("queries", q_seg, length[0]), ("keys", kv_seg, length[1])):
        if seg.shape != (n,):
            raise ValueError(
                f"{_CALLER}: the segment ids of the {name} have shape {seg.shape}; "
                f"expected ({n},), one per position."
            )
    return q_seg, kv_seg


def fused_kernel(dtype: Any, head_dim: int) -> bool:
    """Whether `jax.nn.dot_product_attention(..., implementation="cudnn")` can take
    inputs of `dtype` and `head_dim` on the default backend: cuDNN's flash
    attention, on an NVIDIA GPU, in half precision, for head dimensions that are
    multiples of 8 up to 128 (256 from Hopper on; 128 is kept for every GPU)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    if head_dim % 8 or head_dim > 128:
        return False
    device = jax.devices()[0]
    return device.platform == "gpu" and "cuda" in device.client.platform_version


def _one_device(
    q: Array,
    k: Array,
    v: Array,
    bias: Array | None,
    mask: Array | None,
    segments: tuple[Array | None, Array | None],
    causal: bool,
    scale: float,
) -> Array:
    q_seg, kv_seg = segments
    if q_seg is not None and kv_seg is not None:
        same = q_seg[:, None] == kv_seg[None, :]
        mask = same if mask is None else mask & same

    def call(implementation: Any) -> Array:
        out: Array = jax.nn.dot_product_attention(
            q, k, v, bias, mask, scale=scale, is_causal=causal,
            implementation=implementation,
        )  # fmt: skip
        return out

    # Causal with T != S: JAX defines the mask as `jnp.tril` of (T, S) but does
    # not say which corner cuDNN's takes, so XLA computes JAX's definition.
    if fused_kernel(q.dtype, q.shape[-1]) and not (causal and q.shape[0] != k.shape[0]):
        try:
            return call("cudnn")
        except (NotImplementedError, RuntimeError):
            pass  # a shape or a cuDNN version the kernel does not take
    return call("xla")


def _global(
    q: Array,
    k: Array,
    v: Array,
    segments: tuple[Array | None, Array | None],
    causal: bool,
    scale: float,
    axis: str,
) -> Array:
    """The global view: whole sequences, sharded over `axis` here."""
    size = size_in_context(axis)
    multiple = 2 * size if causal else size
    why = "2 chunks per device for causal balance" if causal else "one per device"
    for name, x in (("q", q), ("k", k)):
        if x.shape[0] % multiple:
            raise ValueError(
                f"{_CALLER}: `{name}` has {x.shape[0]} positions, which is not "
                f"divisible by {multiple} ({why}, over the {size} devices of "
                f"context axis {axis!r}); pad the sequence to a multiple of "
                f"{multiple}."
            )

    def device(q: Array, k: Array, v: Array, q_seg: Any, kv_seg: Any) -> Array:
        arrays: tuple[Any, ...] = (q, k, v, q_seg, kv_seg)
        if causal:  # the natural order's blocks to the balanced order's
            arrays = tuple(None if x is None else balance(x, axis) for x in arrays)
        out = ring_attention(*arrays, causal, scale, axis)
        return unbalance(out, axis) if causal else out

    def body(*arrays: Any) -> Array:
        specs = tuple(None if x is None else P(axis) for x in arrays)
        out: Array = shard_over(device, axis, arrays, specs, P(axis))
        return out

    spec = jax.typeof(q).sharding.spec
    out: Array = run_global(body, axis, (q, k, v, *segments), spec)
    return out


def _device(
    q: Array,
    k: Array,
    v: Array,
    segments: tuple[Array | None, Array | None],
    causal: bool,
    scale: float,
    axis: str,
) -> Array:
    """The device view: this device's chunks, `axis` bound."""
    if causal and (q.shape[0] % 2 or k.shape[0] % 2):
        raise ValueError(
            f"{_CALLER}: causal attention over context axis {axis!r} needs this "
            f"device's chunks of queries and of keys to be of even lengths (two "
            f"halves of the balanced order, `ed.to_context_order`); got "
            f"{q.shape[0]} queries and {k.shape[0]} keys. Make the sequence lengths "
            "multiples of 2 x (devices of the axis)."
        )
    out: Array = ring_attention(q, k, v, *segments, causal, scale, axis)
    return out


@checked_first(_check_sequences)
@typecheck
def attention(
    q: Float[Array, "T H D"],
    k: Float[Array, "S Hkv Dk"],
    v: Float[Array, "Sv Hv Dv"],
    *,
    causal: bool = False,
    bias: Float[Array, "..."] | None = None,
    mask: Bool[Array, "..."] | None = None,
    segment_ids: SegmentIds | None = None,
    scale: float | None = None,
    context_axis: str | None = None,
) -> Float[Array, "T H D"]:
    """Scaled dot-product attention of one sequence, `softmax(q k^T * scale + bias)
    v` per head, as `jax.nn.dot_product_attention` computes it, on one device or
    over a sequence sharded over a mesh axis (context parallelism).

    Arrays are unbatched (`jax.vmap` it for a batch). Keys and values may have
    fewer heads than queries (grouped-query attention): query head `h` attends
    with key head `h // (H // K_heads)`.

    Without `context_axis` it is `jax.nn.dot_product_attention` (segment ids
    become its `mask`): on an NVIDIA GPU with bfloat16 or float16 inputs and a
    head dimension that is a multiple of 8 up to 128, with cuDNN's fused flash
    attention (`implementation="cudnn"`; JAX's default, `None`, still means XLA's
    unfused attention), falling back to XLA for what cuDNN does not take; XLA's
    attention elsewhere.

    **Context parallelism.** With `context_axis`, the sequence is sharded over
    that mesh axis and the result is the exact attention over the whole sequence
    without any device holding all of it: ring attention. Each device keeps its
    chunk of the queries; the chunks of keys and values (with their segment ids)
    go round the axis with `jax.lax.ppermute`, `cp - 1` steps on an axis of `cp`
    devices, each step's block folded into the output with an online softmax.
    The gradient goes round the ring again (a `jax.custom_vjp`), so between the
    passes a device holds O(its chunk), never the whole sequence's keys or the
    scores of more than one block. Under `causal=True` the sequence is sharded in
    the balanced order of `ed.to_context_order`, which gives every device the
    same work, and every step after the first computes only the half of its
    block that the mask keeps. The blocks use XLA's attention with float32
    softmax statistics: `jax.nn.dot_product_attention(..., return_residual=True)`
    does return a block's log-sum-exp, but rounded to the inputs' dtype and
    without a gradient (XLA's is under `stop_gradient`, cuDNN's backward drops
    its cotangent), and cuDNN's backward that would take the whole row's
    statistics is not public. An all-gather of the keys and values is never
    used (docs/benchmarks.md: the ring was as fast or faster on every measured
    size).

    - *Device view* (`context_axis` bound, inside `jax.shard_map` or a step's
      loss with `view="device"`): `q`, `k`, `v` (and `segment_ids`) are this
      device's chunks: for `causal=True` in the balanced order (two halves of
      one even length; `ed.context_positions` gives their positions in the
      whole sequence; queries and keys each in the order of their own
      sequence where `T != S`), in any order otherwise.
    - *Global view* (`context_axis` not bound, but an axis of the context mesh:
      under `jax.set_mesh(mesh)`, or a step's loss with `view="global"`): whole
      sequences in their natural order; the function reorders them, shards them
      over the axis itself (`jax.shard_map` over that axis alone, so a batch
      stays sharded over the other axes) and returns the output in the natural
      order.

    **Arguments:**

    - `q`: queries, `(T, H, D)`.
    - `k`, `v`: keys and values, `(S, K_heads, D)`, `H % K_heads == 0`; the
      dtype of `q`.
    - `causal`: query `t` attends only keys `s <= t` (positions in the whole
      sequences), as `jax.nn.dot_product_attention(..., is_causal=True)`, also
      where `T != S`: its mask is `jnp.tril` of `(T, S)`, aligned at the first
      query and key (with `T < S` the last `S - T` keys are seen by no query;
      with `T > S` the queries from `S` on see every key). With context
      parallelism and `T != S` each ring step computes its whole block (no
      half-block saving).
    - `bias`: added to the logits; shape `(T, S)`, `(1, T, S)` or `(H, T, S)`.
      Not with `context_axis`.
    - `mask`: boolean, `True` where a query may attend a key; shapes as `bias`.
      Not with `context_axis`.
    - `segment_ids`: packed sequences: an int array `(T,)` of each position's
      segment (queries and keys alike, `S == T`), or a pair `(q_segments,
      kv_segments)` of shapes `(T,)` and `(S,)`; a query attends only keys of its
      own segment. With `context_axis`, laid out as `q` and `k`.
    - `scale`: the logits' factor; `None`: `1 / sqrt(D)`.
    - `context_axis`: the mesh axis the sequence is sharded over, or `None` for
      one device.

    **Returns:**

    The attention output, `(T, H, D)` (this device's chunk in the device view),
    in `q`'s dtype. A query with no key to attend (possible only with a pair of
    segment ids) gets the mean of the values over the keys it was compared
    with, as in `jax.nn.dot_product_attention`: mask such rows out of the loss.

    **Raises:**

    `ValueError` if `q`, `k` or `v` is not of one sequence, `(length, heads, dim)`
    (a batch: `jax.vmap` it), the head dimensions of `q` and `k` differ, `v`'s shape
    is not `k`'s, `K_heads` does not divide `H`, the dtypes differ, `bias` or `mask`
    does not broadcast to `(H, T, S)`, the segment ids do not match the lengths,
    `bias` or `mask` is given with `context_axis`, `context_axis` is neither bound
    nor an axis of the context mesh, or the lengths do not divide as context
    parallelism needs (in the global view `T` and `S` by `2 cp` when causal, by `cp`
    otherwise; in the device view causal chunks of queries and of keys of even
    lengths); `TypeError` if `q`, `k` or `v` is not a float array.

    !!! Example

        ```python
        out = ed.attention(q, k, v, causal=True)  # (T, H, D) on one device
        batched = jax.vmap(functools.partial(ed.attention, causal=True))

        # The sequence sharded over "context": in the global view...
        with jax.set_mesh(mesh):
            out = jax.jit(jax.vmap(lambda q, k, v: ed.attention(
                q, k, v, causal=True, context_axis="context")))(q, k, v)
        ```
    """
    _check_shapes(q, k, v)
    full = (q.shape[1], q.shape[0], k.shape[0])
    _check_broadcast(bias, "bias", full)
    _check_broadcast(mask, "mask", full)
    segments = _segments(segment_ids, (q.shape[0], k.shape[0]))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if context_axis is None:
        return _one_device(q, k, v, bias, mask, segments, causal, scale)
    if bias is not None or mask is not None:
        given = "`bias`" if bias is not None else "`mask`"
        raise ValueError(
            f"{_CALLER}: {given} cannot be given with `context_axis`: a (T, S) array "
            "is what context parallelism avoids holding. Express the masking with "
            "`causal` and `segment_ids` (padding as a segment of its own)."
        )
    if view_of(context_axis, _CALLER, "context_axis") == "device":
        return _device(q, k, v, segments, causal, scale, context_axis)
    return _global(q, k, v, segments, causal, scale, context_axis)
