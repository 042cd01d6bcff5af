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
(`device_attention.attention_forward` with `row_offset=o`) therefore runs the kernel twice with no
mask: on the keys 0..o-1 before the block without its causal flag, and on the diagonal block of
keys o..o+n-1 (a square, where the flag's mask is the right one) with it, merged by their
log-sum-exps; so it computes exactly the block's rows of the causal triangle, which is what the
price counts. Where the model passes a mask as well, it runs once on the keys 0..o+n-1 with an
additive mask that is -inf above the shifted diagonal, added to the model's. Its backward gives
zero gradients for the keys after the block.

Refused (the strategy is not offered, so the search picks a batch or head split or keeps
attention whole; `sequence_split_refusal` says why): attention with dropout (the CPU pair is
only ever traced with `dropout_p=0`, dropout inside attention is traced as its math
decomposition, but a sequence split of a kernel that drew its own dropout mask could not give the
serial numbers), and queries that are not 4-D (B, H, L, E).

Asked for (`require_context_parallel`): a mesh axis named "cp" requires, on that axis, the token
embeddings split along the sequence and attention split by this strategy ("allgather") or by heads
("ulysses": with the activations sequence-split, insert_comm's Shard(2) -> Shard(1) redistribution
of q, k and v is DeepSpeed-Ulysses' all-to-all), or either ("auto", by the search's cost).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from autopar.core.layout import BalancedShard, Layout, P, Placement, R, Replicate, Shard
from autopar.core.strategy import AxisStrategy, OpCall, Strategy, TensorSpec
from autopar.rules import device_attention, ring_attention
from autopar.rules.balanced import balanced_registry, only_on_axis
from autopar.rules.base import LocalCall, LocalContext, LocalGraph, Requirement, RuleRegistry, both
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


def is_causal(call: OpCall) -> bool:
    """Whether the call has torch's own causal mask (`is_causal=True`)."""
    return bool(call.arg(7 if call.op == BACKWARD else 4, "is_causal", False))


def contiguous_causal_imbalance(p: int) -> float:
    """The busiest rank's causal work over the mean, with the sequence split into p contiguous
    blocks: block i's queries see the keys of blocks 0..i (i + 1/2 blocks of work, the diagonal
    block half), so the last does p - 1/2 of the mean p/2: (2p - 1) / p, up to 2 for many ranks."""
    return (2 * p - 1) / p if p > 1 else 1.0


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
    """The query-sequence splits of one attention call on one mesh axis (none if refused).

    Forward (q, k, v[, mask]) -> (out, logsumexp): q, out, logsumexp split along the sequence,
    k and v whole. Backward (grad_out, q, k, v, out, logsumexp[, mask]) -> (dq, dk, dv): grad_out,
    q, out, logsumexp and dq split along the sequence, k and v whole, dk and dv partial sums.
    And ring attention (`ring_attention.ring_strategies`): k, v, dk and dv split too."""
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
        return [AxisStrategy(ins, (Shard(SEQ), P, P)), *ring_attention.ring_strategies(call, masks)]
    return [AxisStrategy((Shard(SEQ), R, R, *masks), (Shard(SEQ), Shard(SEQ))), *ring_attention.ring_strategies(call, masks)]


def balanced_strategies(call: OpCall) -> list[AxisStrategy]:
    """The query-sequence split of `sequence_strategies` (keys and values gathered) in the
    load-balanced order (`BalancedShard`): q, out, logsumexp, dq and a mask's query dim split
    balanced, k and v whole, dk and dv partial sums; and ring attention in that order (k, v, dk
    and dv balanced too, `ring_attention.ring_strategies`). Offered on a "cp" axis only
    (`require_context_parallel`)."""
    if sequence_split_refusal(call) is not None:
        return []
    q = call.inputs[_query_index(call)]
    if q.shape[SEQ] < 2:
        return []
    b = BalancedShard(SEQ)
    backward = call.op == BACKWARD
    n_main = 6 if backward else 3
    masks = tuple(
        BalancedShard(m.ndim - 2) if isinstance(_mask_placement(m, q.shape[SEQ]), Shard) else R
        for m in call.inputs[n_main:]
    )
    ring = ring_attention.ring_strategies(call, masks, balanced=True)
    if backward:
        if not partial_ok(call.inputs, call.outputs[1:]):
            return ring
        return [AxisStrategy((b, b, R, R, b, b, *masks), (b, P, P)), *ring]
    return [AxisStrategy((b, R, R, *masks), (b, b)), *ring]


def _with_balanced(strategies: Callable[[OpCall], list[AxisStrategy]]) -> Callable[[OpCall], list[AxisStrategy]]:
    def offered(call: OpCall) -> list[AxisStrategy]:
        return [*strategies(call), *balanced_strategies(call)]

    return offered


def _localize_balanced(ctx: LocalContext, q_layout: Layout) -> LocalCall:
    """Attention with its queries split in the load-balanced order: rows are independent of each
    other, so only a causal call needs its rows' places, one causal block per chunk at the chunk's
    offset (`device_attention.attention_forward_chunks`); a mask's rows came balanced too."""
    call = ctx.call
    if not is_causal(call):
        return LocalCall(call.op, ctx.args, ctx.kwargs)
    offsets = tuple(start for start, _ in q_layout.local_chunks(ctx.mesh_shape, ctx.coords, SEQ))
    backward = call.op == BACKWARD
    n_main = 6 if backward else 3
    kwargs = {"attn_mask": ctx.kwargs.get("attn_mask"), "scale": ctx.kwargs.get("scale"), "row_offsets": offsets}
    target: Callable[..., object] = (
        device_attention.attention_backward_chunks if backward else device_attention.attention_forward_chunks
    )
    return LocalCall(target, (*ctx.args[:n_main], _dropout_p(call)), kwargs)


def row_runs(call: OpCall, strategy: Strategy) -> int:
    """How many runs of rows, each at its own offset of the sequence, the local call of a causal
    attention op cuts the rank's queries into (`localize_attention`): 2 in the load-balanced order
    (its two chunks), 1 where the queries are split in contiguous blocks and the keys are whole,
    0 where the local call is the op itself or the ring's. The memory model counts what such a
    call holds beyond its results (`planning.working.causal_rows_scratch_bytes`)."""
    if call.op not in (FORWARD, BACKWARD) or not is_causal(call) or ring_attention.ring_axis(call.op, strategy) is not None:
        return 0
    q_layout = strategy.inputs[_query_index(call)]
    if any(dim == SEQ for dim, _ in q_layout.balanced_dims()):
        return 2
    return 1 if q_layout.shard_axes(SEQ) else 0


def localize_attention(ctx: LocalContext) -> LocalCall | LocalGraph:
    """The local call of an attention op: the op itself, unless it is causal with the queries split
    along the sequence, where the rank's queries start at offset o of the whole sequence and must
    attend keys 0..o+i (`device_attention.attention_forward` with `row_offset=o`); or, with the
    keys split along the sequence too, the nodes of ring attention (`ring_attention.ring_graph`)."""
    call = ctx.call
    ring = ring_attention.ring_axis(call.op, ctx.strategy)
    if ring is not None:
        return ring_attention.ring_graph(ctx, ring)
    q_layout = ctx.strategy.inputs[_query_index(call)]
    if q_layout.balanced_dims():
        return _localize_balanced(ctx, q_layout)
    if not is_causal(call) or not q_layout.shard_axes(SEQ):
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


# ---------------------------------------------------------------- asked for: a "cp" mesh axis

CP_AXIS = "cp"  # the mesh axis name that asks for context parallelism
HEADS = 1  # the heads dim of the (B, H, L, E) query: Ulysses' split inside attention
# PlanOptions.context_parallel -> the (query, key) placements attention may take on the "cp" axis
CP_STRATEGIES: dict[str, tuple[tuple[Placement, Placement], ...]] = {
    "auto": (
        (Shard(SEQ), R),
        (Shard(SEQ), Shard(SEQ)),
        (Shard(HEADS), Shard(HEADS)),
        (BalancedShard(SEQ), R),
        (BalancedShard(SEQ), BalancedShard(SEQ)),
    ),
    "allgather": ((Shard(SEQ), R),),
    "balanced": ((BalancedShard(SEQ), R),),
    "ring": ((Shard(SEQ), Shard(SEQ)),),
    "ring_balanced": ((BalancedShard(SEQ), BalancedShard(SEQ)),),
    "ulysses": ((Shard(HEADS), Shard(HEADS)),),
}
EMBEDDING = torch.ops.aten.embedding.default
BALANCED = ("balanced", "ring_balanced")  # the strategies that lay the whole block out in the balanced order


def _attention_requirement(axis: int, strategy: str) -> Requirement:
    allowed = CP_STRATEGIES[strategy]

    def admits(call: OpCall, chosen: Strategy) -> bool:
        q = chosen.inputs[_query_index(call)].placements[axis]
        k = chosen.inputs[ring_attention.key_index(call.op)].placements[axis]
        return (q, k) in allowed

    hints = {
        "allgather": "the queries' sequence (dim 2 of (batch, heads, sequence, head_dim)) must split "
        "over the cp axis, without dropout inside attention",
        "balanced": "the queries' sequence (dim 2 of (batch, heads, sequence, head_dim)) must split over the "
        "cp axis in the load-balanced order: into 2 * (cp axis size) equal chunks, without dropout inside "
        "attention",
        "ring": "the queries', keys' and values' sequence (dim 2 of (batch, heads, sequence, head_dim)) must "
        "split evenly over the cp axis, in self-attention (keys as long as the queries, keys and values of "
        "one head size), without dropout inside attention",
        "ring_balanced": "the queries', keys' and values' sequence (dim 2 of (batch, heads, sequence, head_dim)) "
        "must split over the cp axis in the load-balanced order, into 2 * (cp axis size) equal chunks, in "
        "self-attention (keys as long as the queries, keys and values of one head size), without dropout "
        "inside attention",
        "ulysses": "the query and key/value heads must split over the cp axis: as many key/value heads as "
        "query heads (repeated before the call), a multiple of the cp axis size",
    }
    hint = hints.get(strategy, f"{hints['allgather']}, or ring attention's, or its heads ({hints['ulysses']})")
    return Requirement(admits, f"the mesh's \"cp\" axis asks for context parallelism: {hint}; "
                       'or use PlanOptions(context_parallel="allgather" / "ring" / "ulysses"), or name the axis otherwise')


def _embedding_requirement(axis: int, strategy: str) -> Requirement:
    balanced_split: tuple[Placement, ...] = (BalancedShard(1),)
    splits = {"auto": (Shard(1), BalancedShard(1)), **dict.fromkeys(BALANCED, balanced_split)}.get(strategy, (Shard(1),))

    def admits(call: OpCall, chosen: Strategy) -> bool:
        out = chosen.outputs[0]
        return len(out.shape) < 3 or out.placements[axis] in splits

    balanced = " (balanced: a multiple of twice the cp axis size)" if strategy in BALANCED else ""
    return Requirement(
        admits,
        'the mesh\'s "cp" axis splits the token activations (batch, sequence, width) along the sequence: '
        f"their sequence must be at least the cp axis size{balanced}",
    )


def _weights_whole(axis: int) -> Requirement:
    """Pure Ulysses (`context_parallel="ulysses"`): every op reads its weights (parameters and
    their views and casts, `OpCall.weights`) whole on the "cp" axis, and its other tensors split
    there (the tokens: the sequence, or the heads inside attention), as DeepSpeed-Ulysses does:
    outside attention the axis is data parallel over the sequence (each rank its tokens, every
    weight whole, each weight's gradient a pending sum the plan reduces over the axis), and the
    activations move on it only by the all-to-alls around attention (and, where a weight is stored
    split over the axis, for its gradient's product if a gather prices cheaper than the pending
    sum's reduce-scatter: that product reads no weight). Without it the search prices Megatron's
    sequence parallelism (weights split, tokens gathered around the projections) on the same axis
    and often prefers it."""

    def admits(call: OpCall, chosen: Strategy) -> bool:
        if not any(call.weights):
            return True
        for weight, layout in zip(call.weights, chosen.inputs):
            placement = layout.placements[axis]
            if weight and not isinstance(placement, Replicate):
                return False  # a weight split over the axis (tensor or sequence parallelism)
            if not weight and layout.shape and not isinstance(placement, Shard):
                return False  # tokens whole on the axis: every rank would compute them all
        return True

    return Requirement(
        admits,
        'context_parallel="ulysses" keeps every weight whole on the "cp" axis (data parallel over the '
        "sequence there, DeepSpeed-Ulysses); an op that cannot read its weight whole with its tokens "
        'split cannot run so: use context_parallel="auto" or "allgather", or name the axis otherwise',
    )


def require_context_parallel(registry: RuleRegistry, axis: int, strategy: str = "auto") -> RuleRegistry:
    """A copy of `registry` whose plans split the sequence over mesh axis `axis` (a "cp" axis):
    token embeddings (B, T, E) split along T there, so the activations after them are split along
    the sequence, and every attention call, forward and backward, splits its queries there along
    the sequence (`strategy` "allgather": keys and values gathered; "ring": keys and values split
    too, passed around the ring; "balanced" and "ring_balanced": the same two in the load-balanced
    causal order, the embeddings too) or along the heads
    ("ulysses": the all-to-all from the sequence split to the heads split and back, which
    insert_comm makes of the redistribution, with every op's weights whole on the axis:
    `_weights_whole`), or any ("auto": the cheapest, by the search).
    Other ops keep every strategy (with "ulysses", those that read their weights whole on the
    axis): the search lays them out around these."""
    if strategy not in CP_STRATEGIES:
        raise ValueError(f"context parallel strategy {strategy!r}: one of {', '.join(CP_STRATEGIES)}")
    constrained = registry.copy()
    if strategy in ("auto", *BALANCED):  # the load-balanced split is offered on the "cp" axis only
        # (carried over the linears' (batch, sequence) merge only when asked for: under "auto" the
        # extra strategies led the search to a dearer local optimum, 0.489 against 0.388 ms on the
        # zoo LLaMA on (2,4) dp,cp; docs/context-parallel.md)
        constrained = balanced_registry(
            registry, axis, skip=frozenset({FORWARD, BACKWARD}), merges=strategy in BALANCED
        )
    for op in (FORWARD, BACKWARD):
        rule = constrained.get(op)
        if rule is None:
            continue
        if strategy in ("auto", *BALANCED):
            constrained.replace(dataclasses.replace(rule, strategies=_with_balanced(rule.strategies)))
        constrained.require(op, _attention_requirement(axis, strategy))
        if strategy in ("auto", "ring", "ring_balanced"):  # the ring is offered where a "cp" axis asks for it
            constrained.admit(op, ring_attention.ring_admissible)
        if strategy in ("auto", *BALANCED):
            admits = constrained.get(op).admits  # type: ignore[union-attr]
            constrained.admit(op, only_on_axis(axis, admits))
    if EMBEDDING in constrained:
        constrained.require(EMBEDDING, _embedding_requirement(axis, strategy))
    if strategy == "ulysses":
        whole = _weights_whole(axis)
        for op in constrained.ops():
            if op not in (FORWARD, BACKWARD):
                constrained.require(op, both(constrained.get(op).requirement, whole))  # type: ignore[union-attr]
    if strategy == "auto":
        # the search's seeds list the contiguous strategies first, and no chain move turns a whole
        # residual stream balanced: the balanced plan (linears' merge included) seeds it too, and
        # its strategies join the candidates (docs/context-parallel.md#asking-for-it-a-cp-axis); the
        # balanced ring's plan too (its blocks hide its exchanges on fast links: no chain move from
        # the all-gather's plan turns every attention call's keys and values split at once)
        constrained.seed_from("balanced", require_context_parallel(registry, axis, "balanced"))
        constrained.seed_from("ring_balanced", require_context_parallel(registry, axis, "ring_balanced"))
    return constrained


def context_parallel_registry(
    registry: RuleRegistry, axis_names: tuple[str, ...], strategy: str | None = None
) -> RuleRegistry:
    """`registry` as a mesh with these axis names asks: unchanged without a "cp" axis or where it
    already requires a context-parallel strategy (`strategy` None), else with the requirement of
    `strategy` (None: "auto") on the "cp" axis (`require_context_parallel`)."""
    if CP_AXIS not in axis_names:
        return registry
    forward = registry.get(FORWARD)
    if strategy is None and forward is not None and forward.requirement is not None:
        return registry
    return require_context_parallel(registry, axis_names.index(CP_AXIS), strategy or "auto")


def without_sequence_split(registry: RuleRegistry) -> RuleRegistry:
    """A copy of `registry` whose plans never split attention's queries along the sequence on any
    axis: the best plan without context parallelism, which the search's choice is held against
    (what a memory limit makes the search give up, `docs/context-parallel.md`)."""

    def admits(call: OpCall, chosen: Strategy) -> bool:
        return not chosen.inputs[_query_index(call)].shard_axes(SEQ)

    constrained = registry.copy()
    for op in (FORWARD, BACKWARD):
        if op in constrained:
            constrained.require(
                op, Requirement(admits, "context parallelism was ruled out: split the batch or heads instead")
            )
    return constrained
