"""Pipeline parallelism's mechanism, in one folder (see `README.md` here): the
configuration (`config`), the schedules as tables (`schedules`, `slot_arrays`),
the loop that runs them (`engine`), what each entry computes (`stage_slots`,
`stage_passes`, `split_backward`), how a pipelined `Stacked` is called
(`stages`, `all_layers`) and where 1F1B cuts the loss (`cut_loss`,
`layer_reads`).

Code outside this folder imports only the names below, from here: the rest
is the folder's own (`tests/test_house.py` checks it)."""

from .config import (
    Pipeline,
    StagePlan,
    stage_plan,
    stage_spec,
    staged,
    with_data_axis,
)
from .cut_loss import CutLoss, cut
from .engine import stage_layers
from .layer_reads import loss_reads_layers, reads, stage_leaves
from .schedules import WRITTEN_OUT, slot_arrays, table
from .stage_passes import StagePasses, cotangent
from .stage_slots import StageSlots
from .stages import Seen, pipelined, to_chunk_order

__all__ = [
    "WRITTEN_OUT",
    "CutLoss",
    "Pipeline",
    "Seen",
    "StagePasses",
    "StagePlan",
    "StageSlots",
    "cotangent",
    "cut",
    "loss_reads_layers",
    "pipelined",
    "reads",
    "slot_arrays",
    "stage_layers",
    "stage_leaves",
    "stage_plan",
    "stage_spec",
    "staged",
    "table",
    "to_chunk_order",
    "with_data_axis",
]
