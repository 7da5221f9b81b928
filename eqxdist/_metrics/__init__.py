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
from .tree import print_metrics as print_metrics
