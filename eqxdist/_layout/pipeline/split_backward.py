"""One block's backward pass split in the two halves a zero-bubble schedule
runs apart (`stage_slots`): **B**, the cotangent of the block's input, and
**W**, the gradients of its weights, each computing only its own products.

The pullback of `jax.vjp` computes both at once. Traced as a program (a jaxpr
of the residuals and the output's cotangent), it splits on its outputs:
pruned to the input's cotangent (JAX's dead-code rule, which also prunes
inside a `jax.checkpoint`'s recomputation) it is B; pruned to the weights'
gradients it is W's work, of which B has already done part: the cotangents
flowing between the block's products (in an MLP, the hidden layer's, from
which the first weight's gradient comes). B hands W those values (`saved`:
what W reads that B computed, or the output's cotangent itself), so W runs
only the equations B did not: each weight's product with its saved operands —
the zero-bubble paper's W, with no forward and no input-gradient chain.

The split is of the traced program, so it holds for any block whatever its
layers (plain `x @ W`, Equinox modules, attention): what W runs is exactly
what the weights' gradients need beyond B. An equation both halves need
whole (a `jax.checkpoint` whose recomputation feeds both) runs in each, pruned
to its half: under a remat policy W recomputes what the policy did not keep,
as the user chose.
"""

import dataclasses
from typing import Any

import jax
from jax.extend import core as jex_core

from ..._jax import dce_jaxpr, eval_jaxpr, jaxpr_of


@dataclasses.dataclass(frozen=True)
class SplitBackward:
    """A pullback's program cut in B and W.

    - `input_grad(res, ct) -> (dh, saved)`: the cotangents of the first `n_dh`
      outputs of the pullback (the block's input) and the values W reads;
    - `weight_grad(res, saved) -> dw`: the other outputs (the weights'),
    with `res` the pullback's residual leaves and `ct` the output cotangent's
    leaves;
    - `w_reads`: for each residual leaf, whether W reads it (one W does not
      read is dead once B has run: its room may hold what B hands W)."""

    b: Any
    w: Any
    consts: list[Any]
    n_saved: int
    w_reads: tuple[bool, ...]

    @classmethod
    def trace(cls, pullback: Any, res: list[Any], ct: list[Any], n_dh: int) -> Any:
        """Split `pullback(res, ct) -> leaves` (the first `n_dh` leaves: the
        block input's cotangent), traced on the values `res` and `ct`."""
        closed = jax.make_jaxpr(pullback)(res, ct)
        jaxpr, consts = closed.jaxpr, closed.consts
        n_res = len(res)
        res_vars, ct_vars = jaxpr.invars[:n_res], jaxpr.invars[n_res:]
        outs = jaxpr.outvars
        b = dce_jaxpr(jaxpr, [i < n_dh for i in range(len(outs))])
        w = dce_jaxpr(jaxpr, [i >= n_dh for i in range(len(outs))])
        by_b = {v for e in b.eqns for v in e.outvars}
        # W runs what B did not compute; an equation B ran whole is skipped.
        w_eqns = [e for e in w.eqns if not all(v in by_b for v in e.outvars)]
        defined = {v for e in w_eqns for v in e.outvars} | set(res_vars)
        defined |= set(jaxpr.constvars)
        saved: list[Any] = []
        for v in [*(u for e in w_eqns for u in e.invars), *outs[n_dh:]]:
            if isinstance(v, jex_core.Var) and v not in defined and v not in saved:
                saved.append(v)
        assert all(v in by_b or v in ct_vars for v in saved)
        b_prog = jaxpr_of(jaxpr, [*res_vars, *ct_vars], [*outs[:n_dh], *saved], b.eqns)
        w_prog = jaxpr_of(jaxpr, [*res_vars, *saved], list(outs[n_dh:]), w_eqns)
        read = {
            u
            for u in [*(u for e in w_eqns for u in e.invars), *outs[n_dh:]]
            if isinstance(u, jex_core.Var)
        }
        w_reads = tuple(v in read for v in res_vars)
        return cls(b_prog, w_prog, list(consts), len(saved), w_reads)

    def input_grad(self, res: list[Any], ct: list[Any]) -> tuple[list[Any], list[Any]]:
        out = eval_jaxpr(self.b, self.consts, *res, *ct)
        n = len(out) - self.n_saved
        return out[:n], out[n:]

    def weight_grad(self, res: list[Any], saved: list[Any]) -> list[Any]:
        return eval_jaxpr(self.w, self.consts, *res, *saved)
