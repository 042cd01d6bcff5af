"""Property tests: pooling and im2col/col2im, forward and backward, against the oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.rules.registry import default_registry
from autopar.testing.strategies import check_random_strategies, dim_sizes, mesh_shapes, random_tensor, seeds

aten = torch.ops.aten
REGISTRY = default_registry()
PER_OP = settings(max_examples=12, deadline=None)

FORWARD = [aten.avg_pool2d.default, aten._adaptive_avg_pool2d.default, aten.max_pool2d_with_indices.default]
BACKWARD = {
    aten.avg_pool2d.default: aten.avg_pool2d_backward.default,
    aten._adaptive_avg_pool2d.default: aten._adaptive_avg_pool2d_backward.default,
    aten.max_pool2d_with_indices.default: aten.max_pool2d_with_indices_backward.default,
}
COVERED_OPS = [*FORWARD, *BACKWARD.values(), aten.im2col.default, aten.col2im.default]


@st.composite
def images(draw: st.DrawFn, mesh: tuple[int, ...]) -> torch.Tensor:
    """(N, C, H, W), or unbatched (C, H, W), with batch and channel sizes that split on the mesh."""
    g = torch.Generator().manual_seed(draw(seeds()))
    planes = [draw(dim_sizes(mesh)) for _ in range(draw(st.integers(1, 2)))]
    return random_tensor((*planes, draw(st.integers(3, 6)), draw(st.integers(3, 6))), generator=g)


def _pool_args(op: object, x: torch.Tensor, data: st.DataObject) -> tuple:
    if op == aten._adaptive_avg_pool2d.default:
        return (x, [data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))])
    kernel = [data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))]
    stride = [data.draw(st.integers(1, 2))] * 2
    padding = [data.draw(st.integers(0, min(kernel) // 2))] * 2
    if op == aten.max_pool2d_with_indices.default:
        return (x, kernel, stride, padding, [1, 1], data.draw(st.booleans()))
    return (x, kernel, stride, padding, data.draw(st.booleans()), data.draw(st.booleans()))


@pytest.mark.parametrize("op", FORWARD, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_pooling(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    x = data.draw(images(mesh))
    assert check_random_strategies(data, op, _pool_args(op, x, data), {}, mesh, REGISTRY)


@pytest.mark.parametrize("forward", FORWARD, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_pooling_backward(data: st.DataObject, mesh: tuple[int, ...], forward: object) -> None:
    """Each backward on the gradient of its forward's output (the indices max pooling picked)."""
    x = data.draw(images(mesh))
    args = _pool_args(forward, x, data)
    out = forward(*args)  # type: ignore[operator]
    values = out[0] if isinstance(out, tuple) else out
    grad = torch.randn_like(values)
    op = BACKWARD[forward]
    if forward == aten.max_pool2d_with_indices.default:
        back: tuple = (grad, *args, out[1])
    elif forward == aten._adaptive_avg_pool2d.default:
        back = (grad, x)
    else:
        back = (grad, *args, None)  # divisor_override
    assert check_random_strategies(data, op, back, {}, mesh, REGISTRY)


@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_im2col_and_col2im(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """`F.unfold` and its adjoint `F.fold` (ConvBERT's span convolution, MobileViT-V2)."""
    x = data.draw(images(mesh))
    kernel = [data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))]
    dilation, padding, stride = [1, 1], [data.draw(st.integers(0, 1))] * 2, [data.draw(st.integers(1, 2))] * 2
    assert check_random_strategies(data, aten.im2col.default, (x, kernel, dilation, padding, stride), {}, mesh, REGISTRY)
    cols = aten.im2col.default(x, kernel, dilation, padding, stride)
    size = list(x.shape[-2:])
    args = (torch.randn_like(cols), size, kernel, dilation, padding, stride)
    assert check_random_strategies(data, aten.col2im.default, args, {}, mesh, REGISTRY)
