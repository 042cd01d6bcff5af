"""Matrix products, all from one einsum-like spec.

For a spec such as `"mk,kn->mn"` the options on one mesh axis are:

* shard one letter: every operand dim carrying it and the output dim carrying it are split; a
  contracted letter (absent from the output) leaves each rank a partial product, so the output
  is Partial;
* Partial through linearity: exactly one operand Partial, the others Replicate, output Partial;
* all Replicate.

A bias added to the product (`addmm`, `baddbmm`) broadcasts against the output. It is added once
per rank, so whenever the product is Partial the bias must be Partial too (a replicated bias
would be counted g times); when the output is sharded it follows by broadcasting.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autopar.core.layout import P, Placement, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall
from autopar.rules import expert_parallel
from autopar.rules.base import Localizer, RuleRegistry, with_replicated
from autopar.rules.pointwise import broadcast_shard, partial_ok

aten = torch.ops.aten

FAMILY = "matmul"


def parse_spec(spec: str) -> tuple[list[str], str]:
    lhs, out = spec.replace(" ", "").split("->")
    return lhs.split(","), out


def einsum_strategies(
    call: OpCall, spec: str, operands: tuple[int, ...], bias: int | None
) -> list[AxisStrategy]:
    """Single-axis strategies for `spec`; `operands[k]` is the tensor input index of operand k."""
    subscripts, out = parse_spec(spec)
    if len(subscripts) != len(operands):
        raise ValueError(f"spec {spec!r} has {len(subscripts)} operands, got {len(operands)}")
    n_in = len(call.inputs)
    out_shape = call.outputs[0].shape
    if len(out) != len(out_shape) or any(len(s) != call.inputs[i].ndim for s, i in zip(subscripts, operands)):
        return with_replicated(call, [])
    summable = partial_ok(call.inputs, call.outputs)
    letters = sorted({c for s in subscripts for c in s})
    result: list[AxisStrategy] = []
    for letter in letters:
        ins: list[Placement] = [R] * n_in
        for sub, index in zip(subscripts, operands):
            if letter in sub:
                ins[index] = Shard(sub.index(letter))
        if letter in out:
            o = out.index(letter)
            if bias is not None:
                ins[bias] = broadcast_shard([call.inputs[bias].shape], out_shape, o)[0]
            result.append(AxisStrategy(tuple(ins), (Shard(o),)))
        elif summable:
            if bias is not None:
                ins[bias] = P
            result.append(AxisStrategy(tuple(ins), (P,)))
    if summable:
        for index in operands:
            ins = [R] * n_in
            ins[index] = P
            if bias is not None:
                ins[bias] = P
            result.append(AxisStrategy(tuple(ins), (P,)))
    return with_replicated(call, result)


def spec_rule(
    spec: str, operands: tuple[int, ...], bias: int | None = None
) -> Callable[[OpCall], list[AxisStrategy]]:
    def rule(call: OpCall) -> list[AxisStrategy]:
        return einsum_strategies(call, spec, operands, bias)

    rule.__doc__ = f"einsum {spec}"
    return rule


# op -> (spec, tensor input index of each operand, tensor input index of the bias)
SPECS: dict[object, tuple[str, tuple[int, ...], int | None]] = {
    aten.mm.default: ("mk,kn->mn", (0, 1), None),
    aten.bmm.default: ("bmk,bkn->bmn", (0, 1), None),
    aten.addmm.default: ("mk,kn->mn", (1, 2), 0),
    aten.baddbmm.default: ("bmk,bkn->bmn", (1, 2), 0),
    aten.mv.default: ("mk,k->m", (0, 1), None),
    aten.dot.default: ("k,k->", (0, 1), None),
}


def grouped_mm_rule(call: OpCall) -> list[AxisStrategy]:
    """transformers' grouped matmul of mixture-of-experts layers: (input (S, K) sorted by expert,
    weight (E, K, N), offs (E,) cumulative token counts) -> (S, N).

    The tokens are tied to the experts by the data in `offs`, so they do not split; the experts
    do (`expert_parallel`: each rank multiplies its experts' rows, output Partial). Within every
    expert it is a plain matmul: N splits with the weight's columns (Megatron's column split of
    each expert), K with the weight's rows, each rank then holding a partial product."""
    summable = partial_ok(call.inputs[:2], call.outputs)
    result = [AxisStrategy((R, Shard(2), R), (Shard(1),))]
    if summable:
        result += [
            AxisStrategy((Shard(1), Shard(1), R), (P,)),
            AxisStrategy((P, R, R), (P,)),
            AxisStrategy((R, P, R), (P,)),
        ]
    return with_replicated(call, [*result, *expert_parallel.expert_split_forward(call)])


def grouped_mm_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """(input, weight, offs, grad_output) -> (grad_input (S, K), grad_weight (E, K, N)): the
    forward's splits seen from the gradients. N split: grad_input sums over N (Partial), the
    weight's gradient keeps its column split; K split: both gradients split on K; linear in
    grad_output with input and weight fixed; experts split: each rank's rows of grad_input
    (Partial) and its experts' gradients."""
    result = [AxisStrategy((Shard(1), Shard(1), R, R), (Shard(1), Shard(1)))]
    if partial_ok(call.inputs[:2], call.outputs):
        result += [
            AxisStrategy((R, Shard(2), R, Shard(1)), (P, Shard(2))),
            AxisStrategy((R, R, R, P), (P, P)),
        ]
    return with_replicated(call, [*result, *expert_parallel.expert_split_backward(call)])


def aten_grouped_mm_rule(call: OpCall) -> list[AxisStrategy]:
    """`torch._grouped_mm(a, b, offs)` of a hand-written mixture-of-experts layer (torchtitan's), in
    the three forms its forward and backward trace to (no bias, no out_dtype; else replicated only):

    - a (S, K) rows sorted by expert, b (E, K, N) experts, offs (E,) -> (S, N): the forward and the
      input's gradient (`_grouped_mm_mat1_backward`: grad (S, N) times b transposed). The splits of
      transformers' `grouped_mm_fallback` (`grouped_mm_rule`), the expert split among them.
    - a (K, S) (the rows transposed), b (S, N), offs (E,) -> (E, K, N): the experts' gradient
      (`_grouped_mm_mat2_backward`). Experts split: the output Shard(0), each rank summing only its
      experts' rows of b (R, or D: its own rows); K or N split inside every expert; linear in
      either operand. a cannot be D (its rows are its second dim).
    - a (E, M, K), b (E, K, N), no offs -> (E, M, N): a batched matmul, the experts its batch."""
    if call.arg(3, "bias") is not None or call.arg(4, "out_dtype") is not None:
        return with_replicated(call, [])
    dims = tuple(x.ndim for x in call.inputs)
    if dims == (2, 3, 1):
        return grouped_mm_rule(call)
    if dims == (3, 3):
        return einsum_strategies(call, "bmk,bkn->bmn", (0, 1), None)
    if dims != (2, 2, 1) or call.outputs[0].ndim != 3:
        return with_replicated(call, [])
    result = [
        AxisStrategy((Shard(0), R, R), (Shard(1),)),
        AxisStrategy((R, Shard(1), R), (Shard(2),)),
    ]
    if partial_ok(call.inputs[:2], call.outputs):
        result += [AxisStrategy((P, R, R), (P,)), AxisStrategy((R, P, R), (P,))]
        result += expert_parallel.expert_split_weight_gradient(call)
    return with_replicated(call, result)


def library_op(namespace: str, name: str) -> object | None:
    """`torch.ops.<namespace>.<name>.default` if a library has registered it in this process
    (transformers registers its MoE ops when its modeling code is imported), else None."""
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


# library custom ops (namespace, name) -> (rule, local call); registered when present
LIBRARY_OPS: dict[tuple[str, str], tuple[Callable[[OpCall], list[AxisStrategy]], Localizer]] = {
    ("transformers", "grouped_mm_fallback"): (grouped_mm_rule, expert_parallel.localize_grouped_mm),
    ("transformers", "grouped_mm_fallback_backward"): (
        grouped_mm_backward_rule,
        expert_parallel.localize_grouped_mm,
    ),
}


def register(registry: RuleRegistry) -> None:
    rules = registry.family(FAMILY, uneven=True)
    for op, (spec, operands, bias) in SPECS.items():
        rules.register(op, spec_rule(spec, operands, bias), anchor=True)
    rules.register(aten._grouped_mm.default, aten_grouped_mm_rule, localize=expert_parallel.localize_aten_grouped_mm, anchor=True)
    for (namespace, name), (rule, localize) in LIBRARY_OPS.items():
        found = library_op(namespace, name)
        if found is not None:
            rules.register(found, rule, localize=localize, anchor=True)
