"""Property tests: row-disjoint pending sums (D, `RowDisjoint`) against the in-process oracle.

The grouped matmul over split experts gives each row of its output to one rank (the owner of the
row's expert), zeros on the others. The ops between the two grouped matmuls of an expert MLP keep
that (`expert_parallel.DISJOINT_RULES`), and the second grouped matmul takes it as input. Each
test draws who owns which row: at random, skewed (one rank owns most rows, another none), or all
rows to one rank; the oracle gives each D input's rows to their owners and checks that every D
output is zero on the rows a rank does not own, and that the sums equal the whole op.
"""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.moe  # noqa: F401  (registers transformers' grouped-matmul ops)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autopar.core.layout import D, Layout, P, R, RowDisjoint, Shard
from autopar.core.redistribute import FORBIDDEN_FACTOR, plan_redistribute, redistribute_cost
from autopar.planning.search_steps import even_redistribute_cost
from autopar.rules.expert_parallel import row_owners
from autopar.rules.registry import default_registry
from autopar.testing import assemble, check_strategy, shard_tensor, simulate_steps
from autopar.testing.strategies import (
    candidate_strategies,
    dim_sizes,
    expert_routings,
    mesh_shapes,
    random_tensor,
    seeds,
)

aten = torch.ops.aten
REGISTRY = default_registry()
GROUPED_MM = torch.ops.transformers.grouped_mm_fallback.default
GROUPED_MM_BACKWARD = torch.ops.transformers.grouped_mm_fallback_backward.default
SETTINGS = settings(max_examples=25, deadline=None)
MESHES = mesh_shapes(max_axes=3).filter(lambda m: max(m) > 1)


def _owners(data: st.DataObject, rows: int, mesh: tuple[int, ...]) -> dict[int, list[int]]:
    """Per mesh axis, the coordinate owning each row: random, skewed, or every row to one rank."""
    owners = {}
    for a, size in enumerate(mesh):
        kind = data.draw(st.sampled_from(["random", "skewed", "one_rank"]), label=f"owners on axis {a}")
        if kind == "one_rank":
            owners[a] = [data.draw(st.integers(0, size - 1))] * rows
        elif kind == "skewed":
            busy = data.draw(st.integers(0, size - 1))
            owners[a] = [busy if r % 5 else (busy + 1) % size for r in range(rows)]
        else:
            owners[a] = [data.draw(st.integers(0, size - 1)) for _ in range(rows)]
    return owners


def _disjoint_strategies(op: object, args: tuple, kwargs: dict, mesh: tuple[int, ...]) -> list:
    options = candidate_strategies(op, args, kwargs, mesh, REGISTRY)
    return [
        s
        for s in options
        if any(isinstance(p, RowDisjoint) for lay in (*s.inputs, *s.outputs) for p in lay.placements)
    ]


def _check_some(data: st.DataObject, op: object, args: tuple, kwargs: dict, mesh: tuple[int, ...]) -> None:
    """Some D strategy exists, and three drawn ones equal the whole op under drawn row owners."""
    first = args[0][0] if isinstance(args[0], list) else args[0]
    rows = first.shape[0]
    found = _disjoint_strategies(op, args, kwargs, mesh)
    assert found, f"{op} offers no row-disjoint strategy on {mesh}"
    owners = _owners(data, rows, mesh)
    for strategy in [data.draw(st.sampled_from(found), label="strategy") for _ in range(3)]:
        check_strategy(op, args, kwargs, strategy, mesh, REGISTRY, row_owners=owners)


def _matrix(data: st.DataObject, mesh: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    rows, cols = data.draw(st.integers(1, 9), label="rows"), data.draw(dim_sizes(mesh, cap=12), label="cols")
    return random_tensor((rows, cols), generator=g) - 1.5  # negatives too: ReLU and its gradient


ZERO_PRESERVING = [
    aten.silu.default,
    aten.gelu.default,
    aten.relu.default,
    aten.tanh.default,
    aten.neg.default,
    aten.clone.default,
]


@pytest.mark.parametrize("op", ZERO_PRESERVING, ids=str)
@SETTINGS
@given(data=st.data(), mesh=MESHES)
def test_zero_preserving_ops_keep_rows_disjoint(
    data: st.DataObject, mesh: tuple[int, ...], op: object
) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    _check_some(data, op, (_matrix(data, mesh, g),), {}, mesh)


@SETTINGS
@given(data=st.data(), mesh=MESHES)
def test_product_of_disjoint_values_with_the_same_owners(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """x * y with both D (the gate's act(gate) * up), or one D times an R value of any broadcast
    shape (the routing weights), and a scalar multiple."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    x = _matrix(data, mesh, g)
    other = data.draw(st.sampled_from(["same", "column", "row"]))
    shape = {"same": x.shape, "column": (x.shape[0], 1), "row": (x.shape[1],)}[other]
    y = random_tensor(shape, generator=g) - 1.5
    _check_some(data, aten.mul.Tensor, (x, y), {}, mesh)
    _check_some(data, aten.mul.Tensor, (y.expand_as(x).contiguous(), x), {}, mesh)
    _check_some(data, aten.mul.Scalar, (x, 2.5), {}, mesh)


@pytest.mark.parametrize(
    "op",
    [
        aten.silu_backward.default,
        aten.gelu_backward.default,
        aten.tanh_backward.default,
        aten.threshold_backward.default,
    ],
    ids=str,
)
@SETTINGS
@given(data=st.data(), mesh=MESHES)
def test_activation_gradients_keep_rows_disjoint(
    data: st.DataObject, mesh: tuple[int, ...], op: object
) -> None:
    """act_backward(grad D, x D or R): zero where the gradient is; never grad R with x D."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    grad = _matrix(data, mesh, g)
    x = random_tensor(grad.shape, generator=g) - 1.5
    args: tuple = (grad, x, 0.0) if op == aten.threshold_backward.default else (grad, x)
    _check_some(data, op, args, {}, mesh)
    for s in _disjoint_strategies(op, args, {}, mesh):
        for a in range(len(mesh)):
            assert not (s.inputs[1].placements[a] == D and s.inputs[0].placements[a] != D), s


@SETTINGS
@given(data=st.data(), mesh=MESHES)
def test_column_splits_and_concatenation_keep_rows_disjoint(
    data: st.DataObject, mesh: tuple[int, ...]
) -> None:
    """gate_up's output cut into its halves (split / slice of the last dim) and the
    backward's cat of the two gradients; along the rows none of them offers D."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    x = _matrix(data, mesh, g)
    cols = x.shape[1]
    cut = data.draw(st.integers(1, max(cols - 1, 1)))
    _check_some(data, aten.split.Tensor, (x, cut, -1), {}, mesh)
    _check_some(data, aten.slice.Tensor, (x, 1, 0, cut), {}, mesh)
    y = random_tensor((x.shape[0], cut), generator=g)
    _check_some(data, aten.cat.default, ([x, y], 1), {}, mesh)
    assert not _disjoint_strategies(aten.split.Tensor, (x, 1, 0), {}, mesh)
    assert not _disjoint_strategies(aten.cat.default, ([x, x], 0), {}, mesh)
    assert not _disjoint_strategies(aten.add.Tensor, (x, x), {}, mesh)


@pytest.mark.parametrize("op", [GROUPED_MM, GROUPED_MM_BACKWARD], ids=str)
@SETTINGS
@given(data=st.data(), mesh=MESHES)
def test_grouped_matmul_takes_the_rows_of_its_own_experts(
    data: st.DataObject, mesh: tuple[int, ...], op: object
) -> None:
    """The down projection's expert split with a D input (and, backward, a D gradient): each rank
    holds its experts' rows whole, multiplies them, and its output rows are again its own. The
    oracle gives the rows to the owners of their experts; given other owners it must fail."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    experts = data.draw(dim_sizes(mesh, cap=8, allow_one=False), label="experts")
    k, n = data.draw(dim_sizes(mesh, cap=12)), data.draw(dim_sizes(mesh, cap=12))
    offs = torch.tensor(expert_routings(data, experts)).cumsum(0)
    tokens = int(offs[-1])
    x, w = random_tensor((tokens, k), generator=g) + 1, random_tensor((experts, k, n), generator=g) + 1
    args: tuple = (x, w, offs)
    if op == GROUPED_MM_BACKWARD:
        args = (x, w, offs, random_tensor((tokens, n), generator=g) + 1)
    found = [
        s for s in _disjoint_strategies(op, args, {}, mesh) if any(p == D for p in s.inputs[0].placements)
    ]
    if not found:  # uneven blocks with an empty one are not offered
        return
    for strategy in [data.draw(st.sampled_from(found), label="strategy") for _ in range(3)]:
        split = strategy.inputs[1].shard_axes(0)
        assert [a for a, p in enumerate(strategy.outputs[0].placements) if p == D] == list(split)
        check_strategy(op, args, {}, strategy, mesh, REGISTRY)
        axis = next(a for a, p in enumerate(strategy.inputs[0].placements) if p == D)
        if mesh[axis] > 1 and tokens:  # rows handed to the wrong ranks: a wrong result
            wrong = dict(row_owners(offs, strategy.inputs[1], mesh))
            wrong[axis] = [(c + 1) % mesh[axis] for c in wrong[axis]]
            with pytest.raises(AssertionError):
                check_strategy(op, args, {}, strategy, mesh, REGISTRY, row_owners=wrong)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), mesh=MESHES)
def test_redistributing_a_disjoint_sum(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """D reduces like P (to R or a split: same steps, same bytes), becomes P for free, and nothing
    becomes D (priced out of every plan). The oracle runs the steps on drawn owners."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    rows, cols = data.draw(dim_sizes(mesh, cap=12, allow_one=False)), data.draw(dim_sizes(mesh, cap=12))
    axis = data.draw(st.sampled_from([a for a, s in enumerate(mesh) if s > 1]))
    target = data.draw(st.sampled_from([R, P, Shard(0), Shard(1)]))
    src = Layout(tuple(D if a == axis else R for a in range(len(mesh))), (rows, cols))
    dst = src.with_placement(axis, target)
    assume(dst.fits(mesh))
    as_partial = src.with_placement(axis, P)
    steps = plan_redistribute(src, dst, mesh)
    if target == P:
        assert steps == [] and redistribute_cost(src, dst, mesh) == 0.0
    else:
        assert [s.kind for s in steps] == [s.kind for s in plan_redistribute(as_partial, dst, mesh)]
        assert redistribute_cost(src, dst, mesh) == redistribute_cost(as_partial, dst, mesh)
    if src.is_even(mesh) and dst.is_even(mesh):
        assert even_redistribute_cost(src, dst, mesh) == pytest.approx(redistribute_cost(src, dst, mesh))
    full = random_tensor((rows, cols), generator=g)
    owners = _owners(data, rows, mesh)
    pieces = simulate_steps(shard_tensor(full, src, mesh, g, owners), steps, mesh)
    torch.testing.assert_close(assemble(pieces, dst, mesh), full)
    for other in (R, P, Shard(1)):
        back = plan_redistribute(src.with_placement(axis, other), src, mesh)
        assert [s.kind for s in back] == ["forbidden"]
        assert redistribute_cost(src.with_placement(axis, other), src, mesh) >= FORBIDDEN_FACTOR
