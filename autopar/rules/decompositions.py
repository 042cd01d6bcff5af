"""Decompositions applied before propagation when the mesh has more than one rank.

Fused ops whose reductions run over a dim we may want to split are rewritten into sums and
pointwise ops, so that a split dim becomes a Partial sum (a small all-reduce) instead of an
all-gather of the whole activation. Layer norm is written with sums (not var_mean) for that reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

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


def sharding_decompositions() -> dict[Any, Callable[..., Any]]:
    from torch._decomp import decomposition_table

    table: dict[Any, Callable[..., Any]] = {
        aten.native_layer_norm.default: _layer_norm,
        aten.native_layer_norm_backward.default: _layer_norm_backward,
    }
    for op in (
        aten.nll_loss_forward.default,
        aten.nll_loss_backward.default,
        aten.mse_loss.default,
        aten.mse_loss_backward.default,
    ):
        table[op] = decomposition_table[op]
    return table
