"""Random ops: the serial model's numbers on any mesh.

A rank draws the global random tensor from the generator state the serial model would have at
this op (every rank seeds alike; ops run in the serial order) and keeps its own block, so a value's
random numbers do not depend on its layout. Replicas draw the same numbers; Partial inputs share one
mask, which keeps dropout linear in its input.
"""

from __future__ import annotations

import torch

from autopar.core.layout import P, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall
from autopar.rules import local_ops
from autopar.rules.base import LocalCall, LocalContext, RuleRegistry, with_replicated

FAMILY = "random"
aten = torch.ops.aten


def dropout_rule(call: OpCall) -> list[AxisStrategy]:
    """native_dropout(input, p, train) -> (output, mask): split any dim; a pending sum stays pending."""
    strategies = [AxisStrategy((Shard(d),), (Shard(d), Shard(d))) for d in range(call.inputs[0].ndim)]
    if call.inputs[0].dtype.is_floating_point:
        strategies.append(AxisStrategy((P,), (P, R)))
    return with_replicated(call, strategies)


def localize_dropout(ctx: LocalContext) -> LocalCall:
    layout = ctx.strategy.inputs[0]
    offsets = list(layout.local_offsets(ctx.mesh_shape, ctx.coords))
    p = float(ctx.call.arg(1, "p"))
    train = ctx.call.arg(2, "train")
    order = list(ctx.memory_order) if ctx.memory_order is not None else None
    return LocalCall(local_ops.dropout_block, (ctx.args[0], p, train, list(layout.shape), offsets, order), {})


def dropout_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """native_dropout_backward(grad, mask, scale): pointwise; linear in grad with a shared mask."""
    ndim = call.inputs[0].ndim
    strategies = [AxisStrategy((Shard(d), Shard(d)), (Shard(d),)) for d in range(ndim)]
    strategies.append(AxisStrategy((P, R), (P,)))
    return with_replicated(call, strategies)


def random_factory_rule(call: OpCall) -> list[AxisStrategy]:
    """rand/randn(size), rand_like/randn_like(x), bernoulli(x, p), exponential(x, rate) and
    uniform(x, low, high): the output may be split on any dim; an input gives only its shape, so
    it may be split alike or arrive with a pending sum."""
    out = call.outputs[0]
    if call.kwargs.get("generator") is not None:  # the user's own generator: every rank draws all
        return with_replicated(call, [])
    like = (R,) * len(call.inputs)
    strategies = [
        AxisStrategy(tuple(Shard(d) for _ in call.inputs) or like, (Shard(d),))
        for d in range(out.ndim)
        if out.shape[d] > 1
    ]
    if call.inputs:
        strategies.append(AxisStrategy((P,), (R,)))
    return with_replicated(call, strategies)


def localize_random_factory(ctx: LocalContext) -> LocalCall:
    """Draw the global tensor as the serial op would and keep this rank's block."""
    call = ctx.call
    out = ctx.strategy.outputs[0]
    kind = KINDS[call.op]
    if ctx.kwargs.get("generator") is not None:
        return LocalCall(call.op, ctx.args, ctx.kwargs)  # replicated (the rule offers nothing else)
    # bernoulli(x, p) draws into a contiguous tensor whatever x's strides (measured on torch 2.13)
    contiguous = ctx.kwargs.get("memory_format") == torch.contiguous_format or kind == "bernoulli"
    order = list(ctx.memory_order) if ctx.memory_order is not None and not contiguous else None
    args = (
        ctx.args[0] if call.inputs else None,  # a `*_like` input: its device, when none is given
        kind,
        list(out.shape),
        list(out.local_offsets(ctx.mesh_shape, ctx.coords)),
        list(out.local_shape(ctx.mesh_shape, ctx.coords)),
        call.outputs[0].dtype,
        ctx.kwargs.get("device"),
        order,
        *(float(call.arg(i + 1, name, default)) for i, (name, default) in enumerate(PARAMETERS[kind])),
    )
    return LocalCall(local_ops.random_block, args, {})


KINDS = {
    aten.rand.default: "rand",
    aten.randn.default: "randn",
    aten.rand_like.default: "rand",
    aten.randn_like.default: "randn",
    aten.bernoulli.p: "bernoulli",  # x.new_empty(shape).bernoulli_(keep): stochastic depth
    aten.exponential.default: "exponential",  # Gumbel noise, -log(exponential): PhiMoE's expert sampling
    aten.uniform.default: "uniform",  # rand_like(x).uniform_(): PhiMoE's Heun mask
}
# each kind's numbers after its input, by their schema names, with their defaults
PARAMETERS: dict[str, tuple[tuple[str, float], ...]] = {
    "rand": (),
    "randn": (),
    "bernoulli": (("p", 0.5),),
    "exponential": (("lambd", 1.0),),
    "uniform": (("from", 0.0), ("to", 1.0)),
}


def register(registry: RuleRegistry) -> None:
    rules = registry.family(FAMILY, uneven=True)
    rules.register(aten.native_dropout.default, dropout_rule, localize=localize_dropout)
    rules.register(aten.native_dropout_backward.default, dropout_backward_rule)
    for op in KINDS:
        rules.register(op, random_factory_rule, localize=localize_random_factory)
