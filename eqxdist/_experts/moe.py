"""`MoE`: a mixture-of-experts MLP, dropless, on one device or with its experts
sharded over a mesh axis (expert parallelism, `dispatch.py`)."""

import copy
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._long.views import view_of
from .._utils import checked_first
from .dispatch import DISPATCHES, experts_device_view, experts_global_view
from .grouped import Experts, grouped_ffn
from .routing import ROUTERS, Config, Routing, aux_values, route

# The leaves sharded by expert under expert parallelism (`w_gate` may be None).
EXPERT_LEAVES = ("w_in", "w_gate", "w_out")

_M = TypeVar("_M")


def _check_sizes(d_model: Any, d_hidden: Any, num_experts: Any, top_k: Any) -> None:
    for name, value in (
        ("d_model", d_model),
        ("d_hidden", d_hidden),
        ("num_experts", num_experts),
        ("top_k", top_k),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"MoE: `{name}` must be an int; got {type(value).__name__} "
                f"{value!r}. Fix: pass e.g. {name}=8."
            )
        if value < 1 and name != "top_k":
            raise ValueError(
                f"MoE: `{name}` must be a positive int; got {value!r}. Fix: pass "
                f"e.g. {name}=8."
            )
    if not 1 <= top_k <= num_experts:
        more = " (or more experts)" if top_k > num_experts else ""
        raise ValueError(
            f"MoE: `top_k`={top_k} is outside [1, num_experts={num_experts}]; each "
            f"token picks top_k of the experts: pass a top_k in 1..{num_experts}"
            f"{more}."
        )


def _check_init(
    _: Any,
    d_model: Any = None,
    d_hidden: Any = None,
    num_experts: Any = None,
    *,
    top_k: Any = 2,
    router: Any = "softmax",
    dispatch: Any = "all_gather",
    normalize_gates: Any = None,
    router_dtype: Any = jnp.float32,
    capacity_factor: Any = None,
    **__: Any,
) -> None:
    """The sizes and the router, before the annotations are checked: a few
    lines with the fix, not beartype's report."""
    _check_sizes(d_model, d_hidden, num_experts, top_k)
    _check_router_options(normalize_gates, router_dtype, capacity_factor)
    if router not in ROUTERS:
        raise ValueError(
            f"MoE: `router`={router!r} is not one of {ROUTERS}; pass "
            "router='softmax' (or 'sigmoid', DeepSeek-V3's)."
        )
    if not isinstance(dispatch, str) or dispatch not in DISPATCHES:
        raise ValueError(
            f"MoE: `dispatch`={dispatch!r} is not one of {tuple(DISPATCHES)}; pass "
            "dispatch='all_gather' (the default) or 'all_to_all'."
        )


def _check_router_options(
    normalize_gates: Any, router_dtype: Any, capacity_factor: Any
) -> None:
    if normalize_gates is not None and not isinstance(normalize_gates, bool):
        raise TypeError(
            f"MoE: `normalize_gates` must be True, False or None; got "
            f"{type(normalize_gates).__name__} {normalize_gates!r}. Fix: pass "
            "normalize_gates=None (True for top_k > 1, False for top_k == 1)."
        )
    if router_dtype is not None and not _is_floating(router_dtype):
        raise TypeError(
            f"MoE: `router_dtype`={router_dtype!r} is not a floating dtype. Fix: "
            "pass router_dtype=jnp.float32 (the default), or None to route in the "
            "input's dtype."
        )
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, bool) or not isinstance(
        capacity_factor, int | float
    ):
        raise TypeError(
            f"MoE: `capacity_factor` must be a float or None; got "
            f"{type(capacity_factor).__name__} {capacity_factor!r}. Fix: pass e.g. "
            "capacity_factor=1.25, or None for dropless."
        )
    if not 0 < capacity_factor < float("inf"):
        raise ValueError(
            f"MoE: `capacity_factor`={capacity_factor!r} must be a positive finite "
            "number (each expert takes ceil(capacity_factor * T * top_k / "
            "num_experts) assignments). Fix: pass e.g. capacity_factor=1.25, or "
            "None for dropless."
        )


def _is_floating(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))
    except TypeError:
        return False


def _uniform(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int) -> Array:
    # `eqx.nn.Linear`'s initialisation, per expert.
    limit = 1 / fan_in**0.5
    return jax.random.uniform(key, shape, minval=-limit, maxval=limit)


def _check_call(moe: "MoE", x: Any, *_: Any) -> None:
    """`x` is one set of tokens, `(tokens, d_model)`, floating: a batch (a
    missing `jax.vmap`) is the mistake this catches."""
    d_model = moe.router.weight.shape[-1]
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] != d_model:
        raise ValueError(
            f"MoE: `x` has shape {shape}; expected (tokens, d_model={d_model}). "
            "Fix: flatten a batch's tokens, `x.reshape(-1, d_model)`, or "
            "`jax.vmap(moe)` over its sequences."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"MoE: `x` has dtype {x.dtype}; expected a floating dtype. Fix: "
            "`x.astype(jnp.float32)`."
        )


class MoE(eqx.Module):
    """A mixture-of-experts MLP: each token goes through the `top_k` of
    `num_experts` experts its router picks, and gets their outputs weighted by
    its gates. Dropless by default: every token reaches all of its experts,
    however unbalanced the routing.

    **Arguments:**

    - `d_model`, `d_hidden`: the tokens' size and each expert's hidden size.
    - `num_experts`: how many experts.
    - `top_k`: how many experts each token goes through, in `[1, num_experts]`.
    - `key`: a `jax.random` key for the initial weights.
    - `activation`: the experts' activation.
    - `gated`: `(activation(x @ w_in) * (x @ w_gate)) @ w_out` (SwiGLU-style)
      when True, `activation(x @ w_in) @ w_out` when False.
    - `router`: `"softmax"` or `"sigmoid"`, the router's probabilities.
    - `dispatch`: how tokens reach their experts under expert parallelism when
      the expert axis splits the tokens (a data axis): `"all_gather"` (every
      device's tokens gathered, the outputs reduce-scattered back) or
      `"all_to_all"` (each token-expert assignment sent to its expert's device
      and its output sent back: two `all_to_all`s of buffers padded to the worst
      case). Both dropless, same values and gradients; no effect without an
      expert axis, or when the axis holds the same tokens on every device.
    - `normalize_gates`: gates `p_topk / sum(p_topk)` (True) or the
      probabilities `p_topk` themselves (False); None: True for `top_k > 1`,
      False for `top_k == 1` (Switch's gate: a top-1 gate of exactly 1 would
      never train the router from the task loss).
    - `router_dtype`: the dtype the logits, probabilities and top-k are computed
      in (the tokens and the router's weight cast to it), whatever the tokens'
      dtype; None: the tokens'. Default float32, as MaxText, Megatron and
      DeepSeek route.
    - `capacity_factor`: None (dropless) or a positive float: each expert takes
      at most `ceil(capacity_factor * T * top_k / num_experts)` of a call's `T`
      tokens' assignments, by choice rank (every token's first choice before
      any second) then token order; the others contribute zero (the kept gates
      are not renormalised). `T` is the tokens of the call: the whole `x` in the
      global view, this device's `x` in the device view (whatever the dispatch
      gathers).

    Call it on `x` of shape `(tokens, d_model)`: `y, aux = moe(x)`, `aux` a dict
    of `load_balance_loss`, `router_z_loss` (for the loss, with your weights),
    `tokens_per_expert` (the router's choices) and `dropped_fraction` (the share
    of the assignments the capacity dropped, 0.0 when dropless).
    `ed.Layout(..., expert_axis=...)` shards its experts.

    !!! Example

        ```python
        moe = ed.MoE(64, 128, 8, top_k=2, key=jax.random.key(0))
        y, aux = moe(x)
        loss = task_loss(y) + 0.01 * aux["load_balance_loss"]
        ```
    """

    router: eqx.nn.Linear
    w_in: Float[Array, "E d h"]
    w_gate: Float[Array, "E d h"] | None
    w_out: Float[Array, "E h d"]
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    activation: Callable[[Array], Array] = eqx.field(static=True)
    gated: bool = eqx.field(static=True)
    router_kind: str = eqx.field(static=True)
    expert_axis: str | None = eqx.field(static=True, default=None)
    # Whether `expert_axis` holds different tokens on each device (a data axis)
    # or the same ones (an axis of its own); set with `with_expert_axis`.
    tokens_split: bool = eqx.field(static=True, default=True)
    dispatch: str = eqx.field(static=True, default="all_gather")
    # Whether the bound expert axis belongs to a `shard_map` that JAX
    # differentiates whole (the global view's pipeline): the experts' gradient
    # is then the loss's, not averaged over the devices' losses (`whole_loss`).
    whole_loss: bool = eqx.field(static=True, default=False)
    normalize_gates: bool = eqx.field(static=True, default=True)
    router_dtype: Any = eqx.field(static=True, default=jnp.dtype(jnp.float32))
    capacity_factor: float | None = eqx.field(static=True, default=None)

    @checked_first(_check_init)
    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        num_experts: int,
        *,
        top_k: int = 2,
        key: PRNGKeyArray,
        activation: Callable[[Array], Array] = jax.nn.silu,
        gated: bool = True,
        router: str = "softmax",
        dispatch: str = "all_gather",
        normalize_gates: bool | None = None,
        router_dtype: Any = jnp.float32,
        capacity_factor: float | None = None,
    ):
        k_router, k_in, k_gate, k_out = jax.random.split(key, 4)
        self.router = eqx.nn.Linear(d_model, num_experts, use_bias=False, key=k_router)
        shape = (num_experts, d_model, d_hidden)
        self.w_in = _uniform(k_in, shape, d_model)
        self.w_gate = _uniform(k_gate, shape, d_model) if gated else None
        self.w_out = _uniform(k_out, (num_experts, d_hidden, d_model), d_hidden)
        self.num_experts, self.top_k = num_experts, top_k
        self.activation, self.gated, self.router_kind = activation, gated, router
        self.expert_axis, self.tokens_split = None, True
        self.dispatch, self.whole_loss = dispatch, False
        self.normalize_gates = top_k > 1 if normalize_gates is None else normalize_gates
        self.router_dtype = None if router_dtype is None else jnp.dtype(router_dtype)
        self.capacity_factor = (
            None if capacity_factor is None else float(capacity_factor)
        )

    @checked_first(_check_call)
    def __call__(
        self, x: Float[Array, "T d"]
    ) -> tuple[Float[Array, "T d"], dict[str, Array]]:
        """`(y, aux)` for this call's tokens `x`: see the class."""
        config = Config(
            self.num_experts, self.top_k, self.router_kind, self.activation,
            self.normalize_gates, self.router_dtype, self.capacity_factor,
        )  # fmt: skip
        # Routed once, for this call's tokens (the capacity's T), whatever the
        # dispatch then gathers or sends.
        routed = route(self.router.weight, x, config)
        aux = aux_values(routed, self.num_experts)
        experts = Experts(self.w_in, self.w_gate, self.w_out)
        axis = self.expert_axis
        if axis is None:
            y = _unsharded(x, routed.routing, experts, self.activation)
        elif view_of(axis, "MoE", "expert_axis") == "device":
            y = experts_device_view(
                experts, routed.routing, x,
                config=config, axis=axis, tokens_split=self.tokens_split,
                dispatch=self.dispatch, mean_grad=not self.whole_loss,
            )  # fmt: skip
        else:
            y = experts_global_view(
                experts, routed.routing, x,
                config=config, axis=axis, dispatch=self.dispatch,
            )  # fmt: skip
        return y, aux


def _unsharded(
    x: Array, routing: Routing, experts: Experts, activation: Callable[[Array], Array]
) -> Array:
    """All the experts here. Tokens sharded over an Explicit mesh axis are left to
    XLA's partitioner (`auto_axes`): a sort by expert takes no sharded dimension."""
    if not jax.sharding.get_abstract_mesh().explicit_axes:
        return grouped_ffn(x, routing, experts, activation)
    ffn = functools.partial(grouped_ffn, activation=activation)
    spec = jax.typeof(x).sharding.spec
    y: Array = jax.sharding.auto_axes(ffn, out_sharding=spec)(x, routing, experts)
    return y


def _with_axis(moe: MoE, axis: str, tokens_split: bool) -> MoE:
    # Static fields of a frozen module: a copy with the two set, leaves shared.
    return _with(moe, expert_axis=axis, tokens_split=tokens_split)


def with_expert_axis(model: _M, axis: str | None, *, tokens_split: bool = True) -> _M:
    """`model` with every `MoE` in it computing with its experts sharded over
    `axis` (a copy; `None` leaves the model as it is). `tokens_split`: whether
    `axis` holds different tokens on each device (a data axis) or the same."""
    if axis is None:
        return model
    if not isinstance(axis, str):
        raise TypeError(
            f"with_expert_axis: `axis` must be a mesh axis name (str) or None; got "
            f"{type(axis).__name__} {axis!r}."
        )
    out: _M = jax.tree_util.tree_map(
        lambda m: _with_axis(m, axis, tokens_split) if isinstance(m, MoE) else m,
        model,
        is_leaf=lambda m: isinstance(m, MoE),
    )
    return out


def whole_loss(model: _M) -> _M:
    """`model` with every `MoE` in it differentiated as part of one program
    whose expert axis is bound (`MoE.whole_loss`): the global view's pipeline,
    a `shard_map` over the stage and data axes. A copy, leaves shared."""
    out: _M = jax.tree_util.tree_map(
        lambda m: _with(m, whole_loss=True) if isinstance(m, MoE) else m,
        model,
        is_leaf=_is_moe,
    )
    return out


def _with(moe: MoE, **fields: Any) -> MoE:
    new = copy.copy(moe)
    for name, value in fields.items():
        object.__setattr__(new, name, value)
    return new


def _is_moe(x: Any) -> bool:
    return isinstance(x, MoE)


def _expert_weights(moe: Any) -> list[Any]:
    return [getattr(moe, n) for n in EXPERT_LEAVES if getattr(moe, n) is not None]


def expert_axes(model: Any) -> tuple[str | bool | None, ...]:
    """Per leaf of `jax.tree.leaves(model)`: for an `MoE`'s expert weight
    (inside an `ed.Stacked` too, the layer axis first) its `expert_axis`, or
    True when it has none; False for any other leaf."""
    marks: list[str | bool | None] = []
    for node in jax.tree.leaves(model, is_leaf=_is_moe):
        if not isinstance(node, MoE):
            marks.append(False)
            continue
        falses = jax.tree.map(lambda _: False, node)
        count = len(_expert_weights(node))
        mark = node.expert_axis or True
        marked = eqx.tree_at(_expert_weights, falses, replace=[mark] * count)
        marks.extend(jax.tree.leaves(marked))
    return tuple(marks)


def expert_leaves(model: Any) -> tuple[bool, ...]:
    """Per leaf of `jax.tree.leaves(model)`: whether it is an `MoE`'s expert
    weight (inside an `ed.Stacked` too, the layer axis first)."""
    return tuple(a is not False for a in expert_axes(model))
