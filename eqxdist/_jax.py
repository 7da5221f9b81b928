"""The one home of the JAX internals eqxdist relies on.

Each internal is looked up when first used, never at import, so a JAX release that
moves one breaks only the feature that needs it (with an error naming the JAX
version), not `import eqxdist`. Everything else in the package uses public APIs.
"""

import functools
import importlib
from typing import Any

import jax


class MissingInternalError(RuntimeError):
    """A JAX internal eqxdist needs is not where this JAX version keeps it."""


@functools.cache
def _internal(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise MissingInternalError(
            f"eqxdist needs `{module}.{name}`, which JAX {jax.__version__} does not "
            f"provide ({e}); use a JAX version eqxdist supports (see its "
            "pyproject.toml) or report it to eqxdist."
        ) from None


def source_line(source_info: Any) -> str:
    """Where an equation of a traced program was written in the user's code
    (`file:line (function)`, as JAX summarises it)."""
    line: str = _internal("jax._src.source_info_util", "summarize")(source_info)
    return line


def backends_are_initialized() -> bool:
    """Whether JAX has started its backends (after which XLA flags and the
    simulated device count no longer take effect). No public API tells this without
    starting them."""
    started: bool = _internal("jax._src.xla_bridge", "backends_are_initialized")()
    return started


def distributed_client() -> Any:
    """The coordination-service client of `jax.distributed` (`None` before
    `jax.distributed.initialize`): the only way to wait at a barrier with a timeout
    without running a device collective."""
    return _internal("jax._src.distributed", "global_state").client


def preemption_sync_manager() -> Any:
    """JAX's preemption sync manager (`None` without `jax.distributed` or with
    `jax_enable_preemption_service` off). Its `reached_sync_point(step)` is what
    `multihost_utils.reached_preemption_sync_point` calls; asking it directly
    records a step without the launcher taking the call for a preemption loop
    (`_launch/child.py` watches the public function)."""
    return _internal("jax._src.distributed", "global_state").preemption_sync_manager


def cluster_types() -> list[Any]:
    """The cluster environments `jax.distributed.initialize()` detects, in the order
    it tries them (JAX keeps this registry private)."""
    types: list[Any] = list(_internal("jax._src.clusters", "ClusterEnv")._cluster_types)
    return types


def all_gather_invariant(
    x: Any, axis_name: Any, *, axis: int = 0, tiled: bool = False
) -> Any:
    """`jax.lax.all_gather` whose result JAX knows to be the same on every device of
    `axis_name` (inside `jax.shard_map` with `check_vma=True`); not public yet."""
    gather = _internal("jax._src.lax.parallel", "all_gather_invariant")
    return gather(x, axis_name, axis=axis, tiled=tiled)


def shard_map_manual_axes(params: Any) -> frozenset[str]:
    """The mesh axes a traced `jax.shard_map` equation makes manual (its
    `axis_names`), from the equation's parameters, whose name JAX changes between
    releases."""
    for key in ("newly_manual_axes", "manual_axes"):
        if key in params:
            return frozenset(params[key])
    raise MissingInternalError(
        f"eqxdist reads a traced shard_map's manual axes from its parameters, but "
        f"JAX {jax.__version__} names none of them 'newly_manual_axes' or "
        f"'manual_axes' ({sorted(params)}); use a JAX version eqxdist supports (see "
        "its pyproject.toml) or report it to eqxdist."
    )


def dce_jaxpr(jaxpr: Any, used_outputs: list[bool]) -> Any:
    """`jaxpr` (open) with only what `used_outputs` need, nested programs (a
    `jax.checkpoint`'s, a loop's) pruned too: JAX's own dead-code rule, which the
    public API applies only when it lowers a whole program."""
    dce = _internal("jax._src.interpreters.partial_eval", "dce_jaxpr")
    return dce(jaxpr, used_outputs)[0]


def jaxpr_of(jaxpr: Any, invars: list[Any], outvars: list[Any], eqns: list[Any]) -> Any:
    """An open jaxpr of `eqns` (a subset, in order, of `jaxpr`'s) with the given
    inputs and outputs, `jaxpr`'s constants and effects (JAX builds jaxprs only
    by tracing)."""
    make = _internal("jax._src.core", "Jaxpr")
    info = _internal("jax._src.core", "DebugInfo")("split", None, None, None)
    return make(jaxpr.constvars, invars, outvars, eqns, jaxpr.effects, info)


def eval_jaxpr(jaxpr: Any, consts: list[Any], *args: Any) -> list[Any]:
    """Run an open jaxpr on `args` in the current trace."""
    run = _internal("jax._src.core", "eval_jaxpr")
    out: list[Any] = run(jaxpr, consts, *args)
    return out
