"""What greedy passes share (`GreedyMemo`), and their scores of a whole candidate list at once.

A matmul-like op weighs every strategy `expand` gives it (hundreds on a 3-axis mesh), and repeated
layers and the plan search's many greedy passes ask about the same lists again with other input
layouts. Per list, what does not depend on the inputs (uneven blocks, work split, pending sums) is
kept once, and each input's wanted layouts are reduced to the distinct ones; a question then
prices each distinct (current, wanted) pair once and adds them up as arrays. Lists of a beam
(fresh per question) are scored the same way, without keeping their facts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.fx as fx

from autopar.core.layout import Layout, Replicate, RowDisjoint
from autopar.core.strategy import OpCall, Strategy
from autopar.planning.greedy_replay import Blocks, blocks_of


@dataclass(frozen=True)
class ListFacts:
    """Per candidate of one list: uneven layouts, work split, pending sums; per input, the
    distinct wanted layouts and each candidate's index into them."""

    candidates: list[Strategy]  # kept alive with its facts (the list's id keys them)
    uneven: np.ndarray
    split: np.ndarray
    pending: np.ndarray
    wants: tuple[tuple[tuple[Layout, ...], np.ndarray], ...]

    @staticmethod
    def of(candidates: list[Strategy], facts: Callable[[Strategy], tuple[int, int, float]]) -> ListFacts:
        per = [facts(s) for s in candidates]
        return ListFacts(
            candidates,
            np.array([u for u, _, _ in per], dtype=np.int64),
            np.array([float(s) for _, s, _ in per]),
            np.array([p for _, _, p in per]),
            _wants(candidates),
        )


@dataclass(frozen=True)
class ListShape:
    """What `ListFacts` needs of a candidate list that does not depend on the mesh's sizes, worked
    out once for every mesh with that list (the screen's meshes share lists: `ExpandCache`): the
    distinct layouts and, per candidate and tensor (inputs, then outputs), which one it is; per
    candidate the axes its work is split over (a bit each); the wanted inputs as in `ListFacts`."""

    candidates: list[Strategy]  # kept alive with its facts (the list's id keys them)
    layouts: tuple[Layout, ...]
    index: np.ndarray  # candidates x tensors -> position in `layouts`
    n_in: int
    split_axes: np.ndarray  # per candidate: bit a set where some output is not replicated on axis a
    carried: np.ndarray  # per candidate: `carried_axes`
    wants: tuple[tuple[tuple[Layout, ...], np.ndarray], ...]

    @staticmethod
    def of(candidates: list[Strategy]) -> ListShape:
        positions: dict[Layout, int] = {}
        rows = [
            [positions.setdefault(lay, len(positions)) for lay in (*s.inputs, *s.outputs)] for s in candidates
        ]
        n_in = len(candidates[0].inputs) if candidates else 0
        masks = [
            sum(
                1 << a
                for a in range(len(s.outputs[0].placements))
                if any(not isinstance(o.placements[a], Replicate) for o in s.outputs)
            )
            if s.outputs
            else 0
            for s in candidates
        ]
        index = np.array(rows, dtype=np.intp).reshape(len(candidates), -1)
        return ListShape(
            candidates,
            tuple(positions),
            index,
            n_in,
            np.array(masks, dtype=np.int64),
            np.array([carried_axes(s) for s in candidates], dtype=np.int64),
            _wants(candidates),
        )

    def facts(self, mesh_shape: tuple[int, ...]) -> ListFacts:
        """`ListFacts.of(candidates, greedy._strategy_facts on mesh_shape)`, number for number:
        each distinct layout is asked once, each distinct set of split axes multiplied once."""
        even = np.array([lay.is_even(mesh_shape) for lay in self.layouts], dtype=bool)
        uneven = (~even)[self.index].sum(axis=1, dtype=np.int64)
        masks, which = np.unique(self.split_axes, return_inverse=True)
        products = [math.prod(g for a, g in enumerate(mesh_shape) if int(m) >> a & 1) for m in masks]
        split = np.array([float(p) for p in products])[which.reshape(-1)]
        terms = [pending_terms(lay, mesh_shape) for lay in self.layouts]
        outputs = self.index[:, self.n_in :]
        pending = np.array(
            [
                _summed([t for k in row for bit, t in terms[k] if not bit & carried])
                for row, carried in zip(outputs.tolist(), self.carried.tolist())
            ]
        )
        return ListFacts(self.candidates, uneven, split, pending.reshape(len(self.candidates)), self.wants)


def pending_terms(layout: Layout, mesh_shape: tuple[int, ...]) -> list[tuple[int, float]]:
    """The partial sums an output of this layout leaves pending, per partial axis: (the axis's
    bit where the sum is row-disjoint, else 0; elements)."""
    axes = layout.partial_axes()
    if not axes:
        return []
    n = layout.local_numel(mesh_shape)
    return [
        (1 << a if isinstance(layout.placements[a], RowDisjoint) else 0, (mesh_shape[a] - 1) / mesh_shape[a] * n)
        for a in axes
    ]


def carried_axes(strategy: Strategy) -> int:
    """Bit a set where some input is row-disjoint (D) on mesh axis a. A D output on such an axis
    carries its input's pending sum on (through the gate of an expert MLP to the down projection,
    which takes it as D), it does not start one: the grouped matmul that made it was charged for
    it. Charging it again at every op of the gate made the greedy pass reduce the up projection's
    rows before the gate, where no reduction is needed at all."""
    return sum(
        1 << a
        for a in range(len(strategy.inputs[0].placements) if strategy.inputs else 0)
        if any(isinstance(lay.placements[a], RowDisjoint) for lay in strategy.inputs)
    )


def pending_elements(strategy: Strategy, mesh_shape: tuple[int, ...]) -> float:
    """Elements of the pending sums a candidate starts (`pending_terms` of its outputs, less the
    row-disjoint sums it carries on: `carried_axes`), in `ListShape.facts`' order."""
    carried = carried_axes(strategy)
    return _summed(
        [t for out in strategy.outputs for bit, t in pending_terms(out, mesh_shape) if not bit & carried]
    )


def _summed(terms: Sequence[float]) -> float:
    total = 0.0
    for t in terms:
        total += t
    return total


def _wants(candidates: list[Strategy]) -> tuple[tuple[tuple[Layout, ...], np.ndarray], ...]:
    """Per input: the distinct wanted layouts and each candidate's index into them."""
    wants = []
    for j in range(len(candidates[0].inputs) if candidates else 0):
        keys: dict[Layout, int] = {}
        index = np.array([keys.setdefault(s.inputs[j], len(keys)) for s in candidates], dtype=np.intp)
        wants.append((tuple(keys), index))
    return tuple(wants)


@dataclass
class GreedyMemo:
    """What greedy passes over one graph and mesh can share (the plan search runs one per seed):
    answers keyed by the question (op call, input layouts, and the axis roles where
    `_role_filter` applies), and per node its tensor inputs and op call with its key."""

    choices: dict[Any, tuple[Strategy, str]] = field(default_factory=dict)
    inputs: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    calls: dict[fx.Node, tuple[OpCall, tuple[Any, ...]]] = field(default_factory=dict)
    # per node, the number of its (op, call key) in `numbers` (the answers' keys name it by that)
    questions: dict[fx.Node, int] = field(default_factory=dict)
    numbers: dict[Any, int] = field(default_factory=dict)
    # (op, call_key, per-axis options) -> the combined strategy, None if not admissible (`_beam`)
    combos: dict[Any, Strategy | None] = field(default_factory=dict)
    # the same, combined whether admissible or not: mesh-free, shared by the screen's meshes
    combined: dict[Any, Strategy] = field(default_factory=dict)
    lists: dict[int, ListFacts] = field(default_factory=dict)  # by id of an expanded list (kept in it)
    # by id of an expanded list: its mesh-free part, shared by the screen's meshes (`graph_memo`)
    shapes: dict[int, ListShape] = field(default_factory=dict)
    # the graph's copied blocks (`greedy_replay.blocks_of`), worked out for the first pass
    graph_blocks: tuple[fx.GraphModule, int, Blocks | None] | None = None
    replayed: int = 0  # runs of copied blocks replayed, not walked (`greedy._Greedy._walk`)

    def blocks(self, gm: fx.GraphModule) -> Blocks | None:
        found = self.graph_blocks
        if found is None or found[0] is not gm or found[1] != len(gm.graph.nodes):
            found = self.graph_blocks = (gm, len(gm.graph.nodes), blocks_of(gm))
        return found[2]


def scores(
    facts: ListFacts,
    current: Sequence[Layout | str],
    work: float,
    input_cost: Callable[[Layout | str, Layout], float],
    partial_weight: float,
    flop_weight: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(cost, slices) of every candidate: the inputs' redistributions, pending sums and the work
    per rank; slices count inputs that must be cut from what they are (a tie-break: keep
    inputs as they are)."""
    n = len(facts.candidates)
    comm = np.zeros(n)
    slices = np.zeros(n, dtype=np.int64)
    for have, (wants, index) in zip(current, facts.wants):
        comm = comm + np.array([input_cost(have, w) for w in wants])[index]
        if isinstance(have, Layout):
            slices += np.array([have != w for w in wants], dtype=np.int64)[index]
    return comm + partial_weight * facts.pending + flop_weight * work / facts.split, slices


def best(cost: np.ndarray, uneven: np.ndarray, slices: np.ndarray) -> int:
    """Index of the lowest (cost, uneven blocks, slices, enumeration order)."""
    return int(np.lexsort((np.arange(len(cost)), slices, uneven, cost))[0])
