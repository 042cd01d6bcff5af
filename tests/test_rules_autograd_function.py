"""Property tests: the custom-Function ops (`autopar/rules/autograd_function.py`), forward and
backward, against the in-process oracle, with the splits verified for each Function: any dim of an
elementwise Function, every dim but the running one of a running sum."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_autograd_function_ops import DampedCumsum
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.core.layout import Shard
from autopar.passes.autograd_functions import functions_as_ops, verify_function_splits
from autopar.rules.autograd_function import (
    AUTOGRAD_FUNCTION,
    AUTOGRAD_FUNCTION_BACKWARD,
    FunctionTable,
    autograd_function,
    entry_key,
    tracing_functions,
)
from autopar.rules.registry import default_registry
from autopar.testing.strategies import check_random_strategies, dim_sizes, mesh_shapes, random_tensor, seeds

REGISTRY = default_registry()


class SoftClip(torch.autograd.Function):
    """Clipped to [-1, 1] forward, a smooth surrogate gradient backward (1 - tanh(x)^2): an
    elementwise Function defined on every real, whose backward reads a saved input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp(-1.0, 1.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * (1 - torch.tanh(x) ** 2)

COVERED_OPS = [AUTOGRAD_FUNCTION, AUTOGRAD_FUNCTION_BACKWARD]
CASES: dict[str, tuple[type, tuple[Any, ...]]] = {
    "soft_clip": (SoftClip, ()),
    "damped_cumsum": (DampedCumsum, (1, {"damping": 0.5})),
}


def _verified_key(function: type, x: torch.Tensor, extra: tuple[Any, ...]) -> tuple[str, FunctionTable]:
    """The op key of `function` applied to `x` (as a trace records it) and that trace's table,
    its splits verified at this example's shapes."""
    leaf = x.detach().requires_grad_(True)
    with functions_as_ops(True) as table:
        function.apply(leaf, *extra)  # type: ignore[attr-defined]
        key = entry_key(function, (leaf, *extra), (0,))
        assert key in table.entries
        gm = make_fx(lambda t: autograd_function([t], key)[0], tracing_mode="fake")(x)
    verify_function_splits(gm, table, REGISTRY)
    return key, table


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=8, deadline=None)
@given(data=st.data(), mesh=mesh_shapes(max_axes=2))
def test_function_ops(data: st.DataObject, mesh: tuple[int, ...], case: str) -> None:
    function, extra = CASES[case]
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = tuple(data.draw(dim_sizes(mesh)) for _ in range(3))
    x = random_tensor(shape, generator=g)
    key, table = _verified_key(function, x, extra)
    found = table.entries[key]
    split_dims = {p.dim for s in found.forward_strategies for p in s.inputs if isinstance(p, Shard)}
    allowed = {0, 2} if case == "damped_cumsum" else {0, 1, 2}  # never the running dim
    assert split_dims <= allowed and {d for d in allowed if shape[d] > 1} <= split_dims, (shape, split_dims)
    grad = random_tensor(shape, generator=g)
    with tracing_functions(table):  # the op's calls made here name no node: they read the trace's table
        assert check_random_strategies(data, AUTOGRAD_FUNCTION, ([x], key), {}, mesh, REGISTRY)
        assert check_random_strategies(data, AUTOGRAD_FUNCTION_BACKWARD, ([x], [grad], key), {}, mesh, REGISTRY)
