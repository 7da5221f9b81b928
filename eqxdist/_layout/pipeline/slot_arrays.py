"""A schedule's table (`schedules`) in the array form the engine reads inside
the compiled loop: `(slots, stages)` int32 tables of each stage's action, its
microbatch and chunk, the buffer entries it reads and writes, and the
messages that arrive at the end of the slot.

**Buffers.** A stage whose backward is written out (`stage_slots`) keeps
four buffers: `stash` (what its F kept for the backward, until the backward
that is done with it: BW, or W after B), `inbox_f` (activations received,
until their F), `inbox_b` (cotangents received, or made by the loss after the
stack on the last stage, until their BW or B) and `pending` (what a B left
its W, until that W). Which entry of
a buffer each (microbatch, chunk) takes is decided here, on the host, by
giving each the first entry free when it arrives; a buffer is as long as the
most entries the table keeps in it at once on any stage (P for 1F1B's
stash). So every schedule's memory is what its table keeps alive, and none is
indexed by a formula the table could break.
"""

import dataclasses

import numpy as np

Slot = tuple[str, int, int] | None
Table = list[list[Slot]]

IDLE, FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2, 3, 4
_CODES = {None: IDLE, "F": FORWARD, "BW": BACKWARD, "B": INPUT_GRAD, "W": WEIGHT_GRAD}
_BACKWARDS = (BACKWARD, INPUT_GRAD)  # the entries that send a cotangent back


@dataclasses.dataclass(frozen=True)
class SlotArrays:
    """A table as `(slots, stages)` int32 arrays, what the engine indexes by
    slot and then by stage: `action` (`IDLE`, `FORWARD`, `BACKWARD`,
    `INPUT_GRAD` (B), `WEIGHT_GRAD` (W)), `micro` and `chunk` (the entry's; 0
    when idle), and for the messages that arrive at the end of the slot:
    `from_prev` (1 where the previous stage ran a forward whose output this
    stage takes next; on a ring, the last stage's to stage 0), `prev_micro`
    (its microbatch), `from_next` (1 where the next stage ran a backward whose
    input's cotangent this stage takes; on a ring, stage 0's to the last),
    `next_micro`; `sends_f` and `sends_b` (`(slots,)`, one value a row, the
    same on every stage: whether any stage receives an activation, or a
    cotangent, at the end of the slot; a row where none does runs no
    exchange that way).

    The buffer entries (see the module docstring; 0 where unused): `stash`
    (the entry's in `stash`), `read` (an F's in `inbox_f`, a backward's in
    `inbox_b`), `own` (the last stage's F of the last chunk: where the loss's
    cotangent goes in `inbox_b`), `prev_at` and `next_at` (where the arriving
    messages go), `pending` (a B's entry in `pending`, which its W reads);
    `sizes`: the four buffers' lengths."""

    action: np.ndarray
    micro: np.ndarray
    chunk: np.ndarray
    from_prev: np.ndarray
    prev_micro: np.ndarray
    from_next: np.ndarray
    next_micro: np.ndarray
    stash: np.ndarray
    read: np.ndarray
    own: np.ndarray
    prev_at: np.ndarray
    next_at: np.ndarray
    pending: np.ndarray
    sizes: tuple[int, int, int, int]
    sends_f: np.ndarray
    sends_b: np.ndarray

    @property
    def slots(self) -> int:
        return int(self.action.shape[0])

    @property
    def chunks(self) -> int:
        return 1 + int(self.chunk.max(initial=0))


def slot_arrays(rows: Table, *, ring: bool | None = None) -> SlotArrays:
    """`rows` in array form; on a ring (more than one chunk, or `ring`),
    stage 0 receives the last stage's forward of a chunk that is not the last
    one, and the last stage stage 0's backward of a chunk that is not the
    first."""
    action = np.array([[_CODES[e and e[0]] for e in row] for row in rows], np.int32)
    mb = np.array([[0 if e is None else e[1] for e in row] for row in rows], np.int32)
    chunk = np.array(
        [[0 if e is None else e[2] for e in row] for row in rows], np.int32
    )
    if ring is None:
        ring = bool(chunk.max(initial=0) > 0)
    from_prev, prev_micro, from_next, next_micro = _messages(action, mb, chunk, ring)
    buffers = _Buffers(action.shape, int(chunk.max(initial=0)))
    for t in range(len(rows)):
        buffers.slot(t, action[t], mb[t], chunk[t], (from_prev[t], from_next[t]))
    stash, read, own, prev_at, next_at, pending = buffers.tables
    return SlotArrays(
        action,
        mb,
        chunk,
        from_prev,
        prev_micro,
        from_next,
        next_micro,
        stash,
        read,
        own,
        prev_at,
        next_at,
        pending,
        buffers.sizes,
        np.asarray(from_prev.any(axis=1), np.int32),
        np.asarray(from_next.any(axis=1), np.int32),
    )


def _messages(
    action: np.ndarray, mb: np.ndarray, chunk: np.ndarray, ring: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`from_prev`, `prev_micro`, `from_next`, `next_micro` (see `SlotArrays`)."""
    slots, stages = action.shape
    last_chunk = int(chunk.max(initial=0))
    from_prev, prev_micro = np.zeros_like(action), np.zeros_like(action)
    from_next, next_micro = np.zeros_like(action), np.zeros_like(action)
    for t in range(slots):
        for s in range(stages):
            if s > 0 and action[t, s - 1] == FORWARD:
                from_prev[t, s], prev_micro[t, s] = 1, mb[t, s - 1]
            wraps = ring and s == 0
            if wraps and action[t, -1] == FORWARD and chunk[t, -1] < last_chunk:
                from_prev[t, s], prev_micro[t, s] = 1, mb[t, -1]
            if s < stages - 1 and action[t, s + 1] in _BACKWARDS:
                from_next[t, s], next_micro[t, s] = 1, mb[t, s + 1]
            wraps = ring and s == stages - 1
            if wraps and action[t, 0] in _BACKWARDS and chunk[t, 0] > 0:
                from_next[t, s], next_micro[t, s] = 1, mb[t, 0]
    return from_prev, prev_micro, from_next, next_micro


class _Buffers:
    """The buffer entries of every (microbatch, chunk) on every stage, given
    out slot by slot (`slot`): an entry is freed by the action done with it
    and taken by the next arrival."""

    def __init__(self, shape: tuple[int, ...], last_chunk: int) -> None:
        self.last_chunk = last_chunk
        self.tables = [np.zeros(shape, np.int32) for _ in range(6)]
        stages = shape[1]
        # Per buffer (stash, inbox_f, inbox_b, pending) and stage: (m, c) -> its
        # entry.
        self.held: list[list[dict[tuple[int, int], int]]] = [
            [{} for _ in range(stages)] for _ in range(4)
        ]
        self.most = [1, 1, 1, 1]

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.most[0], self.most[1], self.most[2], self.most[3])

    def _take(self, buffer: int, s: int, key: tuple[int, int]) -> int:
        held = self.held[buffer][s]
        assert key not in held, (buffer, s, key)
        entry = min(set(range(len(held) + 1)) - set(held.values()))
        held[key] = entry
        self.most[buffer] = max(self.most[buffer], entry + 1)
        return entry

    def slot(
        self,
        t: int,
        action: np.ndarray,
        mb: np.ndarray,
        chunk: np.ndarray,
        arrivals: tuple[np.ndarray, np.ndarray],
    ) -> None:
        stash, read, own, prev_at, next_at, pending = self.tables
        stages = len(action)
        for s in range(stages):
            key, a = (int(mb[s]), int(chunk[s])), action[s]
            if a == FORWARD:
                if s > 0 or key[1] > 0:
                    read[t, s] = self.held[1][s].pop(key)
                stash[t, s] = self._take(0, s, key)
                if s == stages - 1 and key[1] == self.last_chunk:
                    own[t, s] = self._take(2, s, key)
            elif a == WEIGHT_GRAD:
                # W frees the stash and what its B left it.
                stash[t, s] = self.held[0][s].pop(key)
                pending[t, s] = self.held[3][s].pop(key)
            elif a != IDLE:
                # B leaves the stash for its W, and what W reads in `pending`.
                stash[t, s] = _get(self.held[0][s], key, bool(a != INPUT_GRAD))
                read[t, s] = self.held[2][s].pop(key)
                if a == INPUT_GRAD:
                    pending[t, s] = self._take(3, s, key)
        for s in range(stages):
            if arrivals[0][s]:
                src = s - 1 if s > 0 else stages - 1
                c = int(chunk[src]) + (s == 0)
                prev_at[t, s] = self._take(1, s, (int(mb[src]), c))
            if arrivals[1][s]:
                src = s + 1 if s < stages - 1 else 0
                c = int(chunk[src]) - (s == stages - 1 and src == 0)
                next_at[t, s] = self._take(2, s, (int(mb[src]), c))


def _get(held: dict[tuple[int, int], int], key: tuple[int, int], free: bool) -> int:
    return held.pop(key) if free else held[key]
