"""Mixture of experts: the dropless `MoE` layer, its routing and its grouped
products. Expert parallelism, the experts sharded over a mesh axis, is the
layout's (`_layout/experts`)."""

from .grouped import Experts as Experts
from .moe import (
    DISPATCHES as DISPATCHES,
    EXPERT_LEAVES as EXPERT_LEAVES,
    MoE as MoE,
    expert_leaves as expert_leaves,
)
from .routing import Config as Config, Routing as Routing
