"""The search prices edge tables per pair of placements (`search.even_factor`): the counts must be
those of `redistribute_cost`, for every pair of even layouts, and tables of differently sized
tensors with the same placements must share the factors without changing any entry."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.core.layout import BalancedShard, D, Layout, P, R, Shard, is_balanced
from autopar.core.mesh import Mesh
from autopar.core.redistribute import plan_redistribute, redistribute_cost
from autopar.passes.trace import trace
from autopar.planning import search
from autopar.planning.search import ElementCost, TimeCost, even_factor
from autopar.planning.search_cost import CALL_ELEMENTS, collective_count
from autopar.planning.search_problem import Problem, Shared
from autopar.planning.search_steps import (
    StepTemplates,
    canonical,
    coded_template,
    codes,
    even_redistribute_cost,
)
from autopar.planning.search_vars import PairTable
from autopar.rules.registry import default_registry
from autopar.testing.strategies import layout_pairs
from examples.models import GPT, GPTConfig


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


def test_pairs_share_steps_with_their_silent_axes_taken_out_as_worked_out_whole() -> None:
    """`StepTemplates.programs` works a pair's steps out with the axes that send nothing taken out
    (`search_steps.silent_free`) and puts them back on the pair's axes: every pair of placements
    of three axes (pending sums, row-disjoint sums, replicas, three dims), asked in pieces so that
    later pieces meet compacted keys worked out before, gets `coded_template` of its whole codes,
    and a fifth fewer pairs are worked out than there are distinct whole ones (`canonical`)."""
    options = [D, R, P, Shard(0), Shard(1), Shard(2)]
    placements = list(itertools.product(options, repeat=3))
    templates = StepTemplates(3)
    ids = templates.ids(placements)
    got: list[list[int]] = []
    for piece in np.array_split(np.arange(len(placements)), 5):
        got.extend(templates.programs(ids[piece], ids).tolist())
    for src, row in zip(placements, got):
        for dst, t in zip(placements, row):
            assert templates.templates[t] == coded_template(codes(src), codes(dst)), (src, dst)
    whole = {coded_template(codes(s), codes(d)) for s in placements for d in placements}
    assert set(templates.templates) == whole
    rows = np.array([codes(s) + codes(d) for s in placements for d in placements])
    assert 0 < templates.pairs < 0.8 * len(np.unique(canonical(rows)))


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
    direct = [[_elements_and_calls(s, d, mesh) for d in layouts] for s in layouts]
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
    assert first.tolist() == [[_elements_and_calls(s, d, mesh) for d in small] for s in small]
    assert second.tolist() == [[_elements_and_calls(s, d, mesh) for d in big] for s in big]
    # (S0, R) -> (R, R): all-gather of a 4 x 16 block over x = 2: 64 elements, one call
    assert first[1, 0] == 64 + CALL_ELEMENTS


def test_uneven_layouts_are_priced_pair_by_pair() -> None:
    """(R: even on any mesh; Shard(0) of 10 rows over 3 ranks: uneven.)"""
    mesh = (3,)
    uneven = [Layout((Shard(0),), (10, 4)), Layout((R,), (10, 4))]
    cost = ElementCost(mesh)
    table = cost.redistribute_table(uneven, uneven)
    assert table.tolist() == [[_elements_and_calls(s, d, mesh) for d in uneven] for s in uneven]
    # the uneven layout's pairs are priced alone: only the even one's placements enter the steps
    assert set(cost._placement_ids) == {(-2,)}


@pytest.mark.parametrize("hardware", ["h100-nvlink-ib", "a100-cluster", "cpu-gloo", None])
def test_lists_with_an_uneven_layout_price_their_even_pairs_from_steps_bit_for_bit(hardware: str | None) -> None:
    """A table whose lists hold an uneven layout prices each pair as `redistribute` does alone, to
    the last bit (on cpu-gloo each collective adds its own call time, so the order of the additions
    shows), the even pairs from their placements' steps (the 3-rank axis splits dim 1 of 7 unevenly,
    dim 0 of 12 evenly)."""
    mesh = (2, 3, 2)
    options = [R, P, Shard(0), Shard(1)]
    layouts = [Layout((a, b, c), (12, 7), torch.bfloat16) for a in options for b in options for c in options]
    cost = ElementCost(mesh) if hardware is None else TimeCost(hardware, mesh)
    even = [lay.is_even(mesh) for lay in layouts]
    assert any(even) and not all(even)
    table = cost.redistribute_table(layouts, layouts)
    assert table.tolist() == [[cost.redistribute(s, d) for d in layouts] for s in layouts]
    assert cost._placement_ids  # the even pairs went through the shared steps
    rows, cols = np.array([0, 5, 17, 40]), np.array([3, 9, 33, 63])
    assert cost.redistribute_table(layouts, layouts, rows, cols).tolist() == table[np.ix_(rows, cols)].tolist()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.booleans().flatmap(lambda balanced: layout_pairs(uneven=False, balanced=balanced)),
    st.sampled_from(["h100-nvlink-ib", "v100-cluster", "cpu-gloo"]),
)
def test_time_tables_are_the_seconds_of_every_pair(
    case: tuple[tuple[int, ...], Layout, Layout], hardware: str
) -> None:
    """Load-balanced splits too: their tables' steps are the emitted ones (a split gathered and
    cut again can take more steps than the mesh has axes)."""
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
    calls = CALL_ELEMENTS * collective_count(src, dst, tuple(mesh)) if src != dst else 0.0
    assert alone + calls == ElementCost(mesh).redistribute_table([src], [dst])[0, 0]
    assert alone == pytest.approx(redistribute_cost(src, dst, mesh), rel=1e-12)


def test_a_balanced_split_is_priced_with_the_steps_emitted() -> None:
    """`(Sb(0), P, R) -> (S(0), S(0), R)` on (1, 2, 1): the pending sum reduce-scatters into dim 0,
    then the dim, in the balanced order on the first axis and wanted contiguous there, is gathered
    and cut again, 2 collectives as `plan_redistribute` (what insert_comm emits) takes; the
    templates once read Sb(0) as S(0), kept the split and counted 1."""
    mesh = (1, 2, 1)
    src = Layout((BalancedShard(0), P, R), (8, 4))
    dst = Layout((Shard(0), Shard(0), R), (8, 4))
    emitted = [step for step in plan_redistribute(src, dst, mesh) if step.is_collective]
    assert [step.kind for step in emitted] == ["reduce_scatter", "all_gather"]
    assert collective_count(src, dst, mesh) == 2
    sent = sum(step.elements_sent(mesh) for step in emitted)
    assert even_redistribute_cost(src, dst, mesh) == pytest.approx(sent, rel=1e-12) and sent > 0
    table = ElementCost(mesh).redistribute_table([src], [dst])[0, 0]
    assert table == pytest.approx(sent + 2 * CALL_ELEMENTS, rel=1e-12)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs(uneven=False, balanced=True))
def test_even_tables_of_balanced_splits_price_the_emitted_steps(case: tuple[tuple[int, ...], Layout, Layout]) -> None:
    """With load-balanced splits on either side, the templates (`even_steps`: collective counts,
    the greedy pass's and the tables' elements) are `plan_redistribute`'s collectives."""
    mesh, src, dst = case
    dst = Layout(dst.placements, src.shape, dst.dtype)
    if not (src.is_even(mesh) and dst.is_even(mesh)):
        return
    emitted = [step for step in plan_redistribute(src, dst, mesh) if step.is_collective]
    sent = sum(step.elements_sent(mesh) for step in emitted)
    assert collective_count(src, dst, tuple(mesh)) == len(emitted)
    assert even_redistribute_cost(src, dst, tuple(mesh)) == pytest.approx(sent, rel=1e-12, abs=1e-9)
    calls = CALL_ELEMENTS * len(emitted) if src != dst else 0.0
    table = ElementCost(mesh).redistribute_table([src], [dst])[0, 0]
    assert table == pytest.approx(sent + calls, rel=1e-12, abs=1e-9)


def test_templates_of_balanced_pairs_are_worked_out_whole() -> None:
    """`StepTemplates.programs` on pairs with load-balanced splits (keyed apart from contiguous
    ones by `canonical`'s wide keys) gets `coded_template` of the whole codes, as without."""
    options = [D, R, P, Shard(0), Shard(1), BalancedShard(0), BalancedShard(1)]
    placements = [  # a load-balanced split is the innermost axis on its dim
        p
        for p in itertools.product(options, repeat=2)
        if not (is_balanced(p[0]) and isinstance(p[1], Shard) and p[1].dim == p[0].dim)
    ]
    templates = StepTemplates(2)
    ids = templates.ids(placements)
    pieces = np.array_split(np.arange(len(placements)), 3)
    got = [row for piece in pieces for row in templates.programs(ids[piece], ids).tolist()]
    for src, row in zip(placements, got):
        for dst, t in zip(placements, row):
            assert templates.templates[t] == coded_template(codes(src), codes(dst)), (src, dst)
    plain = codes((Shard(0), Shard(0))) + codes((R, R))
    balanced = codes((Shard(0), BalancedShard(0))) + codes((R, R))
    assert canonical(np.array([plain])) != canonical(np.array([balanced]))


def _elements_and_calls(src: Layout, dst: Layout, mesh: tuple[int, ...]) -> float:
    """What `ElementCost` prices a redistribution at: its elements, plus one gloo call for each of
    its collectives (`search_cost.CALL_ELEMENTS`)."""
    if src == dst:
        return 0.0
    return redistribute_cost(src, dst, mesh) + CALL_ELEMENTS * collective_count(src, dst, tuple(mesh))


def test_element_counts_price_each_collective_s_call() -> None:
    """One all-reduce of a pair of numbers costs one gloo call where two all-reduces of one number
    each cost two (in elements alone they tie); a collective the schedule stage buckets (a gradient
    into its weight) pays none, a local slice is free."""
    cost = ElementCost((2,))
    pair, one = Layout((P,), (2,)), Layout((P,), ())
    assert cost.redistribute(pair, Layout((R,), (2,))) == 2 + CALL_ELEMENTS
    assert 2 * cost.redistribute(one, Layout((R,), ())) == 2 + 2 * CALL_ELEMENTS
    assert cost.bucketed(pair, Layout((R,), (2,))) == 2
    assert cost.redistribute(Layout((R,), (4,)), Layout((Shard(0),), (4,))) == 0


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


def test_a_pair_table_holds_only_the_cells_kept_candidates_read() -> None:
    """`PairTable` keeps a row per producer layout and a column per consumer layout that an edge
    reads, not the whole lists (thousands of layouts on a four-axis mesh, of which the pruned
    candidates read a few hundred: 1.2 GB of tables for a 2-layer Mixtral stage on 2x2x2x2). The
    compact cells are the whole table's, and rows added by a later fill keep earlier indices valid."""
    mesh = (2, 2, 2)
    options = [R, P, Shard(0), Shard(1)]
    layouts = tuple(Layout((a, b, c), (16, 32)) for a in options for b in options for c in options)
    cost = TimeCost("h100-nvlink-ib", mesh)
    whole = cost.redistribute_table(layouts, layouts) / 2
    table = PairTable(layouts, layouts, share=2)
    rng = np.random.default_rng(0)
    first = [rng.integers(0, 8, 20), rng.integers(0, 8, 20)], [rng.integers(10, 20, 30)]
    table.fill(*first, cost.redistribute_table)
    assert table.data.shape == (len(np.unique(np.concatenate(first[0]))), len(np.unique(first[1][0])))
    kept = table.data
    out_first, in_first = table.compact(first[0][0], "out"), table.compact(first[1][0], "in")
    assert table.compact(first[0][0], "out") is out_first  # one compact array per full one
    later = [rng.integers(0, 64, 40)], [rng.integers(0, 64, 40)]
    table.fill(*later, cost.redistribute_table)
    assert table.data.shape[0] <= 64 and table.data.shape[0] > kept.shape[0] and not np.isnan(kept).any()
    for data in (kept, table.data):  # an earlier search's edges keep the array they were handed
        got = data[np.ix_(out_first, in_first)]
        assert got.tolist() == whole[np.ix_(first[0][0], first[1][0])].tolist()
    got = table.data[np.ix_(table.compact(later[0][0], "out"), table.compact(later[1][0], "in"))]
    assert got.tolist() == whole[np.ix_(later[0][0], later[1][0])].tolist()


def test_a_later_fill_prices_each_cell_once() -> None:
    """A fill that adds rows and columns prices the new rows against every column wanted and the
    earlier rows against the new columns only: no cell twice (an uneven table prices pair by
    pair; re-pricing the whole block was half of the zoo Qwen3Next's search). The cells are the
    whole table's."""
    mesh = (2, 2, 2)
    options = [R, P, Shard(0), Shard(1)]
    layouts = tuple(Layout((a, b, c), (12, 7)) for a in options for b in options for c in options)  # 7: uneven
    cost = ElementCost(mesh)
    priced: list[tuple[int, int]] = []

    def price(outs: tuple[Layout, ...], ins: tuple[Layout, ...], rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        priced.extend(itertools.product(rows.tolist(), cols.tolist()))
        return cost.redistribute_table(outs, ins, rows, cols)

    table = PairTable(layouts, layouts, share=1)
    table.fill([np.arange(10)], [np.arange(10)], price)
    later = np.arange(5, 20)
    table.fill([later], [later], price)
    assert len(priced) == len(set(priced)) == 10 * 10 + 10 * 15 + 5 * 10
    whole = cost.redistribute_table(layouts, layouts)
    got = table.data[np.ix_(table.compact(later, "out"), table.compact(later, "in"))]
    assert got.tolist() == whole[np.ix_(later, later)].tolist()


def test_a_search_keeps_no_starts_problem_until_it_picks_a_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """`search_layouts` holds every start's run until it picks one; a run keeps its plans and
    counts, not its problem (edge tables, memo, per-candidate vectors). The same start searched 6
    times peaks at most 25 % above searched twice (it peaked 60 % higher when every run kept its
    problem; the Mixtral 8x7B stage sub-mesh choice ran out of memory). Both are measured after one
    search (k = 1, not compared) has filled the module-level price caches: measured cold, the twice-searched
    peak held those fills and the ratio depended on which tests ran before in the process (1.05 after
    this file's other tests, 1.18 late in the suite; warm, the six runs' kept plans and counts are
    ~0.5 MB a run, 1.13-1.18x on a 12 MB peak)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 128, (16, 32), generator=g), torch.randint(0, 128, (16, 32), generator=g))
    mesh = Mesh.from_shape((2, 4))
    original = search._starts
    peaks, plans = {}, {}
    for k in (1, 2, 6):  # 1: the warm-up, not measured
        monkeypatch.setattr(search, "_starts", lambda *a, k=k, **kw: original(*a, **kw)[:1] * k)
        gm = trace(model, batch, decompose=True)
        tracemalloc.start()
        try:
            plans[k] = search.search_layouts(
                gm, mesh, default_registry(), cost=TimeCost("h100-nvlink-ib", mesh.shape), storage="sharded"
            ).strategies
            peaks[k] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert plans[6] == plans[2]
    assert peaks[6] <= 1.25 * peaks[2], peaks


def test_an_edges_lines_are_its_tables_cells_shared_between_repeated_layers() -> None:
    """A block's solve reads, per edge leaving it, the row (or column) of the edge's costs at the
    other op's candidate (`Edge.for_consumer`, `for_producer`): one read-only copy per table,
    index array and row (`SharedMatrices.line`) serves every edge of the repeated layers, and each
    is the table's cells as indexing gives them; the search from those lines finds the plan it
    finds from lines indexed afresh."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)
    with torch.device("meta"):
        model = GPT(cfg)
    gm = trace(model, (torch.zeros(8, 16, dtype=torch.long),) * 2, decompose=True)
    mesh = Mesh.from_shape((2, 2, 2))
    registry, cost, shared = default_registry(), TimeCost("a100-cluster", mesh.shape), Shared()
    seed = search.greedy_plan(gm, mesh, registry, expand_cache=shared.expand, memo=shared.greedy)
    problem = Problem(gm, mesh, registry, seed, cost, shared.expand, shared)
    asked = 0
    for edge in problem.edges:
        for c in {0, len(edge.out_index) - 1}:
            line = edge.for_consumer(c)
            assert not line.flags.writeable and line is edge.for_consumer(c)
            assert line.tolist() == edge.table[edge.out_index[c], edge.in_index].tolist()
        for c in {0, len(edge.in_index) - 1}:
            line = edge.for_producer(c)
            assert line.tolist() == edge.table[edge.out_index, edge.in_index[c]].tolist()
        asked += 2 * len({0, len(edge.out_index) - 1})
    assert 0 < len(problem.matrices._lines) < asked / 2  # the layers' edges share their lines
    problem.optimize(8)
    plain = Problem(gm, mesh, registry, seed, cost, shared.expand, shared)
    for edge in plain.edges:  # every line and matrix indexed afresh
        edge.matrices = None
    plain.optimize(8)
    assert plain.snapshot() == problem.snapshot()
