"""What an op costs beyond its work divided over the ranks, which no redistribution between
layouts shows: ring attention's exchanges, the all-to-all token dispatcher's
(`routed_exchange_cost`, below, which also charges an expert split for the routing's imbalance,
`cost.dispatch.ROUTING_IMBALANCE`), and the causal imbalance of a contiguous sequence split.

A ring-attention candidate (`rules.ring_attention`) takes its queries, keys and values split along
the sequence as its producers give them, so the edges into it cost nothing; its exchanges happen
inside the call. Every planner that prices a candidate's compute adds this to it: one exchange
moves a rank's keys and values (stacked, one message) to the next rank, priced as the emitted
`ring_shift` step (`cost.ring_shift`: on a hardware table its bytes over the link plus one
message's latency, which one block's computation hides up to its length, and the link's own time
on the rank, `Link.call`, which nothing hides: 1 ms a collective on cpu-gloo, where the ring's 2p
exchanges per layer are what made it slower than the all-gather measured; in element counts
every element of it, as every other collective's, with no overlap) and only what shows is added
(`ring_attention.exposed_exchange_seconds`).

A causal call's work is its lower triangle (`cost.work.causal_fraction`); split contiguously along
the sequence over p ranks, the last rank's queries see the most keys: it does (2p-1)/p of the mean
share (`rules.context_parallel.contiguous_causal_imbalance`), and the step waits for it.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from autopar.core.layout import Layout, R, Shard, is_balanced_sequence
from autopar.core.strategy import Strategy
from autopar.cost.dispatch import PLANNED_EXCHANGES, ROUTING_IMBALANCE
from autopar.cost.hardware import Rate
from autopar.cost.work import work_split
from autopar.rules.context_parallel import SEQ, contiguous_causal_imbalance
from autopar.rules.ring_attention import (
    BACKWARD,
    FORWARD,
    exchanged_block,
    exposed_exchange_seconds,
    key_index,
    ring_axis,
)
from autopar.rules.routed_experts import (
    ROUTED_EXPERTS_BACKWARD,
    ROUTED_OPS,
    all_to_all_axes,
    expert_axes,
    tokens_index,
)


class _Cost(Protocol):
    shape: tuple[int, ...]
    routing_imbalance: float | None

    def redistribute(self, src: Layout, dst: Layout) -> float: ...

    def compute(self, work: float, split: int, rate: Rate = ...) -> float: ...

    def ring_shift(self, block: Layout, axis: int) -> tuple[float, float]: ...


def ring_exchange_cost(op: Any, strategy: Strategy, work: float, rate: Rate, cost: _Cost) -> float:
    """What a candidate's ring exchanges add to its compute (0 for every other candidate): each
    exchange priced as the emitted one (`cost.ring_shift` of the stacked block `ring_graph` sends),
    its wire time hidden by one block's compute (the call's work on the rank, over p blocks) up to
    that block's length, its own time on the rank (gloo's) never."""
    axis = ring_axis(op, strategy)
    if axis is None:
        return 0.0
    p = cost.shape[axis]
    k = strategy.inputs[key_index(op)]
    pair = cost.ring_shift(exchanged_block(k, 2), axis)
    double = cost.ring_shift(exchanged_block(k, 4), axis) if op == BACKWARD else pair
    block = cost.compute(work, work_split(strategy, cost.shape), rate) / p
    return exposed_exchange_seconds(op == BACKWARD, p, pair, double, block)


def routed_exchange_cost(
    op: Any, strategy: Strategy, cost: _Cost, work: float, rate: Rate, imbalance: float | None = None
) -> float:
    """What a routed-experts candidate (`rules.routed_experts`) adds to its compute for the
    routing's imbalance and, with the all-to-all dispatcher, for the exchanges inside the op; 0
    for every other op and for candidates keeping every expert on every rank.

    - Imbalance: where the experts are split, every rank waits for the busiest one, whose experts
      receive that many times the mean rows: `cost.routing_imbalance` where the cost sets one,
      else `imbalance`, the model's figure the trace recorded on the node
      (`cost.dispatch.routing_imbalance`), else the auxiliary-loss figure
      `cost.dispatch.ROUTING_IMBALANCE`; the op's `work` on a rank is charged that many times its
      even share.
    - All-to-all: the counts (E numbers per rank), then each row exchange of
      `cost.dispatch.PLANNED_EXCHANGES` as an all-to-all of the rank's routed pairs (t·k rows of
      that width over the axis), its rows scaled by the imbalance: the exchange ends when the
      busiest rank has received its rows. Nothing overlaps them: the experts' matmuls wait for
      their rows. Over two or three mesh axes each exchange runs along each axis in turn, the
      earlier first (`token_dispatch.axes_exchange`): every one priced, with the counts each axis
      but the last relays first."""
    if op not in ROUTED_OPS or not expert_axes(op, strategy):
        return 0.0
    if cost.routing_imbalance is not None:
        imbalance = cost.routing_imbalance
    elif imbalance is None:
        imbalance = ROUTING_IMBALANCE
    total = (imbalance - 1.0) * cost.compute(work, work_split(strategy, cost.shape), rate)
    axes = all_to_all_axes(op, strategy)
    if not axes:
        return total
    at = tokens_index(op)
    x, ids, experts = strategy.inputs[at], strategy.inputs[at + 1], strategy.inputs[at + 3]
    # the busiest rank's rows: the pairs scaled, rounded up to a whole block per rank (an uneven
    # split would be priced as an all-gather instead)
    blocks = math.prod(cost.shape[a] for a in x.shard_axes(0))
    rows = math.ceil(x.shape[0] * ids.shape[1] * imbalance / blocks) * blocks
    widths = PLANNED_EXCHANGES["backward" if op == ROUTED_EXPERTS_BACKWARD else "forward"]
    for axis in axes:  # over several axes, the exchange runs along each in turn (`axes_exchange`)
        ranks = cost.shape[axis]
        counts = Layout(
            tuple(Shard(0) if a == axis else R for a in range(len(cost.shape))),
            (ranks, experts.shape[0]),
            torch.int64,
        )
        # the route's counts; over several axes, each exchange (the counts' and the rows') first relays
        # its counts along every axis but the last (priced as the route's: an upper bound on their bytes)
        relays = 1 + len(widths) if axis != axes[-1] else 0
        total += (1 + relays) * cost.redistribute(counts, counts.with_placement(axis, Shard(1)))
        for width in widths:
            pairs = Layout(x.placements, (rows, width * x.shape[1]), x.dtype)
            total += cost.redistribute(pairs, pairs.with_placement(axis, Shard(1)))
    return total


def op_extra_cost(
    op: Any, causal: bool, strategy: Strategy, work: float, rate: Rate, cost: _Cost, imbalance: float | None = None
) -> float:
    """What a candidate adds to its even share of the work (`cost.compute`) in every planner's
    price: ring attention's exposed exchanges, the token dispatcher's exchanges and routing
    imbalance, and a contiguous causal split's busiest rank. One sum, so that the search, the
    lowered plan's pricing, `plan_cost` and the screen's transplanted plans price alike.
    `imbalance`: a routed-experts node's own routing imbalance (`routed_experts.node_routing_imbalance`)."""
    return (
        ring_exchange_cost(op, strategy, work, rate, cost)
        + routed_exchange_cost(op, strategy, cost, work, rate, imbalance)
        + causal_imbalance_cost(op, causal, strategy, work, rate, cost)
    )


def causal_imbalance_cost(op: Any, causal: bool, strategy: Strategy, work: float, rate: Rate, cost: _Cost) -> float:
    """What the busiest rank of a causal call split contiguously along the query sequence adds to
    the even share the compute price gives every rank: (imbalance - 1) of that share, over the
    ranks of every axis that splits the queries' sequence (0 for every other call, and for the
    load-balanced order, where every rank has the same (2p+1)/(4p) of a full block of rows)."""
    if not causal or op not in (FORWARD, BACKWARD):
        return 0.0
    query = strategy.inputs[1 if op == BACKWARD else 0]
    if is_balanced_sequence(query):
        return 0.0
    p = math.prod(cost.shape[a] for a in query.shard_axes(SEQ))
    if p <= 1:
        return 0.0
    share = cost.compute(work, work_split(strategy, cost.shape), rate)
    return share * (contiguous_causal_imbalance(p) - 1.0)
