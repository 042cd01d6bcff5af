"""The plan search's objective as arrays, and its exact block moves (see `autopar.planning.search`).

Every decided op is a variable whose values are its candidate strategies. `unary` holds each
candidate's own cost (compute, parameter gathers, fixed inputs, user outputs, gradient reductions,
and under a memory price the saved activations), edges hold the redistribution between a producer's
layouts and a consumer's wanted layouts. Chains are solved exactly by dynamic programming.

Repeated layers make most of this repeat: candidate lists are shared by every op with the same
signature (`expand_cached`), so the per-candidate vectors and edge index arrays are computed once
per candidate list, and a chain's dynamic program is memoized by its structure (edge tables and
index arrays) plus its local cost vectors. Two layers whose neighbourhoods agree therefore cost one
solve, which is what keeps a 32-layer search close to a 4-layer one.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.layout import Layout, settled, summed
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info, signature
from autopar.core.plan import Plan
from autopar.core.strategy import OpCall, Strategy
from autopar.cost.hardware import Rate
from autopar.cost.work import causal_skipped, compute_rate, global_work, work_split
from autopar.planning.greedy import greedy_plan
from autopar.planning.greedy_scores import GreedyMemo
from autopar.planning.memory import SavedValue, plan_memory, saved_nodes, weight_chain
from autopar.planning.plan_cost import GraphFacts, plan_cost
from autopar.planning.ring_cost import op_extra_cost
from autopar.planning.search_blocks import Clock, chains, make_blocks, sweep, trees
from autopar.planning.search_cost import ElementCost
from autopar.planning.search_seeds import fixed_seeds
from autopar.planning.search_vars import Edge, PairTable, SharedMatrices, Tally, Var
from autopar.planning.storage import part_dim_at, part_dims, part_storage, replicated_storage
from autopar.rules.base import RuleRegistry
from autopar.rules.calls import call_key, expand_cached, op_call, output_index, tensor_inputs
from autopar.rules.routed_experts import node_routing_imbalance

MAX_CANDIDATES = 512
_getitem = operator.getitem


class Cost(Protocol):
    shape: tuple[int, ...]
    routing_imbalance: float | None  # routed-experts ops' busiest rank over the mean (`ring_cost.routed_exchange_cost`)

    def redistribute(self, src: Layout, dst: Layout) -> float: ...

    def bucketed(self, src: Layout, dst: Layout) -> float: ...

    def gather_from_storage(self, want: Layout) -> float: ...

    def compute(self, work: float, split: int, rate: Rate = ...) -> float: ...

    def ring_shift(self, block: Layout, axis: int) -> tuple[float, float]: ...

    def redistribute_table(
        self,
        outs: Sequence[Layout],
        ins: Sequence[Layout],
        rows: np.ndarray | None = ...,
        cols: np.ndarray | None = ...,
    ) -> np.ndarray: ...


@dataclass
class Shared:
    """What the greedy passes and the problems of one search (same graph, mesh and cost) share:
    candidate lists and the greedy passes' memo (`greedy.greedy_plan`), edge tables, per-candidate
    vectors, interned layout lists."""

    expand: dict[Any, list[Strategy]] = field(default_factory=dict)
    work: dict[str, float] = field(default_factory=dict)  # node -> `global_work`, where known
    greedy: GreedyMemo = field(default_factory=GreedyMemo)
    # edge tables by their two layout lists and share (read by k consumers of one value in one
    # phase: cells are 1/k, `Problem._count_readers`), priced where a kept candidate reads them (`_fill`)
    tables: dict[Any, PairTable] = field(default_factory=dict)
    vectors: dict[Any, Any] = field(default_factory=dict)  # per candidate list: layouts, costs
    positions: dict[int, dict[Strategy, int]] = field(default_factory=dict)
    interned: dict[tuple[Layout, ...], tuple[Layout, ...]] = field(default_factory=dict)
    pruned: int = 0  # pruned candidate lists so far
    # (id of an edge's index array, kept candidates) -> (that array, the pruned one): `_prune`
    pruned_indices: dict[tuple[int, bytes], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # axis roles -> the greedy plan with them (or what it raised): `role_plan`
    role_plans: dict[tuple[str, ...], Plan | Exception] = field(default_factory=dict)
    # the registry asked and the fixed schemes' plans on this mesh with it: `fixed_plans`
    fixed: tuple[RuleRegistry, list[tuple[str, Plan | AutoparError]]] | None = None
    # (id of a plan, id of a cost) -> (that plan, that cost: kept so the ids stay theirs; its
    # `plan_cost`): `priced`
    prices: dict[tuple[int, int], tuple[Plan, ElementCost, float]] = field(default_factory=dict)

    def role_plan(self, gm: fx.GraphModule, mesh: Mesh, registry: RuleRegistry, roles: tuple[str, ...]) -> Plan:
        """`greedy_plan` with these axis roles and nothing forced, once per graph and mesh: the
        screen's default-role pass is the search's first seed, and the search runs every role
        assignment once per weight storage (`search._starts`), all of the same pass with the same
        candidate lists and memo, so the same plan. Raises what the pass raised."""
        found = self.role_plans.get(roles)
        if found is None:
            try:
                found = greedy_plan(gm, mesh, registry, roles=roles, expand_cache=self.expand, memo=self.greedy)
            except Exception as exc:  # noqa: BLE001 - kept, and raised to every caller alike
                found = exc
            self.role_plans[roles] = found
        if isinstance(found, Exception):
            raise found
        return found

    def fixed_plans(
        self, gm: fx.GraphModule, mesh: Mesh, registry: RuleRegistry
    ) -> list[tuple[str, Plan | AutoparError]]:
        """`search_seeds.fixed_seeds` (each scheme variant's plan, or why it failed), once per graph,
        mesh and registry: the screen prices them for its estimate and the search of a kept mesh
        starts from them once per weight storage (`search._starts`), every time the same greedy
        passes (forced linears, the same candidate lists and memo), so the same plans. On the
        LLaMA-7B shape at 64 ranks that is one to six passes of the whole graph per kept mesh
        and storage, run once instead of two or three times."""
        if self.fixed is None or self.fixed[0] is not registry:
            self.fixed = registry, list(fixed_seeds(gm, mesh, registry, self.expand, self.greedy))
        return self.fixed[1]

    def priced(self, gm: fx.GraphModule, plan: Plan, mesh: Mesh, cost: ElementCost, facts: GraphFacts) -> float:
        """`plan_cost` of one of the plans above (`role_plan`, `fixed_plans`) under `cost`, once: the
        screen prices the default roles' plan and the fixed schemes' for its estimate, and the
        search of a kept mesh prices them again as its seeds (same plan, same cost object)."""
        key = (id(plan), id(cost))
        found = self.prices.get(key)
        if found is None:
            found = self.prices[key] = (plan, cost, plan_cost(gm, plan, mesh, cost, facts))
        return found[2]


class Problem:
    def __init__(
        self,
        gm: fx.GraphModule,
        mesh: Mesh,
        registry: RuleRegistry,
        seed: Plan,
        cost: Cost,
        expand_cache: dict[Any, list[Strategy]],
        shared: Shared | None = None,
        replicated: bool = False,
        share_readers: bool = False,
    ) -> None:
        """`replicated`: the plan stores its weights as they compute ("replicated" storage,
        `planning.storage`; `seed` already stored so): a weight's readers pay for moving it from
        where the seed stores it (nothing where they read it as the seed does), its gradient for
        reaching that storage (the pending sums' all-reduce, or more where the gradient's layout
        differs). The storage is the seed's in the objective; the plans it yields are stored as they
        compute and priced exactly (`plan_cost`)."""
        self.shape = tuple(mesh.shape)
        self.cost = cost
        self.replicated = replicated
        self.seed = seed
        self.tally = Tally()
        nodes = {n.name: n for n in gm.graph.nodes}
        self.index = {name: i for i, name in enumerate(seed.decided)}
        self.vars: list[Var] = []
        self.edges: list[Edge] = []
        self._pairs: list[PairTable] = []  # per edge: its table (`Edge.table` is set by `_fill`)
        self.matrices = SharedMatrices()  # the edges' kept pair matrices, one per distinct one
        self.shared = shared = shared if shared is not None else Shared()
        self._tables = shared.tables
        self._vectors = shared.vectors
        self._positions = shared.positions
        self._interned = shared.interned
        self._memo: dict[tuple[int, bytes], np.ndarray] = {}
        for name in seed.decided:
            node = nodes[name]
            rule = registry.get(node.target)
            call, key_of_call = self._call(node)
            listed = expand_cached(node, rule, call, self.shape, expand_cache, key_of_call)
            chosen = seed.strategies[name]
            at = self._position(listed).get(chosen)
            key: tuple[int, Strategy | None] = (id(listed), None)
            cands = listed
            if at is None:
                cands, key, at = [*listed, chosen], (id(listed), chosen), len(listed)
            work = shared.work[name] if name in shared.work else global_work(node)
            dtype = compute_rate(node)
            causal = causal_skipped(node)
            imbalance = node_routing_imbalance(node)
            base = self._cached(
                ("compute", key, work, dtype, causal, imbalance),
                lambda c=cands, w=work, d=dtype, op=node.target, k=causal, i=imbalance: self._compute(c, w, d, op, k, i),  # type: ignore[misc]
            )
            self.vars.append(Var(name, cands, key, base.copy(), base.copy(), at))
        self._part_dims = part_dims(gm)
        self._readers = self._count_readers(nodes, seed) if share_readers else Counter()
        for name in seed.decided:
            self._inputs(nodes[name], seed)
        self._outputs(gm, seed)
        for var in self.vars:
            if len(var.cands) > MAX_CANDIDATES:
                self._prune(var)
        self._fill()
        for var in self.vars:
            var.unary = var.base.copy()
        self._gm = gm
        self._fixed_bytes: float | None = None  # saved bytes no variable decides; set by _memory
        self.chains = chains(self.vars, self.edges)
        paths = [[(v, chain[k - 1] if k else -1) for k, v in enumerate(chain)] for chain in self.chains]
        self.blocks = make_blocks(self.vars, paths + trees(self.vars, self.edges, self.chains))
        self.tally.distinct_chains = len({b.signature for b in self.blocks[: len(self.chains)]})

    # ---- building the objective ----------------------------------------------------------------
    def _position(self, listed: list[Strategy]) -> dict[Strategy, int]:
        found = self._positions.get(id(listed))
        if found is None:
            found = self._positions[id(listed)] = {}
            for i, s in enumerate(listed):
                found.setdefault(s, i)
        return found

    def _call(self, node: fx.Node) -> tuple[OpCall, tuple[Any, ...]]:
        """The node's op call and `call_key`, as the greedy passes worked them out (`GreedyMemo`)."""
        found = self.shared.greedy.calls.get(node)
        if found is None:
            call = op_call(node)
            found = self.shared.greedy.calls[node] = (call, call_key(call))
        return found

    def _cached(self, key: Any, make: Callable[[], Any]) -> Any:
        found = self._vectors.get(key)
        if found is None:
            found = self._vectors[key] = make()
        return found

    def _compute(
        self,
        cands: list[Strategy],
        work: float,
        dtype: torch.dtype,
        op: Any = None,
        causal: bool = False,
        imbalance: float | None = None,
    ) -> np.ndarray:
        """Each candidate's compute; a ring-attention candidate's with its exchanges' exposed time,
        a causal call split along the sequence at its busiest rank's share."""
        splits = [work_split(s, self.shape) for s in cands]
        by_split = {s: self.cost.compute(work, s, dtype) for s in set(splits)}
        return np.array(
            [
                by_split[split] + op_extra_cost(op, causal, s, work, dtype, self.cost, imbalance)
                for s, split in zip(cands, splits)
            ],
            dtype=float,
        )

    def _layouts(self, var: Var, side: str, k: int) -> tuple[tuple[Layout, ...], np.ndarray]:
        """The distinct layouts of `var`'s candidates at input / output k, and each candidate's row."""

        def make() -> tuple[tuple[Layout, ...], np.ndarray]:
            keys: dict[Layout, int] = {}
            pick = (lambda s: s.inputs[k]) if side == "in" else (lambda s: s.outputs[k])
            index = np.array([keys.setdefault(pick(s), len(keys)) for s in var.cands], dtype=np.intp)
            distinct = tuple(keys)
            return self._interned.setdefault(distinct, distinct), index  # equal tuples: one table

        return self._cached(("layouts", var.key, side, k), make)

    def _per_candidate(
        self, var: Var, side: str, k: int, what: Any, price: Callable[[Layout], float]
    ) -> np.ndarray:
        layouts, index = self._layouts(var, side, k)
        distinct = self._cached(
            ("price", var.key, side, k, what), lambda: np.array([price(x) for x in layouts], dtype=float)
        )
        return distinct[index]

    def _inputs(self, node: fx.Node, seed: Plan) -> None:
        v = self.index[node.name]
        var = self.vars[v]
        kinds = seed.deferred_inputs[node.name]
        inputs = self.shared.greedy.inputs.get(node)
        for j, (src, kind) in enumerate(zip(inputs if inputs is not None else tensor_inputs(node), kinds)):
            if kind == "param" and self.replicated:  # read from where the seed stores it, as it computes
                have = replicated_storage(seed.layouts[src.name][0])
                var.base += self._per_candidate(
                    var, "in", j, ("from stored", have), lambda w, h=have: self.cost.redistribute(h, w)  # type: ignore[misc]
                )
                continue
            if kind == "param":
                dim = part_dim_at(src, self._part_dims)
                gather = self.cost.gather_from_storage if dim is None else self._part_gather(dim)
                var.base += self._per_candidate(var, "in", j, ("gather", dim), gather)
                continue
            if kind == "replica":
                continue
            producer = self._producer(src, seed)
            if producer is None:
                have = seed.layouts[src.name][0]
                var.base += self._per_candidate(
                    var,
                    "in",
                    j,
                    ("from", have),
                    lambda w, have=have: self.cost.redistribute(have, w),  # type: ignore[misc]
                )
                continue
            u, side, k = producer
            share = max(1, self._readers[(*producer, _phase(node))])
            self._edge(u, v, self._layouts(self.vars[u], side, k), self._layouts(var, "in", j), share)

    def _count_readers(self, nodes: dict[str, fx.Node], seed: Plan) -> Counter[tuple[int, str, int, str]]:
        """Per producer layout (var, side, index): how many decided inputs read it. insert_comm
        redistributes a value once per wanted layout, not once per reader (`plan_cost` prices it
        so), so each of its k readers' edges is priced at 1/k: exact where they want one layout
        (the common case: a layer norm's backward reads its input gradient three times), low where
        they differ; `plan_cost` compares the plans the moves give with their seeds exactly."""
        readers: Counter[tuple[int, str, int, str]] = Counter()
        for name in seed.decided:
            node = nodes[name]
            inputs = self.shared.greedy.inputs.get(node)
            kinds = seed.deferred_inputs[name]
            for src, kind in zip(inputs if inputs is not None else tensor_inputs(node), kinds):
                if kind in ("param", "replica"):
                    continue
                producer = self._producer(src, seed)
                if producer is not None:
                    readers[(*producer, _phase(node))] += 1
        return readers

    def _producer(self, src: fx.Node, seed: Plan) -> tuple[int, str, int] | None:
        if src.name in self.index:
            return self.index[src.name], "out", 0
        if src.target is _getitem and isinstance(src.args[0], fx.Node) and src.args[0].name in self.index:
            return self.index[src.args[0].name], "out", output_index(src)
        if src.name in seed.resolved_by:
            owner, j = seed.resolved_by[src.name]
            if owner in self.index:
                return self.index[owner], "in", j
        return None

    def _outputs(self, gm: fx.GraphModule, seed: Plan) -> None:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        sig = signature(gm)
        nu = sig.num_user_outputs

        def whole(o: Layout) -> float:
            return self.cost.redistribute(o, Layout.replicated(o.shape, len(o.placements), o.dtype))

        for i, src in enumerate(output.args[0]):
            producer = self._producer(src, seed) if isinstance(src, fx.Node) else None
            if producer is None:
                continue
            u, side, k = producer
            var = self.vars[u]
            if nu - len(sig.buffer_updates) <= i < nu:  # a buffer's new value: whole, as buffers are
                var.base += self._per_candidate(var, side, k, "whole", whole)
            elif i < nu:  # the user gets it without pending sums (a loss: replicated)
                var.base += self._per_candidate(
                    var, side, k, "settle", lambda o: self.cost.redistribute(o, settled(o))
                )
            elif i >= sig.num_param_grads_end:  # an input's gradient: whole, as the input is
                var.base += self._per_candidate(var, side, k, "whole", whole)
            elif self.replicated and seed.output_layouts[i] is not None:
                # a gradient, into its weight stored as the seed computes it (pending sums
                # all-reduced): bucketed with the others by the schedule stage, at bandwidth
                stored = seed.output_layouts[i]
                var.base += self._per_candidate(
                    var, side, k, ("into stored", stored), lambda o, t=stored: self.cost.bucketed(o, t)  # type: ignore[misc]
                )
            else:  # a gradient: reduced into the parameter's storage
                part = sig.param_parts.get(sig.grad_of[i - nu])
                reduce = self._reduce if part is None else self._part_reduce(part.dim)
                var.base += self._per_candidate(var, side, k, ("reduce", part and part.dim), reduce)

    def _reduce(self, grad: Layout) -> float:
        """Reducing a gradient into its weight's storage: its pending sums reduce-scattered, and a
        load-balanced split put in the contiguous order the weight is stored in
        (`storage.storage_layout`)."""
        return reduce_cost(grad, self.shape) + self.cost.redistribute(summed(grad), settled(grad))

    def _part_gather(self, dim: int) -> Callable[[Layout], float]:
        """Gathering a part of a fused parameter from its storage (`storage.part_storage`)."""
        return lambda want: self.cost.redistribute(part_storage(want, dim, self.shape), summed(want))

    def _part_reduce(self, dim: int) -> Callable[[Layout], float]:
        """Reducing a part's gradient into its storage: the cut dim's axes move elsewhere."""
        return lambda grad: self.cost.redistribute(grad, part_storage(settled(grad), dim, self.shape))

    def _edge(
        self,
        u: int,
        v: int,
        outs: tuple[tuple[Layout, ...], np.ndarray],
        ins: tuple[tuple[Layout, ...], np.ndarray],
        share: int = 1,
    ) -> None:
        (out_keys, out_index), (in_keys, in_index) = outs, ins
        key = (id(out_keys), id(in_keys), share)
        table = self._tables.get(key)
        if table is None:  # edges between the same layout lists share one table, filled by `_fill`
            table = self._tables[key] = PairTable(out_keys, in_keys, share)
        # indices into the full layout lists until `_fill` (after `_prune`) makes them compact
        edge = Edge(u, v, table.data, out_index, in_index)
        self.edges.append(edge)
        self._pairs.append(table)
        self.vars[u].edges.append(edge)
        self.vars[v].edges.append(edge)

    def _fill(self) -> None:
        """Price the cells of the edge tables that the candidates kept after `_prune` read (most
        of a four-axis mesh's pairs belong to candidates pruned away), each cell once per search,
        and point every edge at its table's compact rows and columns (`PairTable`)."""
        needed: dict[int, tuple[PairTable, list[np.ndarray], list[np.ndarray]]] = {}
        for edge, table in zip(self.edges, self._pairs):
            found = needed.setdefault(id(table), (table, [], []))
            found[1].append(edge.out_index)
            found[2].append(edge.in_index)
        for table, out_indices, in_indices in needed.values():
            table.fill(out_indices, in_indices, self.cost.redistribute_table)
        for edge, table in zip(self.edges, self._pairs):
            edge.table, edge.pairs = table.data, table
            edge.out_index, edge.in_index = table.compact(edge.out_index, "out"), table.compact(edge.in_index, "in")
            edge.cached, edge.matrices = None, self.matrices
        self._pairs = []

    def _prune(self, var: Var) -> None:
        """Keep the candidates that are cheapest on their own (and the current one)."""
        order = list(np.argsort(var.base, kind="stable")[:MAX_CANDIDATES])
        if var.current not in order:
            order[-1] = var.current
        order.sort()
        keep = np.array(order)
        kept = keep.tobytes()
        var.cands = [var.cands[i] for i in order]
        self.shared.pruned += 1
        # The same list pruned the same way (a repeated layer) keeps one key and one index array
        # per edge side, so its blocks keep one signature and their solves stay memoized.
        var.key = ("pruned", var.key, kept)
        var.base = var.base[keep]
        var.current = order.index(var.current)
        index = self.index[var.name]
        for edge in var.edges:
            if edge.u == index:
                edge.out_index = self._pruned_index(edge.out_index, keep, kept)
            if edge.v == index:
                edge.in_index = self._pruned_index(edge.in_index, keep, kept)
            edge.cached = None

    def _pruned_index(self, index: np.ndarray, keep: np.ndarray, kept: bytes) -> np.ndarray:
        """`index[keep]`, one array per (index array, kept candidates) (`_prune`)."""
        key = (id(index), kept)
        found = self.shared.pruned_indices.get(key)
        if found is None:
            found = self.shared.pruned_indices[key] = (index, index[keep])  # keeps `index` alive
        return found[1]

    def _memory(self) -> float:
        """Per saved value: its bytes and its regather cost for each candidate of the variable
        that lays it out (once, on first use: a search without a memory limit never needs it).
        Returns the saved bytes that no variable decides."""
        if self._fixed_bytes is not None:
            return self._fixed_bytes
        gm, seed = self._gm, self.seed
        memory = plan_memory(gm, seed, self.shape, working=False)  # only `saved` is read
        nodes = {n.name: n for n in saved_nodes(gm)}
        decided = set(seed.decided)
        fixed = 0.0
        for saved in memory.saved:
            node = nodes[saved.name]
            producer = self._producer(node, seed) if node.op != "placeholder" else None
            if producer is None:
                fixed += saved.bytes
                continue
            u, side, k = producer
            var = self.vars[u]
            chain = weight_chain(node, decided) is not None
            per_byte = self._per_candidate(
                var, side, k, "bytes", lambda lay: float(lay.local_bytes(self.shape))
            )
            again = (
                self._per_candidate(var, side, k, "gather", self.cost.gather_from_storage)
                if chain
                else np.full(len(var.cands), np.inf)
            )
            var.memory.append((per_byte, again))
        self._fixed_bytes = fixed
        return fixed

    # ---- the memory price ------------------------------------------------------------------------
    def set_price(self, per_byte: float) -> None:
        """Price every saved byte at `per_byte` (cost units per byte); a weight chain instead costs
        its gather again in backward when that is cheaper."""
        self._memory()
        for var in self.vars:
            var.unary = var.base.copy()
            if per_byte > 0:
                for size, again in var.memory:
                    var.unary += np.minimum(per_byte * size, again)

    def modeled(self, per_byte: float) -> tuple[float, float]:
        """(cost without the memory price, including backward regathers; activation bytes) now."""
        cost = sum(float(var.base[var.current]) for var in self.vars)
        cost += sum(e.value(self.vars[e.u].current, self.vars[e.v].current) for e in self.edges)
        saved = self._memory()
        for var in self.vars:
            for size, again in var.memory:
                b, r = float(size[var.current]), float(again[var.current])
                if per_byte > 0 and per_byte * b > r:
                    cost += r
                else:
                    saved += b
        return cost, saved

    def snapshot(self) -> list[int]:
        return [var.current for var in self.vars]

    def restore(self, state: Sequence[int]) -> None:
        for var, current in zip(self.vars, state):
            var.current = current

    def forced(self) -> dict[str, Strategy]:
        return {v.name: v.cands[v.current] for v in self.vars}

    # ---- optimizing ------------------------------------------------------------------------------
    def total(self) -> float:
        value = sum(float(var.unary[var.current]) for var in self.vars)
        for edge in self.edges:
            value += edge.value(self.vars[edge.u].current, self.vars[edge.v].current)
        return value

    def optimize(self, max_sweeps: int) -> int:
        before = self.total()
        clock = Clock.fresh(len(self.vars))  # the unary costs may have changed since the last call
        for done in range(1, max_sweeps + 1):
            sweep(self.blocks if done % 2 else self.blocks[::-1], self.vars, self._memo, self.tally, clock)
            after = self.total()
            if after >= before - 1e-9 * max(1.0, abs(before)):
                return done
            before = after
        return max_sweeps


def reduce_cost(layout: Layout, shape: Sequence[int]) -> float:
    """Reduce-scatters that take a gradient's pending sums into a fully split storage layout."""
    n = layout.local_numel(shape)
    total = 0.0
    for a in layout.partial_axes():
        g = shape[a]
        total += (g - 1) / g * n
        n //= g
    return total


def regather_cost(saved: SavedValue, cost: Cost) -> float:
    """What gathering a saved weight chain again in backward costs (its forward gather once more)."""
    return cost.gather_from_storage(saved.layout)


def _phase(node: fx.Node) -> str:
    """Forward or backward: readers of one value share its redistribution only within a phase (a
    forward activation that the backward also reads is mostly wanted there in another layout)."""
    return info(node).phase if has_info(node) else ""
