"""Long sequences and large vocabularies: attention over a sequence sharded over a
context axis, and cross-entropies that never gather or materialise the logits."""

from .attention import attention as attention
from .cross_entropy import cross_entropy as cross_entropy
from .linear_cross_entropy import linear_cross_entropy as linear_cross_entropy
from .order import (
    context_positions as context_positions,
    from_context_order as from_context_order,
    to_context_order as to_context_order,
)
