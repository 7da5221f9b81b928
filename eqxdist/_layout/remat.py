"""What the backward pass of a block keeps (`Stacked(..., remat=...)`,
`make_train_step(..., remat=...)`, the stages of a pipeline): one rule for every
place that rematerialises blocks; and how those places loop over the blocks
(`loop_blocks`: a scan, or with `unroll=True` a Python loop).

- `None` / `"none"` / `False`: everything (no rematerialisation).
- `"full"`: only each block's input; the block is recomputed in the backward pass.
- `"dots"`: the results of matrix products (`jax.checkpoint_policies.dots_saveable`);
  the elementwise work between them is recomputed.
- `"offload"`: only each block's input, moved to host memory in the forward pass
  and back for the backward pass (`save_and_offload_only_these_names`); on a
  backend whose device memory is host memory (CPU) the move is a no-op and it
  keeps what `"full"` keeps.
- any `jax.checkpoint` policy (a function of a primitive and its arguments, e.g.
  `jax.checkpoint_policies.save_only_these_names(...)`).
- `True`: `Stacked`'s boolean of earlier versions, kept as it was (`"dots"`
  without FSDP prefetch, the whole layer recomputed with it).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

REMATS = ("none", "full", "dots", "offload")

BLOCK_INPUT = "eqxdist_block_input"
"""The `checkpoint_name` of a block's input, which `"offload"` moves to the host."""

UNSET: Any = type("Unset", (), {"__repr__": lambda self: "UNSET"})()
"""`make_train_step(remat=None)`: every `Stacked` keeps its own `remat`."""

LEGACY = "legacy"
"""`remat=True`: the earlier boolean's behaviour."""

_OFFLOAD = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=[BLOCK_INPUT],
    offload_src="device",
    offload_dst="pinned_host",
)

_POLICIES: dict[str, Callable[..., Any]] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "offload": _OFFLOAD,
}


def check_remat(remat: Any, caller: str, argument: str = "remat") -> Any:
    """`remat` in its normal form: `None` (keep everything), `LEGACY` (`True`),
    one of `"full"`, `"dots"`, `"offload"`, or a policy function; a `ValueError`
    naming the value otherwise."""
    if remat is None or remat is False or remat == "none":
        return None
    if remat is True:
        return LEGACY
    if isinstance(remat, str):
        if remat in _POLICIES:
            return remat
        raise ValueError(
            f"{caller}: unknown `{argument}`={remat!r}; use None or 'none' (keep "
            "everything), 'full' (keep each block's input), 'dots' (keep matrix "
            "products), 'offload' (each block's input in host memory) or a "
            "jax.checkpoint policy such as jax.checkpoint_policies.dots_saveable."
        )
    if callable(remat):
        return remat
    raise ValueError(
        f"{caller}: `{argument}` must be None, one of {list(REMATS)} or a "
        f"jax.checkpoint policy (a function); got {remat!r}."
    )


def policy_of(remat: Any) -> Callable[..., Any] | None:
    """The `jax.checkpoint` policy of a normal-form `remat` (`check_remat`);
    `None` for no rematerialisation. `LEGACY` keeps matrix products."""
    if remat is None:
        return None
    if remat == LEGACY:
        dots: Callable[..., Any] = jax.checkpoint_policies.dots_saveable
        return dots
    if isinstance(remat, str):
        named: Callable[..., Any] = _POLICIES[remat]
        return named
    policy: Callable[..., Any] = remat
    return policy


def rematerialised(
    body: Callable[..., Any],
    remat: Any,
    *,
    name_input: bool = True,
    prevent_cse: bool = True,
) -> Callable[..., Any]:
    """`body(carry, xs)` of a scan over blocks, wrapped to keep what `remat` says
    (`None`: `body` itself). The carry, the block's input, is named
    `BLOCK_INPUT` (what `"offload"` moves), except for the earlier boolean, whose
    programs stay as they were. `prevent_cse=False` where no forward shares the
    program with the recomputation (a pipeline's B and W entries: an
    optimisation barrier there is unneeded, and XLA:CPU cannot emit one inside
    a fusion)."""
    policy = policy_of(remat)
    if policy is None:
        return body
    if name_input and remat != LEGACY:
        inner = body

        def body(carry: Any, xs: Any) -> Any:
            named = jax.tree.map(lambda a: checkpoint_name(a, BLOCK_INPUT), carry)
            return inner(named, xs)

    return jax.checkpoint(body, policy=policy, prevent_cse=prevent_cse)


def check_unroll(unroll: Any, caller: str, *, optional: bool = False) -> Any:
    """`unroll` itself if it is a bool (or, if `optional`, `None`: not given); a
    `TypeError` naming it otherwise."""
    if isinstance(unroll, bool) or (optional and unroll is None):
        return unroll
    allowed = "True or False"
    if optional:
        allowed = "True, False or None (leave each Stacked as built)"
    raise TypeError(
        f"{caller}: `unroll` must be {allowed}; got {unroll!r} of type "
        f"{type(unroll).__name__}. unroll=True runs the layers as a Python loop "
        "(no while loop in the compiled program)."
    )


def loop_blocks(
    body: Callable[..., Any],
    carry: Any,
    xs: Any,
    *,
    remat: Any,
    unroll: bool,
    length: int | None = None,
) -> tuple[Any, Any]:
    """`jax.lax.scan(rematerialised(body, remat), carry, xs)`; with `unroll`,
    the same body called in a Python loop on static slices of `xs` (`ys`
    stacked as the scan stacks them). The unrolled program has no `while`
    loop, which on GPUs costs a transformer's layers a quarter of their speed:
    XLA schedules and fuses across the layers only outside a loop."""
    step = rematerialised(body, remat)
    if not unroll:
        return jax.lax.scan(step, carry, xs, length=length)
    if length is None:
        (length,) = {int(x.shape[0]) for x in jax.tree.leaves(xs)}
    ys = []
    for i in range(length):
        carry, y = step(carry, jax.tree.map(lambda x: x[i], xs))  # noqa: B023
        ys.append(y)
    return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)
