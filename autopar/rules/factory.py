"""Tensor factories: the output may be created directly in any split layout.

Constant fills only need the local shape (`localize_sizes` rewrites `size`); `arange` must produce
this rank's elements, so its localize computes the block from the output layout and coords.
`*_like` factories follow their input's shards; their input values are never read, so a Partial
input yields a plain replicated constant (or, for zeros, a Partial zero). `new_*` factories take
only dtype and device from their input, so it may arrive in any layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autopar.core.layout import P, Placement, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall
from autopar.rules import local_ops
from autopar.rules.base import LocalCall, LocalContext, RuleRegistry, with_replicated

aten = torch.ops.aten

FAMILY = "factory"


def fill_rule(call: OpCall) -> list[AxisStrategy]:
    """zeros/ones/full/empty: any output dim may be split."""
    shape = call.outputs[0].shape
    result = [AxisStrategy((R,) * len(call.inputs), (Shard(d),)) for d in range(len(shape)) if shape[d] > 1]
    return with_replicated(call, result)


def like_rule(zero: bool) -> Callable[[OpCall], list[AxisStrategy]]:
    def rule(call: OpCall) -> list[AxisStrategy]:
        shape = call.outputs[0].shape
        result = [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(len(shape)) if shape[d] > 1]
        floating = call.outputs[0].dtype.is_floating_point
        result.append(AxisStrategy((P,), (P if zero and floating else R,)))
        return with_replicated(call, result)

    return rule


def fill_value_rule(call: OpCall) -> list[AxisStrategy]:
    """`fill(self, value)`: self's shape filled with a number or a 0-d tensor (encoder-decoder
    models start their decoder inputs so). Self gives only the shape: each rank fills its block;
    a pending sum in self is ignored, one in the value stays pending."""
    ndim = call.outputs[0].ndim
    value: tuple[Placement, ...] = (R,) if len(call.inputs) > 1 else ()
    result = [AxisStrategy((Shard(d), *value), (Shard(d),)) for d in range(ndim) if call.outputs[0].shape[d] > 1]
    result.append(AxisStrategy((P, *value), (R,)))
    if value and call.outputs[0].dtype.is_floating_point:
        result.append(AxisStrategy((R, P), (P,)))
    return with_replicated(call, result)


def new_fill_rule(call: OpCall) -> list[AxisStrategy]:
    """`x.new_ones(size)` etc.: x gives only dtype and device, so it may come in any layout (no
    redistribution is ever needed for it) and the output may be split on any dim."""
    src, shape = call.inputs[0], call.outputs[0].shape
    ins: list[Placement] = [R, P, *(Shard(d) for d in range(src.ndim) if src.shape[d] > 1)]
    outs: list[Placement] = [R, *(Shard(d) for d in range(len(shape)) if shape[d] > 1)]
    return with_replicated(call, [AxisStrategy((i,), (o,)) for i in ins for o in outs])


def arange_bounds(call: OpCall) -> tuple[float | int, float | int]:
    """(start, step) of an arange call."""
    if call.op == aten.arange.default:
        return 0, 1
    return call.arg(0, "start"), call.arg(2, "step", 1) if call.op == aten.arange.start_step else 1


def arange_rule(call: OpCall) -> list[AxisStrategy]:
    result = [AxisStrategy((), (Shard(0),))] if call.outputs[0].shape[0] > 1 else []
    return with_replicated(call, result)


def localize_arange(ctx: LocalContext) -> LocalCall:
    """This rank's block `[offset, offset + length)` of the global arange."""
    call = ctx.call
    layout = ctx.strategy.outputs[0]
    if not layout.shard_axes(0):
        return LocalCall(call.op, ctx.args, ctx.kwargs)
    start, step = arange_bounds(call)
    offset = layout.local_offsets(ctx.mesh_shape, ctx.coords)[0]
    length = layout.local_shape(ctx.mesh_shape, ctx.coords)[0]
    args = (start, step, offset, length, call.outputs[0].dtype, ctx.kwargs.get("device"))
    return LocalCall(local_ops.arange_block, args, {})


def localize_strided_empty(ctx: LocalContext) -> LocalCall:
    """`empty_strided`/`new_empty_strided` hold no values: this rank's block as a plain empty
    tensor (the global strides do not describe a block)."""
    call = ctx.call
    local = list(ctx.strategy.outputs[0].local_shape(ctx.mesh_shape, ctx.coords))
    kwargs = dict(ctx.kwargs)
    if call.op == aten.new_empty_strided.default:
        return LocalCall(aten.new_empty.default, (ctx.args[0], local), kwargs)
    return LocalCall(aten.empty.memory_format, (local,), kwargs)


def localize_eye(ctx: LocalContext) -> LocalCall:
    """This rank's block of the identity: ones where its global row and column agree."""
    out = ctx.strategy.outputs[0]
    offsets = list(out.local_offsets(ctx.mesh_shape, ctx.coords))
    lengths = list(out.local_shape(ctx.mesh_shape, ctx.coords))
    args = (offsets, lengths, ctx.call.outputs[0].dtype, ctx.kwargs.get("device"))
    return LocalCall(local_ops.eye_block, args, {})


def scalar_rule(call: OpCall) -> list[AxisStrategy]:
    """A 0-d tensor has nothing to split."""
    return with_replicated(call, [])


FILLS = [
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.empty.memory_format,
]

LIKES = {
    aten.zeros_like.default: True,
    aten.ones_like.default: False,
    aten.full_like.default: False,
    aten.empty_like.default: False,
}

NEW_FILLS = [aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default]

ARANGES = [aten.arange.default, aten.arange.start, aten.arange.start_step]


def register(registry: RuleRegistry) -> None:
    rules = registry.family(FAMILY, uneven=True)
    for op in FILLS:
        rules.register(op, fill_rule)
    for op, zero in LIKES.items():
        rules.register(op, like_rule(zero))
    for op in NEW_FILLS:
        rules.register(op, new_fill_rule)
    rules.register(aten.new_empty_strided.default, new_fill_rule, localize=localize_strided_empty)
    rules.register(aten.empty_strided.default, fill_rule, localize=localize_strided_empty)
    rules.register(aten.eye.default, fill_rule, localize=localize_eye)
    rules.register(aten.eye.m, fill_rule, localize=localize_eye)
    for op in (aten.fill.Scalar, aten.fill.Tensor):
        rules.register(op, fill_value_rule)
    for op in ARANGES:
        rules.register(op, arange_rule, localize=localize_arange)
    rules.register(aten.scalar_tensor.default, scalar_rule)
