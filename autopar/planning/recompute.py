"""Activation recomputation: which forward values backward computes again instead of keeping.

The forward hands backward every value backward reads; on a transformer that is most of a rank's
memory (the LLaMA-7B shape on 64 ranks saves ~17 GB of activations against ~2 GB of weight state).
A recomputed value is not kept: backward runs its op again, just before its first use, from the
op's own inputs, which are kept instead unless they are recomputed too (`autopar.passes.recompute`
carries a choice out). Three kinds of choice, each a *unit* of forward ops:

- *selective*, one op: a cheap op (pointwise, norm, softmax, view: anything without a matmul's or
  attention's flops, nothing random) whose output is kept for backward. Its inputs are usually
  kept anyway, so it frees its bytes for the price of one cheap op;
- *block*, every op of one numbered block (`layers.3`) but its random ops and weight chains: the
  block's activations shrink to its input, for the price of its forward (and its collectives)
  once more: what Megatron calls full recomputation;
- *region*, the ops of a `torch.utils.checkpoint` region of the user's code (marked by the trace
  stage, `NodeInfo.checkpoint`): always recomputed, but the region's outputs stay kept, as torch
  keeps a checkpointed function's outputs.

Bytes are exact per unit and state: a value is kept in each layout that backward reads it in (the
forward's redistribution of it, reused), as `plan_memory` counts, and in its own layout where a
recomputed op reads it, so freeing a value can keep its inputs. A recomputed op that reads a kept
input in another layout redistributes it again (unless backward keeps that layout anyway): keeping
the forward's gathered copy instead would leave a block's input kept twice, split and gathered, and
recomputing the block would not shrink it to its input. Seconds are the units' compute on this
plan's layouts plus the redistributions they run again (between recomputed ops, and of kept inputs). `choose_savings` brings a plan
under a memory limit with the cheapest seconds per byte first, across recomputation and the
weight-chain regathers of `autopar.planning.memory`.

Recomputed values are not gone for good: backward makes a block's recomputed values again just
before that block's backward reads them, so while it runs they exist beside everything kept
(`RecomputeModel.rematerialized`, the largest block's; an op outside any numbered block or region
is a group of its own). The limit is checked against the kept bytes plus that transient. Without
it, recomputing every block would bring any plan down to its blocks' inputs, and a long sequence
would seem to fit by recomputation alone where, as on real runs, one layer's activations at that
sequence do not: the split of the sequence (context parallelism) is what shrinks them.
"""

from __future__ import annotations

import heapq
import math
import operator
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from autopar.core.layout import Layout
from autopar.core.meta import has_info, info, is_backward, signature
from autopar.core.plan import Plan
from autopar.core.strategy import Strategy
from autopar.cost.work import compute_rate, global_work, work_split
from autopar.planning.memory import SavedValue, views_stored, weight_chain
from autopar.planning.plan_cost import GraphFacts
from autopar.planning.search_cost import ElementCost
from autopar.rules.calls import tensor_inputs

_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")  # the outermost numbered module of a path: "layers.3"


@dataclass(frozen=True)
class Unit:
    """Forward ops recomputed together: "op:<node>", "block:<module path>" or "region:<module path>"."""

    name: str
    nodes: frozenset[str]
    forced: bool = False  # a user's checkpoint region: recomputed whatever the memory


@dataclass
class _Value:
    """What keeping one forward value costs, per state of the recompute set."""

    have: Layout
    is_placeholder: bool  # or a view of a stored block (`views_stored`): its own layout is held anyway
    backward: set[Layout]  # layouts backward reads it in (its own, or a forward redistribution)
    forward: set[Layout]  # layouts forward ops read it in
    by_user: dict[str, list[Layout]] = field(default_factory=dict)  # forward user -> layouts it reads
    users: tuple[str, ...] = ()  # forward users that are recompute candidates


@dataclass(frozen=True)
class Savings:
    """The memory choice for one plan: weight chains gathered again, ops recomputed, and what
    they leave. `activation_bytes` is what backward still finds kept; `seconds` what they add."""

    regather: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    units: tuple[str, ...] = ()  # the chosen units' names, for the report
    activation_bytes: float = 0.0  # kept, plus the largest recomputed group while it exists again
    activation_bytes_before: float = 0.0  # nothing recomputed or regathered
    seconds: float = 0.0
    recompute_seconds: float = 0.0  # of `seconds`, the recomputed ops' (the rest: regathers)

    @property
    def traded(self) -> bool:
        """Whether time was traded for memory (beyond the user's own checkpoint regions)."""
        return bool(self.regather) or any(not u.startswith("region:") for u in self.units)


class RecomputeModel:
    """Exact saved bytes and recompute seconds of a plan for any set of recomputed ops."""

    def __init__(
        self,
        gm: fx.GraphModule,
        plan: Plan,
        mesh_shape: Sequence[int],
        compute: Callable[[fx.Node], float],
        redistribute: Callable[[Layout, Layout], float],
        facts: GraphFacts | None = None,
    ) -> None:
        """`facts`: the graph's `GraphFacts`, whose tensor inputs per call are read instead of
        walked again (the search builds one model per plan it fits)."""
        self.shape = tuple(mesh_shape)
        # call -> its tensor inputs' names
        self._names = {name: inputs for name, inputs, *_ in facts.calls} if facts is not None else {}
        self._redistribute = redistribute
        self.values: dict[str, _Value] = {}
        self.inputs: dict[str, list[tuple[str, Layout]]] = {}  # candidate op -> (input, layout it reads)
        self.seconds: dict[str, float] = {}  # candidate op -> its compute
        self.units: list[Unit] = []
        self.partner: dict[str, str] = {}  # a getitem -> the several-result op it reads
        self.group: dict[str, str] = {}  # candidate op -> the block or region backward remakes it with
        self._plain: dict[str, float] = {}  # value -> its kept bytes while none of its users is recomputed
        decided = set(plan.decided)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        grads = {v for v in list(output.args[0])[signature(gm).num_user_outputs :] if isinstance(v, fx.Node)}
        selective: list[str] = []
        blocks: dict[str, set[str]] = {}
        regions: dict[str, set[str]] = {}
        region_outputs: set[str] = set()
        for node in gm.graph.nodes:
            if node.op not in ("placeholder", "call_function") or is_backward(node):
                continue
            if node.name not in plan.layouts:
                continue
            if isinstance(node.meta.get("val"), torch.Tensor):
                self.values[node.name] = self._value(node, plan, grads)
            if node.op != "call_function" or not _recomputable(node, decided, self.inputs):
                continue
            strategy = plan.strategies.get(node.name)
            sources = self._input_names(node)
            reads = strategy.inputs if strategy is not None else [plan.layouts[i][0] for i in sources]
            self.inputs[node.name] = list(zip(sources, reads))
            self.seconds[node.name] = compute(node)
            source = _tuple_source(node)
            if source is not None:  # one result of a several-result op: recomputed with the op
                self.partner[node.name] = source.name
            region = _region_of(node)
            if region is not None:
                regions.setdefault(region, set()).add(node.name)
                if any(u.op == "output" or (not is_backward(u) and _region_of(u) != region) for u in node.users):
                    region_outputs.add(node.name)  # read after the region: torch keeps it too
            value = self.values.get(node.name)
            if value is not None and value.backward and not _expensive(node if source is None else source):
                selective.append(node.name)
            block = _BLOCK.match(info(node).module_path) if has_info(node) else None
            if block is not None:
                blocks.setdefault(block.group(1), set()).add(node.name)
            self.group[node.name] = region or (block.group(1) if block is not None else node.name)
        for value in self.values.values():
            value.users = tuple(u for u in value.by_user if u in self.inputs)
        for path, names in sorted(regions.items()):
            self.units.append(Unit(f"region:{path}", frozenset(names - region_outputs), forced=True))
        self.units += [Unit(f"op:{n}", frozenset((n, self.partner.get(n, n)))) for n in selective]
        self.units += [Unit(f"block:{path}", frozenset(names)) for path, names in sorted(blocks.items())]

    def _input_names(self, node: fx.Node) -> tuple[str, ...]:
        found = self._names.get(node.name)
        if found is None:
            found = self._names[node.name] = tuple(i.name for i in tensor_inputs(node))
        return found

    def _value(self, node: fx.Node, plan: Plan, grads: Collection[fx.Node]) -> _Value:
        have = plan.layouts[node.name][0]
        value = _Value(have, node.op == "placeholder" or views_stored(node, plan), set(), set())
        name = node.name
        for user in node.users:
            strategy = plan.strategies.get(user.name)
            wants = (
                [have]
                if strategy is None
                else [w for i, w in zip(self._input_names(user), strategy.inputs) if i == name]
            )
            if is_backward(user):
                value.backward.update(wants)
            else:
                value.forward.update(wants)
                value.by_user[user.name] = wants
        if node in grads:
            value.backward.add(have)
        return value

    # ---- bytes and seconds ---------------------------------------------------------------------
    def kept_bytes(self, name: str, recompute: Collection[str], regather: Collection[str]) -> float:
        """Bytes per rank backward finds kept of one value, given what is recomputed / regathered."""
        if name in recompute or name in regather:
            return 0.0
        value = self.values.get(name)
        if value is None:
            return 0.0
        readers = [user for user in value.users if user in recompute]
        if not readers:  # (most calls: worked out once per value)
            plain = self._plain.get(name)
            if plain is None:
                plain = self._plain[name] = self._bytes_of(value, value.backward)
            return plain
        kept = self._kept(value, value.backward)
        for user in readers:  # a copy redistributes again what backward does not keep anyway
            kept.update(w if w in kept else value.have for w in value.by_user[user])
        return self._sum(value, kept)

    def _bytes_of(self, value: _Value, wants: Collection[Layout]) -> float:
        return self._sum(value, self._kept(value, wants))

    @staticmethod
    def _kept(value: _Value, wants: Collection[Layout]) -> set[Layout]:
        """The layouts `value` is kept in for backward's reads in `wants`: each one the forward has
        it in (a redistribution's result, reused), otherwise its own layout."""
        return {w if w in value.forward else value.have for w in wants}

    def _sum(self, value: _Value, kept: Collection[Layout]) -> float:
        return float(sum(lay.local_bytes(self.shape) for lay in kept if not (value.is_placeholder and lay == value.have)))

    def total_bytes(self, recompute: Collection[str] = (), regather: Collection[str] = ()) -> float:
        return sum(self.kept_bytes(n, recompute, regather) for n in self.values)

    def rematerialized(self, recompute: Collection[str], regather: Collection[str]) -> float:
        """Bytes per rank that recomputed values take again during backward: those of the group
        (block, region, or lone op) whose recomputed values are largest, each in the layouts
        backward reads it in. Backward remakes one group's values right before that group's
        backward and frees them after it, so one group's exist at a time."""
        groups: dict[str, float] = {}
        for name in recompute:
            if name in self.values:
                key = self.group.get(name, name)
                groups[key] = groups.get(key, 0.0) + self.kept_bytes(name, (), regather)
        return max(groups.values(), default=0.0)

    def marginal(
        self, nodes: Iterable[str], recompute: set[str], regather: Collection[str]
    ) -> tuple[float, float]:
        """(bytes freed, seconds added) by recomputing `nodes` on top of `recompute`."""
        new = [n for n in nodes if n not in recompute]
        new += [self.partner[n] for n in new if n in self.partner and self.partner[n] not in recompute and self.partner[n] not in new]
        if not new:
            return 0.0, 0.0
        after = recompute | set(new)
        touched = _touched(self, new)
        freed = sum(self.kept_bytes(n, recompute, regather) - self.kept_bytes(n, after, regather) for n in touched)
        return freed, self._seconds(new, after)

    def _seconds(self, new: Sequence[str], after: Collection[str]) -> float:
        """The ops' compute and the redistributions run again, summed exactly rounded (`fsum`):
        the terms come out of sets, whose order changes from one process to the next (layouts
        hash their dtype by identity), and a plain sum's last bits with it, which flipped the
        choice between identical blocks from run to run."""
        moved: set[tuple[str, Layout]] = set()  # redistributions between recomputed ops, run again
        for n in new:
            for src, want in self.inputs[n]:
                if src in after or self._redistributed_again(src, want):
                    moved.add((src, want))
            value = self.values.get(n)
            if value is None:  # a several-result op: its results are the getitems after it
                continue
            for user in value.users:
                if user in after and user not in new:
                    moved.update((n, w) for w in value.by_user[user])
            moved.update((n, w) for w in value.backward if w != value.have)  # backward's own layouts of it
        again = [self._redistribute(self.values[s].have, w) for s, w in moved]
        return math.fsum([*(self.seconds[n] for n in new), *again])


    def _redistributed_again(self, source: str, want: Layout) -> bool:
        """Whether a recomputed op's copy redistributes a kept input again (from the input's own
        layout, which is kept instead): where backward does not keep the forward's redistribution
        of it for its own reads (`autopar.passes.recompute`)."""
        value = self.values.get(source)
        return value is not None and want != value.have and not (want in value.backward and want in value.forward)


class RemadeBytes:
    """`RecomputeModel.rematerialized` kept up to date while a choice grows and shrinks its sets,
    rather than summed afresh over every recomputed op at each check: the choice checks the peak
    once per option it weighs, and at 96 layers that re-summing (thousands of recomputed ops,
    hundreds of checks, at every memory price the search tries) was most of a mesh's search.

    It holds the choice's own `recompute` and `regather` sets, which change only through `change`. A recomputed value's bytes made again do not depend on what else is
    recomputed (`kept_bytes` with nothing recomputed), only on whether it is regathered, so each
    group's sum moves by whole values; the bytes are integers, so the sums are exact in any order
    and equal `rematerialized` bit for bit (tested on random choices)."""

    def __init__(self, model: RecomputeModel, recompute: set[str], regather: set[str]) -> None:
        self.model, self.recompute, self.regather = model, recompute, regather
        self.sums: dict[str, float] = {}  # group -> bytes its recomputed values take again
        for name in recompute:
            self._add(name, self._bytes(name))

    def _bytes(self, name: str) -> float:
        if name not in self.recompute or name not in self.model.values:
            return 0.0
        return self.model.kept_bytes(name, (), self.regather)

    def _add(self, name: str, delta: float) -> None:
        if delta:
            key = self.model.group.get(name, name)
            self.sums[key] = self.sums.get(key, 0.0) + delta

    def change(self, target: set[str], names: Collection[str], add: bool = True) -> None:
        """Add `names` to `target` (`self.recompute` or `self.regather`), or take them out of it,
        and update the sums."""
        before = [self._bytes(n) for n in names]
        if add:
            target.update(names)
        else:
            target.difference_update(names)
        for name, old in zip(names, before):
            self._add(name, self._bytes(name) - old)

    def largest(self, without: Collection[str] = ()) -> float:
        """`model.rematerialized(recompute - without, regather)`. (A group whose values all left
        keeps a sum of 0 here, where `rematerialized` has no entry: no sum is negative, so the
        largest is the same.)"""
        if not without:
            return max(self.sums.values(), default=0.0)
        sums = dict(self.sums)
        for name in set(without):
            drop = self._bytes(name)
            if drop:
                key = self.model.group.get(name, name)
                sums[key] -= drop
        return max(sums.values(), default=0.0)


def choose_savings(
    model: RecomputeModel,
    param_bytes_total: Callable[[float], float],
    limit: float,
    regatherable: Sequence[SavedValue],
    regather_seconds: Callable[[SavedValue], float],
) -> Savings | None:
    """The cheapest (seconds per byte) regathers and recomputations that bring the plan's total
    `param_bytes_total(activation_bytes)` under `limit`, after the user's forced regions; None if
    everything together does not fit. Greedy with lazy re-evaluation: a unit's marginal bytes and
    seconds depend on what is chosen before it, so the best stale ratio is re-priced before it is
    taken."""
    recompute: set[str] = set()
    regather: set[str] = set()
    remade = RemadeBytes(model, recompute, regather)
    before = activation = model.total_bytes()
    forced = 0.0
    chosen: list[str] = []
    for unit in (u for u in model.units if u.forced):
        freed, extra = model.marginal(unit.nodes, recompute, regather)
        remade.change(recompute, unit.nodes)
        activation -= freed
        forced += extra
        chosen.append(unit.name)
    options: dict[str, tuple[frozenset[str], SavedValue | None]] = {
        u.name: (u.nodes, None) for u in model.units if not u.forced
    }
    options.update({f"regather:{s.name}": (frozenset((s.name,)), s) for s in regatherable})

    def price(key: str) -> tuple[float, float]:
        nodes, saved = options[key]
        if saved is None:
            return model.marginal(nodes, recompute, regather)
        name = saved.name
        return model.kept_bytes(name, recompute, regather), regather_seconds(saved)

    def peak(activation_bytes: float, without: Collection[str] = ()) -> float:
        """The total with `activation_bytes` kept and the largest recomputed group made again
        (`without` those ops recomputed)."""
        return param_bytes_total(activation_bytes + remade.largest(without))

    heap: list[tuple[float, str]] = []
    if peak(activation) > limit:
        for key in options:
            freed, extra = price(key)
            if freed > 0:
                heapq.heappush(heap, (extra / freed, key))
    taken: list[tuple[str, float]] = []  # option, seconds it added
    while heap and peak(activation) > limit:
        _, key = heapq.heappop(heap)
        freed, extra = price(key)
        if freed <= 0:
            continue
        ratio = extra / freed
        if heap and ratio > heap[0][0] * (1 + 1e-9):
            heapq.heappush(heap, (ratio, key))  # stale: someone else is cheaper now
            continue
        nodes, saved = options[key]
        remade.change(regather if saved is not None else recompute, nodes)
        activation -= freed
        taken.append((key, extra))
    if peak(activation) > limit:
        return None
    for key, extra in sorted(taken, key=lambda t: (-t[1], t[0])):  # drop what is no longer needed
        nodes, saved = options[key]
        target = regather if saved is not None else recompute
        without = target - nodes
        trial = (without, regather) if saved is None else (recompute, without)
        loss = sum(
            model.kept_bytes(n, *trial) - model.kept_bytes(n, recompute, regather)
            for n in _touched(model, nodes)
        )
        if peak(activation + loss, nodes if saved is None else ()) <= limit:
            remade.change(target, nodes, add=False)
            activation += loss
            taken.remove((key, extra))
    chosen += [key for key, _ in taken if not key.startswith("regather:")]
    recomputing = forced + sum(extra for key, extra in taken if not key.startswith("regather:"))
    regathering = sum(extra for key, extra in taken if key.startswith("regather:"))
    return Savings(
        tuple(sorted(regather)),
        tuple(sorted(recompute)),
        tuple(chosen),
        activation + remade.largest(),
        before,
        recomputing + regathering,
        recomputing,
    )


def has_checkpoint_regions(gm: fx.GraphModule) -> bool:
    """Whether the trace marked any op as inside a user's `torch.utils.checkpoint` region."""
    return any(_region_of(n) is not None for n in gm.graph.nodes)


def _touched(model: RecomputeModel, nodes: Iterable[str]) -> set[str]:
    touched = set(nodes)
    for n in list(touched):
        touched.update(i for i, _ in model.inputs.get(n, ()))
    return touched


def _region_of(node: fx.Node) -> str | None:
    return info(node).checkpoint if has_info(node) else None


def _expensive(node: fx.Node) -> bool:
    """Matmuls, convolutions, attention: ops worth keeping the output of (torch's selective
    checkpointing keeps the same)."""
    return getattr(node.target, "overloadpacket", None) in flop_registry or "scaled_dot_product" in str(node.target)


def _tuple_source(node: fx.Node) -> fx.Node | None:
    """The several-result op a getitem reads, if `node` is one."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _draws(node: fx.Node, target: torch._ops.OpOverload) -> bool:
    """Whether a random-tagged op draws numbers here: attention is tagged for its dropout, which
    draws nothing at `dropout_p=0`."""
    for position, argument in enumerate(target._schema.arguments):
        if argument.name == "dropout_p":
            value = node.kwargs.get("dropout_p", node.args[position] if position < len(node.args) else argument.default_value)
            return bool(value != 0)
    return True


def _recomputable(node: fx.Node, decided: Collection[str], ops: Collection[str]) -> bool:
    """A forward op backward may run again: an ATen op without side effects or randomness (or a
    getitem of one, `ops`: those found so far), and not a weight chain (those are regathered,
    `planning.memory`)."""
    target = node.target
    source = _tuple_source(node)
    if source is not None:
        return source.name in ops
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or (torch.Tag.nondeterministic_seeded in target.tags and _draws(node, target)):
        return False
    return weight_chain(node, decided) is None


def compute_seconds(
    cost: ElementCost, mesh_shape: Sequence[int], plan: Plan, facts: GraphFacts | None = None
) -> Callable[[fx.Node], float]:
    """An op's modeled compute on this plan's layouts (as `plan_cost` prices it). `facts`: the
    graph's `GraphFacts`, whose work and rate per call are read instead of worked out again (the
    search fits many plans of one graph)."""
    shape = tuple(mesh_shape)
    known = {name: (work, rate) for name, _, work, rate, _ in facts.calls} if facts is not None else {}
    splits: dict[Strategy, int] = {}

    def seconds(node: fx.Node) -> float:
        strategy = plan.strategies.get(node.name)
        if strategy is None:
            return 0.0
        split = splits.get(strategy)
        if split is None:
            split = splits[strategy] = work_split(strategy, shape)
        work, rate = known.get(node.name) or (global_work(node), compute_rate(node))
        return float(cost.compute(work, split, rate))

    return seconds
