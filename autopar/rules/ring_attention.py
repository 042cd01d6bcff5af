"""Ring attention: queries, keys and values all split along the sequence on one mesh axis.

The all-gather strategy of `context_parallel` gives every rank the whole keys and values; ring
attention never holds more than two key/value blocks. On an axis of p ranks, rank r holds block r
of the queries, keys and values (dim 2 of (B, H, L, E)); the attention call becomes p steps:

- **forward**: at step s the rank holds the key/value block of rank r-s. It passes that block on to
  rank r+1 (one point-to-point exchange, issued before the step's compute so that it overlaps
  it: `torch.ops._c10d_functional.all_to_all_single` with every split empty but the neighbour's)
  and attends its queries to it (`block_forward`: the attention kernel on one block of keys, with
  the causal and the model's masks cut to that block), then merges the block's partial output
  into the running one by their log-sum-exps (`merge_blocks`). p-1 exchanges, p block computations;
- **backward**: the same ring again, from the saved output and logsumexp (each block's gradient is
  the kernel's backward on that block against the *whole* row's output and logsumexp, so nothing
  but q, k, v, out and logsumexp is saved): the block's share of the query gradient is summed
  locally; its share of the block's key/value gradient is added to an accumulator that travels
  around the ring one step behind the block, in the same exchange as the next block, and reaches
  the block's owner after a last exchange. p exchanges overlapped with a block each, one after
  the last block;
- **causal attention**: block j of keys is hidden from every query of block i < j (the step only
  yields an empty partial: zero output, logsumexp -inf, no kernel call), wholly visible to block
  i > j (no mask), and the diagonal block takes the causal mask at its offsets;
- **masks** (padding, sliding window) are split on their query dim with the queries, whole along
  the keys; each step cuts out the columns of the block it holds. A row that a block masks
  entirely gets logsumexp -inf for it (the kernel reports 0), so it weighs nothing in the merge;
- **grouped-query attention**: key/value blocks keep their own head count; the kernel takes them
  as they are.

The rule is `ring_strategies`; which whole-mesh strategies are admissible is `ring_admissible`
(keys split along the sequence by one axis at most, evenly: the exchanged blocks are equal-sized);
the rank's nodes are built by `ring_graph` (`rules.base.LocalGraph`), so every exchange is a node
of the emitted program, visible in dumps, run in lockstep by the test harness and the oracle.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from autopar.core.errors import ShardingError
from autopar.core.layout import Layout, Placement, Shard
from autopar.core.meta import NodeInfo, set_info
from autopar.core.redistribute import CommStep
from autopar.core.strategy import AxisStrategy, OpCall, Strategy
from autopar.rules import device_attention
from autopar.rules.base import LocalContext, LocalGraph

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
FORWARD = device_attention.CPU_FORWARD
BACKWARD = device_attention.CPU_BACKWARD
SEQ = 2  # the sequence dim of (B, H, L, E) and of the (B, H, L) logsumexp
NEG_INF = float("-inf")


def key_index(op: Any) -> int:
    """Where the key is among the attention op's tensor inputs: after grad_out and q in backward."""
    return 2 if op == BACKWARD else 1


def ring_strategies(call: OpCall, masks: tuple[Placement, ...]) -> list[AxisStrategy]:
    """The ring split of one self-attention call on one axis: every (B, H, L, E) tensor and the
    logsumexp along the sequence; `masks` as the query-sequence split places them (query rows with
    the queries, whole along the keys). None where keys and queries differ in length (cross
    attention) or keys and values in head size or dtype (they travel as one block)."""
    backward = call.op == BACKWARD
    q, k, v = call.inputs[1:4] if backward else call.inputs[:3]
    if q.shape[SEQ] != k.shape[SEQ] or k.shape != v.shape or k.dtype != v.dtype:
        return []
    if backward:
        return [AxisStrategy((Shard(SEQ),) * 6 + masks, (Shard(SEQ),) * 3)]
    return [AxisStrategy((Shard(SEQ),) * 3 + masks, (Shard(SEQ), Shard(SEQ)))]


def ring_axis(op: Any, strategy: Strategy) -> int | None:
    """The mesh axis a strategy of the attention op runs the ring on (its keys split along the
    sequence there), or None."""
    if op not in (FORWARD, BACKWARD):
        return None
    axes = strategy.inputs[key_index(op)].shard_axes(SEQ)
    return axes[0] if axes else None


def without_ring(call: OpCall, strategy: Strategy, mesh_shape: Sequence[int]) -> bool:
    """The attention rules' filter where no "cp" axis asks for context parallelism: no ring. The
    greedy pass (the planner's seeds, the screen, the fixed schemes' plans) scores a strategy by the
    redistributions of its inputs and cannot see the ring's exchanges inside the op, so it would take
    the ring for free; a "cp" axis admits it (`ring_admissible`), and the search prices it."""
    return ring_axis(call.op, strategy) is None


def ring_admissible(call: OpCall, strategy: Strategy, mesh_shape: Sequence[int]) -> bool:
    """Whether the ring of `strategy` can run: the keys split along the sequence by one axis at most
    (a ring passes whole blocks of one axis), into equal blocks (the exchange's shapes are fixed)."""
    k = strategy.inputs[key_index(call.op)]
    axes = k.shard_axes(SEQ)
    if not axes:
        return True
    return len(axes) == 1 and k.shape[SEQ] % mesh_shape[axes[0]] == 0


# ---------------------------------------------------------------- what one step computes


def _block_mask(
    rows: int, q_offset: int, keys: int, k_offset: int, causal: bool, mask: torch.Tensor | None, like: torch.Tensor
) -> torch.Tensor | None:
    """The additive mask of one block: the model's mask cut to the block's key columns, plus the
    causal mask at the block's offsets where the diagonal crosses it."""
    block = None
    if mask is not None:
        block = mask if mask.shape[-1] == 1 else mask.narrow(-1, k_offset, keys)
        if block.dtype == torch.bool:
            block = torch.zeros(block.shape, dtype=like.dtype, device=like.device).masked_fill(~block, NEG_INF)
        else:
            block = block.to(like.dtype)
    if causal and k_offset + keys - 1 > q_offset:
        i = torch.arange(rows, device=like.device).unsqueeze(1) + q_offset
        j = torch.arange(keys, device=like.device).unsqueeze(0) + k_offset
        tri = torch.zeros(rows, keys, dtype=like.dtype, device=like.device).masked_fill(j > i, NEG_INF)
        block = tri if block is None else block + tri
    return block


def _hidden(rows: int, q_offset: int, k_offset: int, causal: bool) -> bool:
    """Whether a causal block of keys lies wholly after every query of the rank's block."""
    return causal and k_offset > q_offset + rows - 1


def block_forward(
    q: torch.Tensor,
    kv: torch.Tensor,
    mask: torch.Tensor | None,
    q_offset: int,
    k_offset: int,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ring step: the rank's queries against one key/value block (`kv`: keys and values
    stacked on a new dim 0): (output in float32, logsumexp), a row the block masks wholly at
    logsumexp -inf and output 0, both in float32 at least (the merge's accumulation)."""
    rows, keys = q.shape[SEQ], kv.shape[SEQ + 1]
    acc = torch.promote_types(q.dtype, torch.float32)
    if _hidden(rows, q_offset, k_offset, causal):
        return q.new_zeros(q.shape, dtype=acc), q.new_full(q.shape[:-1], NEG_INF, dtype=acc)
    block = _block_mask(rows, q_offset, keys, k_offset, causal, mask, q)
    out, lse = device_attention.attention_forward(q, kv[0], kv[1], 0.0, False, attn_mask=block, scale=scale)
    lse = lse.to(acc)
    if block is not None:
        dead = torch.isneginf(block).all(-1)
        lse = torch.where(dead, NEG_INF, lse)
    return out.to(acc), lse


def merge_blocks(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, merged by their
    log-sum-exps: the softmax over the union of the keys (a row neither saw stays 0 and -inf)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = torch.logaddexp(lse_a, lse_b)
    base = torch.where(torch.isneginf(lse), 0.0, lse)
    weight_a = torch.exp(lse_a - base).unsqueeze(-1)
    weight_b = torch.exp(lse_b - base).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def finish_forward(acc: tuple[torch.Tensor, torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged (output, logsumexp) as the kernel returns them: the output in the query's dtype,
    and a row no key could reach at logsumexp 0 (the kernel's convention, which its backward reads)."""
    out, lse = acc
    return out.to(like.dtype), torch.where(torch.isneginf(lse), 0.0, lse)


def block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    q_offset: int,
    k_offset: int,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One backward ring step: the block's share of the query gradient and of its own key/value
    gradient (stacked like `kv`), from the whole rows' output and logsumexp."""
    rows, keys = q.shape[SEQ], kv.shape[SEQ + 1]
    if _hidden(rows, q_offset, k_offset, causal):
        return torch.zeros_like(q), torch.zeros_like(kv)
    block = _block_mask(rows, q_offset, keys, k_offset, causal, mask, q)
    dq, dk, dv = device_attention.attention_backward(
        grad_out, q, kv[0], kv[1], out, lse, 0.0, False, attn_mask=block, scale=scale
    )
    return dq, torch.stack([dk, dv])


# ---------------------------------------------------------------- the rank's nodes


def _shift_sizes(count: int, me: int, p: int) -> tuple[list[int], list[int]]:
    """all_to_all_single's (output, input) split sizes of a pass to the next rank of the ring:
    everything to rank me+1, everything from rank me-1."""
    out = [count if r == (me - 1) % p else 0 for r in range(p)]
    sent = [count if r == (me + 1) % p else 0 for r in range(p)]
    return out, sent


class _Builder:
    """Adds one rank's ring nodes to a graph: exchanges tagged with their CommStep and group (so
    dumps, pricing and the test harness see them as collectives), the rest plain compute."""

    def __init__(self, graph: fx.Graph, base: NodeInfo, axis: int, p: int, me: int, group: str, kv: Layout) -> None:
        self.graph, self.axis, self.p, self.me, self.group = graph, axis, p, me, group
        self.compute = replace(base, role="compute", strategy=None, layouts=(), comm=None, comm_group=None)
        self.comm = replace(self.compute, role="comm")
        self.kv = kv  # the layout of one key or value (global shape): an exchanged block's size

    def node(self, target: Callable[..., Any], *args: Any) -> fx.Node:
        new = self.graph.call_function(target, args)
        set_info(new, self.compute)
        return new

    def shift(self, payload: fx.Node, count: int) -> fx.Node:
        """Pass `payload` (`count` keys/values or gradients stacked on dim 0) to the next rank."""
        out_sizes, in_sizes = _shift_sizes(count, self.me, self.p)
        block = Layout(
            tuple(Shard(p.dim + 1) if isinstance(p, Shard) else p for p in self.kv.placements),
            (count, *self.kv.shape),
            self.kv.dtype,
        )
        sent = self.graph.call_function(c10d.all_to_all_single.default, (payload, out_sizes, in_sizes, self.group))
        step = CommStep("ring_shift", self.axis, block, block)
        set_info(sent, replace(self.comm, comm=step, comm_group=self.group))
        waited = self.graph.call_function(c10d.wait_tensor.default, (sent,))
        set_info(waited, self.comm)
        return waited

    def get(self, x: fx.Node, i: int) -> fx.Node:
        return self.node(operator.getitem, x, i)

    def rows(self, x: fx.Node, start: int, stop: int) -> fx.Node:
        return self.node(aten.slice.Tensor, x, 0, start, stop)


def ring_graph(ctx: LocalContext, axis: int) -> LocalGraph:
    """The rank's nodes of a ring-attention call (forward or backward) on mesh axis `axis`."""
    call, strategy = ctx.call, ctx.strategy
    backward = call.op == BACKWARD
    q_layout = strategy.inputs[1 if backward else 0]
    k_layout = strategy.inputs[key_index(call.op)]
    p, me = ctx.mesh_shape[axis], ctx.coords[axis]
    if k_layout.shape[SEQ] % p:
        raise ShardingError(
            f"{call.op}: ring attention over {p} ranks needs a sequence that they split evenly, not {k_layout.shape[SEQ]}",
            op=str(call.op),
            hint='pad the sequence to a multiple of the axis size, or use PlanOptions(context_parallel="allgather")',
        )
    q_offset = q_layout.local_offsets(ctx.mesh_shape, ctx.coords)[SEQ]
    k_offsets = []
    for s in range(p):
        source = list(ctx.coords)
        source[axis] = (me - s) % p
        k_offsets.append(k_layout.local_offsets(ctx.mesh_shape, source)[SEQ])
    causal = bool(call.arg(7 if backward else 4, "is_causal", False))
    scale = ctx.kwargs.get("scale")
    group = ctx.groups[axis] if ctx.groups else f"<axis {axis}>"

    def build(graph: fx.Graph, args: tuple[Any, ...], kwargs: dict[str, Any], base: NodeInfo) -> fx.Node:
        b = _Builder(graph, base, axis, p, me, group, k_layout)
        mask = kwargs.get("attn_mask")
        if backward:
            return _backward(b, args, mask, q_offset, k_offsets, causal, scale)
        return _forward(b, args, mask, q_offset, k_offsets, causal, scale)

    return LocalGraph(build)


def _forward(
    b: _Builder, args: tuple[Any, ...], mask: Any, q_offset: int, k_offsets: list[int], causal: bool, scale: Any
) -> fx.Node:
    q, k, v = args[:3]
    kv = b.node(aten.stack.default, [k, v])
    acc = None
    for s in range(b.p):
        incoming = b.shift(kv, 2) if s + 1 < b.p else None  # issued first: it overlaps the block
        part = b.node(block_forward, q, kv, mask, q_offset, k_offsets[s], causal, scale)
        acc = part if acc is None else b.node(merge_blocks, acc, part)
        if incoming is not None:
            kv = incoming
    return b.node(finish_forward, acc, q)


def _backward(
    b: _Builder, args: tuple[Any, ...], mask: Any, q_offset: int, k_offsets: list[int], causal: bool, scale: Any
) -> fx.Node:
    """Step s holds block me-s and, from the previous rank, the gradient accumulated so far for it
    (arriving in the same exchange as the next block); the rank adds its share and passes it on."""
    grad_out, q, k, v, out, lse = args[:6]
    kv = b.node(aten.stack.default, [k, v])
    grad_q = None
    carried: fx.Node | None = None  # this rank's accumulator of the previous step's block
    for s in range(b.p):
        payload = [x for x in (kv if s + 1 < b.p else None, carried) if x is not None]
        sent = b.node(aten.cat.default, payload) if len(payload) > 1 else payload[0]
        incoming = b.shift(sent, 2 * len(payload))
        part = b.node(block_backward, grad_out, q, kv, out, lse, mask, q_offset, k_offsets[s], causal, scale)
        dq = b.get(part, 0)
        grad_q = dq if grad_q is None else b.node(aten.add.Tensor, grad_q, dq)
        mine = b.get(part, 1)
        if s + 1 < b.p:
            kv = b.rows(incoming, 0, 2)
        carried = mine if carried is None else b.node(aten.add.Tensor, b.rows(incoming, len(payload) * 2 - 2, len(payload) * 2), mine)
    assert carried is not None and grad_q is not None
    final = b.shift(carried, 2)
    return b.node(_gradients, grad_q, final)


def _gradients(grad_q: torch.Tensor, grad_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward op's (dq, dk, dv) from the summed query gradient and the returned accumulator."""
    return grad_q, grad_kv[0], grad_kv[1]


def exposed_exchange_seconds(backward: bool, p: int, exchange: float, block: float) -> float:
    """Modeled time a ring's exchanges add to its attention call: each exchange overlaps one block's
    computation (`block` seconds), so only what exceeds it shows; `exchange` is one key/value block
    to the next rank. Forward: p-1 exchanges of a block. Backward: block 0 alone, then blocks with
    the previous block's gradient accumulator (twice the bytes), the last accumulator alone, and
    its final pass after the last block, which nothing hides."""
    if p <= 1:
        return 0.0
    if not backward:
        return (p - 1) * max(0.0, exchange - block)
    middle = max(0, p - 2) * max(0.0, 2 * exchange - block)
    return 2 * max(0.0, exchange - block) + middle + exchange

