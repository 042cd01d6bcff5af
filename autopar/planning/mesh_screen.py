"""The mesh choice's screen: a cheap plan per candidate mesh, to pick the few worth searching.

At 512 ranks there are 93 candidate meshes, and the search on one four-axis mesh of a 32-layer
LLaMA takes tens of seconds (a greedy pass per assignment of axis roles, then the chain moves).
The screen prices each candidate's cheapest plans instead: the greedy pass with the mesh's default
roles, the fixed 1-D / 2-D / cube schemes that lay out on it (`search_seeds.fixed_seeds`) and, for
MoE layers traced as routed-experts ops (`PlanOptions.token_dispatch` "alltoall" or "auto"), each
token dispatcher on each axis (`search_seeds.dispatcher_seeds`: the greedy pass cannot price the
all-to-all's exchanges inside the op, so a mesh screened without them would be ranked by its
all-gather plan alone), which are among the search's own seeds. The search starts from its cheapest
seed and never ends above it, so a candidate's estimate is an upper bound on its searched plan's modeled step (both are
`plan_cost`, each redistribution counted once); it is not a lower bound, so ranking by it and
searching only the best few (`mesh_choice.SEARCHED_CANDIDATES`) is a heuristic. The greedy
passes' candidate lists and answers (`Shared`) are handed to the search of the candidates kept,
so screening them costs nothing twice.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.core.strategy import Strategy
from autopar.planning.greedy import axis_roles, greedy_plan
from autopar.planning.greedy_scores import GreedyMemo
from autopar.planning.mesh_bound import Bounds
from autopar.planning.plan_cost import GraphFacts, plan_cost
from autopar.planning.search_cost import ElementCost
from autopar.planning.search_problem import Shared
from autopar.planning.search_seeds import dispatcher_seeds, fixed_seeds
from autopar.rules.base import RuleRegistry
from autopar.rules.calls import ExpandCache


@dataclass
class Estimate:
    """The cheapest screened plan of one candidate mesh (`value` inf: none worked)."""

    value: float
    seed: str
    shared: Shared | None  # what its greedy passes worked out, for the search of this mesh
    screened: bool = True  # False: skipped by the bound (`value` nan)
    bound: float = math.nan  # `mesh_bound` lower bound on `value`; nan: not computed


def estimate(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    cost: ElementCost,
    facts: GraphFacts,
    calls: GreedyMemo | None = None,
    library: dict[Any, list[Strategy]] | None = None,
) -> Estimate:
    """The modeled cost (`plan_cost`) of the cheapest of the default-role greedy plan, the fixed
    schemes' plans and the token dispatchers' seeds (MoE layers as routed-experts ops) on `mesh`:
    an upper bound on what the search finds there. `calls`: a memo whose nodes' op calls and inputs (the same on every mesh) this mesh's passes share.
    `library`: candidate lists shared by meshes whose sizes divide the same dims (`ExpandCache`)."""
    work = {name: work for name, _, work, _, _ in facts.calls}
    shared = Shared(expand=ExpandCache(library), work=work, greedy=graph_memo(calls))
    best, seed = math.inf, ""
    roles = axis_roles(mesh)
    try:
        plan = greedy_plan(gm, mesh, registry, roles=roles, expand_cache=shared.expand, memo=shared.greedy)
    except Exception:  # noqa: BLE001 - as in the search: other roles may still split this model
        pass
    else:
        best, seed = plan_cost(gm, plan, mesh, cost, facts), "/".join(roles)
    seeds = itertools.chain(
        fixed_seeds(gm, mesh, registry, shared.expand, shared.greedy),
        dispatcher_seeds(gm, mesh, registry, shared.expand, shared.greedy),
    )
    for name, found in seeds:
        if isinstance(found, AutoparError):
            continue
        value = plan_cost(gm, found, mesh, cost, facts)
        if value < best:
            best, seed = value, name
    return Estimate(best, seed, shared)


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
) -> tuple[list[int], list[Estimate]]:
    """The meshes' indices by estimate (ties: the earlier one) and every mesh's `Estimate`. Only
    the `keep` best so far keep their `Shared` (the rest are searched only if those fail).
    `library`: candidate lists by op call and mesh signature, shared with other screens.

    `bound` (branch and bound): meshes are screened from the lowest `mesh_bound` bound up, and the
    screen stops at the first whose bound exceeds the `keep`-th best estimate found: its estimate,
    and every later one's, is at least its bound, so the `keep` best are those the whole screen
    finds, in the same order. The meshes left are ranked after, by bound (`Estimate.screened`
    False); `complete` screens them."""
    run = Screening(gm, registry, library)
    estimates = [Estimate(math.nan, "", None, screened=False) for _ in meshes]
    visit = list(range(len(meshes)))
    if bound:
        for i, (mesh, cost) in enumerate(zip(meshes, costs)):
            estimates[i].bound = run.bounds.bound(mesh, cost)
        visit.sort(key=lambda i: (estimates[i].bound, i))
    best: list[float] = []  # the `keep` lowest estimates so far, sorted
    for i in visit:
        if len(best) >= keep and estimates[i].bound > best[keep - 1]:
            break
        found = run.estimate(meshes[i], costs[i])
        found.bound = estimates[i].bound
        estimates[i] = found
        best = sorted([*best, found.value])[:keep]
        ranked = sorted((j for j in visit if estimates[j].screened), key=lambda j: (estimates[j].value, j))
        for j in ranked[keep:]:
            estimates[j].shared = None
    return _order(estimates), estimates


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
            found.bound, found.shared = estimates[i].bound, None
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

    def estimate(self, mesh: Mesh, cost: ElementCost) -> Estimate:
        return estimate(self.gm, mesh, self.registry, cost, self.facts, self.calls, self.library)


def _order(estimates: Sequence[Estimate]) -> list[int]:
    """Screened meshes by estimate, then the others by bound (ties: the earlier one)."""
    screened = [i for i, e in enumerate(estimates) if e.screened]
    rest = [i for i, e in enumerate(estimates) if not e.screened]
    return sorted(screened, key=lambda i: (estimates[i].value, i)) + sorted(
        rest, key=lambda i: (estimates[i].bound, i)
    )
