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
    INPUT_GRAD,
    WEIGHT_GRAD,
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
    ("interleaved", 2, 4, 8),
    ("interleaved", 3, 2, 2),
    ("interleaved", 2, 3, 5),
    ("interleaved", 2, 1, 3),
    ("zb-h1", 1, 4, 8),
    ("zb-h1", 1, 3, 7),
    ("zb-h1", 1, 4, 2),
    ("zb-h1", 1, 1, 3),
]
# Where the textbook bubble is the table's: M a multiple of P for the
# interleaved schedule (Megatron's groups of P), M >= P for ZB-H1.
TEXTBOOK = [case for case in CASES if case[2:] not in ((3, 5), (4, 2))]


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
    kinds = ("F", "B", "W") if schedule == "zb-h1" else ("F", "BW")
    want = {
        (kind, m, c, s)
        for kind in kinds
        for m in range(micro)
        for c in range(repeats)
        for s in range(stages)
    }
    assert set(_slots(rows)) == want
    assert all(any(e is not None for e in row) for row in rows)


@pytest.mark.parametrize(("schedule", "repeats", "stages", "micro"), CASES)
def test_no_entry_runs_before_its_inputs(schedule, repeats, stages, micro):
    """F on stage s after the F it reads (stage s - 1's, or round the ring the
    last stage's of the chunk before); BW (or B) after the stage's own F and
    the BW (or B) of the stage after it (round the ring: stage 0's of the next
    chunk); W after the stage's own B."""
    at = _slots(table(_pipeline(schedule, repeats, micro), stages))
    back = "B" if schedule == "zb-h1" else "BW"
    last = stages - 1
    for (kind, m, c, s), t in at.items():
        if kind == "F":
            if s > 0:
                assert at[("F", m, c, s - 1)] < t
            elif c > 0:
                assert at[("F", m, c - 1, last)] < t
        elif kind == "W":
            assert at[("B", m, c, s)] < t
        else:
            assert kind == back
            assert at[("F", m, c, s)] < t
            if s < last:
                assert at[(back, m, c, s + 1)] < t
            elif c < repeats - 1:
                assert at[(back, m, c + 1, 0)] < t


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


@pytest.mark.parametrize(("schedule", "repeats", "stages", "micro"), TEXTBOOK)
def test_idle_fraction_is_the_bubble(schedule, repeats, stages, micro):
    """(P - 1)/(R M + P - 1) for every schedule here (F one unit, BW two); for
    ZB-H1 (P - 1)/(3 M + P - 1): one unit of bubble per stage and slot of
    warm-up, where 1F1B has three (F, B and W one unit each)."""
    pipeline = _pipeline(schedule, repeats, micro)
    want = (stages - 1) / (repeats * micro + stages - 1)
    if schedule == "zb-h1":
        want = (stages - 1) / (3 * micro + stages - 1)
    assert idle_fraction(pipeline, stages) == pytest.approx(want, abs=1e-12)
    assert idle_fraction_of(table(pipeline, stages)) == idle_fraction(pipeline, stages)


def test_the_contract_figures_at_4_stages_8_microbatches():
    """Through the public methods `Pipeline.table` and `.idle_fraction`."""
    for schedule in ("gpipe", "1f1b"):
        assert _pipeline(schedule, 1, 8).idle_fraction(4) == pytest.approx(3 / 11)
    assert idle_fraction(_pipeline("circular", 2, 8), 4) == pytest.approx(3 / 19)
    assert _pipeline("interleaved", 2, 8).idle_fraction(4) <= 3 / 19 + 0.01
    assert _pipeline("zb-h1", 1, 8).idle_fraction(4) <= 0.12
    for schedule, repeats in [("interleaved", 2), ("zb-h1", 1), ("gpipe", 1)]:
        pipeline = _pipeline(schedule, repeats, 8)
        rows = pipeline.table(4)
        assert rows == table(pipeline, 4)
        assert pipeline.idle_fraction(4) == idle_fraction_of(rows)


def _alive(rows, s):
    """The most microbatches alive on stage s at once: F run, its BW (or W)
    not yet."""
    kinds = [row[s][0] for row in rows if row[s] is not None]
    steps = [{"F": 1, "BW": -1, "W": -1}.get(k, 0) for k in kinds]
    return int(np.cumsum(steps).max())


@pytest.mark.parametrize(("stages", "micro"), [(4, 8), (4, 16), (3, 7), (4, 2)])
def test_zb_h1_keeps_no_more_alive_than_1f1b(stages, micro):
    """At most P microbatches in flight on any stage (1F1B's most, stage
    0's), W deferred only past the B that precedes it, and the buffers the
    engine allocates for the inputs (the stash) no longer than 1F1B's."""
    zb = table(_pipeline("zb-h1", 1, micro), stages)
    one = table(_pipeline("1f1b", 1, micro), stages)
    most = max(_alive(one, s) for s in range(stages))
    assert most == min(stages, micro)
    for s in range(stages):
        assert _alive(zb, s) <= most
    assert slot_arrays(zb).sizes[0] <= slot_arrays(one).sizes[0]


@pytest.mark.parametrize(("stages", "micro", "repeats"), [(4, 8, 2), (2, 4, 3)])
def test_interleaved_runs_megatrons_order(stages, micro, repeats):
    """Each stage's forwards in groups of P microbatches, chunk by chunk; its
    backwards in the same groups, the chunks reversed; the warm-up 2 (P - 1 -
    s) + (R - 1) P forwards, then one forward and one backward in turn."""
    rows = table(_pipeline("interleaved", repeats, micro), stages)
    groups = [range(g, g + stages) for g in range(0, micro, stages)]
    forwards = [(m, c) for g in groups for c in range(repeats) for m in g]
    backwards = [(m, c) for g in groups for c in range(repeats)[::-1] for m in g]
    for s in range(stages):
        order = [row[s] for row in rows if row[s] is not None]
        assert [e[1:] for e in order if e[0] == "F"] == forwards
        assert [e[1:] for e in order if e[0] == "BW"] == backwards
        warm = min(2 * (stages - 1 - s) + (repeats - 1) * stages, len(forwards))
        kinds = [e[0] for e in order]
        assert kinds[:warm] == ["F"] * warm
        assert kinds[warm : warm + 4] == ["F", "BW", "F", "BW"][: len(kinds) - warm]


def test_bad_schedules_name_the_choices():
    with pytest.raises(ValueError, match=r"Pipeline: schedule='interleaved' needs"):
        ed.Pipeline("stage", 4, schedule="interleaved")
    with pytest.raises(ValueError, match=r"repeats=2 .*got schedule='zb-h1'"):
        ed.Pipeline("stage", 4, schedule="zb-h1", repeats=2)
    with pytest.raises(
        ValueError, match=r"unknown schedule 'zb'.*'interleaved'.*'zb-h1'"
    ):
        ed.Pipeline("stage", 4, schedule="zb")


@pytest.mark.parametrize(("schedule", "repeats", "stages", "micro"), CASES)
def test_the_array_form_says_where_each_message_lands(schedule, repeats, stages, micro):
    rows = table(_pipeline(schedule, repeats, micro), stages)
    ring = repeats > 1
    arrays = slot_arrays(rows, ring=ring)
    assert arrays.slots == len(rows)
    codes = {None: IDLE, "F": FORWARD, "BW": BACKWARD}
    codes |= {"B": INPUT_GRAD, "W": WEIGHT_GRAD}
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
            # Round the ring: stage 0's backward of a chunk but the first.
            if ring and s == stages - 1 and row[0] and row[0][2] > 0:
                after = row[0]
            back = after is not None and after[0] in ("BW", "B")
            assert arrays.from_next[t, s] == back
            assert arrays.next_micro[t, s] == (after[1] if back else 0)
    if schedule in ("gpipe", "circular"):
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
