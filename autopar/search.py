"""Plan search: improve the greedy plan over the whole joint graph.

The greedy pass decides each op looking only at its producers. Here every decided op becomes a
variable whose values are its strategies; the objective is the modeled cost of the whole step:
each op's compute under its strategy, plus the redistribution on every edge between a producer's
output layout and its consumer's required input layout, plus parameter gathers and gradient
reductions. The graph is cut into chains (an op whose only decided producer is the previous one);
each chain is solved exactly by dynamic programming (Viterbi) with the rest of the graph held fixed,
and the chains are swept forward and backward until the total stops falling (coordinate descent
with exact block moves). Seeds are the greedy plans for every assignment of axis roles, so the
search starts from the best of the 1-D / 2-D / 3-D patterns and can only improve on it.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.fx as fx

from autopar.layout import Layout, Partial, Replicate
from autopar.mesh import Mesh
from autopar.meta import signature
from autopar.planner import (
    FLOP_WEIGHT,
    Plan,
    _redist,
    axis_roles,
    expand_cached,
    gather_from_storage,
    global_work,
    greedy_plan,
    op_call,
    output_index,
    storage_layout,
    tensor_inputs,
    work_split,
)
from autopar.rules.base import RuleRegistry, Strategy

MAX_CANDIDATES = 512
MAX_SWEEPS = 8


class ElementCost:
    """Elements sent per rank plus flops / 200: the greedy pass's units (no hardware table)."""

    def __init__(self, mesh_shape: Sequence[int]) -> None:
        self.shape = tuple(mesh_shape)

    def redistribute(self, src: Layout, dst: Layout) -> float:
        return _redist(src, dst, self.shape)

    def gather_from_storage(self, want: Layout) -> float:
        return gather_from_storage(want, self.shape)

    def compute(self, work: float, split: int) -> float:
        return FLOP_WEIGHT * work / split


class TimeCost(ElementCost):
    """Seconds per step on a hardware table: alpha-beta collectives on each axis's link (intra- or
    inter-node) and roofline compute, via `autopar.cost`."""

    def __init__(self, hardware: Any, mesh_shape: Sequence[int]) -> None:
        from autopar.cost import MeshCost, load_hardware

        super().__init__(mesh_shape)
        hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
        self.mesh = MeshCost.build(hw, mesh_shape)

    def redistribute(self, src: Layout, dst: Layout) -> float:
        return self.mesh.redistribute(src, dst) if src != dst else 0.0

    def gather_from_storage(self, want: Layout) -> float:
        return self.redistribute(storage_layout(want, self.shape), _settled(want))

    def compute(self, work: float, split: int) -> float:
        return self.mesh.compute(work / split, 0.0, "float32")


@dataclass
class SearchReport:
    seeds: dict[str, float] = field(default_factory=dict)  # roles -> modeled cost of the greedy plan
    chosen_roles: tuple[str, ...] = ()
    seed_cost: float = 0.0
    final_cost: float = 0.0
    sweeps: int = 0
    variables: int = 0
    chains: int = 0


def search_layouts(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    *,
    cost: ElementCost | None = None,
    max_sweeps: int = MAX_SWEEPS,
) -> Plan:
    """Best greedy seed over axis-role assignments, then exact chain moves until no gain."""
    cost = cost or ElementCost(mesh.shape)
    report = SearchReport()
    best_plan: Plan | None = None
    cache: dict[Any, list[Strategy]] = {}
    for roles in role_assignments(mesh):
        try:
            plan = greedy_plan(gm, mesh, registry, roles=roles, expand_cache=cache)
        except Exception:  # a role assignment that cannot split this model evenly
            if roles == axis_roles(mesh):
                raise
            continue
        value = plan_cost(gm, plan, mesh, cost)
        report.seeds["/".join(roles)] = value
        if best_plan is None or value < report.seed_cost:
            best_plan, report.seed_cost = plan, value
    assert best_plan is not None
    report.chosen_roles = best_plan.roles
    problem = _Problem(gm, mesh, registry, best_plan, cost, cache)
    report.variables = len(problem.vars)
    report.chains = len(problem.chains)
    report.sweeps = problem.optimize(max_sweeps)
    forced = {v.name: v.cands[v.current] for v in problem.vars}
    final = greedy_plan(gm, mesh, registry, roles=best_plan.roles, forced=forced, expand_cache=cache)
    final_cost = plan_cost(gm, final, mesh, cost)
    if final_cost > report.seed_cost:  # the chain model is approximate at parameters; never regress
        final, final_cost = best_plan, report.seed_cost
    report.final_cost = final_cost
    final.notes["__search__"] = (
        f"search: seed {report.seed_cost:.4g} -> {final_cost:.4g} in {report.sweeps} sweeps "
        f"over {report.variables} ops in {report.chains} chains; roles {'/'.join(report.chosen_roles)}"
    )
    gm.meta["autopar_search"] = report
    return final


def role_assignments(mesh: Mesh) -> list[tuple[str, ...]]:
    """The default roles first, then every distinct arrangement of tensor/token roles over the axes."""
    default = axis_roles(mesh)
    sized = [a for a, s in enumerate(mesh.shape) if s > 1]
    options = [default]
    for combo in itertools.product(("tensor", "token"), repeat=len(sized)):
        roles = list(default)
        for a, role in zip(sized, combo):
            roles[a] = role
        if tuple(roles) not in options and "tensor" in roles:
            options.append(tuple(roles))
    return options


def plan_cost(gm: fx.GraphModule, plan: Plan, mesh: Mesh, cost: ElementCost) -> float:
    """Modeled cost of a whole plan: every edge's redistribution and every op's compute."""
    shape = tuple(mesh.shape)
    total = 0.0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.name in plan.strategies:
            strategy = plan.strategies[node.name]
            for src, want in zip(tensor_inputs(node), strategy.inputs):
                total += cost.redistribute(plan.layouts[src.name][0], want)
            total += cost.compute(global_work(node), work_split(strategy, shape))
        elif node.op == "output":
            for src, wanted in zip(node.args[0], plan.output_layouts):  # type: ignore[arg-type]
                if isinstance(src, fx.Node) and wanted is not None:
                    total += cost.redistribute(plan.layouts[src.name][0], wanted)
    return total


@dataclass
class _Var:
    name: str
    cands: list[Strategy]
    unary: np.ndarray
    current: int
    edges: list[_Edge] = field(default_factory=list)


@dataclass
class _Edge:
    """Producer u's layout (an output, or an input it laid out) feeding consumer v's input."""

    u: int
    v: int
    table: np.ndarray  # cost between the distinct layouts on each side
    out_index: np.ndarray  # per candidate of u: row of `table`
    in_index: np.ndarray  # per candidate of v: column of `table`

    def for_consumer(self, u_choice: int) -> np.ndarray:
        return self.table[self.out_index[u_choice], self.in_index]

    def for_producer(self, v_choice: int) -> np.ndarray:
        return self.table[self.out_index, self.in_index[v_choice]]

    def matrix(self) -> np.ndarray:
        return self.table[np.ix_(self.out_index, self.in_index)]

    def value(self, u_choice: int, v_choice: int) -> float:
        return float(self.table[self.out_index[u_choice], self.in_index[v_choice]])


class _Problem:
    def __init__(
        self,
        gm: fx.GraphModule,
        mesh: Mesh,
        registry: RuleRegistry,
        seed: Plan,
        cost: ElementCost,
        expand_cache: dict[Any, list[Strategy]],
    ) -> None:
        self.shape = tuple(mesh.shape)
        self.cost = cost
        nodes = {n.name: n for n in gm.graph.nodes}
        self.index = {name: i for i, name in enumerate(seed.decided)}
        self.vars: list[_Var] = []
        self.edges: list[_Edge] = []
        self.tables: dict[Any, np.ndarray] = {}
        for name in seed.decided:
            node = nodes[name]
            rule = registry.get(node.target)
            cands = list(expand_cached(node, rule, op_call(node), self.shape, expand_cache))
            if seed.strategies[name] not in cands:
                cands.append(seed.strategies[name])
            work = global_work(node)
            unary = np.array([cost.compute(work, work_split(s, self.shape)) for s in cands])
            self.vars.append(_Var(name, cands, unary, cands.index(seed.strategies[name])))
        for name in seed.decided:
            self._inputs(nodes[name], seed)
        self._outputs(gm, seed)
        for var in self.vars:
            if len(var.cands) > MAX_CANDIDATES:
                self._prune(var)
        self.chains = self._chains()

    # ---- building the objective ----------------------------------------------------------------
    def _inputs(self, node: fx.Node, seed: Plan) -> None:
        v = self.index[node.name]
        var = self.vars[v]
        kinds = seed.deferred_inputs[node.name]
        for j, (src, kind) in enumerate(zip(tensor_inputs(node), kinds)):
            wants = [s.inputs[j] for s in var.cands]
            if kind == "param":
                var.unary += np.array([self.cost.gather_from_storage(w) for w in wants])
                continue
            if kind == "replica":
                continue
            producer = self._producer(src, seed)
            if producer is None:
                have = seed.layouts[src.name][0]
                var.unary += np.array([self.cost.redistribute(have, w) for w in wants])
                continue
            u, pick = producer
            self._edge(u, v, [pick(s) for s in self.vars[u].cands], wants)

    def _producer(self, src: fx.Node, seed: Plan) -> tuple[int, Callable[[Strategy], Layout]] | None:
        if src.name in self.index:
            return self.index[src.name], lambda s: s.outputs[0]
        if src.target is _getitem and isinstance(src.args[0], fx.Node) and src.args[0].name in self.index:
            k = output_index(src)
            return self.index[src.args[0].name], lambda s, k=k: s.outputs[k]  # type: ignore[misc]
        if src.name in seed.resolved_by:
            owner, j = seed.resolved_by[src.name]
            if owner in self.index:
                return self.index[owner], lambda s, j=j: s.inputs[j]  # type: ignore[misc]
        return None

    def _outputs(self, gm: fx.GraphModule, seed: Plan) -> None:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        nu = signature(gm).num_user_outputs
        for i, src in enumerate(output.args[0]):  # type: ignore[arg-type]
            producer = self._producer(src, seed) if isinstance(src, fx.Node) else None
            if producer is None:
                continue
            u, pick = producer
            var = self.vars[u]
            outs = [pick(s) for s in var.cands]
            if i < nu:  # the user gets it without pending sums (a loss: replicated)
                var.unary += np.array([self.cost.redistribute(o, _settled(o)) for o in outs])
            else:  # a gradient: reduced into the parameter's storage
                var.unary += np.array([_reduce_cost(o, self.shape) for o in outs])

    def _edge(self, u: int, v: int, outs: list[Layout], ins: list[Layout]) -> None:
        out_keys: dict[Layout, int] = {}
        in_keys: dict[Layout, int] = {}
        out_index = np.array([out_keys.setdefault(o, len(out_keys)) for o in outs])
        in_index = np.array([in_keys.setdefault(w, len(in_keys)) for w in ins])
        key = (tuple(out_keys), tuple(in_keys))
        table = self.tables.get(key)
        if table is None:  # edges between same-shaped values share one table
            table = np.array([[self.cost.redistribute(o, w) for w in in_keys] for o in out_keys])
            self.tables[key] = table
        edge = _Edge(u, v, table, out_index, in_index)
        self.edges.append(edge)
        self.vars[u].edges.append(edge)
        self.vars[v].edges.append(edge)

    def _prune(self, var: _Var) -> None:
        """Keep the candidates that are cheapest on their own (and the current one)."""
        order = list(np.argsort(var.unary, kind="stable")[:MAX_CANDIDATES])
        if var.current not in order:
            order[-1] = var.current
        order.sort()
        keep = np.array(order)
        remap = {old: new for new, old in enumerate(order)}
        var.cands = [var.cands[i] for i in order]
        var.unary = var.unary[keep]
        var.current = remap[var.current]
        index = self.index[var.name]
        for edge in var.edges:
            if edge.u == index:
                edge.out_index = edge.out_index[keep]
            if edge.v == index:
                edge.in_index = edge.in_index[keep]

    def _chains(self) -> list[list[int]]:
        """Partition the variables into paths u -> v where u is v's only producing variable."""
        producers: list[set[int]] = [set() for _ in self.vars]
        for edge in self.edges:
            producers[edge.v].add(edge.u)
        chain_of: dict[int, int] = {}
        chains: list[list[int]] = []
        for v in range(len(self.vars)):
            if len(producers[v]) == 1:
                (u,) = producers[v]
                c = chain_of[u]
                if chains[c][-1] == u:
                    chains[c].append(v)
                    chain_of[v] = c
                    continue
            chain_of[v] = len(chains)
            chains.append([v])
        return chains

    # ---- optimizing ------------------------------------------------------------------------------
    def total(self) -> float:
        value = sum(float(var.unary[var.current]) for var in self.vars)
        for edge in self.edges:
            value += edge.value(self.vars[edge.u].current, self.vars[edge.v].current)
        return value

    def optimize(self, max_sweeps: int) -> int:
        before = self.total()
        for sweep in range(1, max_sweeps + 1):
            order = self.chains if sweep % 2 else list(reversed(self.chains))
            for chain in order:
                self._solve(chain)
            after = self.total()
            if after >= before - 1e-9 * max(1.0, abs(before)):
                return sweep
            before = after
        return max_sweeps

    def _solve(self, chain: list[int]) -> None:
        position = {v: k for k, v in enumerate(chain)}
        local = []
        for v in chain:
            var = self.vars[v]
            u_vec = var.unary.copy()
            u_vec[var.current] -= 1e-9 * (1.0 + abs(float(u_vec[var.current])))  # stay put on ties
            for edge in var.edges:
                other = edge.u if edge.v == v else edge.v
                if other in position:
                    continue
                if edge.v == v:
                    u_vec += edge.for_consumer(self.vars[edge.u].current)
                else:
                    u_vec += edge.for_producer(self.vars[edge.v].current)
            local.append(u_vec)
        value = local[0]
        back = []
        for k in range(1, len(chain)):
            u, v = chain[k - 1], chain[k]
            pair = np.zeros((len(self.vars[u].cands), len(self.vars[v].cands)))
            for edge in self.vars[v].edges:
                if edge.u == u and edge.v == v:
                    pair += edge.matrix()
            total = value[:, None] + pair
            arg = total.argmin(axis=0)
            value = total[arg, np.arange(total.shape[1])] + local[k]
            back.append(arg)
        choice = int(value.argmin())
        for k in range(len(chain) - 1, -1, -1):
            self.vars[chain[k]].current = choice
            if k:
                choice = int(back[k - 1][choice])


_getitem = operator.getitem


def _settled(layout: Layout) -> Layout:
    if len(layout.shape) == 0:
        return Layout.replicated((), len(layout.placements), layout.dtype)
    return Layout(
        tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements),
        layout.shape,
        layout.dtype,
    )


def _reduce_cost(layout: Layout, shape: Sequence[int]) -> float:
    """Reduce-scatters that take a gradient's pending sums into a fully split storage layout."""
    n = layout.local_numel(shape)
    total = 0.0
    for a in layout.partial_axes():
        g = shape[a]
        total += (g - 1) / g * n
        n //= g
    return total


def searched_layouts(gm: fx.GraphModule, mesh: Mesh, registry: RuleRegistry) -> Plan:
    """`propagate`'s chooser: the search (see module docstring)."""
    return search_layouts(gm, mesh, registry)
