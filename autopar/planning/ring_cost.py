"""The price of ring attention's exchanges, which no redistribution between layouts shows.

A ring-attention candidate (`rules.ring_attention`) takes its queries, keys and values split along
the sequence as its producers give them, so the edges into it cost nothing; its exchanges happen
inside the call. Every planner that prices a candidate's compute adds this to it: one exchange
moves a rank's key/value block to the next rank, which costs what one of the p-1 steps of a ring
all-gather of the keys and values costs (`cost.redistribute(S(seq) -> R) / (p-1)`), and each
overlaps one block's computation (the call's work on the rank, over p blocks), so only the excess
shows (`ring_attention.exposed_exchange_seconds`).
"""

from __future__ import annotations

from typing import Any, Protocol

from autopar.core.layout import Layout, R
from autopar.core.strategy import Strategy
from autopar.cost.hardware import Rate
from autopar.cost.work import work_split
from autopar.rules.ring_attention import BACKWARD, exposed_exchange_seconds, key_index, ring_axis


class _Cost(Protocol):
    shape: tuple[int, ...]

    def redistribute(self, src: Layout, dst: Layout) -> float: ...

    def compute(self, work: float, split: int, rate: Rate = ...) -> float: ...


def ring_exchange_cost(op: Any, strategy: Strategy, work: float, rate: Rate, cost: _Cost) -> float:
    """What a candidate's ring exchanges add to its compute (0 for every other candidate)."""
    axis = ring_axis(op, strategy)
    if axis is None:
        return 0.0
    p = cost.shape[axis]
    at = key_index(op)
    k, v = strategy.inputs[at], strategy.inputs[at + 1]
    whole = cost.redistribute(k, k.with_placement(axis, R)) + cost.redistribute(v, v.with_placement(axis, R))
    block = cost.compute(work, work_split(strategy, cost.shape), rate) / p
    return exposed_exchange_seconds(op == BACKWARD, p, whole / (p - 1), block)
