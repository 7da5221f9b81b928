"""Stateful distributed metrics: accumulators, the `Metric` base and collection, and
the built-in metrics. A leaf domain: it imports nothing of eqxdist but `_utils`."""

from .accumulator import (
    FoldAccumulator as FoldAccumulator,
    MetricAccumulator as MetricAccumulator,
    ReduceOp as ReduceOp,
)
from .aggregation import (
    LastValue as LastValue,
    Max as Max,
    Mean as Mean,
    Min as Min,
    Std as Std,
    Sum as Sum,
)
from .base import Metric as Metric, MetricCollection as MetricCollection
from .calibration import CalibrationError as CalibrationError
from .classification import (
    AUROC as AUROC,
    Accuracy as Accuracy,
    Perplexity as Perplexity,
)
from .confusion import (
    ConfusionMatrix as ConfusionMatrix,
    F1Score as F1Score,
    FBetaScore as FBetaScore,
    Precision as Precision,
    Recall as Recall,
)
from .confusion_scores import (
    CohenKappa as CohenKappa,
    JaccardIndex as JaccardIndex,
    MatthewsCorrCoef as MatthewsCorrCoef,
    Specificity as Specificity,
)
from .image import PSNR as PSNR, SSIM as SSIM
from .ranking import AveragePrecision as AveragePrecision
from .regression import (
    MeanAbsoluteError as MeanAbsoluteError,
    MeanSquaredError as MeanSquaredError,
    MeanSquaredLogError as MeanSquaredLogError,
    PearsonCorrCoef as PearsonCorrCoef,
    R2Score as R2Score,
)
from .retrieval import (
    MRR as MRR,
    NDCGAtK as NDCGAtK,
    PrecisionAtK as PrecisionAtK,
    RecallAtK as RecallAtK,
)
from .tree import print_metrics as print_metrics
