"""Stateful distributed metrics: `import eqxdist as ed; ed.metrics.Accuracy()`.

Every metric is an immutable `eqx.Module` whose state is linearly additive
(sums and counts): `update(...)` folds a batch in, `merge(other)` adds two
states, `sync(axis_name)` adds every device's state inside `jax.shard_map` (one
collective per reduce operation and dtype in a `MetricCollection`), and
`compute()` gives the value. `ed.Metric`, `ed.MetricCollection` and
`ed.print_metrics` stay at the top level; the accumulators that metrics are
built from (`MetricAccumulator`, `FoldAccumulator`, `ReduceOp`) are here, for
metrics of one's own.
"""

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
