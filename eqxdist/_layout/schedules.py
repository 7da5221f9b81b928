"""Every pipeline schedule as a table of slots: what each stage runs at each
time slot, the single source of what the step executes (`engine` runs it).

**The table.** One row per time slot, one entry per stage: `("F", m, c)` (the
forward pass of microbatch m through the stage's chunk c of layers), `("BW", m,
c)` (its backward pass, both gradients) or `None` (idle). All stages run a row
together; a message sent in a slot (an activation to the next stage, a
cotangent to the previous one) is read in a later one.

- `"gpipe"`: every forward (stage s runs microbatch t - s at slot t), then
  every backward in the reverse order, which is what JAX's autodiff of the
  forward loop runs.
- `"circular"` (`repeats` R chunks per stage): the forward goes round the ring
  R times: at slot t stage s runs step k = t - s, chunk k // M of microbatch k %
  M; then the backward, reversed, as for GPipe.
- `"1f1b"`: PipeDream-flush's order per stage (P - 1 - s warm-up forwards, then
  one forward and one backward in turn, then the remaining backwards), each
  stage taking its next action as soon as its input has arrived.

**Idle fraction.** Each stage runs its entries in the table's order, an F
taking one unit of time and a BW two (it runs the stage's forward again and
its VJP), each as soon as its stage is free and its inputs are there (F: the
previous stage's F of the microbatch; BW: the stage's own F and the next
stage's BW). `idle_fraction` is the idle time over all stages' time until the
last entry ends: P - 1 slots' worth of F and BW per stage for GPipe and 1F1B,
(P - 1)/(M + P - 1) of the whole. The compiled loop runs a row in lockstep,
as long as its longest entry, so its own idle time can be more (1F1B's rows
that mix F and BW).

**The array form** (`SlotArrays`) is what the engine reads inside the compiled
loop: `(slots, stages)` int32 tables of the actions and the messages.
"""

import dataclasses
from typing import Any

import numpy as np

from .._utils import typecheck

Slot = tuple[str, int, int] | None
Table = list[list[Slot]]

IDLE, FORWARD, BACKWARD = 0, 1, 2
_CODES = {None: IDLE, "F": FORWARD, "BW": BACKWARD}
_COST = {"F": 1, "BW": 2}


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
    micro, repeats = pipeline.microbatches, pipeline.repeats
    if pipeline.schedule == "1f1b":
        return one_f_one_b(int(stages), micro)
    forward = forward_rows(int(stages), micro, repeats)
    return forward + backward_rows(forward)


def idle_fraction(pipeline: Any, stages: int) -> float:
    """The idle time of `pipeline`'s table on `stages` stages over all
    stages' time (F one unit, BW two; see the module docstring)."""
    return idle_fraction_of(table(pipeline, stages))


def idle_fraction_of(rows: Table) -> float:
    """The idle fraction of a table (see the module docstring): idle time over
    stages x the time the last entry ends."""
    stages = len(rows[0]) if rows else 0
    chunks = 1 + max((e[2] for row in rows for e in row if e is not None), default=0)
    end: dict[tuple[str, int, int, int], int] = {}  # (kind, m, c, s) -> its end
    free = [0] * stages
    busy = 0
    for row in rows:
        for s, entry in enumerate(row):
            if entry is None:
                continue
            kind, m, c = entry
            needs = [_source(kind, m, c, s, stages, chunks)]
            if kind == "BW":
                needs.append(("F", m, c, s))
            start = max([free[s], *(end[n] for n in needs if n is not None)])
            end[(kind, m, c, s)] = free[s] = start + _COST[kind]
            busy += _COST[kind]
    total = stages * max(free, default=0)
    return (total - busy) / total if total else 0.0


def _source(
    kind: str, m: int, c: int, s: int, stages: int, chunks: int
) -> tuple[str, int, int, int] | None:
    """The entry whose message `(kind, m, c)` on stage `s` reads: the previous
    stage's F (chunk c - 1 on the last stage for stage 0), the next stage's BW
    (chunk c + 1 on stage 0 for the last); `None` at the ends."""
    if kind == "F":
        if s > 0:
            return ("F", m, c, s - 1)
        return ("F", m, c - 1, stages - 1) if c > 0 else None
    if s < stages - 1:
        return ("BW", m, c, s + 1)
    return ("BW", m, c + 1, 0) if c < chunks - 1 else None


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


def one_f_one_b(stages: int, micro: int) -> Table:
    """PipeDream-flush's 1F1B on a clock of slots (see the module docstring);
    checked to keep at most P - s microbatches in flight on stage s."""
    orders = []
    for s in range(stages):
        warm = min(stages - 1 - s, micro)
        order = [("F", m) for m in range(warm)]
        for f in range(warm, micro):
            order += [("F", f), ("BW", f - warm)]
        order += [("BW", m) for m in range(micro - warm, micro)]
        orders.append(order)
    done: dict[tuple[str, int, int], int] = {}  # (action, m, s) -> slot done
    position = [0] * stages
    rows: Table = []
    while any(position[s] < len(orders[s]) for s in range(stages)):
        t = len(rows)
        row: list[Slot] = []
        for s in range(stages):
            if position[s] == len(orders[s]):
                row.append(None)
                continue
            act, m = orders[s][position[s]]
            if act == "F":
                ready = s == 0 or done.get(("F", m, s - 1), t) < t
            else:
                ready = done.get(("F", m, s), t) < t and (
                    s == stages - 1 or done.get(("BW", m, s + 1), t) < t
                )
            row.append((act, m, 0) if ready else None)
        for s, entry in enumerate(row):
            if entry is not None:
                done[(entry[0], entry[1], s)] = t
                position[s] += 1
        rows.append(row)
    _check_in_flight(rows)
    return rows


def _check_in_flight(rows: Table) -> None:
    """At most P - s microbatches between stage s's forward and backward
    steps, so buffers of P entries indexed by microbatch modulo P never lose an
    entry still needed."""
    stages = len(rows[0])
    for s in range(stages):
        alive = 0
        for t, row in enumerate(rows):
            alive += {"F": 1, "BW": -1}.get(_kind(row[s]) or "", 0)
            assert 0 <= alive <= stages - s, (s, t, alive)


def _kind(entry: Slot) -> str | None:
    return None if entry is None else entry[0]


@dataclasses.dataclass(frozen=True)
class SlotArrays:
    """A table as `(slots, stages)` int32 arrays, what the engine indexes by
    slot and then by stage: `action` (`IDLE`, `FORWARD`, `BACKWARD`), `micro`
    and `chunk` (the entry's; 0 when idle), and for the messages that arrive at
    the end of the slot: `from_prev` (1 where the previous stage ran a forward
    whose output this stage takes next; on a ring, the last stage's to stage
    0), `prev_micro` (its microbatch), `from_next` (1 where the next stage ran
    a backward: its input's cotangent arrives), `next_micro`."""

    action: np.ndarray
    micro: np.ndarray
    chunk: np.ndarray
    from_prev: np.ndarray
    prev_micro: np.ndarray
    from_next: np.ndarray
    next_micro: np.ndarray

    @property
    def slots(self) -> int:
        return int(self.action.shape[0])


def slot_arrays(rows: Table, *, ring: bool = False) -> SlotArrays:
    """`rows` in array form; with `ring` (the circular schedule), stage 0
    receives the last stage's forward of a chunk that is not the last one."""
    stages = len(rows[0])
    action = np.array([[_CODES[_kind(e)] for e in row] for row in rows], np.int32)
    mb = np.array([[0 if e is None else e[1] for e in row] for row in rows], np.int32)
    chunk = np.array(
        [[0 if e is None else e[2] for e in row] for row in rows], np.int32
    )
    last_chunk = int(chunk.max(initial=0))
    from_prev, prev_micro = np.zeros_like(action), np.zeros_like(action)
    from_next, next_micro = np.zeros_like(action), np.zeros_like(action)
    for t in range(len(rows)):
        for s in range(stages):
            if s > 0 and action[t, s - 1] == FORWARD:
                from_prev[t, s], prev_micro[t, s] = 1, mb[t, s - 1]
            wraps = ring and s == 0
            if wraps and action[t, -1] == FORWARD and chunk[t, -1] < last_chunk:
                from_prev[t, s], prev_micro[t, s] = 1, mb[t, -1]
            if s < stages - 1 and action[t, s + 1] == BACKWARD:
                from_next[t, s], next_micro[t, s] = 1, mb[t, s + 1]
    return SlotArrays(action, mb, chunk, from_prev, prev_micro, from_next, next_micro)


def forward_arrays(stages: int, micro: int, repeats: int) -> SlotArrays:
    """The array form of the forward half of GPipe and the circular schedule:
    what the forward engine runs (JAX runs the backward half)."""
    rows = forward_rows(stages, micro, repeats)
    return slot_arrays(rows, ring=repeats > 1)
