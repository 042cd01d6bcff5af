"""A greedy plan found on one mesh, priced on another mesh with as many axes: the screen's first
estimate (`mesh_screen`), cheap enough for hundreds of meshes.

Layouts and strategies name mesh axes, not their sizes, so a plan found on mesh A is a plan on any
mesh B with as many axes, provided B's sizes admit every strategy of it (even blocks, or the uneven
blocks the op's rule allows: `rules.base.admissible`, and the rule's own filter), its token axes
divide the batch, and every weight can still be stored split on every axis. What depends on B's
sizes is only where each parameter is stored (derived from the layout it computes with:
`Plan.stored_from`, `planning.storage`) and the prices. So a plan's `PlanPattern` keeps, once, the
distinct (source, wanted layout) redistributions of `plan_cost` (each counted once, as insert_comm
emits them) and the distinct (work, strategy) computations, each with how often it occurs: pricing
it on B asks the cost model a few hundred questions where `plan_cost` walks every node of a
96-layer graph.

The price is the cost of a valid plan on B, not B's own greedy plan: B's sizes may favour other
choices. The screen uses it only to rank meshes for their full estimate, never as an estimate.
The sum is taken in another order than `plan_cost`'s, so it can differ from it in the last bits.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from autopar.core.layout import Layout, Replicate
from autopar.core.mesh import Mesh
from autopar.core.meta import info, signature
from autopar.core.plan import Plan
from autopar.core.strategy import OpCall, Strategy
from autopar.cost.hardware import Rate
from autopar.cost.work import work_split
from autopar.planning.greedy import SMALL_PARAM_FRACTION
from autopar.planning.greedy_roles import batch_error
from autopar.planning.greedy_scores import GreedyMemo
from autopar.planning.plan_cost import GraphFacts
from autopar.planning.ring_cost import op_extra_cost
from autopar.planning.search_cost import ElementCost
from autopar.planning.storage import part_dims, part_storage, storage_layout
from autopar.rules.base import RuleRegistry, admissible
from autopar.rules.calls import op_call

# A parameter's storage on the other mesh: (the layout it computes with, the cut dim of a fused
# part or None, whether it may stay replicated (a vector or a small table)).
Stored = tuple[Layout, int | None, bool]
Source = Layout | Stored  # a value's layout as it is, or a parameter's storage to work out


@dataclass(frozen=True)
class PlanPattern:
    """What pricing one plan on another mesh needs, with repeated layers folded together."""

    roles: tuple[str, ...]
    checks: tuple[tuple[Strategy, bool, Any, OpCall | None], ...]  # (strategy, uneven, admits, call)
    stored: tuple[Stored, ...]  # every distinct parameter storage to work out
    comm: tuple[tuple[Source, Source, int], ...]  # (source, wanted, count)
    # (work, strategy, rate, op, causal, routing imbalance or None, count)
    compute: tuple[tuple[float, Strategy, Rate, Any, bool, float | None, int], ...]

    @staticmethod
    def of(
        gm: fx.GraphModule, plan: Plan, registry: RuleRegistry, facts: GraphFacts, memo: GreedyMemo | None = None
    ) -> PlanPattern | None:
        """The pattern of a greedy plan (None: a plan the greedy pass did not store, e.g. a
        searched one). `memo`: op calls already worked out per node."""
        params = {n.name: n for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "param"}
        if any(name not in plan.stored_from for name in params):
            return None
        dims = part_dims(gm)
        total = sum(math.prod(plan.layouts[name][0].shape) for name in params)
        stored: dict[str, Stored] = {}
        for name in params:
            shape = plan.layouts[name][0].shape
            may_stay = len(shape) < 2 or math.prod(shape) <= SMALL_PARAM_FRACTION * total
            stored[name] = (plan.stored_from[name], dims.get(name), may_stay)

        def source(name: str) -> Source:
            return stored[name] if name in stored else plan.layouts[name][0]

        nodes = {n.name: n for n in gm.graph.nodes}
        checks: dict[tuple[Any, ...], tuple[Strategy, bool, Any, OpCall | None]] = {}
        comm: Counter[tuple[Source, Source]] = Counter()
        compute: Counter[tuple[float, Strategy, Rate, Any, bool, float | None]] = Counter()
        imbalance = dict(facts.imbalance)
        made: set[tuple[str, Layout]] = set()
        for name, inputs, work, rate, op in facts.calls:
            strategy = plan.strategies.get(name)
            if strategy is None:
                continue
            rule = registry.get(op)
            uneven = bool(rule is not None and rule.uneven)
            admits = rule.admits if rule is not None else None
            if admits is None:
                checks.setdefault((strategy, uneven), (strategy, uneven, None, None))
            else:
                node = nodes[name]
                found = memo.calls.get(node) if memo is not None else None
                call = found[0] if found is not None else op_call(node)
                checks.setdefault((strategy, uneven, op, found[1] if found else id(node)), (strategy, uneven, admits, call))
            for src, want in zip(inputs, strategy.inputs):
                if (src, want) not in made:
                    made.add((src, want))
                    comm[(source(src), want)] += 1
            compute[(work, strategy, rate, op, name in facts.causal, imbalance.get(name))] += 1
        for src_name, wanted in _outputs(gm, plan, facts, stored):
            comm[(source(src_name), wanted)] += 1
        return PlanPattern(
            plan.roles,
            tuple(checks.values()),
            tuple(set(stored.values())),
            tuple((src, want, count) for (src, want), count in comm.items()),
            tuple((*key, count) for key, count in compute.items()),
        )

    def price(self, gm: fx.GraphModule, mesh: Mesh, cost: ElementCost) -> float | None:
        """The plan's `plan_cost` on `mesh` (summed in another order), or None where the mesh's
        sizes do not admit it (as the greedy pass would not have found it there)."""
        shape = tuple(mesh.shape)
        if len(shape) != len(self.roles) or batch_error(gm, mesh, self.roles) is not None:
            return None
        for strategy, uneven, admits, call in self.checks:
            if not admissible(strategy, shape, uneven) or (admits is not None and not admits(call, strategy, shape)):
                return None
        storage: dict[Stored, Layout] = {}
        for item in self.stored:
            computes, dim, may_stay = item
            layout = storage_layout(computes, shape) if dim is None else part_storage(computes, dim, shape)
            if not may_stay and any(isinstance(p, Replicate) and shape[a] > 1 for a, p in enumerate(layout.placements)):
                return None  # the greedy pass refuses a weight it cannot store split on every axis
            storage[item] = layout
        comm = 0.0
        for src, want, count in self.comm:
            have = src if isinstance(src, Layout) else storage[src]
            comm += count * cost.redistribute(have, want if isinstance(want, Layout) else storage[want])
        compute = 0.0
        for work, strategy, rate, op, causal, imbalance, count in self.compute:
            split = work_split(strategy, shape)
            extra = op_extra_cost(op, causal, strategy, work, rate, cost, imbalance)
            compute += count * (cost.compute(work, split, rate) + extra)
        return comm + compute


def _outputs(
    gm: fx.GraphModule, plan: Plan, facts: GraphFacts, stored: dict[str, Stored]
) -> list[tuple[str, Layout | Stored]]:
    """(source, wanted) of the graph's outputs that `plan_cost` prices: a parameter's gradient is
    wanted where the parameter is stored (`greedy._outputs`), which depends on the mesh."""
    sig = signature(gm)
    nu = sig.num_user_outputs
    by_param = {info(n).param_name: n.name for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "param"}
    found: list[tuple[str, Layout | Stored]] = []
    for i, (src_name, wanted) in enumerate(zip(facts.outputs, plan.output_layouts)):
        if src_name is None or wanted is None:
            continue
        if nu <= i < sig.num_param_grads_end:
            param = by_param.get(sig.grad_of[i - nu])
            if param is not None and param in stored and wanted == plan.layouts[param][0]:
                found.append((src_name, stored[param]))
                continue
        found.append((src_name, wanted))
    return found
