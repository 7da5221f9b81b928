"""Reading a compiled step: how many collectives of each kind it executes, and
XLA's cost analysis of it."""

import re
from typing import Any

import jax

from ._utils import typecheck

COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
)

_HEAD = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_LOOP = re.compile(r"while\(.*body=%?([\w.\-]+)")
_TRIPS = re.compile(r'known_trip_count"?[:=]\{"?n"?[:=]"?(\d+)')
_OP = re.compile(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


@typecheck
def count_collectives(compiled: Any) -> dict[str, int]:
    """How many collectives of each kind one run of a compiled program executes:
    the way to check that a layout communicates as it should (e.g. that an FSDP
    step with gradient accumulation gathers once per step, not per minibatch).

    Counts the ops of XLA's optimised HLO; an op inside a loop body counts as many
    times as the loop runs (when XLA knows the trip count, as for `jax.lax.scan`).

    **Arguments:**

    - `compiled`: a compiled program (`step.lower(state, batch).compile()`, or
      any `jax.jit(f).lower(...).compile()`) or the text of its HLO.

    **Returns:**

    `{kind: count}` for `"all-gather"`, `"reduce-scatter"`, `"all-reduce"`,
    `"all-to-all"` and `"collective-permute"`.

    !!! Example

        ```python
        compiled = step.lower(state, batch).compile()
        ed.count_collectives(compiled)
        # {'all-gather': 4, 'reduce-scatter': 4, 'all-reduce': 1, ...}
        ```
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    bodies: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head:
            current = head.group(1)
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    trips: dict[str, int] = {}
    for lines in bodies.values():
        for line in lines:
            loop = _LOOP.search(line)
            if loop:
                n = _TRIPS.search(line)
                trips[loop.group(1)] = int(n.group(1)) if n else 1
    counts = dict.fromkeys(COLLECTIVES, 0)
    for name, lines in bodies.items():
        for line in lines:
            op = _OP.search(line.split("=", 1)[-1]) if " = " in line else None
            if op:
                counts[op.group(1)] += trips.get(name, 1)
    return counts


def compiled_cost(lowered: Any, devices: int) -> dict[str, float]:
    """XLA's cost analysis of a lowered step, as totals over its `devices` (XLA
    reports one device's partitioned program): `TrainStep.cost`."""
    compiled = lowered.compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):  # one entry per program on older JAX
        analysis = analysis[0] if analysis else {}
    cost = {k: float(v) * devices for k, v in (analysis or {}).items()}
    if "flops" not in cost:
        raise ValueError(
            "TrainStep.cost: XLA's cost analysis of this step has no 'flops' entry "
            f"on {jax.default_backend()}; count the FLOPs analytically instead."
        )
    return cost
