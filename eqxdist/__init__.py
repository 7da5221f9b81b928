"""eqxdist: distributed training for Equinox on JAX.

The whole public API is importable from here (`import eqxdist as ed`).
"""

from ._accumulate import accumulate_gradients as accumulate_gradients
from ._checkpoint import (
    CheckpointManager as CheckpointManager,
    CheckpointNotFoundError as CheckpointNotFoundError,
    latest_step as latest_step,
    restore_checkpoint as restore_checkpoint,
    save_checkpoint as save_checkpoint,
)
from ._compat import (
    DataParallel as DataParallel,
    DeviceMeshManager as DeviceMeshManager,
    DistributedMetrics as DistributedMetrics,
)
from ._data import BatchLoader as BatchLoader
from ._data_parallel import (
    all_reduce_gradients as all_reduce_gradients,
    create_data_parallel_sharding as create_data_parallel_sharding,
    replicate_params as replicate_params,
    shard_batch as shard_batch,
    shard_model_state as shard_model_state,
)
from ._distributed import initialize_distributed as initialize_distributed
from ._eval import EvalStep as EvalStep, make_eval_step as make_eval_step
from ._flags import (
    enable_gpu_collective_overlap as enable_gpu_collective_overlap,
    gpu_xla_flags as gpu_xla_flags,
)
from ._fsdp import (
    FSDP as FSDP,
    gather_params as gather_params,
    shard_params as shard_params,
    sync_gradients as sync_gradients,
)
from ._hlo import count_collectives as count_collectives
from ._layers import FSDPSequential as FSDPSequential, Stacked as Stacked
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
    AUROC as AUROC,
    MRR as MRR,
    PSNR as PSNR,
    SSIM as SSIM,
    Accuracy as Accuracy,
    AveragePrecision as AveragePrecision,
    CalibrationError as CalibrationError,
    CohenKappa as CohenKappa,
    ConfusionMatrix as ConfusionMatrix,
    F1Score as F1Score,
    FBetaScore as FBetaScore,
    FoldAccumulator as FoldAccumulator,
    JaccardIndex as JaccardIndex,
    LastValue as LastValue,
    MatthewsCorrCoef as MatthewsCorrCoef,
    Max as Max,
    Mean as Mean,
    MeanAbsoluteError as MeanAbsoluteError,
    MeanSquaredError as MeanSquaredError,
    MeanSquaredLogError as MeanSquaredLogError,
    Metric as Metric,
    MetricAccumulator as MetricAccumulator,
    MetricCollection as MetricCollection,
    Min as Min,
    NDCGAtK as NDCGAtK,
    PearsonCorrCoef as PearsonCorrCoef,
    Perplexity as Perplexity,
    Precision as Precision,
    PrecisionAtK as PrecisionAtK,
    R2Score as R2Score,
    Recall as Recall,
    RecallAtK as RecallAtK,
    ReduceOp as ReduceOp,
    Specificity as Specificity,
    Std as Std,
    Sum as Sum,
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
from ._rules import fsdp_specs as fsdp_specs
from ._state import TrainState as TrainState
from ._steps import TrainStep as TrainStep, make_train_step as make_train_step
from ._train import fold_rng_over_axis as fold_rng_over_axis

__version__ = "0.3.0"
