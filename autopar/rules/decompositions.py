"""Decompositions applied before propagation when the mesh has more than one rank.

Fused ops whose reductions run over a dim we may want to split are rewritten into sums and
pointwise ops, so that a split dim becomes a Partial sum (a small all-reduce) instead of an
all-gather of the whole activation. Layer norm is written with sums (not var_mean) for that reason;
batch norm too, so a batch split across ranks gets the global batch's statistics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from autopar.core.errors import TraceError
from autopar.core.meta import where_of

aten = torch.ops.aten


def _layer_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    count = 1
    for s in normalized_shape:
        count *= s
    mean = aten.sum.dim_IntList(x, dims, True) / count
    centered = x - mean
    var = aten.sum.dim_IntList(centered * centered, dims, True) / count
    rstd = aten.rsqrt.default(var + eps)
    out = centered * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out, mean, rstd


def _layer_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    axis = x.dim() - len(normalized_shape)
    inner = list(range(axis, x.dim()))
    outer = list(range(axis))
    count = 1
    for s in normalized_shape:
        count *= s
    xhat = (x - mean) * rstd
    g = grad_out * weight if weight is not None else grad_out
    grad_x = grad_w = grad_b = None
    if output_mask[0]:
        sum_g = aten.sum.dim_IntList(g, inner, True)
        sum_gx = aten.sum.dim_IntList(g * xhat, inner, True)
        grad_x = (g - sum_g / count - xhat * (sum_gx / count)) * rstd
    if output_mask[1] and weight is not None:
        grad_w = aten.sum.dim_IntList(grad_out * xhat, outer, False) if outer else grad_out * xhat
    if output_mask[2] and bias is not None:
        grad_b = aten.sum.dim_IntList(grad_out, outer, False) if outer else grad_out.clone()
    return grad_x, grad_w, grad_b


def _channel_shape(x: torch.Tensor) -> list[int]:
    """(1, C, 1, ...): a per-channel vector broadcast against an (N, C, ...) input."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _per_channel_affine(
    normalized: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    out = normalized
    if weight is not None:
        out = out * weight.reshape(_channel_shape(normalized))
    if bias is not None:
        out = out + bias.reshape(_channel_shape(normalized))
    return out


def _batch_norm_training(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_native_batch_norm_legit_functional` with sums: statistics over a batch split across ranks
    are Partial sums (an all-reduce of C values), so every rank normalizes by the global batch's
    statistics and the running stats update as the serial model's do."""
    if not training:
        out, _, _ = _batch_norm_inference(x, weight, bias, running_mean, running_var, momentum, eps)
        empty = x.new_zeros((0,))
        return out, empty, empty, running_mean.clone(), running_var.clone()
    out, flat_mean, flat_rstd, flat_var = _batch_statistics(x, weight, bias, eps)
    count = x.numel() // x.shape[1]
    unbiased = flat_var * (count / max(count - 1, 1))
    new_mean = running_mean * (1 - momentum) + flat_mean * momentum
    new_var = running_var * (1 - momentum) + unbiased * momentum
    return out, flat_mean, flat_rstd, new_mean, new_var


def _batch_statistics(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normalized output, mean, 1/std, biased variance) over the batch and spatial dims, as sums."""
    dims = [0, *range(2, x.dim())]
    count = x.numel() // x.shape[1]
    mean = aten.sum.dim_IntList(x, dims, True) / count
    centered = x - mean
    var = aten.sum.dim_IntList(centered * centered, dims, True) / count
    rstd = aten.rsqrt.default(var + eps)
    out = _per_channel_affine(centered * rstd, weight, bias)
    return out, mean.reshape(-1), rstd.reshape(-1), var.reshape(-1)


def _batch_norm_no_stats(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_native_batch_norm_legit.no_stats`: batch statistics without running ones (BiT's weight
    standardization calls `F.batch_norm(w, None, None, training=True)`)."""
    out, mean, rstd, _ = _batch_statistics(x, weight, bias, eps)
    return out, mean, rstd


def _batch_norm_inference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_native_batch_norm_legit_no_training`: the running statistics, pointwise per channel."""
    shape = _channel_shape(x)
    rstd = aten.rsqrt.default(running_var + eps)
    out = _per_channel_affine((x - running_mean.reshape(shape)) * rstd.reshape(shape), weight, bias)
    empty = x.new_zeros((0,))
    return out, empty, empty


def _batch_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    save_mean: torch.Tensor | None,
    save_invstd: torch.Tensor | None,
    train: bool,
    eps: float,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`native_batch_norm_backward` with sums over the batch and spatial dims (Partial when split)."""
    shape = _channel_shape(x)
    dims = [0, *range(2, x.dim())]
    count = x.numel() // x.shape[1]
    if train:
        assert save_mean is not None and save_invstd is not None
        mean, invstd = save_mean.reshape(shape), save_invstd.reshape(shape)
    else:
        assert running_mean is not None and running_var is not None
        mean, invstd = running_mean.reshape(shape), aten.rsqrt.default(running_var + eps).reshape(shape)
    xhat = (x - mean) * invstd
    g = grad_out * weight.reshape(shape) if weight is not None else grad_out
    grad_x = grad_w = grad_b = None
    if output_mask[0]:
        if train:
            sum_g = aten.sum.dim_IntList(g, dims, True)
            sum_gx = aten.sum.dim_IntList(g * xhat, dims, True)
            grad_x = (g - sum_g / count - xhat * (sum_gx / count)) * invstd
        else:
            grad_x = g * invstd
    if output_mask[1]:
        grad_w = aten.sum.dim_IntList(grad_out * xhat, dims, False)
    if output_mask[2]:
        grad_b = aten.sum.dim_IntList(grad_out, dims, False)
    return grad_x, grad_w, grad_b


def _weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`w = g * v / ||v||`, the norm over every dim but `dim` (kept as size 1; float32 for a
    bfloat16 `g`, as the kernels keep it). torch's own decomposition takes the norm over every dim
    when `v` has no other dim (a 1-D weight), where the kernel takes each element's magnitude.
    `dim` defaults to 0 as in the op's schema: the trace hands a decomposition its arguments with
    the defaulted ones left out, so `weight_norm(linear)` (dim 0) calls this with two."""
    dims = [d for d in range(v.dim()) if d != dim]
    norm_dtype = torch.float32 if g.dtype == torch.bfloat16 else None
    norm = v.norm(2, dims, keepdim=True, dtype=norm_dtype) if dims else v.abs().to(norm_dtype or v.dtype)
    return v * (g / norm.to(g.dtype)), norm


def _weight_norm_backward(
    grad_w: torch.Tensor, v: torch.Tensor, g: torch.Tensor, norms: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `w = g * v / ||v||` (the norm over every dim but `dim`, all dims for -1, kept
    as size 1; `norms` is the forward's): torch has no decomposition for this backward, and its
    fused kernel has no sharding rule, while its pieces (products, sums over dims) have."""
    dims = [d for d in range(v.dim()) if d != dim]
    along = (grad_w * v).sum(dims, keepdim=True) if dims else grad_w * v  # sum over [] sums every dim
    norms = norms.to(g.dtype)
    grad_g = along / norms
    grad_v = (g / norms) * (grad_w - v * (along / (norms * norms)))
    return grad_v, grad_g


def _target_dtype_checked(decomposition: Callable[..., Any]) -> Callable[..., Any]:
    """`nll_loss` as decomposed, refusing the targets the kernel refuses (int32: "expected target
    dtype to be Long or Byte"): the decomposition would index with any integer dtype, and the
    fake-tensor trace never runs the kernel's check, so a model serial training rejects would
    train."""

    @functools.wraps(decomposition)
    def checked(x: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if target.dtype not in TARGET_DTYPES:
            raise RuntimeError(_target_dtype_message(target.dtype))
        return decomposition(x, target, *args, **kwargs)

    return checked


def _one_reduction_mean(decomposition: Callable[..., Any]) -> Callable[..., Any]:
    """`nll_loss` with a mean over unweighted float32/64 rows, its two sums (the rows' losses, the
    count of targets other than `ignore_index`) stacked into one pair: split rows then leave one
    pending sum of 2 numbers, one all-reduce, where the sums apart were two collectives (the
    count's bool summands cannot carry a pending sum, so the plan gathered the mask, then the
    losses); the planners' per-collective cost (`search_cost.CALL_ELEMENTS` in element counts,
    `Link.call` on a table) makes that one collective the cheaper plan. The pair has one reader,
    `unbind`, so settling it is one edge of the search: read by two `select`s, both and the division
    had to move at once, which the search's block moves do not reach. The count, summed in the
    loss's float dtype, is exact below 2**24 targets. Half-precision counts would round, and
    weighted or 1-D calls keep torch's decomposition."""

    @functools.wraps(decomposition)
    def stacked(x: torch.Tensor, target: torch.Tensor, weight: Any, reduction: int, ignore_index: int) -> Any:
        if reduction != 1 or weight is not None or x.dim() != 2 or x.dtype not in (torch.float32, torch.float64):
            return decomposition(x, target, weight, reduction, ignore_index)
        rows, _ = decomposition(x, target, None, 0, ignore_index)
        sums = torch.stack([rows.sum(), (target != ignore_index).to(x.dtype).sum()])
        total, count = sums.unbind()
        return total / count, count

    return stacked


TARGET_DTYPES = (torch.long, torch.uint8)  # the class-index targets torch's nll_loss kernels take
_NLL_FORWARDS = (torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss2d_forward.default)


def _target_dtype_message(dtype: torch.dtype) -> str:
    name = {torch.int32: "Int", torch.int16: "Short", torch.int8: "Char"}.get(dtype, str(dtype))
    return f"expected target dtype to be Long or Byte, but got {name}"


def refuse_target_dtypes(gm: torch.fx.GraphModule, model_name: str) -> None:
    """On a 1-rank mesh nothing is decomposed, and the fake-tensor trace of `nll_loss` checks no
    target dtype: refuse at compile time the targets the kernel refuses at the call (int32), as
    the decomposed trace does on more ranks, instead of torch's error from inside the program."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _NLL_FORWARDS:
            continue
        target = node.args[1]
        value = target.meta.get("val") if isinstance(target, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and value.dtype not in TARGET_DTYPES:
            raise TraceError(
                f"building the joint forward+backward graph of {model_name} failed: RuntimeError: "
                f"{_target_dtype_message(value.dtype)} (the class-index targets of the loss at {where_of(node)})",
                hint="pass class-index targets as torch.long, e.g. y.long(), as serial torch requires",
            )


LOSS_DECOMPOSED = (
    aten.binary_cross_entropy_with_logits.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_backward.default,
    aten.smooth_l1_loss.default,
    aten.smooth_l1_loss_backward.default,
    aten.huber_loss.default,
    aten.huber_loss_backward.default,
    aten.xlogy.Tensor,
    aten.log_sigmoid_forward.default,
    aten.log_sigmoid_backward.default,
    aten.vdot.default,
)


def sharding_decompositions() -> dict[Any, Callable[..., Any]]:
    from torch._decomp import decomposition_table

    table: dict[Any, Callable[..., Any]] = {
        aten.native_layer_norm.default: _layer_norm,
        aten.native_layer_norm_backward.default: _layer_norm_backward,
        aten._native_batch_norm_legit_functional.default: _batch_norm_training,
        aten._native_batch_norm_legit_no_training.default: _batch_norm_inference,
        aten._native_batch_norm_legit.no_stats: _batch_norm_no_stats,
        aten.native_batch_norm_backward.default: _batch_norm_backward,
        aten._weight_norm_interface.default: _weight_norm,  # wav2vec2's positional convolution
        aten._weight_norm_interface_backward.default: _weight_norm_backward,
    }
    for op in (
        aten.nll_loss_forward.default,
        aten.nll_loss_backward.default,
        aten.nll_loss2d_forward.default,  # segmentation: cross entropy over (N, C, H, W) logits
        aten.nll_loss2d_backward.default,
        aten.mse_loss.default,
        aten.mse_loss_backward.default,
        # the losses models compute inside forward (transformers' multi-label classification, KL
        # divergence, robust regression) and spectral_norm's power iteration: fused kernels without
        # sharding rules, written by torch as pointwise ops and sums, which have them
        *LOSS_DECOMPOSED,
    ):
        table[op] = decomposition_table[op]
    table[aten.nll_loss_forward.default] = _one_reduction_mean(table[aten.nll_loss_forward.default])
    for op in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default):
        table[op] = _target_dtype_checked(table[op])
    return table
