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
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.core.collectives import BYTES_KEY, COLLECTIVES, MATMUL_FLOPS_KEY, PIECE_KEY, bucket_members
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from autopar.core.redistribute import CommStep
from autopar.cost.formulas import MeshCost
from autopar.cost.hardware import Hardware, load_hardware
from autopar.cost.work import compute_rate, global_work, is_view, work_split

c10d = torch.ops._c10d_functional
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
    piece: str = ""  # a decomposed pair's piece: "<original collective>:<index>" (PIECE_KEY); "" whole

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
    _check_streams(streams)
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
            issuing = _issuing(step, cost)  # the rank's own share: on the compute stream
            if issuing > 0:
                timeline.compute.append(Span(node.name, now, now + issuing, info(node).phase))
                now += issuing
                duration -= issuing
            stream = stream_of(step, cost, streams)
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
                piece=str(coll.meta.get(PIECE_KEY, "")),
            )
        )
    return timeline


class StepClock:
    """The timeline model advanced one placed node at a time: the schedule stage's sense of time.

    Communication streams as `simulate` has them (`streams`: one, or one per link), each a queue
    of the collectives placed on it, in placement order; `now` is the compute stream's clock. The
    schedule stage asks it when a stream is free and when a collective would end if placed now
    (`free`, `stream`), so that it can choose which collective takes a busy link first.
    """

    def __init__(self, mesh: Mesh, hardware: str | Hardware | MeshCost, streams: str = "single") -> None:
        _check_streams(streams)
        self.cost = _mesh_cost(hardware, mesh)
        self.shape = tuple(mesh.shape)
        self.streams = streams
        self.now = 0.0
        self.comm_free: dict[str, float] = {}  # stream -> when its last placed collective ends
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

    def issuing(self, collective: fx.Node) -> float:
        """Seconds of a collective its own rank spends on the compute stream (`Link.call`)."""
        return _issuing(info(collective).comm, self.cost) if has_info(collective) else 0.0

    def stream(self, collective: fx.Node) -> str:
        """The communication stream a collective queues on."""
        return stream_of(info(collective).comm if has_info(collective) else None, self.cost, self.streams)

    def free(self, stream: str) -> float:
        """When `stream` has sent everything placed on it so far."""
        return self.comm_free.get(stream, 0.0)

    def place(self, node: fx.Node) -> None:
        if node.op != "call_function" or not has_info(node):
            return
        if node.target in COLLECTIVES:
            issuing = self.issuing(node)
            self.now += issuing
            stream = self.stream(node)
            end = max(self.now, self.free(stream)) + self.duration(node) - issuing
            self.comm_free[stream] = end
            self.ends[node] = end
        elif node.target is c10d.wait_tensor.default:
            coll = node.args[0]
            if isinstance(coll, fx.Node):
                self.now = max(self.now, self.ends.get(coll, self.now))
        else:
            self.now += self.duration(node)

    def finished(self, collective: fx.Node) -> bool:
        end = self.ends.get(collective)
        return end is not None and end <= self.now


def stream_of(step: CommStep | None, cost: MeshCost, streams: str) -> str:
    """The communication stream of a collective: "comm", or under `streams="link"` its axis's link
    ("comm nvlink", "comm ib": collectives on one link queue, on different links they overlap)."""
    if streams == "link" and step is not None:
        return f"comm {cost.links[step.axis].name or step.axis}"
    return "comm"


def _check_streams(streams: str) -> None:
    if streams not in ("single", "link"):
        raise ValueError(f"streams must be 'single' or 'link', not {streams!r}")


def _issuing(step: CommStep | None, cost: MeshCost) -> float:
    """Seconds of a collective that its rank spends itself (`Link.call`), which its compute
    cannot overlap; the rest of `cost.step` is the transfer on the communication stream."""
    if step is None or not step.is_collective or cost.mesh_shape[step.axis] <= 1:
        return 0.0
    return cost.links[step.axis].call


def _mesh_cost(hardware: str | Hardware | MeshCost, mesh: Mesh) -> MeshCost:
    if isinstance(hardware, MeshCost):
        return hardware
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    return MeshCost.build(hw, mesh.shape, mesh.in_process)


def node_time(node: fx.Node, cost: MeshCost, shape: tuple[int, ...], sizes: dict[fx.Node, float]) -> float:
    """Roofline seconds of one non-collective node on this rank (0 for views and bookkeeping)."""
    if is_view(node):
        return 0.0
    node_info = info(node)
    if MATMUL_FLOPS_KEY in node.meta:  # a piece of a decomposed collective matmul, on local shapes
        moved = local_bytes(node, shape, sizes) + sum(local_bytes(i, shape, sizes) for i in node.all_input_nodes)
        return cost.compute(float(node.meta[MATMUL_FLOPS_KEY]), moved, compute_rate(node))
    if node_info.role == "comm":  # a local copy that prepares or unpacks a buffer: read + write
        return 2.0 * local_bytes(node, shape, sizes) / cost.hw.memory_bandwidth
    strategy = node_info.strategy
    if strategy is None:
        return 0.0
    flops = global_work(node) / work_split(strategy, shape)
    moved = sum(lay.local_bytes(shape) for lay in strategy.inputs) + sum(
        lay.local_bytes(shape) for lay in node_info.layouts
    )
    return cost.compute(flops, moved, compute_rate(node))


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


def exposed_by_collective(gm: fx.GraphModule, timeline: Timeline) -> dict[str, float]:
    """Seconds each original collective of `gm` waited exposed in `timeline` (a model of `gm`),
    by node name; a bucket's exposed time is shared evenly by its members."""
    by_name = {c.name: c.exposed for c in timeline.collectives}
    out: dict[str, float] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in COLLECTIVES or node.name not in by_name:
            continue
        members = [m.name for m in bucket_members(node)] or [node.name]
        for name in members:
            out[name] = by_name[node.name] / len(members)
    return out


# ---- reports ---------------------------------------------------------------------------------
def overlap_summary(before: Timeline, after: Timeline) -> dict[str, dict[str, float]]:
    """Totals of the unscheduled and the scheduled step, for plan reports."""
    return {"unscheduled": before.totals(), "scheduled": after.totals()}


def default_hardware(mesh: Mesh, hardware: str | None) -> str:
    """The table to model a dump's timeline on: the one given, else the measured CPU table for a
    CPU mesh, else the H100 table."""
    if hardware is not None:
        return hardware
    dm = mesh.device_mesh
    return "cpu-gloo" if dm is not None and dm.device_type == "cpu" else "h100-nvlink-ib"

