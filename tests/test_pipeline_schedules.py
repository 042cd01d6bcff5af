"""Pipeline schedules (autopar.core.pipeline_schedule) and their simulator (autopar.core.pipeline_simulate),
without processes: every schedule runs to the end for any (pp, v, microbatches), each stage and
microbatch is computed once, sends match receives, the modeled bubbles are the known closed forms,
and the compute order per rank is torch.distributed.pipelining's where torch builds that schedule."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.core.errors import AutoparError
from autopar.core.pipeline_schedule import (
    Action,
    ActionKind,
    Placement,
    Schedule,
    ScheduleArgumentError,
    forwards_then_backwards,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule_by_name,
    zero_bubble_h1,
    zero_bubble_v,
)
from autopar.core.pipeline_simulate import (
    Durations,
    ScheduleDeadlockError,
    ScheduleDependencyError,
    Timeline,
    bubble_fraction,
    bubble_ratio,
    simulate,
)

F, B, BI, BW = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
NAMES_AND_V = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 1), ("interleaved-1f1b", 2),
               ("interleaved-1f1b", 3), ("zero-bubble", 1), ("zero-bubble", 2)]  # fmt: skip


def _check_timeline(t: Timeline) -> None:
    """What the simulator promises, checked again from its output alone."""
    sch = t.schedule
    place, last = sch.placement, sch.num_stages - 1
    end: dict[tuple[ActionKind, int, int], float] = {}
    start: dict[tuple[ActionKind, int, int], float] = {}
    counts: Counter[tuple[ActionKind, int, int]] = Counter()
    sends: Counter[tuple[int, int, ActionKind, int, int]] = Counter()
    recvs: Counter[tuple[int, int, ActionKind, int, int]] = Counter()
    for rank, row in enumerate(t.ranks):
        assert [ta.action for ta in row] == list(sch.actions[rank])
        for prev, ta in zip(row, row[1:]):
            assert ta.start >= prev.end  # one action at a time per rank
        for ta in row:
            a = ta.action
            assert place.rank_of(a.stage) == rank
            key = (a.kind, a.stage, a.microbatch)
            counts[key] += 1
            end[key], start[key] = ta.end, ta.start
            if (
                a.kind == ActionKind.SEND_F
            ):  # channel, message: (from rank, to rank, kind, stage it feeds, mb)
                sends[(rank, a.peer, F, a.stage + 1, a.microbatch)] += 1
            elif a.kind == ActionKind.SEND_B:
                sends[(rank, a.peer, B, a.stage - 1, a.microbatch)] += 1
            elif a.kind == ActionKind.RECV_F:
                recvs[(a.peer, rank, F, a.stage, a.microbatch)] += 1
            elif a.kind == ActionKind.RECV_B:
                recvs[(a.peer, rank, B, a.stage, a.microbatch)] += 1
    assert sends == recvs and all(n == 1 for n in sends.values())
    assert all(n == 1 for n in counts.values())
    for s in range(sch.num_stages):
        for m in range(sch.microbatches):
            assert (F, s, m) in end
            if sch.split_backward:
                assert (BI, s, m) in end and (BW, s, m) in end and (B, s, m) not in end
                assert start[(BW, s, m)] >= end[(BI, s, m)]
                back = (BI, s, m)
            else:
                assert (B, s, m) in end and (BI, s, m) not in end and (BW, s, m) not in end
                back = (B, s, m)
            assert start[back] >= end[(F, s, m)]
            if s > 0:
                assert start[(F, s, m)] >= end[(F, s - 1, m)]
            if s < last:
                upper = (BI if sch.split_backward else B, s + 1, m)
                assert start[back] >= end[upper]
    assert t.makespan >= 0


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from(NAMES_AND_V),
    st.integers(min_value=1, max_value=8),
    st.integers(min_value=1, max_value=16),
)
def test_every_schedule_runs_and_keeps_its_dependencies(
    name_v: tuple[str, int], pp: int, microbatches: int
) -> None:
    name, v = name_v
    sch = schedule_by_name(name, pp, v, microbatches)
    assert len(sch.actions) == pp and sch.num_stages == pp * v
    _check_timeline(simulate(sch))
    skewed = Durations(forward=tuple(1.0 + s % 3 for s in range(pp * v)), backward=3.0, send=0.25, recv=0.5)
    _check_timeline(simulate(sch, skewed))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([(1, "loop"), (2, "loop"), (3, "loop"), (2, "v")]),
    st.integers(min_value=1, max_value=6),
    st.integers(min_value=1, max_value=9),
)
def test_forwards_then_backwards_runs_on_every_placement(v_style: tuple[int, str], pp: int, microbatches: int) -> None:
    """The order of a step whose loss is computed outside the model: every forward of a rank before
    any backward, on the looped and the V placement; with one stage per rank it is GPipe's."""
    v, style = v_style
    sch = forwards_then_backwards(Placement(pp, v, style), microbatches)
    timeline = simulate(sch, Durations(forward=tuple(1.0 + s % 2 for s in range(pp * v)), recv=0.5))
    _check_timeline(timeline)
    for rank in range(pp):
        kinds = [a.kind for a in sch.compute_actions(rank)]
        assert kinds == [F] * (v * microbatches) + [B] * (v * microbatches)
    assert max(timeline.peak_in_flight) == v * microbatches
    if v == 1:
        assert sch.actions == gpipe(pp, microbatches).actions


@pytest.mark.parametrize(("pp", "v", "style", "expected"), [
    (4, 1, "loop", [(0,), (1,), (2,), (3,)]),
    (2, 3, "loop", [(0, 2, 4), (1, 3, 5)]),
    (3, 2, "v", [(0, 5), (1, 4), (2, 3)]),
])  # fmt: skip
def test_placement(pp: int, v: int, style: str, expected: list[tuple[int, ...]]) -> None:
    place = Placement(pp, v, style)
    assert [place.stages_of(r) for r in range(pp)] == expected


def test_adjacent_stages_on_one_rank_pass_locally() -> None:
    """ZB-V's turn (stages pp-1 and pp on rank pp-1) and pp=1 interleaving have no send."""
    sch = zero_bubble_v(3, 4)
    local = {(ActionKind.SEND_F, 2), (ActionKind.RECV_F, 3), (ActionKind.SEND_B, 3), (ActionKind.RECV_B, 2)}
    assert not [a for a in sch.actions[2] if (a.kind, a.stage) in local]
    assert (ActionKind.SEND_F, 3) in {(a.kind, a.stage) for a in sch.actions[2]}
    assert all(a.is_compute for a in interleaved_1f1b(1, 3, 4).actions[0])
    assert str(one_f_one_b(2, 1)).splitlines()[1:] == [
        "  rank 0: F0.0 SEND_F0.0->r1 RECV_B0.0<-r1 B0.0",
        "  rank 1: RECV_F1.0<-r0 F1.0 B1.0 SEND_B1.0->r0",
    ]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 7, 8, 16])
def test_gpipe_and_1f1b_bubble_and_memory(pp: int, microbatches: int) -> None:
    expected = (pp - 1) / (microbatches + pp - 1)
    g, o = simulate(gpipe(pp, microbatches)), simulate(one_f_one_b(pp, microbatches))
    assert bubble_fraction(g) == pytest.approx(expected)
    assert bubble_fraction(o) == pytest.approx(expected)
    assert g.makespan == o.makespan == 3 * (microbatches + pp - 1)
    assert g.peak_in_flight[0] == microbatches
    assert o.peak_in_flight[0] == min(pp, microbatches)
    assert o.peak_in_flight == tuple(min(pp - r, microbatches) for r in range(pp))


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("extra", [0, 1, 3])
def test_interleaved_bubble_is_megatrons(pp: int, v: int, extra: int) -> None:
    """With each of the v stages 1/v of a rank's work, idle over busy time is (p-1)/(v*m) for any
    m >= p (a multiple of p or not), below 1F1B's (p-1)/m."""
    for microbatches in (pp + extra, 2 * pp + extra):
        t = simulate(interleaved_1f1b(pp, v, microbatches), Durations(forward=1 / v, backward=2 / v))
        assert bubble_ratio(t) == pytest.approx((pp - 1) / (v * microbatches))
        assert bubble_ratio(simulate(one_f_one_b(pp, microbatches))) == pytest.approx((pp - 1) / microbatches)
        assert t.makespan < simulate(one_f_one_b(pp, microbatches)).makespan


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 3, 8, 16])
def test_zero_bubble_h1_beats_1f1b_at_its_memory(pp: int, microbatches: int) -> None:
    """I=W=1 against B=2: ZB-H1's bubble is (p-1)*(F+I-W) = p-1 for m >= p, 1F1B's 3(p-1); the most
    activations any rank holds is 1F1B's (rank 0's)."""
    z, o = simulate(zero_bubble_h1(pp, microbatches)), simulate(one_f_one_b(pp, microbatches))
    assert z.makespan < o.makespan or pp == 1
    if microbatches >= pp:
        assert z.makespan == 3 * microbatches + pp - 1
    assert max(z.peak_in_flight) <= max(o.peak_in_flight)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("microbatches", [4, 8, 16])
def test_zero_bubble_v_at_half_stages(pp: int, microbatches: int) -> None:
    """Stages of half a rank's layers: for m >= 2p-1 no slower than ZB-H1, and holding what 1F1B
    holds (twice as many half-size stage activations)."""
    half = Durations(forward=0.5, backward_input=0.5, backward_weight=0.5)
    zv = simulate(zero_bubble_v(pp, microbatches), half)
    if microbatches >= 2 * pp - 1:
        assert zv.makespan <= simulate(zero_bubble_h1(pp, microbatches)).makespan
    assert max(zv.peak_in_flight) <= 2 * max(simulate(one_f_one_b(pp, microbatches)).peak_in_flight)


def _edit(sch: Schedule, rank: int, actions: list[Action]) -> Schedule:
    lists = list(sch.actions)
    lists[rank] = tuple(actions)
    return replace(sch, actions=tuple(lists))


def test_a_missing_receive_is_caught() -> None:
    sch = one_f_one_b(2, 2)
    broken = _edit(sch, 1, [a for a in sch.actions[1] if str(a) != "RECV_F1.1<-r0"])
    with pytest.raises(
        ScheduleDependencyError, match=r"rank 1 action \d+ F1\.1: needs RECV_F1\.1 earlier on rank 1"
    ):
        simulate(broken)


def test_a_missing_send_deadlocks() -> None:
    sch = one_f_one_b(3, 2)
    broken = _edit(sch, 1, [a for a in sch.actions[1] if str(a) != "SEND_F1.1->r2"])
    with pytest.raises(
        ScheduleDeadlockError,
        match=r"rank 2 at action \d+ RECV_F2\.1<-r1 waits for SEND_F1\.1 \(rank 1 never sends it\)",
    ):
        simulate(broken)


def test_durations_must_cover_every_stage() -> None:
    with pytest.raises(ScheduleArgumentError, match="durations.forward has 2 entries for 3 stages"):
        simulate(one_f_one_b(3, 2), Durations(forward=(1.0, 2.0)))


def test_a_second_send_and_a_backward_without_forward_are_caught() -> None:
    sch = one_f_one_b(2, 1)
    broken = _edit(sch, 0, [*sch.actions[0], Action(ActionKind.SEND_F, 0, 0, 1)])
    with pytest.raises(ScheduleDependencyError, match="runs a second time"):
        simulate(broken)
    lone = _edit(sch, 1, [a for a in sch.actions[1] if a.kind != ActionKind.RECV_F and a.kind != F])
    with pytest.raises(ScheduleDependencyError, match="B1.0: needs F1.0"):
        simulate(lone)


def test_a_receive_before_the_send_it_waits_for_deadlocks() -> None:
    """Rank 0 waits for a gradient before sending the forward that would produce it."""
    sch = one_f_one_b(2, 1)
    r0 = list(sch.actions[0])  # F0.0 SEND_F0.0 RECV_B0.0 B0.0
    swapped = _edit(sch, 0, [r0[2], r0[0], r0[1], r0[3]])
    with pytest.raises(ScheduleDeadlockError) as caught:
        simulate(swapped)
    text = str(caught.value)
    assert "rank 0 at action 0 RECV_B0.0<-r1 waits for SEND_B1.0 (rank 1 has it at position 3" in text
    assert "rank 1 at action 0 RECV_F1.0<-r0 waits for SEND_F0.0 (rank 0 has it at position 2" in text
    assert isinstance(caught.value, AutoparError) and caught.value.hint


def test_compute_out_of_order_is_caught() -> None:
    sch = zero_bubble_h1(2, 2)
    r1 = list(sch.actions[1])
    w = next(a for a in r1 if a.kind == BW)
    moved = [w] + [a for a in r1 if a != w]
    with pytest.raises(ScheduleDependencyError, match=rf"W1\.{w.microbatch}: needs I1\.{w.microbatch}"):
        simulate(_edit(sch, 1, moved))
    dropped = _edit(sch, 1, [a for a in r1 if a != w])
    with pytest.raises(ScheduleDependencyError, match=rf"stage 1 microbatch {w.microbatch} never runs W"):
        simulate(dropped)
    foreign = _edit(sch, 1, [Action(F, 0, 0), *r1])
    with pytest.raises(ScheduleDependencyError, match="stage 0 does not live on rank 1"):
        simulate(foreign)


def test_fifo_channels_need_tags_for_interleaved_and_v() -> None:
    """A runtime that matches messages by order alone (no tags) runs GPipe, 1F1B and ZB-H1 as they
    are, but not every interleaved or ZB-V list: there one pair of ranks carries activations and
    gradients both ways and they cross. The runtime tags each message by (direction, stage, mb)."""
    for sch in (gpipe(4, 6), one_f_one_b(4, 6), zero_bubble_h1(4, 6), interleaved_1f1b(4, 2, 8)):
        simulate(sch, in_order=True)
    with pytest.raises(ScheduleDependencyError, match="FIFO channel"):
        simulate(zero_bubble_v(2, 4), in_order=True)
    simulate(zero_bubble_v(2, 4))


@pytest.mark.parametrize(("call", "pattern"), [
    (lambda: gpipe(4, 0), "microbatches >= 1"),
    (lambda: schedule_by_name("1f1b", 4, 2, 8), "interleaved-1f1b"),
    (lambda: schedule_by_name("zero-bubble", 4, 3, 8), "1 or 2 stage"),
    (lambda: schedule_by_name("pipedream", 4, 1, 8), "unknown pipeline schedule"),
    (lambda: Placement(2, 3, "v"), "exactly 2 stages"),
])  # fmt: skip
def test_arguments_that_make_no_schedule(call: object, pattern: str) -> None:
    with pytest.raises(ScheduleArgumentError, match=pattern) as caught:
        call()  # type: ignore[operator]
    assert isinstance(caught.value, AutoparError) and isinstance(caught.value, ValueError)


# torch.distributed.pipelining builds the same orders from stage objects without processes; a stand-in
# with the attributes its constructors read is enough.
class _StandInStage:
    def __init__(self, index: int, num_stages: int, pp: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, 0
        self.submod = None
        self.is_first, self.is_last = index == 0, index == num_stages - 1


def _torch_order(
    name: str, pp: int, microbatches: int, stages: tuple[int, ...], num_stages: int
) -> list[list[str]]:
    sch = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(sch, name)
    made = [_StandInStage(s, num_stages, pp) for s in stages]
    logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.ERROR)
    if cls in (sch.ScheduleGPipe, sch.Schedule1F1B):
        order = cls(made[0], microbatches)._get_pipeline_order()
    else:
        order = cls(made, microbatches).pipeline_order
    short = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    return [
        [f"{short[a.computation_type.name]}{a.stage_index}.{a.microbatch_index}"
         for a in order[r] if a is not None and a.computation_type.name in short]
        for r in range(pp)
    ]  # fmt: skip


@pytest.mark.parametrize(("torch_name", "ours", "pp", "v", "microbatches"), [
    ("ScheduleGPipe", "gpipe", 4, 1, 6),
    ("Schedule1F1B", "1f1b", 4, 1, 8),
    ("ScheduleInterleaved1F1B", "interleaved-1f1b", 4, 2, 8),
    ("ScheduleInterleaved1F1B", "interleaved-1f1b", 4, 3, 12),
    ("ScheduleInterleaved1F1B", "interleaved-1f1b", 4, 2, 3),
    ("ScheduleInterleaved1F1B", "interleaved-1f1b", 3, 2, 9),
    ("ScheduleInterleavedZeroBubble", "zero-bubble", 4, 1, 8),
    ("ScheduleInterleavedZeroBubble", "zero-bubble", 4, 1, 2),
    ("ScheduleZBVZeroBubble", "zero-bubble", 4, 2, 8),
    ("ScheduleZBVZeroBubble", "zero-bubble", 3, 2, 2),
])  # fmt: skip
def test_compute_order_is_torchs(torch_name: str, ours: str, pp: int, v: int, microbatches: int) -> None:
    """Same compute order per rank as torch's schedule of that kind (ZB-H1 is torch's interleaved
    zero bubble with one stage per rank). torch 2.13's Schedule1F1B._get_pipeline_order, an export
    for visualization, numbers the last rank's microbatches from 1, so that rank is left out; its
    runtime loop is right."""
    sch = schedule_by_name(ours, pp, v, microbatches)
    mine = [[str(a) for a in sch.compute_actions(r)] for r in range(pp)]
    theirs = _torch_order(torch_name, pp, microbatches, sch.placement.stages_of(0), sch.num_stages)
    if torch_name == "Schedule1F1B":
        mine, theirs = mine[:-1], theirs[:-1]
    assert mine == theirs


def test_torch_refuses_microbatch_counts_we_run() -> None:
    """torch's interleaved schedules ask for a multiple of the rounds (M=5 on pp=2); ours cut the
    rounds unevenly and still reach Megatron's bubble."""
    sch = pytest.importorskip("torch.distributed.pipelining.schedules")
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        sch.ScheduleInterleaved1F1B([_StandInStage(s, 4, 2) for s in (0, 2)], 5)
    t = simulate(interleaved_1f1b(2, 2, 5), Durations(forward=0.5, backward=1.0))
    assert bubble_ratio(t) == pytest.approx(1 / 10)


def test_durations_per_stage() -> None:
    """A slow last stage sets the pace of 1F1B: makespan is its work plus the others' fill and drain."""
    t = simulate(one_f_one_b(3, 6), Durations(forward=(1.0, 1.0, 2.0), backward=(2.0, 2.0, 4.0)))
    assert t.makespan == pytest.approx(6 * 6 + 2 * 3)
    assert bubble_fraction(t, rank=2) == pytest.approx(6 / 42)


def test_idle_over_busy_is_pooled_over_ranks() -> None:
    """By hand, 1F1B on 2 ranks with one microbatch, F = (1, 2), B = (2, 4): F0 [0, 1], F1 [1, 3],
    B1 [3, 7], B0 [7, 9]; makespan 9, busy 3 and 6, idle 6 and 3: idle / busy = 9 / 9 = 1 (the mean
    of the ranks' own ratios, 2 and 0.5, would be 1.25), and f / (1 - f) of the bubble fraction
    f = 9 / 18. A rank with almost nothing to do (a stage holding an embedding alone) counts its
    idle makespan once, not 1e9 times its busy time."""
    t = simulate(one_f_one_b(2, 1), Durations(forward=(1.0, 2.0), backward=(2.0, 4.0)))
    assert t.makespan == pytest.approx(9.0) and (t.busy(0), t.busy(1)) == pytest.approx((3.0, 6.0))
    assert bubble_ratio(t) == pytest.approx(1.0)
    assert bubble_fraction(t) == pytest.approx(0.5)
    nearly_idle = simulate(one_f_one_b(2, 1), Durations(forward=(1e-9, 1.0), backward=(2e-9, 2.0)))
    assert nearly_idle.makespan == pytest.approx(3.0)
    assert bubble_ratio(nearly_idle) == pytest.approx(3.0 / 3.0, rel=1e-6)  # idle 3 + 0 over busy 0 + 3
