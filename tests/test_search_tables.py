"""The search prices edge tables per pair of placements (`search.even_factor`): the counts must be
those of `redistribute_cost`, for every pair of even layouts, and tables of differently sized
tensors with the same placements must share the factors without changing any entry."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.core.layout import Layout, P, R, Shard
from autopar.core.redistribute import redistribute_cost
from autopar.planning.search import ElementCost, TimeCost, even_factor
from autopar.planning.search_steps import even_redistribute_cost
from autopar.testing.strategies import layout_pairs


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs(uneven=False), st.integers(1, 3))
def test_even_factor_times_the_block_is_redistribute_cost(
    case: tuple[tuple[int, ...], Layout, Layout], scale: int
) -> None:
    mesh, src, dst = case
    src = Layout(src.placements, tuple(d * scale for d in src.shape), src.dtype)  # any even size
    dst = Layout(dst.placements, src.shape, dst.dtype)
    factor = even_factor(src.placements, dst.placements, mesh)
    assert src.local_numel(mesh) * factor == pytest.approx(redistribute_cost(src, dst, mesh), rel=1e-12)


def test_power_of_two_meshes_give_the_same_numbers_bit_for_bit() -> None:
    mesh = (4, 2, 8)
    options = [R, P, Shard(0), Shard(1), Shard(2)]
    layouts = [
        Layout((a, b, c), (64, 128, 32))
        for a in options
        for b in options
        for c in options
    ]
    table = ElementCost(mesh).redistribute_table(layouts, layouts)
    direct = [[redistribute_cost(s, d, mesh) for d in layouts] for s in layouts]
    assert table.tolist() == direct
    assert table.shape == (125, 125) and table.max() > 0


def test_tables_of_other_sizes_share_factors_and_stay_exact() -> None:
    mesh = (2, 4)
    cost = ElementCost(mesh)
    small = [Layout(p, (8, 16)) for p in [(R, R), (Shard(0), R), (R, Shard(1)), (Shard(0), Shard(1)), (P, R)]]
    big = [Layout(lay.placements, (64, 32)) for lay in small]
    first = cost.redistribute_table(small, small)
    priced = len(cost._placement_ids)
    second = cost.redistribute_table(big, big)
    assert len(cost._placement_ids) == priced  # the same placements: nothing new to price
    assert first.tolist() == [[redistribute_cost(s, d, mesh) for d in small] for s in small]
    assert second.tolist() == [[redistribute_cost(s, d, mesh) for d in big] for s in big]
    # (S0, R) -> (R, R): all-gather of a 4 x 16 block over x = 2: 64 elements
    assert first[1, 0] == 64


def test_uneven_layouts_are_priced_pair_by_pair() -> None:
    mesh = (3,)
    uneven = [Layout((Shard(0),), (10, 4)), Layout((R,), (10, 4))]
    cost = ElementCost(mesh)
    table = cost.redistribute_table(uneven, uneven)
    assert table.tolist() == [[redistribute_cost(s, d, mesh) for d in uneven] for s in uneven]
    assert not cost._placement_ids  # nothing shared from uneven blocks


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs(uneven=False), st.sampled_from(["h100-nvlink-ib", "v100-cluster", "cpu-gloo"]))
def test_time_tables_are_the_seconds_of_every_pair(
    case: tuple[tuple[int, ...], Layout, Layout], hardware: str
) -> None:
    mesh, src, dst = case
    cost = TimeCost(hardware, mesh)
    pair = [src, dst]
    table = cost.redistribute_table(pair, pair)
    for i, a in enumerate(pair):
        for j, b in enumerate(pair):
            assert table[i, j] == pytest.approx(cost.redistribute(a, b), rel=1e-12, abs=1e-18)


def test_time_tables_scale_the_bandwidth_term_with_the_tensor() -> None:
    cost = TimeCost("h100-nvlink-ib", (8, 8))  # x crosses nodes (8 GPUs per node), y stays inside
    small = [Layout(p, (64, 64)) for p in [(Shard(0), R), (R, R), (P, R), (R, Shard(1))]]
    big = [Layout(lay.placements, (4096, 64)) for lay in small]
    first, second = cost.redistribute_table(small, small), cost.redistribute_table(big, big)
    for table, layouts in ((first, small), (second, big)):
        direct = [cost.redistribute(s, d) for s in layouts for d in layouts]
        assert table.ravel().tolist() == pytest.approx(direct, rel=1e-12)
    # all-gather over x: same latency, 64x the bytes
    latency = first[0, 1] - (second[0, 1] - first[0, 1]) / 63
    assert latency > 0 and second[0, 1] > first[0, 1]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs(uneven=False))
def test_the_greedy_pass_prices_even_pairs_as_the_tables_do(case: tuple[tuple[int, ...], Layout, Layout]) -> None:
    """`search_steps.even_redistribute_cost` (the greedy pass's price of even pairs) is the table's
    number, and `redistribute_cost`'s."""
    mesh, src, dst = case
    dst = Layout(dst.placements, src.shape, dst.dtype)
    if not (src.is_even(mesh) and dst.is_even(mesh)):
        return
    alone = even_redistribute_cost(src, dst, tuple(mesh))
    assert alone == ElementCost(mesh).redistribute_table([src], [dst])[0, 0]
    assert alone == pytest.approx(redistribute_cost(src, dst, mesh), rel=1e-12)


def test_a_table_priced_piece_by_piece_is_the_whole_table() -> None:
    """The search prices only the cells its kept candidates read (`Problem._fill`): any rows and
    columns give the whole table's numbers, on even lists and on lists with an uneven layout."""
    mesh = (2, 3, 2)
    options = [R, P, Shard(0), Shard(1)]
    for shape in [(12, 24), (12, 7)]:  # 7 % 3: uneven where the 3-rank axis splits dim 1
        layouts = [Layout((a, b, c), shape) for a in options for b in options for c in options]
        cost = TimeCost("h100-nvlink-ib", mesh)
        whole = cost.redistribute_table(layouts, layouts)
        rows, cols = np.array([0, 5, 17, 40]), np.array([3, 9, 33, 63])
        piece = cost.redistribute_table(layouts, layouts, rows, cols)
        assert piece.tolist() == whole[np.ix_(rows, cols)].tolist()
