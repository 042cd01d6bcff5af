"""Stage 3, insert_comm: make every edge's layouts agree by inserting functional collectives.

Where a consumer's strategy wants an input in another layout than its producer gives, the
redistribution steps (autopar.core.redistribute) become `torch.ops._c10d_functional` collectives, each
followed by its `wait_tensor`, on the process group of the step's mesh axis. Nodes inserted here
are already rank-local (local shapes, this rank's coordinates); emit copies them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.core.errors import ShardingError
from autopar.core.layout import Layout, balanced_order, is_balanced
from autopar.core.mesh import Mesh
from autopar.core.meta import NodeInfo, Phase, info, set_info
from autopar.core.redistribute import CommStep, plan_redistribute

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def insert_comm(gm: fx.GraphModule, mesh: Mesh, coords: Sequence[int] | None = None) -> fx.GraphModule:
    """Insert redistributions for this rank (`coords`, default: the mesh's own rank)."""
    coords = tuple(coords) if coords is not None else mesh.my_coords()
    inserter = _Inserter(gm, mesh, coords)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and info(node).strategy is not None:
            wants = info(node).strategy.inputs  # type: ignore[union-attr]
            inserter.rewire(node, list(wants))
        elif node.op == "output":
            inserter.rewire(node, list(info(node).layouts))
    gm.graph.lint()
    gm.recompile()
    return gm


class _Inserter:
    def __init__(self, gm: fx.GraphModule, mesh: Mesh, coords: tuple[int, ...]) -> None:
        self.gm = gm
        self.mesh = mesh
        self.shape = tuple(mesh.shape)
        self.coords = coords
        self.done: dict[tuple[fx.Node, Layout], fx.Node] = {}
        self.groups = {a: mesh.comm_group(a) for a in range(mesh.ndim)}
        self.in_process = tuple(a for a in range(mesh.ndim) if mesh.is_in_process(a))

    def rewire(self, node: fx.Node, wants: list[Layout]) -> None:
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        k = 0
        changed = False
        for i, leaf in enumerate(flat):
            if not (isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor)):
                continue
            want = wants[k]
            k += 1
            have = info(leaf).layouts[0] if info(leaf).layouts else None
            if have is None or have == want:
                continue
            flat[i] = self.redistribute(leaf, have, want, node)
            changed = True
        if changed:
            args, kwargs = pytree.tree_unflatten(flat, spec)
            node.args = tuple(args)
            node.kwargs = dict(kwargs)

    def redistribute(self, producer: fx.Node, have: Layout, want: Layout, consumer: fx.Node) -> fx.Node:
        key = (producer, want)
        # user outputs are redistributed in forward, gradients in backward: follow the producer
        phase: Phase = info(consumer).phase if consumer.op != "output" else info(producer).phase
        made = self.done.get(key)
        # a forward value serves backward (saved), never the other way round: a user output (the
        # output node comes last) whose layout only a backward consumer asked for before gets its
        # own forward collective (BERT's multi-label logits: the loss's backward wanted them whole)
        if made is not None and not (phase == "forward" and info(made).phase == "backward"):
            return made
        base = NodeInfo(
            role="comm",
            phase=phase,
            module_path=info(consumer).module_path if consumer.op != "output" else info(producer).module_path,
            source=info(consumer).source if consumer.op != "output" else info(producer).source,
        )
        current = producer
        with self.gm.graph.inserting_before(consumer):
            for step in plan_redistribute(have, want, self.shape, self.in_process):
                current = self._emit_step(current, step, base)
                current.meta["val"] = producer.meta["val"]
                set_info(current, _with(info(current), layouts=(step.after,)))
        self.done[key] = current
        return current

    # ---- one step as local graph nodes ---------------------------------------------------------
    def _node(self, target: Any, args: tuple[Any, ...], base: NodeInfo, **kwargs: Any) -> fx.Node:
        node = self.gm.graph.call_function(target, args, kwargs)
        set_info(node, _with(base))
        return node

    def _emit_step(self, x: fx.Node, step: CommStep, base: NodeInfo) -> fx.Node:
        """A step's nodes; around a load-balanced split (`BalancedShard`) on the step's axis, the
        dim is put in the balanced order before it is cut (slice, reduce-scatter, all-to-all
        into it) and back in the natural order after it is gathered (all-gather, all-to-all out
        of it), so that the collective itself moves contiguous blocks."""
        g = self.shape[step.axis]
        if is_balanced(step.after.placements[step.axis]) and step.kind in ("slice", "reduce_scatter", "all_to_all"):
            cut = step.dst_dim if step.kind == "all_to_all" else step.dim
            assert cut is not None
            length = step.before.local_shape(self.shape)[cut]  # the block of the outer axes
            x = self._reorder(x, cut, length, balanced_order(g), base)
        if step.swap is not None and step.kind == "reduce_scatter":
            x = self._swap(x, step, step.before, base)
        out = self._emit_plain_step(x, step, base)
        if step.swap is not None and step.kind == "all_gather":
            out = self._swap(out, step, step.after, base)
        if is_balanced(step.before.placements[step.axis]) and step.kind in ("all_gather", "all_to_all"):
            assert step.dim is not None
            order = balanced_order(g)
            length = step.after.local_shape(self.shape)[step.dim]
            out = self._reorder(out, step.dim, length, [order.index(j) for j in range(2 * g)], base)
        return out

    def _swap(self, x: fx.Node, step: CommStep, layout: Layout, base: NodeInfo) -> fx.Node:
        """`layout.swap_blocks` on the local block `x` (laid out as `layout` says for its sizes):
        `step.dim` seen as (outer, inner) blocks and transposed."""
        assert step.swap is not None and step.dim is not None
        outer, inner = step.swap
        local = list(layout.local_shape(self.shape, self.coords))
        d = step.dim
        blocks = [*local[:d], outer, inner, local[d] // (outer * inner), *local[d + 1 :]]
        viewed = self._node(aten.view.default, (self._contiguous(x, base), blocks), base)
        swapped = self._contiguous(self._node(aten.transpose.int, (viewed, d, d + 1), base), base)
        return self._node(aten.view.default, (swapped, local), base)

    def _reorder(self, x: fx.Node, dim: int, length: int, positions: Sequence[int], base: NodeInfo) -> fx.Node:
        """`x` (of `length` along `dim`: the block of the axes outside the balanced one, whole
        along the balanced axis) cut into `len(positions)` equal chunks there and put back
        together in the order `positions` names (chunk `positions[k]` of `x` becomes chunk `k`)."""
        chunk = length // len(positions)
        pieces = [self._node(aten.slice.Tensor, (x, dim, j * chunk, (j + 1) * chunk), base) for j in positions]
        return self._node(aten.cat.default, (pieces, dim), base)

    def _emit_plain_step(self, x: fx.Node, step: CommStep, base: NodeInfo) -> fx.Node:
        local = list(step.before.local_shape(self.shape, self.coords))
        g = self.shape[step.axis]
        group = self.groups[step.axis]
        me = self.coords[step.axis]
        if step.kind == "all_reduce":
            out = self._node(c10d.all_reduce.default, (x, "sum", group), base)
            return self._wait(out, step, base)
        if step.kind in ("all_gather", "reduce_scatter"):
            assert step.dim is not None
            # torch.chunk blocks (uneven dims): every block but the last is `block` long, so the
            # collective runs on blocks padded to that size and the padding is cut off after it.
            # Every rank emits the same nodes (padding by 0 where its block is full).
            split = step.before if step.kind == "all_gather" else step.after
            block = split.local_shape(self.shape)[step.dim]
            uneven = step.dim in split.uneven_dims(self.shape)
            front = self._to_front(x, step.dim, len(local), base)
            if step.kind == "all_gather":
                if uneven:
                    front = self._pad_front(front, local, step.dim, block, base)
                out = self._node(c10d.all_gather_into_tensor.default, (front, g, group), base)
            else:
                if uneven:
                    front = self._pad_front(front, local, step.dim, block * g, base)
                out = self._node(c10d.reduce_scatter_tensor.default, (front, "sum", g, group), base)
            waited = self._wait(out, step, base)
            if uneven:
                size = step.after.local_shape(self.shape, self.coords)[step.dim]
                waited = self._node(aten.slice.Tensor, (waited, 0, 0, size), base)
            return self._from_front(waited, step.dim, len(local), base)
        if step.kind == "all_to_all":
            assert step.dim is not None and step.dst_dim is not None
            return self._all_to_all(x, step, local, g, group, base)
        if step.kind == "slice":
            assert step.dim is not None
            block = step.after.local_shape(self.shape)[step.dim]
            size = step.after.local_shape(self.shape, self.coords)[step.dim]
            out = self._node(aten.slice.Tensor, (x, step.dim, me * block, me * block + size), base)
            return self._contiguous(out, base) if step.dim != 0 else out
        if step.kind == "forbidden":
            raise ShardingError(
                f"the plan turns a value laid out {step.before} into a row-disjoint pending sum "
                f"{step.after} (D): only a grouped matmul over split experts makes one",
                where=base.where(),
                hint="let the planner choose this op's strategy, or give the op a rule that takes the "
                "value as a plain Partial (P)",
            )
        if step.kind == "zero_partial":
            if me == 0:
                return self._node(aten.clone.default, (x,), base)
            return self._node(aten.zeros_like.default, (x,), base)
        raise AssertionError(step.kind)

    def _wait(self, x: fx.Node, step: CommStep, base: NodeInfo) -> fx.Node:
        set_info(x, _with(base, comm=step, comm_group=self.groups[step.axis]))
        return self._node(c10d.wait_tensor.default, (x,), base)

    def _pad_front(self, x: fx.Node, local: list[int], dim: int, length: int, base: NodeInfo) -> fx.Node:
        """Zero-pad dim 0 (the moved-to-front `dim`) of `x` up to `length` rows."""
        missing = length - local[dim]
        return self._node(aten.constant_pad_nd.default, (x, [0, 0] * (len(local) - 1) + [0, missing], 0.0), base)

    def _contiguous(self, x: fx.Node, base: NodeInfo) -> fx.Node:
        return self._node(aten.clone.default, (x,), base, memory_format=torch.contiguous_format)

    def _to_front(self, x: fx.Node, dim: int, ndim: int, base: NodeInfo) -> fx.Node:
        if dim == 0:
            return x
        perm = [dim] + [d for d in range(ndim) if d != dim]
        return self._contiguous(self._node(aten.permute.default, (x, perm), base), base)

    def _from_front(self, x: fx.Node, dim: int, ndim: int, base: NodeInfo) -> fx.Node:
        if dim == 0:
            return x
        perm = [dim] + [d for d in range(ndim) if d != dim]
        inverse = [perm.index(d) for d in range(ndim)]
        return self._contiguous(self._node(aten.permute.default, (x, inverse), base), base)

    def _all_to_all(
        self, x: fx.Node, step: CommStep, local: list[int], g: int, group: str, base: NodeInfo
    ) -> fx.Node:
        """Split dim `dst_dim` into g chunks, send chunk r to rank r, concatenate received along `dim`."""
        assert step.dim is not None and step.dst_dim is not None
        src, dst = step.dim, step.dst_dim
        ndim = len(local)
        front = self._to_front(x, dst, ndim, base)  # [n_dst, *rest]
        rest = [local[d] for d in range(ndim) if d != dst]
        chunk = local[dst] // g
        out = self._node(c10d.all_to_all_single.default, (front, [chunk] * g, [chunk] * g, group), base)
        waited = self._wait(out, step, base)
        # waited: [g * chunk, *rest], block r from rank r; make it [chunk, *rest with src grown by g]
        pos = [d for d in range(ndim) if d != dst].index(src)  # src's index within rest
        blocks = self._node(aten.view.default, (waited, [g, chunk, *rest]), base)
        order = [1] + [2 + i for i in range(pos)] + [0] + [2 + i for i in range(pos, len(rest))]
        moved = self._contiguous(self._node(aten.permute.default, (blocks, order), base), base)
        grown = list(rest)
        grown[pos] *= g
        merged = self._node(aten.view.default, (moved, [chunk, *grown]), base)
        return self._from_front(merged, dst, ndim, base)


def _with(base: NodeInfo, **changes: Any) -> NodeInfo:
    return replace(base, **changes)
