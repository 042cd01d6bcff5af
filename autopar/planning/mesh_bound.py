"""A lower bound on the screen's estimate of one candidate mesh, cheap enough to compute for every
mesh first, so that the screen (`mesh_screen.screen`) visits meshes from the lowest bound up and
stops once the next bound exceeds the estimate it would have to beat (branch and bound).

The screen's estimate of a mesh is the cheapest `plan_cost` of its seeds: the greedy pass with the
mesh's default axis roles, and the fixed schemes' plans that lay out on it. `bound` never exceeds
that estimate, by two terms, each a part of every seed's `plan_cost`:

- **Compute**: every op at the cheapest split the mesh allows. A strategy splits an op's work over
  a product of axis sizes, which divides the world size p, so an op costs at least the least
  `cost.compute(work, s)` over the divisors s of p (on a spec-sheet table: s = p, the ideal split).
- **Tensor axes of paired linears** (`fixed.pair_linears`: q/k/v -> out projection, MLP up ->
  down). Let axis k split the weight of both forward products of a pair A -> B (on the greedy seed:
  a tensor axis, whose role filter forces each weight-consuming product to split its weight when
  a candidate can; on a fixed seed: an axis whose letters are k or n for both linears). On k, A
  either contracts over k (its output is a pending sum) or splits its output features (its input
  is whole on k); so does B. A pending sum must be reduced, on k, before the non-linear op that
  reads it; an output split on k read whole on k must be gathered on k. So A's pending output is
  reduced on a value between A and B; or A and B both split outputs, and B's whole input is
  gathered between them; or B's pending output is reduced between B and the next pair's input.
  Each case is a collective on axis k of a value of that stretch of the forward graph, and such a
  collective sends at least (a_k - 1) / p of the value's elements per rank (the value's block on k
  is at least its size times a_k / p; an all-gather or reduce-scatter sends (a_k - 1) / a_k of
  it, an all-reduce twice that) over axis k's link, with at least a_k - 1 latency steps and the
  link's own call time. The stretches of different pairs do not overlap, and a redistribution's
  steps each run on one axis, so the terms add up. A pending sum or a split on k cannot turn
  whole on k without a collective on k, so the collective is on every path of the stretch: on the
  widest one, it moves at least that path's narrowest value (`_bottleneck`).

Backward collectives, weight gathers and gradient reductions are left out (they only add to a
seed's cost). `tests/test_mesh_bound.py` checks the bound
against every mesh's full estimate on spaces small enough to screen exhaustively.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.cost.hardware import Rate
from autopar.planning.fixed import SEED_SCHEMES, Linear, find_linears, pair_linears, scheme_variants
from autopar.planning.greedy_roles import axis_roles
from autopar.planning.plan_cost import GraphFacts
from autopar.planning.search_cost import ElementCost, TimeCost
from autopar.rules.routed_experts import ROUTED_OPS


@dataclass(frozen=True)
class PairSpan:
    """One pair of linears and the bytes a collective must move at least somewhere on the forward
    graph between its first linears' outputs and its second's input (`between`), and between its
    second's output and the next pair's first input (`after`; 0: no next pair, nothing claimed):
    the widest path's narrowest value (`_bottleneck`)."""

    firsts: tuple[Linear, ...]
    second: Linear
    between: float
    after: float

    @property
    def bytes(self) -> float:
        return min(self.between, self.after)


@dataclass(frozen=True)
class BoundFacts:
    """What the bound reads of the graph, the same for every mesh: the ops' (work, rate, count)
    and the spans of the paired linears."""

    work: tuple[tuple[float, Rate, int], ...]
    pairs: tuple[PairSpan, ...]

    @staticmethod
    def of(gm: fx.GraphModule, facts: GraphFacts) -> BoundFacts:
        counted: dict[tuple[float, Rate], int] = {}
        for _, _, amount, rate, _ in facts.calls:
            counted[(amount, rate)] = counted.get((amount, rate), 0) + 1
        return BoundFacts(tuple((w, r, n) for (w, r), n in counted.items()), _spans(gm))


class Bounds:
    """`bound(mesh, cost)` for the meshes of one screen: the compute term once per table and world
    size, the fixed schemes' variants once per world size."""

    def __init__(self, gm: fx.GraphModule, facts: GraphFacts) -> None:
        self.gm = gm
        self.facts = BoundFacts.of(gm, facts)
        # MoE layers traced as routed-experts ops: the screen's dispatcher seeds include layouts
        # with every axis a data axis (`search_seeds.dispatcher_seeds`), which split no weight
        self.routed = any(op in ROUTED_OPS for *_, op in facts.calls)
        self._compute: dict[tuple[str, int], float] = {}
        self._variants: dict[int, list[tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]]]] = {}

    def bound(self, mesh: Mesh, cost: ElementCost) -> float:
        """A lower bound on the screen's estimate of `mesh` priced by `cost` (module doc)."""
        p = mesh.size
        return self.compute(cost, p) + min(
            (self.comm(mesh, cost, axes) for axes in self.tensor_axes(mesh)), default=0.0
        )

    def compute(self, cost: ElementCost, p: int) -> float:
        name = cost.mesh.hw.name if isinstance(cost, TimeCost) else "elements"
        key = (name, p)
        found = self._compute.get(key)
        if found is None:
            splits = [s for s in range(1, p + 1) if p % s == 0]
            found = self._compute[key] = sum(
                n * min(cost.compute(w, s, rate) for s in splits) for w, rate, n in self.facts.work
            )
        return found

    def comm(self, mesh: Mesh, cost: ElementCost, axes: Sequence[int]) -> float:
        """The tensor-axis term for the axes that split both weights of every pair (module doc)."""
        if not isinstance(cost, TimeCost) or not axes:
            return 0.0
        p = mesh.size
        total = 0.0
        for pair in self.facts.pairs:
            for a in axes:
                link, g = cost.mesh.links[a], mesh.shape[a]
                total += (g - 1) / p * pair.bytes / link.bandwidth + (g - 1) * link.alpha + link.call
        return total

    def tensor_axes(self, mesh: Mesh) -> Iterable[tuple[int, ...]]:
        """Per seed of the screen, the axes that split the weights of both linears of every pair:
        the default roles' tensor axes where every paired linear can be split by them (else none
        are claimed), each fixed scheme variant's axes lettered k or n in both linears, and, for a
        graph with routed-experts ops, none: its dispatcher seeds laid out with every axis a data
        axis split no weight of a pair, so they claim no tensor-axis collective."""
        if self.routed:
            yield ()
        shape = tuple(mesh.shape)
        roles = axis_roles(mesh)
        tensor = tuple(a for a, r in enumerate(roles) if r == "tensor" and shape[a] > 1)
        tokens = math.prod(shape[a] for a, r in enumerate(roles) if r == "token")
        linears = [lin for pair in self.facts.pairs for lin in (*pair.firsts, pair.second)]
        every = all(_role_split(lin, tokens, [shape[a] for a in tensor]) for lin in linears)
        yield tensor if every else ()
        for variant_shape, first, second in self._scheme_variants(mesh.size):
            if variant_shape == tuple(g for g in shape if g > 1):
                sized = [a for a, g in enumerate(shape) if g > 1]
                yield tuple(a for a, x, y in zip(sized, first, second) if x in "kn" and y in "kn")

    def _scheme_variants(self, p: int) -> list[tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]]]:
        found = self._variants.get(p)
        if found is None:
            found = []
            for key in SEED_SCHEMES:
                try:
                    variants = scheme_variants(key, p, self.gm, require_heads=False)
                except AutoparError:
                    continue
                found.extend((v.mesh_shape, v.first, v.second) for v in variants)
            self._variants[p] = found
        return found


def _role_split(lin: Linear, tokens: int, tensor: Sequence[int]) -> bool:
    """Whether the tokens divide over the token axes and the tensor axes can split the weight
    (each axis one of its two dims, the sizes on a dim dividing it): the role filter then has a
    candidate and the weight is split on every tensor axis."""
    if lin.tokens % tokens:
        return False
    for dims in itertools.product((0, 1), repeat=len(tensor)):
        on_k = math.prod(g for g, d in zip(tensor, dims) if d == 0)
        on_n = math.prod(g for g, d in zip(tensor, dims) if d == 1)
        if lin.k % on_k == 0 and lin.n % on_n == 0:
            return True
    return False


def _spans(gm: fx.GraphModule) -> tuple[PairSpan, ...]:
    pairs = pair_linears(gm, find_linears(gm))
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for i, (firsts, second) in enumerate(pairs):
        between = _bottleneck([nodes[f.forward] for f in firsts], nodes[second.activation], order)
        after = 0.0
        if i + 1 < len(pairs):
            after = _bottleneck([nodes[second.forward]], nodes[pairs[i + 1][0][0].activation], order)
        out.append(PairSpan(tuple(firsts), second, between, after))
    return tuple(out)


def _bottleneck(starts: Sequence[fx.Node], end: fx.Node, order: dict[fx.Node, int]) -> float:
    """The most bytes b such that some path from one of `starts` to `end` (both included) has no
    value under b bytes: a collective on every path moves at least one whole value of that path,
    so one on the widest path moves at least b. A node of several outputs (a tuple) is passed
    through (its parts are the values). 0 when `end` is not reached."""
    low = min(order[s] for s in starts)
    up: set[fx.Node] = set()
    todo = [end]
    while todo:
        n = todo.pop()
        if n in up or order[n] < low:
            continue
        up.add(n)
        todo.extend(n.all_input_nodes)
    width: dict[fx.Node, float] = {}
    for n in sorted(up, key=order.__getitem__):
        if n in starts:
            reach = math.inf
        else:
            reach = max((width[m] for m in n.all_input_nodes if m in width), default=-1.0)
            if reach < 0:
                continue  # not reached from a start
        width[n] = min(reach, _bytes(n))
    found = width.get(end, 0.0)
    return found if math.isfinite(found) else 0.0


def _bytes(node: fx.Node) -> float:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return float(val.numel() * val.element_size())
    return math.inf
