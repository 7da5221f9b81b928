"""Checkpoints on Orbax: atomic, verified, multi-process saves and restores, and the
`CheckpointManager` for training loops. A leaf domain: it imports only `_utils` and
`_mesh` of eqxdist."""

from .api import (
    CheckpointNotFoundError as CheckpointNotFoundError,
    latest_step as latest_step,
    restore_checkpoint as restore_checkpoint,
    save_checkpoint as save_checkpoint,
)
from .manager import CheckpointManager as CheckpointManager
