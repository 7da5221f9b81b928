"""`MoE`: a mixture-of-experts MLP, dropless: its routing and its experts. It
knows no mesh axis: under expert parallelism the layout's experts part calls it
through `_layout/experts` (`ExpertParallel`), which sends the tokens to the
devices holding their experts."""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._utils import checked_first
from .grouped import Experts, grouped_ffn
from .routing import ROUTERS, Config, Routing, aux_values, route as route_tokens

# The leaves sharded by expert under expert parallelism (`w_gate` may be None).
EXPERT_LEAVES = ("w_in", "w_gate", "w_out")

# `MoE(dispatch=...)`: how the tokens reach their experts under expert
# parallelism (the layout's experts part implements each, `_layout/experts`).
DISPATCHES = ("all_gather", "all_to_all")


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
    dispatch: Any = "all_to_all",
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
            f"MoE: `dispatch`={dispatch!r} is not one of {DISPATCHES}; pass "
            "dispatch='all_to_all' (the default) or 'all_gather'."
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
      the expert axis splits the tokens (a data axis): `"all_to_all"` (the
      default: each device's counts gathered first, then each
      token-expert assignment sent to its expert's device and its output sent
      back, in rounds of the balanced share and a half per destination: two
      `all_to_all`s a round, one round under balanced routing) or
      `"all_gather"` (every device's tokens gathered, the outputs
      reduce-scattered back: `n` devices' tokens each way, whatever the
      routing). Both dropless, same values and gradients; no effect without
      an expert axis, or when the axis holds the same tokens on every device.
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
    dispatch: str = eqx.field(static=True, default="all_to_all")
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
        dispatch: str = "all_to_all",
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
        self.dispatch = dispatch
        self.normalize_gates = top_k > 1 if normalize_gates is None else normalize_gates
        self.router_dtype = None if router_dtype is None else jnp.dtype(router_dtype)
        self.capacity_factor = (
            None if capacity_factor is None else float(capacity_factor)
        )

    @property
    def config(self) -> Config:
        """The routing's and the experts' settings, as `routing` and `grouped`
        take them."""
        return Config(
            self.num_experts, self.top_k, self.router_kind, self.activation,
            self.normalize_gates, self.router_dtype, self.capacity_factor,
        )  # fmt: skip

    @property
    def experts(self) -> Experts:
        """The experts' weights (`w_gate` None when not gated)."""
        return Experts(self.w_in, self.w_gate, self.w_out)

    @checked_first(_check_call)
    def route(self, x: Float[Array, "T d"]) -> tuple[Routing, dict[str, Array]]:
        """This call's tokens `x` routed (each token's experts and gates, the
        assignments past a capacity dropped), and the aux values: the first
        half of a call, whoever computes the experts (`__call__` here, or the
        layout's `ExpertParallel` under expert parallelism). Routed once per
        call, for its tokens (the capacity's T), whatever a dispatch then
        gathers or sends."""
        routed = route_tokens(self.router.weight, x, self.config)
        return routed.routing, aux_values(routed, self.num_experts)

    @checked_first(_check_call)
    def __call__(
        self, x: Float[Array, "T d"]
    ) -> tuple[Float[Array, "T d"], dict[str, Array]]:
        """`(y, aux)` for this call's tokens `x`: see the class."""
        routing, aux = self.route(x)
        return _unsharded(x, routing, self.experts, self.activation), aux


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


def is_moe(x: Any) -> bool:
    return isinstance(x, MoE)


def _expert_weights(moe: Any) -> list[Any]:
    return [getattr(moe, n) for n in EXPERT_LEAVES if getattr(moe, n) is not None]


def expert_leaves(model: Any) -> tuple[bool, ...]:
    """Per leaf of `jax.tree.leaves(model)`: whether it is an `MoE`'s expert
    weight (inside an `ed.Stacked` too, the layer axis first; inside what
    holds an `MoE`, such as the layout's `ExpertParallel`, too)."""
    marks: list[bool] = []
    for node in jax.tree.leaves(model, is_leaf=is_moe):
        if not isinstance(node, MoE):
            marks.append(False)
            continue
        falses = jax.tree.map(lambda _: False, node)
        count = len(_expert_weights(node))
        marked = eqx.tree_at(_expert_weights, falses, replace=[True] * count)
        marks.extend(jax.tree.leaves(marked))
    return tuple(marks)
