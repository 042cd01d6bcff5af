"""Decomposed collective matmuls: an all-gather feeding a matmul, or a matmul feeding a
reduce-scatter, split into chunks so that each chunk's communication overlaps another chunk's
matmul (the async tensor parallelism of Wang et al., ASPLOS'23; torch's async TP).

Runs between insert_comm and the schedule stage, on this rank's graph. A pair qualifies when the
gathered (scattered) dim reaches a dim of an `mm`/`addmm` through views, transposes and copies
only, in whole rank blocks (`autopar.passes.decompose_pairs`). Each rank's shard is then cut into
k row pieces (k: the group size, or the largest divisor of the shard's rows below it; "auto" also
prices at most 2, 4 and 8 pieces and keeps the count modeled shortest):

- all-gather -> matmul along the rows M of its left operand or the columns N of its right one:
  k all-gathers of one piece each; piece c's gather holds piece c of every rank, its matmul (the
  same views replayed on the smaller block) waits for that gather only, and the k outputs are
  interleaved back into the serial row order (`stack` + `view`).
- all-gather -> matmul along the contracted dim K (a hidden dim gathered into the next linear):
  Y = sum_c X_c W_c, piece c's gathered block times the rows (columns) of the other operand its
  K indices meet, each product added onto the previous ones' sum (`addmm`), so piece c's matmul
  waits for piece c's gather only and the next transfer runs under it.
- A gathered value read by several matmuls (forward and backward) is followed into each; one that
  other nodes read too (kept for backward) is put together again for them.
- matmul -> reduce-scatter: k matmuls, matmul c on the rows (columns) that piece c of every rank's
  block is made of, each followed by its own reduce-scatter; the k results are concatenated.

Cut along M or N every row is computed by one matmul over the same contracted length as before,
and every sum of the reduce-scatters adds the same summands, so results equal the undecomposed
graph's up to the matmul kernel's blocking of a smaller problem; cut along K the partial products
are added in another order (float rounding). The new nodes are rank-local (role "comm", like
insert_comm's own, in the phase of the node they stand for), copied unchanged by emit; a
decomposed matmul carries its local flops (`MATMUL_FLOPS_KEY`) for the modeled timeline, and the
pieces' collectives a key that keeps the bucketing from merging them back (`PIECE_KEY`).

Which pairs are rewritten is a cost decision (`mode="auto"`): the pair's matmul time plus the time
its collective is exposed in the scheduled step without the rewrite, against the pieces' matmuls
(smaller, each at least a launch), the extra copies and calls, and what of the first piece's
transfer and the pieces' leftover transfer stays exposed (`price_pair`). "on" rewrites every
qualifying pair, "off" none.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from autopar.core.collectives import (
    BYTES_KEY,
    DECOMPOSED_KEY,
    MATMUL_FLOPS_KEY,
    PIECE_KEY,
    DecomposedPair,
    comm_group,
)
from autopar.core.mesh import Mesh
from autopar.core.meta import NodeInfo, info, set_info
from autopar.cost.formulas import MeshCost
from autopar.cost.hardware import load_hardware
from autopar.passes.decompose_pairs import (
    CONTRACTED,
    DIMS,
    VIEWS,
    Chain,
    Pair,
    find_pairs,
    front_shape,
    matmul_work,
    operand_bytes,
    operands,
    out_bytes,
    piece_step,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

MODES = ("auto", "on", "off")
__all__ = ["MODES", "decompose_matmuls", "find_pairs", "price_pair"]


def decompose_matmuls(
    gm: fx.GraphModule,
    mesh: Mesh,
    coords: Sequence[int],
    *,
    hardware: str | None = None,
    mode: str = "auto",
    exposed: Mapping[str, float] | None = None,
    only: Collection[str] | None = None,
    rewrite: bool = True,
    pieces: Mapping[str, int] | None = None,
) -> fx.GraphModule:
    """Rewrite this rank's qualifying collective-matmul pairs (module docstring). `exposed`: seconds
    each collective (by node name) waits exposed in the scheduled step without the rewrite, which
    "auto" needs with `hardware`; without them "auto" rewrites nothing. `only`, when given, names
    the collectives whose pairs are rewritten, whatever `mode` says (the driver's choice by the
    whole step's model). `rewrite=False` only prices and records the pairs (`DECOMPOSED_KEY`).
    `pieces`: the piece count of each named collective's pair, as an earlier pricing call chose it
    (a trial of the driver's that has no exposed times to price with must cut the pairs alike)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    shape, coords = tuple(mesh.shape), tuple(coords)
    cost = MeshCost.build(load_hardware(hardware), shape, mesh.in_process) if hardware is not None else None
    records = []
    rewritten: set[fx.Node] = set()  # matmuls of pairs rewritten already (gather -> mm -> scatter: once)
    for options in _piece_options(gm, shape, coords, several=(mode == "auto" and cost is not None) or bool(pieces)):
        pair, before, after = _chosen(options, cost, shape, exposed or {}, pieces or {})
        if any(c.matmul in rewritten for c in pair.chains):
            continue
        kept = mode == "on" or (mode == "auto" and cost is not None and exposed is not None and after < before)
        if only is not None:
            kept = pair.collective.name in only
        step = info(pair.collective).comm
        assert step is not None
        records.append(
            DecomposedPair(
                pair.collective.name,
                step.kind,
                tuple(c.matmul.name for c in pair.chains),
                tuple(DIMS[c.dim] for c in pair.chains),
                info(pair.collective).where(),
                pair.chunks,
                before,
                after,
                kept,
            )
        )
        if kept:
            rewritten.update(c.matmul for c in pair.chains)
            if rewrite:
                _Rewriter(gm, pair, shape, coords).rewrite()
    gm.meta[DECOMPOSED_KEY] = tuple(records)
    gm.graph.lint()
    gm.recompile()
    return gm


# ---- pricing -------------------------------------------------------------------------------------
PIECE_COUNTS = (2, 4, 8)  # at most this many pieces, priced by "auto" beside the group size


def _piece_options(gm: fx.GraphModule, shape: tuple[int, ...], coords: tuple[int, ...], several: bool) -> list[list[Pair]]:
    """Per collective that pairs with a matmul, in graph order, the ways to cut it: into the group
    size's pieces and, where `several`, into at most each of `PIECE_COUNTS` (fewer, larger pieces:
    matmuls nearer their peak rate and fewer calls, less of the transfer hidden)."""
    found: dict[fx.Node, list[Pair]] = {}
    for most in (None, *PIECE_COUNTS) if several else (None,):
        for pair in find_pairs(gm, shape, coords, most):
            options = found.setdefault(pair.collective, [])
            if all(o.chunks != pair.chunks for o in options):
                options.append(pair)
    return [found[node] for node in sorted(found)]


def _chosen(
    options: list[Pair], cost: MeshCost | None, shape: tuple[int, ...], exposed: Mapping[str, float], pieces: Mapping[str, int]
) -> tuple[Pair, float, float]:
    """The option to record (and rewrite, if kept) with its price: the piece count `pieces` names,
    else the one modeled shortest (fewer pieces on a tie), else (unpriced) the most pieces."""
    name = options[0].collective.name
    if name in pieces:
        options = [o for o in options if o.chunks == pieces[name]] or options
    if cost is None:
        return max(options, key=lambda o: o.chunks), 0.0, 0.0
    priced = [(o, *price_pair(o, cost, shape, exposed.get(name, 0.0))) for o in options]
    return min(priced, key=lambda p: (p[2], p[0].chunks))


def price_pair(pair: Pair, cost: MeshCost, shape: tuple[int, ...], exposed: float) -> tuple[float, float]:
    """Modeled seconds the pair adds to the step's critical path (before, after the rewrite).

    Before: its matmuls, plus the time the collective waits exposed in the scheduled step. After:
    k matmuls of 1/k the size (each run at the rate its size reaches, at least a launch), the
    copies that cut operands, interleave outputs or add partial products up, k - 1 more collective
    calls, and exposed: no more than before, and no more than the first piece's transfer plus, for
    each later piece, what of its transfer the previous piece's matmul does not cover (the first
    matmul's: a gathered value read by a forward and a backward matmul overlaps the forward's)."""
    step = info(pair.collective).comm
    assert step is not None
    k = pair.chunks
    whole_mm = sum(_matmul_time(c.matmul, cost, shape, 1) for c in pair.chains)
    piece_mm = sum(_matmul_time(c.matmul, cost, shape, k) for c in pair.chains)
    transfer = cost.step(piece_step(step, k))
    chain_exposed = transfer + (k - 1) * max(0.0, transfer - _matmul_time(pair.chains[0].matmul, cost, shape, k))
    copied = sum(_copied_bytes(c, shape, k) for c in pair.chains)
    copies = copied / cost.hw.memory_bandwidth
    calls = (k - 1) * cost.links[step.axis].call
    before = whole_mm + exposed
    after = k * piece_mm + copies + calls + min(exposed, chain_exposed)
    return before, after


def _copied_bytes(chain: Chain, shape: tuple[int, ...], k: int) -> float:
    """Bytes read and written by what a chain's pieces add: the output interleaved (M, N), or the
    other operand cut into the pieces' rows and the partial products added up (K: each of the
    k - 1 later matmuls reads the running sum besides its operands)."""
    result = out_bytes(chain.matmul, shape)
    if chain.dim != CONTRACTED:
        return 2 * (2 * result)
    indices = operands(chain.matmul)
    assert indices is not None
    other = indices[1] if chain.operand == indices[0] else indices[0]
    return 2 * operand_bytes(chain.matmul, other, shape) + (k - 1) * result


def _matmul_time(matmul: fx.Node, cost: MeshCost, shape: tuple[int, ...], k: int) -> float:
    flops, moved = matmul_work(matmul, shape)
    dtype = info(matmul).layouts[0].dtype if info(matmul).layouts else torch.float32
    return cost.compute(flops / k, moved / k, dtype)


# ---- rewriting -----------------------------------------------------------------------------------
def _plain(node_info: NodeInfo) -> NodeInfo:
    """A rank-local node's info: no layouts nor strategy (its arguments are local already)."""
    return replace(node_info, comm=None, comm_group=None, layouts=(), strategy=None, note="")


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, pair: Pair, shape: tuple[int, ...], coords: tuple[int, ...]) -> None:
        self.gm = gm
        self.pair = pair
        self.shape = shape
        self.coords = coords
        step = info(pair.collective).comm
        assert step is not None and step.dim is not None
        self.step = step
        self.piece_step = piece_step(step, pair.chunks)
        self.g = shape[step.axis]
        self.base = _plain(info(pair.collective))

    def _like(self, node: fx.Node) -> NodeInfo:
        """The info of a node standing for (a piece of) `node`: rank-local, role "comm" like the
        collective's, in `node`'s phase (forward, backward) and at its source line."""
        node_info = info(node)
        return replace(self.base, phase=node_info.phase, module_path=node_info.module_path, source=node_info.source)

    def _node(
        self, target: Any, args: tuple[Any, ...], like: fx.Node, nbytes: float, base: NodeInfo | None = None, **kwargs: Any
    ) -> fx.Node:
        node = self.gm.graph.call_function(target, args, kwargs)
        set_info(node, replace(base if base is not None else self.base))
        node.meta["val"] = like.meta.get("val")
        node.meta[BYTES_KEY] = nbytes
        return node

    def _collective(self, target: Any, args: tuple[Any, ...], c: int) -> fx.Node:
        node = self.gm.graph.call_function(target, args)
        set_info(node, replace(self.base, comm=self.piece_step, comm_group=comm_group(self.pair.collective)))
        node.meta["val"] = self.pair.collective.meta.get("val")
        node.meta[PIECE_KEY] = f"{self.pair.collective.name}:{c}"
        waited = self.gm.graph.call_function(c10d.wait_tensor.default, (node,))
        set_info(waited, replace(self.base, layouts=()))
        waited.meta["val"] = node.meta["val"]
        return waited

    def _replay(
        self, chain: Chain, x: fx.Node, c: int, nbytes: float, made: dict[tuple[fx.Node, int, Any], fx.Node]
    ) -> fx.Node:
        """The chain's views on piece c's block; nodes shared by chains (before a fork) made once
        per piece and phase, in `made`."""
        base = self._like(chain.matmul)
        for op in chain.ops:
            key = (op, c, base.phase)
            if key not in made:
                if op.target in VIEWS:
                    made[key] = self._node(aten.reshape.default, (x, chain.views[op]), op, nbytes, base)
                else:
                    made[key] = self._node(op.target, (x, *op.args[1:]), op, nbytes, base, **op.kwargs)
            x = made[key]
        return x

    def _cut(self, chain: Chain, x: fx.Node, axis: int, c: int, nbytes: float) -> fx.Node:
        """Piece c of every rank block of a 2-D `x`'s dim `axis` ([g, k, run] blocks): the rows
        (columns) piece c's collective holds."""
        g, k = self.g, self.pair.chunks
        run = chain.size // (g * k)
        base = self._like(chain.matmul)
        sizes, whole = ([g, k, run, -1], [g * run, -1]) if axis == 0 else ([-1, g, k, run], [-1, g * run])
        grid = self._node(aten.reshape.default, (x, sizes), x, nbytes, base)
        picked = self._node(aten.select.int, (grid, axis + 1, c), x, nbytes / k, base)
        return self._node(aten.reshape.default, (picked, whole), x, nbytes / k, base)

    def _matmul(self, chain: Chain, operand: fx.Node, operand_index: int, c: int) -> fx.Node:
        mm = chain.matmul
        args = list(mm.args)
        args[operand_index] = operand
        if mm.target is aten.addmm.default and chain.dim == 1:  # the bias of piece c's columns
            bias = args[0]
            assert isinstance(bias, fx.Node)
            column = self._node(aten.reshape.default, (bias, [1, -1]), mm, operand_bytes(mm, 0, self.shape), self._like(mm))
            args[0] = self._node(aten.reshape.default, (self._cut(chain, column, 1, c, operand_bytes(mm, 0, self.shape)), [-1]), mm, 0.0, self._like(mm))
        node = self._node(mm.target, tuple(args), mm, out_bytes(mm, self.shape) / self.pair.chunks, self._like(mm))
        flops, _ = matmul_work(mm, self.shape)
        node.meta[MATMUL_FLOPS_KEY] = flops / self.pair.chunks
        return node

    def _accumulate(self, chain: Chain, pieces: list[fx.Node]) -> fx.Node:
        """The contracted dim: Y = sum_c A_c B_c, piece c's gathered block times the matching
        rows (columns) of the other operand, each matmul adding onto the previous ones' sum
        (`addmm`), so piece c's product waits for its own collective only."""
        mm, k = chain.matmul, self.pair.chunks
        indices = operands(mm)
        assert indices is not None
        left = chain.operand == indices[0]
        other_index = indices[1] if left else indices[0]
        other = mm.args[other_index]
        assert isinstance(other, fx.Node)
        nbytes = operand_bytes(mm, other_index, self.shape)
        flops, _ = matmul_work(mm, self.shape)
        base = self._like(mm)
        total: fx.Node | None = None
        for c, piece in enumerate(pieces):
            cut = self._cut(chain, other, 0 if left else 1, c, nbytes)
            a, b = (piece, cut) if left else (cut, piece)
            if total is None:
                target, args = mm.target, ((mm.args[0], a, b) if mm.target is aten.addmm.default else (a, b))
            else:
                target, args = aten.addmm.default, (total, a, b)
            total = self._node(target, args, mm, out_bytes(mm, self.shape), base)
            total.meta[MATMUL_FLOPS_KEY] = flops / k
        assert total is not None
        return total

    def rewrite(self) -> None:
        if self.step.kind == "all_gather":
            self._rewrite_gather()
        else:
            self._rewrite_scatter()

    def _rewrite_gather(self) -> None:
        pair, g, k = self.pair, self.g, self.pair.chunks
        graph = self.gm.graph
        front = pair.collective.args[0]
        assert isinstance(front, fx.Node)
        local = self.step.before.local_bytes(self.shape)
        rows = front_shape(self.step.before, self.step.dim, self.shape, self.coords)[0]  # type: ignore[arg-type]
        piece_rows = rows // k
        waits = []
        with graph.inserting_before(pair.collective):
            for c in range(k):
                part = self._node(aten.slice.Tensor, (front, 0, c * piece_rows, (c + 1) * piece_rows), front, local / k)
                waited = self._collective(c10d.all_gather_into_tensor.default, (part, g, *pair.collective.args[2:]), c)
                waits.append(waited)
        made: dict[tuple[fx.Node, int, Any], fx.Node] = {}
        chains = pair.chains  # in graph order of their matmuls: shared views made before the first
        for chain in chains:
            mm = chain.matmul
            with graph.inserting_before(mm):
                pieces = [self._replay(chain, w, c, local * g / k, made) for c, w in enumerate(waits)]
                if chain.dim == CONTRACTED:
                    whole = self._accumulate(chain, pieces)
                else:
                    outputs = [self._matmul(chain, piece, chain.operand, c) for c, piece in enumerate(pieces)]
                    whole = self._interleave(outputs, chain, mm, out_bytes(mm, self.shape))
            mm.replace_all_uses_with(whole)
            graph.erase_node(mm)
        for op in sorted({op for chain in chains for op in chain.ops}, reverse=True):
            if not op.users:  # read by the rewritten matmuls only (a fork's other branch keeps it)
                graph.erase_node(op)
        if pair.wait.users:  # read by others too (kept for backward): put the gathered value together
            with graph.inserting_before(pair.wait):
                whole_rows = rows * g
                rest = list(front_shape(self.step.after, self.step.dim, self.shape, self.coords)[1:])  # type: ignore[arg-type]
                blocks = [
                    self._node(aten.view.default, (w, [g, piece_rows, *rest]), pair.wait, local * g / k) for w in waits
                ]
                stacked = self._node(aten.stack.default, (blocks, 1), pair.wait, local * g)
                full = self._node(aten.view.default, (stacked, [whole_rows, *rest]), pair.wait, local * g)
            pair.wait.replace_all_uses_with(full)
        graph.erase_node(pair.wait)
        graph.erase_node(pair.collective)

    def _interleave(self, pieces: list[fx.Node], chain: Chain, like: fx.Node, nbytes: float) -> fx.Node:
        """The pieces' outputs in the serial order: rank blocks outermost, pieces within a block."""
        g, k = self.g, self.pair.chunks
        out = list(info(like).layouts[0].local_shape(self.shape, self.coords))
        run = chain.size // (g * k)
        base = self._like(like)
        if chain.dim == 0:
            blocks = [self._node(aten.view.default, (p, [g, run, out[1]]), like, nbytes / k, base) for p in pieces]
            stacked = self._node(aten.stack.default, (blocks, 1), like, nbytes, base)
        else:
            blocks = [self._node(aten.view.default, (p, [out[0], g, run]), like, nbytes / k, base) for p in pieces]
            stacked = self._node(aten.stack.default, (blocks, 2), like, nbytes, base)
        return self._node(aten.view.default, (stacked, out), like, nbytes, base)

    def _rewrite_scatter(self) -> None:
        pair, g, k = self.pair, self.g, self.pair.chunks
        graph = self.gm.graph
        chain = pair.chains[0]
        mm = chain.matmul
        operand = mm.args[chain.operand]
        assert isinstance(operand, fx.Node)
        nbytes = operand_bytes(mm, chain.operand, self.shape)
        local = self.step.before.local_bytes(self.shape)
        waits = []
        with graph.inserting_before(pair.wait):
            for c in range(k):
                # rows: [M, K] -> [g, k, run, K] -> piece c [g * run, K]; columns: [K, N] likewise
                cut = self._cut(chain, operand, chain.dim, c, nbytes)
                partial = self._matmul(chain, cut, chain.operand, c)
                front = self._replay(chain, partial, c, local / k, {})
                waits.append(self._collective(c10d.reduce_scatter_tensor.default, (front, *pair.collective.args[1:]), c))
            whole = self._node(aten.cat.default, (waits, 0), pair.wait, local / g)
        pair.wait.replace_all_uses_with(whole)
        graph.erase_node(pair.wait)
        graph.erase_node(pair.collective)
        for op in reversed(chain.ops):
            graph.erase_node(op)
        graph.erase_node(mm)
