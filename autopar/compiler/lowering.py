"""A plan lowered: propagate and insert_comm (with the search's recomputation and regathers), once
per batch chunk when over-decomposed, and the step that lowering models once its collective
matmuls are decomposed and it is scheduled, on a copy of the graph.

The driver lowers the plan it compiles here (`lower`); the plan choices price candidates the same
way without compiling them: the mesh choice ranks its best meshes by `scheduled_step_time`, the
driver keeps the search's start where it schedules faster (`prefer_scheduled`), over_decompose="auto"
compares chunk counts (`chunk_step_times`), and the schedule's prefetch cap comes from the memory
the plan leaves (`in_flight_budget`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch.fx as fx

from autopar.compiler.decompose_choice import decompose_chosen
from autopar.compiler.rank_share import SCHEDULE_REPORT_KEY
from autopar.core.graph_copy import graph_copy
from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.cost.formulas import MeshCost
from autopar.cost.hardware import load_hardware
from autopar.cost.timeline import Timeline, simulate
from autopar.passes.chunks import merge_chunks
from autopar.passes.insert_comm import insert_comm
from autopar.passes.propagate import propagate
from autopar.passes.recompute import recompute
from autopar.passes.regather import regather
from autopar.passes.schedule import IN_FLIGHT_BYTES
from autopar.passes.schedule import schedule as schedule_pass
from autopar.planning.memory import MEMORY_HEADROOM, plan_memory
from autopar.planning.overdecompose import OverDecompositionError, chunk_plan
from autopar.planning.search import SearchPlan
from autopar.planning.storage import unify_part_storage
from autopar.reporting.dump import write_stage
from autopar.rules.base import RuleRegistry


def lower(
    gm: fx.GraphModule,
    plan: Plan,
    mesh: Mesh,
    registry: RuleRegistry,
    coords: tuple[int, ...],
    chunks: int,
    path: Any = None,
) -> tuple[fx.GraphModule, Mesh]:
    """propagate and insert_comm (with the search's regathers); chunked: once per chunk, then
    merged. Returns the graph and the mesh its layouts are on (with the chunk axis if chunked)."""
    work, chosen = mesh, plan
    if chunks > 1:
        work, chosen = mesh.with_chunks(chunks), chunk_plan(gm, plan, mesh, registry, chunks)
    gm = propagate(gm, chosen, work.shape)
    write_stage(path, "2_propagate", gm, work)
    copies = [gm] + [graph_copy(gm) for _ in range(chunks - 1)]
    for c, one in enumerate(copies):
        insert_comm(one, work, (*coords, c) if chunks > 1 else coords)
        if isinstance(plan, SearchPlan):
            recompute(one, plan.recompute)  # first: regather then serves the copies' weights too
            regather(one, plan.regather)
    return (merge_chunks(copies, work) if chunks > 1 else gm), work


def scheduled_step_time(
    gm: fx.GraphModule,
    plan: Plan,
    mesh: Mesh,
    registry: RuleRegistry,
    hardware: str,
    memory_limit: float | None = None,
    decompose_matmuls: str = "off",
) -> float:
    """Modeled step time of `plan` with overlap: lowered on a copy of `gm` for the rank at
    coordinates 0, its collective matmuls decomposed where `decompose_matmuls` says, scheduled and
    simulated on `hardware` as `compile_for_rank` runs it (the mesh choice ranks its best
    candidates by this). "off" by default: pricing the decomposition ("auto") costs the mesh
    choice 2-2.5 s more per candidate at GPT-2 small's 12 layers and changed no benchmark's choice
    (docs/scheduling.md, "In the mesh choice")."""
    if decompose_matmuls == "off":  # (the mesh choice's: `ScheduledCopies` keeps the copies)
        return scheduled_copy(gm, plan, mesh, registry, hardware, memory_limit).timeline.step_time
    plan = unify_part_storage(gm, plan, mesh.shape)
    cap = in_flight_budget(gm, plan, mesh, hardware, memory_limit)
    coords = (0,) * mesh.ndim
    return chunk_step_times(gm, plan, mesh, registry, coords, [1], hardware, True, cap, decompose_matmuls, False)[1]


@dataclass
class ScheduledCopy:
    """A plan as `scheduled_step_time` (decomposition "off") lowered, scheduled and simulated it
    for the rank at coordinates 0: the schedule stage's graph, its timeline, and what they were
    made for. The mesh choice schedules its best candidates so (`ScheduledCopies`), and the compile
    of the chosen plan at those coordinates (`compile_for_rank(scheduled=)`) takes this copy where
    it would schedule its own lowered graph again: the collective-matmul choice ("auto") first
    schedules the whole graph to price the pairs, "off" schedules it for the program. The compile
    still lowers the plan itself (its lowered graph is what the decomposition rewrites; copying a
    lowered graph in the choice, for every candidate scheduled, would cost about what lowering the
    chosen one once does)."""

    source: Plan  # the plan as handed to `scheduled_step_time`, before `unify_part_storage`
    mesh: Mesh
    table: str
    in_flight_bytes: int
    graph: fx.GraphModule | None  # None once taken
    timeline: Timeline

    def fits(self, plan: Plan, mesh: Mesh, coords: Sequence[int], table: str, in_flight_bytes: int, chunks: int) -> bool:
        """Whether this is the schedule stage's graph of `plan` lowered for `coords` on `mesh`,
        modeled on `table` under the in-flight cap `in_flight_bytes`, not over-decomposed: the very
        plan object the choice scheduled (a plan is chosen, not rebuilt, between the two)."""
        return (
            self.graph is not None and plan is self.source and mesh == self.mesh and not any(coords)
            and table == self.table and in_flight_bytes == self.in_flight_bytes and chunks == 1
        )  # fmt: skip

    def take(self, lowered: fx.GraphModule) -> tuple[Timeline, fx.GraphModule]:
        """The timeline and the scheduled graph, handed once, with the graph-level metadata of
        the compile's own `lowered` graph (the choice lowered a copy of the same trace; only the
        schedule stage's report is the copy's own), as scheduling a copy of `lowered` gives."""
        graph, self.graph = self.graph, None
        assert graph is not None, "a scheduled copy is handed to one compile"
        graph.meta = {**lowered.meta, SCHEDULE_REPORT_KEY: graph.meta[SCHEDULE_REPORT_KEY]}
        return self.timeline, graph


def scheduled_copy(
    gm: fx.GraphModule,
    plan: Plan,
    mesh: Mesh,
    registry: RuleRegistry,
    hardware: str,
    memory_limit: float | None = None,
) -> ScheduledCopy:
    """`scheduled_step_time(gm, plan, ...)` (decomposition "off"), keeping the scheduled graph and
    its timeline (`ScheduledCopy.timeline.step_time` is that step)."""
    unified = unify_part_storage(gm, plan, mesh.shape)
    cap = in_flight_budget(gm, unified, mesh, hardware, memory_limit)
    lowered, work = lower(graph_copy(gm), unified, mesh, registry, (0,) * mesh.ndim, 1)
    scheduled = schedule_pass(lowered, work, hardware=hardware, in_flight_bytes=cap)
    return ScheduledCopy(plan, mesh, hardware, cap, scheduled, simulate(scheduled, work, hardware))


class ScheduledCopies:
    """`scheduled_step_time` for the mesh choice (its `StepTime`) that keeps the scheduled copies
    of the plans with the shortest step so far (`ScheduledCopy`): the choice ranks its modeled
    candidates by that step, so the chosen plan's copy is among them. Several only where steps
    tie; one scheduled graph per candidate at most alive beside them."""

    def __init__(self) -> None:
        self.kept: list[ScheduledCopy] = []

    def __call__(
        self,
        gm: fx.GraphModule,
        plan: Plan,
        mesh: Mesh,
        registry: RuleRegistry,
        hardware: str,
        memory_limit: float | None = None,
    ) -> float:
        found = scheduled_copy(gm, plan, mesh, registry, hardware, memory_limit)
        step = found.timeline.step_time
        best = self.kept[0].timeline.step_time if self.kept else math.inf
        if step < best:
            self.kept = [found]
        elif step == best:
            self.kept.append(found)
        return step

    def of(self, plan: Plan) -> ScheduledCopy | None:
        """The copy of this very plan object, if kept."""
        return next((c for c in self.kept if c.source is plan), None)


def prefer_scheduled(
    gm: fx.GraphModule,
    plan: SearchPlan,
    mesh: Mesh,
    registry: RuleRegistry,
    hardware: str,
    memory_limit: float | None = None,
) -> SearchPlan:
    """The searched plan or the search's cheapest start (`SearchPlan.start`), whichever models
    faster lowered and scheduled on `hardware`: the search's objective prices every edge as its
    own collective, and bucketing can make a start's many small parameter collectives a few (on
    `cpu-gloo`, where a collective's own time on its rank is ~1 ms, FSDP's pattern on one axis
    beats the plan the chain moves found from it). Only on tables whose links give a collective
    such a time (`MeshCost.counts_calls`): elsewhere a collective's count weighs little against its bytes,
    and the two extra lowerings would cost a large model's compile seconds for nothing."""
    if plan.start is None or not MeshCost.build(load_hardware(hardware), mesh.shape).counts_calls:
        return plan
    searched = scheduled_step_time(gm, plan, mesh, registry, hardware, memory_limit)
    start = scheduled_step_time(gm, plan.start, mesh, registry, hardware, memory_limit)
    if start >= searched:
        return plan
    why = f"; kept its start, {start * 1e3:.4g} ms scheduled against {searched * 1e3:.4g} ms"
    return replace(plan.start, notes={**plan.start.notes, "__search__": plan.notes.get("__search__", "") + why})


def in_flight_budget(
    gm: fx.GraphModule, plan: Plan, mesh: Mesh, hardware: str, memory_limit: float | None = None
) -> int:
    """The schedule's default cap on collective buffers in flight, bytes per rank: what the memory
    limit (`memory_limit`, else `MEMORY_HEADROOM` of the table's device memory) leaves after the
    plan's modeled memory (stored parameters, gradients, AdamW states, saved activations; the
    search's own figure where it has one). Prefetching may use the headroom, never more; 0 when
    there is none (one collective in flight at a time). `IN_FLIGHT_BYTES` without a limit (a table
    without device memory, or `memory_limit=math.inf`)."""
    hw = load_hardware(hardware)
    limit = memory_limit if memory_limit is not None else MEMORY_HEADROOM * hw.rank_memory(math.prod(mesh.shape[: mesh.device_ndim]))
    if limit <= 0 or not math.isfinite(limit):
        return IN_FLIGHT_BYTES
    memory = plan.memory if isinstance(plan, SearchPlan) else None
    if memory is None:
        memory = plan_memory(gm, plan, mesh.shape).breakdown()
    return max(0, int(limit - memory.total))


def chunk_step_times(
    gm: fx.GraphModule,
    plan: Plan,
    mesh: Mesh,
    registry: RuleRegistry,
    coords: tuple[int, ...],
    candidates: Sequence[int],
    table: str,
    schedule: bool,
    in_flight_bytes: int,
    decompose_matmuls: str = "off",
    every_pair: bool = True,
) -> dict[int, float]:
    """Modeled step time of each chunk count that fits, lowered (on a copy of `gm`), its
    collective matmuls decomposed as `decompose_matmuls` says (batch chunks: never) and scheduled
    like the real one."""
    times: dict[int, float] = {}
    for k in candidates:
        try:
            lowered, work = lower(graph_copy(gm), plan, mesh, registry, coords, k)
        except OverDecompositionError:
            continue
        lowered, prescheduled = decompose_chosen(
            lowered, work, coords, table, decompose_matmuls, schedule, in_flight_bytes, every_pair
        )
        if prescheduled is not None:
            lowered = prescheduled
        elif schedule:
            lowered = schedule_pass(lowered, work, hardware=table, in_flight_bytes=in_flight_bytes)
        times[k] = simulate(lowered, work, table).step_time
    return times
