"""Every pipeline schedule's table of slots, checked from first principles: each
stage runs every (microbatch, chunk) forward and backward exactly once, no entry
runs before the messages it reads were sent (in an earlier row: the table is the
lockstep loop the step compiles), at most P - s microbatches are alive on stage
s under 1F1B and P under ZB-H1, the idle fraction is the bubble of that lockstep
loop, and the array form the engine reads says where each message lands."""

import numpy as np
import pytest

import eqxdist as ed
from eqxdist._layout.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    IDLE,
    INPUT_GRAD,
    WEIGHT_GRAD,
    WRITTEN_OUT,
    _clock,
    _family,
    _needs,
    _one_then_one,
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
# Where the bubble has a closed form: M a multiple of P for the interleaved
# schedule (Megatron's groups of P), M >= P for ZB-H1.
TEXTBOOK = [
    (schedule, repeats, stages, micro)
    for schedule, repeats, stages, micro in CASES
    if not (schedule == "interleaved" and micro % stages)
    and not (schedule == "zb-h1" and micro < stages)
]
# Every schedule on shapes with M < P, M not a multiple of P, and P = 1.
SHAPES = [(4, 8), (4, 2), (3, 7), (2, 5), (4, 6), (1, 3)]
LOCKSTEP = [
    (schedule, repeats, stages, micro)
    for schedule, repeats in [
        ("gpipe", 1),
        ("circular", 2),
        ("1f1b", 1),
        ("interleaved", 2),
        ("interleaved", 3),
        ("zb-h1", 1),
    ]
    for stages, micro in SHAPES
    if schedule != "circular" or micro >= stages
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


def _every(kinds, micro, repeats, stages):
    """Each kind of entry once for every microbatch, chunk and stage."""
    return {
        (kind, m, c, s)
        for kind in kinds
        for m in range(micro)
        for c in range(repeats)
        for s in range(stages)
    }


@pytest.mark.parametrize(("schedule", "repeats", "stages", "micro"), CASES)
def test_each_stage_runs_every_microbatch_and_chunk_once(
    schedule, repeats, stages, micro
):
    rows = table(_pipeline(schedule, repeats, micro), stages)
    assert all(len(row) == stages for row in rows)
    kinds = ("F", "B", "W") if schedule in WRITTEN_OUT else ("F", "BW")
    assert set(_slots(rows)) == _every(kinds, micro, repeats, stages)
    assert all(any(e is not None for e in row) for row in rows)


@pytest.mark.parametrize(("schedule", "repeats", "stages", "micro"), CASES)
def test_no_entry_runs_before_its_inputs(schedule, repeats, stages, micro):
    """F on stage s after the F it reads (stage s - 1's, or round the ring the
    last stage's of the chunk before); BW (or B) after the stage's own F and
    the BW (or B) of the stage after it (round the ring: stage 0's of the next
    chunk); W after the stage's own B."""
    at = _slots(table(_pipeline(schedule, repeats, micro), stages))
    back = "B" if schedule in WRITTEN_OUT else "BW"
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
        want = ["F"] * warm + ["F", "B", "W"] * (micro - warm) + ["B", "W"] * warm
        assert kinds == want
        in_flight = np.cumsum([{"F": 1, "W": -1}.get(k, 0) for k in kinds])
        assert in_flight.max() <= stages - s
        assert [e[1] for e in order if e[0] == "B"] == list(range(micro))
        assert [e[1] for e in order if e[0] == "W"] == list(range(micro))


@pytest.mark.parametrize(("schedule", "repeats", "stages", "micro"), LOCKSTEP)
def test_every_table_is_a_valid_lockstep_loop(schedule, repeats, stages, micro):
    """Each entry's inputs (`_needs`) produced in a strictly earlier row; one F
    and one B (or BW) and, where the backward is split, one W per microbatch,
    chunk and stage; 1F1B at most P - s microbatches alive on stage s (F run,
    BW or W not yet), ZB-H1 at most P, none left alive at the end."""
    rows = table(_pipeline(schedule, repeats, micro), stages)
    done = {}
    for t, row in enumerate(rows):
        for s, entry in enumerate(row):
            if entry is None:
                continue
            kind, m, c = entry
            for need in _needs(kind, m, c, s, stages, repeats):
                assert done.get(need, t) < t, (t, s, entry, need)
            key = (_family(kind), m, c, s)
            assert key not in done, (t, s, entry)
            done[key] = t
    families = ("F", "B", "W") if schedule in WRITTEN_OUT else ("F", "B")
    assert set(done) == _every(families, micro, repeats, stages)
    limit = {"1f1b": lambda s: stages - s, "zb-h1": lambda s: stages}.get(schedule)
    for s in range(stages):
        kinds = [row[s][0] for row in rows if row[s] is not None]
        alive = np.cumsum([{"F": 1, "BW": -1, "W": -1}.get(k, 0) for k in kinds])
        assert alive.min() >= 0
        assert alive[-1] == 0
        if limit is not None:
            assert alive.max() <= limit(s)


@pytest.mark.parametrize(("schedule", "repeats", "stages", "micro"), TEXTBOOK)
def test_idle_fraction_is_the_bubble(schedule, repeats, stages, micro):
    """The lockstep loop's idle share (F, B and W one unit, BW two, a row as
    long as its longest entry): (P - 1)/(R M + P - 1) for GPipe and the
    circular schedule (forward rows of one unit, backward rows of two); 2 (P -
    1)/(3 R M + 2 (P - 1)) for 1F1B and interleaved 1F1B, their backwards
    split into B and W; (P - 1)/(3 M + P - 1) for ZB-H1: one unit of bubble per
    stage and slot of warm-up."""
    pipeline = _pipeline(schedule, repeats, micro)
    work = repeats * micro
    want = (stages - 1) / (work + stages - 1)
    if schedule in ("1f1b", "interleaved"):
        want = 2 * (stages - 1) / (3 * work + 2 * (stages - 1))
    if schedule == "zb-h1":
        want = (stages - 1) / (3 * micro + stages - 1)
    assert idle_fraction(pipeline, stages) == pytest.approx(want, abs=1e-12)
    assert idle_fraction_of(table(pipeline, stages)) == idle_fraction(pipeline, stages)


def test_idle_fraction_counts_rows_in_lockstep():
    """A row lasts as long as its longest entry: an F beside a BW idles a unit;
    an idle row costs nothing."""
    assert idle_fraction_of([[("F", 0, 0), ("BW", 0, 0)]]) == pytest.approx(1 / 4)
    assert idle_fraction_of([[("B", 0, 0), ("W", 0, 0)]]) == 0
    assert idle_fraction_of([[None, None], [("F", 0, 0), None]]) == 0.5
    assert idle_fraction_of([]) == 0


def test_split_backwards_idle_less_in_lockstep():
    """Why 1F1B and interleaved 1F1B split each backward into B and W: with BW
    entries (two units) beside other stages' F (one) their lockstep loops idle
    more than GPipe's 3/11 at P = 4, M = 8 (0.400 and 0.294)."""
    forwards = [(m, 0) for m in range(8)]
    orders = [
        _one_then_one(forwards, forwards, 3 - s, backward=("BW",)) for s in range(4)
    ]
    assert idle_fraction_of(_clock(orders)) == pytest.approx(0.4)
    groups = [range(0, 4), range(4, 8)]
    forwards = [(m, c) for g in groups for c in range(2) for m in g]
    backwards = [(m, c) for g in groups for c in (1, 0) for m in g]
    orders = [
        _one_then_one(forwards, backwards, 2 * (3 - s) + 4, backward=("BW",))
        for s in range(4)
    ]
    assert idle_fraction_of(_clock(orders, 2)) == pytest.approx(5 / 17)
    assert _pipeline("1f1b", 1, 8).idle_fraction(4) == pytest.approx(0.2)
    assert _pipeline("interleaved", 2, 8).idle_fraction(4) == pytest.approx(1 / 9)


def test_the_contract_figures_at_4_stages_8_microbatches():
    """Through the public methods `Pipeline.table` and `.idle_fraction`."""
    assert _pipeline("gpipe", 1, 8).idle_fraction(4) == pytest.approx(3 / 11)
    assert _pipeline("1f1b", 1, 8).idle_fraction(4) <= 3 / 11 + 0.01
    assert idle_fraction(_pipeline("circular", 2, 8), 4) == pytest.approx(3 / 19)
    assert _pipeline("interleaved", 2, 8).idle_fraction(4) <= 3 / 19 + 0.01
    assert _pipeline("zb-h1", 1, 8).idle_fraction(4) <= 0.12
    for schedule, repeats in [
        ("interleaved", 2),
        ("zb-h1", 1),
        ("gpipe", 1),
        ("1f1b", 1),
    ]:
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
        assert [e[1:] for e in order if e[0] == "B"] == backwards
        assert [e[1:] for e in order if e[0] == "W"] == backwards
        warm = min(2 * (stages - 1 - s) + (repeats - 1) * stages, len(forwards))
        kinds = [e[0] for e in order]
        assert kinds[:warm] == ["F"] * warm
        steady = ["F", "B", "W", "F", "B", "W"]
        assert kinds[warm : warm + 6] == steady[: len(kinds) - warm]


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
