"""Plan search: improve the greedy plan over the whole joint graph, under a memory limit.

The greedy pass decides each op looking only at its producers. Here every decided op becomes a
variable whose values are its strategies; the objective is the modeled cost of the whole step:
each op's compute under its strategy, plus the redistribution on every edge between a producer's
output layout and its consumer's required input layout, plus parameter gathers and gradient
reductions. The graph is cut into chains (an op whose only decided producer is the previous one);
each chain is solved exactly by dynamic programming (Viterbi) with the rest of the graph held fixed,
and the chains are swept forward and backward until the total stops falling (coordinate descent
with exact block moves; `autopar.planning.search_problem`). Seeds are the greedy plans for every assignment
of axis roles, those of the narrower registries the rules ask to seed from (a "cp" axis: the
balanced causal order, `RuleRegistry.seed_from`), and the fixed 1-D / 2-D / 3-D scheme plans that lay out
on this mesh (`autopar.planning.search_seeds`); the chain moves start from the cheapest role seed, from the
cheapest seed of each narrower registry, and from the cheapest fixed seed when that is cheaper still, so the search is never worse than any seed; role
assignments that cannot split the model (a token axis larger than the batch) are skipped, and only
if no seed works is the error raised. Edge tables are priced per pair of placements
(`autopar.planning.search_cost`).

Memory: a plan must fit `memory_limit` bytes per rank (default: `MEMORY_HEADROOM` of the hardware
table's device memory; no limit when pricing in element counts). Stored parameters, gradients and
AdamW states are nearly the same for every plan (each rank stores ~1/p); what plans change is the
activations the forward saves for backward, including gathered weights that backward reuses. When
the cheapest plan does not fit, saved bytes get a price per byte, raised until the plan fits: with
it the search trades time for memory, both in layouts and per weight chain, whose saved gathered
copy can be dropped and gathered again in backward (`SearchPlan.regather`, carried out by
`autopar.passes.regather`). If even the leanest plan does not fit, `MemoryLimitError` says by how much.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.cost.formulas import format_bytes
from autopar.planning.greedy import greedy_plan
from autopar.planning.greedy_roles import axis_roles
from autopar.planning.memory import PlanMemory, plan_memory
from autopar.planning.plan_cost import GraphFacts, plan_cost, plan_cost_parts
from autopar.planning.search_cost import ElementCost, TimeCost, even_factor, even_steps
from autopar.planning.search_fit import (
    Fitted,
    SearchPlan,
    default_memory_limit,
    fit,
    fit_memory,
    leanest_need,
    memory_error,
    price_memory,
    recompute_note,
    replicated_fits,
    weight_state_bytes,
)
from autopar.planning.search_polish import polish
from autopar.planning.search_problem import Problem, Shared
from autopar.planning.search_seeds import (
    ATTENTION,
    ORDER,
    expert_axes,
    expert_seeds,
    has_grouped_mm,
    has_routed_experts,
    note_cheapest,
    order_seeds,
    splits_experts,
    uses_all_to_all,
)
from autopar.planning.search_vars import Tally
from autopar.planning.storage import REPLICATED, SHARDED, STORAGE_MODES, replicate_storage
from autopar.rules.base import RuleRegistry

__all__ = [
    "ElementCost",
    "GraphFacts",
    "SearchPlan",
    "SearchReport",
    "TimeCost",
    "default_memory_limit",
    "even_factor",
    "even_steps",
    "fit_memory",
    "format_bytes",
    "plan_cost",
    "plan_cost_parts",
    "replicated_fits",
    "role_assignments",
    "search_layouts",
    "weight_state_bytes",
]

MAX_SWEEPS = 8
TIE = 1e-9  # relative cost difference below which two plans tie (the leaner wins)



@dataclass
class SearchReport:
    # roles ("tensor/tensor/token") or "fixed:<scheme>" -> modeled cost of that seed plan
    seeds: dict[str, float] = field(default_factory=dict)
    failed_roles: dict[str, str] = field(default_factory=dict)  # roles -> why the greedy pass failed
    failed_fixed: dict[str, str] = field(default_factory=dict)  # "fixed:<scheme>", "order:<name>:<roles>" -> why it failed
    chosen_seed: str = ""  # the seed whose chain moves gave the plan (see `_starts`)
    chosen_roles: tuple[str, ...] = ()
    seed_cost: float = 0.0
    final_cost: float = 0.0  # includes the regathers' collectives and the recomputed ops
    sweeps: int = 0
    variables: int = 0
    chains: int = 0
    distinct_chains: int = 0  # chains with different structure (repeated layers share one)
    solves: int = 0
    memo_hits: int = 0  # chain solves answered from an identical earlier one
    memory_limit: float = math.inf
    memory: float = 0.0  # bytes per rank of the chosen plan
    working: float = 0.0  # of which the working memory at the step's peak op (`planning.working`)
    prices: list[float] = field(default_factory=list)  # memory prices tried (cost per byte)
    regathered: tuple[str, ...] = ()  # weight chains gathered again in backward
    recomputed: tuple[str, ...] = ()  # units recomputed in backward ("op:..", "block:..", "region:..")
    storage: str = ""  # how the chosen plan stores its weights: "sharded" or "replicated"
    # MoE layers: the cheapest plan the search found (over every start's fitting options) with
    # some grouped matmul's experts split over a mesh axis, and keeping every expert whole on
    # every rank; None where it found none (`search_seeds.splits_experts`). Why the experts are
    # (or are not) split, in the search's own units (`cost_unit`).
    experts_split_cost: float | None = None
    experts_whole_cost: float | None = None
    # with MoE layers traced as routed-experts ops: the cheapest plan splitting the experts with
    # each token dispatcher ("all-to-all", "all-gather")
    dispatcher_costs: dict[str, float] = field(default_factory=dict)
    # the cheapest plan found per set of mesh axes holding the experts ((): whole on every rank),
    # over every start's fitting options (the expert seed's start is the cheapest of the expert
    # split over every axis and over each axis alone, `search_seeds.expert_seeds`)
    experts_axes_costs: dict[tuple[int, ...], float] = field(default_factory=dict)
    cost_unit: str = "elements"


def search_layouts(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    *,
    cost: ElementCost | None = None,
    max_sweeps: int = MAX_SWEEPS,
    memory_limit: float | None = None,
    fixed_seeds: bool = True,
    shared: Shared | None = None,
    storage: str = "auto",
) -> SearchPlan:
    """Best seed (greedy plans over axis-role assignments and, with `fixed_seeds`, the fixed
    schemes' plans on this mesh), then exact chain moves until no gain, within `memory_limit`
    bytes per rank (None: the default of the cost's hardware; math.inf: none). `shared`: the
    candidate lists and greedy memo of earlier greedy passes on this graph and mesh.
    `storage`: how weights are stored (`planning.storage`): "sharded", "replicated", or "auto"
    (default): on a hardware table where the weights fit replicated (`replicated_fits`), both
    searched and the cheaper plan kept (on a tie, the leaner); in element counts, sharded."""
    if storage not in ("auto", *STORAGE_MODES):
        raise AutoparError(f"unknown weight storage {storage!r}", hint='use "auto", "sharded" or "replicated"')
    cost = cost or ElementCost(mesh.shape)
    limit = default_memory_limit(cost) if memory_limit is None else float(memory_limit)
    if storage == REPLICATED and not replicated_fits(gm, limit):
        raise AutoparError(
            f'weights stored "replicated" need {weight_state_bytes(gm) / 2**30:.3g} GiB per rank (every '
            f"parameter whole with its gradient and AdamW states), over the memory limit of {limit / 2**30:.3g} GiB",
            hint='store them "sharded" (or "auto"), give a larger memory_limit, or use more tensor-parallel ranks',
        )
    report = SearchReport(memory_limit=limit)
    facts = GraphFacts.of(gm)
    if shared is None:  # (the mesh choice hands over what its screen worked out on this mesh)
        shared = Shared(work={name: work for name, _, work, _, _ in facts.calls})
    modes = [m for m in (storage,) if m != "auto"] or [SHARDED, *([REPLICATED] if _replicas_wanted(gm, cost, limit) else [])]
    runs = [
        _from_seed(gm, mesh, _searched_in(registry, start[0]), cost, shared, facts, start, limit, max_sweeps, report, mode)
        for mode in modes
        for start in _starts(gm, mesh, registry, cost, shared, facts, report, fixed_seeds, mode)
    ]
    fitting = [(option, run) for run in runs for option in run.options]
    if not fitting:
        lean = min((run.leanest(gm, mesh) for run in runs), key=leanest_need)
        raise memory_error(lean, mesh, limit, "the leanest plan found")
    # never worse than a start (its seed is an option); ties (to rounding: sharded and replicated
    # storage often move the same elements) keep the leaner plan, then the earlier start
    cheapest = min(option.cost for option, _ in fitting)
    best, run = min(
        ((o, r) for o, r in fitting if o.cost <= cheapest + TIE * abs(cheapest)), key=lambda t: (t[0].bytes, t[0].cost)
    )
    final = best.search_plan(gm, mesh)
    starts = [r.start for r in runs if r.start is not None]
    if starts:
        start = min(starts, key=lambda f: (f.cost, f.bytes))
        if (
            start.plan.strategies != best.plan.strategies
            or start.regather != best.regather
            or start.storage != best.storage
        ):
            final.start = start.search_plan(gm, mesh)
    prefix = "" if run.storage == SHARDED else run.storage + ":"  # (as `report.seeds` names it)
    report.chosen_seed, report.chosen_roles, report.sweeps = prefix + run.name, run.seed.roles, run.sweeps
    report.storage = final.storage = run.storage
    report.variables, report.chains = run.variables, run.chains
    report.final_cost = best.cost
    report.cost_unit = "seconds" if isinstance(cost, TimeCost) else "elements"
    if has_grouped_mm(gm):
        for option, _ in fitting:
            field_name = "experts_split_cost" if splits_experts(gm, option.plan) else "experts_whole_cost"
            if getattr(report, field_name) is None or option.cost < getattr(report, field_name):
                setattr(report, field_name, option.cost)
            if field_name == "experts_split_cost" and has_routed_experts(gm):
                kind = "all-to-all" if uses_all_to_all(gm, option.plan) else "all-gather"
                if option.cost < report.dispatcher_costs.get(kind, math.inf):
                    report.dispatcher_costs[kind] = option.cost
            note_cheapest(report.experts_axes_costs, expert_axes(gm, option.plan), option.cost)
    report.memory = final.memory.total if final.memory is not None else 0.0
    report.working = final.memory.working if final.memory is not None else 0.0
    report.regathered = best.regather
    report.recomputed = best.savings.units
    report.solves = sum(r.tally.solves for r in runs)
    report.memo_hits = sum(r.tally.memo_hits for r in runs)
    report.distinct_chains = run.tally.distinct_chains
    memory_note = (
        f"; memory {format_bytes(report.memory)} per rank of {format_bytes(limit)}, "
        f"{len(best.regather)} gathered weights gathered again in backward"
        if math.isfinite(limit)
        else ""
    ) + recompute_note(best.savings)
    final.notes["__search__"] = (
        f"search: seed {report.seed_cost:.4g} -> {best.cost:.4g} in {report.sweeps} sweeps over "
        f"{report.variables} ops in {report.chains} chains ({report.distinct_chains} distinct) from "
        f"seed {report.chosen_seed}; roles {'/'.join(report.chosen_roles)}; weights stored {run.storage}"
        f"{memory_note}"
    )
    gm.meta["autopar_search"] = report
    return final


def _starts(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    cost: ElementCost,
    shared: Shared,
    facts: GraphFacts,
    report: SearchReport,
    fixed: bool = True,
    storage: str = SHARDED,
) -> list[tuple[str, Plan, float]]:
    """Where the chain moves start: the cheapest greedy plan over role assignments, and (`fixed`)
    the cheapest fixed scheme's plan on this mesh when it is cheaper still. Both are searched from,
    so the result is never worse than any seed, nor than the search from the role seeds alone (a
    cheaper start can end higher). Every seed's cost is in `report.seeds` (under "replicated"
    storage named "replicated:<seed>", each seed with its weights stored as they compute); if no
    role assignment and no scheme works, the most telling error of the role assignments is raised."""
    prefix = "" if storage == SHARDED else storage + ":"
    best: tuple[str, Plan, float] | None = None
    errors: list[tuple[tuple[str, ...], Exception]] = []
    for roles in role_assignments(mesh):
        try:
            plan = shared.role_plan(gm, mesh, registry, roles)
        except Exception as exc:  # a role assignment that cannot split this model evenly
            errors.append((roles, exc))
            report.failed_roles["/".join(roles)] = str(exc).splitlines()[0]
            continue
        plan = _stored(gm, plan, mesh, storage)
        value = report.seeds[prefix + "/".join(roles)] = _price(gm, plan, mesh, cost, facts, shared, storage)
        if best is None or value < best[2]:
            best = ("/".join(roles), plan, value)
    starts = [best] if best is not None else []
    # the cheapest seed of each narrower registry the search seeds from (the balanced causal
    # order on a "cp" axis): searched from in any case, as the moves from other seeds miss it
    orders: dict[str, tuple[str, Plan, float]] = {}
    for name, found in order_seeds(gm, mesh, registry, role_assignments(mesh), shared.expand):
        if isinstance(found, AutoparError):
            report.failed_fixed[name] = found.message.splitlines()[0]
            continue
        found = _stored(gm, found, mesh, storage)
        value = report.seeds[prefix + name] = plan_cost(gm, found, mesh, cost, facts)
        order = name.rsplit(":", 1)[0]
        if order not in orders or value < orders[order][2]:
            orders[order] = (name, found, value)
    starts.extend(orders.values())
    if fixed:
        # the cheapest expert split over every axis, and the cheapest over one axis alone: both
        # searched from in any case (moves from other seeds do not reach them, nor each other)
        experts: dict[bool, tuple[str, Plan, float]] = {}
        for name, found in expert_seeds(gm, mesh, registry, shared.expand, shared.greedy):
            if isinstance(found, AutoparError):
                report.failed_fixed[name] = found.message.splitlines()[0]
                continue
            found = _stored(gm, found, mesh, storage)
            value = report.seeds[prefix + name] = plan_cost(gm, found, mesh, cost, facts)
            alone = "@" in name
            if alone not in experts or value < experts[alone][2]:
                experts[alone] = (name, found, value)
        starts.extend(experts.values())
        # the cheapest scheme's plan, and the cheapest with attention and the residual stream forced
        # too: both searched from where cheaper than the role seeds (a cheaper start can end higher:
        # on the plan-quality GPT at 4x4x4 the forced start ends 0.5 % above the cube's own)
        cheapest: dict[bool, tuple[str, Plan, float]] = {}
        for name, found in shared.fixed_plans(gm, mesh, registry):
            if isinstance(found, AutoparError):
                report.failed_fixed[name] = found.message.splitlines()[0]
                continue
            found = _stored(gm, found, mesh, storage)
            value = report.seeds[prefix + name] = _price(gm, found, mesh, cost, facts, shared, storage)
            forced = name.endswith(ATTENTION)
            if forced not in cheapest or value < cheapest[forced][2]:
                cheapest[forced] = (name, found, value)
        starts.extend(start for start in cheapest.values() if best is None or start[2] < best[2])
    if not starts:
        raise _roles_error(errors)
    report.seed_cost = min(start[2] for start in starts)
    return starts


@dataclass
class _Run:
    """The chain moves from one start: what its problem counted and the plans it offers (fitting
    the limit). Not the problem itself: `search_layouts` keeps every start's run until it picks one,
    and a problem holds its edges' pair tables (tens of MB on a four-axis mesh)."""

    name: str
    seed: Plan
    tally: Tally
    variables: int
    chains: int
    sweeps: int
    options: list[Fitted]
    start: Fitted | None  # the seed itself, fitted (None: it does not fit)
    first: Plan  # the plan of the unpriced optimum
    lean: PlanMemory | None  # the leanest plan's memory seen while pricing memory, if priced
    storage: str = SHARDED

    def leanest(self, gm: fx.GraphModule, mesh: Mesh) -> PlanMemory:
        """For the error when nothing fits: the leanest plan seen, or the unpriced optimum's."""
        return self.lean if self.lean is not None else plan_memory(gm, self.first, mesh.shape)


def _from_seed(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    cost: ElementCost,
    shared: Shared,
    facts: GraphFacts,
    start: tuple[str, Plan, float],
    limit: float,
    max_sweeps: int,
    report: SearchReport,
    storage: str = SHARDED,
) -> _Run:
    name, seed, seed_cost = start
    problem = Problem(gm, mesh, registry, seed, cost, shared.expand, shared, replicated=storage == REPLICATED)
    unmoved = problem.snapshot()
    sweeps = problem.optimize(max_sweeps)

    def materialize(moved: Problem = problem) -> Plan:
        plan = greedy_plan(
            gm,
            mesh,
            registry,
            roles=seed.roles,
            forced=moved.forced(),
            expand_cache=shared.expand,
            memo=shared.greedy,
        )
        return _stored(gm, plan, mesh, storage)

    # nothing moved: the greedy pass with every decided strategy forced to the seed's is the seed
    first = materialize() if problem.snapshot() != unmoved else seed
    options = [fit(gm, seed, mesh, cost, limit, facts=facts, known=seed_cost)]
    fitted_seed = options[0]
    if first is not seed:
        options.insert(0, fit(gm, first, mesh, cost, limit, facts=facts))
    lean = None
    if (options[0] is None or options[0].savings.traded) and math.isfinite(limit):
        priced, lean = price_memory(gm, mesh, cost, facts, limit, problem, max_sweeps, materialize, report.prices)
        options += priced
    # from there, moves that price a value read by k ops of one phase at 1/k per reader (insert_comm
    # redistributes it once per wanted layout): the pairwise objective above counts one
    # redistribution per reader and misses sums that should stay pending until their fan-out
    # (`Problem._count_readers`); the plan they give is one more option, priced exactly (`plan_cost`)
    shared_moves = Problem(
        gm, mesh, registry, first, cost, shared.expand, shared, replicated=storage == REPLICATED, share_readers=True
    )
    before = shared_moves.snapshot()
    shared_moves.optimize(max_sweeps)
    moved = shared_moves.snapshot()
    if moved != before:
        options.append(fit(gm, materialize(shared_moves), mesh, cost, limit, facts=facts))
    # and from there, single ops moved where a value's readers want different layouts, priced once
    # per wanted layout as insert_comm emits them (`search_polish`): one more option
    if polish(shared_moves) and shared_moves.snapshot() != moved:
        options.append(fit(gm, materialize(shared_moves), mesh, cost, limit, facts=facts))
    kept = [o for o in options if o is not None]
    for option in kept:
        option.storage = storage
    counts = (problem.tally, len(problem.vars), len(problem.chains))
    return _Run(name, seed, *counts, sweeps, kept, fitted_seed, first, lean, storage)


def _price(
    gm: fx.GraphModule, plan: Plan, mesh: Mesh, cost: ElementCost, facts: GraphFacts, shared: Shared, storage: str
) -> float:
    """A seed's `plan_cost`: sharded, the plan `shared` holds (the screen may have priced it
    already, `Shared.priced`); replicated, a plan made for this storage, priced here."""
    if storage == SHARDED:
        return shared.priced(gm, plan, mesh, cost, facts)
    return plan_cost(gm, plan, mesh, cost, facts)


def _stored(gm: fx.GraphModule, plan: Plan, mesh: Mesh, storage: str) -> Plan:
    """`plan` (as the greedy pass lays weights out: sharded) with its weights stored as `storage`."""
    return replicate_storage(gm, plan, mesh.shape) if storage == REPLICATED else plan


def _replicas_wanted(gm: fx.GraphModule, cost: ElementCost, limit: float) -> bool:
    """Whether `storage="auto"` searches replicated storage too: on a hardware table (seconds,
    which see what replicas save: a collective's latency and its own time on the rank, the
    gathers on the critical path) where the weights fit replicated. In element counts a gather
    plus a reduce-scatter moves what an all-reduce moves and memory has no price, so plans priced
    that way (explicit meshes without a table) keep ~1/p per rank."""
    return isinstance(cost, TimeCost) and replicated_fits(gm, limit)


def _roles_error(errors: list[tuple[tuple[str, ...], Exception]]) -> Exception:
    """The error of the attempt that got furthest: one past the batch check, else the default's."""
    ours = [(r, e) for r, e in errors if isinstance(e, AutoparError)]
    if not ours:
        return errors[0][1]
    roles, error = next(((r, e) for r, e in ours if e.op != "input"), ours[0])
    assert isinstance(error, AutoparError)
    tried = ", ".join("/".join(r) for r, _ in errors)
    hint = f"every assignment of axis roles failed ({tried}); this one with roles {'/'.join(roles)}"
    return type(error)(
        error.message,
        op=error.op,
        where=error.where,
        layouts=error.layouts,
        hint=f"{error.hint}; {hint}" if error.hint else hint,
    )


def role_assignments(mesh: Mesh) -> list[tuple[str, ...]]:
    """The default roles first, then every distinct arrangement of tensor/token roles over the axes,
    all-token among them: every axis splits the batch and weights are stored split and gathered
    where used (ZeRO-3-like), which can lose on the summed step and still hide its communication
    best (`autopar.planning.mesh_choice` ranks meshes by the scheduled step)."""
    default = axis_roles(mesh)
    sized = [a for a, s in enumerate(mesh.shape) if s > 1]
    options = [default]
    for combo in itertools.product(("tensor", "token"), repeat=len(sized)):
        roles = list(default)
        for a, role in zip(sized, combo):
            roles[a] = role
        if tuple(roles) not in options:
            options.append(tuple(roles))
    return options


def _searched_in(registry: RuleRegistry, start: str) -> RuleRegistry:
    """The registry whose candidates the chain moves from seed `start` choose among: a narrower
    registry's seed (`search_seeds.order_seeds`) is searched within that registry, since the
    moves among `registry`'s own lists, where its plans are a few ops among many contiguous
    copies, fall back into the contiguous plans (the balanced seed on the zoo's LLaMA at sequence
    2048, (2, 4) ("dp", "cp"): 0.307 ms searched so, 0.213 within its own registry). Its plans
    meet `registry`'s requirements (the seed was checked; the narrower registry's are stricter)."""
    if not start.startswith(ORDER):
        return registry
    order = start[len(ORDER) :].split(":", 1)[0]
    return dict(registry.seed_orders())[order]
