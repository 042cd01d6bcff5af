"""The mesh choice's screen: a cheap plan per candidate mesh, to pick the few worth searching.

At 512 ranks there are 93 candidate meshes, and the search on one four-axis mesh of a 32-layer
LLaMA takes tens of seconds (a greedy pass per assignment of axis roles, then the chain moves).
The screen prices each candidate's cheapest plans instead: the greedy pass with the mesh's default
roles and the fixed 1-D / 2-D / cube schemes that lay out on it (`search_seeds.fixed_seeds`), which
are among the search's own seeds. The search starts from its cheapest seed and never ends above
it, so a candidate's estimate is an upper bound on its searched plan's modeled step (both are
`plan_cost`, each redistribution counted once); it is not a lower bound, so ranking by it and
searching only the best few (`mesh_choice.SEARCHED_CANDIDATES`) is a heuristic. The greedy
passes' candidate lists and answers (`Shared`) are handed to the search of the candidates kept,
so screening them costs nothing twice.

A model of N identical blocks (a transformer's layers, `autopar.passes.repeats`) is screened on
short graphs instead (`ShortGraphs`: the same model traced with a, a + 1 and a + 2 of its blocks):
each seed's plan is priced on the three, and where its cost grows by the same amount per block on
both steps (the seed lays out every block alike), its cost on N blocks is extrapolated from them;
a seed whose cost is not linear there, or that fails on one graph and not another, sends that mesh
to the full graph. A greedy pass over 96 blocks walks every node of them (the memo answers the
questions, not the walk), so this is most of the screen's time at a thousand ranks
(`tests/test_plan_scale.py` holds the estimates and the choice to the full graph's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.planning.greedy import axis_roles, greedy_plan
from autopar.planning.greedy_scores import GreedyMemo
from autopar.planning.plan_cost import GraphFacts, plan_cost
from autopar.planning.search_cost import ElementCost
from autopar.planning.search_problem import Shared
from autopar.planning.search_seeds import fixed_seeds
from autopar.rules.base import RuleRegistry


@dataclass(frozen=True)
class ShortGraphs:
    """The model traced with `blocks`, `blocks + 1` and `blocks + 2` of its `count` repeated blocks
    (one repeated container), for the screen's extrapolation (module doc)."""

    graphs: tuple[fx.GraphModule, fx.GraphModule, fx.GraphModule]
    blocks: int
    count: int


# the per-block growth of a seed's cost must agree on both steps to this relative tolerance
LINEAR_TOLERANCE = 1e-9


@dataclass
class Estimate:
    """The cheapest screened plan of one candidate mesh (`value` inf: none worked)."""

    value: float
    seed: str
    shared: Shared | None  # what its greedy passes worked out, for the search of this mesh


def estimate(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    cost: ElementCost,
    facts: GraphFacts,
    calls: GreedyMemo | None = None,
) -> Estimate:
    """The modeled cost (`plan_cost`) of the cheapest of the default-role greedy plan and the
    fixed schemes' plans on `mesh`: an upper bound on what the search finds there. `calls`: a
    memo whose nodes' op calls and inputs (the same on every mesh) this mesh's passes share."""
    shared = Shared(work={name: work for name, _, work, _ in facts.calls}, greedy=graph_memo(calls))
    best, seed = math.inf, ""
    for name, value in seed_costs(gm, mesh, registry, cost, facts, shared):
        if value < best:
            best, seed = value, name
    return Estimate(best, seed, shared)


def seed_costs(
    gm: fx.GraphModule, mesh: Mesh, registry: RuleRegistry, cost: ElementCost, facts: GraphFacts, shared: Shared
) -> list[tuple[str, float]]:
    """(seed, `plan_cost`) of the default-role greedy plan and of every fixed scheme's plan on
    `mesh`, in that order; inf for a seed with no plan."""
    out: list[tuple[str, float]] = []
    roles = axis_roles(mesh)
    try:
        plan = greedy_plan(gm, mesh, registry, roles=roles, expand_cache=shared.expand, memo=shared.greedy)
    except Exception:  # noqa: BLE001 - as in the search: other roles may still split this model
        out.append(("/".join(roles), math.inf))
    else:
        out.append(("/".join(roles), plan_cost(gm, plan, mesh, cost, facts)))
    for name, found in fixed_seeds(gm, mesh, registry, shared.expand, shared.greedy):
        out.append((name, math.inf if isinstance(found, AutoparError) else plan_cost(gm, found, mesh, cost, facts)))
    return out


def extrapolated(
    short: ShortGraphs,
    mesh: Mesh,
    registry: RuleRegistry,
    cost: ElementCost,
    facts: list[GraphFacts],
    calls: list[GreedyMemo],
) -> Estimate | None:
    """The estimate on `short.count` blocks from the seeds' costs on the short graphs (module
    doc), with no `Shared` (it belongs to a short graph); None where a seed is not linear."""
    per_graph = []
    for g, f, memo in zip(short.graphs, facts, calls):
        shared = Shared(work={name: work for name, _, work, _ in f.calls}, greedy=graph_memo(memo))
        per_graph.append(seed_costs(g, mesh, registry, cost, f, shared))
    names = [name for name, _ in per_graph[0]]
    if any([name for name, _ in found] != names for found in per_graph[1:]):
        return None
    best, seed = math.inf, ""
    for j, name in enumerate(names):
        a, b, c = (found[j][1] for found in per_graph)
        if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(c)):
            if math.isfinite(a) or math.isfinite(b) or math.isfinite(c):
                return None  # fails on some lengths only
            continue
        first, second = b - a, c - b
        if abs(second - first) > LINEAR_TOLERANCE * max(abs(c), 1e-30):
            return None
        value = c + (short.count - short.blocks - 2) * second
        if value < best:
            best, seed = value, name
    return Estimate(best, seed, None)


def graph_memo(calls: GreedyMemo | None) -> GreedyMemo:
    """A fresh memo for one mesh sharing `calls`' per-node op calls and inputs (mesh-free)."""
    return GreedyMemo() if calls is None else GreedyMemo(inputs=calls.inputs, calls=calls.calls)


def screen(
    gm: fx.GraphModule,
    meshes: Sequence[Mesh],
    registry: RuleRegistry,
    costs: Sequence[ElementCost],
    keep: int,
    short: ShortGraphs | None = None,
) -> tuple[list[int], list[Estimate]]:
    """Every mesh's `estimate`, and the meshes' indices by estimate (ties: the earlier one). Only
    the `keep` best so far keep their `Shared` (the rest are searched only if those fail).
    `short`: estimate on `short.count` blocks from the short graphs where every seed is linear
    there (module doc), on `gm` elsewhere."""
    full: list[GraphFacts] = []  # (the full graph's facts: walked only if a mesh needs them)
    calls = GreedyMemo()
    short_facts = [GraphFacts.of(g) for g in short.graphs] if short is not None else []
    short_calls = [GreedyMemo() for _ in short_facts]
    estimates: list[Estimate] = []
    for mesh, cost in zip(meshes, costs):
        found = extrapolated(short, mesh, registry, cost, short_facts, short_calls) if short is not None else None
        if found is None:
            if not full:
                full.append(GraphFacts.of(gm))
            found = estimate(gm, mesh, registry, cost, full[0], calls)
        estimates.append(found)
        ranked = sorted(range(len(estimates)), key=lambda i: (estimates[i].value, i))
        for i in ranked[keep:]:
            estimates[i].shared = None
    return sorted(range(len(estimates)), key=lambda i: (estimates[i].value, i)), estimates
