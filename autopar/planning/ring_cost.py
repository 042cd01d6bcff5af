"""What an op costs beyond its work divided over the ranks, which no redistribution between
layouts shows: ring attention's exchanges, the all-to-all token dispatcher's
(`routed_exchange_cost`, below), and the causal imbalance of a contiguous sequence split.

A ring-attention candidate (`rules.ring_attention`) takes its queries, keys and values split along
the sequence as its producers give them, so the edges into it cost nothing; its exchanges happen
inside the call. Every planner that prices a candidate's compute adds this to it: one exchange
moves a rank's key/value block to the next rank, which costs what one of the p-1 steps of a ring
all-gather of the keys and values costs (`cost.redistribute(S(seq) -> R) / (p-1)`), and each
overlaps one block's computation (the call's work on the rank, over p blocks), so only the excess
shows (`ring_attention.exposed_exchange_seconds`).

A causal call's work is its lower triangle (`cost.work.causal_fraction`); split contiguously along
the sequence over p ranks, the last rank's queries see the most keys: it does (2p-1)/p of the mean
share (`rules.context_parallel.contiguous_causal_imbalance`), and the step waits for it.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from autopar.core.layout import Layout, R, Shard
from autopar.core.strategy import Strategy
from autopar.cost.dispatch import PLANNED_EXCHANGES
from autopar.cost.hardware import Rate
from autopar.cost.work import work_split
from autopar.rules.context_parallel import SEQ, contiguous_causal_imbalance
from autopar.rules.ring_attention import BACKWARD, FORWARD, exposed_exchange_seconds, key_index, ring_axis
from autopar.rules.routed_experts import ROUTED_EXPERTS_BACKWARD, all_to_all_axis, tokens_index


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


def routed_exchange_cost(op: Any, strategy: Strategy, cost: _Cost) -> float:
    """What an all-to-all token dispatcher candidate (`rules.routed_experts`) exchanges inside the
    op, priced as the all-to-alls they are: the counts (E numbers per rank), then each row
    exchange of `cost.dispatch.PLANNED_EXCHANGES` as a balanced all-to-all of the rank's routed
    pairs (t·k rows of that width over the axis: the routing spread evenly, as
    `cost.dispatch.dispatch_cost` prices it). 0 for every other candidate. Nothing overlaps
    them: the experts' matmuls wait for their rows."""
    axis = all_to_all_axis(op, strategy)
    if axis is None:
        return 0.0
    at = tokens_index(op)
    x, ids, experts = strategy.inputs[at], strategy.inputs[at + 1], strategy.inputs[at + 3]
    ranks = cost.shape[axis]
    counts = Layout(
        tuple(Shard(0) if a == axis else R for a in range(len(cost.shape))),
        (ranks, experts.shape[0]),
        torch.int64,
    )
    total = cost.redistribute(counts, counts.with_placement(axis, Shard(1)))
    rows = x.shape[0] * ids.shape[1]
    for width in PLANNED_EXCHANGES["backward" if op == ROUTED_EXPERTS_BACKWARD else "forward"]:
        pairs = Layout(x.placements, (rows, width * x.shape[1]), x.dtype)
        total += cost.redistribute(pairs, pairs.with_placement(axis, Shard(1)))
    return total


def causal_imbalance_cost(op: Any, causal: bool, strategy: Strategy, work: float, rate: Rate, cost: _Cost) -> float:
    """What the busiest rank of a causal call split contiguously along the query sequence adds to
    the even share the compute price gives every rank: (imbalance - 1) of that share, over the
    ranks of every axis that splits the queries' sequence (0 for every other call)."""
    if not causal or op not in (FORWARD, BACKWARD):
        return 0.0
    query = strategy.inputs[1 if op == BACKWARD else 0]
    p = math.prod(cost.shape[a] for a in query.shard_axes(SEQ))
    if p <= 1:
        return 0.0
    share = cost.compute(work, work_split(strategy, cost.shape), rate)
    return share * (contiguous_causal_imbalance(p) - 1.0)
