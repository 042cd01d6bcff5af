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

The step beyond the schedule (`autopar.planning.step_accounting`): the weight state in bytes per
element (`WeightState`: mixed precision's float32 masters and gradients), split over the ranks
the plan splits it over; the data axis's gradient reduction once per step, where it runs past
each rank's last backward; the optimizer step; optionally full recomputation of every block.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch.fx as fx

from autopar.core.errors import AutoparError, MemoryLimitError
from autopar.core.pipeline_schedule import Schedule, check_schedule, schedule_by_name
from autopar.core.pipeline_simulate import Durations, simulate
from autopar.cost.formulas import collective_time, format_bytes
from autopar.cost.hardware import Hardware, axis_links
from autopar.planning.memory import MEMORY_HEADROOM
from autopar.planning.stage_balance import balance, in_flight, peak_activations
from autopar.planning.stage_result import Stage, StageCut, stage_durations
from autopar.planning.stage_units import SavedActivation, StageGraph, Unit, compact, stage_graph
from autopar.planning.step_accounting import (
    PLAIN,
    WeightState,
    is_recomputed,
    optimizer_seconds,
    recompute_mode,
)


class StageCutError(AutoparError, ValueError):
    """A forced cut or a stage count the model cannot be cut into."""


class StageMemoryError(MemoryLimitError):
    """No cut into the requested stages fits the memory limit."""


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
    weight_state: WeightState = PLAIN,
    data_parallel: int = 1,
    state_shards: float | None = None,
    grad_reduce: float | None = None,
    recompute: bool | str = False,
) -> StageCut:
    """Cut a traced joint graph into `pp * v` stages (see the module docstring); `stage_boundaries`
    names the first module of each stage after the first and skips the search. `memory_limit`:
    bytes per rank; default 90 % of the table's device memory, `math.inf` for none. The step's
    accounting (`cut_graph`): `weight_state`, `data_parallel`, `state_shards`, `grad_reduce`,
    `recompute`."""
    graph = stage_graph(gm, hardware, tensor_size)
    return cut_graph(
        graph,
        pp=pp,
        microbatches=microbatches,
        v=v,
        schedule=schedule,
        memory_limit=memory_limit,
        stage_boundaries=stage_boundaries,
        weight_state=weight_state,
        data_parallel=data_parallel,
        state_shards=state_shards,
        grad_reduce=grad_reduce,
        recompute=recompute,
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
    weight_state: WeightState = PLAIN,
    data_parallel: int = 1,
    state_shards: float | None = None,
    grad_reduce: float | None = None,
    recompute: bool | str = False,
    schedules: Schedules | None = None,
) -> StageCut:
    """`cut_stages` on an analysed graph (`stage_units.stage_graph`), to try several pipeline
    shapes without tracing again.

    The step's accounting (`autopar.planning.step_accounting`): `weight_state`, bytes per
    trainable element (default `PLAIN`, what `parallelize` keeps); `data_parallel`: d of a stage's
    t ranks are replicas of its weights (t = tensor ranks x d, tensor ranks innermost as in
    Megatron), so one copy of the weight state is split over `state_shards` ranks (default t / d)
    and the gradients are all-reduced over d once per step on the data axis's link; `grad_reduce`
    replaces that price: seconds to reduce the whole model's gradients once on one rank of a stage
    sub-mesh (each pp rank pays its stages' share of it by gradient bytes), e.g. the sub-mesh
    plan's gradient collectives; `recompute`: "full" or "selective" recomputation of every block
    (`step_accounting.RECOMPUTE_MODES`; True is "full", False "none"). `schedules`: built schedules
    to share between cuts of the same shape (a pipeline choice's modes and depths)."""
    check_schedule(schedule, pp, v, microbatches)
    num = pp * v
    hw = graph.hardware
    # a rank's memory: the device's, or on a CPU table the machine's over the job's ranks, less the runtime's
    limit = hw.rank_memory(pp * graph.tensor_size) * MEMORY_HEADROOM if memory_limit is None else float(memory_limit)
    if data_parallel < 1 or graph.tensor_size % data_parallel:
        raise StageCutError(
            f"data_parallel={data_parallel} does not divide the {graph.tensor_size} ranks of a stage",
            hint="data_parallel must divide tensor_size (a stage's ranks: tensor x data)",
        )
    if stage_boundaries is None and num > len(graph.candidates()) + 1:
        # before the schedule is built: at a thousand ranks ZB-V's takes seconds, for nothing
        raise StageCutError(
            f"{num} stages asked, but the model has only {len(graph.candidates()) + 1} units that can "
            f"start one: {compact(graph.names)}",
            hint="use fewer pipeline stages (pp * v)",
        )
    plan, flight = (schedules or Schedules()).get(schedule, pp, v, microbatches)
    shards = graph.tensor_size / data_parallel if state_shards is None else float(state_shards)
    model = _StageModel(graph, plan, microbatches, weight_state, shards, recompute, flight)
    if stage_boundaries is not None:
        cuts = forced_cut(graph, stage_boundaries, num)
    else:
        share = limit / v  # each of a rank's v stages gets an equal share (exact for v = 1)
        found = balance(
            [u.time for u in model.units],
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
    cut = model.report(cuts, limit, stage_boundaries is not None)
    return _with_step_end(cut, model, cuts, data_parallel, grad_reduce)


def _with_step_end(
    cut: StageCut, model: _StageModel, cuts: Sequence[int], data_parallel: int, grad_reduce: float | None
) -> StageCut:
    """`cut` with each pp rank's once-per-step gradient reduction and optimizer step."""
    g = model.graph
    edges = [0, *cuts, len(g.units)]
    everything = model.grad_bytes(set(g.state_bytes))
    link = axis_links((cut.pp, data_parallel, g.tensor_size // data_parallel), g.hardware)[1]
    reduce, step, buckets = [], [], []
    for r in range(cut.pp):
        mine = [st for st in cut.stages if st.rank == r]
        names = set().union(*(model.params(edges[st.index], edges[st.index + 1]) for st in mine))
        grads = model.grad_bytes(names)
        if grad_reduce is not None:
            reduce.append(grad_reduce * grads / everything if everything > 0 else 0.0)
        else:  # a ring all-reduce of the gradient bytes one data replica holds
            reduce.append(collective_time("all_reduce", grads, 1, data_parallel, link))
        step.append(optimizer_seconds(model.step_bytes(names), g.hardware))
        buckets.append(sum(len(st.units) for st in mine))
    return replace(
        cut, reduce_time=tuple(reduce), optimizer_time=tuple(step), buckets=tuple(buckets),
        recompute=model.recompute,
    )  # fmt: skip


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


Segments = dict[tuple[int, int], tuple[float, float, float]]
# The segments of the last few (graph, accounting) pairs: a pipeline choice cuts one graph with
# every schedule of a depth, and a segment's memory does not depend on the schedule.
_SEGMENT_MEMOS: OrderedDict[tuple[Any, ...], tuple[StageGraph, Segments]] = OrderedDict()
SEGMENT_MEMOS = 16


def _segment_memo(graph: StageGraph, *accounting: Any) -> Segments:
    """The segments already priced on `graph` under `accounting` (kept for the last
    `SEGMENT_MEMOS` pairs; the graph is held with them, so its id cannot be reused)."""
    key = (id(graph), *accounting)
    found = _SEGMENT_MEMOS.get(key)
    if found is None or found[0] is not graph:
        found = _SEGMENT_MEMOS[key] = (graph, {})
    _SEGMENT_MEMOS.move_to_end(key)
    while len(_SEGMENT_MEMOS) > SEGMENT_MEMOS:
        _SEGMENT_MEMOS.popitem(last=False)
    return found[1]


class Schedules:
    """Schedules built once per (name, pp, v, microbatches), with their in-flight counts
    (`stage_balance.in_flight`). A pipeline choice cuts each depth under every recomputation mode,
    and again once its sub-mesh is chosen: at 1536 ranks building ZB-V and interleaved 1F1B
    again for each was most of the cuts' time. Held by the caller, one per choice."""

    def __init__(self) -> None:
        self._built: dict[tuple[str, int, int, int], tuple[Schedule, tuple[int, ...]]] = {}

    def get(self, name: str, pp: int, v: int, microbatches: int) -> tuple[Schedule, tuple[int, ...]]:
        key = (name, pp, v, microbatches)
        found = self._built.get(key)
        if found is None:
            plan = schedule_by_name(name, pp, v, microbatches)
            found = self._built[key] = (plan, in_flight(plan))
        return found


class _StageModel:
    """Prices a run of units as one stage of a schedule."""

    def __init__(
        self,
        graph: StageGraph,
        schedule: Schedule,
        microbatches: int,
        weight_state: WeightState = PLAIN,
        shards: float | None = None,
        recompute: bool | str = False,
        flight: tuple[int, ...] | None = None,
    ) -> None:
        self.graph = graph
        self.schedule = schedule
        self.m = microbatches
        self.t = graph.tensor_size
        self.weight_state = weight_state
        self.shards = float(self.t if shards is None else shards)
        self.recompute = recompute_mode(recompute)
        self.flight = in_flight(schedule) if flight is None else flight
        # a recomputed block runs its forward (selective: its element-wise ops) again before its
        # backward, on the input-gradient path
        self.again = tuple(self.recompute != "none" and is_recomputed(u.name) for u in graph.units)
        self.units: tuple[Unit, ...] = tuple(
            replace(u, backward=u.backward + extra, backward_input=u.backward_input + extra)
            if again
            else u
            for u, again in zip(graph.units, self.again, strict=True)
            for extra in [u.forward if self.recompute == "full" else u.forward_elementwise]
        )
        self._segments = _segment_memo(graph, microbatches, weight_state, self.shards, recompute)
        # per unit, the saved activations and parameters it touches: a segment's are the union of
        # its units', not a scan of the whole model's (the cut asks for up to n^2 / 2 segments)
        self._saved_at: list[list[int]] = [[] for _ in graph.units]
        for k, a in enumerate(graph.saved):
            for u in a.units:
                self._saved_at[u].append(k)
        self._params_at: list[list[str]] = [[] for _ in graph.units]
        for p, us in graph.used_by.items():
            for u in set(us):
                self._params_at[u].append(p)

    def segment(self, i: int, j: int) -> tuple[float, float, float]:
        """(states, activations per microbatch, once-per-step activations) of units [i, j), kept:
        the dynamic program asks for each segment once per stage."""
        found = self._segments.get((i, j))
        if found is None:
            per_mb, fixed, again = self.activations(i, j)
            found = self._segments[(i, j)] = (self.states(self.params(i, j))[1], per_mb, fixed + again)
        return found

    def _local(self, names: set[str]) -> list[tuple[float, int]]:
        """(elements this rank holds, traced itemsize) of each trainable parameter of `names`."""
        g = self.graph
        out = []
        for p in names:
            if g.trainable[p]:
                size = g.itemsize.get(p, 4)
                out.append((g.state_bytes[p] / size / self.shards, size))
        return out

    def states(self, names: set[str]) -> tuple[float, float]:
        """(weights and buffers, all their state: `WeightState` bytes of the trainable elements
        this rank holds), per rank; buffers divided by t."""
        g = self.graph
        other = sum(g.state_bytes[p] for p in names if not g.trainable[p]) / self.t
        local = self._local(names)
        weights = sum(n * self.weight_state.kinds(size)[0] for n, size in local)
        return weights + other, sum(n * self.weight_state.bytes(size) for n, size in local) + other

    def grad_bytes(self, names: set[str]) -> float:
        """Gradient bytes of `names` one weight replica holds (what the data axis reduces)."""
        return sum(n * self.weight_state.grad_bytes(size) for n, size in self._local(names))

    def step_bytes(self, names: set[str]) -> float:
        """Bytes the optimizer step moves on one rank for `names`."""
        return sum(n * self.weight_state.step_bytes(size) for n, size in self._local(names))

    def params(self, i: int, j: int) -> set[str]:
        """The parameters and buffers units [i, j) read."""
        return {p for u in range(i, j) for p in self._params_at[u]}

    def activations(self, i: int, j: int) -> tuple[float, float, float]:
        """(per microbatch, once per step, rebuilt by recomputation) saved bytes per tensor rank
        of units [i, j). Under full recomputation a recomputed block keeps only its input (what
        crosses the cut before it) per microbatch in flight, and one microbatch of its own
        activations exists again while its backward runs: the stage's largest block's. Under
        selective recomputation it keeps its input and what its matmuls and attention made; the
        element-wise values are the ones made again."""
        g = self.graph
        per_mb = fixed = 0.0
        own = [0.0] * len(g.units)
        for a in self._saved(i, j):
            mine = [u for u in a.units if i <= u < j]
            if not mine:
                continue
            if not a.per_batch:
                fixed += a.bytes
            elif all(self.again[u] for u in mine) and (self.recompute == "full" or a.elementwise):
                for u in mine:
                    own[u] += a.bytes / self.m
            else:
                per_mb += a.bytes / self.m
        for k in range(i, j):
            if self.again[k]:
                per_mb += sum(x.bytes for x in g.crossing[k] if x.per_batch) / self.m
        return per_mb / self.t, fixed / self.t, max(own, default=0.0) / self.t

    def _saved(self, i: int, j: int) -> list[SavedActivation]:
        """The saved activations some unit of [i, j) reads, in the graph's order."""
        if j - i == 1:
            return [self.graph.saved[k] for k in self._saved_at[i]]
        found = sorted({k for u in range(i, j) for k in self._saved_at[u]})
        return [self.graph.saved[k] for k in found]

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
            per_mb, fixed, again = self.activations(i, j)
            send = g.crossing[j] if j < n else ()
            shared = tuple(
                sorted(p for p in names if g.trainable[p] and any(not i <= u < j for u in g.used_by[p]))
            )
            stages.append(
                Stage(
                    index=s,
                    rank=placement.rank_of(s),
                    units=tuple(u.name for u in units),
                    forward=sum(u.forward for u in self.units[i:j]),
                    backward=sum(u.backward for u in self.units[i:j]),
                    backward_input=sum(u.backward_input for u in self.units[i:j]),
                    param_bytes=weights,
                    state_bytes=states,
                    activation_bytes=per_mb,
                    fixed_activation_bytes=fixed,
                    in_flight=self.flight[s],
                    send=send,
                    send_bytes=sum(x.bytes / (self.m if x.per_batch else 1) for x in send) / self.t,
                    shared=shared,
                    recompute_bytes=again,
                    recompute_time=sum(self.units[k].backward - g.units[k].backward for k in range(i, j)),
                )
            )
        peaks = peak_activations(self.schedule, [st.activation_bytes for st in stages])
        rank_memory = []
        for r in range(self.schedule.pp):
            mine = [st for st in stages if st.rank == r]
            names = set().union(*(self.params(edges[st.index], edges[st.index + 1]) for st in mine))
            rank_memory.append(
                self.states(names)[1]
                + peaks[r]
                + sum(st.fixed_activation_bytes for st in mine)
                + max((st.recompute_bytes for st in mine), default=0.0)
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
            total_time=sum(u.time for u in self.units),
            recompute_time=sum(u.time for u in self.units) - sum(u.time for u in g.units),
            rank_memory=tuple(rank_memory),
            memory_limit=limit,
            forced=forced,
            timeline=simulate(self.schedule, self.durations(stages)),
        )

    def durations(self, stages: Sequence[Stage]) -> Durations:
        return stage_durations(stages, self.schedule.pp, self.m, self.t, self.graph.hardware)
