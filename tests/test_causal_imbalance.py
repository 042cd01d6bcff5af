"""The price of causal attention over a split sequence: a causal call's work is its lower triangle
(`cost.work.causal_fraction`: the kernels skip the tiles above the diagonal), and a contiguous
sequence split over p ranks leaves the last rank (2p-1)/p of the mean share
(`rules.context_parallel.contiguous_causal_imbalance`), which every planner adds
(`planning.ring_cost.causal_imbalance_cost`). Counted against the scores each rank's causal rows
really reach, against the kernel calls a rank's causal rows make, and checked on the candidates
of one attention call."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.core.layout import BalancedShard, Layout
from autopar.core.strategy import Strategy
from autopar.cost.work import causal_fraction, global_work, work_split
from autopar.planning.ring_cost import causal_imbalance_cost
from autopar.planning.search_cost import TimeCost
from autopar.rules import device_attention, ring_attention
from autopar.rules.base import expand, make_call
from autopar.rules.context_parallel import BACKWARD, FORWARD, contiguous_causal_imbalance
from autopar.rules.registry import default_registry


def _reached(seq: int, rows: range) -> int:
    """Scores a causal kernel computes for these query rows: row i reaches keys 0..i."""
    return sum(i + 1 for i in rows)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 16), n=st.integers(1, 64))
def test_the_busiest_rank_of_a_contiguous_split(p: int, n: int) -> None:
    """Counted: the last of p contiguous blocks of n queries reaches (2p-1)/p of the mean,
    up to the diagonal's own half row (within 1/n of it), never more."""
    seq = p * n
    per_rank = [_reached(seq, range(r * n, (r + 1) * n)) for r in range(p)]
    assert max(per_rank) == per_rank[-1]
    ratio = per_rank[-1] / (sum(per_rank) / p)
    assert ratio <= contiguous_causal_imbalance(p) + 1e-12
    assert ratio >= contiguous_causal_imbalance(p) * (1 - 1 / n) - 1e-12
    assert sum(per_rank) == pytest.approx(seq * seq * causal_fraction(seq))


def _attention_node(seq: int, causal: bool) -> fx.Node:
    graph = fx.Graph()
    q = torch.empty(1, 2, seq, 8, device="meta")
    inputs = []
    for name in "qkv":
        node = graph.placeholder(name)
        node.meta["val"] = q
        inputs.append(node)
    call = graph.call_function(FORWARD, (*inputs, 0.0, causal))
    call.meta["val"] = FORWARD(q, q, q, 0.0, causal)[:2]
    return call


def test_a_causal_call_is_priced_at_its_triangle() -> None:
    full = global_work(_attention_node(64, causal=False))
    assert global_work(_attention_node(64, causal=True)) == pytest.approx(full * 65 / 128)


@pytest.mark.parametrize(("shape", "split"), [((4,), 4), ((2, 4), 8)])
def test_only_a_causal_sequence_split_pays_the_imbalance(shape: tuple[int, ...], split: int) -> None:
    """Every candidate of a causal forward call on `shape`: those with the queries split along
    the sequence over `split` ranks in all pay (2p-1)/p - 1 of their share on top; batch and
    heads splits, and the same candidates of a call without the causal flag, pay nothing."""
    q = torch.empty(2, 8, 64, 16, device="meta")
    out, lse = FORWARD(q, q, q, 0.0, True)[:2]
    call = make_call(FORWARD, (q, q, q, 0.0, True), {}, (out, lse))
    cost = TimeCost("h100-nvlink-ib", shape)
    rule = default_registry().get(FORWARD)
    assert rule is not None
    work = 1e12
    seen = set()
    for strategy in expand(call, rule.strategies(call), shape, rule.uneven):
        extra = causal_imbalance_cost(FORWARD, True, strategy, work, torch.float32, cost)
        assert causal_imbalance_cost(FORWARD, False, strategy, work, torch.float32, cost) == 0.0
        axes = strategy.inputs[0].shard_axes(2)
        p = 1
        for a in axes:
            p *= shape[a]
        share = cost.compute(work, work_split(strategy, shape), torch.float32)
        assert extra == pytest.approx(share * (contiguous_causal_imbalance(p) - 1)), strategy
        assert (extra > 0) == bool(axes), strategy
        seen.add(p)
    assert split in seen and 1 in seen, "the candidates hold both a whole-mesh sequence split and none"


def test_the_load_balanced_order_pays_no_imbalance() -> None:
    """The same causal candidate with its queries in the load-balanced order (`BalancedShard`:
    every rank the same share of the triangle) pays nothing on top, where the contiguous one pays
    (2p-1)/p - 1 of its share."""
    q = torch.empty(2, 8, 64, 16, device="meta")
    out, lse = FORWARD(q, q, q, 0.0, True)[:2]
    call = make_call(FORWARD, (q, q, q, 0.0, True), {}, (out, lse))
    cost = TimeCost("h100-nvlink-ib", (4,))
    rule = default_registry().get(FORWARD)
    assert rule is not None
    contiguous = next(
        s
        for s in expand(call, rule.strategies(call), (4,), rule.uneven)
        if s.inputs[0].shard_axes(2) == (0,) and not s.inputs[1].shard_axes(2)
    )
    query = contiguous.inputs[0]
    balanced = Strategy(
        (Layout((BalancedShard(2),), query.shape, query.dtype), *contiguous.inputs[1:]), contiguous.outputs
    )
    assert causal_imbalance_cost(FORWARD, True, contiguous, 1e12, torch.float32, cost) > 0
    assert causal_imbalance_cost(FORWARD, True, balanced, 1e12, torch.float32, cost) == 0.0


class _KernelCalls(TorchDispatchMode):
    """Records each attention kernel call: (query rows, keys, causal flag, whether a mask was passed)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, bool, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in (FORWARD, BACKWARD):
            at, flag = (1, 7) if func == BACKWARD else (0, 4)
            q, k = args[at], args[at + 1]
            causal = bool(args[flag] if len(args) > flag else kwargs.get("is_causal", False))
            self.calls.append((q.shape[-2], k.shape[-2], causal, kwargs.get("attn_mask") is not None))
        return func(*args, **kwargs)


def _scores(calls: list[tuple[int, int, bool, bool]]) -> int:
    """Scores the kernel computes over these calls: a flagged call its (square) lower triangle."""
    return sum(rows * (rows + 1) // 2 if causal else rows * keys for rows, keys, causal, _ in calls)


@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 5), n=st.integers(1, 7), kv_heads=st.sampled_from([1, 2]), transposed=st.booleans())
def test_a_contiguous_causal_block_runs_the_kernels_flag_on_its_diagonal(
    p: int, n: int, kv_heads: int, transposed: bool
) -> None:
    """Every rank's causal rows (`device_attention.attention_forward` / `_backward` with a
    `row_offset`) equal the serial kernel's rows (output, logsumexp, every gradient summed over the
    ranks), and run the kernel with no mask: the keys before the block without the flag, the
    diagonal block with it. So the scores computed are exactly the block's rows of the triangle,
    what the price counts (`causal_fraction`, `contiguous_causal_imbalance`): the last rank's are
    (2p-1)/p of the mean, not a whole row block against every key before it."""
    seq, gen = p * n, torch.Generator().manual_seed(p * 100 + n * 10 + kv_heads)

    def rand(heads: int) -> torch.Tensor:
        if transposed:
            return torch.randn(2, seq, heads, 8, generator=gen, dtype=torch.float64).transpose(1, 2)
        return torch.randn(2, heads, seq, 8, generator=gen, dtype=torch.float64)

    q, k, v = rand(2), rand(kv_heads), rand(kv_heads)
    out, lse = FORWARD(q, k, v, 0.0, True)[:2]
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dq, dk, dv = BACKWARD(grad, q, k, v, out, lse, 0.0, True)
    dk_sum, dv_sum = torch.zeros_like(dk), torch.zeros_like(dv)
    for r in range(p):
        rows = slice(r * n, (r + 1) * n)
        with _KernelCalls() as forward:
            o, ls = device_attention.attention_forward(q[:, :, rows], k, v, 0.0, True, row_offset=r * n)
        torch.testing.assert_close(o, out[:, :, rows])
        torch.testing.assert_close(ls, lse[:, :, rows])
        with _KernelCalls() as backward:
            gq, gk, gv = device_attention.attention_backward(
                grad[:, :, rows], q[:, :, rows], k, v, o, ls, 0.0, True, row_offset=r * n
            )
        torch.testing.assert_close(gq, dq[:, :, rows])
        dk_sum, dv_sum = dk_sum + gk, dv_sum + gv
        for calls in (forward.calls, backward.calls):
            assert not any(masked for *_, masked in calls)
            assert [causal for *_, causal, _ in calls].count(True) == 1
            assert _scores(calls) == _reached(seq, range(r * n, (r + 1) * n))
    torch.testing.assert_close(dk_sum, dk)
    torch.testing.assert_close(dv_sum, dv)


def test_the_rings_diagonal_step_runs_the_kernels_flag() -> None:
    """The contiguous ring's step on the rank's own block (`ring_attention.block_forward`) runs the
    kernel with its causal flag and no mask; a block before the rank's runs without either."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    kv = torch.randn(2, 1, 2, 4, 8, dtype=torch.float64)
    with _KernelCalls() as own:
        ring_attention.block_forward(q, kv, None, ((4, 4),), ((4, 4),), True, None)
    with _KernelCalls() as before:
        ring_attention.block_forward(q, kv, None, ((4, 4),), ((0, 4),), True, None)
    assert own.calls == [(4, 4, True, False)]
    assert before.calls == [(4, 4, False, False)]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_balanced_rings_mirror_chunk_skips_its_hidden_half(p: int) -> None:
    """In the load-balanced order rank r holds chunks r and 2p-1-r (n rows each). Over its p ring
    steps, forward and backward, no kernel call takes a mask and the scores computed are exactly
    its rows' part of the causal triangle: on the diagonal step the mirror chunk runs against the
    front chunk without a mask and against its own chunk with the kernel's flag (before, one
    masked call against both computed the hidden half of its own chunk too). The output equals
    the serial kernel's rows."""
    n, seq = 3, 6 * p
    g = torch.Generator().manual_seed(p)
    q, k, v = (torch.randn(1, 2, seq, 4, generator=g, dtype=torch.float64) for _ in range(3))
    whole, _ = FORWARD(q, k, v, 0.0, True)
    for r in range(p):
        q_chunks = ((r * n, n), ((2 * p - 1 - r) * n, n))
        rows = [i for start, length in q_chunks for i in range(start, start + length)]
        q_local = q[:, :, rows]
        acc = None
        for forward in (True, False):
            with _KernelCalls() as kernels:
                for s in range(p):
                    j = (r - s) % p
                    k_chunks = ((j * n, n), ((2 * p - 1 - j) * n, n))
                    keys = [i for start, length in k_chunks for i in range(start, start + length)]
                    kv = torch.stack([k[:, :, keys], v[:, :, keys]])
                    if forward:
                        part = ring_attention.block_forward(q_local, kv, None, q_chunks, k_chunks, True, None)
                        acc = part if acc is None else ring_attention.merge_blocks(acc, part)
                    else:
                        assert acc is not None
                        out, lse = ring_attention.finish_forward(acc, q_local)
                        ring_attention.block_backward(out, q_local, kv, out, lse, None, q_chunks, k_chunks, True, None)
            assert not any(masked for *_, masked in kernels.calls)
            assert _scores(kernels.calls) == sum(_reached(seq, range(a, a + b)) for a, b in q_chunks)
        assert acc is not None
        torch.testing.assert_close(ring_attention.finish_forward(acc, q_local)[0], whole[:, :, rows])
