"""Pictures of a pipeline schedule's modeled step (issue 19, item 5; docs/pipeline.md, "The pipeline
timeline"): a Chrome trace and a PNG with one row per pp rank (for v=1, one per stage) holding
its F / B / I / W blocks per microbatch and the bubble between them, and a short report of the
modeled bubble beside Megatron's (p-1)/(v*m).

The timeline is `autopar.core.pipeline_simulate.simulate`'s. A rank's row runs without gaps from 0
to its last action (each action starts when the previous one ends); what is not busy (compute and
sends, `Timeline.busy`) is a receive waiting for its data or the end of the step after the rank's
last action, and that is what the bubble blocks cover, exactly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autopar.core.pipeline_schedule import COMPUTE_KINDS, RECV_KINDS, SEND_KINDS, ActionKind, Schedule
from autopar.core.pipeline_simulate import Durations, Timeline, bubble_fraction, bubble_ratio, simulate

IDEAL_FORMULA = "(p-1)/(v*m)"  # Megatron's bubble time over ideal time (Narayanan et al., SC'21)

KIND_COLORS = {  # the PNG's
    ActionKind.FORWARD: "#4c78a8",
    ActionKind.BACKWARD: "#54a24b",
    ActionKind.BACKWARD_INPUT: "#b279a2",
    ActionKind.BACKWARD_WEIGHT: "#f58518",
}
SEND_COLOR, BUBBLE_COLOR = "#505050", "#e4e4e4"
CHROME_COLORS = {  # the trace viewer's reserved color names ("cname")
    ActionKind.FORWARD: "rail_response",
    ActionKind.BACKWARD: "rail_load",
    ActionKind.BACKWARD_INPUT: "rail_animation",
    ActionKind.BACKWARD_WEIGHT: "rail_idle",
    "send": "generic_work",
    "bubble": "grey",
}
_CATEGORY = {
    ActionKind.FORWARD: "forward",
    ActionKind.BACKWARD: "backward",
    ActionKind.BACKWARD_INPUT: "backward_input",
    ActionKind.BACKWARD_WEIGHT: "backward_weight",
}
_US_PER = {"s": 1e6, "ms": 1e3, "us": 1.0}  # any other unit (abstract time units) shows as 1 ms


@dataclass(frozen=True)
class Span:
    """One block of a rank's row: a compute action ("F3"), a send that costs its rank time, or
    bubble (the rank idle: `why` names the receives it waited in, or the end of the step)."""

    rank: int
    kind: str  # "F", "B", "I", "W", "send" or "bubble"
    start: float
    end: float
    stage: int | None = None
    microbatch: int | None = None
    why: str = ""

    @property
    def name(self) -> str:
        if self.kind == "bubble":
            return "bubble"
        return f"send {self.why}{self.microbatch}" if self.kind == "send" else f"{self.kind}{self.microbatch}"


def rank_spans(timeline: Timeline, rank: int) -> list[Span]:
    """Rank `rank`'s row in time order: compute blocks, sends that take time, and bubble blocks
    filling the rest of [0, makespan] (waits merged where several receives follow each other)."""
    spans: list[Span] = []
    waits: list[str] = []
    clock = 0.0

    def idle_until(t: float, why: str) -> None:
        if t > clock:
            spans.append(Span(rank, "bubble", clock, t, why=why))

    for t in timeline.ranks[rank]:
        a = t.action
        if a.kind in RECV_KINDS:
            if t.end > t.start:
                waits.append(str(a))
            continue
        if a.kind in SEND_KINDS and t.end <= t.start:
            continue
        idle_until(t.start, "waiting for " + ", ".join(waits) if waits else "idle")
        waits = []
        kind = a.kind.value if a.kind in COMPUTE_KINDS else "send"
        why = a.kind.value[-1] if kind == "send" else ""  # send F3 / send B3
        spans.append(Span(rank, kind, t.start, t.end, a.stage, a.microbatch, why))
        clock = t.end
    idle_until(timeline.makespan, "waiting for " + ", ".join(waits) if waits else "end of step")
    return spans


def _row_name(schedule: Schedule, rank: int) -> str:
    stages = schedule.placement.stages_of(rank)
    label = "stage" if len(stages) == 1 else "stages"
    return f"{label} {', '.join(map(str, stages))} (rank {rank})"


def _check(timeline: Timeline, schedule: Schedule | None) -> Schedule:
    if schedule is not None and schedule != timeline.schedule:
        raise ValueError("the timeline was simulated from another schedule than the one given")
    return timeline.schedule


def _f(x: float) -> str:
    """Three decimals of a share, float noise dropped first (0.18749999... prints as 0.1875 would)."""
    return f"{round(x, 9):.3f}"


@dataclass(frozen=True)
class PipelineTimelineReport:
    """The modeled step of a schedule. `bubble_fraction` is the share of the step a rank is idle
    (mean over ranks; `pipeline_simulate.bubble_fraction`), compared with `ideal_fraction`, the
    formula's (p-1)/(v*m+p-1) of the step; `bubble_ratio` is idle over busy time
    (`pipeline_simulate.bubble_ratio`), the form of `formula`, compared with `ideal_ratio`. With
    equal stage times and free sends GPipe and 1F1B meet both exactly (interleaved 1F1B for
    m >= p); zero-bubble schedules go below them. Times are in `time_unit` ("s" from a stage cut)."""

    schedule: str
    pp: int
    virtual_stages: int
    microbatches: int
    step_time: float
    bubble_fraction: float
    bubble_ratio: float
    ideal_ratio: float
    ideal_fraction: float
    stage_busy: tuple[float, ...]  # compute per stage per step, sends excluded
    rank_busy: tuple[float, ...]  # compute and sends per rank (`Timeline.busy`)
    stage_ranks: tuple[int, ...]  # the rank holding each stage
    split_backward: bool = False
    formula: str = IDEAL_FORMULA
    time_unit: str = "s"

    def _t(self, x: float) -> str:
        if self.time_unit != "s":
            return f"{x:.4g}"
        if x >= 1.0 or x == 0.0:
            return f"{x:.3f} s"
        return f"{x * 1e3:.3f} ms" if x >= 1e-3 else f"{x * 1e6:.3f} us"

    def __str__(self) -> str:
        unit = "" if self.time_unit == "s" else f" {self.time_unit}"
        note = " (1F1B's formula: zero-bubble goes below it)" if self.split_backward else ""
        lines = [
            f"pipeline timeline: {self.schedule} pp={self.pp} v={self.virtual_stages} "
            f"microbatches={self.microbatches}, modeled step {self._t(self.step_time)}{unit}",
            f"bubble {_f(self.bubble_fraction)} of the step vs {_f(self.ideal_fraction)} from {self.formula}; "
            f"idle/busy {_f(self.bubble_ratio)} vs {self.formula} = {_f(self.ideal_ratio)}{note}",
            f"{'rank':<5} {'stages':<7} {'busy':>11} {'idle':>11} {'idle share':>10}  busy per stage",
        ]
        for r, busy in enumerate(self.rank_busy):
            stages = [s for s, owner in enumerate(self.stage_ranks) if owner == r]
            idle = self.step_time - busy
            share = idle / self.step_time if self.step_time > 0 else 0.0
            per = ", ".join(f"{s}: {self._t(self.stage_busy[s])}" for s in stages)
            names = ",".join(map(str, stages))
            lines.append(f"{r:<5} {names:<7} {self._t(busy):>11} {self._t(idle):>11} {_f(share):>10}  {per}")
        return "\n".join(lines)


def timeline_report(timeline: Timeline, *, time_unit: str = "s") -> PipelineTimelineReport:
    """The report of an already simulated step (a `StageCut.timeline`, for instance)."""
    s = timeline.schedule
    busy = [0.0] * s.num_stages
    for row in timeline.ranks:
        for t in row:
            if t.action.kind in COMPUTE_KINDS:
                busy[t.action.stage] += t.end - t.start
    ideal = (s.pp - 1) / (s.v * s.microbatches)
    return PipelineTimelineReport(
        schedule=s.name,
        pp=s.pp,
        virtual_stages=s.v,
        microbatches=s.microbatches,
        step_time=timeline.makespan,
        bubble_fraction=bubble_fraction(timeline),
        bubble_ratio=bubble_ratio(timeline),
        ideal_ratio=ideal,
        ideal_fraction=ideal / (1.0 + ideal),
        stage_busy=tuple(busy),
        rank_busy=tuple(timeline.busy(r) for r in range(s.pp)),
        stage_ranks=tuple(s.placement.rank_of(k) for k in range(s.num_stages)),
        split_backward=s.split_backward,
        time_unit=time_unit,
    )


def pipeline_timeline_report(
    schedule: Schedule, durations: Durations | None = None, *, time_unit: str = "s"
) -> PipelineTimelineReport:
    """Simulate `schedule` with `durations` (the simulator's defaults F=1, B=2, I=W=1 when None)
    and report its bubble beside (p-1)/(v*m)."""
    return timeline_report(simulate(schedule, durations), time_unit=time_unit)


def stage_durations(
    forward: Sequence[float],
    backward: Sequence[float] | None = None,
    backward_input: Sequence[float] | None = None,
    *,
    microbatches: int,
    recv: float | Sequence[float] = 0.0,
    send: float = 0.0,
) -> Durations:
    """Per-stage times per step (all microbatches, as `planning.stage_result.Stage` gives them) as
    the simulator's per-microbatch `Durations`. A stage cut prices the backward and its I part by
    their ops; without them the backward is taken as 2x the forward and I as half the backward
    (I = W = F, the zero-bubble paper's even split). W is the backward less I. `recv` is a
    transfer per microbatch (one number or one per stage); sends are free by default."""
    n = len(forward)
    bwd = [2.0 * f for f in forward] if backward is None else list(backward)
    inp = [b / 2.0 for b in bwd] if backward_input is None else list(backward_input)
    if microbatches < 1 or len(bwd) != n or len(inp) != n:
        raise ValueError(
            f"{n} forward, {len(bwd)} backward, {len(inp)} input-gradient times for {microbatches} "
            "microbatches: give one time per stage and microbatches >= 1"
        )
    if isinstance(recv, (int, float)):
        per_recv: float | tuple[float, ...] = float(recv)
    else:
        per_recv = tuple(float(x) for x in recv)

    def per_mb(xs: Sequence[float]) -> tuple[float, ...]:
        return tuple(x / microbatches for x in xs)

    return Durations(
        forward=per_mb(forward),
        backward=per_mb(bwd),
        backward_input=per_mb(inp),
        backward_weight=per_mb([b - i for b, i in zip(bwd, inp)]),
        send=send,
        recv=per_recv,
    )


def _ns(us: float) -> float:
    """Microseconds rounded to the nanosecond: readable JSON, no float noise."""
    return round(us, 3)


def _flows(timeline: Timeline, us: float) -> list[dict[str, Any]]:
    """One flow arrow per message, from the block that made the value to the one that reads it."""
    where: dict[tuple[str, int, int], tuple[int, float]] = {}  # (kind, stage, mb) -> (rank, middle)
    for rank, row in enumerate(timeline.ranks):
        for t in row:
            a = t.action
            if a.kind in COMPUTE_KINDS:
                key = ("B" if a.kind == ActionKind.BACKWARD_INPUT else a.kind.value, a.stage, a.microbatch)
                where[key] = (rank, _ns((t.start + t.end) / 2 * us))
    events: list[dict[str, Any]] = []
    for rank, row in enumerate(timeline.ranks):
        for t in row:
            a = t.action
            if a.kind not in RECV_KINDS:
                continue
            forward = a.kind == ActionKind.RECV_F
            kind = "F" if forward else "B"
            src = where.get((kind, a.stage - 1 if forward else a.stage + 1, a.microbatch))
            dst = where.get((kind, a.stage, a.microbatch))
            if src is None or dst is None:
                continue
            name = f"{'activation' if forward else 'gradient'} {kind}{a.microbatch}"
            common = {"name": name, "cat": "p2p", "id": len(events) // 2, "pid": 0}
            args = {"message": str(a), "arrives_us": _ns(t.end * us)}
            events.append({**common, "ph": "s", "ts": src[1], "tid": src[0], "args": args})
            events.append({**common, "ph": "f", "bp": "e", "ts": dst[1], "tid": rank, "args": args})
    return events


def pipeline_chrome_trace(
    timeline: Timeline, schedule: Schedule | None = None, *, time_unit: str = "s"
) -> dict[str, Any]:
    """Chrome / Perfetto trace-event JSON of a simulated step: one row (tid) per pp rank, named by
    its stages; "F3" / "B3" / "I3" / "W3" blocks (kind and microbatch), sends that cost time,
    "bubble" blocks where the rank is idle, and a flow arrow per message. Times in us (`time_unit`
    "s", "ms" or "us"; other units show one unit as 1 ms)."""
    schedule = _check(timeline, schedule)
    us = _US_PER.get(time_unit, 1e3)
    title = f"{schedule.name} pp={schedule.pp} v={schedule.v} M={schedule.microbatches}"
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"pipeline {title}"}}
    ]
    for r in range(schedule.pp):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": _row_name(schedule, r)}}
        )
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
        for sp in rank_spans(timeline, r):
            args: dict[str, Any]
            if sp.kind == "bubble":
                cat, args = "bubble", {"why": sp.why}
            else:
                cat = "send" if sp.kind == "send" else _CATEGORY[ActionKind(sp.kind)]
                args = {"stage": sp.stage, "microbatch": sp.microbatch}
            events.append(
                {"name": sp.name, "cat": cat, "ph": "X", "ts": _ns(sp.start * us), "dur": _ns((sp.end - sp.start) * us),
                 "pid": 0, "tid": r, "cname": CHROME_COLORS[sp.kind], "args": args}
            )  # fmt: skip
    events += _flows(timeline, us)
    report = asdict(timeline_report(timeline, time_unit=time_unit))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title, **report}}


def write_pipeline_chrome_trace(
    path: str | Path, timeline: Timeline, schedule: Schedule | None = None, *, time_unit: str = "s"
) -> None:
    Path(path).write_text(json.dumps(pipeline_chrome_trace(timeline, schedule, time_unit=time_unit)))


def _axis(step: float, time_unit: str) -> tuple[float, str]:
    if time_unit != "s":
        return 1.0, time_unit
    if step >= 1.0:
        return 1.0, "s"
    return (1e3, "ms") if step >= 1e-3 else (1e6, "us")


def write_pipeline_png(
    path: str | Path, timeline: Timeline, schedule: Schedule | None = None, *, time_unit: str = "s"
) -> None:
    """A Gantt chart of the step: one row per pp rank, blocks colored by kind (lighter for a rank's
    later stages when v > 1) and labelled with the microbatch, the bubble hatched grey; the title
    gives the schedule, p, v, M and the modeled bubble beside (p-1)/(v*m)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    schedule = _check(timeline, schedule)
    rep = timeline_report(timeline, time_unit=time_unit)
    scale, unit = _axis(rep.step_time, time_unit)
    rows = schedule.pp
    fig = Figure(figsize=(14, 0.5 * rows + 1.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    narrow = rep.step_time * scale / 110  # blocks narrower than this keep no label
    kinds_seen: set[str] = set()
    for r in range(rows):
        y = rows - 1 - r
        mine = schedule.placement.stages_of(r)
        for sp in rank_spans(timeline, r):
            x, w = sp.start * scale, (sp.end - sp.start) * scale
            if sp.kind == "bubble":
                ax.broken_barh([(x, w)], (y + 0.1, 0.8), facecolors=BUBBLE_COLOR, edgecolor="#a8a8a8",
                               hatch="///", linewidth=0.3)  # fmt: skip
                continue
            kinds_seen.add(sp.kind)
            if sp.kind == "send":
                ax.broken_barh([(x, w)], (y + 0.4, 0.2), facecolors=SEND_COLOR)
                continue
            light = 0.5 * mine.index(sp.stage or 0) / max(1, len(mine) - 1)
            color = tuple(c + (1.0 - c) * light for c in to_rgb(KIND_COLORS[ActionKind(sp.kind)]))
            ax.broken_barh([(x, w)], (y + 0.1, 0.8), facecolors=[color], edgecolor="white", linewidth=0.5)
            if w >= narrow:
                ax.text(x + w / 2, y + 0.5, str(sp.microbatch), ha="center", va="center", fontsize=7,
                        color="white" if light < 0.3 else "black")  # fmt: skip
    ax.set_yticks([rows - 0.5 - r for r in range(rows)], [_row_name(schedule, r) for r in range(rows)])
    ax.set_ylim(0, rows)
    ax.set_xlim(0, rep.step_time * scale)
    ax.set_xlabel(f"modeled time ({unit})")
    ax.set_title(
        f"{schedule.name}: p={schedule.pp} v={schedule.v} M={schedule.microbatches}, step "
        f"{rep.step_time * scale:.4g} {unit}; bubble {_f(rep.bubble_fraction)} of the step "
        f"(formula {_f(rep.ideal_fraction)}), idle/busy {_f(rep.bubble_ratio)} vs {rep.formula} = "
        f"{_f(rep.ideal_ratio)}",
        fontsize=10,
    )
    handles = [Patch(color=KIND_COLORS[k], label=_CATEGORY[k]) for k in KIND_COLORS if k.value in kinds_seen]
    handles += [Patch(facecolor=BUBBLE_COLOR, edgecolor="#a8a8a8", hatch="///", label="bubble (idle)")]
    if "send" in kinds_seen:
        handles.append(Patch(color=SEND_COLOR, label="send"))
    if schedule.v > 1:
        handles.append(Patch(color="#c0c0c0", label="lighter: a rank's later stage"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(str(path), dpi=110)
