"""Elementwise ops, from tables.

A pointwise op with numpy broadcasting can shard any output dim: every input whose aligned dim has
the same size shards it too, and an input that broadcasts along it (size 1 or missing) stays
Replicate, because its single slice is what every block of the output sees.

Partial is allowed only where the op is linear: each entry of an op's `linear` table is a set of
argument positions that may be Partial *together* while every other tensor stays Replicate
(`add`: both operands; `mul`: either one, never both; `div`: the numerator only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from autopar.core.layout import P as PARTIAL
from autopar.core.layout import Placement, Shard
from autopar.core.layout import R as REPLICATE
from autopar.core.strategy import AxisStrategy, OpCall, TensorSpec
from autopar.rules.base import RuleRegistry, with_replicated

aten = torch.ops.aten

FAMILY = "pointwise"

# Argument positions that may be Partial together (the rest Replicate); () = not linear anywhere.
Linearity = tuple[tuple[int, ...], ...]


def sum_preserved(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a pending sum survives computing a `dst` value from a `src` summand.

    bool cannot hold sums, and a float summand cast to an integer type would round each summand.
    """
    if src == torch.bool or dst == torch.bool or src.is_complex or dst.is_complex:
        return False
    return not (src.is_floating_point and not dst.is_floating_point)


def partial_ok(inputs: Iterable[TensorSpec], outputs: Iterable[TensorSpec]) -> bool:
    """Every Partial input dtype can carry a sum into every output dtype."""
    outs = list(outputs)
    return all(sum_preserved(i.dtype, o.dtype) for i in inputs for o in outs)


def tensor_positions(call: OpCall) -> dict[int, int]:
    """Top-level argument position -> flattened tensor input index, for direct tensor args."""
    mapping: dict[int, int] = {}
    index = 0
    for pos, value in enumerate(call.args):
        if isinstance(value, TensorSpec):
            mapping[pos] = index
            index += 1
        elif isinstance(value, (list, tuple)):
            index += sum(isinstance(v, TensorSpec) for v in value)
    return mapping


def broadcast_shard(
    in_shapes: Sequence[tuple[int, ...]], out_shape: tuple[int, ...], out_dim: int
) -> list[Placement]:
    """Input placements when the broadcast output is sharded on `out_dim`."""
    placements: list[Placement] = []
    for shape in in_shapes:
        d = out_dim - (len(out_shape) - len(shape))
        if d >= 0 and shape[d] == out_shape[out_dim] and shape[d] != 1:
            placements.append(Shard(d))
        else:
            placements.append(REPLICATE)
    return placements


def shard_strategies(
    in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]
) -> list[AxisStrategy]:
    """All outputs (same shape) sharded on one dim, inputs following by broadcasting."""
    if not out_shapes:
        return []
    out_shape = out_shapes[0]
    result = []
    for d in range(len(out_shape)):
        if out_shape[d] <= 1:
            continue
        ins = broadcast_shard(in_shapes, out_shape, d)
        result.append(AxisStrategy(tuple(ins), (Shard(d),) * len(out_shapes)))
    return result


def partial_strategies(call: OpCall, linear: Linearity) -> list[AxisStrategy]:
    """One strategy per linear group whose members are all tensors of a summable dtype."""
    positions = tensor_positions(call)
    result = []
    for group in linear:
        if not all(p in positions for p in group):
            continue
        members = [positions[p] for p in group]
        if not partial_ok([call.inputs[i] for i in members], call.outputs):
            continue
        ins = [PARTIAL if i in members else REPLICATE for i in range(len(call.inputs))]
        result.append(AxisStrategy(tuple(ins), (PARTIAL,) * len(call.outputs)))
    return result


def pointwise_strategies(call: OpCall, linear: Linearity = ()) -> list[AxisStrategy]:
    """Shard any output dim (inputs broadcast-follow), Partial per the linearity table, or R."""
    out_shapes = [o.shape for o in call.outputs]
    if any(s != out_shapes[0] for s in out_shapes):
        return with_replicated(call, [])
    strategies = shard_strategies([i.shape for i in call.inputs], out_shapes)
    strategies += partial_strategies(call, linear)
    return with_replicated(call, strategies)


def pointwise_rule(linear: Linearity = ()) -> Callable[[OpCall], list[AxisStrategy]]:
    def rule(call: OpCall) -> list[AxisStrategy]:
        return pointwise_strategies(call, linear)

    return rule


def _scalar_zero(call: OpCall, index: int, name: str) -> bool:
    value = call.arg(index, name)
    return isinstance(value, (int, float, bool)) and float(value) == 0.0


def masked_fill_rule(call: OpCall) -> list[AxisStrategy]:
    """`masked_fill(self, mask, value)` is linear in self only when it fills zeros."""
    linear: Linearity = ((0,),) if _scalar_zero(call, 2, "value") else ()
    return pointwise_strategies(call, linear)


NONE: Linearity = ()
FIRST: Linearity = ((0,),)
EITHER: Linearity = ((0,), (1,))
BOTH: Linearity = ((0, 1),)

# Ops whose every tensor argument is elementwise with broadcasting, with their linearity.
TABLE: dict[object, Linearity] = {
    # unary, not linear
    aten.exp.default: NONE,
    aten.log.default: NONE,
    aten.log1p.default: NONE,
    aten.expm1.default: NONE,
    aten.sqrt.default: NONE,
    aten.rsqrt.default: NONE,
    aten.reciprocal.default: NONE,
    aten.abs.default: NONE,
    aten.sin.default: NONE,
    aten.cos.default: NONE,
    aten.erf.default: NONE,
    aten.sigmoid.default: NONE,
    aten.silu.default: NONE,
    aten.sign.default: NONE,
    aten.pow.Tensor_Scalar: NONE,
    aten.pow.Scalar: NONE,  # number ** tensor (ALiBi slopes, Funnel)
    aten.floor.default: NONE,
    aten.ceil.default: NONE,
    aten.trunc.default: NONE,
    aten.round.default: NONE,
    aten.add.Scalar: NONE,
    aten.sub.Scalar: NONE,
    aten.rsub.Scalar: NONE,
    aten.clamp.default: NONE,
    aten.clamp_min.default: NONE,  # Swin v2's logit scale, EfficientFormer
    aten.clamp_max.default: NONE,
    aten.clamp.Tensor: NONE,  # bounds as tensors (PhiMoE's sparse mixer: scores.abs().clamp(min=threshold))
    aten.clamp_min.Tensor: NONE,
    aten.clamp_max.Tensor: NONE,
    aten.logical_not.default: NONE,
    aten.isnan.default: NONE,  # xlogy (F.kl_div) as decomposed
    aten.bitwise_not.default: NONE,
    # comparisons (bool outputs are never Partial)
    aten.eq.Scalar: NONE,
    aten.ne.Scalar: NONE,
    aten.lt.Scalar: NONE,
    aten.le.Scalar: NONE,
    aten.gt.Scalar: NONE,
    aten.ge.Scalar: NONE,
    aten.eq.Tensor: NONE,
    aten.ne.Tensor: NONE,
    aten.lt.Tensor: NONE,
    aten.le.Tensor: NONE,
    aten.gt.Tensor: NONE,
    aten.ge.Tensor: NONE,
    aten.logical_and.default: NONE,
    aten.logical_or.default: NONE,
    aten.bitwise_and.Tensor: NONE,
    aten.bitwise_or.Tensor: NONE,
    # binary, not linear
    aten.maximum.default: NONE,
    aten.minimum.default: NONE,
    aten.pow.Tensor_Tensor: NONE,
    aten.floor_divide.default: NONE,
    aten.div.Tensor_mode: NONE,  # rounded division (Wav2Vec2's conv output lengths, rounding_mode="floor")
    aten.remainder.Scalar: NONE,  # CANINE's hash buckets
    aten.remainder.Tensor: NONE,
    aten.polar.default: NONE,  # complex rotary frequencies (DeepSeek-V2)
    aten._conj.default: NONE,  # and the backward of their complex product
    aten.resolve_conj.default: NONE,
    # activations of vision and state-space models (MobileNet, LeViT, Apertus)
    aten.hardtanh.default: NONE,
    aten.hardswish.default: NONE,
    aten.softplus.default: NONE,
    # activations of GAN discriminators and older vision models (LeakyReLU, ELU/SELU/CELU, Mish,
    # Hardsigmoid; sgn is Softsign's and abs's backward)
    aten.leaky_relu.default: NONE,
    aten.elu.default: NONE,
    aten.celu.default: NONE,
    aten.mish.default: NONE,
    aten.hardsigmoid.default: NONE,
    aten.sgn.default: NONE,
    # linear
    aten.neg.default: FIRST,
    aten.mul.Scalar: FIRST,
    aten.div.Scalar: FIRST,
    aten.add.Tensor: BOTH,
    aten.sub.Tensor: BOTH,
    aten.mul.Tensor: EITHER,
    aten.div.Tensor: FIRST,
    # addcmul(x, a, b, value=v) = x + v*a*b: linear in (x, a) or (x, b) together, never in x alone
    # (ConvNeXt-V2's global response norm); addcdiv(x, a, b) = x + v*a/b in (x, a)
    aten.addcmul.default: ((0, 1), (0, 2)),
    aten.addcdiv.default: ((0, 1),),
    # where(cond, x, y) is linear in (x, y) together with the condition fixed
    aten.where.self: ((1, 2),),
    # backward of activations: linear in the incoming gradient
    aten.sigmoid_backward.default: FIRST,
    aten.tanh_backward.default: FIRST,
    aten.silu_backward.default: FIRST,
    aten.hardtanh_backward.default: FIRST,
    aten.hardswish_backward.default: FIRST,
    aten.softplus_backward.default: FIRST,
    aten.leaky_relu_backward.default: FIRST,
    aten.elu_backward.default: FIRST,
    aten.mish_backward.default: FIRST,
    aten.hardsigmoid_backward.default: FIRST,
}


def register(registry: RuleRegistry) -> None:
    rules = registry.family(FAMILY, uneven=True)
    for op, linear in TABLE.items():
        rules.register(op, pointwise_rule(linear))
    rules.register(aten.masked_fill.Scalar, masked_fill_rule)
    rules.register(aten.masked_fill.Tensor, pointwise_rule(NONE))  # a 0-d tensor value: filled as is
