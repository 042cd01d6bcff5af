"""A modeled timeline of one rank's training step: what the schedule overlaps and what stays exposed.

The joint graph runs as emit splits it: the forward nodes in graph order, then the backward nodes.
Two streams: compute runs every other node one after another, each for its roofline time on local
shapes (`autopar.cost.compute_time`; views cost nothing, the copies that prepare or unpack a
collective's buffer cost their memory traffic); communication runs the collectives one after another,
each for its alpha-beta time on its mesh axis's link (`autopar.cost.step_time`). A collective starts
when it is issued and the communication stream is free (the schedule keeps at most one in flight per
process group; one stream is stricter); its wait holds the compute stream until it ends. The time
the compute stream spends there is the collective's exposed time.

`streams="link"` gives each kind of link (intra-node, inter-node) its own communication stream:
NCCL runs each process group on its own stream, and collectives on NVLink and on the network use
different hardware, so they can overlap each other. Collectives on one link still queue.
"""

from __future__ import annotations

import bisect
import json
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from autopar.cost import Hardware, MeshCost, load_hardware
from autopar.mesh import Mesh
from autopar.meta import has_info, info
from autopar.passes.bucket import BYTES_KEY, COLLECTIVES, bucket_members
from autopar.storage import global_work, work_split

c10d = torch.ops._c10d_functional
_VIEWS = {torch.ops.aten._unsafe_view.default, operator.getitem}
KIND_COLORS = {
    "all_gather": "#1f77b4",
    "reduce_scatter": "#2ca02c",
    "all_reduce": "#ff7f0e",
    "all_to_all": "#9467bd",
}


@dataclass(frozen=True)
class Span:
    """A busy interval of the compute stream: a node, or a wait that blocked it (`collective` set)."""

    name: str
    start: float
    end: float
    phase: str
    collective: str = ""


@dataclass(frozen=True)
class CollectiveTiming:
    name: str
    kind: str
    axis: str
    phase: str
    stream: str  # the communication stream it ran on ("comm", or its link under streams="link")
    bytes: float  # sent per rank
    members: int  # collectives merged into this one by bucketing (1: none)
    issue: float
    start: float
    end: float
    exposed: float  # time the compute stream waited on it
    overlapped: int  # compute nodes that ran while it was on the wire
    overlapped_names: tuple[str, ...]  # the first few of them
    overlap_time: float  # compute time inside [start, end]

    @property
    def modeled(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """One rank's modeled step (seconds)."""

    hardware: str
    mesh: str
    streams: str = "single"
    compute: list[Span] = field(default_factory=list)
    waits: list[Span] = field(default_factory=list)
    collectives: list[CollectiveTiming] = field(default_factory=list)
    step_time: float = 0.0

    def comm_streams(self) -> list[str]:
        return sorted({c.stream for c in self.collectives}) or ["comm"]

    @property
    def comm_time(self) -> float:
        return sum(c.modeled for c in self.collectives)

    @property
    def exposed_comm(self) -> float:
        return sum(c.exposed for c in self.collectives)

    @property
    def compute_time(self) -> float:
        return sum(s.end - s.start for s in self.compute)

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_comm / self.comm_time if self.comm_time > 0 else 0.0

    def totals(self) -> dict[str, float]:
        return {
            "collectives": float(len(self.collectives)),
            "comm_time": self.comm_time,
            "exposed_comm": self.exposed_comm,
            "compute_time": self.compute_time,
            "step_time": self.step_time,
            "exposed_fraction": self.exposed_fraction,
        }


def simulate(
    gm: fx.GraphModule, mesh: Mesh, hardware: str | Hardware | MeshCost, streams: str = "single"
) -> Timeline:
    """Model one step of the joint graph `gm` (after insert_comm, scheduled or not) on `hardware`."""
    if streams not in ("single", "link"):
        raise ValueError(f"streams must be 'single' or 'link', not {streams!r}")
    cost = _mesh_cost(hardware, mesh)
    shape = tuple(mesh.shape)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and has_info(n)]
    run = [n for n in nodes if info(n).phase != "backward"] + [n for n in nodes if info(n).phase == "backward"]
    sizes: dict[fx.Node, float] = {}
    timeline = Timeline(cost.hw.name, str(mesh), streams)
    now = 0.0
    comm_free: dict[str, float] = {}  # stream -> when it is free
    pending: dict[fx.Node, tuple[float, float, float, str]] = {}  # collective -> issue, start, end, stream
    exposed: dict[fx.Node, float] = {}
    for node in run:
        if node.target in COLLECTIVES:
            step = info(node).comm
            duration = cost.step(step) if step is not None else 0.0
            stream = "comm"
            if streams == "link" and step is not None:
                stream = f"comm {cost.links[step.axis].name or step.axis}"
            start = max(now, comm_free.get(stream, 0.0))
            comm_free[stream] = start + duration
            pending[node] = (now, start, start + duration, stream)
            continue
        if node.target is c10d.wait_tensor.default:
            coll = node.args[0]
            if coll in pending:
                end = pending[coll][2]  # type: ignore[index]
                blocked = max(0.0, end - now)
                exposed[coll] = exposed.get(coll, 0.0) + blocked  # type: ignore[index]
                if blocked > 0:
                    timeline.waits.append(Span(node.name, now, end, info(node).phase, coll.name))  # type: ignore[union-attr]
                now = max(now, end)
            continue
        duration = node_time(node, cost, shape, sizes)
        if duration > 0:
            timeline.compute.append(Span(node.name, now, now + duration, info(node).phase))
            now += duration
    timeline.step_time = max([now, *comm_free.values()])
    starts = [s.start for s in timeline.compute]
    names = mesh.axis_names
    for coll, (issue, start, end, stream) in pending.items():
        step = info(coll).comm
        first = max(0, bisect.bisect_right(starts, start) - 1)
        last = bisect.bisect_left(starts, end)
        inside = [
            s for s in timeline.compute[first:last] if min(s.end, end) - max(s.start, start) > 0
        ]
        timeline.collectives.append(
            CollectiveTiming(
                name=coll.name,
                kind=step.kind if step is not None else str(coll.target),
                axis=names[step.axis] if step is not None else "",
                phase=info(coll).phase,
                stream=stream,
                bytes=step.bytes_sent(shape) if step is not None else 0.0,
                members=max(1, len(bucket_members(coll))),
                issue=issue,
                start=start,
                end=end,
                exposed=exposed.get(coll, 0.0),
                overlapped=len(inside),
                overlapped_names=tuple(s.name for s in inside[:4]),
                overlap_time=sum(min(s.end, end) - max(s.start, start) for s in inside),
            )
        )
    return timeline


class StepClock:
    """The timeline model advanced one placed node at a time: the schedule stage's sense of time.

    One communication stream, as `simulate`; `now` is the compute stream's clock.
    """

    def __init__(self, mesh: Mesh, hardware: str | Hardware | MeshCost) -> None:
        self.cost = _mesh_cost(hardware, mesh)
        self.shape = tuple(mesh.shape)
        self.now = 0.0
        self.comm_free = 0.0
        self.ends: dict[fx.Node, float] = {}
        self._sizes: dict[fx.Node, float] = {}
        self._durations: dict[fx.Node, float] = {}

    def duration(self, node: fx.Node) -> float:
        """Seconds on its stream: a collective's transfer, a node's compute (0 for waits)."""
        known = self._durations.get(node)
        if known is not None:
            return known
        value = 0.0
        if node.op == "call_function" and has_info(node) and node.target is not c10d.wait_tensor.default:
            if node.target in COLLECTIVES:
                step = info(node).comm
                value = self.cost.step(step) if step is not None else 0.0
            else:
                value = node_time(node, self.cost, self.shape, self._sizes)
        self._durations[node] = value
        return value

    def place(self, node: fx.Node) -> None:
        if node.op != "call_function" or not has_info(node):
            return
        if node.target in COLLECTIVES:
            self.comm_free = max(self.now, self.comm_free) + self.duration(node)
            self.ends[node] = self.comm_free
        elif node.target is c10d.wait_tensor.default:
            coll = node.args[0]
            if isinstance(coll, fx.Node):
                self.now = max(self.now, self.ends.get(coll, self.now))
        else:
            self.now += self.duration(node)

    def finished(self, collective: fx.Node) -> bool:
        end = self.ends.get(collective)
        return end is not None and end <= self.now


def _mesh_cost(hardware: str | Hardware | MeshCost, mesh: Mesh) -> MeshCost:
    if isinstance(hardware, MeshCost):
        return hardware
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    return MeshCost.build(hw, mesh.shape, mesh.in_process)


def is_view(node: fx.Node) -> bool:
    """Whether the op only makes a view (no memory traffic): its schema returns aliases."""
    if node.target in _VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def node_time(node: fx.Node, cost: MeshCost, shape: tuple[int, ...], sizes: dict[fx.Node, float]) -> float:
    """Roofline seconds of one non-collective node on this rank (0 for views and bookkeeping)."""
    if is_view(node):
        return 0.0
    node_info = info(node)
    if node_info.role == "comm":  # a local copy that prepares or unpacks a buffer: read + write
        return 2.0 * local_bytes(node, shape, sizes) / cost.hw.memory_bandwidth
    strategy = node_info.strategy
    if strategy is None:
        return 0.0
    flops = global_work(node) / work_split(strategy, shape)
    moved = sum(lay.local_bytes(shape) for lay in strategy.inputs) + sum(
        lay.local_bytes(shape) for lay in node_info.layouts
    )
    dtype = node_info.layouts[0].dtype if node_info.layouts else torch.float32
    return cost.compute(flops, moved, dtype)


def local_bytes(node: fx.Node, shape: tuple[int, ...], sizes: dict[fx.Node, float]) -> float:
    """This rank's bytes of a node's value. Nodes insert_comm adds between a step's input and its
    result carry no layout; they hold the same elements as their input (permute, clone, view)."""
    known = sizes.get(node)
    if known is not None:
        return known
    chain = [node]
    value = 0.0
    while True:  # walk back to a node whose size is known (no recursion: chains can be long)
        current = chain[-1]
        if current in sizes:
            value = sizes[current]
            break
        if BYTES_KEY in current.meta:
            value = float(current.meta[BYTES_KEY])
            break
        current_info = info(current) if has_info(current) else None
        if current_info is not None and current_info.layouts:
            value = float(sum(lay.local_bytes(shape) for lay in current_info.layouts))
            break
        if current_info is not None and current_info.comm is not None:
            value = float(current_info.comm.after.local_bytes(shape))
            break
        inputs = current.all_input_nodes
        if not inputs:
            break
        chain.append(inputs[0])
    for n in chain:
        sizes[n] = value
    return value


# ---- reports ---------------------------------------------------------------------------------
def overlap_summary(before: Timeline, after: Timeline) -> dict[str, dict[str, float]]:
    """Totals of the unscheduled and the scheduled step, for plan reports."""
    return {"unscheduled": before.totals(), "scheduled": after.totals()}


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
        kind = c.kind + (f" x{c.members}" if c.members > 1 else "")
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
                                "overlapped_compute_nodes": c.overlapped}}
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"hardware": timeline.hardware,
                                                                           **timeline.totals()}}


def write_chrome_trace(timeline: Timeline, path: str | Path, rank: int = 0) -> None:
    Path(path).write_text(json.dumps(chrome_trace(timeline, rank)))


def write_png(path: str | Path, after: Timeline, before: Timeline | None = None) -> None:
    """Lanes per step (compute above, communication below); collectives colored by kind, exposed
    waits red. With `before`, the unscheduled step is drawn above the scheduled one, same time axis."""
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
                spans = [(c.start * ms, c.modeled * ms) for c in t.collectives if c.kind == kind and c.stream == stream]
                if spans:
                    ax.broken_barh(spans, (lane + 0.1, 0.8), facecolors=color, edgecolor="white", linewidth=0.3)
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
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(str(path), dpi=110)


def default_hardware(mesh: Mesh, hardware: str | None) -> str:
    """The table to model a dump's timeline on: the one given, else the measured CPU table for a
    CPU mesh, else the H100 table."""
    if hardware is not None:
        return hardware
    dm = mesh.device_mesh
    return "cpu-gloo" if dm is not None and dm.device_type == "cpu" else "h100-nvlink-ib"

