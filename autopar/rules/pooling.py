"""Sliding-window ops of vision models: pooling and im2col/col2im.

A window spans spatial neighbours, so spatial dims stay whole (a split would need halos); the
batch and channel dims are independent planes and split freely. Average pooling and the
im2col/col2im pair are linear, so a pending sum passes through them; max pooling picks per plane
and its indices count within a plane, so they do not depend on the split either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autopar.core.layout import P, Placement, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall
from autopar.rules.base import RuleRegistry, with_replicated
from autopar.rules.pointwise import partial_ok

aten = torch.ops.aten

FAMILY = "pooling"


def _plane_dims(call: OpCall, spatial: int) -> list[int]:
    """The leading (batch, channel) dims of the first input: all but its `spatial` trailing ones."""
    return list(range(call.inputs[0].ndim - spatial))


def plane_rule(spatial: int, linear_in: tuple[int, ...] | None) -> Callable[[OpCall], list[AxisStrategy]]:
    """Every tensor input and output split alike on a batch or channel dim; if `linear_in` is
    given, Partial on those inputs (the others whole) gives Partial outputs."""

    def rule(call: OpCall) -> list[AxisStrategy]:
        n_in, n_out = len(call.inputs), len(call.outputs)
        result = [
            AxisStrategy((Shard(d),) * n_in, (Shard(d),) * n_out)
            for d in _plane_dims(call, spatial)
            if call.inputs[0].shape[d] > 1
        ]
        if linear_in is not None and partial_ok([call.inputs[i] for i in linear_in], call.outputs):
            ins: tuple[Placement, ...] = tuple(P if i in linear_in else R for i in range(n_in))
            result.append(AxisStrategy(ins, (P,) * n_out))
        return with_replicated(call, result)

    return rule


def unfold_rule(call: OpCall) -> list[AxisStrategy]:
    """im2col (N, C, H, W) -> (N, C*kh*kw, L) and col2im back: the batch dim splits (a channel
    block of the input is not a block of C*kh*kw when C does not divide evenly); linear."""
    batched = max(call.inputs[0].ndim, call.outputs[0].ndim) == 4
    result = [AxisStrategy((Shard(0),), (Shard(0),))] if batched and call.inputs[0].shape[0] > 1 else []
    if partial_ok(call.inputs, call.outputs):
        result.append(AxisStrategy((P,), (P,)))
    return with_replicated(call, result)


RULES: dict[object, Callable[[OpCall], list[AxisStrategy]]] = {
    aten.avg_pool2d.default: plane_rule(2, (0,)),
    aten.avg_pool2d_backward.default: plane_rule(2, (0,)),  # (grad_out, self): linear in grad_out
    aten._adaptive_avg_pool2d.default: plane_rule(2, (0,)),
    aten._adaptive_avg_pool2d_backward.default: plane_rule(2, (0,)),
    aten.max_pool2d_with_indices.default: plane_rule(2, None),
    # (grad_out, self, ..., indices): linear in grad_out with the indices fixed
    aten.max_pool2d_with_indices_backward.default: plane_rule(2, (0,)),
    aten.im2col.default: unfold_rule,
    aten.col2im.default: unfold_rule,
}


def register(registry: RuleRegistry) -> None:
    rules = registry.family(FAMILY, uneven=True)
    for op, rule in RULES.items():
        rules.register(op, rule)
