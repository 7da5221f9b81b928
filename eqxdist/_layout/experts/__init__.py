"""Expert parallelism's mechanism, in one folder (see `README.md` here): the
`ed.MoE` layer routes its tokens and computes its experts (`_experts`); here is
where the experts are and how the tokens reach them. Each `MoE` the loss sees
is an `ExpertParallel` (`parts/experts.py`'s `for_loss`: a subclass adding the
axis), the dispatches
(`dispatch`: an all-gather of the tokens, or `exchange`'s all-to-alls) send
them, in the device view or the global view.

Code outside this folder imports only the names below, from here: the rest
is the folder's own (`tests/test_house.py` checks it)."""

from .parallel import ExpertParallel, expert_axes, whole_loss, with_expert_axis

__all__ = ["ExpertParallel", "expert_axes", "whole_loss", "with_expert_axis"]
