"""Over-decomposition (Tensor3D's idea): each rank runs its batch as chunks, one after another, so
that one chunk's collectives overlap the next chunk's compute.

The chunks are one more mesh axis, run inside the process (`Mesh.with_chunks`). The plan keeps its
layouts on the device axes and takes, on the chunk axis, the layouts of a data-parallel plan of the
same graph (batch split, weights whole, weight gradients partial sums). Rules are written per axis,
so the combined strategy is the rule's own strategy on the larger mesh, and every chunk computes
what a rank of that mesh would: the same localize steps (a mean over the batch divides by the
whole batch), hence the serial model's numbers up to the order of additions. Placeholders and
outputs stay whole on the chunk axis: every chunk reads the same weights and the rows of the
inputs it owns, and the chunks' losses and gradients add up in memory (`autopar.passes.chunks`) before
one collective per gradient leaves the rank.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.core.errors import AutoparError, ShardingError
from autopar.core.layout import Layout, Placement, Replicate, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import info
from autopar.core.plan import Plan
from autopar.core.strategy import Strategy
from autopar.planning.greedy import greedy_plan
from autopar.rules.base import RuleRegistry

CHUNK_AXIS = "chunk"


class OverDecompositionError(ShardingError):
    """The batch cannot be cut into the asked number of chunks on this plan."""


def chunk_plan(gm: fx.GraphModule, plan: Plan, mesh: Mesh, registry: RuleRegistry, chunks: int) -> Plan:
    """`plan` (on `mesh`) with a chunk axis of `chunks` appended: the plan on `mesh.with_chunks(chunks)`."""
    data = _data_parallel(gm, registry, chunks)
    shape = mesh.with_chunks(chunks, CHUNK_AXIS).shape
    out = Plan(notes=dict(plan.notes), roles=(*plan.roles, CHUNK_AXIS))
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        name = node.name
        if node.op == "placeholder":  # weights, inputs, tangents: whole in every chunk
            out.layouts[name] = tuple(_extend(x, Replicate(), shape, node) for x in plan.layouts[name])
            continue
        ours = data.layouts.get(name)
        if ours is None or len(ours) != len(plan.layouts[name]):
            raise _cannot(node, chunks, "the data-parallel plan of the chunks does not lay it out")
        out.layouts[name] = tuple(
            _extend(x, y.placements[0], shape, node) for x, y in zip(plan.layouts[name], ours)
        )
        strategy = plan.strategies.get(name)
        if strategy is None:
            continue
        theirs = data.strategies.get(name)
        if theirs is None:
            raise _cannot(node, chunks, "the data-parallel plan of the chunks implies it instead of choosing")
        out.strategies[name] = Strategy(
            tuple(_extend(x, y.placements[0], shape, node) for x, y in zip(strategy.inputs, theirs.inputs)),
            tuple(_extend(x, y.placements[0], shape, node) for x, y in zip(strategy.outputs, theirs.outputs)),
        )
    out.output_layouts = [
        None if x is None else Layout((*x.placements, Replicate()), x.shape, x.dtype) for x in plan.output_layouts
    ]
    return out


def _data_parallel(gm: fx.GraphModule, registry: RuleRegistry, chunks: int) -> Plan:
    try:
        return greedy_plan(gm, Mesh((CHUNK_AXIS,), (chunks,)), registry, roles=("token",))
    except AutoparError as exc:
        raise OverDecompositionError(
            f"the batch cannot be cut into {chunks} chunks: {exc.message}",
            op=exc.op,
            where=exc.where,
            layouts=exc.layouts,
            hint="use fewer chunks (over_decompose=1 turns it off), or a batch divisible by them",
        ) from exc


def _extend(layout: Layout, chunk: Placement, shape: tuple[int, ...], node: fx.Node) -> Layout:
    """`layout` with the chunk axis's placement appended; chunks must be equal (even split)."""
    out = Layout((*layout.placements, chunk), layout.shape, layout.dtype)
    if isinstance(chunk, Shard) and out.shape[chunk.dim] % out.split_factor(chunk.dim, shape):
        raise _cannot(
            node,
            shape[-1],
            f"dim {chunk.dim} of {list(out.shape)} does not split evenly into "
            f"{out.split_factor(chunk.dim, shape)} blocks",
            out,
        )
    if not out.balanced_fits(shape):
        raise _cannot(
            node,
            shape[-1],
            f"dim(s) {[d for d, _ in out.balanced_dims()]} of {list(out.shape)} are split in the "
            "load-balanced causal order (Sb), which batch chunks cannot cut again",
            out,
        )
    return out


def _cannot(node: fx.Node, chunks: int, why: str, layout: Layout | None = None) -> OverDecompositionError:
    return OverDecompositionError(
        f"cannot cut {node.name} into {chunks} batch chunks: {why}",
        op=str(node.target),
        where=info(node).where(),
        layouts=[layout.per_axis_str()] if layout is not None else [],
        hint="use fewer chunks (over_decompose=1 turns it off), or a per-rank batch divisible by them",
    )
