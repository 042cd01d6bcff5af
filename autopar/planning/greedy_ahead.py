"""The greedy pass's look-ahead: a value's layout priced with its readers' way to what they need.

The greedy pass picks each op's strategy from its inputs' layouts alone, so it would take a
layout that is cheap to enter but that its readers must pay to leave. With the exchange-first
reduce-scatter (`redistribute.exchanges_ahead`), moving fc1's pending sum into a split over all
three axes of a cube costs what the all-reduce into fc2's input layout costs; the flop term then
favoured the wider split for gelu, and fc2, which takes its input split on two axes, gathered it
back (a quarter above the 3-D cube's closed form). So the best few candidates by their own cost,
one per distinct output layout, are ranked again with their readers' least move into a layout
each reader may take the value in.

Only readers that constrain that layout are looked at: a reader whose strategy is forced (the
fixed schemes), and an anchor reading a parameter, which takes its activation as its axis roles
allow (`_Greedy._role_filter`). Any other reader takes a value as it comes, or close to it, and
the cost of what it does next is its own choice's: one level of look-ahead, no more.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from autopar.core.layout import Layout
from autopar.core.strategy import Strategy
from autopar.rules.base import RuleRegistry

AHEAD_TOP = 8  # distinct output layouts of the best candidates ranked again with their readers
UNKNOWN = "unknown"  # an input of a reader that is not laid out yet (or is the value itself)
Price = Callable[[Layout, Layout], float]


@dataclass(frozen=True)
class ReaderNeed:
    """One reader of a value: the layouts it may take the value in."""

    wants: tuple[Layout, ...]

    def choice(self, have: Layout, price: Price) -> tuple[Layout, float]:
        """The layout the reader takes the value in when it arrives as `have`, and the move."""
        return min(((w, price(have, w)) for w in self.wants), key=lambda t: t[1])


def total_need(needs: Sequence[ReaderNeed], have: Layout, price: Price) -> float:
    """What the readers pay to take the value as `have`: insert_comm redistributes a value once
    per layout wanted, so readers taking it in one layout share one move."""
    moves = dict(r.choice(have, price) for r in needs)
    return sum(moves.values())


def rerank(
    order: Sequence[int], output: Callable[[int], Layout], needs: Sequence[ReaderNeed], price: Price, top: int = AHEAD_TOP
) -> list[tuple[int, float]]:
    """The first candidates of `order` (best first), one per distinct output layout, up to `top`,
    each with its readers' total need: (candidate, need). A later candidate with an output
    already seen costs more for the same readers, so it can never win."""
    seen: set[Layout] = set()
    out: list[tuple[int, float]] = []
    for i in order:
        layout = output(i)
        if layout in seen:
            continue
        seen.add(layout)
        out.append((i, total_need(needs, layout, price)))
        if len(out) == top:
            break
    return out


@dataclass
class Readers:
    """The constraining readers of a value, as the greedy pass sees them mid-way: `layouts`,
    `deferred` and `tangents` are the pass's own (read, never written); `wants` gives the layouts
    an anchor reader's axis roles let it take input `position` in, given its inputs now."""

    registry: RuleRegistry
    forced: Mapping[str, Strategy]
    layouts: Mapping[str, tuple[Layout, ...]]
    deferred: Mapping[fx.Node, str]
    tangents: set[fx.Node]
    tensor_inputs: Callable[[fx.Node], list[fx.Node]]
    question: Callable[[fx.Node], int]
    wants: Callable[[fx.Node, int, list[Layout | str]], tuple[Layout, ...]]
    roles: tuple[str, ...]

    def of(self, node: fx.Node) -> list[tuple[fx.Node, int]]:
        """(reader, which of its tensor inputs) for each reader of `node` that constrains how it
        takes it: a forced one, or an anchor that reads a parameter."""
        found = []
        for user in node.users:
            if user.op != "call_function" or user.target is operator.getitem:
                continue
            rule = self.registry.get(user.target)
            for j, i in enumerate(self.tensor_inputs(user)):
                if i is node and (
                    user.name in self.forced or rule is not None and rule.anchor and "param" in self.inputs(user, j)
                ):
                    found.append((user, j))
        return found

    def key(self, reader: fx.Node, position: int) -> tuple[Any, ...]:
        """What a reader's need depends on: its forced strategy, or its question, its inputs now
        and the axis roles."""
        if reader.name in self.forced:
            return (self.forced[reader.name], position)
        return (self.question(reader), position, tuple(self.inputs(reader, position)), self.roles)

    def needs(self, readers: Sequence[tuple[fx.Node, int]]) -> list[ReaderNeed]:
        out = []
        for reader, position in readers:
            strategy = self.forced.get(reader.name)
            wants = (strategy.inputs[position],) if strategy else self.wants(reader, position, self.inputs(reader, position))
            if wants:
                out.append(ReaderNeed(wants))
        return out

    def inputs(self, reader: fx.Node, position: int) -> list[Layout | str]:
        """A reader's inputs now, laying nothing out: a layout, a deferral kind, or UNKNOWN (the
        value itself, or not known yet)."""
        current: list[Layout | str] = []
        for k, i in enumerate(self.tensor_inputs(reader)):
            found = self.layouts.get(i.name)
            if k == position or i in self.tangents:
                current.append(UNKNOWN)
            elif found is not None:
                current.append(found[0])
            else:
                current.append(self.deferred.get(self._viewed(i), UNKNOWN))
        return current

    def _viewed(self, node: fx.Node) -> fx.Node:
        """The deferred value that a value not visited yet views (a weight's transpose, met after
        the activation its linear reads): back through one-input ops without an anchor rule."""
        while node not in self.deferred and node.name not in self.layouts and node.op == "call_function":
            inputs = self.tensor_inputs(node)
            rule = self.registry.get(node.target)
            if len(inputs) != 1 or rule is None or rule.anchor:
                break
            node = inputs[0]
        return node
