"""The load-balanced sequence layout (`BalancedShard`) offered by the rules, on one mesh axis.

A balanced split is a contiguous split of the dim taken in the order 0, 2p-1, 1, 2p-2, ...: so an
op whose local call treats the split dim's rows independently and reads no offset computes the
same on it as on a contiguous split, provided every tensor the axis splits in the call is split
along the same rows. `balanced_variants` adds, for such ops, the balanced copy of each per-axis
strategy whose split dims all have one length (an elementwise correspondence of their rows, as
`expand` asks of uneven splits: a view that merges the dim with another, or cuts it, fails it).

What is not offered it, and why (each would compute with contiguous offsets):
- random ops (`rules.random`: a rank's numbers come from its block's offsets in the serial
  stream), `eye`, ring attention's blocks, the expert ops (rows owned by offsets), CTC, pooling;
- the vocabulary-row split of an embedding (its local lookup subtracts the block's offset);
- attention: its own balanced strategy (`context_parallel.balanced_strategies`) with the causal
  rows at each chunk's offset; `arange` its own (`arange_balanced`), each chunk's values.
Anything else that reads `Layout.local_offsets` on such a layout raises `BalancedShardError`.

A reshape that merges (batch, sequence) into tokens, or splits tokens back (the linears of
transformers and the zoo), carries a balanced sequence split over the merge only where every rank
holds one sample: `[S(0), Sb(1)]` on (B, T) is `[S(0), Sb(0)]` on (B*T) when the batch's axes
split it down to one row each and come before the balanced one, so that each outer block of the
tokens is one sample's sequence (`merged_balanced`, `one_sample_per_block`).

`balanced_registry` offers all of it on one mesh axis (the "cp" axis): a per-axis rule cannot
see the axis, so the rules' whole-mesh filters (`OpRule.admits`) drop balanced splits elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from autopar.core.layout import BalancedShard, Layout, Placement, Shard, is_balanced
from autopar.core.strategy import AxisStrategy, OpCall, Strategy
from autopar.rules import factory, local_ops
from autopar.rules.base import Admits, LocalCall, LocalContext, RuleRegistry
from autopar.rules.views import reshape_groups

aten = torch.ops.aten

# families whose local calls read rank offsets or are order-dependent along a split dim
UNBALANCED_FAMILIES = frozenset({"random", "routed_experts", "expert_parallel", "ctc", "pooling"})
EMBEDDING = aten.embedding.default
EMBEDDING_BACKWARD = aten.embedding_dense_backward.default
UNBALANCED_OPS = frozenset({aten.eye.default, aten.eye.m, *factory.ARANGES})
RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def _balanced(p: Placement) -> Placement:
    return BalancedShard(p.dim) if isinstance(p, Shard) else p


def balanced_variants(call: OpCall, strategies: list[AxisStrategy], first: bool = False) -> list[AxisStrategy]:
    """`strategies` and, for each that splits tensors of the call along dims of one length (at
    least 2), its copy with those splits balanced (with `first`, the copies ahead of the
    contiguous strategies: the greedy pass keeps the first of equally priced strategies)."""
    specs = (*call.inputs, *call.outputs)
    extra = []
    for s in strategies:
        placements = (*s.inputs, *s.outputs)
        sizes = {spec.shape[p.dim] for p, spec in zip(placements, specs) if isinstance(p, Shard)}
        if len(sizes) != 1 or min(sizes) < 2 or any(is_balanced(p) for p in placements):
            continue
        if call.op is EMBEDDING and isinstance(s.inputs[0], Shard):
            continue  # the vocabulary-row split reads its block's offset
        if call.op is EMBEDDING_BACKWARD and isinstance(s.outputs[0], Shard):
            continue
        extra.append(AxisStrategy(tuple(map(_balanced, s.inputs)), tuple(map(_balanced, s.outputs))))
    return [*extra, *strategies] if first else [*strategies, *extra]


def _with_variants(
    strategies: Callable[[OpCall], list[AxisStrategy]], first: bool
) -> Callable[[OpCall], list[AxisStrategy]]:
    def offered(call: OpCall) -> list[AxisStrategy]:
        return balanced_variants(call, strategies(call), first)

    return offered


def merged_runs(call: OpCall) -> list[tuple[int, int, int, bool]]:
    """The reshape's runs that merge two dims into one or split one into two: (outer dim, inner
    dim, merged dim, whether the two dims are the input's), size-1 dims ignored."""
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    if 0 in src:
        return []
    runs = []
    for ga, gb in reshape_groups(src, dst):
        if len(ga) == 2 and len(gb) == 1:
            runs.append((ga[0], ga[1], gb[0], True))
        elif len(ga) == 1 and len(gb) == 2:
            runs.append((gb[0], gb[1], ga[0], False))
    return runs


def merged_balanced(call: OpCall) -> list[AxisStrategy]:
    """The balanced split of the inner dim (the sequence) of a merged run, carried to the merged
    dim (the tokens) and back; whole-mesh, only where each rank has one row of the outer dim
    (`one_sample_per_block`)."""
    found = []
    for _, inner, merged, merging in merged_runs(call):
        if merging:
            found.append(AxisStrategy((BalancedShard(inner),), (BalancedShard(merged),)))
        else:
            found.append(AxisStrategy((BalancedShard(merged),), (BalancedShard(inner),)))
    return found


def one_sample_per_block(call: OpCall, strategy: Strategy, mesh_shape: tuple[int, ...]) -> bool:
    """A balanced split on a merged run's dims: the outer dim (the batch) split by the axes
    outside the balanced one down to one row per rank, so that each of their blocks of the
    merged dim is one row's inner dim in the balanced order."""
    for outer, inner, merged, merging in merged_runs(call):
        two: Layout = strategy.inputs[0] if merging else strategy.outputs[0]
        one: Layout = strategy.outputs[0] if merging else strategy.inputs[0]
        if not any(d == merged for d, _ in one.balanced_dims()):
            continue
        if not any(d == inner for d, _ in two.balanced_dims()):
            return False
        if two.split_factor(outer, mesh_shape) != two.shape[outer]:
            return False
        if one.shard_axes(merged)[:-1] != two.shard_axes(outer):
            return False
    return True


def _reshape_with_variants(
    strategies: Callable[[OpCall], list[AxisStrategy]], first: bool
) -> Callable[[OpCall], list[AxisStrategy]]:
    def offered(call: OpCall) -> list[AxisStrategy]:
        if first:
            return [*merged_balanced(call), *balanced_variants(call, strategies(call), first)]
        return [*balanced_variants(call, strategies(call)), *merged_balanced(call)]

    return offered


def _also(admits: Admits | None, more: Admits) -> Admits:
    def admitted(call: OpCall, strategy: Strategy, mesh_shape: tuple[int, ...]) -> bool:
        return more(call, strategy, mesh_shape) and (admits is None or admits(call, strategy, mesh_shape))

    return admitted


def arange_balanced(call: OpCall) -> list[AxisStrategy]:
    """arange's strategies and its balanced split (a rank's positions: its two chunks)."""
    found = factory.arange_rule(call)
    if call.outputs[0].shape[0] > 1:
        found.append(AxisStrategy((), (BalancedShard(0),)))
    return found


def localize_arange_balanced(ctx: LocalContext) -> LocalCall:
    """A balanced arange: the values of the rank's two chunks, end to end."""
    layout = ctx.strategy.outputs[0]
    if not layout.balanced_dims():
        return factory.localize_arange(ctx)
    start, step = factory.arange_bounds(ctx.call)
    chunks = layout.local_chunks(ctx.mesh_shape, ctx.coords, 0)
    args = (start, step, chunks, ctx.call.outputs[0].dtype, ctx.kwargs.get("device"))
    return LocalCall(local_ops.arange_chunks, args, {})


def only_on_axis(axis: int, admits: Admits | None) -> Admits:
    """`admits`, and no balanced split on any mesh axis but `axis`."""

    def admitted(call: OpCall, strategy: Strategy, mesh_shape: tuple[int, ...]) -> bool:
        for layout in (*strategy.inputs, *strategy.outputs):
            if any(a != axis for _, a in layout.balanced_dims()):
                return False
        return admits is None or admits(call, strategy, mesh_shape)

    return admitted


def balanced_registry(
    registry: RuleRegistry, axis: int, skip: frozenset[object] = frozenset(), merges: bool = True
) -> RuleRegistry:
    """A copy of `registry` that also offers the balanced split on mesh axis `axis`: the
    order-indifferent rules' balanced variants and arange's (`skip`: ops whose rule the caller
    gives a balanced strategy of its own, attention), and with `merges` the balanced split carried
    over a (batch, sequence) merge (`merged_balanced`)."""
    offered = registry.copy()
    for rule in registry.rules():
        if rule.op in skip or rule.family in UNBALANCED_FAMILIES:
            continue
        if rule.op in factory.ARANGES:
            new = dataclasses.replace(rule, strategies=arange_balanced, localize=localize_arange_balanced)
        elif rule.op in UNBALANCED_OPS:
            continue
        elif rule.op in RESHAPES and merges:
            new = dataclasses.replace(rule, strategies=_reshape_with_variants(rule.strategies, merges))
            new = dataclasses.replace(new, admits=_also(rule.admits, one_sample_per_block))
        else:
            new = dataclasses.replace(rule, strategies=_with_variants(rule.strategies, merges))
        offered.replace(dataclasses.replace(new, admits=only_on_axis(axis, new.admits)))
    return offered

