"""Every pipeline schedule as a table of slots: what each stage runs at each
time slot, the single source of what the step executes (`engine` runs it).

**The table.** One row per time slot, one entry per stage: `("F", m, c)` (the
forward pass of microbatch m through the stage's chunk c of layers), `("BW", m,
c)` (its backward pass, both gradients), `("B", m, c)` (the backward pass for
the input's gradient only), `("W", m, c)` (the one for the weights' gradient,
after the B) or `None` (idle). All stages run a row together; a message sent
in a slot (an activation to the next stage, a cotangent to the previous one)
is read in a later one.

- `"gpipe"`: every forward (stage s runs microbatch t - s at slot t), then
  every backward in the reverse order, which is what JAX's autodiff of the
  forward loop runs.
- `"circular"` (`repeats` R chunks per stage): the forward goes round the ring
  R times: at slot t stage s runs step k = t - s, chunk k // M of microbatch k %
  M; then the backward, reversed, as for GPipe.
- `"1f1b"`: PipeDream-flush's order per stage (P - 1 - s warm-up forwards, then
  one forward and one backward in turn, then the remaining backwards), each
  backward split into B (the pass that sends the cotangent back) and W right
  after it, each stage taking its next entry as soon as its input has arrived.
  Split, because a row lasts as long as its longest entry: a BW (two units)
  beside another stage's F (one) idles that stage a unit, and 1F1B's steady
  state mixes them in every row (with BW entries it would idle 0.400 at P =
  4, M = 8, more than GPipe's 0.273; split, 0.200).
- `"interleaved"` (R chunks per stage, held as the circular schedule holds
  them): Megatron's interleaved 1F1B. The forwards go in groups of P
  microbatches, each group through chunk 0, then chunk 1, ...; the backwards
  in the same groups, the chunks in reverse; stage s runs 2 (P - 1 - s) + (R -
  1) P warm-up forwards, then one forward and one backward in turn (more
  warm-up where a group is not whole and the clock would stall); each
  backward split into B and W as for 1F1B, for the same reason (with BW
  entries 0.294 at P = 4, M = 8, R = 2, worse than GPipe; split, 0.111).
- `"zb-h1"`: 1F1B's order of forwards and input-gradient passes B, each
  backward split in two; a stage runs its next F or B as soon as its input has
  arrived, and a deferred W (oldest first) when it cannot: while it waits, or
  where one more F would keep more microbatches alive (F run, W not yet) than
  1F1B does (P - s on stage s).

**Idle fraction.** The table counted as the lockstep loop the step compiles:
every stage runs its entry of a row together, and the row lasts as long as its
longest entry (F, B and W one unit of time, BW two: it runs the stage's
forward again and its VJP; an idle entry none). `idle_fraction` is the idle
time of all stages over P x the sum of the rows' durations: the bubble the step
pays, no replay of entries started as soon as they could. GPipe and the
circular schedule: (P - 1)/(R M + P - 1) (forward rows of one unit, backward
rows of two); 1F1B and interleaved 1F1B (M a multiple of P):
2 (P - 1)/(3 R M + 2 (P - 1)); ZB-H1 (M >= P): (P - 1)/(3 M + P - 1).

**The array form** (`slot_arrays.SlotArrays`) is what the engine reads inside
the compiled loop.
"""

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..._utils import typecheck
from .slot_arrays import (
    BACKWARD,
    FORWARD,
    IDLE,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Slot,
    SlotArrays,
    Table,
    slot_arrays,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "IDLE",
    "INPUT_GRAD",
    "WEIGHT_GRAD",
    "WRITTEN_OUT",
    "Slot",
    "SlotArrays",
    "Table",
    "forward_arrays",
    "idle_fraction",
    "idle_fraction_of",
    "slot_arrays",
    "table",
]

# The schedules whose backward is written out (`stage_slots`), not left to
# JAX's autodiff of a forward loop: a stage runs F, B and W entries in the
# order of the table (each backward split into B and W).
WRITTEN_OUT = ("1f1b", "interleaved", "zb-h1")

_COST = {"F": 1, "B": 1, "W": 1, "BW": 2}
Key = tuple[str, int, int, int]  # (kind family "F" | "B" | "W", m, c, stage)


@typecheck
def table(pipeline: Any, stages: int) -> Table:
    """The schedule of `pipeline` (an `ed.Pipeline`: its `schedule`,
    `microbatches` and `repeats`) on `stages` stages (see the module
    docstring)."""
    caller = "pipeline.table"
    if isinstance(stages, bool) or not isinstance(stages, int | np.integer):
        raise TypeError(
            f"{caller}: `stages` must be an int, the size of the pipeline's mesh "
            f"axis; got {stages!r}."
        )
    if stages < 1:
        raise ValueError(
            f"{caller}: `stages` must be >= 1 (the size of the pipeline's mesh "
            f"axis); got {stages}."
        )
    stages, micro, repeats = int(stages), pipeline.microbatches, pipeline.repeats
    if pipeline.schedule == "1f1b":
        return one_f_one_b(stages, micro)
    if pipeline.schedule == "interleaved":
        return interleaved(stages, micro, repeats)
    if pipeline.schedule == "zb-h1":
        return zero_bubble(stages, micro)
    forward = forward_rows(stages, micro, repeats)
    return forward + backward_rows(forward)


def idle_fraction(pipeline: Any, stages: int) -> float:
    """The idle time of `pipeline`'s table on `stages` stages, run as the
    lockstep loop the step compiles, over all stages' time (see the module
    docstring)."""
    return idle_fraction_of(table(pipeline, stages))


def idle_fraction_of(rows: Table) -> float:
    """The idle fraction of a table run in lockstep (see the module
    docstring): each row lasts as long as its longest entry (F, B and W one
    unit, BW two, `None` none); the idle time of all stages over stages x the
    rows' total duration."""
    total = busy = 0
    for row in rows:
        costs = [0 if entry is None else _COST[entry[0]] for entry in row]
        total += len(row) * max(costs, default=0)
        busy += sum(costs)
    return (total - busy) / total if total else 0.0


def _family(kind: str) -> str:
    """`"B"` for both backwards that pass a cotangent on (B and BW)."""
    return "B" if kind == "BW" else kind


def _needs(kind: str, m: int, c: int, s: int, stages: int, chunks: int) -> list[Key]:
    """The entries that `(kind, m, c)` on stage `s` waits for: an F the
    previous stage's F (chunk c - 1 on the last stage for stage 0); a B or BW
    the stage's own F and the next stage's backward (chunk c + 1 on stage 0 for
    the last); a W the stage's own B."""
    if kind == "W":
        return [("B", m, c, s)]
    if kind == "F":
        if s > 0:
            return [("F", m, c, s - 1)]
        return [("F", m, c - 1, stages - 1)] if c > 0 else []
    own: list[Key] = [("F", m, c, s)]
    if s < stages - 1:
        return [*own, ("B", m, c, s + 1)]
    return [*own, ("B", m, c + 1, 0)] if c < chunks - 1 else own


def forward_rows(stages: int, micro: int, repeats: int) -> Table:
    """The forward half of GPipe (`repeats == 1`) and the circular schedule:
    R M + P - 1 slots; at slot t stage s runs step k = t - s (chunk k // M,
    microbatch k % M) while 0 <= k < R M."""
    work = repeats * micro
    rows: Table = []
    for t in range(work + stages - 1):
        row: list[Slot] = []
        for s in range(stages):
            k = t - s
            row.append(("F", k % micro, k // micro) if 0 <= k < work else None)
        rows.append(row)
    return rows


def backward_rows(forward: Table) -> Table:
    """The backward half of a schedule whose backward is autodiff's of its
    forward loop: the forward's slots in reverse, each F a BW."""
    return [
        [None if e is None else ("BW", e[1], e[2]) for e in row]
        for row in forward[::-1]
    ]


Entry = tuple[str, int, int]
Order = list[Entry]


def one_f_one_b(stages: int, micro: int) -> Table:
    """PipeDream-flush's 1F1B on a clock of slots, each backward split into B
    and W (see the module docstring); checked to keep at most P - s
    microbatches in flight on stage s."""
    orders = []
    for s in range(stages):
        forwards = [(m, 0) for m in range(micro)]
        orders.append(_one_then_one(forwards, forwards, min(stages - 1 - s, micro)))
    rows = _clock(orders)
    assert rows is not None  # 1F1B's order never stalls
    _check_in_flight(rows, lambda s: stages - s)
    return rows


def _one_then_one(
    forwards: list[tuple[int, int]],
    backwards: list[tuple[int, int]],
    warm: int,
    backward: tuple[str, ...] = ("B", "W"),
) -> Order:
    """`warm` forwards, then one forward and one backward in turn, then the
    remaining backwards; each backward the entries of kinds `backward` in
    turn (B then W: the backward split in two)."""

    def back(e: tuple[int, int]) -> Order:
        return [(kind, *e) for kind in backward]

    order: Order = [("F", *e) for e in forwards[:warm]]
    for i, e in enumerate(forwards[warm:]):
        order += [("F", *e), *back(backwards[i])]
    return order + [x for e in backwards[len(forwards) - warm :] for x in back(e)]


def interleaved(stages: int, micro: int, repeats: int) -> Table:
    """Interleaved 1F1B, each backward split into B and W (see the module
    docstring)."""
    groups = [range(g, min(g + stages, micro)) for g in range(0, micro, stages)]
    forwards = [(m, c) for g in groups for c in range(repeats) for m in g]
    backwards = [(m, c) for g in groups for c in reversed(range(repeats)) for m in g]
    for extra in range(len(forwards) + 1):
        orders = []
        for s in range(stages):
            warm = 2 * (stages - 1 - s) + (repeats - 1) * stages + extra
            orders.append(_one_then_one(forwards, backwards, min(warm, len(forwards))))
        rows = _clock(orders, repeats)
        if rows is not None:
            return rows
    raise AssertionError("every forward first never stalls")


def zero_bubble(stages: int, micro: int) -> Table:
    """ZB-H1 (see the module docstring), checked to keep at most P - s
    microbatches alive (F run, W not yet) on stage s, as 1F1B does."""
    firsts = []
    for s in range(stages):
        forwards = [(m, 0) for m in range(micro)]
        warm = min(stages - 1 - s, micro)
        firsts.append(_one_then_one(forwards, forwards, warm, backward=("B",)))
    deferred: list[list[tuple[int, int]]] = [[] for _ in range(stages)]
    alive = [0] * stages

    def choose(s: int, ready: Callable[[Entry], bool]) -> Slot:
        order = firsts[s]
        if order:
            kind, m, c = order[0]
            fits = kind == "B" or alive[s] < stages
            if fits and ready(order[0]):
                order.pop(0)
                alive[s] += kind == "F"
                if kind == "B":
                    deferred[s].append((m, c))
                return (kind, m, c)
        if deferred[s]:
            alive[s] -= 1
            return ("W", *deferred[s].pop(0))
        return None

    rows = _clock_choosing(stages, 1, choose)
    assert not any(firsts) and not any(deferred)  # never stalls
    _check_in_flight(rows, lambda s: stages)
    return rows


def _clock(orders: list[Order], chunks: int = 1) -> Table | None:
    """Each stage's `orders` run in turn on a clock of slots, each entry as
    soon as its inputs were sent in an earlier slot; `None` where the clock
    stalls (no stage can run its next entry, entries left)."""
    position = [0] * len(orders)

    def choose(s: int, ready: Callable[[Entry], bool]) -> Slot:
        if position[s] == len(orders[s]) or not ready(orders[s][position[s]]):
            return None
        position[s] += 1
        return orders[s][position[s] - 1]

    rows = _clock_choosing(len(orders), chunks, choose)
    return rows if position == [len(o) for o in orders] else None


def _clock_choosing(
    stages: int, chunks: int, choose: Callable[[int, Callable[[Entry], bool]], Slot]
) -> Table:
    """Rows of slots: at each, `choose(s, ready)` gives stage s's entry (or
    `None`), `ready(entry)` telling whether its inputs were sent in an earlier
    slot; until a slot where no stage runs anything (nothing changes after it:
    every stage is done, or the clock stalls)."""
    done: set[Key] = set()
    rows: Table = []

    def ready(s: int, entry: Entry) -> bool:
        kind, m, c = entry
        return all(n in done for n in _needs(kind, m, c, s, stages, chunks))

    while True:
        row = [choose(s, functools.partial(ready, s)) for s in range(stages)]
        if all(e is None for e in row):
            return rows
        rows.append(row)
        for s, e in enumerate(row):
            if e is not None:
                done.add((_family(e[0]), e[1], e[2], s))


def _check_in_flight(rows: Table, limit: Callable[[int], int]) -> None:
    """At most `limit(s)` microbatches alive on stage s (between its F and its
    BW or W), never fewer than none."""
    for s in range(len(rows[0]) if rows else 0):
        alive = 0
        for t, row in enumerate(rows):
            kind = None if row[s] is None else row[s][0]  # type: ignore[index]
            alive += {"F": 1, "BW": -1, "W": -1}.get(kind or "", 0)
            assert 0 <= alive <= limit(s), (s, t, alive)


def forward_arrays(stages: int, micro: int, repeats: int) -> SlotArrays:
    """The array form of the forward half of GPipe and the circular schedule:
    what the forward engine runs (JAX runs the backward half)."""
    return slot_arrays(forward_rows(stages, micro, repeats))
