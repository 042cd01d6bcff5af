"""Cutting a traced model into `pp * v` pipeline stages by the cost model (issue 19, item 2).

The units of `autopar.planning.stage_units` (module calls in forward order, each priced) are cut
into contiguous stages: the cut minimizes the longest stage's modeled time (a pipeline runs at the
pace of its slowest stage), keeps every rank's memory (its stages' parameters, gradients and AdamW
states, plus the activations its schedule keeps in flight) under a limit, and among the cuts with
that time sends the fewest boundary bytes. Embedding and head are units like any block, priced by
their ops, so a huge vocabulary shortens the last stage by itself. A dynamic program over the
candidate cuts (Alpa's stage slicing, one mesh per stage) finds it exactly. Or the user names it.

Assumptions (docs/pipeline.md, "Stage cutting"): a stage's work and memory are divided ideally
by its tensor sub-mesh size t (the per-stage tensor plan comes later); a microbatch is 1/M of the
traced batch, so its activations and times are 1/M of the trace's; the activations in flight are
counted from the schedule's action order (the simulator's `peak_in_flight` per stage).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch.fx as fx

from autopar.core.errors import AutoparError, MemoryLimitError
from autopar.core.pipeline_schedule import ActionKind, Schedule, schedule_by_name
from autopar.core.pipeline_simulate import Durations, Timeline, bubble_fraction, bubble_ratio, simulate
from autopar.cost.formulas import ADAMW_STATE_FACTOR, format_bytes, memory_per_rank
from autopar.cost.hardware import Hardware, axis_links, load_hardware
from autopar.planning.memory import MEMORY_HEADROOM
from autopar.planning.stage_units import BoundaryTensor, StageGraph, compact, stage_graph

TIME_TOLERANCE = 1e-9  # relative: stage times this close to the optimum count as tied

Fits = Callable[[int, int, int], bool]  # (first unit, end unit, stage) -> fits the memory limit


class StageCutError(AutoparError, ValueError):
    """A forced cut or a stage count the model cannot be cut into."""


class StageMemoryError(MemoryLimitError):
    """No cut into the requested stages fits the memory limit."""


def balance(
    times: Sequence[float],
    sizes: Sequence[float],
    num_stages: int,
    *,
    allowed: Sequence[bool] | None = None,
    fits: Fits | None = None,
) -> tuple[int, ...] | None:
    """The cut of units with `times` into `num_stages` contiguous non-empty stages that minimizes
    the longest stage and, among cuts within `TIME_TOLERANCE` of that, the sum of `sizes[k]` (bytes
    crossing a cut before unit k) over its cuts. Returns each stage's first unit after the first
    (`num_stages - 1` positions), or None when no cut satisfies `allowed` (per position) and `fits`.
    Two exact dynamic programs over positions, O(num_stages * n^2): the min-max time first, then the
    fewest bytes under it (one program on (time, bytes) pairs would not be exact: a prefix with a
    longer stage but fewer bytes can win once a later stage is longer still)."""
    n = len(times)
    if num_stages < 1 or num_stages > n:
        return None
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    ok = [True] * (n + 1) if allowed is None else list(allowed)
    ok[0] = ok[n] = True

    def seg(i: int, j: int, s: int) -> float:
        if fits is not None and not fits(i, j, s):
            return math.inf
        return prefix[j] - prefix[i]

    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n + 1):
            if not ok[j] or (s == num_stages) != (j == n):
                continue
            best[s][j] = min(
                (max(best[s - 1][i], seg(i, j, s - 1)) for i in range(s - 1, j) if best[s - 1][i] < inf),
                default=inf,
            )
    limit = best[num_stages][n]
    if limit == inf:
        return None
    bound = limit * (1 + TIME_TOLERANCE) + 1e-300
    cost = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    back = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n + 1):
            if not ok[j] or (s == num_stages) != (j == n):
                continue
            extra = sizes[j] if j < n else 0.0
            for i in range(s - 1, j):
                if cost[s - 1][i] < inf and seg(i, j, s - 1) <= bound and cost[s - 1][i] + extra < cost[s][j]:
                    cost[s][j], back[s][j] = cost[s - 1][i] + extra, i
    cuts = []
    j = n
    for s in range(num_stages, 1, -1):
        j = back[s][j]
        cuts.append(j)
    return tuple(reversed(cuts))


def in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most microbatches whose forward its rank has run and whose backward (B, or W
    after I) it has not: what the simulator's `peak_in_flight` counts, stage by stage."""
    peak = [0] * schedule.num_stages
    for rank in range(schedule.pp):
        held = [0] * schedule.num_stages
        for a in schedule.compute_actions(rank):
            if a.kind == ActionKind.FORWARD:
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                held[a.stage] -= 1
    return tuple(peak)


def peak_activations(schedule: Schedule, per_microbatch: Sequence[float]) -> tuple[float, ...]:
    """Per rank, the most activation bytes it holds at once, its stages' microbatches weighted by
    `per_microbatch[stage]` (at most the sum of each stage's own peak: they need not coincide)."""
    out = []
    for rank in range(schedule.pp):
        held = peak = 0.0
        for a in schedule.compute_actions(rank):
            if a.kind == ActionKind.FORWARD:
                held += per_microbatch[a.stage]
                peak = max(peak, held)
            elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                held -= per_microbatch[a.stage]
        out.append(peak)
    return tuple(out)


@dataclass(frozen=True)
class Stage:
    """One stage of a cut. Times are seconds per training step (all microbatches) on one of its t
    tensor ranks; bytes are per tensor rank."""

    index: int
    rank: int
    units: tuple[str, ...]
    forward: float
    backward: float
    backward_input: float  # the part of `backward` the previous stage waits for (zero-bubble's I)
    param_bytes: float  # weights and buffers held, tied copies included
    state_bytes: float  # weights + gradients + AdamW states
    activation_bytes: float  # saved for backward per microbatch
    fixed_activation_bytes: float  # saved once per step (views of weights)
    in_flight: int  # microbatches whose activations the schedule keeps at once
    send: tuple[BoundaryTensor, ...]  # to the next stage
    send_bytes: float  # per microbatch
    shared: tuple[str, ...]  # tied parameters another stage holds too (buffers are copied silently)

    @property
    def time(self) -> float:
        return self.forward + self.backward

    @property
    def modules(self) -> str:
        return compact(self.units)

    @property
    def memory(self) -> float:
        return self.state_bytes + self.in_flight * self.activation_bytes + self.fixed_activation_bytes


@dataclass(frozen=True)
class StageCut:
    """A cut and what it is modeled to cost; `str()` prints the table."""

    stages: tuple[Stage, ...]
    boundaries: tuple[str, ...]  # the first module of stages 1.. (`stage_boundaries=` forces them)
    pp: int
    v: int
    microbatches: int
    schedule: str
    tensor_size: int
    hardware: str
    total_time: float  # modeled compute of the whole graph per step per tensor rank
    rank_memory: tuple[float, ...]  # per pp rank: its stages' states and its peak activations
    memory_limit: float
    forced: bool
    timeline: Timeline  # the schedule simulated with the stages' durations per microbatch

    @property
    def fits(self) -> bool:
        """Whether every rank stays under the memory limit (a forced cut need not)."""
        return all(m <= self.memory_limit for m in self.rank_memory)

    @property
    def max_stage_time(self) -> float:
        return max(s.time for s in self.stages)

    @property
    def makespan(self) -> float:
        return self.timeline.makespan

    @property
    def bubble(self) -> float:
        """Idle share of the simulated step, averaged over ranks."""
        return bubble_fraction(self.timeline)

    @property
    def bubble_ratio(self) -> float:
        """Idle over busy time: the form of Megatron's (p-1)/(v*m), printed beside it."""
        return bubble_ratio(self.timeline)

    def slowed(self, overhead: float) -> StageCut:
        """This cut with `overhead` more seconds per step of each tensor rank's work (a stage
        sub-mesh plan's collectives and imbalance beyond the ideal division by t), spread over the
        stages in proportion to their compute, and simulated again."""
        total = sum(st.time for st in self.stages)
        if overhead <= 0 or total <= 0:
            return self
        scale = 1.0 + overhead / total
        stages = tuple(
            replace(
                st,
                forward=st.forward * scale,
                backward=st.backward * scale,
                backward_input=st.backward_input * scale,
            )
            for st in self.stages
        )
        schedule = self.timeline.schedule
        durations = stage_durations(
            stages, self.pp, self.microbatches, self.tensor_size, load_hardware(self.hardware)
        )
        return replace(
            self, stages=stages, total_time=self.total_time + overhead, timeline=simulate(schedule, durations)
        )

    def __str__(self) -> str:
        head = (
            f"stage cut: pp={self.pp} v={self.v} microbatches={self.microbatches} schedule={self.schedule} "
            f"tensor ranks per stage={self.tensor_size} on {self.hardware}{' (forced)' if self.forced else ''}"
        )
        cols = (
            "stage",
            "rank",
            "modules",
            "time",
            "fwd / bwd per mb",
            "weights",
            "w+grad+adam",
            "act per mb x in flight",
            "memory",
            "sends per mb",
        )
        rows = []
        m = self.microbatches
        for s in self.stages:
            rows.append(
                (
                    str(s.index),
                    str(s.rank),
                    s.modules + (f" (tied: {', '.join(s.shared)})" if s.shared else ""),
                    format_seconds(s.time),
                    f"{format_seconds(s.forward / m)} / {format_seconds(s.backward / m)}",
                    format_bytes(s.param_bytes),
                    format_bytes(s.state_bytes),
                    f"{format_bytes(s.activation_bytes)} x {s.in_flight}",
                    format_bytes(s.memory),
                    f"{format_bytes(s.send_bytes)} ({len(s.send)})"
                    if s.index < len(self.stages) - 1
                    else "-",
                )
            )
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
        lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        ideal = (self.pp - 1) / (self.v * self.microbatches)
        lines.append(
            f"sum of stage times {format_seconds(self.total_time)}, longest stage {format_seconds(self.max_stage_time)} "
            f"(balance {self.total_time / len(self.stages) / self.max_stage_time:.3f})"
        )
        lines.append(
            "rank memory "
            + ", ".join(format_bytes(b) for b in self.rank_memory)
            + f" (limit {format_bytes(self.memory_limit) if math.isfinite(self.memory_limit) else 'none'}"
            + ("" if self.fits else ", OVER IT")
            + ")"
        )
        lines.append(
            f"simulated step {format_seconds(self.makespan)}, bubble {self.bubble:.3f} of the step, "
            f"idle/busy {self.bubble_ratio:.3f} vs (p-1)/(v*m) = {ideal:.3f}"
        )
        return "\n".join(lines)


def format_seconds(x: float) -> str:
    """Seconds in s, ms or us, three significant decimals."""
    if x >= 1.0:
        return f"{x:.3f} s"
    return f"{x * 1e3:.3f} ms" if x >= 1e-3 else f"{x * 1e6:.3f} us"


def cut_stages(
    gm: fx.GraphModule,
    *,
    pp: int,
    microbatches: int,
    v: int = 1,
    schedule: str = "1f1b",
    hardware: str | Hardware = "h100-nvlink-ib",
    tensor_size: int = 1,
    memory_limit: float | None = None,
    stage_boundaries: Sequence[str] | None = None,
) -> StageCut:
    """Cut a traced joint graph into `pp * v` stages (see the module docstring); `stage_boundaries`
    names the first module of each stage after the first and skips the search. `memory_limit`:
    bytes per rank; default 90 % of the table's device memory, `math.inf` for none."""
    graph = stage_graph(gm, hardware, tensor_size)
    return cut_graph(
        graph,
        pp=pp,
        microbatches=microbatches,
        v=v,
        schedule=schedule,
        memory_limit=memory_limit,
        stage_boundaries=stage_boundaries,
    )


def cut_graph(
    graph: StageGraph,
    *,
    pp: int,
    microbatches: int,
    v: int = 1,
    schedule: str = "1f1b",
    memory_limit: float | None = None,
    stage_boundaries: Sequence[str] | None = None,
) -> StageCut:
    """`cut_stages` on an analysed graph (`stage_units.stage_graph`), to try several pipeline
    shapes without tracing again."""
    plan = schedule_by_name(schedule, pp, v, microbatches)
    num = plan.num_stages
    hw = graph.hardware
    limit = hw.memory_capacity * MEMORY_HEADROOM if memory_limit is None else float(memory_limit)
    model = _StageModel(graph, plan, microbatches)
    if stage_boundaries is not None:
        cuts = forced_cut(graph, stage_boundaries, num)
    else:
        if num > len(graph.candidates()) + 1:
            raise StageCutError(
                f"{num} stages asked, but the model has only {len(graph.candidates()) + 1} units that can "
                f"start one: {compact(graph.names)}",
                hint="use fewer pipeline stages (pp * v)",
            )
        share = limit / v  # each of a rank's v stages gets an equal share (exact for v = 1)
        found = balance(
            [u.time for u in graph.units],
            [graph.boundary_bytes(k) for k in range(len(graph.units) + 1)],
            num,
            allowed=graph.valid,
            fits=lambda i, j, s: model.stage_memory(i, j, s) <= share,
        )
        if found is None:
            need = _leanest_memory(graph, model, num, v)
            raise StageMemoryError(
                f"no cut into {num} stages fits {format_bytes(limit)} per rank: the leanest cut needs "
                f"{format_bytes(need)} per rank"
                + (
                    ""
                    if v == 1
                    else f" ({format_bytes(share)} per stage, the limit shared by its {v} stages)"
                ),
                memory=need,
                limit=limit,
                hint="more pipeline stages, more tensor ranks per stage, a schedule that keeps fewer "
                "microbatches in flight (1f1b rather than gpipe), or activation recomputation",
            )
        cuts = found
    return model.report(cuts, limit, stage_boundaries is not None)


def node_stages(graph: StageGraph, cut: StageCut) -> dict[str, int]:
    """The stage of every compute node of the joint graph under `cut` (what splitting the graph
    into per-stage programs needs). Nodes in `graph.recomputed` are listed with their first
    reader's stage; every later stage that reads one makes its own copy."""
    stage_of_unit = {name: s.index for s in cut.stages for name in s.units}
    return {node: stage_of_unit[graph.units[u].name] for node, u in graph.node_unit.items()}


def _leanest_memory(graph: StageGraph, model: _StageModel, num: int, v: int) -> float:
    """The smallest largest-stage memory (times v: a rank's share) any cut reaches."""
    n = len(graph.units)
    best = [[math.inf] * (n + 1) for _ in range(num + 1)]
    best[0][0] = 0.0
    for s in range(1, num + 1):
        for j in range(s, n + 1):
            if (j < n and not graph.valid[j]) or (s == num) != (j == n):
                continue
            best[s][j] = min(
                (max(best[s - 1][i], model.stage_memory(i, j, s - 1)) for i in range(s - 1, j)),
                default=math.inf,
            )
    return best[num][n] * v


def forced_cut(graph: StageGraph, names: Sequence[str], num_stages: int) -> tuple[int, ...]:
    """Positions of a user's cut: `names` are the first modules of stages 1..num_stages-1."""
    starts = {graph.units[k].name: k for k in graph.candidates()}
    hint = f"a stage can start with {compact([graph.units[k].name for k in graph.candidates()])}"
    if len(names) != num_stages - 1:
        raise StageCutError(
            f"stage_boundaries names {len(names)} modules, but {num_stages} stages need {num_stages - 1} "
            "(the first module of each stage after the first)",
            hint=hint,
        )
    cuts = []
    for name in names:
        if name not in starts:
            why = "cannot start a stage" if name in graph.names else "is not a module a stage can start with"
            raise StageCutError(f"stage boundary {name!r} {why}", hint=hint)
        cuts.append(starts[name])
    if any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)):
        raise StageCutError(f"stage_boundaries {list(names)} are not in the model's forward order", hint=hint)
    return tuple(cuts)


class _StageModel:
    """Prices a run of units as one stage of a schedule."""

    def __init__(self, graph: StageGraph, schedule: Schedule, microbatches: int) -> None:
        self.graph = graph
        self.schedule = schedule
        self.m = microbatches
        self.t = graph.tensor_size
        self.flight = in_flight(schedule)
        self._segments: dict[tuple[int, int], tuple[float, float, float]] = {}

    def segment(self, i: int, j: int) -> tuple[float, float, float]:
        """(states, activations per microbatch, once-per-step activations) of units [i, j), kept:
        the dynamic program asks for each segment once per stage."""
        found = self._segments.get((i, j))
        if found is None:
            found = self._segments[(i, j)] = (self.states(self.params(i, j))[1], *self.activations(i, j))
        return found

    def states(self, names: set[str]) -> tuple[float, float]:
        """(weights and buffers, their states with gradients and AdamW), per tensor rank."""
        g = self.graph
        trainable = sum(g.state_bytes[p] for p in names if g.trainable[p]) / self.t
        other = sum(g.state_bytes[p] for p in names if not g.trainable[p]) / self.t
        return trainable + other, memory_per_rank(trainable, trainable, ADAMW_STATE_FACTOR).total + other

    def params(self, i: int, j: int) -> set[str]:
        return {p for p, us in self.graph.used_by.items() if any(i <= u < j for u in us)}

    def activations(self, i: int, j: int) -> tuple[float, float]:
        """(per microbatch, once per step) saved bytes per tensor rank of units [i, j)."""
        per_mb = fixed = 0.0
        for a in self.graph.saved:
            if any(i <= u < j for u in a.units):
                if a.per_batch:
                    per_mb += a.bytes / self.m
                else:
                    fixed += a.bytes
        return per_mb / self.t, fixed / self.t

    def stage_memory(self, i: int, j: int, s: int) -> float:
        states, per_mb, fixed = self.segment(i, j)
        return states + self.flight[s] * per_mb + fixed

    def report(self, cuts: Sequence[int], limit: float, forced: bool) -> StageCut:
        g = self.graph
        n = len(g.units)
        edges = [0, *cuts, n]
        placement = self.schedule.placement
        stages: list[Stage] = []
        for s in range(len(edges) - 1):
            i, j = edges[s], edges[s + 1]
            units = g.units[i:j]
            names = self.params(i, j)
            weights, states = self.states(names)
            per_mb, fixed = self.activations(i, j)
            send = g.crossing[j] if j < n else ()
            shared = tuple(
                sorted(p for p in names if g.trainable[p] and any(not i <= u < j for u in g.used_by[p]))
            )
            stages.append(
                Stage(
                    index=s,
                    rank=placement.rank_of(s),
                    units=tuple(u.name for u in units),
                    forward=sum(u.forward for u in units),
                    backward=sum(u.backward for u in units),
                    backward_input=sum(u.backward_input for u in units),
                    param_bytes=weights,
                    state_bytes=states,
                    activation_bytes=per_mb,
                    fixed_activation_bytes=fixed,
                    in_flight=self.flight[s],
                    send=send,
                    send_bytes=sum(x.bytes / (self.m if x.per_batch else 1) for x in send) / self.t,
                    shared=shared,
                )
            )
        peaks = peak_activations(self.schedule, [st.activation_bytes for st in stages])
        rank_memory = []
        for r in range(self.schedule.pp):
            mine = [st for st in stages if st.rank == r]
            names = set().union(*(self.params(edges[st.index], edges[st.index + 1]) for st in mine))
            rank_memory.append(
                self.states(names)[1] + peaks[r] + sum(st.fixed_activation_bytes for st in mine)
            )
        return StageCut(
            stages=tuple(stages),
            boundaries=tuple(g.units[k].name for k in cuts),
            pp=self.schedule.pp,
            v=self.schedule.v,
            microbatches=self.m,
            schedule=self.schedule.name,
            tensor_size=self.t,
            hardware=g.hardware.name,
            total_time=g.total_time,
            rank_memory=tuple(rank_memory),
            memory_limit=limit,
            forced=forced,
            timeline=simulate(self.schedule, self.durations(stages)),
        )

    def durations(self, stages: Sequence[Stage]) -> Durations:
        return stage_durations(stages, self.schedule.pp, self.m, self.t, self.graph.hardware)


def stage_durations(
    stages: Sequence[Stage], pp: int, microbatches: int, tensor_size: int, hardware: Hardware
) -> Durations:
    """Per microbatch: each stage's forward, backward and its I/W parts; a receive takes the
    transfer of the larger of the stage's boundary tensors (in or out) over the pp axis's link,
    each tensor rank sending its 1/t block."""
    m = microbatches
    link = axis_links((pp, tensor_size), hardware)[0]

    def transfer(nbytes: float) -> float:
        return link.alpha + nbytes / link.bandwidth if nbytes > 0 else 0.0

    recv = tuple(
        transfer(max(st.send_bytes, stages[st.index - 1].send_bytes if st.index else 0.0)) for st in stages
    )
    return Durations(
        forward=tuple(st.forward / m for st in stages),
        backward=tuple(st.backward / m for st in stages),
        backward_input=tuple(st.backward_input / m for st in stages),
        backward_weight=tuple((st.backward - st.backward_input) / m for st in stages),
        send=0.0,
        recv=recv if pp > 1 else 0.0,
    )
