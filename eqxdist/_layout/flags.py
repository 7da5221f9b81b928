"""XLA settings for FSDP: the opt-in flags that let GPUs overlap its collectives
with compute, and the compiler option that keeps its barriers on CPU; the
barrier that keeps a step's collectives in one order on CPU (`in_one_order`)."""

import importlib.metadata
import os
import pkgutil
from typing import Any

import equinox as eqx
import jax

from .._jax import backends_are_initialized
from .._utils import is_array, typecheck

# XLA:CPU removes optimization barriers early (before its last CSE pass and before
# scheduling), which would let it hoist every `FSDP` module's all-gather to the
# start of the step and merge rematerialised all-gathers back into the forward
# ones. Keeping the barriers makes `FSDP` modules behave on CPU as on GPU and TPU.
CPU_FSDP_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def in_one_order(tree: Any) -> Any:
    """`tree`'s arrays through one `optimization_barrier`: what comes out waits
    for all of it to be computed (with `CPU_FSDP_OPTIONS`, which keeps the
    barrier until XLA:CPU schedules the program).

    XLA:CPU runs a program's independent operations concurrently, in an order
    that can differ from device to device, and a loop (`while`) holding
    collectives is not ordered against the collectives outside it. In a step
    with a pipeline and a context axis, a metric's all-reduce of a token count
    (which reads only the batch) ran before the pipeline's loop of `ppermute`s
    on some devices and after it on others: each waited for the others, and the
    step aborted after 40 s ("Expected 4 threads to join the rendezvous"). A
    barrier makes such a collective wait for the loop's results. GPUs and TPUs
    run a device's operations in one order, so the steps fence on CPU only
    (`Layout.fence`)."""
    arrays, rest = eqx.partition(tree, is_array)
    return eqx.combine(jax.lax.optimization_barrier(arrays), rest)


# Async collectives are XLA:GPU's default; these let the scheduler use them.
GPU_XLA_FLAGS = (
    # Schedule collectives by their cost, so that all-gathers and
    # reduce-scatters run on their own stream alongside independent compute.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # Inside a loop (Stacked's scan over layers), issue the next iteration's
    # all-gather / reduce-scatter / all-reduce during this iteration.
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    # Unroll scans by two so that pipelined collectives have a partner iteration.
    "--xla_gpu_enable_while_loop_double_buffering=true",
)


@typecheck
def gpu_xla_flags() -> str:
    """The XLA flags that let a GPU overlap FSDP's all-gathers and reduce-scatters
    with compute, as one string for `XLA_FLAGS`.

    They turn on XLA:GPU's latency-hiding scheduler (collectives, asynchronous by
    default, are scheduled alongside independent compute: `FSDPSequential`'s and
    `Stacked`'s prefetched gathers run while the previous block computes),
    pipelining of collectives across loop iterations (the scan of `Stacked`) and
    the loop double buffering it relies on. They cost compile time and some memory
    (collectives in flight hold their buffers longer). CPU and TPU backends ignore
    them; see `enable_gpu_collective_overlap` to set them.

    **Returns:**

    The flags, space-separated.

    !!! Example

        ```bash
        XLA_FLAGS="$(python -c 'import eqxdist; print(eqxdist.gpu_xla_flags())')" \\
            python train.py
        ```
    """
    return " ".join(GPU_XLA_FLAGS)


def _gpu_plugin_installed() -> bool:
    names = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins  # type: ignore[import-not-found]

        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        pass
    return any("cuda" in n or "rocm" in n for n in names)


@typecheck
def enable_gpu_collective_overlap() -> bool:
    """Add `gpu_xla_flags()` to `XLA_FLAGS` when this process will run on a GPU;
    nothing otherwise (CPU runs are unchanged).

    Call it first thing, before JAX starts its backend (before the first array or
    `jax.devices()`; importing `jax` or `eqxdist` is fine), as with
    `simulate_cpu_devices`. A GPU is expected when a CUDA or ROCm plugin of JAX is
    installed and `JAX_PLATFORMS`, if set, allows it. Flags already in `XLA_FLAGS`
    win: a flag you set yourself is not repeated.

    **Returns:**

    Whether the flags were added.

    **Raises:**

    `RuntimeError` if JAX has already started on a GPU, when the flags could no
    longer take effect.

    !!! Example

        ```python
        import eqxdist as ed

        ed.enable_gpu_collective_overlap()  # a no-op without a GPU
        mesh = ed.create_data_parallel_mesh()
        ```
    """
    if backends_are_initialized():
        if jax.devices()[0].platform == "gpu":
            flags = os.environ.get("XLA_FLAGS", "")
            if all(f.split("=")[0] in flags for f in GPU_XLA_FLAGS):
                return False
            raise RuntimeError(
                "enable_gpu_collective_overlap: JAX has already started on a GPU, "
                "so XLA flags can no longer take effect; call it before creating "
                "any array (or set XLA_FLAGS to ed.gpu_xla_flags() before starting "
                "Python)."
            )
        return False
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
        return False
    if not _gpu_plugin_installed():
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    new = [f for f in GPU_XLA_FLAGS if f.split("=")[0] not in flags]
    if not new:
        return False
    os.environ["XLA_FLAGS"] = " ".join([flags, *new]).strip()
    return True
