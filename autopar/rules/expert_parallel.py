"""Expert parallelism for the grouped matmul of mixture-of-experts layers: experts split over a
mesh axis, tokens dispatched to them by all-gather and combined by reduce-scatter.

transformers' MoE layers (Mixtral, Qwen3-MoE, OLMoE, ... at their default `grouped_mm` experts
implementation, traced on CPU) compute their experts with the custom op
`transformers::grouped_mm_fallback(input (S, K), weight (E, K, N), offs (E,))`: `input` holds one
row per (token, chosen expert) pair sorted by expert, `offs` the cumulative row counts per expert,
so rows offs[e-1]..offs[e] are multiplied by expert e's matrix. Its backward is the custom op
`grouped_mm_fallback_backward(input, weight, offs, grad_output) -> (grad_input, grad_weight)`.

The strategy here splits the expert dim E of the weight over one mesh axis (each rank holds
E/ep experts, with their gradients and optimizer state) and keeps every row on every rank:

- forward: input Replicate, weight Shard(0), offs Replicate -> output Partial. A rank multiplies
  only its own experts' rows (`local_ops.grouped_mm_experts`); the rows of other ranks' experts
  come out zero, so the sum over the axis is the serial output, exactly (each row has one rank
  that computes it, the others add zeros). No token is dropped and no capacity is set: the
  routing in `offs` is read at run time, however uneven.
- backward: input, offs and grad_output Replicate, weight Shard(0) -> grad_input Partial (each
  rank's rows), grad_weight Shard(0) (each rank's experts' gradients, whole: no reduction).

The collectives come from insert_comm, not from new runtime machinery: where the tokens are split
along the batch on the same axis (experts sharing the data axis, as DeepSeek and torchtitan
place them), the Replicate input is an all-gather of the tokens and the Partial output is
reduce-scattered back to the batch split: Megatron-Core's all-gather dispatcher. Where the tokens
are whole on the axis, the Partial output is all-reduced. The planner prices the split like any
other: the op's flops (`autopar.cost.work`) divided over the axis, plus those redistributions.

Not built: the all-to-all dispatcher (moving only the routed rows, split sizes known at run
time), and a token split inside the grouped matmul (rows and experts are tied by `offs`).
"""

from __future__ import annotations

from autopar.core.layout import P, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall
from autopar.rules import local_ops
from autopar.rules.base import LocalCall, LocalContext
from autopar.rules.pointwise import partial_ok

EXPERT_DIM = 0  # the expert dim of the (E, K, N) weight and of its gradient
# the ops' schema names, in order: forward (input, weight, offs), backward adds grad_output
_ARGUMENTS = ("input", "weight", "offs", "grad_output")


def expert_split_forward(call: OpCall) -> list[AxisStrategy]:
    """(input R, weight Shard(0), offs R) -> output Partial; none where a pending sum of the output
    would not be exact (integer dtypes)."""
    if call.inputs[1].ndim != 3 or not partial_ok(call.inputs[:2], call.outputs):
        return []
    return [AxisStrategy((R, Shard(EXPERT_DIM), R), (P,))]


def expert_split_backward(call: OpCall) -> list[AxisStrategy]:
    """(input R, weight Shard(0), offs R, grad_output R) -> (grad_input Partial, grad_weight
    Shard(0))."""
    if call.inputs[1].ndim != 3 or not partial_ok(call.inputs[:2], call.outputs[:1]):
        return []
    return [AxisStrategy((R, Shard(EXPERT_DIM), R, R), (P, Shard(EXPERT_DIM)))]


def localize_grouped_mm(ctx: LocalContext) -> LocalCall:
    """The op itself unless the weight holds a block of the experts: then the rank multiplies only
    its experts' rows, starting at its first expert's global index (the weight's offset on E)."""
    weight = ctx.strategy.inputs[1]
    if not weight.shard_axes(EXPERT_DIM):
        return LocalCall(ctx.call.op, ctx.args, ctx.kwargs)
    first_expert = weight.local_offsets(ctx.mesh_shape, ctx.coords)[EXPERT_DIM]
    names = _ARGUMENTS[: len(ctx.call.inputs)]
    tensors = tuple(ctx.args[i] if i < len(ctx.args) else ctx.kwargs[name] for i, name in enumerate(names))
    target = local_ops.grouped_mm_experts_backward if len(names) == 4 else local_ops.grouped_mm_experts
    return LocalCall(target, (*tensors, first_expert), {})
