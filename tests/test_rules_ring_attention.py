"""Property tests: ring attention (queries, keys and values split along the sequence, key/value
blocks passed around the ring, partial outputs merged by their log-sum-exps), forward and backward,
against the oracle, which runs every rank's ring nodes in step with their exchanges; contiguous
and in the load-balanced order (each rank's front and mirror chunks travelling as one block). Causal
offsets, padding masks that hide whole blocks from some rows, broadcast and additive masks,
grouped-query attention, and meshes where another axis splits the batch or the queries too."""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
from attention_cases import attention_case, check_some
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autopar.core.meta import NodeInfo, info
from autopar.core.strategy import Strategy
from autopar.rules.base import LocalContext, LocalGraph, RuleRegistry, make_call
from autopar.rules.context_parallel import BACKWARD, FORWARD, localize_attention, require_context_parallel
from autopar.rules.registry import default_registry
from autopar.rules.ring_attention import (
    _visible,
    exposed_exchange_seconds,
    key_index,
    merge_blocks,
    ring_admissible,
    ring_axis,
)
from autopar.testing.strategies import candidate_strategies, mesh_shapes, random_tensor

REGISTRY = default_registry()
for _op in (FORWARD, BACKWARD):  # offered where a "cp" axis asks for it; here, on any axis
    REGISTRY.admit(_op, ring_admissible)
SETTINGS = settings(max_examples=25, deadline=None)
A2A = torch.ops._c10d_functional.all_to_all_single.default


def _ring(options: list[Strategy], op: object) -> list[Strategy]:
    return [s for s in options if ring_axis(op, s) is not None]


def _case(data: st.DataObject, mesh: tuple[int, ...]) -> tuple[tuple, dict, torch.Generator]:
    """q (B, H, T, E), k and v with H or fewer heads (GQA), T a multiple of an axis size (the ring
    needs equal blocks), causal or not, and a mask: none, padding (B, 1, T, T) with -inf at
    padded keys (often every key of a block, for some rows), one broadcast along the queries
    (B, 1, 1, T), or random additive values (T, T)."""
    axis_size = data.draw(st.sampled_from(sorted(set(mesh))))
    seq = axis_size * data.draw(st.integers(1, 4))
    return attention_case(data, mesh, seq)


def _check_some(data: st.DataObject, op: object, args: tuple, kwargs: dict, mesh: tuple[int, ...]) -> None:
    options = _ring(candidate_strategies(op, args, kwargs, mesh, REGISTRY), op)
    assume(options)  # a mesh of size-1 axes, or a sequence no axis splits evenly
    check_some(data, op, args, kwargs, mesh, options, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(max_axes=2, max_size=4))
def test_ring_forward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    args, kwargs, _ = _case(data, mesh)
    _check_some(data, FORWARD, args, kwargs, mesh)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(max_axes=2, max_size=4))
def test_ring_backward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """dq, dk and dv split like q, k and v: each block's gradient is summed around the ring."""
    (q, k, v, dropout, causal), kwargs, g = _case(data, mesh)
    out, lse = FORWARD(q, k, v, dropout, causal, **kwargs)
    grad = random_tensor(out.shape, generator=g)
    _check_some(data, BACKWARD, (grad, q, k, v, out, lse, dropout, causal), kwargs, mesh)


def test_ring_is_offered_once_per_mesh_and_only_for_even_blocks() -> None:
    """Keys split along the sequence by one axis at most (a (2, 2) mesh offers no ring over both),
    and never over an axis that does not divide the sequence (the exchanged blocks are equal)."""
    q = torch.randn(2, 2, 8, 4)
    args = (q, q, q, 0.0, True)
    for strategy in _ring(candidate_strategies(FORWARD, args, {}, (2, 2), REGISTRY), FORWARD):
        assert len(strategy.inputs[1].shard_axes(2)) == 1, strategy
    odd = torch.randn(2, 2, 9, 4)
    assert not _ring(candidate_strategies(FORWARD, (odd, odd, odd, 0.0, True), {}, (2,), REGISTRY), FORWARD)


def _ring_nodes(op: object, args: tuple, kwargs: dict, mesh: tuple[int, ...], coords: tuple[int, ...]) -> fx.Graph:
    expected = op(*args, **kwargs)  # type: ignore[operator]
    call = make_call(op, args, kwargs, expected)
    (strategy,) = _ring(candidate_strategies(op, args, kwargs, mesh, REGISTRY), op)
    local = localize_attention(LocalContext(call, strategy, mesh, coords, args, kwargs, groups=("cp",)))
    assert isinstance(local, LocalGraph)
    graph = fx.Graph()
    inputs = tuple(graph.placeholder(f"x{i}") if isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
    graph.output(local.build(graph, inputs, {}, NodeInfo(role="compute", phase="forward")))
    return graph


def test_the_ring_is_its_exchanges_in_the_rank_graph() -> None:
    """On 4 ranks: the forward passes its key/value block 3 times, each exchange issued before the
    block computation it overlaps (to rank me+1, from rank me-1: one non-empty split each);
    the backward passes blocks and gradient accumulators 4 times and the accumulator once more."""
    q = torch.randn(1, 2, 8, 4)
    out, lse = FORWARD(q, q, q, 0.0, True)
    for op, args, count in ((FORWARD, (q, q, q, 0.0, True), 3), (BACKWARD, (out, q, q, q, out, lse, 0.0, True), 5)):
        graph = _ring_nodes(op, args, {}, (4,), (1,))
        nodes = list(graph.nodes)
        exchanges = [n for n in nodes if n.target is A2A]
        assert len(exchanges) == count, op
        for n in exchanges:
            step = info(n).comm
            assert step is not None and step.kind == "ring_shift" and info(n).comm_group == "cp"
            out_sizes, in_sizes = n.args[1], n.args[2]
            assert [i for i, x in enumerate(in_sizes) if x] == [2] and [i for i, x in enumerate(out_sizes) if x] == [0]
        blocks = [i for i, n in enumerate(nodes) if "block_" in str(n.target)]
        first_exchange = nodes.index(exchanges[0])
        assert first_exchange < blocks[0], "the exchange is issued before the block it overlaps"


def test_merge_of_a_block_no_key_reaches_is_the_other() -> None:
    """A block that hides every key from a row (logsumexp -inf) weighs nothing; two such blocks
    leave the row at 0, not NaN."""
    out = torch.randn(1, 1, 2, 3)
    lse = torch.tensor([[[0.5, float("-inf")]]])
    empty = (torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2), float("-inf")))
    merged, merged_lse = merge_blocks((out, lse), empty)
    torch.testing.assert_close(merged[..., 0, :], out[..., 0, :])
    assert bool((merged[..., 1, :] == 0).all()) and bool(torch.isneginf(merged_lse[..., 1]).all())


def test_only_what_a_block_does_not_hide_is_priced() -> None:
    """p-1 forward exchanges, each hidden by one block's compute up to its length; the backward's
    last accumulator pass follows the last block, so it always shows. An exchange's own time on
    its rank (gloo's per-call copies and queueing) shows whatever the overlap: once per exchange,
    p-1 in forward, p+1 in backward."""
    assert exposed_exchange_seconds(False, 4, (1.0, 0.0), (2.0, 0.0), block=2.0) == 0.0
    assert exposed_exchange_seconds(False, 4, (3.0, 0.0), (6.0, 0.0), block=2.0) == 3.0
    assert exposed_exchange_seconds(True, 4, (1.0, 0.0), (2.0, 0.0), block=2.0) == 1.0
    assert exposed_exchange_seconds(True, 4, (1.0, 0.0), (2.0, 0.0), block=0.0) == 2 + 2 * 2 + 1
    assert exposed_exchange_seconds(False, 4, (1.0, 0.5), (2.0, 0.5), block=2.0) == 3 * 0.5
    assert exposed_exchange_seconds(True, 4, (1.0, 0.5), (2.0, 0.5), block=2.0) == 1.0 + 5 * 0.5


# ---------------------------------------------------------------- the ring in the load-balanced order


@functools.cache
def _balanced_registry(axis: int) -> RuleRegistry:
    """The rules a mesh whose axis `axis` is "cp" asks for the ring in the balanced order with."""
    return require_context_parallel(default_registry(), axis, "ring_balanced")


def _check_balanced(data: st.DataObject, op: object, args: tuple, kwargs: dict, mesh: tuple[int, ...]) -> None:
    registry = _balanced_registry(len(mesh) - 1)
    options = [
        s
        for s in _ring(candidate_strategies(op, args, kwargs, mesh, registry), op)
        if s.inputs[key_index(op)].balanced_dims()
    ]
    assume(options)
    check_some(data, op, args, kwargs, mesh, options, registry)


BALANCED_MESHES = st.sampled_from([(2,), (3,), (4,), (2, 2), (3, 2), (2, 3)])


@SETTINGS
@given(data=st.data(), mesh=BALANCED_MESHES)
def test_ring_balanced_forward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """Each rank's two chunks (front and mirror) travel as one block; each run of query rows
    attends only the key runs it can see (causal skipping), merged by log-sum-exp."""
    args, kwargs, _ = attention_case(data, mesh, 2 * mesh[-1] * data.draw(st.integers(1, 2)))
    _check_balanced(data, FORWARD, args, kwargs, mesh)


@SETTINGS
@given(data=st.data(), mesh=BALANCED_MESHES)
def test_ring_balanced_backward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """dq, dk and dv balanced like q, k and v: each chunk's gradient summed around the ring."""
    (q, k, v, dropout, causal), kwargs, g = attention_case(data, mesh, 2 * mesh[-1] * data.draw(st.integers(1, 2)))
    out, lse = FORWARD(q, k, v, dropout, causal, **kwargs)
    grad = random_tensor(out.shape, generator=g)
    _check_balanced(data, BACKWARD, (grad, q, k, v, out, lse, dropout, causal), kwargs, mesh)


def test_ring_balanced_skips_what_the_causal_mask_hides() -> None:
    """On 4 ranks (8 chunks of 2 rows), rank 1 holds chunks 1 and 6. Its diagonal step computes
    both query chunks (the front against its own chunk only); a block from rank 0 (chunks 0, 7)
    is seen only through its front chunk; a block from rank 3 (chunks 3, 4) only by the back
    query chunk. Every step computes the same 2 x 2 chunk pairs minus the hidden ones: half."""
    q_chunks = ((2, 2), (12, 2))
    assert _visible(q_chunks[0], ((2, 2), (12, 2)), True) == [0]
    assert _visible(q_chunks[1], ((2, 2), (12, 2)), True) == [0, 1]
    assert _visible(q_chunks[0], ((0, 2), (14, 2)), True) == [0]
    assert _visible(q_chunks[1], ((0, 2), (14, 2)), True) == [0]
    assert _visible(q_chunks[0], ((6, 2), (8, 2)), True) == []
    assert _visible(q_chunks[1], ((6, 2), (8, 2)), True) == [0, 1]
    assert _visible(q_chunks[0], ((6, 2), (8, 2)), False) == [0, 1]
