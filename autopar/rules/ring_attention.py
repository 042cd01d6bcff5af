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
  i > j (no mask), and the diagonal block runs the kernel's causal flag (`_kernel_calls`). The
  last rank computes p blocks, the first one: the contiguous split's imbalance;
- **the load-balanced order** (`BalancedShard`: rank r holds chunks r and 2p-1-r of 2p): the
  blocks travel as they are, two chunks each, and each run of query rows attends only the runs
  of keys it can see. At every step a rank computes half a block of scores (the diagonal step:
  both chunks' triangles, each with the kernel's causal flag, and the back chunk against the
  front without a mask, so no half-block the mask hides is computed; a block from an earlier rank:
  both query chunks against its front chunk; from a later rank: the back query chunk against
  both), so every rank does the same causal work and every exchange hides behind the same share;
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
from autopar.core.layout import BalancedShard, Layout, Placement, Shard
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


def ring_strategies(call: OpCall, masks: tuple[Placement, ...], balanced: bool = False) -> list[AxisStrategy]:
    """The ring split of one self-attention call on one axis: every (B, H, L, E) tensor and the
    logsumexp along the sequence (with `balanced`, in the load-balanced order: each rank's two
    chunks travel together); `masks` as the query-sequence split places them (query rows with the
    queries, whole along the keys). None where keys and queries differ in length (cross
    attention) or keys and values in head size or dtype (they travel as one block)."""
    backward = call.op == BACKWARD
    q, k, v = call.inputs[1:4] if backward else call.inputs[:3]
    if q.shape[SEQ] != k.shape[SEQ] or k.shape != v.shape or k.dtype != v.dtype:
        return []
    split = BalancedShard(SEQ) if balanced else Shard(SEQ)
    if backward:
        return [AxisStrategy((split,) * 6 + masks, (split,) * 3)]
    return [AxisStrategy((split,) * 3 + masks, (split, split))]


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
    (a ring passes whole blocks of one axis), into equal blocks (the exchange's shapes are fixed;
    in the load-balanced order, equal chunks: twice as many)."""
    k = strategy.inputs[key_index(call.op)]
    axes = k.shard_axes(SEQ)
    if not axes:
        return True
    blocks = mesh_shape[axes[0]] * (2 if k.balanced_dims() else 1)
    return len(axes) == 1 and k.shape[SEQ] % blocks == 0


# ---------------------------------------------------------------- what one step computes


Chunks = tuple[tuple[int, int], ...]  # (start, length) of each run of the sequence, in local order


def _visible(q_chunk: tuple[int, int], k_chunks: Chunks, causal: bool) -> list[int]:
    """The runs of a block's keys that a run of query rows sees: all of them, or with a causal mask
    those not wholly after its last query (causal skipping: a hidden run is never computed)."""
    start, rows = q_chunk
    return [j for j, (k_start, _) in enumerate(k_chunks) if not (causal and k_start > start + rows - 1)]


def _starts(chunks: Chunks) -> list[int]:
    """Where each run begins in the local tensor (the runs lie end to end)."""
    found, at = [], 0
    for _, n in chunks:
        found.append(at)
        at += n
    return found


def _block_mask(
    q_chunk: tuple[int, int], k_chunks: Chunks, causal: bool, mask: torch.Tensor | None, like: torch.Tensor
) -> torch.Tensor | None:
    """The additive mask of one run of query rows against some runs of keys: the model's mask
    (already cut to the run's rows) cut to those keys' columns, plus the causal mask at their
    positions in the sequence where some key lies after some query."""
    start, rows = q_chunk
    block = None
    if mask is not None:
        block = mask
        if mask.shape[-1] != 1:
            block = torch.cat([mask.narrow(-1, k, n) for k, n in k_chunks], -1) if len(k_chunks) > 1 else (
                mask.narrow(-1, k_chunks[0][0], k_chunks[0][1])
            )
        if block.dtype == torch.bool:
            block = torch.zeros(block.shape, dtype=like.dtype, device=like.device).masked_fill(~block, NEG_INF)
        else:
            block = block.to(like.dtype)
    if causal and max(k + n - 1 for k, n in k_chunks) > start:
        i = torch.arange(rows, device=like.device).unsqueeze(1) + start
        j = torch.cat([torch.arange(k, k + n, device=like.device) for k, n in k_chunks]).unsqueeze(0)
        tri = torch.zeros(rows, j.shape[1], dtype=like.dtype, device=like.device).masked_fill(j > i, NEG_INF)
        block = tri if block is None else block + tri
    return block


def _kernel_calls(
    q_chunk: tuple[int, int], k_chunks: Chunks, runs: list[int], causal: bool, mask: torch.Tensor | None
) -> list[tuple[list[int], bool]]:
    """How a run of query rows computes against the visible runs `runs` of a block: a list of
    (runs of keys, the kernel's causal flag), one kernel call each. With a causal mask and no mask
    of the model's, the runs wholly before the rows (every key visible) are one call without a
    mask, and the run at the rows' own positions (the diagonal) one call with the flag: its square's
    top-left alignment is the sequence's, so the kernel skips the tiles above the diagonal instead
    of computing and masking them. That is the load-balanced order's mirror chunk on the diagonal
    step (its front chunk before it, its own chunk on the diagonal): two calls, about half the
    scores of one masked call. Otherwise one call over all the runs, masked where needed; none
    where the rows see no run of the block."""
    if not runs:
        return []
    if not (causal and mask is None):
        return [(runs, False)]
    start = q_chunk[0]
    before = [j for j in runs if k_chunks[j][0] + k_chunks[j][1] <= start]
    rest = [j for j in runs if j not in before]
    if not rest:
        return [(runs, False)]
    if [k_chunks[j] for j in rest] != [q_chunk]:
        return [(runs, False)]
    return ([(before, False)] if before else []) + [(rest, True)]


def _mask_rows(mask: torch.Tensor | None, at: int, rows: int) -> torch.Tensor | None:
    """Query rows `at..at+rows` of a mask (dim -2); one that broadcasts along the queries (size 1
    there, or 1-D) goes whole."""
    if mask is None or mask.dim() < 2 or mask.shape[-2] == 1:
        return mask
    return mask.narrow(-2, at, rows)


def _keys(kv: torch.Tensor, k_chunks: Chunks, runs: list[int]) -> torch.Tensor:
    """The stacked keys and values of the visible runs `runs` of a block, end to end."""
    if len(runs) == len(k_chunks):
        return kv
    starts = _starts(k_chunks)
    parts = [kv.narrow(SEQ + 1, starts[j], k_chunks[j][1]) for j in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, SEQ + 1)


def block_forward(
    q: torch.Tensor,
    kv: torch.Tensor,
    mask: torch.Tensor | None,
    q_chunks: Chunks,
    k_chunks: Chunks,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ring step: the rank's queries (runs of the sequence at `q_chunks`: one for a contiguous
    split, two for the load-balanced one) against one key/value block (`kv`: keys and values
    stacked on a new dim 0, its runs at `k_chunks`): (output, logsumexp) in float32 at least (the
    merge's accumulation). Each run of rows attends only the runs of keys it can see; a row that
    sees no key of the block has logsumexp -inf and output 0."""
    acc = torch.promote_types(q.dtype, torch.float32)
    outs, lses = [], []
    for at, q_chunk in zip(_starts(q_chunks), q_chunks):
        rows = q_chunk[1]
        runs = _visible(q_chunk, k_chunks, causal)
        q_run = q.narrow(SEQ, at, rows)
        merged: tuple[torch.Tensor, torch.Tensor] | None = None
        for group, flag in _kernel_calls(q_chunk, k_chunks, runs, causal, mask):
            keys = _keys(kv, k_chunks, group)
            block = None if flag else _block_mask(q_chunk, tuple(k_chunks[j] for j in group), causal, _mask_rows(mask, at, rows), q)
            out, lse = device_attention.attention_forward(q_run, keys[0], keys[1], 0.0, flag, attn_mask=block, scale=scale)
            lse = lse.to(acc)
            if block is not None:
                lse = torch.where(torch.isneginf(block).all(-1), NEG_INF, lse)
            merged = (out.to(acc), lse) if merged is None else merge_blocks(merged, (out.to(acc), lse))
        if merged is None:  # the block hides every key from these rows
            merged = (q_run.new_zeros(q_run.shape, dtype=acc), q_run.new_full(q_run.shape[:-1], NEG_INF, dtype=acc))
        outs.append(merged[0])
        lses.append(merged[1])
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, SEQ), torch.cat(lses, SEQ)


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
    q_chunks: Chunks,
    k_chunks: Chunks,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One backward ring step: the block's share of the query gradient and of its own key/value
    gradient (stacked like `kv`), from the whole rows' output and logsumexp; each run of rows
    against the runs of keys it sees, as in `block_forward`."""
    grad_q = torch.zeros_like(q)
    grad_kv = torch.zeros_like(kv)  # both summed into in place: no call's gradients outlive it
    k_starts = _starts(k_chunks)
    for at, q_chunk in zip(_starts(q_chunks), q_chunks):
        rows = q_chunk[1]
        runs = _visible(q_chunk, k_chunks, causal)
        q_run = q.narrow(SEQ, at, rows)
        for group, flag in _kernel_calls(q_chunk, k_chunks, runs, causal, mask):
            keys = _keys(kv, k_chunks, group)
            block = None if flag else _block_mask(q_chunk, tuple(k_chunks[j] for j in group), causal, _mask_rows(mask, at, rows), q)
            dq, dk, dv = device_attention.attention_backward(
                grad_out.narrow(SEQ, at, rows), q_run, keys[0], keys[1], out.narrow(SEQ, at, rows),
                lse.narrow(SEQ, at, rows), 0.0, flag, attn_mask=block, scale=scale,
            )  # fmt: skip
            grad_q.narrow(SEQ, at, rows).add_(dq)
            at_key = 0
            for j in group:
                n = k_chunks[j][1]
                grad_kv[0].narrow(SEQ, k_starts[j], n).add_(dk.narrow(SEQ, at_key, n))
                grad_kv[1].narrow(SEQ, k_starts[j], n).add_(dv.narrow(SEQ, at_key, n))
                at_key += n
            del dq, dk, dv
    return grad_q, grad_kv


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
        block = exchanged_block(self.kv, count)
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
    q_chunks = q_layout.local_chunks(ctx.mesh_shape, ctx.coords, SEQ)
    k_chunks = []  # the runs of the sequence in the block the rank holds at each step
    for s in range(p):
        source = list(ctx.coords)
        source[axis] = (me - s) % p
        k_chunks.append(k_layout.local_chunks(ctx.mesh_shape, source, SEQ))
    causal = bool(call.arg(7 if backward else 4, "is_causal", False))
    scale = ctx.kwargs.get("scale")
    group = ctx.groups[axis] if ctx.groups else f"<axis {axis}>"

    def build(graph: fx.Graph, args: tuple[Any, ...], kwargs: dict[str, Any], base: NodeInfo) -> fx.Node:
        b = _Builder(graph, base, axis, p, me, group, k_layout)
        mask = kwargs.get("attn_mask")
        if backward:
            return _backward(b, args, mask, q_chunks, k_chunks, causal, scale)
        return _forward(b, args, mask, q_chunks, k_chunks, causal, scale)

    return LocalGraph(build)


def _forward(
    b: _Builder, args: tuple[Any, ...], mask: Any, q_chunks: Chunks, k_chunks: list[Chunks], causal: bool, scale: Any
) -> fx.Node:
    q, k, v = args[:3]
    kv = b.node(aten.stack.default, [k, v])
    acc = None
    for s in range(b.p):
        incoming = b.shift(kv, 2) if s + 1 < b.p else None  # issued first: it overlaps the block
        part = b.node(block_forward, q, kv, mask, q_chunks, k_chunks[s], causal, scale)
        acc = part if acc is None else b.node(merge_blocks, acc, part)
        if incoming is not None:
            kv = incoming
    return b.node(finish_forward, acc, q)


def _backward(
    b: _Builder, args: tuple[Any, ...], mask: Any, q_chunks: Chunks, k_chunks: list[Chunks], causal: bool, scale: Any
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
        part = b.node(block_backward, grad_out, q, kv, out, lse, mask, q_chunks, k_chunks[s], causal, scale)
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


def exchanged_block(kv: Layout, count: int) -> Layout:
    """The layout (global shape) of one ring exchange's payload: `count` keys, values or their
    gradients (each laid out as `kv`) stacked on a new dim 0."""
    placements = tuple(Shard(p.dim + 1) if isinstance(p, Shard) else p for p in kv.placements)
    return Layout(placements, (count, *kv.shape), kv.dtype)


Shift = tuple[float, float]  # one exchange's (seconds a block's compute can hide, seconds it cannot)


def exposed_exchange_seconds(backward: bool, p: int, pair: Shift, double: Shift, block: float) -> float:
    """Modeled time a ring's exchanges add to its attention call. Each exchange overlaps one block's
    computation (`block` seconds), so only what of its wire time exceeds that shows, plus what the
    exchange costs its own rank whatever the overlap (`Link.call`: on gloo, the copies and queueing
    on the rank's cores). `pair`: passing a key/value block (keys and values), `double`: a block
    with the previous block's gradient accumulator (twice the bytes). Forward: p-1 pairs. Backward:
    block 0 alone, then blocks with the previous block's accumulator, the last accumulator alone,
    and its final pass after the last block, which nothing hides."""
    if p <= 1:
        return 0.0

    def shown(shift: Shift) -> float:
        return max(0.0, shift[0] - block) + shift[1]

    if not backward:
        return (p - 1) * shown(pair)
    return 2 * shown(pair) + max(0, p - 2) * shown(double) + pair[0] + pair[1]
