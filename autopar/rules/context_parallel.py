"""Context parallelism for attention: queries split along the sequence, keys and values whole.

The attention ops of a traced graph are the CPU flash pair `_scaled_dot_product_flash_attention_for
_cpu(_backward)` (what `F.scaled_dot_product_attention` lowers to on the fake CPU tensors of the
trace; `device_attention` runs the same pair on other devices). Their batch and head splits live in
`nn.py`; this module adds the split along the query sequence (dim 2 of the (B, H, L, E) query),
Llama 3's context parallelism:

- forward: the query, the output and the logsumexp are split along the sequence; the keys and the
  values are whole on that axis, so where their producer holds them split along the sequence,
  insert_comm all-gathers them (one all-gather each per attention call);
- backward: the query's gradient is split like the query; each rank's block of queries touches
  every key, so the keys' and values' gradients are partial sums (`Partial`), which insert_comm
  reduce-scatters back to the sequence split (or all-reduces, where a whole value is wanted);
- an attention mask (a padding or sliding-window mask, shape (B, 1, Tq, Tk) or any shape that
  broadcasts against the scores) is split on its query dim with the query; a mask that broadcasts
  along the queries (size 1 there) stays whole.

Each rule is written for one mesh axis, so the split composes with the batch and head splits of
the other axes (a (2, 4) mesh: batch over the first, sequence over the second). Keys and values are
never split by this strategy, so grouped-query attention (fewer key/value heads than query heads,
which the CPU kernel takes as they are) is unaffected.

Causal attention (`is_causal=True`) is the case that needs care: torch's causal mask is aligned to
the top left of the (Tq, Tk) scores, so query i of the whole sequence attends keys 0..i. A rank
holding queries o..o+n-1 must attend keys 0..o+i for its query i, which the kernel's own causal
flag (top-left aligned on the local (n, Tk) scores) does not give. The local call
(`device_attention.attention_forward` with `row_offset=o`) therefore runs the kernel without its
causal flag on the keys 0..o+n-1 only (the later ones are masked for every local query, so their work is skipped) with an additive
mask that is -inf above the shifted diagonal, added to the user's mask if there is one; its
backward pads the keys' and values' gradients with zeros for the keys it skipped.

Refused (the strategy is not offered, so the search picks a batch or head split or keeps
attention whole; `sequence_split_refusal` says why): attention with dropout (the CPU pair is
only ever traced with `dropout_p=0`, dropout inside attention is traced as its math
decomposition, but a sequence split of a kernel that drew its own dropout mask could not give the
serial numbers), and queries that are not 4-D (B, H, L, E).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autopar.core.layout import P, Placement, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall, TensorSpec
from autopar.rules import device_attention
from autopar.rules.base import LocalCall, LocalContext
from autopar.rules.pointwise import partial_ok

aten = torch.ops.aten

FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ = 2  # the sequence dim of the (B, H, L, E) query, key, value and output, and of the (B, H, L) logsumexp


def _query_index(call: OpCall) -> int:
    """Where the query is among the tensor inputs: after grad_out in the backward."""
    return 1 if call.op == BACKWARD else 0


def _dropout_p(call: OpCall) -> float:
    return float(call.arg(6 if call.op == BACKWARD else 3, "dropout_p", 0.0))


def _is_causal(call: OpCall) -> bool:
    return bool(call.arg(7 if call.op == BACKWARD else 4, "is_causal", False))


def sequence_split_refusal(call: OpCall) -> str | None:
    """Why this attention call cannot be split along the query sequence, or None if it can."""
    q = call.inputs[_query_index(call)]
    if q.ndim != 4:
        return (
            f"{call.op}: the query is {q.ndim}-D; a sequence split needs (batch, heads, sequence, head_dim)"
        )
    if _dropout_p(call) != 0.0:
        return (
            f"{call.op}: dropout_p={_dropout_p(call)} inside attention; each rank would draw its own "
            "dropout mask, not its block of the serial one (split the batch or heads instead)"
        )
    return None


def _mask_placement(mask: TensorSpec, seq_q: int) -> Placement:
    """A mask follows the queries where it has a query dim of their length; it stays whole where it
    broadcasts along them."""
    if mask.ndim >= 2 and mask.shape[-2] == seq_q and seq_q > 1:
        return Shard(mask.ndim - 2)
    return R


def sequence_strategies(call: OpCall) -> list[AxisStrategy]:
    """The query-sequence split of one attention call on one mesh axis (none if refused).

    Forward (q, k, v[, mask]) -> (out, logsumexp): q, out, logsumexp split along the sequence,
    k and v whole. Backward (grad_out, q, k, v, out, logsumexp[, mask]) -> (dq, dk, dv): grad_out,
    q, out, logsumexp and dq split along the sequence, k and v whole, dk and dv partial sums."""
    if sequence_split_refusal(call) is not None:
        return []
    q = call.inputs[_query_index(call)]
    if q.shape[SEQ] < 2:
        return []
    backward = call.op == BACKWARD
    n_main = 6 if backward else 3
    masks = tuple(_mask_placement(m, q.shape[SEQ]) for m in call.inputs[n_main:])
    if backward:
        if not partial_ok(call.inputs, call.outputs[1:]):
            return []
        ins: tuple[Placement, ...] = (Shard(SEQ), Shard(SEQ), R, R, Shard(SEQ), Shard(SEQ), *masks)
        return [AxisStrategy(ins, (Shard(SEQ), P, P))]
    return [AxisStrategy((Shard(SEQ), R, R, *masks), (Shard(SEQ), Shard(SEQ)))]


def localize_attention(ctx: LocalContext) -> LocalCall:
    """The local call of an attention op: the op itself, unless it is causal with the queries split
    along the sequence, where the rank's queries start at offset o of the whole sequence and must
    attend keys 0..o+i (`device_attention.attention_forward` with `row_offset=o`)."""
    call = ctx.call
    q_layout = ctx.strategy.inputs[_query_index(call)]
    if not _is_causal(call) or not q_layout.shard_axes(SEQ):
        return LocalCall(call.op, ctx.args, ctx.kwargs)
    offset = q_layout.local_offsets(ctx.mesh_shape, ctx.coords)[SEQ]
    backward = call.op == BACKWARD
    n_main = 6 if backward else 3
    tensors = ctx.args[:n_main]
    kwargs = {"attn_mask": ctx.kwargs.get("attn_mask"), "scale": ctx.kwargs.get("scale"), "row_offset": offset}
    target: Callable[..., object] = (
        device_attention.attention_backward if backward else device_attention.attention_forward
    )
    return LocalCall(target, (*tensors, _dropout_p(call), True), kwargs)
