"""Uneven pairs are priced from programs shared by every shape with the same divisibility
(`planning.uneven_steps`): each cell must be `redistribute` of the pair alone, bit for bit, for
tensors of other sizes that share a program too."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from autopar.core.layout import BalancedShard, D, Layout, P, Placement, R, Shard
from autopar.core.redistribute import plan_redistribute, redistribute_cost
from autopar.planning.search_cost import CALL_ELEMENTS, ElementCost, collective_count
from autopar.planning.uneven_steps import UnevenPrograms
from autopar.testing.strategies import _balanced_alone


def _alone(src: Layout, dst: Layout, mesh: tuple[int, ...]) -> float:
    """What `ElementCost.redistribute` adds up for one pair, from `redistribute_cost` itself."""
    if src == dst:
        return 0.0
    return redistribute_cost(src, dst, mesh) + CALL_ELEMENTS * collective_count(src, dst, mesh)


@st.composite
def uneven_pairs(draw: st.DrawFn) -> tuple[tuple[int, ...], Layout, Layout]:
    """(mesh, src, dst) of any placements (pending and row-disjoint sums, contiguous and
    load-balanced splits) on 1-3 axes of 1-4 ranks, on a shape of sizes 1-14, at least one side
    uneven."""
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    ndim = draw(st.integers(1, 3))
    choices = [R, P, D, *(Shard(d) for d in range(ndim)), *(BalancedShard(d) for d in range(ndim))]
    shape = tuple(draw(st.lists(st.integers(1, 14), min_size=ndim, max_size=ndim)))
    src, dst = (_fitted(tuple(draw(st.sampled_from(choices)) for _ in mesh), shape, mesh) for _ in range(2))
    assume(not (src.is_even(mesh) and dst.is_even(mesh)))  # even pairs: `search_steps`' templates
    return mesh, src, dst


def _fitted(placements: tuple[Placement, ...], shape: tuple[int, ...], mesh: tuple[int, ...]) -> Layout:
    """The layout, its load-balanced splits made contiguous where their chunks do not fit."""
    layout = Layout(_balanced_alone(placements), shape, torch.float32)
    if layout.balanced_fits(mesh):
        return layout
    return Layout(tuple(Shard(p.dim) if isinstance(p, Shard) else p for p in layout.placements), shape, torch.float32)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(uneven_pairs(), st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_random_uneven_pairs_cost_what_redistribute_cost_says(
    case: tuple[tuple[int, ...], Layout, Layout], grow: list[int]
) -> None:
    """One program priced on the pair's shape and on larger shapes of the same divisibility (each
    dim grown by a multiple of every axis product, twice over for the balanced splits' chunks, so
    the blocks round up otherwise but the steps are the same): each cell is the direct
    `redistribute_cost` and the collectives `plan_redistribute` issues, and one program serves all."""
    mesh, src, dst = case
    programs = UnevenPrograms(mesh)
    period = 2 * math.prod(mesh)
    for extra in grow:
        shape = tuple(size + extra * period for size in src.shape)
        a, b = Layout(src.placements, shape, src.dtype), Layout(dst.placements, shape, dst.dtype)
        n = np.array([float(a.local_numel(mesh))])
        elements, calls = programs.price([a], [b], n, np.array([0]), np.array([0]))
        assert elements[0] == redistribute_cost(a, b, mesh)
        assert calls[0] == collective_count(a, b, mesh)
    assert programs.worked_out == 1


def test_a_table_of_uneven_layouts_is_each_pair_alone_bit_for_bit() -> None:
    """Pending sums, row-disjoint sums (the forbidden pairs) and splits of two dims on (2, 3, 2), on
    three shapes with the same divisibility (dim 0 divisible by every axis product, dim 1 by none
    but 1) and one with another, whose steps differ: each table, also asked in pieces, is each pair
    priced alone, and the three like shapes work out each pair of placements once."""
    mesh = (2, 3, 2)
    options = [R, P, D, Shard(0), Shard(1)]
    placements = list(itertools.product(options, repeat=3))
    cost = ElementCost(mesh)
    for shape in [(12, 7), (24, 5), (36, 13)]:
        layouts = [Layout(p, shape, torch.float32) for p in placements]
        table = cost.redistribute_table(layouts, layouts)
        assert table.tolist() == [[_alone(s, d, mesh) for d in layouts] for s in layouts]
    worked = cost._uneven.worked_out
    assert 0 < worked <= len(placements) ** 2
    # 8 rows split evenly over x = 2 (so dim 0 -> dim 1 on x is an all-to-all), not over y = 3:
    # another signature, asked in pieces
    layouts = [Layout(p, (12, 8), torch.float32) for p in placements]
    pieces = np.array_split(np.arange(len(layouts)), 3)
    got = np.concatenate([cost.redistribute_table(layouts, layouts, rows=piece) for piece in pieces])
    assert got.tolist() == [[_alone(s, d, mesh) for d in layouts] for s in layouts]
    assert cost._uneven.worked_out > worked
    exchange = Layout((Shard(0), R, R), (12, 8)), Layout((Shard(1), R, R), (12, 8))
    assert [step.kind for step in plan_redistribute(*exchange, mesh)] == ["all_to_all"]


def test_uneven_pairs_of_different_shapes_in_one_table_are_refused() -> None:
    programs = UnevenPrograms((3,))
    a, b = Layout((Shard(0),), (10, 4)), Layout((R,), (11, 4))
    try:
        programs.price([a], [b], np.array([4.0]), np.array([0]), np.array([0]))
    except ValueError as exc:
        assert "one shape" in str(exc)
    else:
        raise AssertionError("a table of two shapes was priced")
