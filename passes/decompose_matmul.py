"""Decomposed collective matmuls: an all-gather feeding a matmul, or a matmul feeding a
reduce-scatter, split into chunks so that each chunk's communication overlaps another chunk's
matmul (the async tensor parallelism of Wang et al., ASPLOS'23; torch's async TP).

Runs between insert_comm and the schedule stage, on this rank's graph. A pair qualifies when the
gathered (scattered) dim reaches a non-contracted dim of an `mm`/`addmm` (the rows M of its left
operand, the columns N of its right one) through views, transposes and copies only, in whole rank
blocks. Each rank's shard is then cut into k row pieces (k: the group size, or the largest divisor
of the shard's rows below it):

- all-gather -> matmul: k all-gathers of one piece each; piece c's gather holds piece c of every
  rank, its matmul (the same views replayed on the smaller block) waits for that gather only, and
  the k outputs are interleaved back into the serial row order (`stack` + `view`). A gathered value
  that other nodes read too (kept for backward) is put together again for them.
- matmul -> reduce-scatter: k matmuls, matmul c on the rows (columns) that piece c of every rank's
  block is made of, each followed by its own reduce-scatter; the k results are concatenated.

Every row is computed by one matmul over the same contracted length as before, and every sum of
the reduce-scatters adds the same summands, so results equal the undecomposed graph's up to the
matmul kernel's blocking of a smaller problem. The new nodes are rank-local (role "comm", like
insert_comm's own), copied unchanged by emit; a decomposed matmul carries its local flops
(`MATMUL_FLOPS_KEY`) for the modeled timeline, and the pieces' collectives a key that keeps the
bucketing from merging them back (`PIECE_KEY`).

Which pairs are rewritten is a cost decision (`mode="auto"`): the pair's matmul time plus the time
its collective is exposed in the scheduled step without the rewrite, against the pieces' matmuls
(smaller, each at least a launch), the extra copies and calls, and what of the first piece's
transfer and the pieces' leftover transfer stays exposed (`price_pair`). "on" rewrites every
qualifying pair, "off" none.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
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
from autopar.core.layout import Layout
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info, set_info
from autopar.core.redistribute import CommStep
from autopar.cost.formulas import MeshCost
from autopar.cost.hardware import load_hardware

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

MODES = ("auto", "on", "off")
_MATMULS = (aten.mm.default, aten.addmm.default)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SAME = (aten.clone.default, aten.alias.default, aten.detach.default)
_FLIPS = (aten.t.default, aten.transpose.int, aten.permute.default)


@dataclass
class _Chain:
    """Unary view-like nodes between a collective's value and a matmul operand (or back)."""

    ops: list[fx.Node]
    views: dict[fx.Node, list[int]]  # a view's local size with the piece's dim divided by k
    matmul: fx.Node
    operand: int  # argument index of the matmul the chain feeds / position of its output dim
    dim: int  # the matmul's dim the rank blocks run along: 0 rows (M), 1 columns (N)
    size: int  # that dim's local length


@dataclass
class _Pair:
    collective: fx.Node
    wait: fx.Node
    chains: list[_Chain]
    chunks: int


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
) -> fx.GraphModule:
    """Rewrite this rank's qualifying collective-matmul pairs (module docstring). `exposed`: seconds
    each collective (by node name) waits exposed in the scheduled step without the rewrite, which
    "auto" needs with `hardware`; without them "auto" rewrites nothing. `only`, when given, names
    the collectives whose pairs are rewritten, whatever `mode` says (the driver's choice by the
    whole step's model). `rewrite=False` only prices and records the pairs (`DECOMPOSED_KEY`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    shape, coords = tuple(mesh.shape), tuple(coords)
    cost = MeshCost.build(load_hardware(hardware), shape, mesh.in_process) if hardware is not None else None
    records = []
    rewritten: set[fx.Node] = set()  # matmuls of pairs rewritten already (gather -> mm -> scatter: once)
    for pair in find_pairs(gm, shape, coords):
        if any(c.matmul in rewritten for c in pair.chains):
            continue
        before = after = 0.0
        if cost is not None:
            before, after = price_pair(pair, cost, shape, (exposed or {}).get(pair.collective.name, 0.0))
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
                tuple("MN"[c.dim] for c in pair.chains),
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


# ---- finding pairs -------------------------------------------------------------------------------
def find_pairs(gm: fx.GraphModule, shape: tuple[int, ...], coords: tuple[int, ...]) -> list[_Pair]:
    """The graph's all-gather -> matmul and matmul -> reduce-scatter pairs that can be decomposed."""
    pairs = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not has_info(node) or info(node).comm is None:
            continue
        step = info(node).comm
        assert step is not None
        wait = next(iter(node.users), None)
        if wait is None or len(node.users) != 1 or wait.target is not c10d.wait_tensor.default:
            continue
        if node.target is c10d.all_gather_into_tensor.default and step.kind == "all_gather":
            pair = _gather_pair(node, wait, step, shape, coords)
        elif node.target is c10d.reduce_scatter_tensor.default and step.kind == "reduce_scatter":
            pair = _scatter_pair(node, wait, step, shape, coords)
        else:
            continue
        if pair is not None:
            pairs.append(pair)
    return pairs


def _front_shape(layout: Layout, dim: int, shape: tuple[int, ...], coords: tuple[int, ...]) -> list[int]:
    local = list(layout.local_shape(shape, coords))
    return [local[dim], *local[:dim], *local[dim + 1 :]]


def _pieces(rows: int, g: int) -> int:
    """Pieces to cut a rank's `rows` into: the group size, or its largest divisor below that."""
    return max((k for k in range(2, g + 1) if rows % k == 0), default=1)


def _gather_pair(
    node: fx.Node, wait: fx.Node, step: CommStep, shape: tuple[int, ...], coords: tuple[int, ...]
) -> _Pair | None:
    assert step.dim is not None
    g = shape[step.axis]
    if step.dim in step.before.uneven_dims(shape):
        return None
    front = _front_shape(step.after, step.dim, shape, coords)
    k = _pieces(front[0] // g, g)
    if k < 2:
        return None
    chains = []
    for user in wait.users:
        chain = _follow_down(user, wait, front, g, k, shape, coords)
        if chain is not None:
            chains.append(chain)
    return _Pair(node, wait, chains, k) if chains else None


def _follow_down(
    first: fx.Node,
    start: fx.Node,
    local: list[int],
    g: int,
    k: int,
    shape: tuple[int, ...],
    coords: tuple[int, ...],
) -> _Chain | None:
    """The chain from `start` (dim 0 in rank blocks) through `first` and its single users to a
    matmul operand along M or N, or None."""
    ops: list[fx.Node] = []
    views: dict[fx.Node, list[int]] = {}
    pos, current, prev = 0, local, start
    node = first
    while node.target not in _MATMULS:
        if node.op != "call_function" or node.args[0] is not prev or not _unary(node):
            return None
        moved = _track(node, current, pos, g, k, shape, coords)
        if moved is None:
            return None
        current, pos, piece = moved
        if piece is not None:
            views[node] = piece
        ops.append(node)
        if len(node.users) != 1:
            return None
        prev, node = node, next(iter(node.users))
    operands = _operands(node)
    if operands is None or [a is prev for a in node.args].count(True) != 1 or not _even(node, shape):
        return None
    index = list(node.args).index(prev)
    dim = 0 if index == operands[0] else 1
    if len(current) != 2 or pos != dim or not _bias_fits(node, dim, current[dim], shape):
        return None
    return _Chain(ops, views, node, index, dim, current[dim])


def _scatter_pair(
    node: fx.Node, wait: fx.Node, step: CommStep, shape: tuple[int, ...], coords: tuple[int, ...]
) -> _Pair | None:
    assert step.dim is not None
    g = shape[step.axis]
    if step.dim in step.after.uneven_dims(shape):
        return None
    front = _front_shape(step.before, step.dim, shape, coords)
    k = _pieces(front[0] // g, g)
    if k < 2:
        return None
    ops: list[fx.Node] = []
    node_up = node.args[0]
    while isinstance(node_up, fx.Node) and node_up.target not in _MATMULS:
        if node_up.op != "call_function" or len(node_up.users) != 1 or not _unary(node_up):
            return None
        ops.append(node_up)
        node_up = node_up.args[0]
    if not isinstance(node_up, fx.Node) or len(node_up.users) != 1 or _operands(node_up) is None:
        return None
    if not _even(node_up, shape):
        return None
    matmul = node_up
    ops.reverse()
    out = list(info(matmul).layouts[0].local_shape(shape, coords)) if info(matmul).layouts else None
    if out is None or len(out) != 2:
        return None
    for dim in (0, 1):
        if not _bias_fits(matmul, dim, out[dim], shape):
            continue
        if out[dim] % (g * k) != 0:
            continue
        pos, current, views, ok = dim, out, {}, True
        for op in ops:
            moved = _track(op, current, pos, g, k, shape, coords)
            if moved is None:
                ok = False
                break
            current, pos, piece = moved
            if piece is not None:
                views[op] = piece
        if ok and pos == 0 and current == front:
            operands = _operands(matmul)
            assert operands is not None
            return _Pair(node, wait, [_Chain(ops, views, matmul, operands[dim], dim, out[dim])], k)
    return None


def _even(matmul: fx.Node, shape: tuple[int, ...]) -> bool:
    """A matmul whose operands and result split evenly: every rank then finds the same pairs with
    the same sizes and prices them alike, so all ranks rewrite the same pairs (their collectives
    must match)."""
    strategy = info(matmul).strategy
    layouts = [*(strategy.inputs if strategy is not None else ()), *info(matmul).layouts]
    return strategy is not None and all(not lay.uneven_dims(shape) for lay in layouts)


def _bias_fits(matmul: fx.Node, dim: int, size: int, shape: tuple[int, ...]) -> bool:
    """An addmm's bias can be cut with its columns: one value per column (N,), or rows are cut."""
    if matmul.target is not aten.addmm.default or dim == 0:
        return True
    strategy = info(matmul).strategy
    return strategy is not None and tuple(strategy.inputs[0].local_shape(shape)) == (size,)


def _operands(matmul: fx.Node) -> tuple[int, int] | None:
    """Argument indices of a matmul's left and right operands (None: not one this pass rewrites)."""
    if matmul.kwargs:
        return None
    if matmul.target is aten.mm.default:
        return (0, 1)
    if matmul.target is aten.addmm.default:
        return (1, 2)
    return None


def _unary(node: fx.Node) -> bool:
    """A view, transpose or copy of its first argument whose other arguments are constants."""
    if node.target not in (*_VIEWS, *_SAME, *_FLIPS):
        return False
    rest = [*node.args[1:], *node.kwargs.values()]
    return not any(isinstance(x, fx.Node) for x in rest)


def _local_out(node: fx.Node, shape: tuple[int, ...], coords: tuple[int, ...]) -> list[int] | None:
    """A view's local result size: its layout's (a planned node, global arguments) or its own
    arguments (a node insert_comm added, rank-local already)."""
    if has_info(node) and info(node).layouts:
        return list(info(node).layouts[0].local_shape(shape, coords))
    size = node.args[1]
    return list(size) if isinstance(size, (list, tuple)) and -1 not in size else None  # type: ignore[arg-type]


def _track(
    node: fx.Node,
    current: list[int],
    pos: int,
    g: int,
    k: int,
    shape: tuple[int, ...],
    coords: tuple[int, ...],
) -> tuple[list[int], int, list[int] | None] | None:
    """Where the rank-block dim goes through one node: (local shape after, its dim, a view's size for
    one piece), or None where the blocks would no longer be whole runs of one dim."""
    if node.target in _SAME:
        return current, pos, None
    ndim = len(current)
    if node.target is aten.t.default:
        return current[::-1], (ndim - 1 - pos) if ndim == 2 else pos, None
    if node.target is aten.transpose.int:
        a, b = (int(d) % ndim for d in node.args[1:3])  # type: ignore[arg-type]
        perm = list(range(ndim))
        perm[a], perm[b] = perm[b], perm[a]
    elif node.target is aten.permute.default:
        perm = [int(d) % ndim for d in node.args[1]]  # type: ignore[arg-type, union-attr]
    else:  # a view
        out = _local_out(node, shape, coords)
        if out is None or math.prod(out) != math.prod(current):
            return None
        before = math.prod(current[:pos])
        j = next((j for j in range(len(out) + 1) if math.prod(out[:j]) >= before), len(out))
        if j >= len(out) or math.prod(out[:j]) != before:
            return None
        merged = out[j] % current[pos] == 0 and any(
            math.prod(current[pos:e]) == out[j] for e in range(pos + 1, ndim + 1)
        )
        split = current[pos] % out[j] == 0 and out[j] % (g * k) == 0 and any(
            math.prod(out[j:e]) == current[pos] for e in range(j + 1, len(out) + 1)
        )
        if not (merged or split):
            return None
        piece = list(out)
        piece[j] //= k
        return out, j, piece
    return [current[p] for p in perm], perm.index(pos), None


# ---- pricing -------------------------------------------------------------------------------------
def price_pair(pair: _Pair, cost: MeshCost, shape: tuple[int, ...], exposed: float) -> tuple[float, float]:
    """Modeled seconds the pair adds to the step's critical path (before, after the rewrite).

    Before: its matmuls, plus the time the collective waits exposed in the scheduled step. After:
    k matmuls of 1/k the size (each run at the rate its size reaches, at least a launch), the
    copies that cut operands and interleave outputs, k - 1 more collective calls, and exposed: no
    more than before, and no more than the first piece's transfer plus, for each later piece, what
    of its transfer the previous piece's matmul does not cover."""
    step = info(pair.collective).comm
    assert step is not None
    k = pair.chunks
    piece = _piece_step(step, k)
    whole_mm = sum(_matmul_time(c.matmul, cost, shape, 1) for c in pair.chains)
    piece_mm = sum(_matmul_time(c.matmul, cost, shape, k) for c in pair.chains)
    transfer = cost.step(piece)
    chain_exposed = transfer + (k - 1) * max(0.0, transfer - piece_mm)
    out_bytes = sum(_out_bytes(c.matmul, shape) for c in pair.chains)
    copies = 2 * (2 * out_bytes) / cost.hw.memory_bandwidth  # operands cut or outputs interleaved
    calls = (k - 1) * cost.links[step.axis].call
    before = whole_mm + exposed
    after = k * piece_mm + copies + calls + min(exposed, chain_exposed)
    return before, after


def _piece_step(step: CommStep, k: int) -> CommStep:
    assert step.dim is not None

    def cut(layout: Layout) -> Layout:
        sizes = list(layout.shape)
        sizes[step.dim] //= k  # type: ignore[index]
        return replace(layout, shape=tuple(sizes))

    return replace(step, before=cut(step.before), after=cut(step.after))


def _matmul_time(matmul: fx.Node, cost: MeshCost, shape: tuple[int, ...], k: int) -> float:
    flops, moved = _matmul_work(matmul, shape)
    dtype = info(matmul).layouts[0].dtype if info(matmul).layouts else torch.float32
    return cost.compute(flops / k, moved / k, dtype)


def _matmul_work(matmul: fx.Node, shape: tuple[int, ...]) -> tuple[float, float]:
    """Local flops and bytes moved of a planned matmul (2 M K N; its operands and result)."""
    strategy = info(matmul).strategy
    assert strategy is not None
    operands = _operands(matmul)
    assert operands is not None
    a, b = (strategy.inputs[i].local_shape(shape) for i in operands)
    flops = 2.0 * a[0] * a[1] * b[1]
    moved = sum(lay.local_bytes(shape) for lay in strategy.inputs) + _out_bytes(matmul, shape)
    return flops, float(moved)


def _out_bytes(matmul: fx.Node, shape: tuple[int, ...]) -> float:
    layouts = info(matmul).layouts
    return float(layouts[0].local_bytes(shape)) if layouts else 0.0


# ---- rewriting -----------------------------------------------------------------------------------
class _Rewriter:
    def __init__(self, gm: fx.GraphModule, pair: _Pair, shape: tuple[int, ...], coords: tuple[int, ...]) -> None:
        self.gm = gm
        self.pair = pair
        self.shape = shape
        self.coords = coords
        step = info(pair.collective).comm
        assert step is not None and step.dim is not None
        self.step = step
        self.piece_step = _piece_step(step, pair.chunks)
        self.g = shape[step.axis]
        self.base = replace(info(pair.collective), comm=None, comm_group=None, layouts=(), strategy=None, note="")

    def _node(self, target: Any, args: tuple[Any, ...], like: fx.Node, nbytes: float, **kwargs: Any) -> fx.Node:
        node = self.gm.graph.call_function(target, args, kwargs)
        set_info(node, replace(self.base))
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

    def _replay(self, chain: _Chain, x: fx.Node, nbytes: float) -> fx.Node:
        for op in chain.ops:
            if op.target in _VIEWS:
                x = self._node(aten.reshape.default, (x, chain.views[op]), op, nbytes)
            else:
                x = self._node(op.target, (x, *op.args[1:]), op, nbytes, **op.kwargs)
        return x

    def _matmul(self, chain: _Chain, operand: fx.Node, operand_index: int, c: int) -> fx.Node:
        mm = chain.matmul
        args = list(mm.args)
        args[operand_index] = operand
        if mm.target is aten.addmm.default and chain.dim == 1:  # the bias of piece c's columns
            g, k = self.g, self.pair.chunks
            run = chain.size // (g * k)
            bias = args[0]
            nbytes = _operand_bytes(mm, 0, self.shape)
            grid = self._node(aten.reshape.default, (bias, [g, k, run]), mm, nbytes)
            picked = self._node(aten.select.int, (grid, 1, c), mm, nbytes / k)
            args[0] = self._node(aten.reshape.default, (picked, [g * run]), mm, nbytes / k)
        node = self._node(mm.target, tuple(args), mm, _out_bytes(mm, self.shape) / self.pair.chunks)
        flops, _ = _matmul_work(mm, self.shape)
        node.meta[MATMUL_FLOPS_KEY] = flops / self.pair.chunks
        return node

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
        rows = _front_shape(self.step.before, self.step.dim, self.shape, self.coords)[0]  # type: ignore[arg-type]
        piece_rows = rows // k
        outputs: dict[fx.Node, list[fx.Node]] = {c.matmul: [] for c in pair.chains}
        waits = []
        with graph.inserting_before(pair.collective):
            for c in range(k):
                part = self._node(aten.slice.Tensor, (front, 0, c * piece_rows, (c + 1) * piece_rows), front, local / k)
                waited = self._collective(c10d.all_gather_into_tensor.default, (part, g, *pair.collective.args[2:]), c)
                waits.append(waited)
        for chain in pair.chains:
            mm = chain.matmul
            out_bytes = _out_bytes(mm, self.shape)
            with graph.inserting_before(mm):
                for c, waited in enumerate(waits):
                    operand = self._replay(chain, waited, local * g / k)
                    outputs[mm].append(self._matmul(chain, operand, chain.operand, c))
                whole = self._interleave(outputs[mm], chain, mm, out_bytes)
            mm.replace_all_uses_with(whole)
            graph.erase_node(mm)
            for op in reversed(chain.ops):
                graph.erase_node(op)
        if pair.wait.users:  # read by others too (kept for backward): put the gathered value together
            with graph.inserting_before(pair.wait):
                whole_rows = rows * g
                rest = list(_front_shape(self.step.after, self.step.dim, self.shape, self.coords)[1:])  # type: ignore[arg-type]
                blocks = [
                    self._node(aten.view.default, (w, [g, piece_rows, *rest]), pair.wait, local * g / k) for w in waits
                ]
                stacked = self._node(aten.stack.default, (blocks, 1), pair.wait, local * g)
                full = self._node(aten.view.default, (stacked, [whole_rows, *rest]), pair.wait, local * g)
            pair.wait.replace_all_uses_with(full)
        graph.erase_node(pair.wait)
        graph.erase_node(pair.collective)

    def _interleave(self, pieces: list[fx.Node], chain: _Chain, like: fx.Node, nbytes: float) -> fx.Node:
        """The pieces' outputs in the serial order: rank blocks outermost, pieces within a block."""
        g, k = self.g, self.pair.chunks
        out = list(info(like).layouts[0].local_shape(self.shape, self.coords))
        run = chain.size // (g * k)
        if chain.dim == 0:
            blocks = [self._node(aten.view.default, (p, [g, run, out[1]]), like, nbytes / k) for p in pieces]
            stacked = self._node(aten.stack.default, (blocks, 1), like, nbytes)
        else:
            blocks = [self._node(aten.view.default, (p, [out[0], g, run]), like, nbytes / k) for p in pieces]
            stacked = self._node(aten.stack.default, (blocks, 2), like, nbytes)
        return self._node(aten.view.default, (stacked, out), like, nbytes)

    def _rewrite_scatter(self) -> None:
        pair, g, k = self.pair, self.g, self.pair.chunks
        graph = self.gm.graph
        chain = pair.chains[0]
        mm = chain.matmul
        run = chain.size // (g * k)
        operand = mm.args[chain.operand]
        assert isinstance(operand, fx.Node)
        operand_bytes = _operand_bytes(mm, chain.operand, self.shape)
        local = self.step.before.local_bytes(self.shape)
        waits = []
        with graph.inserting_before(pair.wait):
            for c in range(k):
                if chain.dim == 0:  # rows: [M, K] -> [g, k, run, K] -> piece c: [g * run, K]
                    grid = self._node(aten.reshape.default, (operand, [g, k, run, -1]), operand, operand_bytes)
                    picked = self._node(aten.select.int, (grid, 1, c), operand, operand_bytes / k)
                    cut = self._node(aten.reshape.default, (picked, [g * run, -1]), operand, operand_bytes / k)
                else:  # columns: [K, N] -> [K, g, k, run] -> piece c: [K, g * run]
                    grid = self._node(aten.reshape.default, (operand, [-1, g, k, run]), operand, operand_bytes)
                    picked = self._node(aten.select.int, (grid, 2, c), operand, operand_bytes / k)
                    cut = self._node(aten.reshape.default, (picked, [-1, g * run]), operand, operand_bytes / k)
                partial = self._matmul(chain, cut, chain.operand, c)
                front = self._replay(chain, partial, local / k)
                waits.append(self._collective(c10d.reduce_scatter_tensor.default, (front, *pair.collective.args[1:]), c))
            whole = self._node(aten.cat.default, (waits, 0), pair.wait, local / g)
        pair.wait.replace_all_uses_with(whole)
        graph.erase_node(pair.wait)
        graph.erase_node(pair.collective)
        for op in reversed(chain.ops):
            graph.erase_node(op)
        graph.erase_node(mm)


def _operand_bytes(matmul: fx.Node, index: int, shape: tuple[int, ...]) -> float:
    strategy = info(matmul).strategy
    assert strategy is not None
    return float(strategy.inputs[index].local_bytes(shape))

