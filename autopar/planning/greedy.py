"""The greedy pass: one Strategy per node, op by op (`planner="greedy"`, and the search's seeds).

Nodes are visited in graph order. Each op picks the strategy whose input redistributions, pending
sums and replicated work cost least given its producers' layouts. Parameters are not laid out up
front: the first op that consumes a parameter chooses the layout it computes with, and the
parameter is then *stored* in that layout further split over every axis it was replicated on, so
that each rank stores ~1/p of it and all-gathers before use.

Matmul-like ops that consume a parameter follow axis roles, which is where the 3-D algorithm comes
from: "token" axes split the rows (tokens) of the activation, "tensor" axes must each split the
weight, preferably along different weight dims (contraction on one, columns on the other, as in
the AxoNN / Tensor3D grid; one tensor axis gives 1-D Megatron, two give 2-D).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from autopar.core.errors import MissingRuleError, ShardingError
from autopar.core.layout import Layout, Partial, Replicate, Shard, settled
from autopar.core.mesh import Mesh
from autopar.core.meta import info, signature
from autopar.core.plan import Plan
from autopar.core.redistribute import redistribute_cost
from autopar.core.strategy import AxisStrategy, OpCall, Strategy
from autopar.cost.work import global_work, work_split
from autopar.planning.greedy_ahead import Readers, rerank
from autopar.planning.greedy_replay import walk
from autopar.planning.greedy_roles import axis_roles, batch_error
from autopar.planning.greedy_scores import GreedyMemo, ListFacts, ListShape, best, pending_elements, scores
from autopar.planning.search_steps import even_redistribute_cost
from autopar.planning.storage import (
    gather_from_storage,
    part_dims,
    part_storage,
    placement_cost,
    storage_layout,
)
from autopar.rules.base import RuleRegistry, admissible, combine, expand
from autopar.rules.calls import call_key, expand_cached, op_call, output_index, tensor_inputs

# Relative weights of the heuristic's cost terms, in "elements sent per rank".
FLOP_WEIGHT = 1.0 / 200.0  # a rank does ~200 flops in the time it sends one element (CPU/gloo-like)
PARTIAL_WEIGHT = 1.0  # a pending sum will cost at least a reduce-scatter later
BEAM = 3

# a parameter at most this fraction of the model's elements may be stored whole where no split
# fits it: what it adds to a rank's share is noise
SMALL_PARAM_FRACTION = 1e-3


def choose_layouts(gm: fx.GraphModule, mesh: Mesh, registry: RuleRegistry) -> Plan:
    return _Greedy(gm, mesh, registry).run()


def greedy_plan(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    *,
    roles: tuple[str, ...] | None = None,
    forced: dict[str, Strategy] | None = None,
    expand_cache: dict[Any, list[Strategy]] | None = None,
    memo: GreedyMemo | None = None,
    replay: bool = True,
) -> Plan:
    """The greedy pass with other axis roles, or with some nodes' strategies fixed in advance.
    Passes over the same graph and mesh may share `memo` and `expand_cache`. `replay=False` walks
    every node of repeated blocks (`greedy_replay`: the same plan, to compare with)."""
    greedy = _Greedy(gm, mesh, registry, roles=roles, forced=forced, expand_cache=expand_cache, memo=memo)
    return greedy.run(replay)


@functools.lru_cache(maxsize=200_000)
def _redist(src: Layout, dst: Layout, mesh_shape: tuple[int, ...]) -> float:
    """`redistribute_cost`; between even layouts from the steps of their placements alone."""
    if src == dst:
        return 0.0
    if src.shape == dst.shape and src.is_even(mesh_shape) and dst.is_even(mesh_shape):
        return even_redistribute_cost(src, dst, mesh_shape)
    return redistribute_cost(src, dst, mesh_shape)


@functools.lru_cache(maxsize=200_000)
def _gather(want: Layout, mesh_shape: tuple[int, ...]) -> float:
    return gather_from_storage(want, mesh_shape)


@functools.lru_cache(maxsize=200_000)
def _storage(want: Layout, mesh_shape: tuple[int, ...], part_dim: int | None) -> Layout:
    """Where a parameter computing as `want` is stored (a part of a fused one: `part_dim` whole);
    repeated layers ask the same of every mesh."""
    return storage_layout(want, mesh_shape) if part_dim is None else part_storage(want, part_dim, mesh_shape)


@functools.lru_cache(maxsize=200_000)
def _strategy_facts(strategy: Strategy, mesh_shape: tuple[int, ...]) -> tuple[int, int, float]:
    """(uneven layouts, work split, elements of pending sums) of a candidate: candidate lists are
    shared by repeated ops and passes, so each candidate is worked out once."""
    uneven = sum(not lay.is_even(mesh_shape) for lay in (*strategy.inputs, *strategy.outputs))
    return uneven, work_split(strategy, mesh_shape), pending_elements(strategy, mesh_shape)


class _Greedy:
    def __init__(
        self,
        gm: fx.GraphModule,
        mesh: Mesh,
        registry: RuleRegistry,
        roles: tuple[str, ...] | None = None,
        forced: dict[str, Strategy] | None = None,
        expand_cache: dict[Any, list[Strategy]] | None = None,
        memo: GreedyMemo | None = None,
    ) -> None:
        self.gm = gm
        self.mesh = mesh
        self.shape = tuple(mesh.shape)
        self.registry = registry
        self.plan = Plan(roles=roles if roles is not None else axis_roles(mesh))
        self.forced = forced or {}
        self.expand_cache = expand_cache if expand_cache is not None else {}
        memo = memo if memo is not None else GreedyMemo()
        # (op, call_key, input layouts, roles where they apply) -> (strategy, note): see _choose
        self.choices: dict[Any, tuple[Strategy, str]] = memo.choices
        self.memo = memo
        # Values laid out by their first consumer: "param" chains (a parameter and views/casts of
        # it) and "replica" chains (computed from whole, replicated values only: slicing is free).
        self.deferred: dict[fx.Node, str] = {}
        self.sig = signature(gm)
        self.part_dims = part_dims(gm)  # parts of fused parameters: stored with the cut dim whole
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.tangents: set[fx.Node] = set()
        self.readers = Readers(
            registry, self.forced, self.plan.layouts, self.deferred, self.tangents, self._tensor_inputs,
            lambda r: self._question(r, self._op_call(r)[1]), self._reader_wants, self.plan.roles,
        )

    # ---- driver -------------------------------------------------------------------------------
    def run(self, replay: bool = True) -> Plan:
        self._check_batch()
        blocks = self.memo.blocks(self.gm) if replay else None
        if blocks is None:
            for node in self.gm.graph.nodes:
                self.visit(node)
        else:
            self.memo.replayed += walk(self, blocks)
        self._outputs()
        self._check_storage()
        return self.plan

    def visit(self, node: fx.Node) -> None:
        """Lay out one node (`greedy_replay.walk` calls it for every node it does not replay)."""
        if node.op == "placeholder":
            self._placeholder(node)
        elif node.op == "call_function":
            self._call(node)

    def _check_batch(self) -> None:
        error = batch_error(self.gm, self.mesh, self.plan.roles)
        if error is not None:
            raise error

    def _check_storage(self) -> None:
        """Weights (2-D and up) must be stored split on every axis; vectors, and tables too small
        to matter (SMALL_PARAM_FRACTION of the model: Swin's relative-position bias of one head,
        LeViT's attention biases), may stay replicated, as the report lists."""
        params = [n for n in self.gm.graph.nodes if n.op == "placeholder" and info(n).role == "param"]
        total = sum(math.prod(self.plan.layouts[n.name][0].shape) for n in params)
        for node in self.gm.graph.nodes:
            if node.op != "placeholder" or info(node).role != "param":
                continue
            layout = self.plan.layouts[node.name][0]
            unsplit = [
                a for a, p in enumerate(layout.placements) if isinstance(p, Replicate) and self.shape[a] > 1
            ]
            small = math.prod(layout.shape) <= SMALL_PARAM_FRACTION * total
            if len(layout.shape) >= 2 and unsplit and not small:
                axes = ", ".join(f"{self.mesh.axis_names[a]}={self.shape[a]}" for a in unsplit)
                raise ShardingError(
                    f"parameter {info(node).param_name} of shape {list(layout.shape)} cannot be split "
                    f"over mesh axis {axes}: after the splits its computation needs, no dim is "
                    "divisible by that axis, nor long enough for uneven blocks (every rank must "
                    "hold at least one row)",
                    op="parameter storage",
                    layouts=[layout.per_dim_str(self.mesh.axis_names)],
                    hint="choose a mesh whose axes divide the weight's dims (or are smaller than "
                    "them), or make the weight larger",
                )

    def _placeholder(self, node: fx.Node) -> None:
        role = info(node).role
        val = node.meta["val"]
        if role == "param":
            self.deferred[node] = "param"
        elif role == "tangent":
            self.tangents.add(node)  # takes its output's layout once that is known
        else:  # user inputs and buffers arrive whole on every rank; consumers slice for free
            self._set(node, (Layout.replicated(val.shape, self.mesh.ndim, val.dtype),), "global input")

    def _call(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            parent = node.args[0]
            assert isinstance(parent, fx.Node)
            layout = self.plan.strategies[parent.name].outputs[output_index(node)]
            self._set(node, (layout,), "")
            return
        inputs = self._tensor_inputs(node)
        rule = self.registry.get(node.target)
        if (
            inputs
            and isinstance(node.meta.get("val"), torch.Tensor)
            and not (rule is not None and rule.anchor)
        ):
            kinds = [self._deferral(i) for i in inputs]
            if all(k is not None for k in kinds):
                self.deferred[node] = "param" if "param" in kinds else "replica"
                return
        self._choose(node, inputs)

    def _deferral(self, node: fx.Node) -> str | None:
        """How a value may be laid out later: "param", "replica", or None (it has its layout)."""
        current = self._current(node)
        if isinstance(current, str):
            return current
        return "replica" if current.is_replicated else None

    # ---- choosing a strategy -------------------------------------------------------------------
    def _rule(self, node: fx.Node) -> Any:
        rule = self.registry.get(node.target)
        tags = getattr(node.target, "tags", ())
        if rule is None and torch.Tag.nondeterministic_seeded in tags:
            raise MissingRuleError(
                f"random op {node.target} has no sharding rule: its numbers would depend on the layout",
                op=str(node.target),
                where=info(node).where(),
                hint="give it a rule that draws the global random tensor and keeps each rank's block, "
                "as autopar/rules/random.py does for dropout, or train without it",
            )
        if rule is None:
            raise MissingRuleError(
                f"no sharding rule for {node.target}",
                op=str(node.target),
                where=info(node).where(),
                hint="register one with registry.register(op, strategies, family=...) and pass "
                "registry= to autopar.parallelize (docs/layouts-and-rules.md: Sharding rules)",
            )
        return rule

    def _current(self, node: fx.Node) -> Layout | str:
        """Layout an input has now, or its deferral kind if its consumer will lay it out."""
        if node in self.tangents:
            self._resolve_tangent(node)
        if node in self.deferred:
            return self.deferred[node]
        return self.plan.layouts[node.name][0]

    def _input_cost(self, have: Layout | str, want: Layout) -> float:
        if isinstance(have, Layout):
            return _redist(have, want, self.shape)
        return _gather(want, self.shape) if have == "param" else 0.0  # "replica": slicing is free

    def _tensor_inputs(self, node: fx.Node) -> list[fx.Node]:
        found = self.memo.inputs.get(node)
        if found is None:
            found = self.memo.inputs[node] = tensor_inputs(node)
        return found

    def _op_call(self, node: fx.Node) -> tuple[OpCall, tuple[Any, ...]]:
        """The node's op call and its `call_key` (each worked out once per memo)."""
        found = self.memo.calls.get(node)
        if found is None:
            call = op_call(node)
            found = self.memo.calls[node] = (call, call_key(call))
        return found

    def _question(self, node: fx.Node, key_of_call: tuple[Any, ...]) -> int:
        """One number per distinct (op, call key): the memo's keys hash it instead of the call's
        specs at every node of every layer."""
        found = self.memo.questions.get(node)
        if found is None:
            numbers = self.memo.numbers
            found = self.memo.questions[node] = numbers.setdefault((node.target, key_of_call), len(numbers))
        return found

    def _choose(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        rule = self._rule(node)
        call, key_of_call = self._op_call(node)
        current = [self._current(i) for i in inputs]
        self.plan.decided.append(node.name)
        self.plan.deferred_inputs[node.name] = tuple(c if isinstance(c, str) else "" for c in current)
        for index, (node_in, have) in enumerate(zip(inputs, current)):
            if isinstance(have, str):
                self.plan.resolved_by.setdefault(node_in.name, (node.name, index))
        if node.name in self.forced:
            best = self.forced[node.name]
            for node_in, want in zip(inputs, best.inputs):
                self._resolve(node_in, want)
            self.plan.strategies[node.name] = best
            self._set(node, best.outputs, "chosen by the plan search")
            return
        # The choice depends only on the op call and the inputs' current layouts (and the axis roles
        # where `_role_filter` applies): repeated layers ask the same question again and get the
        # same answer, and so do passes with other roles or forced nodes sharing `choices`.
        roled = rule.anchor and "param" in current and any(c != "param" for c in current)
        # ... and on what its readers take (`greedy_ahead`): their ops and other inputs now
        readers = self.readers.of(node)
        # (and whether they are all its uses: `_pick` then charges no pending sum of its own)
        ahead = (tuple(self.readers.key(r, j) for r, j in readers), len(readers) == len(node.users))
        key = (self._question(node, key_of_call), tuple(current), self.plan.roles if roled else None, ahead)
        found = self.choices.get(key)
        if found is None:
            found = self.choices[key] = self._pick(node, rule, call, current, key_of_call, readers)
        best, note = found
        for node_in, want in zip(inputs, best.inputs):
            self._resolve(node_in, want)
        self.plan.strategies[node.name] = best
        self._set(node, best.outputs, note)

    def _pick(
        self,
        node: fx.Node,
        rule: Any,
        call: OpCall,
        current: list[Layout | str],
        key_of_call: tuple[Any, ...] | None = None,
        readers: Sequence[tuple[fx.Node, int]] = (),
    ) -> tuple[Strategy, str]:
        """The lowest-cost candidate strategy for `call` given its inputs' current layouts, the
        best few (one per output layout) ranked again with what `readers` pay to take their output."""
        # a whole list, shared by repeated ops and passes (a rule with a requirement: filtered)
        # (a rule with a whole-mesh filter, `admits`: its filtered list, which the per-axis beam
        # cannot apply: a balanced split off the "cp" axis, or over a merge of two samples)
        shared = rule.anchor or len(current) == 0 or rule.requirement is not None or rule.admits is not None
        if shared:
            candidates = expand_cached(node, rule, call, self.shape, self.expand_cache, key_of_call)
        else:
            key = (call.op, call_key(call) if key_of_call is None else key_of_call)
            candidates = self._beam(call, rule.strategies(call), current, rule.uneven, key)
        if not candidates:
            raise self._no_strategy(node, call, rule)
        facts = self._list_facts(candidates) if shared else ListFacts.of(candidates, self._facts)
        cost, slices = scores(
            facts, current, global_work(node), self._input_cost, PARTIAL_WEIGHT, FLOP_WEIGHT
        )
        roled = rule.anchor and "param" in current and any(c != "param" for c in current)
        needs = self.readers.needs(readers) if len(call.outputs) == 1 else []
        # where every use is a reader priced, its need reduces the pending sums: not charged twice
        own = cost - PARTIAL_WEIGHT * facts.pending if needs and len(readers) == len(node.users) else cost
        if not roled:
            if not needs:
                return candidates[best(cost, facts.uneven, slices)], "lowest modeled cost"
            order = np.lexsort((np.arange(len(cost)), slices, facts.uneven, cost)).tolist()
            ahead = rerank(order, lambda i: candidates[i].outputs[0], needs, self._price)
            chosen = min(ahead, key=lambda t: (own[t[0]] + t[1], facts.uneven[t[0]], slices[t[0]], t[0]))
            return candidates[chosen[0]], "lowest modeled cost"
        columns = (cost.tolist(), facts.uneven.tolist(), slices.tolist(), range(len(cost)), candidates)
        scored = [(0, *row) for row in zip(*columns)]
        note = "lowest modeled cost"
        constrained = self._role_filter(scored, current)
        if constrained:
            scored, note = constrained, "axis roles (tokens / tensor axes)"
        # (role preference, cost, uneven blocks (even splits win ties), slices, enumeration order)
        scored.sort(key=lambda t: t[:5])
        if needs:
            rows = {t[4]: t for t in scored}
            ahead = rerank([t[4] for t in scored], lambda i: candidates[i].outputs[0], needs, self._price)
            ranked = sorted((rows[i][0], own[i] + need, *rows[i][2:5]) for i, need in ahead)
            return candidates[ranked[0][4]], note
        return scored[0][5], note

    # ---- the look-ahead over a value's readers (`greedy_ahead`) ---------------------------------
    def _price(self, have: Layout, want: Layout) -> float:
        return _redist(have, want, self.shape)

    def _reader_wants(self, reader: fx.Node, position: int, current: list[Layout | str]) -> tuple[Layout, ...]:
        """The layouts an anchor reading a parameter may take input `position` in: those of its
        candidates that its axis roles keep, at the best role preference."""
        call, key_of_call = self._op_call(reader)
        candidates = expand_cached(reader, self._rule(reader), call, self.shape, self.expand_cache, key_of_call)
        kept = self._role_filter([(0, 0, 0, 0, i, s) for i, s in enumerate(candidates)], current)
        first = min((t[0] for t in kept), default=0)
        return tuple(dict.fromkeys(t[5].inputs[position] for t in kept if t[0] == first))

    def _list_facts(self, candidates: list[Strategy]) -> ListFacts:
        found = self.memo.lists.get(id(candidates))
        if found is None:
            shape = self.memo.shapes.get(id(candidates))
            if shape is None:
                shape = self.memo.shapes[id(candidates)] = ListShape.of(candidates)
            found = self.memo.lists[id(candidates)] = shape.facts(self.shape)
        return found

    def _facts(self, strategy: Strategy) -> tuple[int, int, float]:
        return _strategy_facts(strategy, self.shape)

    def _beam(
        self,
        call: OpCall,
        options: list[AxisStrategy],
        current: Sequence[Layout | str],
        uneven: bool,
        key: Any = None,
    ) -> list[Strategy]:
        """Per axis, the few single-axis options closest to the inputs; their product (each
        combination combined once per memo: `key` names the call)."""
        numels = [have.local_numel(self.shape) if isinstance(have, Layout) else 0 for have in current]
        per_axis: list[list[AxisStrategy]] = []
        for a, g in enumerate(self.shape):
            if g == 1:
                per_axis.append(
                    [
                        AxisStrategy(
                            tuple(Replicate() for _ in call.inputs), tuple(Replicate() for _ in call.outputs)
                        )
                    ]
                )
                continue
            ranked = sorted(
                enumerate(options),
                key=lambda t: (self._axis_cost(t[1], current, a, g, numels), t[0]),
            )
            per_axis.append([s for _, s in ranked[:BEAM]])
        result = []
        combos = self.memo.combos if key is not None else {}
        combined = self.memo.combined  # (mesh-free: shared by the screen's meshes)
        for combo in itertools.product(*per_axis):
            if (key, combo) not in combos:
                strategy = combined.get((key, combo)) if key is not None else None
                if strategy is None:
                    strategy = combine(call, combo)
                    if key is not None:
                        combined[(key, combo)] = strategy
                combos[(key, combo)] = strategy if admissible(strategy, self.shape, uneven) else None
            found = combos[(key, combo)]
            if found is not None:
                result.append(found)
        return result or expand(call, options, self.shape, uneven)

    def _axis_cost(
        self, option: AxisStrategy, current: Sequence[Layout | str], axis: int, g: int, numels: Sequence[int]
    ) -> float:
        cost = 0.0
        for have, want, n in zip(current, option.inputs, numels):
            if isinstance(have, Layout):
                cost += placement_cost(have.placements[axis], want, g, n)
            elif have == "param":
                cost += 0.0 if isinstance(want, Shard) else 1.0
        for out in option.outputs:
            if isinstance(out, Partial):
                cost += 0.5
        return cost

    def _role_filter(self, scored: list[Any], current: Sequence[Layout | str]) -> list[Any]:
        """Candidates that respect the axis roles, ranked first by how many distinct weight dims
        the tensor axes split (then by cost)."""
        roles = self.plan.roles
        kept = []
        for item in scored:
            strategy: Strategy = item[5]
            ok = True
            distinct: set[int] = set()
            weights = [w for w, c in zip(strategy.inputs, current) if c == "param"]
            main_weight = max(weights, key=lambda w: math.prod(w.shape))
            for a, role in enumerate(roles):
                if self.shape[a] == 1:
                    continue
                if role == "token":
                    acts = [w for w, c in zip(strategy.inputs, current) if c != "param" and len(w.shape) >= 1]
                    ok = ok and all(w.placements[a] == Shard(0) for w in acts)
                else:
                    p = main_weight.placements[a]
                    ok = ok and isinstance(p, Shard)
                    if isinstance(p, Shard):
                        distinct.add(p.dim)
            if ok:
                kept.append((-len(distinct), *item[1:]))
        return kept

    # ---- laying out parameters -----------------------------------------------------------------
    def _resolve(self, node: fx.Node, want: Layout) -> None:
        """Give a deferred value (a parameter or replica chain) the layout its consumer wants."""
        if node not in self.deferred:
            return
        kind = self.deferred.pop(node)
        if node.op == "placeholder":
            dim = self.part_dims.get(node.name)
            storage = _storage(want, self.shape, dim)
            self.plan.stored_from[node.name] = want
            self._set(node, (storage,), f"stored split over all axes; computes as {want.per_axis_str()}")
            return
        if node.target is operator.getitem:
            raise ShardingError(f"cannot lay out {node.name}", where=info(node).where())
        inputs = self._tensor_inputs(node)
        rule = self._rule(node)
        call, key_of_call = self._op_call(node)
        every = expand_cached(node, rule, call, self.shape, self.expand_cache, key_of_call)
        matching = [s for s in every if s.outputs[0] == want]
        if not matching:
            replicated = [s for s in every if s.outputs[0].is_replicated]
            matching = replicated[:1]
        current = [self._current(i) for i in inputs]
        best = min(matching, key=lambda s: sum(self._input_cost(h, w) for h, w in zip(current, s.inputs)))
        for node_in, need in zip(inputs, best.inputs):
            self._resolve(node_in, need)
        self.plan.strategies[node.name] = best
        self._set(node, best.outputs, f"laid out by its consumer ({kind} chain)")

    def _resolve_tangent(self, node: fx.Node) -> None:
        index = info(node).input_index or 0
        produced = self.output.args[0][index]  # type: ignore[index]
        assert isinstance(produced, fx.Node)
        self.tangents.discard(node)
        self._resolve(produced, self._replicated(produced))
        self._set(node, (self._user_output_layout(produced),), "gradient of a user output")

    def _replicated(self, node: fx.Node) -> Layout:
        val = node.meta["val"]
        return Layout.replicated(val.shape, self.mesh.ndim, val.dtype)

    def _user_output_layout(self, produced: fx.Node) -> Layout:
        return settled(self.plan.layouts[produced.name][0])

    def _outputs(self) -> None:
        values = list(self.output.args[0])  # type: ignore[arg-type]
        nu = self.sig.num_user_outputs
        param_nodes = {
            info(n).param_name: n
            for n in self.gm.graph.nodes
            if n.op == "placeholder" and info(n).role == "param"
        }
        buffers = {
            info(n).param_name: n for n in self.gm.graph.nodes if n.op == "placeholder" and info(n).role == "buffer"
        }
        updated = {nu - len(self.sig.buffer_updates) + k: name for k, name in enumerate(self.sig.buffer_updates)}
        result: list[Layout | None] = []
        for i, value in enumerate(values):
            if not isinstance(value, fx.Node):
                result.append(None)
                continue
            if i in updated:  # a buffer's new value goes back into the buffer, laid out as it is
                self._resolve(value, self._replicated(value))
                result.append(self.plan.layouts[buffers[updated[i]].name][0])
                continue
            if i < nu:
                self._resolve(value, self._replicated(value))
                result.append(self._user_output_layout(value))
                continue
            if i >= self.sig.num_param_grads_end:  # an input's gradient: whole, as the input is
                self._resolve(value, self._replicated(value))
                result.append(self._replicated(value))
                continue
            param = param_nodes[self.sig.grad_of[i - nu]]
            if param in self.deferred:  # used only in backward: store it as its gradient arrives
                grad = self.plan.layouts[value.name][0]
                self._resolve(
                    param,
                    Layout(
                        tuple(Replicate() if isinstance(p, Partial) else p for p in grad.placements),
                        grad.shape,
                        grad.dtype,
                    ),
                )
            result.append(self.plan.layouts[param.name][0])
        for node in list(self.deferred):  # computed but consumed by nothing that chose a layout
            self._resolve(node, self._replicated(node))
        self.plan.output_layouts = result

    # ---- helpers -------------------------------------------------------------------------------
    def _set(self, node: fx.Node, layouts: tuple[Layout, ...], note: str) -> None:
        self.plan.layouts[node.name] = layouts
        if note:
            self.plan.notes[node.name] = note

    def _no_strategy(self, node: fx.Node, call: OpCall, rule: Any = None) -> ShardingError:
        shapes = ", ".join(str(list(s.shape)) for s in call.inputs)
        requirement = rule.requirement if rule is not None else None
        if requirement is not None:
            return ShardingError(
                f"no layout of {node.target} on mesh {self.mesh} meets what the mesh asks of it: "
                f"input shapes {shapes}",
                op=str(node.target),
                where=info(node).where(),
                hint=requirement.hint,
            )
        return ShardingError(
            f"no even layout of {node.target} fits mesh {self.mesh}: input shapes {shapes}",
            op=str(node.target),
            where=info(node).where(),
            hint="make the split dims divisible by the mesh axes that split them, or choose another mesh shape",
        )
