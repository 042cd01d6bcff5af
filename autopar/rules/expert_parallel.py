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

The output is not an ordinary Partial but a row-disjoint one (`RowDisjoint`, "D"): each row has
one rank that computes it, the others hold zeros. That survives the layer between the two grouped
matmuls (the gate's `act(gate) * up`, the chunk of gate_up_proj's output into its halves, and the
same ops' backward), which an ordinary pending sum does not: the activation runs on each rank's own
rows, and the down projection's expert split takes its input as D, multiplying the rows of its
experts, complete on that rank. So the expert split reduces only the down projection's (S, H)
output, as the split inside the experts does, with whole-expert matmuls and 1/ep of the weights.
`DISJOINT_RULES` adds the D strategies of those ops to their ordinary rules (`register`). Two D
values combine only with the same row owners (same `offs`, same expert split):
`autopar.passes.propagate` checks every plan for that.

The all-to-all dispatcher (moving only the routed rows, split sizes known at run time) is planned
on the layer traced as one op instead (`autopar.rules.routed_experts`, PlanOptions.token_dispatch).
Not built: a token split inside the grouped matmul (rows and experts are tied by `offs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from autopar.core.layout import D, Layout, Placement, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall, Strategy, TensorSpec
from autopar.rules import local_ops
from autopar.rules.base import LocalCall, LocalContext, RuleRegistry, StrategyFn, normalize_dim
from autopar.rules.pointwise import partial_ok

aten = torch.ops.aten

EXPERT_DIM = 0  # the expert dim of the (E, K, N) weight and of its gradient
# the ops' schema names, in order: forward (input, weight, offs), backward adds grad_output
_ARGUMENTS = ("input", "weight", "offs", "grad_output")


# `OpOverload.name()` of the grouped matmuls whose localizers multiply a rank's experts
GROUPED_MM_OPS = (
    "transformers::grouped_mm_fallback",
    "transformers::grouped_mm_fallback_backward",
    "aten::_grouped_mm",
)


def experts_layout(target: object, strategy: Strategy) -> Layout | None:
    """The layout whose dim 0 is a grouped matmul's experts: its (E, K, N) weight, or the output
    of `torch._grouped_mm`'s 2D x 2D form (the experts' gradient, (E, K, N)); None for other ops
    and for the batched form (no `offs`: no rows tied to experts)."""
    name = getattr(target, "name", None)
    if not callable(name) or name() not in GROUPED_MM_OPS or len(strategy.inputs) < 3:
        return None
    if len(strategy.inputs[1].shape) == 3:
        return strategy.inputs[1]
    if len(strategy.inputs[1].shape) == 2 and strategy.outputs and len(strategy.outputs[0].shape) == 3:
        return strategy.outputs[0]
    return None


def is_expert_split(target: object, strategy: Strategy) -> bool:
    """Whether a node runs a grouped matmul with its experts split (on some mesh axis)."""
    layout = experts_layout(target, strategy)
    return layout is not None and bool(layout.shard_axes(EXPERT_DIM))


def expert_owners(weight: Layout, axis: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The coordinate on `axis` of the rank holding each expert of a weight split on dim 0 (the
    blocks of `Layout.local_offsets`, nested over the axes that split the experts)."""
    axes = weight.shard_axes(EXPERT_DIM)
    experts = weight.shape[EXPERT_DIM]
    block = -(-experts // math.prod(mesh_shape[a] for a in axes))
    inner = math.prod(mesh_shape[b] for b in axes[axes.index(axis) + 1 :])
    return tuple((e // block) // inner % mesh_shape[axis] for e in range(experts))


def row_owners(offs: torch.Tensor, weight: Layout, mesh_shape: Sequence[int]) -> dict[int, Sequence[int]]:
    """Per mesh axis splitting the experts: the coordinate owning each row of a grouped matmul's
    input and output (row r belongs to the expert e with offs[e-1] <= r < offs[e])."""
    ends = [int(x) for x in offs.tolist()]
    experts_of_rows = [e for e, end in enumerate(ends) for _ in range(end - (ends[e - 1] if e else 0))]
    return {
        a: [expert_owners(weight, a, mesh_shape)[e] for e in experts_of_rows]
        for a in weight.shard_axes(EXPERT_DIM)
    }


def expert_split_forward(call: OpCall) -> list[AxisStrategy]:
    """(input R or D, weight Shard(0), offs R) -> output D (row-disjoint Partial); none where a
    pending sum of the output would not be exact (integer dtypes). A D input holds the rows of
    this rank's experts whole (checked after planning: the same owners), and those are all the
    rows the rank multiplies."""
    if call.inputs[1].ndim != 3 or not partial_ok(call.inputs[:2], call.outputs):
        return []
    return [AxisStrategy((rows, Shard(EXPERT_DIM), R), (D,)) for rows in (R, D)]


def expert_split_backward(call: OpCall) -> list[AxisStrategy]:
    """(input R or D, weight Shard(0), offs R, grad_output R or D) -> (grad_input D, grad_weight
    Shard(0)): each rank's experts read only their own rows of input and grad_output."""
    if call.inputs[1].ndim != 3 or not partial_ok(call.inputs[:2], call.outputs[:1]):
        return []
    return [
        AxisStrategy((rows, Shard(EXPERT_DIM), R, grads), (D, Shard(EXPERT_DIM)))
        for rows in (R, D)
        for grads in (R, D)
    ]


def expert_split_weight_gradient(call: OpCall) -> list[AxisStrategy]:
    """`torch._grouped_mm(a (K, S), b (S, N), offs) -> (E, K, N)` (the experts' gradient): a R,
    b R or D, offs R -> output Shard(0). Each rank sums over the rows of its own experts only,
    which a D b holds whole on their owner."""
    if call.inputs[0].ndim != 2 or call.outputs[0].ndim != 3:
        return []
    return [AxisStrategy((R, rows, R), (Shard(EXPERT_DIM),)) for rows in (R, D)]


# ---- the row-disjoint strategies of the ops between two grouped matmuls -------------------------


def _rows_kept(spec: TensorSpec, out: TensorSpec) -> bool:
    """A D input lines its rows up with the output's: same rank and number of rows."""
    return spec.ndim == out.ndim >= 1 and spec.shape[0] == out.shape[0]


def _disjoint(call: OpCall, disjoint: Sequence[int]) -> list[AxisStrategy]:
    """Inputs `disjoint` D, the other tensors R -> every output D, where the rows line up and the
    dtypes carry sums."""
    if not call.outputs or not disjoint or any(i >= len(call.inputs) for i in disjoint):
        return []
    out = call.outputs[0]
    members = [call.inputs[i] for i in disjoint]
    if not all(_rows_kept(m, o) for m in members for o in call.outputs) or not partial_ok(
        members, call.outputs
    ):
        return []
    if any(o.shape[0] != out.shape[0] for o in call.outputs):
        return []
    ins: tuple[Placement, ...] = tuple(D if i in disjoint else R for i in range(len(call.inputs)))
    return [AxisStrategy(ins, (D,) * len(call.outputs))]


def zero_preserving(call: OpCall) -> list[AxisStrategy]:
    """f(x) with f(0) = 0, elementwise (SiLU, GELU, ReLU, tanh, neg, a scalar multiple, a cast):
    a zero row stays zero and an owner's row is the whole value."""
    return _disjoint(call, (0,))


def product(call: OpCall) -> list[AxisStrategy]:
    """x * y: either one D and the other R (a zero row times anything is zero), or both D with the
    same row owners (checked after planning): the owner holds both whole rows."""
    return [*_disjoint(call, (0,)), *_disjoint(call, (1,)), *_disjoint(call, (0, 1))]


def gradient_of_activation(call: OpCall) -> list[AxisStrategy]:
    """act_backward(grad, x, ...) is zero where grad is: grad D with x R, or both D (same owners).
    Not grad R with x D: a zero row of x has a nonzero derivative."""
    return [*_disjoint(call, (0,)), *_disjoint(call, (0, 1))]


def _dim_not_rows(call: OpCall, index: int, name: str, default: int) -> bool:
    dim = call.arg(index, name, default)
    return isinstance(dim, int) and normalize_dim(dim, call.inputs[0].ndim) != 0


def columns(call: OpCall) -> list[AxisStrategy]:
    """slice along a dim other than the rows (gate_up's halves): each row keeps its owner."""
    if not call.inputs or not _dim_not_rows(call, 1, "dim", 0):
        return []
    return _disjoint(call, (0,))


def split_columns(call: OpCall) -> list[AxisStrategy]:
    """split(x, sizes, dim) along a dim other than the rows."""
    if not call.inputs or not _dim_not_rows(call, 2, "dim", 0):
        return []
    return _disjoint(call, (0,))


def cat_columns(call: OpCall) -> list[AxisStrategy]:
    """cat(tensors, dim) along a dim other than the rows, all D (same owners, checked after
    planning): the backward of the split of gate_up's output."""
    if not call.inputs or not _dim_not_rows(call, 1, "dim", 0):
        return []
    return _disjoint(call, tuple(range(len(call.inputs))))


# op -> its row-disjoint strategies, added to its ordinary rule by `register`
DISJOINT_RULES: dict[object, StrategyFn] = {
    aten.silu.default: zero_preserving,
    aten.gelu.default: zero_preserving,
    aten.relu.default: zero_preserving,
    aten.tanh.default: zero_preserving,
    aten.neg.default: zero_preserving,
    aten.mul.Scalar: zero_preserving,
    aten.clone.default: zero_preserving,
    aten._to_copy.default: zero_preserving,
    aten.mul.Tensor: product,
    aten.silu_backward.default: gradient_of_activation,
    aten.gelu_backward.default: gradient_of_activation,
    aten.threshold_backward.default: gradient_of_activation,
    aten.tanh_backward.default: gradient_of_activation,
    aten.split.Tensor: split_columns,
    aten.split_with_sizes.default: split_columns,
    aten.slice.Tensor: columns,
    aten.cat.default: cat_columns,
}


def with_disjoint(rule: StrategyFn, extra: StrategyFn) -> StrategyFn:
    """The ordinary rule's strategies, then the row-disjoint ones (none repeated)."""

    def combined(call: OpCall) -> list[AxisStrategy]:
        found = rule(call)
        return [*found, *(s for s in extra(call) if s not in found)]

    combined.__doc__ = f"{rule.__doc__ or ''}\nRow-disjoint: {extra.__doc__ or ''}"
    return combined


def register(registry: RuleRegistry) -> None:
    """Adds the D strategies to the rules the other families registered (it runs after them)."""
    for op, extra in DISJOINT_RULES.items():
        rule = registry.get(op)
        if rule is None:
            continue
        registry.register(
            op,
            with_disjoint(rule.strategies, extra),
            family=rule.family,
            localize=rule.localize,
            anchor=rule.anchor,
            uneven=rule.uneven,
        )


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


def localize_aten_grouped_mm(ctx: LocalContext) -> LocalCall:
    """`torch._grouped_mm` on a rank's blocks, as a loop of matmuls over the rank's experts
    (`local_ops`): the whole op's kernel wants every stride a multiple of 16 bytes, which a block
    of a split K or N need not be, and a rank holding a block of the experts multiplies only their
    rows (starting at its first expert's global index). The batched form (no `offs`) is the op itself."""
    if len(ctx.call.inputs) < 3:
        return LocalCall(ctx.call.op, ctx.args, ctx.kwargs)
    a, b = ctx.args[0], ctx.args[1]
    offs = ctx.args[2] if len(ctx.args) > 2 else ctx.kwargs["offs"]
    if len(ctx.strategy.inputs[1].shape) == 3:
        weight = ctx.strategy.inputs[1]
        first = weight.local_offsets(ctx.mesh_shape, ctx.coords)[EXPERT_DIM] if weight.shard_axes(EXPERT_DIM) else 0
        return LocalCall(local_ops.grouped_mm_experts, (a, b, offs, first), {})
    out = ctx.strategy.outputs[0]
    first = out.local_offsets(ctx.mesh_shape, ctx.coords)[EXPERT_DIM]
    count = out.local_shape(ctx.mesh_shape, ctx.coords)[EXPERT_DIM]
    return LocalCall(local_ops.grouped_mm_experts_weight, (a, b, offs, first, count), {})
