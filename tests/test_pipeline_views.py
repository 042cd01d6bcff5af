"""The pipeline timeline (autopar.reporting.pipeline_views): the Chrome trace has one row per pp
rank (per stage for v=1), one block per compute action at the simulator's times, never two blocks
at once on a row, bubble blocks that cover exactly the idle time; the report's bubble equals the
closed forms where the theory says so; the PNG is drawn."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from autopar.core.pipeline_schedule import ActionKind, Schedule, gpipe, one_f_one_b, schedule_by_name
from autopar.core.pipeline_simulate import Durations, Timeline, simulate
from autopar.reporting.pipeline_views import (
    CHROME_COLORS,
    pipeline_chrome_trace,
    pipeline_timeline_report,
    rank_spans,
    stage_durations,
    timeline_report,
    write_pipeline_chrome_trace,
    write_pipeline_png,
)

US = 1e3  # time_unit="units": one unit shows as 1 ms
EPS = 1e-2  # us: the trace rounds times to the nanosecond
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zero-bubble", 2)]
SHAPES = [(1, 3), (2, 1), (2, 4), (3, 5), (4, 4), (4, 8)]


def uniform(v: int) -> Durations:
    """Each of a rank's v stages holds 1/v of its layers: F = 1/v, B = 2/v, I = W = 1/v."""
    return Durations(forward=1 / v, backward=2 / v, backward_input=1 / v, backward_weight=1 / v)


def uneven(schedule: Schedule) -> Durations:
    """Stages of different lengths, sends that cost their rank time, transfers that take time."""
    n = schedule.num_stages
    fwd = tuple(1.0 + 0.37 * ((3 * s) % 5) for s in range(n))
    return Durations(
        forward=fwd,
        backward=tuple(2.1 * f for f in fwd),
        backward_input=tuple(0.9 * f for f in fwd),
        backward_weight=tuple(1.2 * f for f in fwd),
        send=0.05,
        recv=0.3,
    )


def blocks_by_row(trace: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    rows: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            rows[e["tid"]].append(e)
    return {tid: sorted(es, key=lambda e: e["ts"]) for tid, es in rows.items()}


@pytest.mark.parametrize("even", [True, False], ids=["uniform", "uneven"])
@pytest.mark.parametrize(("pp", "microbatches"), SHAPES)
@pytest.mark.parametrize(("name", "v"), SCHEDULES)
def test_trace_rows_blocks_and_bubbles(name: str, v: int, pp: int, microbatches: int, even: bool) -> None:
    schedule = schedule_by_name(name, pp, v, microbatches)
    durations = uniform(v) if even else uneven(schedule)
    timeline = simulate(schedule, durations)
    trace = pipeline_chrome_trace(timeline, schedule, time_unit="units")
    span = timeline.makespan * US

    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(names) == list(range(pp))  # one row per rank: per stage when v = 1
    for r in range(pp):
        stages = schedule.placement.stages_of(r)
        word = "stage" if v == 1 else "stages"
        assert names[r] == f"{word} {', '.join(map(str, stages))} (rank {r})"

    rows = blocks_by_row(trace)
    timed = {
        (t.action.kind.value, t.action.stage, t.action.microbatch): (r, t)
        for r, row in enumerate(timeline.ranks)
        for t in row
        if t.action.is_compute
    }
    compute: Counter[tuple[str, int, int]] = Counter()
    for r, blocks in rows.items():
        for e in blocks:
            if e["cat"] in ("bubble", "send"):
                continue
            kind, s, m = e["name"][0], e["args"]["stage"], e["args"]["microbatch"]
            assert e["name"] == f"{kind}{m}" and e["cname"] == CHROME_COLORS[kind]
            rank, t = timed[(kind, s, m)]  # at the simulator's times, on its stage's rank
            assert r == rank == schedule.placement.rank_of(s)
            assert e["ts"] == pytest.approx(t.start * US) and e["dur"] == pytest.approx(
                (t.end - t.start) * US
            )
            compute[(kind, s, m)] += 1
    backward = ("I", "W") if schedule.split_backward else ("B",)
    expected = {
        (k, s, m): 1
        for s in range(schedule.num_stages)
        for m in range(microbatches)
        for k in ("F", *backward)
    }
    assert dict(compute) == expected

    for r in range(pp):
        blocks = rows[r]
        # The row tiles [0, makespan]: each block starts where the previous ends (no overlap, no gap).
        assert blocks[0]["ts"] == pytest.approx(0.0, abs=EPS)
        for prev, nxt in zip(blocks, blocks[1:]):
            assert nxt["ts"] == pytest.approx(prev["ts"] + prev["dur"], abs=EPS)
        assert blocks[-1]["ts"] + blocks[-1]["dur"] == pytest.approx(span)
        assert all(e["dur"] > 0 for e in blocks)
        bubble = sum(e["dur"] for e in blocks if e["cat"] == "bubble")
        assert bubble == pytest.approx((timeline.makespan - timeline.busy(r)) * US, abs=EPS)
        sends = [e for e in blocks if e["cat"] == "send"]
        assert len(sends) == (
            sum(a.kind.value.startswith("SEND") for a in schedule.actions[r]) if not even else 0
        )

    colors = {e["cat"]: e["cname"] for es in rows.values() for e in es}
    assert len(set(colors.values())) == len(colors)  # one color per kind, distinct
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    recvs = sum(a.kind.value.startswith("RECV") for acts in schedule.actions for a in acts)
    assert Counter(e["ph"] for e in flows) == ({"s": recvs, "f": recvs} if recvs else {})
    assert trace["otherData"]["bubble_fraction"] == pytest.approx(timeline_report(timeline).bubble_fraction)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "microbatches"), [(1, 4), (2, 1), (2, 5), (3, 2), (4, 4), (4, 8), (5, 16)])
def test_gpipe_and_1f1b_bubble_is_the_formula(make: Any, pp: int, microbatches: int) -> None:
    """Equal stages (F=1, B=2), free sends: step 3(m+p-1); each rank idle 3(p-1), so the idle share
    is (p-1)/(m+p-1) = f/(1+f) and idle/busy is f = (p-1)/m, with f Megatron's (p-1)/(v*m), v=1."""
    schedule = make(pp, microbatches)
    report = pipeline_timeline_report(schedule, Durations(), time_unit="units")
    f = (pp - 1) / microbatches
    assert report.ideal_ratio == pytest.approx(f) and report.ideal_fraction == pytest.approx(f / (1 + f))
    assert report.step_time == pytest.approx(3 * (microbatches + pp - 1))
    assert report.bubble_fraction == pytest.approx((pp - 1) / (microbatches + pp - 1))
    assert report.bubble_fraction == pytest.approx(report.ideal_fraction)
    assert report.bubble_ratio == pytest.approx(report.ideal_ratio)
    assert report.rank_busy == pytest.approx((3 * microbatches,) * pp)
    assert report.stage_busy == pytest.approx((3 * microbatches,) * pp)
    timeline = simulate(schedule)
    for r in range(pp):
        idle = sum(s.end - s.start for s in rank_spans(timeline, r) if s.kind == "bubble")
        assert idle == pytest.approx(3 * (pp - 1))


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 2), (2, 5), (3, 4), (4, 4), (4, 6), (4, 11)])
def test_interleaved_bubble_is_the_formula(pp: int, microbatches: int) -> None:
    """v=2, each stage half a rank's layers: idle/busy = (p-1)/(v*m) for m >= p, idle share its
    f/(1+f) (every rank is busy 3m)."""
    report = pipeline_timeline_report(schedule_by_name("interleaved-1f1b", pp, 2, microbatches), uniform(2))
    f = (pp - 1) / (2 * microbatches)
    assert report.bubble_ratio == pytest.approx(f) == report.ideal_ratio
    assert report.bubble_fraction == pytest.approx(f / (1 + f)) == report.ideal_fraction
    assert report.step_time == pytest.approx(3 * microbatches * (1 + f))
    assert report.stage_busy == pytest.approx((1.5 * microbatches,) * 2 * pp)


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 2), (3, 5), (4, 4), (4, 8), (4, 16)])
def test_zero_bubble_goes_below_the_formula(pp: int, microbatches: int) -> None:
    """ZB-H1 with F=I=W=1: step 3m+p-1, each rank idle p-1 (a third of 1F1B's); ZB-V at half-size
    stages is lower still for m >= 2p-1 (the docs' table: 15, 25.5, 49.5 for p=4)."""
    h1 = pipeline_timeline_report(schedule_by_name("zero-bubble", pp, 1, microbatches), uniform(1))
    assert h1.split_backward and h1.schedule == "zero-bubble"
    assert h1.step_time == pytest.approx(3 * microbatches + pp - 1)
    assert h1.bubble_fraction == pytest.approx((pp - 1) / (3 * microbatches + pp - 1))
    assert h1.bubble_ratio == pytest.approx(h1.ideal_ratio / 3)
    zbv = pipeline_timeline_report(schedule_by_name("zero-bubble", pp, 2, microbatches), uniform(2))
    assert zbv.schedule == "zero-bubble-v" and zbv.bubble_fraction < zbv.ideal_fraction
    if microbatches >= 2 * pp - 1:
        assert zbv.step_time <= h1.step_time + 1e-9
    if pp == 4:
        assert zbv.step_time == pytest.approx({4: 15.0, 8: 25.5, 16: 49.5}[microbatches])


def test_report_text() -> None:
    report = pipeline_timeline_report(one_f_one_b(4, 8), stage_durations([0.8] * 4, microbatches=8))
    lines = str(report).splitlines()
    assert lines[0] == "pipeline timeline: 1f1b pp=4 v=1 microbatches=8, modeled step 3.300 s"
    assert (
        lines[1]
        == "bubble 0.273 of the step vs 0.273 from (p-1)/(v*m); idle/busy 0.375 vs (p-1)/(v*m) = 0.375"
    )
    assert len(lines) == 3 + 4
    assert lines[3].split() == ["0", "0", "2.400", "s", "900.000", "ms", "0.273", "0:", "2.400", "s"]
    zb = str(
        pipeline_timeline_report(schedule_by_name("zero-bubble", 4, 2, 8), uniform(2), time_unit="units")
    )
    assert "(1F1B's formula: zero-bubble goes below it)" in zb and "0,7" in zb.splitlines()[3]


def test_stage_durations() -> None:
    """Per-step stage times to per-microbatch durations; backward 2x forward and I = W = B/2 when
    not given."""
    d = stage_durations([0.8, 1.6], microbatches=8)
    assert d.forward == pytest.approx((0.1, 0.2)) and d.backward == pytest.approx((0.2, 0.4))
    assert d.backward_input == pytest.approx((0.1, 0.2)) and d.backward_weight == pytest.approx((0.1, 0.2))
    assert (d.send, d.recv) == (0.0, 0.0)
    # 1F1B on two stages runs at the slower one's pace: F0 + m (F1 + B1) + B0.
    assert simulate(one_f_one_b(2, 8), d).makespan == pytest.approx(0.1 + 8 * 0.6 + 0.2)
    d = stage_durations([1.0, 2.0], [3.0, 5.0], [1.0, 4.0], microbatches=2, recv=[0.0, 0.25])
    assert d.backward == pytest.approx((1.5, 2.5)) and d.backward_input == pytest.approx((0.5, 2.0))
    assert d.backward_weight == pytest.approx((1.0, 0.5)) and d.recv == (0.0, 0.25)
    with pytest.raises(ValueError, match="one time per stage"):
        stage_durations([1.0, 2.0], [3.0], microbatches=2)
    with pytest.raises(ValueError, match="microbatches >= 1"):
        stage_durations([1.0], microbatches=0)


def test_trace_in_seconds_is_in_microseconds(tmp_path: Path) -> None:
    schedule = one_f_one_b(2, 2)
    timeline = simulate(schedule, stage_durations([2e-3, 2e-3], microbatches=2, recv=1e-4))
    path = tmp_path / "pipeline.json"
    write_pipeline_chrome_trace(path, timeline, schedule)
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(pipeline_chrome_trace(timeline)))
    first = next(e for e in trace["traceEvents"] if e["ph"] == "X")
    assert (first["name"], first["ts"], first["dur"]) == ("F0", 0.0, pytest.approx(1000.0))
    assert trace["otherData"]["step_time"] == pytest.approx(timeline.makespan)
    waits = [e for e in trace["traceEvents"] if e.get("cat") == "bubble" and "RECV_F1.0" in e["args"]["why"]]
    assert (
        len(waits) == 1 and waits[0]["ts"] == pytest.approx(0.0) and waits[0]["dur"] == pytest.approx(1100.0)
    )
    with pytest.raises(ValueError, match="another schedule"):
        pipeline_chrome_trace(timeline, gpipe(2, 2))


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)])
def test_png_is_written(tmp_path: Path, name: str, v: int) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    timeline: Timeline = simulate(schedule_by_name(name, 4, v, 8), uniform(v))
    path = tmp_path / "pipeline.png"
    write_pipeline_png(path, timeline, time_unit="units")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    height, width = imread(str(path)).shape[:2]
    assert (width, height) == (14 * 110, round((0.5 * 4 + 1.8) * 110))  # one row per rank


def test_kinds_have_their_own_colors() -> None:
    kinds = [ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT]
    assert len({CHROME_COLORS[k] for k in kinds} | {CHROME_COLORS["bubble"], CHROME_COLORS["send"]}) == 6
