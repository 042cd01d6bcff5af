"""What greedy passes share (`GreedyMemo`), and their scores of a whole candidate list at once.

A matmul-like op weighs every strategy `expand` gives it (hundreds on a 3-axis mesh), and repeated
layers and the plan search's many greedy passes ask about the same lists again with other input
layouts. Per list, what does not depend on the inputs (uneven blocks, work split, pending sums) is
kept once, and each input's wanted layouts are reduced to the distinct ones; a question then
prices each distinct (current, wanted) pair once and adds them up as arrays. Lists of a beam
(fresh per question) are scored the same way, without keeping their facts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.fx as fx

from autopar.core.layout import Layout
from autopar.core.strategy import OpCall, Strategy


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
        wants = []
        for j in range(len(candidates[0].inputs) if candidates else 0):
            keys: dict[Layout, int] = {}
            index = np.array([keys.setdefault(s.inputs[j], len(keys)) for s in candidates], dtype=np.intp)
            wants.append((tuple(keys), index))
        return ListFacts(
            candidates,
            np.array([u for u, _, _ in per], dtype=np.int64),
            np.array([float(s) for _, s, _ in per]),
            np.array([p for _, _, p in per]),
            tuple(wants),
        )


@dataclass
class GreedyMemo:
    """What greedy passes over one graph and mesh can share (the plan search runs one per seed):
    answers keyed by the question (op call, input layouts, and the axis roles where
    `_role_filter` applies), and per node its tensor inputs and op call with its key."""

    choices: dict[Any, tuple[Strategy, str]] = field(default_factory=dict)
    inputs: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    calls: dict[fx.Node, tuple[OpCall, tuple[Any, ...]]] = field(default_factory=dict)
    # (op, call_key, per-axis options) -> the combined strategy, None if not admissible (`_beam`)
    combos: dict[Any, Strategy | None] = field(default_factory=dict)
    lists: dict[int, ListFacts] = field(default_factory=dict)  # by id of an expanded list (kept in it)


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
