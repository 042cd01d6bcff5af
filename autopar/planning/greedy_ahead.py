"""The greedy pass's look-ahead: a value's layout priced with its readers' way to what they need.

The greedy pass picks each op's strategy from its inputs' layouts alone, so it would take a
layout that is cheap to enter but that its readers must pay to leave: with the exchange-first
reduce-scatter (`redistribute.exchanges_ahead`) moving fc1's pending sum into a split over all
three axes of a cube costs what the all-reduce into fc2's layout costs, the flop term then
favours the wider split, and fc2, which takes its input split on two axes, gathered it back (the
3-D cube's closed form exceeded by a quarter). So the best few candidates by their own cost, one
per distinct output layout, are ranked again with each reader's least cost of taking that output:
for each layout the reader may want the value in, the reader's other terms (its other inputs'
redistributions from where they are now, its pending sums and its work) at their least, plus the
move from the candidate's output into that layout. One level only: a reader's own readers are not
looked at, and a reader whose other inputs are not laid out yet prices them as free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autopar.core.layout import Layout
from autopar.planning.greedy_scores import ListFacts

AHEAD_TOP = 8  # distinct output layouts of the best candidates ranked again with their readers
UNKNOWN = "unknown"  # an input of a reader that is not laid out yet (or is the value itself)


@dataclass(frozen=True)
class ReaderNeed:
    """One reader of a value: the layouts it may take the value in and, per layout, the least
    cost of the rest of its choice (other inputs, pending sums, work) with the value so."""

    wants: tuple[Layout, ...]
    rest: np.ndarray

    def choice(self, have: Layout, price: Callable[[Layout, Layout], float]) -> tuple[Layout, float, float]:
        """The reader's least cost with the value arriving as `have`: (the layout it takes the
        value in, the move into it, the rest of its cost)."""
        moves = np.array([price(have, w) for w in self.wants])
        best = int(np.argmin(moves + self.rest))
        return self.wants[best], float(moves[best]), float(self.rest[best])


def total_need(needs: Sequence[ReaderNeed], have: Layout, price: Callable[[Layout, Layout], float]) -> float:
    """What the readers pay with the value as `have`: insert_comm redistributes a value once per
    layout wanted, so readers taking it in one layout share one move (a value read in forward
    and again in backward is not reduced twice)."""
    moves: dict[Layout, float] = {}
    rest = 0.0
    for reader in needs:
        want, move, other = reader.choice(have, price)
        moves[want] = move
        rest += other
    return rest + sum(moves.values())


def reader_need(facts: ListFacts, position: int, cost: np.ndarray, allowed: np.ndarray | None) -> ReaderNeed:
    """`ReaderNeed` from a reader's candidate list: `cost` per candidate without the value's own
    move (its input `position` priced as free), `allowed` the candidates it may choose (the axis
    roles of an anchor reading a parameter), None for all."""
    wants, index = facts.wants[position]
    rest = np.full(len(wants), np.inf)
    masked = cost if allowed is None else np.where(allowed, cost, np.inf)
    np.minimum.at(rest, index, masked)
    keep = np.isfinite(rest)
    return ReaderNeed(tuple(w for w, k in zip(wants, keep.tolist()) if k), rest[keep])


def rerank(
    order: Sequence[int],
    output: Callable[[int], Layout],
    needs: Sequence[ReaderNeed],
    price: Callable[[Layout, Layout], float],
    top: int = AHEAD_TOP,
) -> list[tuple[int, float]]:
    """The first candidates of `order` (best first), one per distinct output layout, up to `top`,
    each with its readers' total need: (candidate, need). Later candidates with an output already
    seen cost more for the same readers, so they can never win."""
    seen: dict[Layout, float] = {}
    out: list[tuple[int, float]] = []
    for i in order:
        layout = output(i)
        if layout in seen:
            continue
        seen[layout] = total_need(needs, layout, price)
        out.append((i, seen[layout]))
        if len(out) == top:
            break
    return out
