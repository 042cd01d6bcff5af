"""Property tests: embedding, attention, softmax, layer norm, losses, gather/scatter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.rules.registry import default_registry
from autopar.testing import MEMORY_LAYOUTS
from autopar.testing.strategies import (
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

SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SOFTMAX = [
    aten._softmax.default,
    aten._safe_softmax.default,
    aten._log_softmax.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
]
BATCH_NORM = [
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit_no_training.default,
    aten._native_batch_norm_legit.no_stats,
    aten.native_batch_norm_backward.default,
]
GROUP_NORM = [aten.native_group_norm.default, aten.native_group_norm_backward.default]
GATHER_SCATTER = [aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default]

COVERED_OPS = [
    *GROUP_NORM,
    aten.embedding.default,
    aten.embedding_dense_backward.default,
    SDPA,
    SDPA_BACKWARD,
    *SOFTMAX,
    aten.native_layer_norm.default,
    aten.native_layer_norm_backward.default,
    aten.nll_loss_forward.default,
    aten.nll_loss_backward.default,
    aten.mse_loss.default,
    aten.mse_loss_backward.default,
    *GATHER_SCATTER,
    aten.index_add.default,
    aten.scatter_reduce.two,
    aten.index_select.default,
    *BATCH_NORM,
    aten.convolution.default,
    aten.convolution_backward.default,
]


def _gen(data: st.DataObject) -> torch.Generator:
    return torch.Generator().manual_seed(data.draw(seeds()))


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_embedding_forward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    _embedding(data, mesh, backward=False)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_embedding_backward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    _embedding(data, mesh, backward=True)


def _embedding(data: st.DataObject, mesh: tuple[int, ...], backward: bool) -> None:
    g = _gen(data)
    vocab, dim = data.draw(dim_sizes(mesh, allow_one=False)), data.draw(dim_sizes(mesh))
    tokens = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=2))
    indices = random_tensor(tokens, torch.int64, generator=g, high=vocab)
    padding = data.draw(st.sampled_from([-1, 0, vocab - 1]))
    if not backward:
        weight = random_tensor((vocab, dim), generator=g)
        assert check_random_strategies(
            data, aten.embedding.default, (weight, indices, padding), {}, mesh, REGISTRY
        )
        return
    grad = random_tensor((*tokens, dim), generator=g)
    scale = data.draw(st.booleans())
    args = (grad, indices, vocab, padding, scale)
    assert check_random_strategies(data, aten.embedding_dense_backward.default, args, {}, mesh, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(max_axes=3))
def test_attention_forward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    _attention(data, mesh, backward=False)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(max_axes=3))
def test_attention_backward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    _attention(data, mesh, backward=True)


def _attention(data: st.DataObject, mesh: tuple[int, ...], backward: bool) -> None:
    g = _gen(data)
    b, h = data.draw(dim_sizes(mesh, cap=6)), data.draw(dim_sizes(mesh, cap=6))
    seq_q, seq_k, e = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    causal = data.draw(st.booleans())
    q = random_tensor((b, h, seq_q, e), generator=g)
    k = random_tensor((b, h, seq_k, e), generator=g)
    v = random_tensor((b, h, seq_k, e), generator=g)
    kwargs: dict = {"scale": data.draw(st.sampled_from([None, 0.3]))}
    if not causal and data.draw(st.booleans()):
        mask_shape = data.draw(st.sampled_from([(seq_q, seq_k), (b, 1, seq_q, seq_k), (b, h, seq_q, seq_k)]))
        kwargs["attn_mask"] = random_tensor(mask_shape, generator=g)
    if not backward:
        assert check_random_strategies(data, SDPA, (q, k, v, 0.0, causal), kwargs, mesh, REGISTRY)
        return
    out, lse = SDPA(q, k, v, 0.0, causal, **kwargs)
    grad = random_tensor(out.shape, generator=g)
    args = (grad, q, k, v, out, lse, 0.0, causal)
    assert check_random_strategies(data, SDPA_BACKWARD, args, kwargs, mesh, REGISTRY)


@pytest.mark.parametrize("op", SOFTMAX, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_softmax(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    g = _gen(data)
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = random_tensor(shape, generator=g)
    if op is aten._safe_softmax.default:  # masked attention: some rows wholly -inf come out 0
        masked = torch.rand(shape, generator=g) < 0.5
        if len(shape) > 1:
            masked[0] = True
        args: tuple = (x.masked_fill(masked, float("-inf")), dim)
    elif op in (aten._softmax.default, aten._log_softmax.default):
        args = (x, dim, False)
    else:
        forward = aten._softmax if op == aten._softmax_backward_data.default else aten._log_softmax
        args = (random_tensor(shape, generator=g), forward.default(x, dim, False), dim, x.dtype)
    assert check_random_strategies(data, op, args, {}, mesh, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_layer_norm_forward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    _layer_norm(data, mesh, backward=False)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_layer_norm_backward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    _layer_norm(data, mesh, backward=True)


def _layer_norm(data: st.DataObject, mesh: tuple[int, ...], backward: bool) -> None:
    g = _gen(data)
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    # prefer leading (splittable) dims and affine params: that is where Partial grads come from
    normalized = list(shape[data.draw(st.sampled_from(range(len(shape) - 1, -1, -1))) :])
    affine = data.draw(st.sampled_from([True, False]))
    weight = random_tensor(normalized, generator=g) if affine else None
    bias = random_tensor(normalized, generator=g) if affine and data.draw(st.booleans()) else None
    x = random_tensor(shape, generator=g)
    if not backward:
        args: tuple = (x, normalized, weight, bias, 1e-5)
        assert check_random_strategies(data, aten.native_layer_norm.default, args, {}, mesh, REGISTRY)
        return
    _, mean, rstd = aten.native_layer_norm.default(x, normalized, weight, bias, 1e-5)
    mask = [
        data.draw(st.booleans()),
        weight is not None and data.draw(st.sampled_from([True, False])),
        bias is not None,
    ]
    grad = random_tensor(shape, generator=g)
    args = (grad, x, normalized, mean, rstd, weight, bias, mask)
    assert check_random_strategies(data, aten.native_layer_norm_backward.default, args, {}, mesh, REGISTRY)


@pytest.mark.parametrize("loss", ["nll", "mse"])
@pytest.mark.parametrize("backward", [False, True])
@settings(max_examples=12, deadline=None)  # per op
@given(data=st.data(), mesh=mesh_shapes(), reduction=st.sampled_from([0, 1, 2]))
def test_losses(data: st.DataObject, mesh: tuple[int, ...], reduction: int, backward: bool, loss: str) -> None:
    g = _gen(data)
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    x, target = random_tensor(shape, generator=g), random_tensor(shape, generator=g)
    if loss == "nll":  # nll_loss: all-replicated only, checked all the same
        n, c = data.draw(dim_sizes(mesh)), data.draw(dim_sizes(mesh, allow_one=False))
        logp = random_tensor((n, c), generator=g).log_softmax(-1)
        labels = random_tensor((n,), torch.int64, generator=g, high=c)
        if n > 1:  # one ignored token (all ignored would make the mean NaN)
            labels[0] = -100
        loss, total = aten.nll_loss_forward.default(logp, labels, None, reduction, -100)
        if backward:
            grad = random_tensor(loss.shape, generator=g)
            args: tuple = (grad, logp, labels, None, reduction, -100, total)
            assert check_random_strategies(data, aten.nll_loss_backward.default, args, {}, mesh, REGISTRY)
        else:
            args = (logp, labels, None, reduction, -100)
            assert check_random_strategies(data, aten.nll_loss_forward.default, args, {}, mesh, REGISTRY)
        return
    if not backward:
        assert check_random_strategies(
            data, aten.mse_loss.default, (x, target, reduction), {}, mesh, REGISTRY
        )
        return
    grad = random_tensor(shape if reduction == 0 else (), generator=g)
    args = (grad, x, target, reduction)
    assert check_random_strategies(data, aten.mse_loss_backward.default, args, {}, mesh, REGISTRY)


@pytest.mark.parametrize("op", GATHER_SCATTER, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_gather_scatter(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    g = _gen(data)
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3, allow_one=False))
    n = len(shape)
    dim = data.draw(st.integers(-n, n - 1))
    size = shape[dim]
    # index: same shape as self except along `dim`; distinct positions along `dim` (scatter is
    # only deterministic without duplicates)
    picked = data.draw(st.integers(1, size)) if op != aten.gather.default else data.draw(dim_sizes(mesh))
    index_shape = list(shape)
    index_shape[dim] = picked
    if op == aten.gather.default:
        index = random_tensor(index_shape, torch.int64, generator=g, high=size)
    else:
        keys = torch.rand(shape, generator=g).argsort(dim=dim)
        index = keys.narrow(dim, 0, picked).contiguous()
    x = random_tensor(shape, generator=g)
    if op == aten.gather.default:
        args: tuple = (x, dim, index)
    elif op in (aten.scatter.src, aten.scatter_add.default):
        args = (x, dim, index, random_tensor(index_shape, generator=g))
    else:
        args = (x, dim, index, data.draw(st.sampled_from([0.0, -1.0])))
    assert check_random_strategies(data, op, args, {}, mesh, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_scatter_reduce(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """src reduced into self at index along `dim`, every reduction TAPAS's segments use, with and
    without self's own values; repeated positions along `dim` (several src values to one place)."""
    g = _gen(data)
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3, allow_one=False))
    n = len(shape)
    dim = data.draw(st.integers(-n, n - 1))
    index_shape = list(shape)
    index_shape[dim] = data.draw(dim_sizes(mesh))
    index = random_tensor(index_shape, torch.int64, generator=g, high=shape[dim])
    reduce = data.draw(st.sampled_from(["sum", "prod", "mean", "amax", "amin"]))
    include_self = data.draw(st.booleans())
    args = (random_tensor(shape, generator=g), dim, index, random_tensor(index_shape, generator=g), reduce)
    assert check_random_strategies(data, aten.scatter_reduce.two, args, {"include_self": include_self}, mesh, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_index_select(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """Rows of `self` picked at `index` along `dim` (repeats allowed; M2M100's position table)."""
    g = _gen(data)
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3, allow_one=False))
    n = len(shape)
    dim = data.draw(st.integers(-n, n - 1))
    rows = data.draw(dim_sizes(mesh))
    index = random_tensor((rows,), torch.int64, generator=g, high=shape[dim])
    args = (random_tensor(shape, generator=g), dim, index)
    assert check_random_strategies(data, aten.index_select.default, args, {}, mesh, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_index_add(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """Mixture-of-experts combine: rows of `source` added into `self` at `index` (repeats add up)."""
    g = _gen(data)
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3, allow_one=False))
    n = len(shape)
    dim = data.draw(st.integers(-n, n - 1))
    rows = data.draw(dim_sizes(mesh))
    index = random_tensor((rows,), torch.int64, generator=g, high=shape[dim])
    source_shape = list(shape)
    source_shape[dim] = rows
    x, source = random_tensor(shape, generator=g), random_tensor(source_shape, generator=g)
    alpha = data.draw(st.sampled_from([1, 2.5]))
    assert check_random_strategies(data, aten.index_add.default, (x, dim, index, source), {"alpha": alpha}, mesh, REGISTRY)


@pytest.mark.parametrize("op", BATCH_NORM, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes(), affine=st.booleans())
def test_batch_norm(data: st.DataObject, mesh: tuple[int, ...], op: object, affine: bool) -> None:
    """The fused ops as one rank traces them (more ranks decompose them: test_decompositions)."""
    g = _gen(data)
    shape = data.draw(tensor_shapes(mesh, min_dims=2, max_dims=4, allow_one=False))
    channels = shape[1]
    x = random_tensor(shape, generator=g)
    weight, bias = (random_tensor((channels,), generator=g) for _ in range(2)) if affine else (None, None)
    mean = random_tensor((channels,), generator=g)
    var = random_tensor((channels,), generator=g).abs() + 0.5
    if op == aten._native_batch_norm_legit_functional.default:
        args: tuple = (x, weight, bias, mean, var, True, 0.1, 1e-5)
    elif op == aten._native_batch_norm_legit_no_training.default:
        args = (x, weight, bias, mean, var, 0.1, 1e-5)
    elif op == aten._native_batch_norm_legit.no_stats:
        args = (x, weight, bias, True, 0.1, 1e-5)
    else:
        train = data.draw(st.booleans())
        _, save_mean, save_rstd, _, _ = aten._native_batch_norm_legit_functional.default(
            x, weight, bias, mean, var, True, 0.1, 1e-5
        )
        grad = random_tensor(shape, generator=g)
        args = (grad, x, weight, mean, var, save_mean, save_rstd, train, 1e-5, [True, affine, affine])
    assert check_random_strategies(data, op, args, {}, mesh, REGISTRY)


@settings(max_examples=50, deadline=None)
@given(data=st.data(), mesh=mesh_shapes(max_axes=3), backward=st.booleans())
def test_convolution(data: st.DataObject, mesh: tuple[int, ...], backward: bool) -> None:
    """1-d and 2-d convolutions (plain, transposed, grouped; strided, padded, dilated), forward
    and backward with every output mask."""
    g = _gen(data)
    spatial = data.draw(st.integers(1, 2))
    groups = data.draw(st.sampled_from([1, 1, 2]))
    batch = data.draw(dim_sizes(mesh, cap=6))
    c_in = groups * data.draw(dim_sizes(mesh, cap=6, allow_one=False))
    c_out = groups * data.draw(dim_sizes(mesh, cap=6, allow_one=False))
    kernel = [data.draw(st.integers(1, 3)) for _ in range(spatial)]
    transposed = data.draw(st.booleans())
    stride = [data.draw(st.integers(1, 2)) for _ in range(spatial)]
    # (a transposed convolution's padding crops its output: none, so that it never vanishes)
    padding = [0 if transposed else data.draw(st.integers(0, 1)) for _ in range(spatial)]
    dilation = [data.draw(st.integers(1, 2)) for _ in range(spatial)]
    # at least the dilated kernel's extent, so that every output has a valid size
    size = [(k - 1) * d + data.draw(st.integers(1, 4)) for k, d in zip(kernel, dilation)]
    if transposed:
        weight_shape = (c_in, c_out // groups, *kernel)
    else:
        weight_shape = (c_out, c_in // groups, *kernel)
    x = random_tensor((batch, c_in, *size), generator=g)
    weight = random_tensor(weight_shape, generator=g)
    bias = random_tensor((c_out,), generator=g) if data.draw(st.booleans()) else None
    conv_args = (stride, padding, dilation, transposed, [0] * spatial, groups)
    if not backward:
        args: tuple = (x, weight, bias, *conv_args)
        assert check_random_strategies(data, aten.convolution.default, args, {}, mesh, REGISTRY)
        return
    out = aten.convolution.default(x, weight, bias, *conv_args)
    grad = random_tensor(out.shape, generator=g)
    mask = data.draw(
        st.lists(st.booleans(), min_size=3, max_size=3).filter(lambda m: any(m[:2]) or bias is not None)
    )
    mask[2] = mask[2] and bias is not None
    if not any(mask):
        mask[1] = True
    bias_sizes = [c_out] if bias is not None else None
    args = (grad, x, weight, bias_sizes, *conv_args, mask)
    assert check_random_strategies(data, aten.convolution_backward.default, args, {}, mesh, REGISTRY)


@pytest.mark.parametrize("op", GROUP_NORM, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes(), affine=st.booleans(), groups=st.sampled_from([1, 2]))
def test_group_norm(data: st.DataObject, mesh: tuple[int, ...], op: object, affine: bool, groups: int) -> None:
    """Per-sample statistics: the batch splits (N passed as each rank's block of it)."""
    g = _gen(data)
    shape = list(data.draw(tensor_shapes(mesh, min_dims=2, max_dims=4, allow_one=False)))
    shape[1] = 2 * groups
    n, channels, hxw = shape[0], shape[1], int(torch.tensor(shape[2:]).prod()) if len(shape) > 2 else 1
    x = random_tensor(tuple(shape), generator=g)
    weight, bias = (random_tensor((channels,), generator=g) for _ in range(2)) if affine else (None, None)
    if op == aten.native_group_norm.default:
        args: tuple = (x, weight, bias, n, channels, hxw, groups, 1e-5)
    else:
        _, mean, rstd = aten.native_group_norm.default(x, weight, bias, n, channels, hxw, groups, 1e-5)
        grad = random_tensor(tuple(shape), generator=g)
        args = (grad, x, mean, rstd, weight, n, channels, hxw, groups, [True, affine, affine])
    # a rank's blocks may have other strides than serial's (the kernels read raw memory in x's format)
    assert check_random_strategies(data, op, args, {}, mesh, REGISTRY, memory_layouts=MEMORY_LAYOUTS)
