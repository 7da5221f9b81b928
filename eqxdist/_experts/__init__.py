"""Mixture of experts: the dropless `MoE` layer and the expert-parallel
computation of its experts sharded over a mesh axis."""

from .dispatch import (
    experts_device_view as experts_device_view,
    experts_global_view as experts_global_view,
)
from .grouped import Experts as Experts
from .moe import (
    EXPERT_LEAVES as EXPERT_LEAVES,
    MoE as MoE,
    with_expert_axis as with_expert_axis,
)
from .routing import Config as Config
