"""Property tests: matmul family (mm, bmm, addmm, baddbmm, mv, dot) against the oracle."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.moe  # noqa: F401  (registers transformers' grouped-matmul ops)
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.core.layout import chunks_nonempty
from autopar.rules.registry import default_registry
from autopar.testing import check_strategy
from autopar.testing.strategies import (
    candidate_strategies,
    check_random_strategies,
    dim_sizes,
    expert_routings,
    mesh_shapes,
    random_tensor,
    seeds,
)

# Each op of a family gets its own examples (sampling the op would leave some untested).
PER_OP = settings(max_examples=8, deadline=None)

aten = torch.ops.aten
REGISTRY = default_registry()
SETTINGS = settings(max_examples=30, deadline=None)

MATMULS = [
    aten.mm.default,
    aten.bmm.default,
    aten.addmm.default,
    aten.baddbmm.default,
    aten.mv.default,
    aten.dot.default,
]
GROUPED_MM = torch.ops.transformers.grouped_mm_fallback.default
GROUPED_MM_BACKWARD = torch.ops.transformers.grouped_mm_fallback_backward.default
LIBRARY_OPS = [GROUPED_MM, GROUPED_MM_BACKWARD]
COVERED_OPS = [*MATMULS, *LIBRARY_OPS, aten._grouped_mm.default]  # the last: test_torch_grouped_mm


@pytest.mark.parametrize("op", MATMULS, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_matmul_family(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    b, m, k, n = (data.draw(dim_sizes(mesh, cap=12)) for _ in range(4))
    t = lambda *shape: random_tensor(shape, generator=g)
    if op == aten.mm.default:
        args: tuple = (t(m, k), t(k, n))
    elif op == aten.bmm.default:
        args = (t(b, m, k), t(b, k, n))
    elif op == aten.mv.default:
        args = (t(m, k), t(k))
    elif op == aten.dot.default:
        args = (t(k), t(k))
    else:
        # bias shapes broadcast against the output: full, row vector, (1, n), scalar-like
        out = (m, n) if op == aten.addmm.default else (b, m, n)
        bias_shape = data.draw(st.sampled_from([out, out[-1:], (1,) * (len(out) - 1) + out[-1:], (1,)]))
        lhs = t(m, k) if op == aten.addmm.default else t(b, m, k)
        rhs = t(k, n) if op == aten.addmm.default else t(b, k, n)
        args = (t(*bias_shape), lhs, rhs)
    kwargs = {"beta": 0.5, "alpha": 2.0} if op in (aten.addmm.default, aten.baddbmm.default) else {}
    assert check_random_strategies(data, op, args, kwargs, mesh, REGISTRY)


@pytest.mark.parametrize("op", LIBRARY_OPS, ids=str)
@settings(max_examples=20, deadline=None)
@given(data=st.data(), mesh=mesh_shapes())
def test_grouped_matmul(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    """transformers' mixture-of-experts grouped matmul and its backward: tokens sorted by expert,
    some experts given none."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    experts, k, n = data.draw(st.integers(1, 4)), data.draw(dim_sizes(mesh, cap=12)), data.draw(dim_sizes(mesh, cap=12))
    counts = [data.draw(st.integers(0, 4)) for _ in range(experts)]
    offs = torch.tensor(counts).cumsum(0)
    tokens = int(offs[-1])
    x, w = random_tensor((tokens, k), generator=g), random_tensor((experts, k, n), generator=g)
    args: tuple = (x, w, offs)
    if op == GROUPED_MM_BACKWARD:
        args = (x, w, offs, random_tensor((tokens, n), generator=g))
    assert check_random_strategies(data, op, args, {}, mesh, REGISTRY)


@pytest.mark.parametrize("op", LIBRARY_OPS, ids=str)
@settings(max_examples=25, deadline=None)
@given(data=st.data(), mesh=mesh_shapes(max_axes=3).filter(lambda m: max(m) > 1))
def test_grouped_matmul_expert_split(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    """Expert parallelism: every strategy that splits the experts (the weight's dim 0) over some
    axis, alone or beside a split inside the experts on another axis, equals the whole op, under
    random routings: uneven, an expert with no rows, one with most of them, all rows to one."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    experts = data.draw(dim_sizes(mesh, cap=8, allow_one=False), label="experts")
    k, n = data.draw(dim_sizes(mesh, cap=12)), data.draw(dim_sizes(mesh, cap=12))
    offs = torch.tensor(expert_routings(data, experts)).cumsum(0)
    tokens = int(offs[-1])
    x, w = random_tensor((tokens, k), generator=g), random_tensor((experts, k, n), generator=g)
    args: tuple = (x, w, offs)
    if op == GROUPED_MM_BACKWARD:
        args = (x, w, offs, random_tensor((tokens, n), generator=g))
    options = candidate_strategies(op, args, {}, mesh, REGISTRY)
    split = [s for s in options if s.inputs[1].shard_axes(0)]
    if not split:  # uneven blocks with an empty one are not offered
        assert not any(a > 1 and chunks_nonempty(experts, a) for a in mesh), (experts, mesh)
        return
    for strategy in [data.draw(st.sampled_from(split), label="strategy") for _ in range(3)]:
        assert strategy.inputs[0].shard_axes(0) == () and strategy.inputs[2].is_replicated
        check_strategy(op, args, {}, strategy, mesh, REGISTRY)


TORCH_GROUPED_MM = aten._grouped_mm.default


@pytest.mark.parametrize("form", ["rows", "experts_gradient"])
@settings(max_examples=25, deadline=None)
@given(data=st.data(), mesh=mesh_shapes(max_axes=3).filter(lambda m: max(m) > 1))
def test_torch_grouped_mm(data: st.DataObject, mesh: tuple[int, ...], form: str) -> None:
    """`torch._grouped_mm` of a hand-written MoE layer, in its two forms with `offs`: rows (S, K)
    times experts (E, K, N) (forward and the input's gradient), and rows transposed (K, S) times
    (S, N) giving the experts' gradient (E, K, N). Random strategies of its rule, and then strategies
    splitting the experts (alone or beside a split inside them on another axis), equal the whole op
    under random routings: uneven, an expert with no rows, one with most of them, all rows to one.
    float32 (the op has no float64), K and N multiples of 4 (its strides must be of 16 bytes)."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    experts = data.draw(dim_sizes(mesh, cap=8, allow_one=False), label="experts")
    k, n = 4 * data.draw(st.integers(1, 3), label="k/4"), 4 * data.draw(st.integers(1, 3), label="n/4")
    offs = torch.tensor(expert_routings(data, experts)).cumsum(0).to(torch.int32)
    tokens = int(offs[-1])
    x = random_tensor((tokens, k), dtype=torch.float32, generator=g)
    if form == "rows":
        args: tuple = (x, random_tensor((experts, k, n), dtype=torch.float32, generator=g), offs)
    else:
        args = (x.T, random_tensor((tokens, n), dtype=torch.float32, generator=g), offs)
    assert check_random_strategies(data, TORCH_GROUPED_MM, args, {}, mesh, REGISTRY)
    options = candidate_strategies(TORCH_GROUPED_MM, args, {}, mesh, REGISTRY)
    experts_of = (lambda s: s.inputs[1]) if form == "rows" else (lambda s: s.outputs[0])
    split = [s for s in options if experts_of(s).shard_axes(0)]
    if not split:  # uneven blocks with an empty one are not offered
        assert not any(a > 1 and chunks_nonempty(experts, a) for a in mesh), (experts, mesh)
        return
    for strategy in [data.draw(st.sampled_from(split), label="strategy") for _ in range(3)]:
        assert strategy.inputs[2].is_replicated
        check_strategy(TORCH_GROUPED_MM, args, {}, strategy, mesh, REGISTRY)
