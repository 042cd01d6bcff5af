"""The search's block moves (autopar/planning/search_blocks.py): chains and trees of chains, solved exactly."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.planning.search_blocks import (
    Block,
    Clock,
    _column_message,
    _grouped_message,
    _tree_dp,
    chains,
    make_blocks,
    solve,
    sweep,
    trees,
)
from autopar.planning.search_vars import CACHED_ENTRIES, SharedMatrices, Tally
from autopar.planning.search_vars import Edge as _Edge
from autopar.planning.search_vars import Var as _Var


def _var(name: str, unary: list[float], current: int = 0) -> _Var:
    base = np.array(unary, dtype=float)
    return _Var(name, [f"{name}{i}" for i in range(len(unary))], ("test", name), base, base.copy(), current)  # type: ignore[arg-type]


def _connect(vars: list[_Var], u: int, v: int, table: np.ndarray) -> _Edge:
    n_u, n_v = table.shape
    edge = _Edge(u, v, table, np.arange(n_u), np.arange(n_v))
    vars[u].edges.append(edge)
    vars[v].edges.append(edge)
    return edge


def _total(vars: list[_Var], edges: list[_Edge]) -> float:
    value = sum(float(v.unary[v.current]) for v in vars)
    return value + sum(e.value(vars[e.u].current, vars[e.v].current) for e in edges)


def _sweep(vars: list[_Var], edges: list[_Edge], with_trees: bool) -> float:
    found = chains(vars, edges)
    shapes = [[(v, chain[k - 1] if k else -1) for k, v in enumerate(chain)] for chain in found]
    if with_trees:
        shapes += trees(vars, edges, found)
    memo: dict = {}
    for _ in range(4):
        for block in make_blocks(vars, shapes):
            solve(block, vars, memo, Tally())
    return _total(vars, edges)


def _attention_like() -> tuple[list[_Var], list[_Edge]]:
    """q, k and v (one op each) feed an attention op; every op has layouts A (0) and B (1). Each
    projection is a little cheaper in B, but disagreeing with the attention costs 10."""
    vars = [_var("q", [1, 0]), _var("k", [1, 0]), _var("v", [1, 0]), _var("attn", [0, 0])]
    mismatch = np.array([[0.0, 10.0], [10.0, 0.0]])
    edges = [_connect(vars, i, 3, mismatch) for i in range(3)]
    return vars, edges


def test_chain_moves_stay_where_q_k_v_must_move_together() -> None:
    vars, edges = _attention_like()
    assert _sweep(vars, edges, with_trees=False) == 3.0  # any one op moving alone pays 10
    assert [v.current for v in vars] == [0, 0, 0, 0]


def test_the_tree_move_moves_the_join_and_its_producers_together() -> None:
    vars, edges = _attention_like()
    assert _sweep(vars, edges, with_trees=True) == 0.0
    assert [v.current for v in vars] == [1, 1, 1, 1]


def test_a_fork_join_becomes_a_tree_trimmed_at_the_fork() -> None:
    # x forks into q, k and v (two ops each), which join at attention, followed by a projection
    names = ["x", "q1", "q2", "k1", "k2", "v1", "v2", "attn", "proj"]
    vars = [_var(n, [0.0, 0.0]) for n in names]
    at = {n: i for i, n in enumerate(names)}
    edges = []
    for u, v in [
        ("x", "q1"),
        ("q1", "q2"),
        ("x", "k1"),
        ("k1", "k2"),
        ("x", "v1"),
        ("v1", "v2"),
        ("q2", "attn"),
        ("k2", "attn"),
        ("v2", "attn"),
        ("attn", "proj"),
    ]:
        edges.append(_connect(vars, at[u], at[v], np.zeros((2, 2))))
    found = chains(vars, edges)
    assert [[names[v] for v in c] for c in found] == [
        ["x", "q1", "q2"],
        ["k1", "k2"],
        ["v1", "v2"],
        ["attn", "proj"],
    ]
    fork, join = trees(vars, edges, found)
    # at the fork, x's chain is the root and the k and v chains hang from x whole
    assert {names[v]: names[p] if p >= 0 else None for v, p in fork} == {
        "x": None,
        "q1": "x",
        "q2": "q1",
        "k1": "x",
        "k2": "k1",
        "v1": "x",
        "v2": "v1",
    }
    parent = {names[v]: names[p] if p >= 0 else None for v, p in join}
    # the attention's chain is the root; q's chain hangs from it whole (x included); k and v lose
    # the op next to the fork, which would close a cycle through x
    assert parent == {
        "attn": None,
        "proj": "attn",
        "q2": "attn",
        "q1": "q2",
        "x": "q1",
        "k2": "attn",
        "v2": "attn",
    }
    members = {at[n] for n in parent}
    inside = [e for e in edges if e.u in members and e.v in members]
    assert len(inside) == len(members) - 1  # a tree


@st.composite
def _trees(draw: st.DrawFn) -> tuple[list[_Var], list[_Edge], list[tuple[int, int]]]:
    """A random tree of 2..6 variables (2..3 candidates each), a member sometimes linked to its
    parent by two edges, plus fixed outside neighbours."""
    n = draw(st.integers(2, 6))
    costs = st.floats(0, 10, allow_nan=False, allow_infinity=False)
    vars = [_var(f"v{i}", draw(st.lists(costs, min_size=2, max_size=3)), 0) for i in range(n)]
    outside = _var("fixed", [0.0, 0.0], current=draw(st.integers(0, 1)))
    vars.append(outside)
    edges = []
    shape = [(0, -1)]
    for v in range(1, n):
        p = draw(st.integers(0, v - 1))
        shape.append((v, p))
        table = np.array(
            draw(
                st.lists(
                    st.lists(costs, min_size=len(vars[v].cands), max_size=len(vars[v].cands)),
                    min_size=len(vars[p].cands),
                    max_size=len(vars[p].cands),
                )
            )
        )
        u, w = (p, v) if draw(st.booleans()) else (v, p)
        edges.append(_connect(vars, u, w, table if u == p else table.T))
        if draw(st.booleans()):  # a second edge between the same two (two inputs of one value)
            cells = draw(st.lists(costs, min_size=table.size, max_size=table.size))
            twin = np.array(cells).reshape(table.shape)
            edges.append(_connect(vars, w, u, twin.T if u == p else twin))
    for v in range(n):  # an edge to the fixed variable outside the block
        if draw(st.booleans()):
            table = np.array(
                draw(
                    st.lists(
                        st.lists(costs, min_size=len(vars[v].cands), max_size=len(vars[v].cands)),
                        min_size=2,
                        max_size=2,
                    )
                )
            )
            edges.append(_connect(vars, n, v, table))
    return vars, edges, shape


@settings(max_examples=60, deadline=None)
@given(_trees())
def test_tree_block_solve_is_the_exact_optimum(
    case: tuple[list[_Var], list[_Edge], list[tuple[int, int]]],
) -> None:
    vars, edges, shape = case
    n = len(shape)
    best = np.inf
    for choice in itertools.product(*(range(len(vars[v].cands)) for v in range(n))):
        for v, c in enumerate(choice):
            vars[v].current = c
        best = min(best, _total(vars, edges))
    for v in range(n):
        vars[v].current = 0
    (block,) = make_blocks(vars, [shape])
    solve(block, vars, {}, Tally())
    assert abs(_total(vars, edges) - best) <= 1e-6 * (1 + abs(best))


@st.composite
def _graphs(draw: st.DrawFn) -> tuple[list[_Var], list[_Edge]]:
    """Random DAGs of 3 to 8 ops with 2 or 3 candidates each and random edge tables."""
    n = draw(st.integers(3, 8))
    cost = st.floats(0.0, 10.0, allow_nan=False)
    sizes = [draw(st.integers(2, 3)) for _ in range(n)]
    vars = [_var(f"v{i}", draw(st.lists(cost, min_size=s, max_size=s))) for i, s in enumerate(sizes)]
    edges = []
    for v in range(1, n):
        for u in sorted(draw(st.sets(st.integers(0, v - 1), min_size=1, max_size=min(2, v)))):
            table = np.array(draw(st.lists(cost, min_size=sizes[u] * sizes[v], max_size=sizes[u] * sizes[v])))
            edges.append(_connect(vars, u, v, table.reshape(sizes[u], sizes[v])))
    return vars, edges


@settings(max_examples=60, deadline=None)
@given(_graphs())
def test_sweeps_that_skip_unmoved_blocks_end_where_full_sweeps_end(graph: tuple[list[_Var], list[_Edge]]) -> None:
    vars, edges = graph
    found = chains(vars, edges)
    shapes = [[(v, chain[k - 1] if k else -1) for k, v in enumerate(chain)] for chain in found]
    blocks = make_blocks(vars, shapes + trees(vars, edges, found))
    full, skipping = Tally(), Tally()
    for _ in range(6):
        for block in blocks:
            solve(block, vars, {}, full)
    reference = [v.current for v in vars]
    for var in vars:
        var.current = 0
    clock = Clock.fresh(len(vars))
    for _ in range(6):
        sweep(blocks, vars, {}, skipping, clock)
    assert [v.current for v in vars] == reference
    before = skipping.solves
    sweep(blocks, vars, {}, skipping, clock)  # nothing moved since: every block is skipped
    assert skipping.solves == before
    assert skipping.solves <= full.solves


def test_an_edge_keeps_small_pair_tables_and_gathers_large_ones_again() -> None:
    """`Edge.matrix()` is every (u, v) candidate pair's cost from the table of distinct layouts. A
    small one is kept for the next solve; one above `CACHED_ENTRIES` (a routed-experts op's 512
    candidates against its neighbour's) is gathered again each time, so a search over thousands of
    such edges holds their small tables only, and both give the same numbers."""
    rng = np.random.default_rng(0)
    table = rng.random((3, 4))
    for n in (8, 600):
        out_index, in_index = rng.integers(0, 3, n), rng.integers(0, 4, n)
        edge = _Edge(0, 1, table, out_index, in_index)
        want = np.array([[table[out_index[i], in_index[j]] for j in range(n)] for i in range(n)])
        assert np.array_equal(edge.matrix(), want) and np.array_equal(edge.matrix(), want)
        assert (edge.cached is not None) == (n * n <= CACHED_ENTRIES), n


def test_edges_reading_one_table_through_the_same_indices_share_one_kept_matrix() -> None:
    """Repeated layers' edges read one pair table through the same index arrays: one search keeps
    one matrix for all of them (`SharedMatrices`), the numbers each edge would gather itself; an
    edge with other index arrays (equal values, another array) or another table gets its own."""
    rng = np.random.default_rng(1)
    table = rng.random((3, 4))
    out_index, in_index = rng.integers(0, 3, 40), rng.integers(0, 4, 50)
    matrices = SharedMatrices()
    layers = [_Edge(2 * k, 2 * k + 1, table, out_index, in_index, matrices=matrices) for k in range(4)]
    alone = _Edge(8, 9, table, out_index.copy(), in_index, matrices=matrices)
    other = _Edge(10, 11, table.copy(), out_index, in_index, matrices=matrices)
    want = table[np.ix_(out_index, in_index)]
    for edge in (*layers, alone, other):
        assert np.array_equal(edge.matrix(), want)
    assert all(edge.matrix() is layers[0].matrix() for edge in layers)
    assert alone.matrix() is not layers[0].matrix() and other.matrix() is not layers[0].matrix()
    assert len(matrices) == 3


def _message(value: np.ndarray, edge: _Edge, child_is_u: bool) -> tuple[np.ndarray, np.ndarray]:
    """The message through the candidates' whole pair matrix (what `_tree_dp(grouped=False)` sends)."""
    total = value[:, None] + (edge.matrix() if child_is_u else edge.matrix().T)
    arg = total.argmin(axis=0)
    return arg, total[arg, np.arange(total.shape[1])]


@st.composite
def _wide_edges(draw: st.DrawFn) -> tuple[np.ndarray, _Edge, bool]:
    """An edge between two ops of 65-200 candidates over 1-6 distinct layouts a side, costs drawn
    from a few values and their next floats (exact ties, and ties only rounding tells apart)."""
    n_child, n_parent = draw(st.integers(65, 200)), draw(st.integers(65, 200))
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    levels = draw(st.lists(st.sampled_from([0.0, 1.0, 3.0, 1e3, 1e9, 0.1]), min_size=1, max_size=4))
    near = st.sampled_from(levels).flatmap(lambda x: st.sampled_from([x, np.nextafter(x, np.inf), x * 1.5]))
    value = np.array(draw(st.lists(near, min_size=n_child, max_size=n_child)))
    table = np.array(draw(st.lists(near, min_size=rows * cols, max_size=rows * cols))).reshape(rows, cols)
    child_index = np.array(draw(st.lists(st.integers(0, rows - 1), min_size=n_child, max_size=n_child)))
    parent_index = np.array(draw(st.lists(st.integers(0, cols - 1), min_size=n_parent, max_size=n_parent)))
    child_is_u = draw(st.booleans())
    if child_is_u:
        return value, _Edge(0, 1, table, child_index, parent_index), True
    return value, _Edge(1, 0, table.T.copy(), parent_index, child_index), False


@settings(max_examples=200, deadline=None)
@given(_wide_edges())
def test_a_message_through_the_distinct_layouts_equals_the_whole_matrix_s(case: tuple[np.ndarray, _Edge, bool]) -> None:
    """`_grouped_message` gives the whole pair matrix's argmin (lowest index on ties) and sums, bit
    for bit, or declines (None) where rounding could tell a lower index apart."""
    value, edge, child_is_u = case
    want_arg, want_sum = _message(value, edge, child_is_u)
    found = _grouped_message(value, edge, child_is_u)
    if found is not None:
        arg, sums = found
        assert np.array_equal(arg, want_arg)
        assert np.array_equal(sums, want_sum)


@settings(max_examples=200, deadline=None)
@given(_wide_edges())
def test_a_message_per_distinct_parent_layout_equals_the_whole_matrix_s(case: tuple[np.ndarray, _Edge, bool]) -> None:
    """`_column_message` (where the grouped message declines) gives the whole pair matrix's argmin
    and sums bit for bit on every drawn edge, rounding ties included: it never declines here (at
    most 6 parent layouts for 65 or more candidates; drawn edges are small, so the size at which
    `_tree_dp` takes it, above the kept matrices', is lowered to 0)."""
    value, edge, child_is_u = case
    found = _column_message(value, edge, child_is_u, smallest=0)
    assert found is not None
    want_arg, want_sum = _message(value, edge, child_is_u)
    assert np.array_equal(found[0], want_arg)
    assert np.array_equal(found[1], want_sum)


def test_the_grouped_message_is_taken_where_layouts_repeat_and_declines_a_rounding_tie() -> None:
    rng = np.random.default_rng(1)
    table = rng.random((4, 5))
    child, parent = rng.integers(0, 4, 300), rng.integers(0, 5, 300)
    value = rng.random(300)
    edge = _Edge(0, 1, table, child, parent)
    found = _grouped_message(value, edge, True)
    assert found is not None  # 4 x 5 distinct cells for 300 x 300 pairs
    assert all(np.array_equal(a, b) for a, b in zip(found, _message(value, edge, True)))
    # candidate 0 costs one ulp more than candidate 1 of the same layout, every other candidate far
    # more: with an entry of 1.0 the two sums round alike, and the whole matrix picks 0, the lower
    # index, for every parent candidate; the grouped message, which keeps only candidate 1 of that
    # layout, declines
    child[:2], value[:2], value[2:] = 0, (np.nextafter(0.25, 1.0), 0.25), value[2:] + 10.0
    table[0, :] = 1.0
    edge = _Edge(0, 1, table, child, parent)
    assert np.nextafter(0.25, 1.0) + 1.0 == 0.25 + 1.0
    assert _grouped_message(value, edge, True) is None
    arg, _ = _message(value, edge, True)
    assert (arg == 0).all()
    column = _column_message(value, edge, True)  # what `_tree_dp` sends instead: the matrix's choice
    assert column is not None and (column[0] == 0).all()


@settings(max_examples=40, deadline=None)
@given(_wide_edges())
def test_tree_dp_grouped_or_not_chooses_alike(case: tuple[np.ndarray, _Edge, bool]) -> None:
    """A two-member block (the parent the root): the same choices through either message."""
    value, edge, child_is_u = case
    parent_size = len(edge.in_index if child_is_u else edge.out_index)
    rng = np.random.default_rng(len(value))
    root = rng.choice([0.0, 1.0, 2.0], parent_size)
    vars = [_var("p", list(root)), _var("c", list(value))]
    edge.u, edge.v = (1, 0) if child_is_u else (0, 1)
    block = Block((0, 1), (-1, 0), ((), ((edge, child_is_u),)), 0, (0, 1), ((), ()))
    local = [vars[0].unary.copy(), vars[1].unary.copy()]
    assert np.array_equal(_tree_dp(block, local, grouped=True), _tree_dp(block, local, grouped=False))
