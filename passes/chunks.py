"""Over-decomposition, after insert_comm: one graph that runs every batch chunk of this rank.

insert_comm lowers the chunked plan (`autopar.planning.overdecompose`) once per chunk, as if each chunk were
a rank of the mesh's in-process axis. This pass zips those copies into one graph node by node, then
lets each chunk's forward run whole segments in turn (`forward_segments_in_turn`), so that chunk c's
collective sits before chunk c+1's compute, where the schedule stage overlaps them.
What every chunk computes alike is emitted once: placeholders, weight gathers, and any value that
is whole on the chunk axis and computed from shared values. Redistributions on the chunk axis are
local tensor ops among the copies: a sum for all_reduce, a concatenation for all_gather, a sum and
each chunk's rows for reduce_scatter, exchanged rows for all_to_all.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from autopar.core.graph_order import apply_order
from autopar.core.layout import Replicate
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info, set_info

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def merge_chunks(copies: Sequence[fx.GraphModule], mesh: Mesh) -> fx.GraphModule:
    """One graph from insert_comm's per-chunk graphs (chunk c at index c); `mesh` ends in the chunk axis."""
    axis = mesh.ndim - 1
    if not mesh.is_in_process(axis) or len(copies) != mesh.shape[axis]:
        raise ValueError(f"expected {mesh.shape[axis]} chunk copies on an in-process last axis of {mesh}")
    merger = _Merger(copies, mesh, axis)
    graph = merger.run()
    apply_order(graph, forward_segments_in_turn(graph))
    merged = fx.GraphModule(copies[0], graph)
    merged.meta.update(copies[0].meta)
    return merged


class _Merger:
    def __init__(self, copies: Sequence[fx.GraphModule], mesh: Mesh, axis: int) -> None:
        self.nodes = [list(gm.graph.nodes) for gm in copies]
        if len({len(n) for n in self.nodes}) != 1:
            raise AssertionError("chunk copies differ in length: insert_comm must lower each alike")
        self.k = len(copies)
        self.mesh = mesh
        self.axis = axis
        self.group = mesh.group_name(axis)
        self.graph = fx.Graph()
        self.env: list[dict[fx.Node, fx.Node]] = [{} for _ in copies]

    def run(self) -> fx.Graph:
        for row in zip(*self.nodes):
            first = row[0]
            if any(n.op != first.op or n.target != first.target and not _per_chunk_op(n) for n in row):
                raise AssertionError(f"chunk copies differ at {first.name}: {[n.target for n in row]}")
            if first.op == "placeholder":
                self._share(row, self.graph.placeholder(first.name))
            elif first.op == "output":
                outs = [self._map(c, n.args) for c, n in enumerate(row)]
                if any(o != outs[0] for o in outs):
                    raise AssertionError("chunk copies return different values: outputs must be whole")
                new = self.graph.output(outs[0][0])
                new.meta.update(first.meta)
            elif self._on_chunk_axis(first):
                results = self._combine(row)
                for c, n in enumerate(row):
                    self.env[c][n] = results[c]
            elif first.target is c10d.wait_tensor.default and self._on_chunk_axis(first.args[0]):
                for c, n in enumerate(row):
                    self.env[c][n] = self.env[c][n.args[0]]  # type: ignore[index]
            else:
                self._copy(row)
        return self.graph

    # ---- copies ---------------------------------------------------------------------------------
    def _map(self, c: int, value: Any) -> Any:
        return fx.map_arg(value, self.env[c].__getitem__)

    def _share(self, row: Sequence[fx.Node], new: fx.Node) -> None:
        new.meta.update(row[0].meta)
        for c, n in enumerate(row):
            self.env[c][n] = new

    def _copy(self, row: Sequence[fx.Node]) -> None:
        mapped = [(self._map(c, n.args), self._map(c, n.kwargs)) for c, n in enumerate(row)]
        first = row[0]
        if (
            all(n.target == first.target for n in row)
            and all(m == mapped[0] for m in mapped)
            and self._whole(first)
        ):
            new = self.graph.create_node(first.op, first.target, mapped[0][0], mapped[0][1], name=first.name)
            self._share(row, new)
            return
        for c, (n, (args, kwargs)) in enumerate(zip(row, mapped)):
            new = self.graph.create_node(n.op, n.target, args, kwargs, name=f"{n.name}_c{c}")
            new.meta.update(n.meta)
            if has_info(n):
                set_info(new, replace(info(n), chunk=c))
            self.env[c][n] = new

    def _whole(self, node: fx.Node) -> bool:
        """Every chunk holds the same value (given the same inputs): whole on the chunk axis."""
        if not has_info(node):
            return True
        return all(isinstance(x.placements[self.axis], Replicate) for x in info(node).layouts)

    # ---- redistributions on the chunk axis --------------------------------------------------------
    def _on_chunk_axis(self, node: Any) -> bool:
        return isinstance(node, fx.Node) and has_info(node) and info(node).comm_group == self.group

    def _combine(self, row: Sequence[fx.Node]) -> list[fx.Node]:
        """The local ops; in backward right after the last chunk's input: redistributions of
        gradients sit before the output in insert_comm's order, and the schedule moves collectives
        early, not compute, so a sum left there would hold each gradient's collective to the end."""
        xs = [self._map(c, n.args[0]) for c, n in enumerate(row)]
        # every row is placed chunk by chunk, so the last chunk's input is the latest of them
        last = xs[-1]
        if info(row[0]).phase == "forward" or not has_info(last) or info(last).phase == "forward":
            return self._combined(row, xs)  # in forward, at the row's own place
        with self.graph.inserting_before(last.next):
            return self._combined(row, xs)

    def _combined(self, row: Sequence[fx.Node], xs: list[fx.Node]) -> list[fx.Node]:
        first = row[0]
        step = info(first).comm
        assert step is not None
        # compute, not comm: the schedule treats comm-only nodes before a collective as copies of
        # its input that it may rebuild (bucketing), and these add or cut values
        base = replace(info(first), role="compute", comm=None, comm_group=None, layouts=(), strategy=None)
        # the global value the step yields: insert_comm records it on the step's last node (the wait)
        waits = [u for u in first.users if u.target is c10d.wait_tensor.default]
        val = waits[0].meta.get("val") if waits else None
        if step.kind == "all_reduce":
            total = self._sum(xs, base, val)
            return [total] * self.k
        if step.kind == "all_gather":
            whole = self._node(aten.cat.default, (xs, 0), base, val)
            return [whole] * self.k
        if step.kind == "reduce_scatter":
            total = self._sum(xs, base, val)
            rows = step.before.local_shape(self.mesh.shape)[step.dim] // self.k  # type: ignore[index]
            return [
                self._node(
                    aten.slice.Tensor, (total, 0, c * rows, (c + 1) * rows), replace(base, chunk=c), val
                )
                for c in range(self.k)
            ]
        if step.kind == "all_to_all":
            rows = int(first.args[1][0])  # type: ignore[index, arg-type]
            out = []
            for c in range(self.k):
                pieces = [
                    self._node(
                        aten.slice.Tensor, (x, 0, c * rows, (c + 1) * rows), replace(base, chunk=c), val
                    )
                    for x in xs
                ]
                out.append(self._node(aten.cat.default, (pieces, 0), replace(base, chunk=c), val))
            return out
        raise AssertionError(f"no in-process form of {step.kind}")

    def _sum(self, xs: Sequence[fx.Node], base: Any, val: Any) -> fx.Node:
        total = xs[0]
        for x in xs[1:]:
            total = self._node(aten.add.Tensor, (total, x), base, val)
        return total

    def _node(self, target: Any, args: tuple[Any, ...], base: Any, val: Any) -> fx.Node:
        """A local op standing in for a chunk-axis collective; `val` is the value's global meta."""
        node = self.graph.call_function(target, args)
        set_info(node, base)
        if val is not None:
            node.meta["val"] = val
        return node


def forward_segments_in_turn(graph: fx.Graph) -> list[fx.Node]:
    """The zipped graph's nodes with each chunk's forward running a whole segment (its work between
    two of its waits) before the next chunk's: zipped node by node, chunk 0's collective overlaps
    only chunk 1's last node of the segment; in turn, it overlaps chunk 1's whole segment. On the
    GPT of benchmarks/overlap.py at p = 8, 2 chunks: 15.9 % -> 12.9 % of communication exposed.

    The backward keeps the zipped order: there the weight gradients fill the collectives' time, and
    taking segments in turn delayed them (15.2 % exposed). A topological order by (phase, segment
    depth, chunk, zipped position); what the chunks share runs right before its first user."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    depth: dict[fx.Node, int] = {}
    key: dict[fx.Node, tuple[int, ...]] = {}
    shared: list[fx.Node] = []
    for n in nodes:
        depth[n] = max((depth[i] for i in n.all_input_nodes), default=0) + int(
            n.target is c10d.wait_tensor.default
        )
        if has_info(n) and info(n).phase == "backward":
            key[n] = (1, 0, 0, position[n])
            continue
        chunk = info(n).chunk if has_info(n) else None
        key[n] = (0, depth[n], -1 if chunk is None else chunk, position[n])
        if chunk is None and n.op == "call_function":
            shared.append(n)
    for n in reversed(shared):
        users = [key[u] for u in n.users if u.op != "output" and key[u][0] == 0]
        if users:
            key[n] = (*min(users)[:3], position[n])  # before its first user: its position is lower
    missing = {n: len(n.all_input_nodes) for n in nodes}
    ready = [(key[n], position[n], n) for n in nodes if not missing[n] and n.op != "output"]
    heapq.heapify(ready)
    order = []
    while ready:
        *_, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            missing[u] -= 1
            if not missing[u] and u.op != "output":
                heapq.heappush(ready, (key[u], position[u], u))
    if len(order) != len(nodes) - 1:  # pragma: no cover - the zipped graph has a cycle
        raise AssertionError("chunk order lost nodes")
    # the placeholders (the backward's among them) stay together at the top
    return [n for n in order if n.op == "placeholder"] + [n for n in order if n.op != "placeholder"]


def _per_chunk_op(node: fx.Node) -> bool:
    """insert_comm's zero_partial step: chunk 0 keeps its value (clone), the others zeros_like."""
    return node.target in (aten.clone.default, aten.zeros_like.default)
