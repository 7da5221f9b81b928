"""The loop around the train step: metric writers, FLOPs and MFU, progress,
watchdog, and `train_loop` built from them."""

from .flops import mfu as mfu
from .loop import restore_latest as restore_latest, train_loop as train_loop
from .pieces import (
    Progress as Progress,
    Watchdog as Watchdog,
    enable_compilation_cache as enable_compilation_cache,
    learning_rate as learning_rate,
)
from .run import LoopResult as LoopResult
from .writers import (
    CsvWriter as CsvWriter,
    JsonlWriter as JsonlWriter,
    MultiWriter as MultiWriter,
    TensorBoardWriter as TensorBoardWriter,
    WandbWriter as WandbWriter,
    Writer as Writer,
    WriterBase as WriterBase,
)
