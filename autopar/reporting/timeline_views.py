"""Pictures of a modeled timeline (`autopar.cost.timeline`): an overlap table, a Chrome trace
(chrome://tracing, Perfetto) and a PNG of both streams before and after the schedule stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autopar.cost.timeline import Timeline

KIND_COLORS = {
    "all_gather": "#1f77b4",
    "reduce_scatter": "#2ca02c",
    "all_reduce": "#ff7f0e",
    "all_to_all": "#9467bd",
}


def overlap_text(before: Timeline, after: Timeline, limit: int | None = None) -> str:
    """The overlap table: one row per collective of the scheduled step, then totals before/after."""
    us = 1e6
    lines = [
        f"# modeled on {after.hardware}, mesh {after.mesh}; times in us; streams: compute, "
        f"{', '.join(after.comm_streams())}",
        f"{'collective':<36} {'kind':<14} {'axis':<4} {'phase':<8} {'bytes':>12} {'modeled':>9} "
        f"{'issue':>10} {'start':>10} {'end':>10} {'exposed':>9} {'overlap':>8}  overlapped compute",
    ]
    rows = after.collectives if limit is None else after.collectives[:limit]
    for c in rows:
        kind = c.kind + (f" x{c.members}" if c.members > 1 else "") + (" piece" if c.piece else "")
        first = ", ".join(c.overlapped_names) + (", ..." if c.overlapped > len(c.overlapped_names) else "")
        lines.append(
            f"{c.name:<36} {kind:<14} {c.axis:<4} {c.phase:<8} {c.bytes:>12.0f} {c.modeled * us:>9.2f} "
            f"{c.issue * us:>10.2f} {c.start * us:>10.2f} {c.end * us:>10.2f} {c.exposed * us:>9.2f} "
            f"{c.overlap_time * us:>8.2f}  {c.overlapped} ({first})"
        )
    if limit is not None and len(after.collectives) > limit:
        lines.append(f"... {len(after.collectives) - limit} more")
    lines.append("")
    lines.append(f"{'totals per step':<16} {'collectives':>11} {'comm':>12} {'exposed':>12} {'exposed %':>9} "
                 f"{'compute':>12} {'step':>12}")
    for label, t in (("unscheduled", before), ("scheduled", after)):
        lines.append(
            f"{label:<16} {len(t.collectives):>11} {t.comm_time * us:>12.2f} {t.exposed_comm * us:>12.2f} "
            f"{100 * t.exposed_fraction:>8.1f}% {t.compute_time * us:>12.2f} {t.step_time * us:>12.2f}"
        )
    return "\n".join(lines) + "\n"


def chrome_trace(timeline: Timeline, rank: int = 0) -> dict[str, Any]:
    """Chrome / Perfetto trace-event JSON: process `rank`; thread 0 is compute, threads 1.. the
    communication streams (one, "comm", unless simulated with streams="link"); times in us."""
    us = 1e6
    tids = {name: 1 + i for i, name in enumerate(timeline.comm_streams())}
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({timeline.mesh})"}},
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "compute"}},
    ]
    events += [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
        for name, tid in tids.items()
    ]
    for s in timeline.compute:
        events.append(
            {"name": s.name, "cat": "compute", "ph": "X", "ts": s.start * us, "dur": (s.end - s.start) * us,
             "pid": rank, "tid": 0, "args": {"phase": s.phase}}
        )
    for s in timeline.waits:
        events.append(
            {"name": f"wait {s.collective}", "cat": "exposed_wait", "ph": "X", "ts": s.start * us,
             "dur": (s.end - s.start) * us, "pid": rank, "tid": 0, "args": {"collective": s.collective}}
        )
    for c in timeline.collectives:
        events.append(
            {"name": c.name, "cat": c.kind, "ph": "X", "ts": c.start * us, "dur": c.modeled * us, "pid": rank,
             "tid": tids[c.stream], "args": {"kind": c.kind, "axis": c.axis, "phase": c.phase, "bytes": c.bytes,
                                "members": c.members, "issue_us": c.issue * us, "exposed_us": c.exposed * us,
                                "overlapped_compute_nodes": c.overlapped, "piece_of": c.piece}}
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"hardware": timeline.hardware,
                                                                           **timeline.totals()}}


def write_chrome_trace(timeline: Timeline, path: str | Path, rank: int = 0) -> None:
    Path(path).write_text(json.dumps(chrome_trace(timeline, rank)))


def write_png(path: str | Path, after: Timeline, before: Timeline | None = None) -> None:
    """Lanes per step (compute above, communication below); collectives colored by kind, the pieces
    of a decomposed collective matmul hatched, exposed waits red. With `before`, the unscheduled
    step is drawn above the scheduled one, same time axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [("unscheduled", before), ("scheduled", after)] if before is not None else [("scheduled", after)]
    fig = Figure(figsize=(14, 2.2 * len(panels) + 0.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    ms = 1e3
    for ax, (label, t) in zip(axes, panels):
        assert t is not None
        lanes = t.comm_streams()
        top = len(lanes)
        ax.broken_barh([(s.start * ms, (s.end - s.start) * ms) for s in t.compute], (top + 0.1, 0.8),
                       facecolors="#9e9e9e")
        ax.broken_barh([(s.start * ms, (s.end - s.start) * ms) for s in t.waits], (top + 0.1, 0.8),
                       facecolors="#d62728", hatch="//")
        for lane, stream in enumerate(reversed(lanes)):
            for kind, color in KIND_COLORS.items():
                for pieces, hatch in ((False, None), (True, "..")):
                    spans = [
                        (c.start * ms, c.modeled * ms)
                        for c in t.collectives
                        if c.kind == kind and c.stream == stream and bool(c.piece) == pieces
                    ]
                    if spans:
                        ax.broken_barh(
                            spans, (lane + 0.1, 0.8), facecolors=color, edgecolor="white", linewidth=0.3, hatch=hatch
                        )
        ax.set_yticks([i + 0.5 for i in range(top + 1)], [*reversed(lanes), "compute"])
        ax.set_ylim(0, top + 1)
        ax.set_title(
            f"{label}: step {t.step_time * ms:.3f} ms, comm {t.comm_time * ms:.3f} ms, "
            f"exposed {t.exposed_comm * ms:.3f} ms ({100 * t.exposed_fraction:.1f}%)",
            fontsize=9,
        )
    axes[-1].set_xlabel(f"ms (modeled on {after.hardware}, mesh {after.mesh})")
    handles = [Patch(color="#9e9e9e", label="compute"), Patch(color="#d62728", label="exposed wait")]
    handles += [Patch(color=c, label=k) for k, c in KIND_COLORS.items()]
    if any(c.piece for t in (after, before) if t is not None for c in t.collectives):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="..", label="piece of a decomposed matmul"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(str(path), dpi=110)
