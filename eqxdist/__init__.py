"""eqxdist: distributed training for Equinox on JAX.

The whole public API is here (`import eqxdist as ed`), with two namespaces:
`ed.metrics` (the stateful metrics) and `ed.compat` (object forms of the
functions, for code ported from object-style APIs).
"""

import warnings as _warnings
from typing import Any as _Any

from . import compat as compat, metrics as metrics
from ._checkpoint import (
    CheckpointManager as CheckpointManager,
    CheckpointNotFoundError as CheckpointNotFoundError,
    latest_step as latest_step,
    restore_checkpoint as restore_checkpoint,
    save_checkpoint as save_checkpoint,
)
from ._data import BatchLoader as BatchLoader
from ._data_parallel import (
    all_reduce_gradients as all_reduce_gradients,
    create_data_parallel_sharding as create_data_parallel_sharding,
    fold_rng_over_axis as fold_rng_over_axis,
    replicate_params as replicate_params,
    shard_batch as shard_batch,
)
from ._distributed import initialize_distributed as initialize_distributed
from ._experts import MoE as MoE
from ._hlo import count_collectives as count_collectives
from ._layout.collectives import (
    gather_params as gather_params,
    shard_params as shard_params,
    sync_gradients as sync_gradients,
)
from ._layout.flags import (
    enable_gpu_collective_overlap as enable_gpu_collective_overlap,
    gpu_xla_flags as gpu_xla_flags,
)
from ._layout.fsdp import FSDP as FSDP, shard_model_state as shard_model_state
from ._layout.layout import Layout as Layout
from ._layout.pipeline import Pipeline as Pipeline
from ._layout.rules import fsdp_specs as fsdp_specs
from ._layout.sequential import FSDPSequential as FSDPSequential
from ._layout.stacked import Stacked as Stacked
from ._long import (
    attention as attention,
    context_positions as context_positions,
    cross_entropy as cross_entropy,
    from_context_order as from_context_order,
    linear_cross_entropy as linear_cross_entropy,
    to_context_order as to_context_order,
)
from ._loop import (
    CsvWriter as CsvWriter,
    JsonlWriter as JsonlWriter,
    LoopResult as LoopResult,
    MultiWriter as MultiWriter,
    Progress as Progress,
    TensorBoardWriter as TensorBoardWriter,
    WandbWriter as WandbWriter,
    Watchdog as Watchdog,
    Writer as Writer,
    WriterBase as WriterBase,
    enable_compilation_cache as enable_compilation_cache,
    learning_rate as learning_rate,
    mfu as mfu,
    restore_latest as restore_latest,
    train_loop as train_loop,
)
from ._mesh import (
    create_data_parallel_mesh as create_data_parallel_mesh,
    create_device_mesh as create_device_mesh,
    create_hybrid_mesh as create_hybrid_mesh,
    create_model_parallel_mesh as create_model_parallel_mesh,
    get_mesh_info as get_mesh_info,
    simulate_cpu_devices as simulate_cpu_devices,
)
from ._metrics import (
    Metric as Metric,
    MetricCollection as MetricCollection,
    print_metrics as print_metrics,
)
from ._reductions import (
    all_gather as all_gather,
    collect_from_devices as collect_from_devices,
    reduce_custom as reduce_custom,
    reduce_max as reduce_max,
    reduce_mean as reduce_mean,
    reduce_min as reduce_min,
    reduce_sum as reduce_sum,
)
from ._step.accumulate import accumulate_gradients as accumulate_gradients
from ._step.eval_step import EvalStep as EvalStep, make_eval_step as make_eval_step
from ._step.output import StepOutput as StepOutput
from ._step.state import TrainState as TrainState
from ._step.train_step import (
    TrainStep as TrainStep,
    make_train_step as make_train_step,
)
from ._weights import (
    LoRALinear as LoRALinear,
    load_safetensors as load_safetensors,
    lora as lora,
    lora_trainable as lora_trainable,
    merge_lora as merge_lora,
    save_safetensors as save_safetensors,
)

__version__ = "0.5.0.dev0"

# Names that moved into a namespace in 0.4: the top-level name still works, with a
# DeprecationWarning, for this one release.
_MOVED = {
    **{
        name: "metrics"
        for name in dir(metrics)
        if name[0].isupper() and name not in ("Metric", "MetricCollection")
    },
    **{
        name: "compat"
        for name in ("DataParallel", "DeviceMeshManager", "DistributedMetrics")
    },
}


def __getattr__(name: str) -> _Any:
    if name in _MOVED:
        namespace = _MOVED[name]
        _warnings.warn(
            f"eqxdist.{name} moved to eqxdist.{namespace}.{name} in eqxdist 0.4; "
            "the top-level name goes in 0.5.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(globals()[namespace], name)
    raise AttributeError(f"module 'eqxdist' has no attribute {name!r}")
