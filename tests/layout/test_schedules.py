"""Every pipeline schedule's table of slots, checked from first principles: each
stage runs every (microbatch, chunk) forward and backward exactly once, no entry
runs before the messages it reads were sent, at most P microbatches are in
flight on a stage, the idle fraction is the bubble of the textbook formula, and
the array form the engine reads says where each message lands."""

import numpy as np
import pytest

import eqxdist as ed
from eqxdist._layout.schedules import (
    BACKWARD,
    FORWARD,
    IDLE,
    forward_arrays,
    forward_rows,
    idle_fraction,
    idle_fraction_of,
    slot_arrays,
    table,
)

CASES = [
    ("gpipe", 1, 4, 8),
    ("gpipe", 1, 2, 3),
    ("gpipe", 1, 1, 2),
    ("circular", 2, 4, 8),
    ("circular", 3, 2, 2),
    ("1f1b", 1, 4, 8),
    ("1f1b", 1, 4, 2),
    ("1f1b", 1, 3, 7),
    ("1f1b", 1, 1, 3),
]


def _pipeline(schedule, repeats, micro):
    return ed.Pipeline("stage", micro, schedule=schedule, repeats=repeats)


def _slots(rows):
    """`(kind, m, c, s) -> slot` of every entry, each seen once."""
    at = {}
    for t, row in enumerate(rows):
        for s, entry in enumerate(row):
            if entry is not None:
                assert (*entry, s) not in at, (entry, s)
                at[(*entry, s)] = t
    return at


@pytest.mark.parametrize(("schedule", "repeats", "stages", "micro"), CASES)
def test_each_stage_runs_every_microbatch_and_chunk_once(
    schedule, repeats, stages, micro
):
    rows = table(_pipeline(schedule, repeats, micro), stages)
    assert all(len(row) == stages for row in rows)
    want = {
        (kind, m, c, s)
        for kind in ("F", "BW")
        for m in range(micro)
        for c in range(repeats)
        for s in range(stages)
    }
    assert set(_slots(rows)) == want
    assert all(any(e is not None for e in row) for row in rows)


@pytest.mark.parametrize(("schedule", "repeats", "stages", "micro"), CASES)
def test_no_entry_runs_before_its_inputs(schedule, repeats, stages, micro):
    """F on stage s after the F it reads (stage s - 1's, or round the ring the
    last stage's of the chunk before); BW after the stage's own F and the BW of
    the stage after it (round the ring: stage 0's of the next chunk)."""
    at = _slots(table(_pipeline(schedule, repeats, micro), stages))
    last = stages - 1
    for (kind, m, c, s), t in at.items():
        if kind == "F":
            if s > 0:
                assert at[("F", m, c, s - 1)] < t
            elif c > 0:
                assert at[("F", m, c - 1, last)] < t
        else:
            assert at[("F", m, c, s)] < t
            if s < last:
                assert at[("BW", m, c, s + 1)] < t
            elif c < repeats - 1:
                assert at[("BW", m, c + 1, 0)] < t


@pytest.mark.parametrize(
    ("repeats", "stages", "micro"), [(1, 4, 8), (2, 4, 8), (3, 2, 2)]
)
def test_forward_schedules_pass_activations_on_in_the_next_slot(repeats, stages, micro):
    """The forward engine reads the previous stage's output of the slot before
    (no inbox; stage 0 keeps what comes round the ring in its loop-back
    buffer until its slot), and the backward half is the forward's slots reversed (what
    autodiff of the forward loop runs)."""
    rows = forward_rows(stages, micro, repeats)
    assert len(rows) == repeats * micro + stages - 1
    at = _slots(rows)
    for (_, m, c, s), t in at.items():
        if s > 0:
            assert at[("F", m, c, s - 1)] == t - 1
        elif c > 0:
            assert at[("F", m, c - 1, stages - 1)] <= t - 1
    schedule = "circular" if repeats > 1 else "gpipe"
    full = table(_pipeline(schedule, repeats, micro), stages)
    assert full[: len(rows)] == rows
    for forward, backward in zip(rows, full[len(rows) :][::-1], strict=True):
        assert [e and e[0] for e in backward] == [e and "BW" for e in forward]
        assert [e and e[1:] for e in backward] == [e and e[1:] for e in forward]


@pytest.mark.parametrize(("stages", "micro"), [(4, 8), (4, 2), (3, 7), (2, 1)])
def test_1f1b_is_pipedream_flush_with_at_most_p_in_flight(stages, micro):
    rows = table(_pipeline("1f1b", 1, micro), stages)
    for s in range(stages):
        order = [row[s] for row in rows if row[s] is not None]
        warm = min(stages - 1 - s, micro)
        kinds = [e[0] for e in order]
        want = ["F"] * warm + ["F", "BW"] * (micro - warm) + ["BW"] * warm
        assert kinds == want
        in_flight = np.cumsum([1 if k == "F" else -1 for k in kinds])
        assert in_flight.max() <= stages - s
        assert [e[1] for e in order if e[0] == "BW"] == list(range(micro))


@pytest.mark.parametrize(("schedule", "repeats", "stages", "micro"), CASES)
def test_idle_fraction_is_the_bubble(schedule, repeats, stages, micro):
    """(P - 1)/(R M + P - 1) for every schedule here (F one unit, BW two)."""
    pipeline = _pipeline(schedule, repeats, micro)
    want = (stages - 1) / (repeats * micro + stages - 1)
    assert idle_fraction(pipeline, stages) == pytest.approx(want, abs=1e-12)
    assert idle_fraction_of(table(pipeline, stages)) == idle_fraction(pipeline, stages)


def test_the_contract_figures_at_4_stages_8_microbatches():
    for schedule in ("gpipe", "1f1b"):
        assert idle_fraction(_pipeline(schedule, 1, 8), 4) == pytest.approx(3 / 11)
    assert idle_fraction(_pipeline("circular", 2, 8), 4) == pytest.approx(3 / 19)


@pytest.mark.parametrize(("schedule", "repeats", "stages", "micro"), CASES)
def test_the_array_form_says_where_each_message_lands(schedule, repeats, stages, micro):
    rows = table(_pipeline(schedule, repeats, micro), stages)
    ring = schedule == "circular"
    arrays = slot_arrays(rows, ring=ring)
    assert arrays.slots == len(rows)
    codes = {None: IDLE, "F": FORWARD, "BW": BACKWARD}
    for t, row in enumerate(rows):
        for s, entry in enumerate(row):
            assert arrays.action[t, s] == codes[entry and entry[0]]
            assert (arrays.micro[t, s], arrays.chunk[t, s]) == (
                (0, 0) if entry is None else entry[1:]
            )
            prev = row[s - 1] if s > 0 else None
            if ring and s == 0 and row[-1] and row[-1][2] < repeats - 1:
                prev = row[-1]
            sent = prev is not None and prev[0] == "F"
            assert arrays.from_prev[t, s] == sent
            assert arrays.prev_micro[t, s] == (prev[1] if sent else 0)
            after = row[s + 1] if s < stages - 1 else None
            back = after is not None and after[0] == "BW"
            assert arrays.from_next[t, s] == back
            assert arrays.next_micro[t, s] == (after[1] if back else 0)
    if schedule != "1f1b":
        forward = forward_arrays(stages, micro, repeats)
        n = forward.slots
        assert (forward.action == arrays.action[:n]).all()
        assert (forward.from_prev == arrays.from_prev[:n]).all()


@pytest.mark.parametrize(
    ("stages", "error"), [(0, ValueError), (-1, ValueError), (True, TypeError)]
)
def test_a_bad_number_of_stages(stages, error):
    with pytest.raises(error, match=rf"pipeline\.table: `stages` must be.*{stages}"):
        table(_pipeline("gpipe", 1, 4), stages)
    with pytest.raises(TypeError, match="stages"):
        table(_pipeline("gpipe", 1, 4), 2.0)
