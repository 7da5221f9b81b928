"""Reducing pytrees of metrics across devices.

Two modes, chosen by `axis_name`:

- a mesh axis name (default `"data"`): *collective* mode, inside `jax.shard_map`;
  every array leaf is combined across the devices of that axis with
  `lax.pmean`/`psum`/`pmax`/`pmin`.
- `None`: *global* mode, for global (possibly sharded) arrays under `jax.jit` or
  eagerly; every array leaf with `ndim > 0` is reduced over all of its elements, and
  XLA inserts whatever communication the sharding needs.

Non-array leaves pass through. A Python number passed through a collective *sum*
is the trap: `lax.psum` would multiply it by the axis size, `reduce_sum` keeps it, so
a count written as `x.shape[0]` silently stays one device's count. That one case
warns (`UserWarning`, once per call site and leaf); a mean, maximum or minimum of a
number that is the same on every device is that number, so they pass it silently.
"""

import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from ._jax import all_gather_invariant
from ._utils import (
    AxisName,
    check_array_leaves,
    check_axis_bound,
    is_array,
    map_arrays,
    path_str,
    typecheck,
)

ReduceName: TypeAlias = Literal["mean", "sum", "max", "min"]

_COLLECTIVE: dict[str, Callable[..., Any]] = {
    "mean": jax.lax.pmean,
    "sum": jax.lax.psum,
    "max": jax.lax.pmax,
    "min": jax.lax.pmin,
}
_GLOBAL: dict[str, Callable[..., Any]] = {
    "mean": jnp.mean,
    "sum": jnp.sum,
    "max": jnp.max,
    "min": jnp.min,
}


_KEYS_CANNOT_BE = {
    "mean": "averaged",
    "sum": "summed",
    "max": "compared",
    "min": "compared",
}


def _check_reducible(metrics: Any, op: str, global_mode: bool, caller: str) -> None:
    check_array_leaves(metrics, caller, "metrics", keys=_KEYS_CANNOT_BE[op])
    if not global_mode or op not in ("max", "min"):
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(metrics)[0]:
        if is_array(leaf) and jnp.ndim(leaf) > 0 and leaf.size == 0:
            raise ValueError(
                f"{caller}: `metrics` leaf {path_str(path)} has no elements (shape "
                f"{tuple(leaf.shape)}), so its {op}imum is undefined; drop empty "
                "leaves, or use `reduce_sum`/`reduce_mean` for them."
            )


def _reduce(metrics: Any, op: str, axis_name: AxisName | None, caller: str) -> Any:
    _check_reducible(metrics, op, axis_name is None, caller)
    return _reduce_checked(metrics, op, axis_name, caller)


def _reduce_checked(
    metrics: Any, op: str, axis_name: AxisName | None, caller: str
) -> Any:
    if axis_name is None:
        fn = _GLOBAL[op]
        return map_arrays(lambda x: fn(x) if jnp.ndim(x) > 0 else x, metrics)
    names = check_axis_bound(axis_name, caller, has_global_mode=True)
    if op == "sum":
        _warn_unsummed_numbers(metrics, names, caller)
    collective = _COLLECTIVE[op]
    return map_arrays(lambda x: collective(x, names), metrics)


# Frames of these packages lie between the user's call and the check: our own
# functions and methods, and the wrappers that type-check and bind them.
_LIBRARY_MODULES = ("eqxdist", "jaxtyping", "beartype", "equinox")


def _warn_unsummed_numbers(metrics: Any, names: tuple[str, ...], caller: str) -> None:
    """Warn, at the user's call, for each Python number a collective sum passes
    through (see the module's docstring)."""
    numbers = [
        (path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(metrics)[0]
        if isinstance(leaf, int | float | complex) and not isinstance(leaf, bool)
    ]
    if not numbers:
        return
    frame = sys._getframe(1)
    while frame.f_back is not None and (
        str(frame.f_globals.get("__name__")).partition(".")[0] in _LIBRARY_MODULES
        or frame.f_code.co_filename.startswith("<@beartype")
    ):
        frame = frame.f_back
    size = 1
    for name in names:
        size *= jax.lax.axis_size(name)
    axes = repr(names[0]) if len(names) == 1 else repr(names)
    for path, number in numbers:
        kind = type(number).__name__
        message = (
            f"{caller}: `metrics` leaf {path_str(path)} is the Python {kind} "
            f"{number!r}, which is the same on every device, so it is NOT summed "
            f"over {axes} ({size} devices): it comes back as {number!r}, where "
            f"`jax.lax.psum` would give {number * size!r}. If it counts this "
            f"device's examples, make it an array (`jnp.asarray({number!r})`, or "
            "`jnp.sum(mask)`) and it is summed; if it is a constant, leave it out of "
            "`metrics`."
        )
        warnings.warn_explicit(
            message,
            UserWarning,
            frame.f_code.co_filename,
            frame.f_lineno,
            module=frame.f_globals.get("__name__"),
            registry=frame.f_globals.setdefault("__warningregistry__", {}),
            module_globals=frame.f_globals,
        )


@typecheck
def reduce_mean(
    metrics: PyTree[Any], axis_name: AxisName | None = "data"
) -> PyTree[Any]:
    """Average every array leaf of `metrics` across devices.

    **Arguments:**

    - `metrics`: any pytree (dict of scalars, nested dicts, `(sum, count)` tuples,
      Equinox modules...). Non-array leaves pass through unchanged.
    - `axis_name`: the mesh axis (or tuple of axes) to average over, inside
      `jax.shard_map`. `None` selects global mode: each array leaf with `ndim > 0` is
      averaged over all its elements (`jnp.mean`), 0-d leaves pass through.

    **Returns:**

    A pytree of the same structure. In collective mode the results are replicated
    over the axis, so they can leave `shard_map` with `out_specs=P()`.

    **Raises:**

    `ValueError` if `axis_name` is not bound (called outside `shard_map`).

    !!! Example

        ```python
        def step(x):
            return ed.reduce_mean({"loss": jnp.mean(x**2)})

        jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P())(x)
        ```
    """
    return _reduce(metrics, "mean", axis_name, "reduce_mean")


@typecheck
def reduce_sum(
    metrics: PyTree[Any], axis_name: AxisName | None = "data"
) -> PyTree[Any]:
    """Sum every array leaf of `metrics` across devices (`lax.psum`), or over all
    elements with `axis_name=None`. Otherwise as `reduce_mean`.

    !!! Warning "Counts must be arrays"

        A Python number is the same on every device, so it passes through unsummed
        (where `lax.psum` would multiply it by the axis size), and a collective
        `reduce_sum` warns about it (`UserWarning`). Write a per-device count as an
        array: `jnp.asarray(x.shape[0])` or `jnp.sum(mask)`, not `x.shape[0]`.
    """
    return _reduce(metrics, "sum", axis_name, "reduce_sum")


@typecheck
def reduce_max(
    metrics: PyTree[Any], axis_name: AxisName | None = "data"
) -> PyTree[Any]:
    """Elementwise maximum of every array leaf across devices (`lax.pmax`), or over all
    elements with `axis_name=None`. Otherwise as `reduce_mean`."""
    return _reduce(metrics, "max", axis_name, "reduce_max")


@typecheck
def reduce_min(
    metrics: PyTree[Any], axis_name: AxisName | None = "data"
) -> PyTree[Any]:
    """Elementwise minimum of every array leaf across devices (`lax.pmin`), or over all
    elements with `axis_name=None`. Otherwise as `reduce_mean`."""
    return _reduce(metrics, "min", axis_name, "reduce_min")


@typecheck
def reduce_custom(
    metrics: Mapping[str, Any],
    reduce_fn: Mapping[str, str | None] | None = None,
    axis_name: AxisName | None = "data",
) -> dict[str, Any]:
    """Reduce each top-level entry of `metrics` with its own operation.

    **Arguments:**

    - `metrics`: a mapping from names to values (arrays or whole subtrees).
    - `reduce_fn`: maps names of `metrics` to `"mean"`, `"sum"`, `"max"`, `"min"` or
      `None` (leave that entry unchanged). Names it does not mention use `"mean"`;
      `reduce_fn=None` means `"mean"` for everything.
    - `axis_name`: as in `reduce_mean` (`None` for global mode).

    **Returns:**

    A dict with the keys of `metrics` in their order.

    **Raises:**

    `ValueError` for an unknown operation, or a key of `reduce_fn` that `metrics` does
    not have (a misspelt name would otherwise silently fall back to the mean).

    !!! Example

        ```python
        ed.reduce_custom(
            {"loss": loss, "samples": n, "grad_norm": g},
            {"samples": "sum", "grad_norm": "max"},
        )
        ```
    """
    ops = dict(reduce_fn or {})
    unknown_keys = [k for k in ops if k not in metrics]
    if unknown_keys:
        raise ValueError(
            f"reduce_custom: `reduce_fn` names {unknown_keys}, which are not keys of "
            f"`metrics` (its keys are {list(metrics)})."
        )
    for key, op in ops.items():
        if op is not None and op not in _COLLECTIVE:
            raise ValueError(
                f"reduce_custom: unknown reduction {op!r} for {key!r}; valid "
                f"operations are {[*_COLLECTIVE, None]}."
            )
    out = {}
    for key, value in metrics.items():
        op = ops.get(key, "mean")
        if op is not None:
            # Under its key, so that messages name the leaf's full path.
            _check_reducible({key: value}, op, axis_name is None, "reduce_custom")
            value = _reduce_checked({key: value}, op, axis_name, "reduce_custom")[key]
        out[key] = value
    return out


@typecheck
def all_gather(
    metrics: PyTree[Any], axis_name: AxisName = "data", *, tiled: bool = False
) -> PyTree[Any]:
    """Collect every device's value of each array leaf, inside `jax.shard_map`.

    **Arguments:**

    - `metrics`: any pytree; non-array leaves pass through.
    - `axis_name`: the mesh axis (or axes) to gather over.
    - `tiled`: if `False`, each leaf gains a leading axis of size `axis_size`, in
      device order; if `True`, leaves are concatenated along axis 0 instead (0-d
      leaves are treated as shape `(1,)`).

    **Returns:**

    The gathered pytree. Every device holds the same result, and JAX knows it: it
    can be returned with `out_specs=P()` under the default `check_vma=True`.

    !!! Example

        ```python
        def per_device_loss(x):
            return ed.all_gather({"loss": jnp.mean(x)})  # loss: shape (8,)
        ```
    """
    names = check_axis_bound(axis_name, "all_gather")
    check_array_leaves(metrics, "all_gather", "metrics", keys="gathered")
    # Inside shard_map the invariant gather tells JAX that every device holds the
    # same result; under `vmap`/`pmap` with a named axis there is no such
    # bookkeeping and the plain gather is the one that applies.
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    gather_fn = all_gather_invariant if manual.issuperset(names) else jax.lax.all_gather

    def gather(x: Any) -> Any:
        if tiled and jnp.ndim(x) == 0:
            x = jnp.reshape(x, (1,))
        return gather_fn(x, names, axis=0, tiled=tiled)

    return map_arrays(gather, metrics)


@typecheck
def collect_from_devices(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Split results that carry a leading device axis into per-device lists, outside
    `jit` (e.g. the output of `all_gather`, for logging).

    Every array leaf with `ndim > 0`, at any depth, becomes a Python list of its slices
    along axis 0; 0-d arrays and non-array leaves are returned unchanged.

    !!! Example

        ```python
        per_device = ed.collect_from_devices({"loss": jnp.array([0.5, 0.7])})
        per_device["loss"]  # [Array(0.5), Array(0.7)]
        ```
    """

    def split(x: Any) -> Any:
        return list(x) if jnp.ndim(x) > 0 else x

    return {key: map_arrays(split, value) for key, value in metrics.items()}
