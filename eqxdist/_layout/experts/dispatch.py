"""Expert parallelism: the experts' weights sharded by expert over a mesh axis
(device i of n holds experts `[i*E/n, (i+1)*E/n)`), each token's assignments
computed where their experts are, the outputs brought back to their tokens.

Each call's tokens are routed once, before any dispatch (`MoE.route`, which
`ExpertParallel` calls: the capacity counts that call's tokens). The default
dispatch, `exchange.py`'s, gathers the counts first, then sends each device's
`T k` assignments to their experts' devices and the outputs back in rounds of
all-to-alls. `MoE(dispatch="all_gather")` takes `_gathered` instead
(`DISPATCHES`): an all-gather of the tokens and their routing over the axis
(each device then runs its experts on their assignments only: the others sort
after its groups, in no tile of the grouped products, so its work is its
experts' share, not every token's) and a reduce-scatter of the outputs:
dropless, with no sizes to exchange first, never a weight moved, but `n T`
tokens each way per device whatever the routing.

- the *device view* (`experts_device_view`): the axis is bound, the weights are
  this device's block. `tokens_split` says whether the axis holds different
  tokens on each device (a data axis, the usual case) or the same tokens (an
  axis of its own, tokens replicated over it).
- the *global view* (`experts_global_view`): the axis is an axis of the context
  mesh; whole arrays, sharded here with a `shard_map` over the axis.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from ..._experts.grouped import Experts, grouped_ffn
from ..._experts.moe import DISPATCHES as DISPATCH_NAMES
from ..._experts.routing import Config, Routing
from ..._long.views import run_global, shard_over, size_in_context
from .exchange import exchanged


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _mean_grad(w: Array, size: int) -> Array:
    return w


def _mean_grad_fwd(w: Array, size: int) -> tuple[Array, None]:
    return w, None


def _mean_grad_bwd(size: int, _: None, g: Array) -> tuple[Array]:
    # Through the gather and the scatter this cotangent is the gradient of every
    # data device's loss together; a leaf sharded over a data axis gets the mean
    # (FSDP's convention, `scatter_mean`), which the step does not redo.
    return (g / size,)


_mean_grad.defvjp(_mean_grad_fwd, _mean_grad_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _enter(x: Array, axis: str) -> Array:
    """Megatron's f: identity; the gradient summed over `axis`."""
    return x


def _enter_fwd(x: Array, axis: str) -> tuple[Array, None]:
    return x, None


def _enter_bwd(axis: str, _: None, g: Array) -> tuple[Array]:
    return (jax.lax.psum(g, axis),)


_enter.defvjp(_enter_fwd, _enter_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _leave(x: Array, axis: str) -> Array:
    """Megatron's g: summed over `axis`; the gradient passed through."""
    summed: Array = jax.lax.psum(x, axis)
    return summed


def _leave_fwd(x: Array, axis: str) -> tuple[Array, None]:
    return jax.lax.psum(x, axis), None


def _leave_bwd(axis: str, _: None, g: Array) -> tuple[Array]:
    return (g,)


_leave.defvjp(_leave_fwd, _leave_bwd)


def _here(routing: Routing, local: int, axis: str) -> Routing:
    """The routing with expert ids local to this device's block of `local`
    experts; assignments to other devices' experts get id `local` and gate 0."""
    first = jax.lax.axis_index(axis) * local
    ids = routing.experts - first
    mine = (ids >= 0) & (ids < local)
    return Routing(
        jnp.where(mine, ids, local).astype(jnp.int32),
        jnp.where(mine, routing.gates, 0.0),
    )


def check_divides(num_experts: int, size: int, axis: str) -> None:
    """A `ValueError` naming the expert leaves when the experts do not split
    evenly over the axis."""
    if num_experts % size:
        raise ValueError(
            f"MoE: `num_experts`={num_experts} is not divisible by the {size} "
            f"devices of expert axis {axis!r} (leaves w_in, w_gate, w_out); choose "
            f"a multiple of {size} experts, or an expert axis whose size divides "
            f"{num_experts}."
        )


def check_block(experts: Experts, num_experts: int, size: int, axis: str) -> None:
    """`check_divides`, and a `ValueError` naming the leaf when a weight is not
    this device's block of the experts."""
    check_divides(num_experts, size, axis)
    for name, w in zip(("w_in", "w_gate", "w_out"), experts, strict=True):
        if w is not None and w.shape[0] * size != num_experts:
            raise ValueError(
                f"MoE: leaf `{name}` has shape {w.shape} on this device, but in the "
                f"device view of expert axis {axis!r} ({size} devices) it must be "
                f"this device's block of {num_experts // size} of the "
                f"{num_experts} experts; shard it with P({axis!r}) on its first "
                "dimension (`ed.Layout(..., expert_axis=...)` does)."
            )


def _gathered(
    experts: Experts,
    routing: Routing,
    x: Array,
    config: Config,
    axis: str,
    call_tokens: int,
) -> Array:
    """Different tokens on each device, each routed on its own device
    (`MoE.route`): all of them gathered with their experts and gates (one
    all-gather: the gates and ids ride as columns), run through this device's
    experts, and each device's outputs summed back to it. The buffer is the
    devices' tokens, whatever a capacity keeps of their assignments
    (`call_tokens` bounds nothing here)."""
    del call_tokens
    k = routing.experts.shape[1]
    dtype = jnp.result_type(x, routing.gates)
    ids = routing.experts
    if config.num_experts >= 2 ** (jnp.finfo(dtype).nmant + 1):
        ids = jax.lax.all_gather(ids, axis, axis=0, tiled=True)
    columns = [x.astype(dtype), routing.gates.astype(dtype)]
    if ids is routing.experts:
        columns.append(jax.lax.stop_gradient(ids.astype(dtype)))
    both = jax.lax.all_gather(jnp.concatenate(columns, 1), axis, axis=0, tiled=True)
    d = x.shape[1]
    everyone = both[:, :d].astype(x.dtype)
    gates = both[:, d : d + k].astype(routing.gates.dtype)
    if ids is routing.experts:
        ids = jnp.round(both[:, d + k :]).astype(jnp.int32)
    local = _here(Routing(ids, gates), experts.w_in.shape[0], axis)
    out = grouped_ffn(everyone, local, experts, config.activation, config.num_experts)
    mine: Array = jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)
    return mine


# `MoE.dispatch` -> the computation with the tokens split over the axis.
DISPATCHES = {"all_gather": _gathered, "all_to_all": exchanged}
assert tuple(DISPATCHES) == DISPATCH_NAMES  # the layer's option, each one here


def _replicated(
    experts: Experts, routing: Routing, x: Array, config: Config, axis: str
) -> Array:
    """The same tokens on every device: each runs them through its own experts
    and the outputs are summed (Megatron's f/g pair around the experts)."""
    if axis in jax.typeof(experts.w_in).manual_axis_type.varying:
        # `shard_map(check_vma=True)`: JAX types the replicated tokens and gates
        # as invariant, and its `pcast` to varying and `psum` are f and g (the
        # custom pair would mistype them). The cast is explicit: the grouped
        # products' custom gradient would not cast back an implicit one.
        x, gates = jax.lax.pcast((x, routing.gates), (axis,), to="varying")
        local = _here(Routing(routing.experts, gates), experts.w_in.shape[0], axis)
        summed: Array = jax.lax.psum(
            grouped_ffn(x, local, experts, config.activation, config.num_experts),
            axis,
        )
        return summed
    # The gates enter before `_here` masks other devices' out: each gate's
    # gradient is summed from the one device that used it.
    routing = Routing(routing.experts, _enter(routing.gates, axis))
    local = _here(routing, experts.w_in.shape[0], axis)
    out = grouped_ffn(
        _enter(x, axis), local, experts, config.activation, config.num_experts
    )
    return _leave(out, axis)


def experts_device_view(
    experts: Experts,
    routing: Routing,
    x: Float[Array, "T d"],
    *,
    config: Config,
    axis: str,
    tokens_split: bool,
    dispatch: str = "all_to_all",
    mean_grad: bool = True,
) -> Float[Array, "T d"]:
    """The experts' combined output for this device's tokens `x` (routed as
    `routing` says), inside `jax.shard_map` over `axis`, with `experts` this
    device's block.

    Gradients follow the step's device view (`shard_map(check_vma=False)`, each
    device's loss differentiated on its own): with `tokens_split` (a data axis)
    the experts' gradient is the mean over `axis` of every device's loss's, as
    FSDP's sharded leaves get it; the router's and the tokens' are this
    device's part of the sum, which the step's mean over the data axes
    completes. Without it, every gradient is the whole loss's, on each device.

    `dispatch` (a key of `DISPATCHES`) picks how split tokens reach their
    experts; replicated tokens need no dispatch (each device already has them
    all) and take Megatron's f/g pair whichever is picked.

    `mean_grad=False`: the map is differentiated as a whole (the global view's
    pipeline), every device's output cotangent the loss's own; the experts'
    gradient is then the loss's, with no mean to take."""
    size = jax.lax.axis_size(axis)
    check_block(experts, config.num_experts, size, axis)
    if not tokens_split:
        return _replicated(experts, routing, x, config, axis)
    # The call's tokens are this device's own (a capacity counts them).
    tokens = x.shape[0]
    if not mean_grad:
        return DISPATCHES[dispatch](experts, routing, x, config, axis, tokens)
    w_in, w_gate, w_out = experts
    weights = Experts(
        _mean_grad(w_in, size),
        None if w_gate is None else _mean_grad(w_gate, size),
        _mean_grad(w_out, size),
    )
    return DISPATCHES[dispatch](weights, routing, x, config, axis, tokens)


def experts_global_view(
    experts: Experts,
    routing: Routing,
    x: Float[Array, "T d"],
    *,
    config: Config,
    axis: str,
    dispatch: str = "all_to_all",
) -> Float[Array, "T d"]:
    """The experts' combined output for all of `x` (routed as `routing` says,
    over all of its tokens), whole arrays under a context
    mesh with `axis`: the tokens split over `axis`, the experts sharded over it
    by expert, in a `shard_map` of `axis` alone (gradients exact: JAX
    differentiates the whole program).

    Tokens that do not split evenly (a few per call, e.g. one short sequence
    under `jax.vmap(moe)`, each sequence a call of its own) are padded with
    zero tokens to a multiple of the axis size, routed to no expert (the id one
    past the last, gate 0); their outputs are dropped, so they change no value
    and no gradient."""
    size = size_in_context(axis)
    check_divides(config.num_experts, size, axis)
    tokens = x.shape[0]
    pad = -tokens % size

    def device(x: Array, ids: Array, gates: Array, *weights: Array | None) -> Array:
        w_in, w_gate, w_out = weights
        assert w_in is not None and w_out is not None  # only w_gate may be None
        weights = Experts(w_in, w_gate, w_out)
        routing = Routing(ids, gates)
        # The call's tokens are all of `x` (a capacity counts them).
        return DISPATCHES[dispatch](weights, routing, x, config, axis, tokens)

    def body(x: Array, ids: Array, gates: Array, *args: Array | None) -> Array:
        if pad:
            x = jnp.pad(x, ((0, pad), (0, 0)))
            ids = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=config.num_experts)
            gates = jnp.pad(gates, ((0, pad), (0, 0)))
        specs = tuple(None if a is None else P(axis) for a in (x, ids, gates, *args))
        out: Array = shard_over(device, axis, (x, ids, gates, *args), specs, P(axis))
        return out[:tokens] if pad else out

    spec = jax.typeof(x).sharding.spec
    out: Array = run_global(body, axis, (x, *routing, *experts), spec)
    return out
