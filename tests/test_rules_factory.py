"""Property tests: factories (arange blocks, constant fills, *_like)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.rules.base import make_call
from autopar.rules.registry import default_registry
from autopar.testing import run_local
from autopar.testing.strategies import (
    candidate_strategies,
    check_random_strategies,
    dim_sizes,
    mesh_shapes,
    random_tensor,
    seeds,
    tensor_shapes,
)

# Each op of a family gets its own examples (sampling the op would leave some untested).
PER_OP = settings(max_examples=8, deadline=None)

aten = torch.ops.aten
REGISTRY = default_registry()
SETTINGS = settings(max_examples=30, deadline=None)

ARANGES = [aten.arange.default, aten.arange.start, aten.arange.start_step]
FILLS = [aten.zeros.default, aten.ones.default, aten.full.default]
LIKES = [aten.zeros_like.default, aten.ones_like.default, aten.full_like.default]
EMPTIES = [
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.empty_strided.default,
    aten.new_empty_strided.default,
]
EYES = [aten.eye.default, aten.eye.m]
NEW_FILLS = [aten.new_ones.default, aten.new_zeros.default, aten.new_full.default]

FILL_VALUES = [aten.fill.Scalar, aten.fill.Tensor]
COVERED_OPS = [*ARANGES, *FILLS, *LIKES, *EMPTIES, *NEW_FILLS, aten.scalar_tensor.default, *FILL_VALUES, *EYES]


@pytest.mark.parametrize("op", ARANGES, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_arange(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    length = data.draw(dim_sizes(mesh))
    dtype = data.draw(st.sampled_from([None, torch.float64, torch.int64]))
    kwargs = {} if dtype is None else {"dtype": dtype}
    if op == aten.arange.default:
        args: tuple = (length,)
    elif op == aten.arange.start:
        start = data.draw(st.integers(-5, 5))
        args = (start, start + length)
    else:
        start = data.draw(st.sampled_from([-3, 0, 2, 0.5]))
        step = data.draw(st.sampled_from([1, 2, -1, 0.25] if dtype != torch.int64 else [1, 2, -1]))
        args = (start, start + length * step, step)
    check_random_strategies(data, op, args, kwargs, mesh, REGISTRY)


@pytest.mark.parametrize("op", FILLS + LIKES + [aten.scalar_tensor.default], ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_fills(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    dtype = data.draw(st.sampled_from([torch.float64, torch.int64]))
    x = random_tensor(shape, dtype, generator=torch.Generator().manual_seed(data.draw(seeds())))
    if op == aten.scalar_tensor.default:
        args: tuple = (2.5,)
    elif op == aten.full.default:
        args = (list(shape), 7)
    elif op == aten.full_like.default:
        args = (x, 7)
    elif op in LIKES:
        args = (x,)
    else:
        args = (list(shape),)
    check_random_strategies(data, op, args, {"dtype": dtype}, mesh, REGISTRY)


@pytest.mark.parametrize("op", EMPTIES, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_empty_shapes(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    """Values of `empty` are arbitrary: check every rank's local shape only."""
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    if op == aten.empty.memory_format:
        args: tuple = (list(shape),)
    elif op == aten.new_empty.default:
        args = (torch.zeros(data.draw(tensor_shapes(mesh, min_dims=0, max_dims=2))), list(shape))
    elif op in (aten.empty_strided.default, aten.new_empty_strided.default):
        strides = list(torch.empty(list(reversed(shape))).permute(*reversed(range(len(shape)))).stride())
        args = (list(shape), strides)  # column-major, as a transposed buffer
        if op == aten.new_empty_strided.default:
            args = (torch.zeros(data.draw(tensor_shapes(mesh, min_dims=0, max_dims=2))), *args)
    else:
        args = (torch.zeros(shape),)
    strategy = data.draw(st.sampled_from(candidate_strategies(op, args, {}, mesh, REGISTRY)))
    call = make_call(op, args, {}, op(*args))
    outputs, _ = run_local(call, strategy, args, {}, mesh, REGISTRY)
    layout = strategy.outputs[0]
    assert all(tuple(outs[0].shape) == layout.local_shape(mesh, c) for c, outs in outputs.items())


@pytest.mark.parametrize("op", NEW_FILLS, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_new_fills(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    """`x.new_ones(size)`: x (any layout, any shape) gives only the dtype; size may be () too."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    src = random_tensor(data.draw(tensor_shapes(mesh, min_dims=0, max_dims=3)), generator=g)
    shape = data.draw(tensor_shapes(mesh, min_dims=0, max_dims=3))
    args: tuple = (src, list(shape), 7) if op == aten.new_full.default else (src, list(shape))
    dtype = data.draw(st.sampled_from([torch.float64, torch.int64, torch.bool]))
    check_random_strategies(data, op, args, {"dtype": dtype}, mesh, REGISTRY)


@pytest.mark.parametrize("op", FILL_VALUES, ids=str)
@settings(max_examples=15, deadline=None)
@given(data=st.data(), mesh=mesh_shapes())
def test_fill_with_a_value(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    x = random_tensor(shape, generator=g)
    value = random_tensor((), generator=g) if op == aten.fill.Tensor else 2.5
    assert check_random_strategies(data, op, (x, value), {}, mesh, REGISTRY)


@pytest.mark.parametrize("op", EYES, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_eye(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    """`torch.eye(n)` / `torch.eye(n, m)` (gated delta-rule models): any block of the identity."""
    n, m = data.draw(dim_sizes(mesh)), data.draw(dim_sizes(mesh))
    args: tuple = (n,) if op == aten.eye.default else (n, m)
    dtype = data.draw(st.sampled_from([torch.float64, torch.int64, torch.bool]))
    check_random_strategies(data, op, args, {"dtype": dtype}, mesh, REGISTRY)
