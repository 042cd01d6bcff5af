"""Property tests: reductions (Partial over split reduced dims, renumbered kept dims)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.rules.registry import default_registry
from autopar.testing.strategies import (
    check_random_strategies,
    mesh_shapes,
    random_tensor,
    seeds,
    tensor_shapes,
)

aten = torch.ops.aten
REGISTRY = default_registry()

# Ops taking (self, dims, keepdim) positionally.
DIM_LIST_OPS = [
    aten.sum.dim_IntList,
    aten.mean.dim,
    aten.amax.default,
    aten.amin.default,
    aten.logsumexp.default,
]
SINGLE_DIM_OPS = [aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim, aten.any.dim]
CORRECTION_OPS = [aten.var_mean.correction, aten.var.correction, aten.std.correction]
ALL_OPS = [aten.sum.default, aten.mean.default]

ALONG_DIM_OPS = [aten.sort.default, aten.sort.stable, aten.topk.default]
FFT_OPS = [aten._fft_c2c.default, aten._fft_r2c.default, aten._fft_c2r.default]
COVERED_OPS = [
    *FFT_OPS,
    *DIM_LIST_OPS,
    *SINGLE_DIM_OPS,
    *CORRECTION_OPS,
    *ALL_OPS,
    aten.cumsum.default,
    *ALONG_DIM_OPS,
    aten.linalg_vector_norm.default,
    aten.histc.default,
    aten.nonzero_static.default,
]


@pytest.mark.parametrize("op", DIM_LIST_OPS + SINGLE_DIM_OPS + CORRECTION_OPS + ALL_OPS, ids=str)
@settings(max_examples=10, deadline=None)  # per op
@given(data=st.data(), mesh=mesh_shapes())
def test_reductions(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    ndim = len(shape)
    dtype = torch.bool if op == aten.any.dim else torch.float64
    if op == aten.sum.dim_IntList and data.draw(st.booleans()):
        dtype = torch.int64  # integer sums may stay Partial too
    x = random_tensor(shape, dtype, generator=g)
    keepdim = data.draw(st.booleans())
    dims = data.draw(
        st.lists(st.integers(-ndim, ndim - 1), min_size=1, max_size=ndim, unique_by=lambda d: d % ndim)
    )
    kwargs: dict = {}
    if op in ALL_OPS:
        args: tuple = (x,)
    elif op in DIM_LIST_OPS:
        args = (x, dims, keepdim)
    elif op in SINGLE_DIM_OPS:
        dim = (
            None if op in (aten.argmax.default, aten.argmin.default) and data.draw(st.booleans()) else dims[0]
        )
        args = (x, dim, keepdim)
    else:
        reduce = data.draw(st.sampled_from([dims, None]))
        count = 1
        for d in range(ndim) if reduce is None else reduce:
            count *= shape[d]
        # correction 1 over a single element is NaN, which never compares equal
        correction = data.draw(st.sampled_from([0, 1])) if count > 1 else 0
        args = (x, reduce)
        kwargs = {"correction": correction, "keepdim": keepdim}
    assert check_random_strategies(data, op, args, kwargs, mesh, REGISTRY)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), mesh=mesh_shapes(), order=st.sampled_from([2, 1, 3.0, float("inf")]))
def test_vector_norm(data: st.DataObject, mesh: tuple[int, ...], order: float) -> None:
    """`torch.linalg.vector_norm(x, ord, dim, keepdim)`, over some dims or all (dim=None)."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    ndim = len(shape)
    dims = data.draw(
        st.one_of(
            st.none(),
            st.lists(st.integers(-ndim, ndim - 1), min_size=1, max_size=ndim, unique_by=lambda d: d % ndim),
        )
    )
    x = random_tensor(shape, torch.float64, generator=g)
    args = (x, order, dims, data.draw(st.booleans()))
    assert check_random_strategies(data, aten.linalg_vector_norm.default, args, {}, mesh, REGISTRY)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), mesh=mesh_shapes())
def test_cumsum(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """Scans keep their dim whole; bool inputs (attention-mask position ids) count up as int64."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    dtype = data.draw(st.sampled_from([torch.float64, torch.int64, torch.bool]))
    x = random_tensor(shape, dtype, generator=g)
    kwargs = {"dtype": torch.float64} if dtype == torch.int64 and data.draw(st.booleans()) else {}
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    assert check_random_strategies(data, aten.cumsum.default, (x, dim), kwargs, mesh, REGISTRY)


@pytest.mark.parametrize("op", ALONG_DIM_OPS, ids=str)
@settings(max_examples=10, deadline=None)  # per op
@given(data=st.data(), mesh=mesh_shapes())
def test_sort_and_topk(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    """Mixture-of-experts routing picks the top k experts per token; distinct values (ties would
    make the indices depend on the sort's stability)."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    ndim = len(shape)
    x = torch.randperm(int(torch.tensor(shape).prod()), generator=g).reshape(shape).double()
    dim = data.draw(st.integers(-ndim, ndim - 1))
    flip = data.draw(st.booleans())
    if op == aten.topk.default:
        k = data.draw(st.integers(1, shape[dim]))
        args: tuple = (x, k, dim, flip, True)
        kwargs: dict = {}
    elif op == aten.sort.stable:
        args, kwargs = (x,), {"stable": True, "dim": dim, "descending": flip}
    else:
        args, kwargs = (x, dim, flip), {}
    assert check_random_strategies(data, op, args, kwargs, mesh, REGISTRY)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), mesh=mesh_shapes())
def test_histogram(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """`torch.histc(expert_ids.float(), bins=E, min=0, max=E - 1)`: tokens per expert."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=2))
    bins = data.draw(st.integers(1, 6))
    x = random_tensor(shape, torch.int64, generator=g, high=bins).to(torch.float64)
    assert check_random_strategies(data, aten.histc.default, (x, bins, 0, bins - 1), {}, mesh, REGISTRY)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), mesh=mesh_shapes())
def test_nonzero_static(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """An end-of-sequence mask's coordinates at a fixed count (fewer than it holds, as many, more:
    filled with -1)."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    mask = random_tensor(shape, torch.int64, generator=g, high=2).to(torch.bool)
    size = data.draw(st.integers(0, int(mask.numel()) + 2))
    assert check_random_strategies(data, aten.nonzero_static.default, (mask,), {"size": size}, mesh, REGISTRY)


@pytest.mark.parametrize("op", FFT_OPS, ids=str)
@settings(max_examples=15, deadline=None)
@given(data=st.data(), mesh=mesh_shapes(), two=st.booleans())
def test_fft(data: st.DataObject, mesh: tuple[int, ...], op: object, two: bool) -> None:
    """FNet's token mixing: the transformed dims stay whole, the others split."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=2, max_dims=3))
    dims = [len(shape) - 2, len(shape) - 1] if two else [len(shape) - 1]
    x = random_tensor(shape, generator=g)
    if op == aten._fft_c2c.default:
        args: tuple = (torch.complex(x, random_tensor(shape, generator=g)), dims, 0, True)
    elif op == aten._fft_r2c.default:
        args = (x, dims, 0, True)
    else:  # the inverse of a one-sided transform: last dim n // 2 + 1 -> n
        half = torch.fft.rfftn(x, dim=dims)
        args = (half, dims, 2, shape[-1])
    assert check_random_strategies(data, op, args, {}, mesh, REGISTRY)
