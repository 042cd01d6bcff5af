"""Property tests: matmul family (mm, bmm, addmm, baddbmm, mv, dot) against the oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.rules.registry import default_registry
from autopar.testing.strategies import check_random_strategies, dim_sizes, mesh_shapes, random_tensor, seeds

# Each op of a family gets its own examples (sampling the op would leave some untested).
PER_OP = settings(max_examples=8, deadline=None)

aten = torch.ops.aten
REGISTRY = default_registry()
SETTINGS = settings(max_examples=30, deadline=None)

COVERED_OPS = [
    aten.mm.default,
    aten.bmm.default,
    aten.addmm.default,
    aten.baddbmm.default,
    aten.mv.default,
    aten.dot.default,
]


@pytest.mark.parametrize("op", COVERED_OPS, ids=str)
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
