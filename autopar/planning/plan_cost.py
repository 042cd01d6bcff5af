"""The modeled cost of a whole plan: what the search, its seeds and the fixed schemes are ranked by.

Every plan (greedy, fixed scheme or searched) is priced by the same two functions, so they sit
below all of the planners that compare plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from autopar.core.layout import Layout
from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.core.strategy import Strategy
from autopar.cost.hardware import Rate
from autopar.cost.work import causal_skipped, compute_rate, global_work, work_split
from autopar.planning.ring_cost import op_extra_cost
from autopar.planning.search_cost import ElementCost
from autopar.rules.calls import tensor_inputs
from autopar.rules.routed_experts import node_routing_imbalance


@dataclass(frozen=True)
class GraphFacts:
    """What pricing a plan reads of the graph, gathered once for the many plans of one search:
    per call node in graph order its tensor inputs, global work and op, and the output's values."""

    calls: tuple[tuple[str, tuple[str, ...], float, Rate, Any], ...]
    outputs: tuple[str | None, ...]
    causal: frozenset[str] = frozenset()  # the attention calls with torch's causal mask
    # routed-experts calls' routing imbalance recorded by the trace (`routed_experts.IMBALANCE_META`)
    imbalance: tuple[tuple[str, float], ...] = ()

    @staticmethod
    def of(gm: fx.GraphModule) -> GraphFacts:
        calls = []
        causal: set[str] = set()
        imbalance: list[tuple[str, float]] = []
        outputs: tuple[str | None, ...] = ()
        for node in gm.graph.nodes:
            if node.op == "call_function":
                inputs = tuple(src.name for src in tensor_inputs(node))
                calls.append((node.name, inputs, global_work(node), compute_rate(node), node.target))
                if causal_skipped(node):
                    causal.add(node.name)
                factor = node_routing_imbalance(node)
                if factor is not None:
                    imbalance.append((node.name, factor))
            elif node.op == "output":
                outputs = tuple(src.name if isinstance(src, fx.Node) else None for src in node.args[0])
        return GraphFacts(tuple(calls), outputs, frozenset(causal), tuple(imbalance))


def plan_cost(
    gm: fx.GraphModule, plan: Plan, mesh: Mesh, cost: ElementCost, facts: GraphFacts | None = None
) -> float:
    """Modeled cost of a whole plan, as it will be emitted: each (value, wanted layout)
    redistributed once, and every op's compute. Seeds and the runs' results are compared by it:
    the search's own objective prices every edge apart, which overprices a value read by several
    consumers (q, k and v reading one layer norm's output) and can rank plans wrongly."""
    comm, compute = plan_cost_parts(gm, plan, mesh, cost, facts, once=True)
    return comm + compute


def plan_cost_parts(
    gm: fx.GraphModule,
    plan: Plan,
    mesh: Mesh,
    cost: ElementCost,
    facts: GraphFacts | None = None,
    once: bool = False,
) -> tuple[float, float]:
    """(communication, compute) of a plan; for a SearchPlan, with its regathers' collectives and
    its recomputed ops (their collectives counted as compute time: `RecomputeModel` prices both).
    `facts`: `GraphFacts.of(gm)`, when pricing many plans of the same graph. The search's
    objective prices every edge; `once` prices each (value, wanted layout) once, as insert_comm
    emits it (consumers that want the same layout of a value share one redistribution, a weight
    gathered in forward is reused in backward): closer to the compiled program's collectives."""
    facts = facts if facts is not None else GraphFacts.of(gm)
    shape = tuple(mesh.shape)
    comm = compute = 0.0
    layouts, strategies = plan.layouts, plan.strategies
    splits: dict[Strategy, int] = {}
    imbalance = dict(facts.imbalance)
    made: set[tuple[str, Layout]] = set()
    for name, inputs, work, dtype, op in facts.calls:
        strategy = strategies.get(name)
        if strategy is None:
            continue
        for src, want in zip(inputs, strategy.inputs):
            if once:
                if (src, want) in made:
                    continue
                made.add((src, want))
            comm += cost.redistribute(layouts[src][0], want)
        split = splits.get(strategy)
        if split is None:
            split = splits[strategy] = work_split(strategy, shape)
        compute += cost.compute(work, split, dtype) + op_extra_cost(
            op, name in facts.causal, strategy, work, dtype, cost, imbalance.get(name)
        )
    for src_name, wanted in zip(facts.outputs, plan.output_layouts):
        if src_name is not None and wanted is not None:
            comm += cost.redistribute(layouts[src_name][0], wanted)
    for name in getattr(plan, "regather", ()):
        comm += cost.gather_from_storage(layouts[name][0])
    savings = getattr(plan, "savings", None)
    if savings is not None:  # ops run again in backward (`planning.recompute`)
        compute += savings.recompute_seconds
    return comm, compute
