"""The all-to-all token dispatcher (`autopar.rules.token_dispatch`) against the serial MoE layer:
each thread rank dispatches its own tokens, multiplies the rows its experts received, and combines
the results back. Outputs and the gradients of the tokens, the experts' weights and the router's
weights equal serial for random routings, imbalanced ones (one expert gets nearly every token),
starved ones (an expert gets none) and ranks without tokens. One test runs it on gloo ranks."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from multirank import run_ranks

from autopar.core.errors import AutoparError
from autopar.cost.dispatch import dispatch_cost
from autopar.cost.hardware import Link
from autopar.rules import token_dispatch
from autopar.testing.threads import ThreadExchange, run_threads

HIDDEN, OUT = 4, 3


def _routing(tokens: int, experts: int, top_k: int, mode: str, seed: int) -> torch.Tensor:
    """(tokens, top_k) distinct experts per token: uniform, "hot" (expert 0 chosen first by nine
    tokens in ten), or "cold" (the last expert never chosen)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(tokens):
        pool = list(range(experts - 1 if mode == "cold" else experts))
        order = [pool[i] for i in torch.randperm(len(pool), generator=gen).tolist()]
        if mode == "hot" and float(torch.rand((), generator=gen)) < 0.9:
            order.remove(0)
            order.insert(0, 0)
        rows.append(order[:top_k])
    return torch.tensor(rows, dtype=torch.long).reshape(tokens, top_k)


def _serial(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each token's k experts' results, weighted and summed, expert by expert."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] = out[t] + weights[t, j] * (x[t] @ w[ids[t, j]])
    return out


def _experts(rows: torch.Tensor, offs: torch.Tensor, w_local: torch.Tensor) -> torch.Tensor:
    """A grouped matmul: local expert j multiplies rows offs[j-1]..offs[j]."""
    ends = [0, *offs.tolist()]
    pieces = [rows[ends[j] : ends[j + 1]] @ w_local[j] for j in range(w_local.shape[0])]
    return torch.cat(pieces) if pieces else rows.new_zeros(0, w_local.shape[2])


def _case(ranks: int, local: int, top_k: int, tokens: list[int], mode: str, seed: int) -> None:
    experts = ranks * local
    gen = torch.Generator().manual_seed(seed)
    total = sum(tokens)
    x = torch.randn(total, HIDDEN, generator=gen, dtype=torch.float64)
    ids = _routing(total, experts, top_k, mode, seed)
    weights = torch.rand(total, top_k, generator=gen, dtype=torch.float64)
    w = torch.randn(experts, HIDDEN, OUT, generator=gen, dtype=torch.float64)
    grad = torch.randn(total, OUT, generator=gen, dtype=torch.float64)
    serial = [t.clone().requires_grad_() for t in (x, weights, w)]
    want = _serial(serial[0], ids, serial[1], serial[2])
    (want * grad).sum().backward()
    starts = [sum(tokens[:r]) for r in range(ranks + 1)]

    def rank(r: int, exchange: token_dispatch.Exchange) -> tuple[torch.Tensor, ...]:
        mine = slice(starts[r], starts[r + 1])
        x_r = x[mine].clone().requires_grad_()
        weights_r = weights[mine].clone().requires_grad_()
        w_r = w[r * local : (r + 1) * local].clone().requires_grad_()
        route = token_dispatch.dispatch(x_r, ids[mine], experts, exchange)
        assert sum(route.tokens_per_expert) == route.rows.shape[0]
        out = token_dispatch.combine(_experts(route.rows, route.offs, w_r), route, weights_r, exchange)
        (out * grad[mine]).sum().backward()
        assert x_r.grad is not None and weights_r.grad is not None and w_r.grad is not None
        return out.detach(), x_r.grad, weights_r.grad, w_r.grad, torch.tensor(route.recv_splits)

    got = run_threads(ranks, rank)
    close = {"atol": 1e-10, "rtol": 1e-10}
    torch.testing.assert_close(torch.cat([g[0] for g in got]), want.detach(), **close)
    torch.testing.assert_close(torch.cat([g[1] for g in got]), serial[0].grad, **close)
    torch.testing.assert_close(torch.cat([g[2] for g in got]), serial[1].grad, **close)
    torch.testing.assert_close(torch.cat([g[3] for g in got]), serial[2].grad, **close)
    # only routed rows move: rank r receives exactly the pairs routed to its experts
    for r, g in enumerate(got):
        owned = ((ids >= r * local) & (ids < (r + 1) * local)).sum()
        assert int(g[4].sum()) == int(owned)


@settings(max_examples=25, deadline=None)
@given(
    ranks=st.sampled_from([2, 4]),
    local=st.sampled_from([1, 2]),
    top_k=st.sampled_from([1, 2]),
    tokens=st.lists(st.integers(0, 6), min_size=4, max_size=4),
    mode=st.sampled_from(["uniform", "hot", "cold"]),
    seed=st.integers(0, 2**16),
)
def test_dispatch_and_combine_equal_serial(
    ranks: int, local: int, top_k: int, tokens: list[int], mode: str, seed: int
) -> None:
    assume(sum(tokens[:ranks]) > 0 and (mode != "cold" or ranks * local > top_k))
    _case(ranks, local, top_k, tokens[:ranks], mode, seed)


def test_one_expert_gets_every_token_and_another_none() -> None:
    """Every token's first choice is expert 0 (rank 0's): rank 0 receives every token once, the
    last expert receives nothing, and the numbers still equal serial."""
    _case(4, 2, 2, [5, 0, 3, 4], "hot", seed=3)
    _case(2, 2, 1, [6, 6], "cold", seed=5)


def test_uneven_expert_split_is_refused_with_a_hint() -> None:
    def body(r: int, exchange: token_dispatch.Exchange) -> None:
        token_dispatch.dispatch(torch.zeros(2, HIDDEN), torch.zeros(2, 1, dtype=torch.long), 3, exchange)

    with pytest.raises(AutoparError, match="do not split evenly"):
        run_threads(2, body)


def _gloo_body(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    tokens, local, top_k = 5, 2, 2
    experts = world * local
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(world * tokens, HIDDEN, generator=gen, dtype=torch.float64)
    ids = _routing(world * tokens, experts, top_k, "hot", 1)
    weights = torch.rand(world * tokens, top_k, generator=gen, dtype=torch.float64)
    w = torch.randn(experts, HIDDEN, OUT, generator=gen, dtype=torch.float64)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    x_r = x[mine].clone().requires_grad_()
    w_r = w[rank * local : (rank + 1) * local].clone().requires_grad_()
    exchange = token_dispatch.GroupExchange(dist.group.WORLD)
    route = token_dispatch.dispatch(x_r, ids[mine], experts, exchange)
    out = token_dispatch.combine(_experts(route.rows, route.offs, w_r), route, weights[mine], exchange)
    out.sum().backward()
    serial_x, serial_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = _serial(serial_x, ids, weights, serial_w)
    want.sum().backward()
    assert x_r.grad is not None and w_r.grad is not None and serial_x.grad is not None and serial_w.grad is not None
    return [
        float((out - want[mine]).abs().max()),
        float((x_r.grad - serial_x.grad[mine]).abs().max()),
        float((w_r.grad - serial_w.grad[rank * local : (rank + 1) * local]).abs().max()),
    ]


@pytest.mark.multirank
def test_dispatch_on_gloo_ranks_equals_serial() -> None:
    """The same exchange on 4 gloo processes (`GroupExchange`: counts, then rows, with split sizes)."""
    for errors in run_ranks(4, _gloo_body):
        assert max(errors) < 1e-10, errors


def test_modeled_bytes_are_the_rows_the_dispatcher_sends() -> None:
    """`autopar.cost.dispatch` prices the all-to-all dispatcher by the rows that leave a rank:
    with each rank's pairs spread evenly over the experts, the rows each rank sends to others
    (counted from the dispatch's split sizes) times 4 exchanges (dispatch, combine, and both
    again in backward) are its modeled bytes, less the counts; the all-gather dispatcher's token
    collectives send ep/k times as much."""
    ranks, local, top_k, tokens = 4, 2, 2, 8
    experts = ranks * local
    link = Link(alpha=1e-5, bandwidth=1e10)
    # token i of every rank chooses experts i and i+1 (mod E): every expert gets `tokens*top_k/E` rows
    ids = torch.tensor([[i % experts, (i + 1) % experts] for i in range(tokens)])

    def rank(r: int, exchange: token_dispatch.Exchange) -> int:
        route = token_dispatch.dispatch(torch.randn(tokens, HIDDEN), ids, experts, exchange)
        return sum(n for d, n in enumerate(route.send_splits) if d != r)

    sent_rows = run_threads(ranks, rank)
    assert len(set(sent_rows)) == 1 and sent_rows[0] == tokens * top_k * (ranks - 1) // ranks
    a2a = dispatch_cost("all_to_all", tokens, HIDDEN, top_k, experts, ranks, link)
    counts = (ranks - 1) / ranks * experts * 8
    assert a2a.bytes_sent - counts == pytest.approx(4 * sent_rows[0] * HIDDEN * 4)
    assert a2a.collectives == ("all_to_all",) * 5
    gather = dispatch_cost("all_gather", tokens, HIDDEN, top_k, experts, ranks, link)
    routing = (ranks - 1) * tokens * top_k * 8
    assert (a2a.bytes_sent - counts) / (gather.bytes_sent - routing) == pytest.approx(top_k / ranks)
    # the busiest rank receiving twice the mean doubles the rows' time, not the counts'
    skewed = dispatch_cost("all_to_all", tokens, HIDDEN, top_k, experts, ranks, link, imbalance=2.0)
    assert skewed.seconds > a2a.seconds
    with pytest.raises(AutoparError, match="no token dispatcher"):
        dispatch_cost("ring", tokens, HIDDEN, top_k, experts, ranks, link)


def test_an_exchange_over_three_axes_moves_each_row_across_each_axis_it_must_cross_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`token_dispatch.axes_exchange` over (2, 2, 2) (thread ranks, one group per axis): every rank
    receives the rows sent to it in source order, and along each axis the ranks send off-rank
    exactly the rows whose source and destination differ on that axis, so each row crosses each
    axis once where it must and never otherwise (what `routed_exchange_cost` prices per axis).
    Rank 3 receives nothing, rank 5 sends nothing."""
    grid, ranks = (2, 2, 2), 8
    sends = torch.randint(0, 4, (ranks, ranks), generator=torch.Generator().manual_seed(0))  # [source, destination]
    sends[:, 3] = 0
    sends[5, :] = 0
    coords = [(r // 4, r // 2 % 2, r % 2) for r in range(ranks)]
    sent: dict[int, list[int]] = defaultdict(list)  # thread -> rows sent off-rank by each row exchange, in order
    original = ThreadExchange.all_to_all

    def counting(self, x, out_splits, in_splits):  # type: ignore[no-untyped-def]
        if x.ndim == 2:  # the rows (the relayed counts are 1-D)
            sent[threading.get_ident()].append(sum(in_splits) - in_splits[self.rank])
        return original(self, x, out_splits, in_splits)

    monkeypatch.setattr(ThreadExchange, "all_to_all", counting)

    def rows(source: int, destination: int) -> torch.Tensor:
        n = int(sends[source, destination])
        return torch.tensor([[source, destination, i] for i in range(n)], dtype=torch.float64).reshape(n, 3)

    def rank_call(rank: int, exchange: token_dispatch.Exchange) -> torch.Tensor:
        assert exchange.size == ranks and exchange.rank == rank
        out = torch.cat([rows(rank, d) for d in range(ranks)])
        return exchange.all_to_all(out, sends[:, rank].tolist(), sends[rank].tolist())

    got = run_threads(ranks, rank_call, grid=grid)
    for d in range(ranks):
        torch.testing.assert_close(got[d], torch.cat([rows(s, d) for s in range(ranks)]), atol=0, rtol=0)
    per_axis = [sum(counts[a] for counts in sent.values()) for a in range(3)]
    assert all(len(counts) == 3 for counts in sent.values()), sent  # along x, then y, then z
    crossing = [
        sum(int(sends[s, d]) for s in range(ranks) for d in range(ranks) if coords[s][a] != coords[d][a]) for a in range(3)
    ]
    assert per_axis == crossing, (per_axis, crossing)
