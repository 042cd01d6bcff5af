"""plan_redistribute: golden step lists, ring volumes, and a simulated round trip on random layouts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.core.layout import Layout, P, R, Shard
from autopar.core.redistribute import COLLECTIVE_KINDS, plan_redistribute, redistribute_cost
from autopar.planning.search_steps import element_factor, even_steps
from autopar.testing import assemble, shard_tensor, simulate_steps
from autopar.testing.strategies import layout_pairs


def _kinds(steps: list) -> list[tuple[str, int]]:
    return [(s.kind, s.axis) for s in steps]


def _round_trip(full: torch.Tensor, src: Layout, dst: Layout, mesh: tuple[int, ...], seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    pieces = shard_tensor(full, src, mesh, gen)
    steps = plan_redistribute(src, dst, mesh)
    out = simulate_steps(pieces, steps, mesh)
    for coords, piece in out.items():
        assert tuple(piece.shape) == dst.local_shape(mesh, coords), (coords, src, dst)
    torch.testing.assert_close(assemble(out, dst, mesh, atol=1e-9, rtol=1e-9), full, atol=1e-9, rtol=1e-9)


# ---- golden cases on one axis of size g --------------------------------------------------------
G = 4
N_SHAPE = (8, 12)
N = math.prod(N_SHAPE)


def _one_axis(p: object) -> Layout:
    return Layout((p,), N_SHAPE)  # type: ignore[arg-type]


def test_partial_to_replicate_is_one_all_reduce() -> None:
    steps = plan_redistribute(_one_axis(P), _one_axis(R), (G,))
    assert _kinds(steps) == [("all_reduce", 0)]
    assert steps[0].is_collective and steps[0].dim is None
    assert steps[0].elements_sent((G,)) == pytest.approx(2 * (G - 1) / G * N)
    assert steps[0].bytes_sent((G,)) == pytest.approx(4 * 2 * (G - 1) / G * N)


@pytest.mark.parametrize("dim", [0, 1])
def test_partial_to_shard_is_one_reduce_scatter(dim: int) -> None:
    steps = plan_redistribute(_one_axis(P), _one_axis(Shard(dim)), (G,))
    assert _kinds(steps) == [("reduce_scatter", 0)] and steps[0].dim == dim
    # ring reduce-scatter: (g-1)/g of the full (unscattered) size
    assert steps[0].elements_sent((G,)) == pytest.approx((G - 1) / G * N)


@pytest.mark.parametrize("dim", [0, 1])
def test_shard_to_replicate_is_one_all_gather(dim: int) -> None:
    steps = plan_redistribute(_one_axis(Shard(dim)), _one_axis(R), (G,))
    assert _kinds(steps) == [("all_gather", 0)] and steps[0].dim == dim
    # ring all-gather: (g-1)/g of the full (gathered) size
    assert steps[0].elements_sent((G,)) == pytest.approx((G - 1) / G * N)


def test_shard_to_other_shard_on_one_axis_is_one_all_to_all() -> None:
    steps = plan_redistribute(_one_axis(Shard(0)), _one_axis(Shard(1)), (G,))
    assert _kinds(steps) == [("all_to_all", 0)]
    assert (steps[0].dim, steps[0].dst_dim) == (0, 1)
    # each rank keeps 1/g of its local block and sends the rest
    assert steps[0].elements_sent((G,)) == pytest.approx((G - 1) / G * N / G)
    assert steps[0].describe(("x",)) == "all_to_all[x] dim 0->1"


def test_replicate_to_shard_is_a_free_slice() -> None:
    steps = plan_redistribute(_one_axis(R), _one_axis(Shard(1)), (G,))
    assert _kinds(steps) == [("slice", 0)] and steps[0].dim == 1
    assert not steps[0].is_collective
    assert steps[0].elements_sent((G,)) == 0.0
    assert redistribute_cost(_one_axis(R), _one_axis(Shard(1)), (G,)) == 0.0


def test_replicate_to_partial_zeroes_all_but_one_replica() -> None:
    steps = plan_redistribute(_one_axis(R), _one_axis(P), (G,))
    assert _kinds(steps) == [("zero_partial", 0)] and steps[0].elements_sent((G,)) == 0.0
    _round_trip(torch.randn(N_SHAPE, dtype=torch.float64), _one_axis(R), _one_axis(P), (G,))


def test_equal_layouts_need_no_steps_and_size_one_axes_are_free() -> None:
    lay = Layout((Shard(0), P), N_SHAPE)
    assert plan_redistribute(lay, lay, (2, 2)) == []
    assert redistribute_cost(lay, lay, (2, 2)) == 0.0
    # a size-1 axis: P -> R needs no collective at all
    assert plan_redistribute(Layout((P,), N_SHAPE), Layout((R,), N_SHAPE), (1,)) == []


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="shapes"):
        plan_redistribute(Layout((R,), (4,)), Layout((R,), (8,)), (2,))


# ---- golden cases on several axes --------------------------------------------------------------
def test_nested_gather_goes_innermost_first() -> None:
    mesh = (2, 3)
    src, dst = Layout((Shard(0), Shard(0)), (12, 2)), Layout((R, R), (12, 2))
    steps = plan_redistribute(src, dst, mesh)
    assert _kinds(steps) == [("all_gather", 1), ("all_gather", 0)]
    # the inner gather sends 2 blocks of 2x2, the outer one 1 block of 6x2
    assert [s.elements_sent(mesh) for s in steps] == [8, 12]
    assert redistribute_cost(src, dst, mesh) == 20
    _round_trip(torch.randn(12, 2, dtype=torch.float64), src, dst, mesh)


def test_two_partials_reduce_scatter_into_a_nested_split() -> None:
    mesh = (2, 2)
    src, dst = Layout((P, P), (8, 4)), Layout((Shard(0), Shard(0)), (8, 4))
    steps = plan_redistribute(src, dst, mesh)
    assert _kinds(steps) == [("reduce_scatter", 0), ("reduce_scatter", 1)]
    assert [s.elements_sent(mesh) for s in steps] == [16, 8]
    _round_trip(torch.randn(8, 4, dtype=torch.float64), src, dst, mesh)


def test_a_pending_sum_exchanges_its_target_dims_axes_away_then_reduce_scatters() -> None:
    """x's pending sum cannot reduce-scatter into dim 0 while y and z split it, so it was
    all-reduced and y and z exchanged after (as GPT's embedding output on 4x8x16 was, into the
    residual stream's layout). The exchanges run on the summands first (an exchange of summands
    is one of sums, the same block), then x reduce-scatters: half an all-reduce."""
    mesh = (2, 2, 4)
    src = Layout((P, Shard(0), Shard(0)), (16, 16, 16))
    dst = Layout((Shard(0), Shard(1), Shard(2)), (16, 16, 16))
    steps = plan_redistribute(src, dst, mesh)
    assert [(s.kind, s.axis, s.dim, s.dst_dim) for s in steps] == [
        ("all_to_all", 2, 0, 2),
        ("all_to_all", 1, 0, 1),
        ("reduce_scatter", 0, 0, None),
    ]
    n = 16**3 / 8  # the source block
    sent = [s.elements_sent(mesh) for s in steps]
    assert sent == [3 / 4 * n, 1 / 2 * n, 1 / 2 * n]  # (all-reduce first: n + 3/4 n + 1/2 n)
    assert redistribute_cost(src, dst, mesh) == sum(sent) == 896
    assert sum(element_factor(k, mesh[a]) * n * num / den for k, a, num, den in even_steps(src.placements, dst.placements, mesh)) == 896
    _round_trip(torch.randn(16, 16, 16, dtype=torch.float64), src, dst, mesh)
    # with a second pending sum reduced after it, the exchange would run before that one's
    # reduce-scatter shrinks the block: the usual order
    two = Layout((P, P, Shard(0)), (16, 16, 16))
    kinds = [s.kind for s in plan_redistribute(two, dst, mesh) if s.is_collective]
    assert kinds[0] == "all_reduce"


def test_all_gather_volume_equals_ring_formula_of_the_gathered_size() -> None:
    """comm_volumes.md: all-gather whose gathered size is N over g ranks sends (g-1)/g * N."""
    mesh = (2, 2, 2)
    # a weight stored split on x, y and z, gathered on z only (the AxoNN forward weight gather)
    k, n = 64, 256
    stored = Layout((Shard(1), Shard(0), Shard(0)), (n, k))
    compute = Layout((Shard(1), Shard(0), R), (n, k))
    (step,) = plan_redistribute(stored, compute, mesh)
    assert (step.kind, step.axis, step.dim) == ("all_gather", 2, 0)
    assert step.elements_sent(mesh) == pytest.approx((2 - 1) / 2 * k * n / (2 * 2))


# ---- property: any even src -> dst round-trips through the simulated collectives ---------------
@st.composite
def _case(draw: st.DrawFn) -> tuple[tuple[int, ...], Layout, Layout, torch.Tensor]:
    mesh, src, dst = draw(layout_pairs())
    seed = draw(st.integers(0, 2**16))
    full = torch.randn(src.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return mesh, src, dst, full


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_redistribution_round_trips(case: tuple[tuple[int, ...], Layout, Layout, torch.Tensor]) -> None:
    mesh, src, dst, full = case
    steps = plan_redistribute(src, dst, mesh)

    # each step changes exactly its own axis; steps on size-1 axes may be skipped (nothing moves)
    def same_up_to_unit_axes(a: Layout, b: Layout) -> bool:
        return all(p == q or mesh[ax] == 1 for ax, (p, q) in enumerate(zip(a.placements, b.placements)))

    layout = src
    for step in steps:
        assert same_up_to_unit_axes(step.before, layout)
        changed = [a for a in range(len(mesh)) if step.before.placements[a] != step.after.placements[a]]
        assert changed == [step.axis]
        layout = step.after
    assert same_up_to_unit_axes(layout, dst)
    assert all(s.kind in (*COLLECTIVE_KINDS, "slice", "zero_partial") for s in steps)
    assert all(mesh[s.axis] > 1 for s in steps if s.is_collective)
    assert redistribute_cost(src, dst, mesh) == pytest.approx(sum(s.elements_sent(mesh) for s in steps))
    _round_trip(full, src, dst, mesh)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs())
def test_fast_cost_equals_the_steps(case: tuple[tuple[int, ...], Layout, Layout]) -> None:
    """redistribute_cost prices pairs without building steps; it must agree with plan_redistribute."""
    mesh, src, dst = case
    steps = plan_redistribute(src, dst, mesh)
    assert redistribute_cost(src, dst, mesh) == pytest.approx(sum(s.elements_sent(mesh) for s in steps))
