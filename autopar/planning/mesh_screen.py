"""The mesh choice's screen: a cheap plan per candidate mesh, to pick the few worth searching.

At 512 ranks there are 93 candidate meshes, and the search on one four-axis mesh of a 32-layer
LLaMA takes tens of seconds (a greedy pass per assignment of axis roles, then the chain moves).
The screen prices each candidate's cheapest plans instead: the greedy pass with the mesh's default
roles, the fixed 1-D / 2-D / cube / 3-D grid layouts on it (`search_seeds.fixed_seeds`) and, for
MoE layers traced as routed-experts ops (`PlanOptions.token_dispatch` "alltoall" or "auto"), each
token dispatcher on each axis (`search_seeds.dispatcher_seeds`: the greedy pass cannot price the
all-to-all's exchanges inside the op, so a mesh screened without them would be ranked by its
all-gather plan alone), which are among the search's own seeds. The search starts from its cheapest
seed and never ends above it, so a candidate's estimate is an upper bound on its searched plan's modeled step (both are
`plan_cost`, each redistribution counted once); it is not a lower bound, so ranking by it and
searching only the best few (`mesh_choice.SEARCHED_CANDIDATES`) is a heuristic. The greedy
passes' candidate lists and answers (`Shared`) are handed to the search of the candidates kept,
so screening them costs nothing twice.

With hundreds of meshes (1536 ranks: 463, 444 of them with three or four axes) the estimate itself
is too dear for every mesh (about a second each on a 96-layer graph: the greedy pass asks its
first layer's questions again at every mesh's sizes). The screen then runs in two stages:
meshes of one or two axes (whose fixed-scheme seeds a plan of another mesh does not stand for) and,
per number of axes, the `REPRESENTATIVES` meshes with the lowest bounds get their full estimate;
every other mesh gets a first estimate, the cheapest of those representatives' plans priced on
its own sizes (`plan_transplant.PlanPattern`: a few hundred cost questions instead of a graph
walk), and only the `SECOND_STAGE` best by that first estimate get the full one, and after them
every mesh whose first estimate is at or below the `keep`-th best full estimate found (a plan
known there beats a mesh that would be searched). A first estimate is the price of a valid plan
there, not of the mesh's own seeds, and the two differ by more than the meshes do: the greedy pass
around a fixed scheme's linears (the 3-D grid's attention, layer norms, residual stream) chooses
by the mesh's sizes, so on 16 ranks the (4, 2, 2) representative's grid plan priced on (2, 4, 2) is
9 % below that mesh's own seeds and on (2, 2, 4) 8 % above them (its own grid seed, with attention
split by sequence on the contraction axis, is the cheapest of the three); the representatives'
other grid orders, or the plans with axes permuted onto the mesh's sizes, do not reverse that. So
this is a heuristic, like searching only the best few estimates; `tests/test_plan_scale.py` and
`tests/test_plan_transplant.py` hold it to the whole screen's choice on spaces small enough to
screen exhaustively. Below that many meshes the screen estimates every mesh (save those the bound
skips).

The screen starts from the experts over one mesh axis or two (`SCREENED_EXPERT_AXES`), not over
three as the search of a kept mesh also does: on a four-axis mesh the four triples would add 8 of
its 28 dispatcher passes, and a plan with the experts over three axes is still reached by the
search of a mesh kept for its two-axis or one-axis starts.

The token dispatchers' starts come in two layouts (`search_seeds.dispatcher_seeds`): with the
mesh's default roles (tensor axes splitting the weights around the MoE layers) and with every axis
a data axis (":data"). On a four-axis mesh that is 28 greedy passes, most of a DeepSeek-V3 screen
at 256 ranks. The screen prices the ":data" starts first and the default-role ones only where the
mesh's own weight-splitting plans (the default-role greedy plan, the fixed schemes) are no dearer
than the cheapest ":data" start: a default-role start is one of those plans with its MoE layers'
dispatcher forced, so where the weight splits already lose to expert plus data parallelism, it is
not what ranks the mesh. A heuristic like the others (the search of a kept mesh still starts from
every layout); docs/moe-published.md measures what it changes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.core.strategy import Strategy
from autopar.planning.greedy_roles import axis_roles
from autopar.planning.greedy_scores import GreedyMemo
from autopar.planning.mesh_bound import Bounds
from autopar.planning.plan_cost import GraphFacts, plan_cost
from autopar.planning.plan_transplant import PlanPattern
from autopar.planning.search_cost import ElementCost
from autopar.planning.search_problem import Shared
from autopar.planning.search_seeds import DATA, dispatcher_seeds
from autopar.rules.base import RuleRegistry
from autopar.rules.calls import ExpandCache

# Meshes with at least this many axes can be ranked first by other meshes' plans (two-stage
# screen); those with fewer get their full estimate (their fixed 1-D / 2-D seeds win there).
FIRST_STAGE_AXES = 3
# Per number of axes and roles: meshes estimated in full first, whose plans the others are priced by.
REPRESENTATIVES = 4
# Meshes estimated in full after the first stage, the best by their first estimate.
SECOND_STAGE = 16
# The most mesh axes the screen's token-dispatcher starts put the experts over (module doc).
SCREENED_EXPERT_AXES = 2


@dataclass
class Estimate:
    """The cheapest screened plan of one candidate mesh (`value` inf: none worked)."""

    value: float
    seed: str
    shared: Shared | None  # what its greedy passes worked out, for the search of this mesh
    screened: bool = True  # False: skipped by the bound (`value` nan)
    bound: float = math.nan  # `mesh_bound` lower bound on `value`; nan: not computed
    # the cheapest representative's plan priced on this mesh (`plan_transplant`); nan: not priced
    first: float = math.nan
    pattern: PlanPattern | None = None  # a representative's best plan, to price on other meshes


def estimate(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    cost: ElementCost,
    facts: GraphFacts,
    calls: GreedyMemo | None = None,
    library: dict[Any, list[Strategy]] | None = None,
    keep_pattern: bool = False,
) -> Estimate:
    """The modeled cost (`plan_cost`) of the cheapest of the default-role greedy plan, the fixed
    schemes' plans and the token dispatchers' seeds (MoE layers as routed-experts ops) on `mesh`:
    an upper bound on what the search finds there. `calls`: a memo whose nodes' op calls and
    inputs (the same on every mesh) this mesh's passes share. `library`: candidate lists shared
    by meshes whose sizes divide the same dims (`ExpandCache`). `keep_pattern`: keep the cheapest
    plan's `PlanPattern` (a representative's)."""
    work = {name: work for name, _, work, _, _ in facts.calls}
    shared = Shared(expand=ExpandCache(library), work=work, greedy=graph_memo(calls))
    found = _Cheapest()
    roles = axis_roles(mesh)
    try:
        plan = shared.role_plan(gm, mesh, registry, roles)  # (the search's first seed)
    except Exception:  # noqa: BLE001 - as in the search: other roles may still split this model
        pass
    else:
        found.offer("/".join(roles), plan, shared.priced(gm, plan, mesh, cost, facts))
    price = functools.partial(_priced, gm, mesh, cost, facts)
    found.offer_all(
        (name, plan, shared.priced(gm, plan, mesh, cost, facts))
        for name, plan in shared.fixed_plans(gm, mesh, registry)
        if not isinstance(plan, AutoparError)
    )
    # the experts over one axis or two: the search of a kept mesh also starts from three (`SCREENED_EXPERT_AXES`)
    starts = functools.partial(
        dispatcher_seeds, gm, mesh, registry, shared.expand, shared.greedy, widest=SCREENED_EXPERT_AXES
    )
    if all(role == "token" for role in roles):  # the default roles are the data layout: no second one
        found.offer_all(price(starts()))
    else:
        weights_split = found.value  # the cheapest plan splitting weights by the default roles or a scheme
        data = _Cheapest()
        data.offer_all(price(starts(suffixes=(DATA,))))
        if weights_split <= data.value:  # (module doc: the default-role starts)
            found.offer_all(price(starts(suffixes=("",))))
        found.offer(data.seed, data.chosen, data.value)
    best, seed, chosen = found.value, found.seed, found.chosen
    pattern = None
    if keep_pattern and chosen is not None:
        pattern = PlanPattern.of(gm, chosen, registry, facts, shared.greedy)
    return Estimate(best, seed, shared, pattern=pattern)


class _Cheapest:
    """The cheapest of the plans offered (the first of equal ones)."""

    def __init__(self) -> None:
        self.value, self.seed = math.inf, ""
        self.chosen: Plan | None = None

    def offer(self, seed: str, plan: Plan | None, value: float) -> None:
        if value < self.value:
            self.value, self.seed, self.chosen = value, seed, plan

    def offer_all(self, priced: Iterable[tuple[str, Plan, float]]) -> None:
        for seed, plan, value in priced:
            self.offer(seed, plan, value)


def _priced(
    gm: fx.GraphModule,
    mesh: Mesh,
    cost: ElementCost,
    facts: GraphFacts,
    seeds: Iterable[tuple[str, Plan | AutoparError]],
) -> Iterator[tuple[str, Plan, float]]:
    """(name, plan, `plan_cost`) of the seeds that laid out."""
    for name, found in seeds:
        if not isinstance(found, AutoparError):
            yield name, found, plan_cost(gm, found, mesh, cost, facts)


def graph_memo(calls: GreedyMemo | None) -> GreedyMemo:
    """A fresh memo for one mesh sharing `calls`' mesh-free answers: per node its op call and
    inputs, per list its `ListShape`, per beam its combined strategies."""
    return (
        GreedyMemo()
        if calls is None
        else GreedyMemo(
            inputs=calls.inputs,
            calls=calls.calls,
            questions=calls.questions,
            numbers=calls.numbers,
            shapes=calls.shapes,
            combined=calls.combined,
        )
    )


def screen(
    gm: fx.GraphModule,
    meshes: Sequence[Mesh],
    registry: RuleRegistry,
    costs: Sequence[ElementCost],
    keep: int,
    library: dict[Any, list[Strategy]] | None = None,
    bound: bool = True,
    representatives: int | None = None,
    second_stage: int | None = None,
) -> tuple[list[int], list[Estimate]]:
    """The meshes' indices by estimate (ties: the earlier one) and every mesh's `Estimate`. Only
    the `keep` best so far keep their `Shared` (the rest are searched only if those fail).
    `library`: candidate lists by op call and mesh signature, shared with other screens.

    `bound` (branch and bound): meshes are screened from the lowest `mesh_bound` bound up, and the
    screen stops at the first whose bound exceeds the `keep`-th best estimate found: its estimate,
    and every later one's, is at least its bound, so the `keep` best are those the whole screen
    finds, in the same order. The meshes left are ranked after, by bound (`Estimate.screened`
    False); `complete` screens them.

    With more than `second_stage` meshes of `FIRST_STAGE_AXES` or more axes left besides
    `representatives` per number of axes, the screen runs in two stages (module doc): the meshes
    only first-estimated are ranked after the screened ones, by first estimate (`Estimate.first`).
    `representatives` and `second_stage` default to the module's `REPRESENTATIVES` and
    `SECOND_STAGE` (read at the call)."""
    representatives = REPRESENTATIVES if representatives is None else representatives
    second_stage = SECOND_STAGE if second_stage is None else second_stage
    run = Screening(gm, registry, library)
    estimates = [Estimate(math.nan, "", None, screened=False) for _ in meshes]
    visit = list(range(len(meshes)))
    if bound:
        for i, (mesh, cost) in enumerate(zip(meshes, costs)):
            estimates[i].bound = run.bounds.bound(mesh, cost)
        visit.sort(key=lambda i: (estimates[i].bound, i))
    groups: dict[tuple[str, ...], list[int]] = {}
    for i in visit:
        if meshes[i].ndim >= FIRST_STAGE_AXES:
            groups.setdefault(axis_roles(meshes[i]), []).append(i)
    rest = sum(max(0, len(members) - representatives) for members in groups.values())
    if rest <= second_stage:
        best = _Best(keep)
        for i in visit:
            if best.beats(estimates[i].bound):
                break
            best.add(i, run.estimate(meshes[i], costs[i]), estimates)
        return _order(estimates), estimates
    return _two_stages(run, meshes, costs, keep, estimates, visit, groups, representatives, second_stage)


def _two_stages(
    run: Screening,
    meshes: Sequence[Mesh],
    costs: Sequence[ElementCost],
    keep: int,
    estimates: list[Estimate],
    visit: list[int],
    groups: dict[tuple[str, ...], list[int]],
    representatives: int,
    second_stage: int,
) -> tuple[list[int], list[Estimate]]:
    """`screen`'s two stages; `visit`: the meshes by bound, `groups`: those of `FIRST_STAGE_AXES`
    or more axes by their default roles, in `visit`'s order. A mesh whose bound exceeds the
    `keep`-th best estimate found is skipped at any stage (its estimate could not be kept). After
    the `second_stage` best first estimates, every mesh whose first estimate is at or below the
    `keep`-th best estimate found is estimated in full too (module doc)."""
    best = _Best(keep)
    patterns: dict[tuple[str, ...], list[PlanPattern]] = {roles: [] for roles in groups}
    group_of = {i: roles for roles, members in groups.items() for i in members}
    chosen = {i for members in groups.values() for i in members[:representatives]}
    full = [i for i in visit if i not in group_of or i in chosen]
    for i in full:
        if best.beats(estimates[i].bound):
            continue
        found = best.add(i, run.estimate(meshes[i], costs[i], keep_pattern=i in group_of), estimates)
        if found.pattern is not None:
            patterns[group_of[i]].append(found.pattern)
            found.pattern = None
    firsts = []
    for i in visit:
        if i not in group_of or i in chosen or best.beats(estimates[i].bound):
            continue
        prices = [p.price(run.gm, meshes[i], costs[i]) for p in patterns[group_of[i]]]
        valid = [v for v in prices if v is not None]
        if not valid:  # no representative's plan lays out here: a representative of its own
            found = best.add(i, run.estimate(meshes[i], costs[i], keep_pattern=True), estimates)
            if found.pattern is not None:
                patterns[group_of[i]].append(found.pattern)
                found.pattern = None
            continue
        estimates[i].first = min(valid)
        firsts.append(i)
    firsts.sort(key=lambda i: (estimates[i].first, i))
    for n, i in enumerate(firsts):
        if n >= second_stage and best.beats(estimates[i].first):
            break  # (module doc: past `second_stage`, only meshes with a plan below the keep-th estimate)
        if not best.beats(estimates[i].bound):
            best.add(i, run.estimate(meshes[i], costs[i]), estimates)
    return _order(estimates), estimates


class _Best:
    """The `keep` lowest estimates found so far; only their meshes keep their `Shared`."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.values: list[float] = []  # sorted
        self.found: list[int] = []  # the meshes estimated

    def beats(self, bound: float) -> bool:
        """Whether `keep` estimates at or below `bound` are known (a mesh bounded by it cannot be kept)."""
        return len(self.values) >= self.keep and bound > self.values[self.keep - 1]

    def add(self, i: int, found: Estimate, estimates: list[Estimate]) -> Estimate:
        found.bound, found.first = estimates[i].bound, estimates[i].first
        estimates[i] = found
        self.values = sorted([*self.values, found.value])[: self.keep]
        self.found.append(i)
        ranked = sorted(self.found, key=lambda j: (estimates[j].value, j))
        for j in ranked[self.keep :]:
            estimates[j].shared = None
        return found


def complete(
    gm: fx.GraphModule,
    meshes: Sequence[Mesh],
    registry: RuleRegistry,
    costs: Sequence[ElementCost],
    estimates: list[Estimate],
    library: dict[Any, list[Strategy]] | None = None,
) -> list[int]:
    """Screen the meshes `screen` left unscreened (for the mesh choice's fallback when none of the
    searched ones fits) and return the order of every mesh by estimate, as a whole screen gives."""
    run = Screening(gm, registry, library)
    for i, (mesh, cost) in enumerate(zip(meshes, costs)):
        if not estimates[i].screened:
            found = run.estimate(mesh, cost)
            found.bound, found.first, found.shared = estimates[i].bound, estimates[i].first, None
            estimates[i] = found
    return _order(estimates)


class Screening:
    """What the estimates of one screen share: the graph's facts, the mesh-free greedy answers,
    the candidate lists' library and the bounds."""

    def __init__(
        self, gm: fx.GraphModule, registry: RuleRegistry, library: dict[Any, list[Strategy]] | None
    ) -> None:
        self.gm, self.registry = gm, registry
        self.facts, self.calls = GraphFacts.of(gm), GreedyMemo()
        self.library = library if library is not None else {}
        self.bounds = Bounds(gm, self.facts)

    def estimate(self, mesh: Mesh, cost: ElementCost, keep_pattern: bool = False) -> Estimate:
        return estimate(
            self.gm, mesh, self.registry, cost, self.facts, self.calls, self.library, keep_pattern
        )


def _order(estimates: Sequence[Estimate]) -> list[int]:
    """Screened meshes by estimate, then those first-estimated by their first estimate, then the
    others by bound (ties: the earlier one)."""
    screened = [i for i, e in enumerate(estimates) if e.screened]
    first = [i for i, e in enumerate(estimates) if not e.screened and not math.isnan(e.first)]
    rest = [i for i, e in enumerate(estimates) if not e.screened and math.isnan(e.first)]
    return (
        sorted(screened, key=lambda i: (estimates[i].value, i))
        + sorted(first, key=lambda i: (estimates[i].first, i))
        + sorted(rest, key=lambda i: (estimates[i].bound, i))
    )
