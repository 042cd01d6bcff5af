"""Where weights live, for every planner: the storage layout that gives each rank ~1/p of a
weight, the gather back to a compute layout, and the storage of parts cut from a fused weight.

A plan stores its weights one of two ways (`STORAGE_MODES`), chosen per plan by the search
(`autopar.planning.search`), priced like every other choice:

- "sharded" (ZeRO-3 / FSDP's pattern): each weight in its compute layout split further over every
  axis that layout replicates (`storage_layout`): ~1/p per rank, all-gathered where used, its
  gradient reduce-scattered.
- "replicated" (DDP's pattern, and Megatron's for tensor-split weights): each weight stored in its
  compute layout (`replicated_storage`): nothing to gather, the gradient's pending sums all-reduced
  (bucketed and overlapped with backward by the schedule stage), at up to p times the weight state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.fx as fx

from autopar.core.layout import (
    Layout,
    Partial,
    Placement,
    Replicate,
    RowDisjoint,
    Shard,
    is_balanced_sequence,
    settled,
    summed,
)
from autopar.core.meta import info, signature
from autopar.core.plan import Plan
from autopar.core.redistribute import FORBIDDEN_FACTOR, redistribute_cost
from autopar.rules.calls import tensor_inputs

PlanT = TypeVar("PlanT", bound=Plan)

SHARDED, REPLICATED = "sharded", "replicated"
STORAGE_MODES = (SHARDED, REPLICATED)


def storage_layout(compute: Layout, mesh_shape: Sequence[int]) -> Layout:
    """`compute` further split over every axis it replicates, so each rank stores ~1/p.

    Each extra axis goes to the largest dim it divides, preferring dims where it nests innermost
    (a plain all-gather restores the compute layout). Where it divides none, a 2-D or larger
    weight takes `torch.chunk` blocks on its largest unsplit dim (GPT-2's 50257-row embedding on
    an axis of 8: seven blocks of 6283 and one of 6276). Vectors and tensors too small for that stay
    replicated on the axis.

    A load-balanced split (`BalancedShard`) is stored as the contiguous split of its dim: the
    stored tensor is the user's parameter, a DTensor, which has only contiguous blocks. A reader
    that wants the balanced order gathers the dim and cuts it (`gather_from_storage` prices it).
    """
    layout = settled(compute)
    for a, p in enumerate(layout.placements):
        if not isinstance(p, Replicate) or mesh_shape[a] == 1:
            continue
        best: tuple[int, int, int] | None = None
        for d in range(len(layout.shape)):
            factor = layout.split_factor(d, mesh_shape) * mesh_shape[a]
            if layout.shape[d] % factor:
                continue
            innermost = int(all(b < a for b in layout.shard_axes(d)))
            key = (innermost, layout.shape[d] // factor, -d)
            if best is None or key > best:
                best = key
        if best is not None:
            layout = layout.with_placement(a, Shard(-best[2]))
        elif len(layout.shape) >= 2:
            layout = _uneven_storage(layout, a, mesh_shape)
    return layout


def _uneven_storage(layout: Layout, axis: int, mesh_shape: Sequence[int]) -> Layout:
    """`layout` split over `axis` in uneven blocks on its largest dim no other axis splits."""
    free = [d for d in range(len(layout.shape)) if not layout.shard_axes(d)]
    for d in sorted(free, key=lambda d: (-layout.shape[d], d)):
        candidate = layout.with_placement(axis, Shard(d))
        if candidate.fits(mesh_shape):
            return candidate
    return layout


def gather_from_storage(want: Layout, mesh_shape: Sequence[int]) -> float:
    """Elements a rank receives to build `want` from its ~1/p storage (all-gathers on R axes).

    A Partial axis (a bias added before a split contraction) costs nothing extra: the stored value
    is zeroed on all but one rank of that axis. A load-balanced split, stored contiguous, is the
    redistribution's elements (the dim gathered on its axis and cut in the balanced order).
    """
    if is_balanced_sequence(want):
        return redistribute_cost(storage_layout(want, mesh_shape), summed(want), mesh_shape)
    replicated = math.prod(mesh_shape[a] for a, p in enumerate(want.placements) if not isinstance(p, Shard))
    return want.local_numel(mesh_shape) * (1 - 1 / replicated)


def placement_cost(have: Placement, want: Placement, g: int, n: int) -> float:
    if have == want:
        return 0.0
    if isinstance(want, RowDisjoint):  # nothing makes a row-disjoint sum (`redistribute.forbidden_axes`)
        return FORBIDDEN_FACTOR * n
    if isinstance(have, RowDisjoint) and isinstance(want, Partial):
        return 0.0  # a row-disjoint sum is a sum
    if isinstance(want, Replicate):
        return (g - 1) * n if isinstance(have, Shard) else 2 * (g - 1) / g * n
    if isinstance(want, Shard):
        return 0.0 if isinstance(have, Replicate) else (g - 1) / g * n
    return 0.0 if isinstance(have, Replicate) else (g - 1) * n


def whole_on(layout: Layout, dim: int, mesh_shape: Sequence[int]) -> Layout:
    """`layout` with `dim` whole: each axis that split it moves to the largest other dim it divides
    evenly (kept ~1/p), else replicates."""
    axes = layout.shard_axes(dim)
    for a in axes:
        layout = layout.with_placement(a, Replicate())
    for a in axes:
        options = [
            d
            for d in range(len(layout.shape))
            if d != dim and layout.shape[d] % (layout.split_factor(d, mesh_shape) * mesh_shape[a]) == 0
        ]
        if options:
            best = max(options, key=lambda d: (layout.shape[d] // layout.split_factor(d, mesh_shape), -d))
            layout = layout.with_placement(a, Shard(best))
    return layout


def part_storage(compute: Layout, dim: int, mesh_shape: Sequence[int]) -> Layout:
    """Where a part of a fused parameter is stored when it computes as `compute`: split over all
    axes with the cut dim whole (`unify_part_storage` says why)."""
    return whole_on(storage_layout(compute, mesh_shape), dim, mesh_shape)


def part_dims(gm: fx.GraphModule) -> dict[str, int]:
    """Placeholder name -> cut dim, for every part of a fused parameter (`autopar.passes.fused`)."""
    parts = signature(gm).param_parts
    if not parts:
        return {}
    names = {n.name: info(n).param_name for n in gm.graph.nodes if n.op == "placeholder"}
    return {node: parts[name].dim for node, name in names.items() if name is not None and name in parts}


_DIM_ORDER = {torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default}


def part_dim_at(node: fx.Node, dims: dict[str, int]) -> int | None:
    """The cut dim of a part parameter in the dims of `node`, a value computed from the part by
    transposes (the weight a linear's matmul reads); None for anything else."""
    if node.op == "placeholder":
        return dims.get(node.name)
    if node.target not in _DIM_ORDER or not isinstance(node.args[0], fx.Node):
        return None
    inner = part_dim_at(node.args[0], dims)
    if inner is None:
        return None
    rank = len(node.args[0].meta["val"].shape)
    if node.target is torch.ops.aten.permute.default:
        order = [int(d) % rank for d in node.args[1]]  # type: ignore[union-attr, arg-type]
    else:
        swapped = [int(d) % rank for d in node.args[1:] if isinstance(d, int)]  # transpose's dims
        a, b = (0, 1) if node.target is torch.ops.aten.t.default else swapped
        order = list(range(rank))
        order[a], order[b] = order[b], order[a]
    return order.index(inner)


def unify_part_storage(gm: fx.GraphModule, plan: PlanT, mesh_shape: Sequence[int]) -> PlanT:
    """Store every part of a fused parameter (`autopar.passes.fused`) in its first part's storage
    layout with the cut dim whole, so the parts side by side are one ordinary shard of the user's
    parameter (a DTensor and a checkpoint shard; a split of the cut dim would be strided, which
    torch's checkpointing refuses). The parts' uses keep their layouts: insert_comm gathers from
    this storage and reduces gradients into it."""
    sig = signature(gm)
    if not sig.param_parts:
        return plan
    placeholders = {
        info(n).param_name: n for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "param"
    }
    first: dict[str, Layout] = {}
    layouts = dict(plan.layouts)
    output_layouts = list(plan.output_layouts)
    for name, part in sig.param_parts.items():
        node = placeholders[name]
        (stored,) = plan.layouts[node.name]
        if part.source not in first:
            first[part.source] = whole_on(stored, part.dim, mesh_shape)
        want = Layout(first[part.source].placements, stored.shape, stored.dtype)
        if want == stored:
            continue
        layouts[node.name] = (want,)
        output_layouts[sig.num_user_outputs + sig.grad_of.index(name)] = want
    return dataclasses.replace(plan, layouts=layouts, output_layouts=output_layouts)


def replicated_storage(compute: Layout) -> Layout:
    """Where a weight computing as `compute` is stored under "replicated" storage: that layout
    with its pending sums done (a bias added before a split contraction is stored whole) and a
    load-balanced split in the contiguous order (`storage_layout` says why)."""
    return settled(compute)


def replicated_part_storage(compute: Layout, dim: int) -> Layout:
    """A part of a fused parameter stored replicated: its compute layout with the cut dim whole
    (replicated on the axes that split it), so the parts side by side stay one ordinary shard of
    the user's parameter (`unify_part_storage`)."""
    layout = replicated_storage(compute)
    for a in layout.shard_axes(dim):
        layout = layout.with_placement(a, Replicate())
    return layout


def compute_layouts(gm: fx.GraphModule, plan: Plan, mesh_shape: Sequence[int]) -> dict[str, Layout]:
    """Parameter placeholder -> the compute layout its storage was made from: among its users'
    wanted input layouts whose `storage_layout` (or `part_storage`) is the stored one, the least
    split (a tied weight that the embedding reads whole and the head split is stored whole, so
    neither gathers it), the first user's on a tie. A parameter none of whose users explains its
    storage is left out."""
    dims = part_dims(gm)
    found: dict[str, Layout] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or info(node).role != "param" or node.name not in plan.layouts:
            continue
        (stored,) = plan.layouts[node.name]
        dim = dims.get(node.name)
        for user in node.users:
            strategy = plan.strategies.get(user.name)
            if strategy is None:
                continue
            wants = [w for src, w in zip(tensor_inputs(user), strategy.inputs) if src is node]
            match = [
                w
                for w in wants
                if (storage_layout(w, mesh_shape) if dim is None else part_storage(w, dim, mesh_shape)) == stored
            ]
            for want in match:
                best = found.get(node.name)
                if best is None or _split_axes(want) < _split_axes(best):
                    found[node.name] = want
    return found


def _split_axes(layout: Layout) -> int:
    return sum(isinstance(p, Shard) for p in layout.placements)


def replicate_storage(gm: fx.GraphModule, plan: PlanT, mesh_shape: Sequence[int]) -> PlanT:
    """`plan` (sharded storage, as the planners lay weights out) with every parameter stored in
    its compute layout instead ("replicated" storage): its users read it as stored (no all-gather),
    its gradient's pending sums are all-reduced into it (insert_comm emits both from the layouts).
    Buffers keep their layouts."""
    sig = signature(gm)
    dims = part_dims(gm)
    layouts = dict(plan.layouts)
    output_layouts = list(plan.output_layouts)
    grads = {name: sig.num_user_outputs + i for i, name in enumerate(sig.grad_of)}
    params = {n.name: info(n).param_name for n in gm.graph.nodes if n.op == "placeholder"}
    for node_name, compute in compute_layouts(gm, plan, mesh_shape).items():
        dim = dims.get(node_name)
        stored = replicated_storage(compute) if dim is None else replicated_part_storage(compute, dim)
        layouts[node_name] = (stored,)
        at = grads.get(params[node_name] or "")
        if at is not None and at < len(output_layouts):
            output_layouts[at] = stored
    return dataclasses.replace(plan, layouts=layouts, output_layouts=output_layouts)
