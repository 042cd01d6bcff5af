"""Automatic mesh choice: the factorization of the world size with the lowest modeled step time.

Every way to write the world size as a product of up to four factors larger than one is a
candidate mesh, in the order of its axes: one to three axes are named x, y, z and a fourth leading
one dp (`autopar.core.mesh.default_axis_names`); axes of size 1 change nothing and are left out, so 8
ranks give (8), (2, 4), (4, 2) and (2, 2, 2). Order matters: ranks are row-major, so the last axis
is the one whose groups stay inside a node. The model is traced once; each candidate is planned on
that graph (the search tries every tensor/token role of the axes, so a mesh's names only pick its
default roles, and is seeded by the fixed 1-D / 2-D / cube plans that lay out on the candidate, so
in the search's objective its plan is no slower than any of them on that candidate: 2-D's q x q
grid is a candidate) and priced on the hardware table: communication and compute seconds per step (each
redistribution of a value to a layout counted once, as insert_comm emits it, so that candidates
whose consumers share collectives rank as their compiled programs do) and memory per rank.

That sum assumes no overlap, and meshes differ in how much of their communication the schedule
stage can hide: for the 3-layer h = 4096 GPT of benchmarks/overlap.py at 8 ranks on H100, the 2x4
plan sums to 130.2 ms but its activation collectives sit on the critical path (132.0 ms
scheduled), while the all-token (8) plan (weights gathered, ZeRO-3-like) sums to 132.4 ms and hides
nearly all of it (128.3 ms). So the fitting candidates are then lowered, scheduled and simulated
(`autopar.cost.timeline`) as `compile_for_rank` would run them, in order of their sum, up to
`OVERLAP_CANDIDATES` of them, skipping those whose compute alone (a lower bound: the simulated
compute stream also runs the buffer copies) is no shorter than the best scheduled step found; those
modeled rank first, by scheduled step time. With more than `SEARCHED_CANDIDATES` candidates, only
the best few by a cheap plan each are searched (`autopar.planning.mesh_screen`: a heuristic; the
rest are listed as not searched), and the pairs of placements whose steps the searches price are
worked out once for every mesh with as many axes (`search_steps.StepCache`). The fastest candidate
that fits the memory limit wins;
ties go to the earlier candidate, so the choice is deterministic. Under `parallelize` rank 0
chooses and broadcasts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch.fx as fx

from autopar.core.errors import AutoparError, MemoryLimitError, MeshError
from autopar.core.mesh import Mesh, default_axis_names
from autopar.core.plan import Plan
from autopar.cost.formulas import format_bytes
from autopar.planning.greedy import choose_layouts
from autopar.planning.mesh_screen import Estimate, complete, screen
from autopar.planning.plan_cost import plan_cost_parts
from autopar.planning.search import SearchPlan, default_memory_limit, fit_memory, search_layouts
from autopar.planning.search_cost import TimeCost
from autopar.planning.search_problem import Shared
from autopar.planning.search_seeds import expert_axes, has_grouped_mm
from autopar.planning.search_steps import StepCache
from autopar.planning.step_accounting import gradient_reduction_time
from autopar.rules.base import RuleRegistry

MAX_AXES = 4
# Candidates modeled with overlap at most, the fastest by the no-overlap sum (each is lowered and
# scheduled: about a second for a 3-layer h = 4096 GPT).
OVERLAP_CANDIDATES = 4
# Candidates searched at most when there are more: the best by the screen's cheap plans
# (`autopar.planning.mesh_screen`); more are searched only if none of these has a plan that fits.
SEARCHED_CANDIDATES = 4


def experts_text(experts: tuple[str, ...] | None, names: Sequence[str], shape: Sequence[int]) -> str:
    """Where a candidate's plan holds the MoE layers' experts, for the choice tables: the mesh axes
    and the ranks they span ("ep (EP 64)", "dp,tp (EP 32)"), "whole" where every rank holds every
    expert, "-" for a model without an expert dim (or a candidate without a plan)."""
    if experts is None:
        return "-"
    if not experts:
        return "whole"
    sizes = dict(zip(names, shape))
    return f"{','.join(experts)} (EP {math.prod(sizes.get(a, 1) for a in experts)})"


@dataclass(frozen=True)
class MeshCandidate:
    """One factorization of the world size and how its plan is modeled to run."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    comm_time: float = math.nan  # s per step, collectives one after another
    compute_time: float = math.nan  # s per step
    memory: float = math.nan  # bytes per rank (for a plan that does not fit: the leanest found)
    fits: bool = False
    roles: tuple[str, ...] = ()
    error: str = ""  # why it has no plan (memory, or a dim no axis split divides)
    scheduled_time: float = math.nan  # s per step lowered, scheduled and simulated; nan: not modeled
    estimate: float = math.nan  # s per step of the screen's cheapest plan; nan: not screened
    searched: bool = True  # False: screened out (`estimate` ranked below the searched ones)
    storage: str = ""  # how its plan stores the weights: "sharded" or "replicated" (`planning.storage`)
    # s per step of the plan's gradient reductions (in `comm_time`): what a pipeline stage or a
    # step of accumulated microbatches runs once per step, not once per microbatch
    reduce_time: float = 0.0
    param_bytes: float = math.nan  # stored parameter and buffer bytes per rank
    # s per step below which the screen's estimate cannot be (`mesh_bound`); nan: not bounded
    bound: float = math.nan
    # > 0: its numbers are those of the model cut to a few blocks, taken to this many blocks
    # (`planning.mesh_fold`); 0: priced on the whole graph
    folded: int = 0
    # the mesh axis names over which its plan splits the MoE layers' experts: () every rank holds
    # every expert; None: the model has no expert dim (or the candidate has no plan)
    experts: tuple[str, ...] | None = None

    @property
    def step_time(self) -> float:
        """Communication plus compute: no overlap (an upper bound on the scheduled step)."""
        return self.comm_time + self.compute_time

    @property
    def rank_time(self) -> float:
        """What it is ranked by: the scheduled step where it was modeled, else the sum."""
        return self.scheduled_time if math.isfinite(self.scheduled_time) else self.step_time

    @property
    def label(self) -> str:
        return "x".join(map(str, self.shape)) + " (" + ",".join(self.names) + ")"


@dataclass
class ChosenPlan:
    """The chosen candidate's plan as the choice searched it, and the search's report
    (`gm.meta["autopar_search"]`): `autopar.plan` compiles it instead of tracing and searching that
    mesh again (the search planner only: the same search, on the same graph, gives the same plan)."""

    plan: Plan
    report: Any = None
    graph: fx.GraphModule | None = None  # the traced graph it is a plan of, when kept (`choose_mesh`)
    # the step model's scheduled copy of this plan (`compiler.lowering.ScheduledCopy`, opaque here),
    # which the compile of it takes instead of scheduling it again; None: not kept
    scheduled: Any = None


@dataclass
class MeshChoice:
    """The ranked candidates: those that fit by step time, then the others."""

    world_size: int
    hardware: str
    planner: str
    memory_limit: float
    candidates: list[MeshCandidate] = field(default_factory=list)
    # the chosen candidate's searched plan (search planner), for `autopar.plan` to compile as it is
    chosen_plan: ChosenPlan | None = field(default=None, repr=False, compare=False)
    # every searched candidate's plan by (shape, names), when asked for (`rank_meshes(keep_plans=)`)
    plans: dict[tuple[tuple[int, ...], tuple[str, ...]], Plan] = field(default_factory=dict, repr=False, compare=False)

    @property
    def chosen(self) -> MeshCandidate:
        return self.candidates[0]

    def __str__(self) -> str:  # print(pmodel.mesh_choice) shows the ranking, not the dataclass
        return self.table()

    def table(self) -> str:
        rows = [
            (
                "rank",
                "mesh",
                "scheduled ms",
                "step ms",
                "comm ms",
                "compute ms",
                "memory/rank",
                "roles / why not",
            )
        ]
        for i, c in enumerate(self.candidates, 1):
            if c.fits:
                rows.append(
                    (
                        str(i),
                        c.label,
                        f"{c.scheduled_time * 1e3:.4f}" if math.isfinite(c.scheduled_time) else "-",
                        f"{c.step_time * 1e3:.4f}",
                        f"{c.comm_time * 1e3:.4f}",
                        f"{c.compute_time * 1e3:.4f}",
                        format_bytes(c.memory),
                        "/".join(c.roles) + (f", weights {c.storage}" if c.storage else "")
                        + (f", folded to {c.folded} blocks" if c.folded else "")
                        + (f", experts on {experts_text(c.experts, c.names, c.shape)}" if c.experts is not None else ""),
                    )
                )
            else:
                memory = format_bytes(c.memory) if math.isfinite(c.memory) else "-"
                rows.append(("-", c.label, "-", "-", "-", "-", memory, c.error))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        limit = format_bytes(self.memory_limit) if math.isfinite(self.memory_limit) else "none"
        head = (
            f"mesh choice for {self.world_size} ranks on {self.hardware} ({self.planner} planner, "
            f"memory limit {limit} per rank; scheduled: lowered, scheduled and simulated, '-' where "
            "not modeled):"
        )
        return "\n".join([head] + ["  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in rows])

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {
                "mesh": dict(zip(c.names, c.shape)),
                "fits": c.fits,
                "scheduled_step_seconds": c.scheduled_time if math.isfinite(c.scheduled_time) else None,
                "step_seconds": c.step_time if c.fits else None,
                "comm_seconds": c.comm_time if c.fits else None,
                "compute_seconds": c.compute_time if c.fits else None,
                "memory_bytes_per_rank": c.memory if math.isfinite(c.memory) else None,
                "roles": list(c.roles),
                "storage": c.storage,
                "error": c.error,
                "searched": c.searched,
                "estimate_seconds": c.estimate if math.isfinite(c.estimate) else None,
                "bound_seconds": c.bound if math.isfinite(c.bound) else None,
                "folded_blocks": c.folded,
                "experts_axes": list(c.experts) if c.experts is not None else None,
            }
            for c in self.candidates
        ]


def mesh_candidates(
    world_size: int, max_axes: int = MAX_AXES
) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every ordered factorization of `world_size` into 1..`max_axes` factors > 1, with names."""
    if world_size < 1:
        raise MeshError(f"world size must be >= 1, got {world_size}", hint="the number of ranks of the job")
    if world_size == 1:
        return [((1,), ("x",))]
    result = []
    for n in range(1, max_axes + 1):
        for shape in _factorizations(world_size, n):
            result.append((shape, default_axis_names(n)))
    return result


def _factorizations(p: int, n: int) -> list[tuple[int, ...]]:
    divisors = [d for d in range(2, p + 1) if p % d == 0]
    return [
        (*head, p // math.prod(head))
        for head in itertools.product(divisors, repeat=n - 1)
        if p % math.prod(head) == 0 and p // math.prod(head) > 1
    ]


StepTime = Callable[[fx.GraphModule, Plan, Mesh, RuleRegistry, str, "float | None"], float]


def rank_meshes(
    gm: fx.GraphModule,
    world_size: int,
    registry: RuleRegistry,
    step_time: StepTime,
    *,
    hardware: str = "h100-nvlink-ib",
    planner: str = "search",
    memory_limit: float | None = None,
    candidates: Sequence[tuple[tuple[int, ...], tuple[str, ...]]] | None = None,
    overlap_candidates: int = OVERLAP_CANDIDATES,
    searched: int = SEARCHED_CANDIDATES,
    keep_plan: bool = False,
    steps: StepCache | None = None,
    storage: str = "auto",
    keep_plans: bool = False,
) -> MeshChoice:
    """Plan the traced joint graph `gm` on every candidate mesh of `world_size` ranks and rank them
    (module doc). `step_time(gm, plan, mesh, registry, hardware, memory_limit)` is the modeled step
    with overlap of a plan as the compiler would lower and schedule it (the driver's
    `scheduled_step_time`), asked for at most `overlap_candidates` of the fitting candidates.
    With more than `searched` candidates (search planner), the `searched` best by the screen's
    cheap plans are searched, more only while none of those fits (`mesh_screen`; 0: all).
    `keep_plan`: keep the chosen candidate's searched plan in `choice.chosen_plan`. `steps`: the
    pairs of placements already worked out (a cache shared by several choices: the pipeline
    choice's sub-meshes; they depend on the number of axes only). `storage`: how every
    candidate's search stores the weights (`search_layouts`). `keep_plans`: keep every searched
    candidate's plan in `choice.plans` (`planning.mesh_fold` compares them across depths).
    """
    meshes = []
    for shape, names in candidates if candidates is not None else mesh_candidates(world_size):
        mesh = Mesh.from_shape(tuple(shape), tuple(names))
        if mesh.size != world_size:
            raise MeshError(f"candidate mesh {mesh} does not have {world_size} ranks")
        meshes.append(mesh)
    steps = steps if steps is not None else StepCache()  # pairs of placements: once per number of axes
    costs = [TimeCost(hardware, mesh.shape, steps=steps) for mesh in meshes]
    limit = math.inf
    if costs:
        limit = default_memory_limit(costs[0]) if memory_limit is None else float(memory_limit)
    order, estimates = list(range(len(meshes))), None
    if planner == "search" and 0 < searched < len(meshes):
        order, estimates = screen(gm, meshes, registry, costs, searched, steps.lists)
    evaluated: list[MeshCandidate | None] = [None] * len(meshes)
    plans: list[Plan | None] = [None] * len(meshes)
    reports: list[Any] = [None] * len(meshes)
    done = 0
    while done < len(order):
        i = order[done]
        if estimates is not None and done >= searched and any(c is not None and c.fits for c in evaluated):
            break
        if estimates is not None and not estimates[i].screened:  # none fits yet: the whole screen's order
            rest = complete(gm, meshes, registry, costs, estimates, steps.lists)
            order = order[:done] + [j for j in rest if j not in order[:done]]
            i = order[done]
        done += 1
        shared = estimates[i].shared if estimates is not None else None
        gm.meta.pop("autopar_search", None)
        candidate, plans[i] = _evaluate(gm, meshes[i], registry, costs[i], planner, limit, shared, storage)
        reports[i] = gm.meta.get("autopar_search")
        if estimates is not None:
            candidate = replace(candidate, estimate=estimates[i].value, bound=estimates[i].bound)
            estimates[i].shared = None
        evaluated[i] = candidate
    ranked = [
        c if c is not None else _screened_out(meshes[i], estimates, order, i) for i, c in enumerate(evaluated)
    ]
    ranked = _scheduled(
        gm, ranked, plans, costs, registry, hardware, overlap_candidates, memory_limit, step_time
    )
    order = sorted(range(len(ranked)), key=lambda i: (*rank_key(ranked[i]), i))
    choice = MeshChoice(world_size, hardware, planner, limit, [ranked[i] for i in order])
    if not choice.candidates or not choice.chosen.fits:
        raise _no_mesh_error(choice)
    kept = plans[order[0]]
    if keep_plan and planner == "search" and kept is not None:  # (greedy: fitted to the limit here only)
        choice.chosen_plan = ChosenPlan(kept, reports[order[0]])
    if keep_plans:
        choice.plans = {(m.shape, m.axis_names): p for m, p in zip(meshes, plans) if p is not None}
    return choice


def rank_key(c: MeshCandidate) -> tuple[int, int, float]:
    """Fitting candidates first (those modeled with overlap first, by the step they are ranked
    by), then those that do not fit (by memory), those with no plan, and those not searched."""
    if c.fits:
        return 0, 0 if math.isfinite(c.scheduled_time) else 1, c.rank_time
    if math.isfinite(c.memory):
        return 1, 1, c.memory
    if c.searched:
        return 2, 1, 0.0
    return (3, 1, c.estimate) if not math.isnan(c.estimate) else (3, 2, c.bound)


def _screened_out(mesh: Mesh, estimates: list[Estimate] | None, order: list[int], i: int) -> MeshCandidate:
    """Candidate `i`, ranked below the ones searched by the screen (`order`)."""
    assert estimates is not None  # only a screen leaves candidates unsearched
    found, where = estimates[i], f"screened {order.index(i) + 1} of {len(order)}"
    if not found.screened and not math.isnan(found.first):
        why = f"not screened: first estimate {found.first * 1e3:.4g} ms (other meshes' plans priced here)"
        return MeshCandidate(mesh.shape, mesh.axis_names, error=why, bound=found.bound, searched=False)
    if not found.screened:
        why = f"not screened: bound {found.bound * 1e3:.4g} ms above the searched ones' estimates"
        return MeshCandidate(mesh.shape, mesh.axis_names, error=why, bound=found.bound, searched=False)
    why = (
        f"not searched: {where}, cheapest seed {found.value * 1e3:.4g} ms ({found.seed})"
        if math.isfinite(found.value)
        else f"not searched: {where}, no cheap plan"
    )
    return MeshCandidate(
        mesh.shape, mesh.axis_names, error=why[:160], estimate=found.value, bound=found.bound, searched=False
    )


def _scheduled(
    gm: fx.GraphModule,
    evaluated: list[MeshCandidate],
    plans: list[Plan | None],
    costs: Sequence[TimeCost],
    registry: RuleRegistry,
    hardware: str,
    at_most: int,
    memory_limit: float | None,
    step_time: StepTime,
) -> list[MeshCandidate]:
    """The candidates with `scheduled_time` set on those worth modeling with overlap (module doc).
    On tables that price a collective's own time on its rank (`Link.call`), a searched plan's start
    (`SearchPlan.start`) is scheduled too, and replaces it in `plans` and in the candidate where it
    models faster (the choice then compiles it; `compiler.lowering.prefer_scheduled` decides alike)."""

    out = list(evaluated)
    best = math.inf
    fitting = sorted(
        (i for i, c in enumerate(evaluated) if c.fits), key=lambda i: (evaluated[i].step_time, i)
    )
    modeled = 0
    for i in fitting:
        candidate, plan = evaluated[i], plans[i]
        if modeled == at_most:
            break
        if candidate.compute_time >= best:  # (not the communication: bucketing shortens it)
            continue
        modeled += 1
        assert plan is not None
        mesh = Mesh.from_shape(candidate.shape, candidate.names)
        scheduled = step_time(gm, plan, mesh, registry, hardware, memory_limit)
        out[i] = replace(candidate, scheduled_time=scheduled)
        start = plan.start if isinstance(plan, SearchPlan) else None
        if start is not None and costs[i].mesh.counts_calls:
            from_start = step_time(gm, start, mesh, registry, hardware, memory_limit)
            if from_start < scheduled:
                comm, compute = plan_cost_parts(gm, start, mesh, costs[i], once=True)
                memory = start.memory.total if start.memory is not None else math.nan
                out[i] = replace(
                    candidate, comm_time=comm, compute_time=compute, memory=memory, roles=start.roles,
                    scheduled_time=from_start, storage=start.storage,
                    reduce_time=gradient_reduction_time(gm, start, mesh.shape, costs[i].mesh.hw),
                    param_bytes=start.memory.params if start.memory is not None else math.nan,
                )  # fmt: skip
                plans[i] = start
        best = min(best, out[i].scheduled_time)
    return out


def _evaluate(
    gm: Any,
    mesh: Mesh,
    registry: RuleRegistry,
    cost: TimeCost,
    planner: str,
    limit: float,
    shared: Shared | None = None,
    storage: str = "auto",
) -> tuple[MeshCandidate, Plan | None]:
    try:
        if planner == "search":
            plan: SearchPlan = search_layouts(
                gm, mesh, registry, cost=cost, memory_limit=limit, shared=shared, storage=storage
            )
        elif planner == "greedy":
            plan = fit_memory(gm, choose_layouts(gm, mesh, registry), mesh, cost, limit)
        else:
            raise AutoparError(f"unknown planner {planner!r}", hint='use "search" or "greedy"')
    except MemoryLimitError as exc:
        return MeshCandidate(
            mesh.shape, mesh.axis_names, memory=exc.memory, error="does not fit in memory"
        ), None
    except AutoparError as exc:
        error = f"{type(exc).__name__}: {exc.message}"[:160]
        return MeshCandidate(mesh.shape, mesh.axis_names, error=error), None
    comm, compute = plan_cost_parts(gm, plan, mesh, cost, once=True)  # as insert_comm will emit it
    memory = plan.memory.total if plan.memory is not None else math.nan
    stored = plan.memory.params if plan.memory is not None else math.nan
    reduce = gradient_reduction_time(gm, plan, mesh.shape, cost.mesh.hw)
    candidate = MeshCandidate(mesh.shape, mesh.axis_names, comm, compute, memory, True, plan.roles)
    experts = tuple(mesh.axis_names[a] for a in expert_axes(gm, plan)) if has_grouped_mm(gm) else None
    return replace(
        candidate, storage=getattr(plan, "storage", ""), reduce_time=reduce, param_bytes=stored, experts=experts
    ), plan


def _no_mesh_error(choice: MeshChoice) -> AutoparError:
    table = choice.table()
    lean = [c for c in choice.candidates if math.isfinite(c.memory)]
    if lean:
        best = min(lean, key=lambda c: c.memory)
        return MemoryLimitError(
            f"no mesh of {choice.world_size} ranks fits the memory limit of {format_bytes(choice.memory_limit)} "
            f"per rank; the leanest, {best.label}, needs {format_bytes(best.memory)}\n{table}",
            memory=best.memory,
            limit=choice.memory_limit,
            hint="use more ranks, a smaller batch or sequence, or a larger memory_limit",
        )
    return AutoparError(
        f"no mesh of {choice.world_size} ranks has a plan for this model\n{table}",
        hint="use a world size whose factors divide the model's batch and hidden dims",
    )
