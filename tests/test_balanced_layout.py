"""The load-balanced sequence split (`BalancedShard`): where a rank's rows lie, that nothing reads a
contiguous offset of it, and that every redistribution into or out of it (planned, priced,
simulated by the oracle and lowered by insert_comm) moves the right rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pass_fixtures import collectives
from test_pass_insert_comm import _check_redistribution

from autopar.core.errors import AutoparError
from autopar.core.layout import (
    BalancedShard,
    Layout,
    P,
    R,
    Shard,
    balanced_order,
    from_balanced,
    is_balanced_sequence,
    to_balanced,
)
from autopar.core.meta import info
from autopar.core.redistribute import plan_redistribute, redistribute_cost
from autopar.planning.search_cost import TimeCost
from autopar.planning.storage import gather_from_storage, replicated_storage, storage_layout
from autopar.runtime.program import local_value
from autopar.testing import assemble, shard_tensor, simulate_steps
from autopar.testing.strategies import layout_pairs

SEQ_SHAPE = (2, 16, 3)  # (batch, sequence, width): 16 tokens, 8 chunks of 2 on 4 ranks


def test_each_rank_holds_a_front_chunk_and_its_mirror() -> None:
    layout = Layout((BalancedShard(1),), SEQ_SHAPE)
    assert balanced_order(4) == (0, 7, 1, 6, 2, 5, 3, 4)
    assert [layout.local_chunks((4,), (r,), 1) for r in range(4)] == [
        ((0, 2), (14, 2)),
        ((2, 2), (12, 2)),
        ((4, 2), (10, 2)),
        ((6, 2), (8, 2)),
    ]
    full = torch.arange(2 * 16 * 3, dtype=torch.float64).reshape(SEQ_SHAPE)
    block = local_value(full, layout, (4,), (1,))
    torch.testing.assert_close(block, torch.cat([full[:, 2:4], full[:, 12:14]], 1))
    # every rank's causal work (keys at or before its rows) is the same
    work = [
        sum(start + i + 1 for start, n in layout.local_chunks((4,), (r,), 1) for i in range(n))
        for r in range(4)
    ]
    assert len(set(work)) == 1
    torch.testing.assert_close(from_balanced(to_balanced(full, 1, 4), 1, 4), full)
    assert is_balanced_sequence(layout) and not is_balanced_sequence(Layout((Shard(1),), SEQ_SHAPE))


def test_contiguous_offsets_are_refused_by_name() -> None:
    layout = Layout((BalancedShard(1),), SEQ_SHAPE)
    with pytest.raises(AutoparError, match="load-balanced"):
        layout.local_offsets((4,), (1,))


def test_balanced_split_is_alone_on_its_dim_in_equal_chunks() -> None:
    assert Layout((BalancedShard(1),), SEQ_SHAPE).is_even((4,))
    assert not Layout((BalancedShard(1),), (2, 12, 3)).is_even((4,))  # 12 is not 8 equal chunks
    assert not Layout((BalancedShard(1),), (2, 12, 3)).fits((4,))
    assert not Layout((BalancedShard(1), Shard(1)), SEQ_SHAPE).is_even((2, 2))  # balanced innermost only
    assert BalancedShard(1) != Shard(1) and hash(BalancedShard(1)) != hash(Shard(1))


@pytest.mark.parametrize(
    ("src", "dst", "kinds"),
    [
        (BalancedShard(1), R, ["all_gather"]),
        (R, BalancedShard(1), ["slice"]),
        (P, BalancedShard(1), ["reduce_scatter"]),
        (BalancedShard(1), Shard(1), ["all_gather", "slice"]),
        (Shard(1), BalancedShard(1), ["all_gather", "slice"]),
        (BalancedShard(1), Shard(2), ["all_to_all"]),
        (Shard(0), BalancedShard(1), ["all_to_all"]),
    ],
)
def test_steps_and_their_reordering_on_four_ranks(src: object, dst: object, kinds: list[str]) -> None:
    shape = (4, 16, 4)
    a, b = Layout((src,), shape, torch.float64), Layout((dst,), shape, torch.float64)  # type: ignore[arg-type]
    assert [s.kind for s in plan_redistribute(a, b, (4,))] == kinds
    graphs = _check_redistribution(a, b, (4,))
    gm = graphs[(2,)]
    assert [info(n).comm.kind for n in collectives(gm)] == [k for k in kinds if k != "slice"]
    # the reorder: a cat of the 8 chunks around the collective (none for a contiguous target)
    cats = [n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert len(cats) == 1
    assert all(len(n.args[0]) == 8 for n in cats)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs(max_axes=3, balanced=True, uneven=False), st.integers(0, 1000))
def test_balanced_redistributions_round_trip(case: tuple, seed: int) -> None:
    """Oracle simulation and insert_comm's lowered nodes alike give back the whole tensor, and the
    fast price equals the steps' volume."""
    mesh, src, dst = case
    steps = plan_redistribute(src, dst, mesh)
    assert redistribute_cost(src, dst, mesh) == pytest.approx(sum(s.elements_sent(mesh) for s in steps))
    full = torch.randn(src.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    out = simulate_steps(shard_tensor(full, src, mesh, torch.Generator().manual_seed(seed + 1)), steps, mesh)
    torch.testing.assert_close(assemble(out, dst, mesh, atol=1e-9, rtol=1e-9), full, atol=1e-9, rtol=1e-9)
    _check_redistribution(src, dst, mesh, seed)


def test_nested_inside_the_batch_split_each_block_is_balanced() -> None:
    """`[S(0), Sb(0)]` on (2 samples * 16 tokens) over (2, 4) ("dp", "cp"): the "dp" rank's sample,
    its 8 chunks of 2 tokens in the balanced order; the round trip to the contiguous split and to
    whole through insert_comm's nodes and the oracle gives the tensor back."""
    tokens = Layout((Shard(0), BalancedShard(0)), (32, 3), torch.float64)
    assert tokens.is_even((2, 4)) and tokens.fits((2, 4))
    assert tokens.local_chunks((2, 4), (1, 1), 0) == ((16 + 2, 2), (16 + 12, 2))
    assert tokens.local_chunks((2, 4), (0, 3), 0) == ((6, 2), (8, 2))
    assert not Layout((Shard(0), BalancedShard(0)), (24, 3)).is_even((2, 4))  # 12 tokens a sample: not 8 chunks
    assert not Layout((BalancedShard(0), Shard(0)), (32, 3)).is_even((2, 4))  # balanced innermost only
    for other in ((Shard(0), Shard(0)), (Shard(0), R), (R, R), (R, Shard(0)), (Shard(0), P)):
        if P not in other:  # a pending sum is a source only
            _check_redistribution(tokens, Layout(other, (32, 3), torch.float64), (2, 4))  # type: ignore[arg-type]
        _check_redistribution(Layout(other, (32, 3), torch.float64), tokens, (2, 4))  # type: ignore[arg-type]


def test_a_weight_is_stored_contiguous_and_reading_it_balanced_is_priced() -> None:
    """A stored weight is the user's parameter, a DTensor, so both storage modes keep a balanced
    compute layout's split in the contiguous order, and reading it back in the balanced order costs
    the gather and cut, in elements (the greedy pass) and in time (the search), where reading the
    contiguous split costs nothing."""
    mesh = (2, 4)
    balanced, contiguous = (Layout((Shard(0), BalancedShard(1)), (64, 32)), Layout((Shard(0), Shard(1)), (64, 32)))
    for stored in (storage_layout(balanced, mesh), replicated_storage(balanced)):
        assert stored == contiguous and not is_balanced_sequence(stored)
    assert gather_from_storage(contiguous, mesh) == 0
    assert gather_from_storage(balanced, mesh) == redistribute_cost(contiguous, balanced, mesh) > 0
    cost = TimeCost("h100-nvlink-ib", mesh)
    assert cost.gather_from_storage(contiguous) == 0 < cost.gather_from_storage(balanced)
