"""The all-to-all token dispatcher of expert parallelism: each rank sends only the (token, expert)
pairs routed to other ranks' experts, with split sizes known only at run time, and gets the
experts' results back the same way.

The all-gather dispatcher (`autopar.rules.expert_parallel`) gives every rank every token and
reduces the (tokens, hidden) output: static shapes, but each rank receives (ep-1)/ep of all the
tokens whatever the routing. Here a rank receives only the rows routed to its own experts: with
top-k routing over E experts held E/ep per rank, about k/ep of its tokens' rows leave it (and as
many come back), which is what wins at large E (Megatron-Core's "alltoall" dispatcher).

Dropless, no capacity factor: the number of rows each rank sends to each other rank comes from the
routing, so the exchange runs in two steps:

1. counts: every rank counts its pairs per expert (E numbers) and one `all_to_all_single` of
   E/ep numbers per destination tells each rank how many rows it receives from each source for
   each of its experts;
2. rows: the pairs sorted by destination expert go out in one `all_to_all_single` with those input
   and output split sizes; the received rows are regrouped by local expert (source-major to
   expert-major) so that an expert's rows are contiguous, as a grouped matmul wants them.

`combine` undoes both moves (regroup, the all-to-all with the split sizes swapped, unsort) and sums
each token's k results weighted by the router. The all-to-all of rows is an autograd function whose
backward is the same exchange in the other direction, so gradients travel exactly as tokens did;
the permutations are ordinary indexing ops, differentiated by autograd.

The collective is behind `Exchange`, so the same code runs on a process group
(`GroupExchange`: gloo or NCCL) and in one process with a thread per rank
(`autopar.testing.threads.ThreadExchange`). It is a runtime library of its own; compiled plans
run the same scheme on (token, choice) pairs inside one op per MoE layer
(`autopar.rules.routed_experts`), see docs/expert-parallel.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from autopar.core.errors import AutoparError


class Exchange(Protocol):
    """One all-to-all with split sizes, among the ranks of one expert-parallel group."""

    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def all_to_all(self, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int]) -> torch.Tensor:
        """Rows `in_splits[d]` of `x` (in order) go to rank d; returns the rows received,
        `out_splits[s]` from rank s, in rank order."""
        ...


class GroupExchange:
    """`Exchange` on a torch.distributed process group (`torch.distributed.all_to_all_single`)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._size = dist.get_world_size(group)
        self._rank = dist.get_rank(group)

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    def all_to_all(self, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int]) -> torch.Tensor:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=self.group)
        return out


class TwoAxisExchange:
    """`Exchange` among the ranks of two mesh axes at once, made of one exchange along each: rank
    `outer.rank * inner.size + inner.rank`, the order in which two mesh axes split one dim (the
    earlier axis into outer blocks), so that rank r of it holds expert block r of a weight split
    over both axes. No process group spans the two axes: one all-to-all with split sizes runs as
    two, first along the outer axis (to each outer peer, every row bound for its column, with the
    counts per inner rank: `inner.size` numbers per peer), then along the inner one; each rank
    regroups the rows it relays, and the receiver puts them back in source order."""

    def __init__(self, outer: Exchange, inner: Exchange) -> None:
        self.outer = outer
        self.inner = inner

    @property
    def size(self) -> int:
        return self.outer.size * self.inner.size

    @property
    def rank(self) -> int:
        return self.outer.rank * self.inner.size + self.inner.rank

    def all_to_all(self, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int]) -> torch.Tensor:
        outer, inner = self.outer.size, self.inner.size
        sent = torch.tensor(list(in_splits), dtype=torch.int64).view(outer, inner)  # [to outer, to inner]
        # relayed[s, j]: rows from outer peer s (this inner rank) bound for inner rank j of this outer rank
        relayed = self.outer.all_to_all(sent.reshape(-1), [inner] * outer, [inner] * outer).view(outer, inner)
        rows = self.outer.all_to_all(x, relayed.sum(1).tolist(), sent.sum(1).tolist())  # by (s, j)
        got = torch.tensor(list(out_splits), dtype=torch.int64).view(outer, inner)  # [from outer, from inner]
        back = self.inner.all_to_all(rows[_expert_major(relayed)], got.sum(0).tolist(), relayed.sum(0).tolist())
        return back[_expert_major(got.T.contiguous())]  # (from inner, from outer) -> source order


def axes_exchange(exchanges: Sequence[Exchange]) -> Exchange:
    """One `Exchange` among the ranks of several mesh axes, one exchange per axis in mesh-axis
    order: `TwoAxisExchange`s nested from the last axis out, so that rank r of it holds expert
    block r of a weight split over all of them (the earlier axis outer, as a dim split by several
    axes is laid out). Over three axes (x, y, z) each row crosses x, then y, then z, at most once
    each, and each axis but the last relays the counts of the axes after it."""
    if not exchanges:
        raise AutoparError(
            "an exchange over no mesh axis",
            op="token_dispatch.axes_exchange",
            hint="name the exchange of at least one mesh axis",
        )
    combined = exchanges[-1]
    for outer in reversed(exchanges[:-1]):
        combined = TwoAxisExchange(outer, combined)
    return combined


class _AllToAll(torch.autograd.Function):
    """The row exchange; its backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], exchange: Exchange
    ) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.exchange = exchange
        return exchange.all_to_all(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return ctx.exchange.all_to_all(grad.contiguous(), in_splits, out_splits), None, None, None


def exchange_rows(
    x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], exchange: Exchange
) -> torch.Tensor:
    """Differentiable `Exchange.all_to_all`."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), exchange)


@dataclass(frozen=True)
class Dispatched:
    """What `dispatch` returns: the rows this rank's experts multiply and how to send them back.

    `rows` holds the received rows grouped by local expert (local expert j's rows are
    `tokens_per_expert[:j].sum()` onwards); `offs` their cumulative counts (a grouped matmul's
    `offs`). The rest is the route, for `combine`."""

    rows: torch.Tensor
    tokens_per_expert: tuple[int, ...]
    offs: torch.Tensor
    order: torch.Tensor  # the (token, choice) pairs in the order they were sent (sorted by expert)
    send_splits: tuple[int, ...]  # rows sent to each rank
    recv_splits: tuple[int, ...]  # rows received from each rank
    regroup: torch.Tensor  # received (source-major) row of each expert-major row
    tokens: int
    top_k: int


def experts_per_rank(num_experts: int, ranks: int) -> int:
    """E/ep: experts split in contiguous blocks, rank r holding r*E/ep .. (r+1)*E/ep - 1 (the
    blocks of a weight Shard(0) on the expert dim)."""
    if num_experts % ranks:
        raise AutoparError(
            f"{num_experts} experts do not split evenly over {ranks} ranks",
            op="token_dispatch.dispatch",
            hint="use an expert-parallel group whose size divides the number of experts",
        )
    return num_experts // ranks


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, exchange: Exchange) -> Dispatched:
    """Send this rank's tokens `x` (t, H), routed to `expert_ids` (t, k), to the ranks holding
    those experts; returns the rows this rank's experts must multiply.

    Each (token, choice) pair is one row: a token chosen by two experts of one rank goes there
    twice, as in the serial layer (and in Megatron-Core's dispatcher)."""
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise AutoparError(
            f"expert_ids of shape {tuple(expert_ids.shape)} do not route the {x.shape[0]} tokens of x",
            op="token_dispatch.dispatch",
            hint="pass the router's top-k expert indices, one row per token",
        )
    ranks = exchange.size
    local = experts_per_rank(num_experts, ranks)
    tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise AutoparError(
            f"an expert index outside 0..{num_experts - 1} in expert_ids",
            op="token_dispatch.dispatch",
            hint="the router's indices must name one of num_experts experts",
        )
    order = torch.argsort(flat, stable=True)  # by expert, hence by destination rank
    counts = torch.bincount(flat, minlength=num_experts)  # pairs per expert, sent by this rank
    received = exchange.all_to_all(counts, [local] * ranks, [local] * ranks).view(ranks, local)
    send_splits = tuple(int(c) for c in counts.view(ranks, local).sum(1).tolist())
    recv_splits = tuple(int(c) for c in received.sum(1).tolist())
    rows = exchange_rows(x[order // top_k], recv_splits, send_splits, exchange)
    regroup = _expert_major(received)
    per_expert = received.sum(0)
    return Dispatched(
        rows=rows[regroup],
        tokens_per_expert=tuple(int(c) for c in per_expert.tolist()),
        offs=torch.cumsum(per_expert, 0).to(torch.int32),
        order=order,
        send_splits=send_splits,
        recv_splits=recv_splits,
        regroup=regroup,
        tokens=tokens,
        top_k=top_k,
    )


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """For rows received source-major (source 0's rows for local experts 0, 1, ..., then source
    1's, ...: `counts[s, j]` of each), the source-major index of each row in expert-major order
    (expert 0's rows from sources 0, 1, ..., then expert 1's)."""
    ranks, local = counts.shape
    starts = torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)
    pieces = [
        torch.arange(int(starts[s * local + j]), int(starts[s * local + j] + counts[s, j]))
        for j in range(local)
        for s in range(ranks)
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def combine(expert_out: torch.Tensor, route: Dispatched, weights: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """The experts' results (`expert_out`, one row per row of `route.rows`) sent back to the
    tokens' ranks and summed per token with the router's `weights` (t, k): (t, H')."""
    if expert_out.shape[0] != route.rows.shape[0]:
        raise AutoparError(
            f"expert_out has {expert_out.shape[0]} rows, the dispatch delivered {route.rows.shape[0]}",
            op="token_dispatch.combine",
            hint="give combine one result row per dispatched row, in the dispatched order",
        )
    source_major = torch.empty_like(expert_out).index_copy(0, route.regroup, expert_out)
    back = exchange_rows(source_major, route.send_splits, route.recv_splits, exchange)
    pairs = torch.empty_like(back).index_copy(0, route.order, back)  # pair (token, choice) order
    pairs = pairs.view(route.tokens, route.top_k, back.shape[1])
    return (pairs * weights.unsqueeze(-1).to(pairs.dtype)).sum(1)

