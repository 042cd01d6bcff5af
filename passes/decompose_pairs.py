"""The collective-matmul pairs `autopar.passes.decompose_matmul` can cut into pieces: where an
all-gather's rank blocks reach a matmul operand, or a matmul's output reaches a reduce-scatter,
through views, transposes and copies only, and which of the matmul's dims the blocks run along.

Apart from the rewriting so that finding a pair (what the driver asks before it prices anything)
reads the graph only. The gathered dim may reach a matmul's rows M or columns N (its pieces give
whole output rows or columns, interleaved back) or its contracted dim K (its pieces give partial
products of the whole output, added up); a reduce-scatter's dim is always one of the output's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from autopar.core.layout import Layout, is_balanced
from autopar.core.meta import has_info, info
from autopar.core.redistribute import CommStep

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

MATMULS = (aten.mm.default, aten.addmm.default)
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
SAME = (aten.clone.default, aten.alias.default, aten.detach.default)
FLIPS = (aten.t.default, aten.transpose.int, aten.permute.default)
DIMS = "MNK"  # a chain's `dim`: 0 rows of the output, 1 its columns, 2 the contracted dim
CONTRACTED = 2
MAX_CHAIN = 8  # view-like nodes followed from a gathered value before giving up on a branch


@dataclass
class Chain:
    """Unary view-like nodes between a collective's value and a matmul operand (or back)."""

    ops: list[fx.Node]
    views: dict[fx.Node, list[int]]  # a view's local size with the piece's dim divided by k
    matmul: fx.Node
    operand: int  # argument index of the matmul the chain feeds / position of its output dim
    dim: int  # the matmul's dim the rank blocks run along: 0 rows (M), 1 columns (N), 2 contracted (K)
    size: int  # that dim's local length


@dataclass
class Pair:
    collective: fx.Node
    wait: fx.Node
    chains: list[Chain]
    chunks: int


def find_pairs(
    gm: fx.GraphModule, shape: tuple[int, ...], coords: tuple[int, ...], most_pieces: int | None = None
) -> list[Pair]:
    """The graph's all-gather -> matmul and matmul -> reduce-scatter pairs that can be decomposed,
    each cut into as many pieces as its group has ranks (or the largest count below that which
    divides a rank's rows), at most `most_pieces` where given."""
    pairs = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not has_info(node) or info(node).comm is None:
            continue
        step = info(node).comm
        assert step is not None
        if is_balanced(step.before.placements[step.axis]) or is_balanced(step.after.placements[step.axis]):
            continue  # its rank blocks are reordered around it (`BalancedShard`): not rows in rank order
        if step.swap is not None:
            continue  # its blocks are swapped back locally around it (`CommStep.swap`): not rows in rank order
        wait = next(iter(node.users), None)
        if wait is None or len(node.users) != 1 or wait.target is not c10d.wait_tensor.default:
            continue
        if node.target is c10d.all_gather_into_tensor.default and step.kind == "all_gather":
            cut = _cut(step, step.before, step.after, shape, coords, most_pieces)
            pair = _gather_pair(node, wait, cut, shape, coords) if cut is not None else None
        elif node.target is c10d.reduce_scatter_tensor.default and step.kind == "reduce_scatter":
            cut = _cut(step, step.after, step.before, shape, coords, most_pieces)
            pair = _scatter_pair(node, wait, cut, shape, coords) if cut is not None else None
        else:
            continue
        if pair is not None:
            pairs.append(pair)
    return pairs


def front_shape(layout: Layout, dim: int, shape: tuple[int, ...], coords: tuple[int, ...]) -> list[int]:
    """A collective's local buffer: `layout`'s local shape with `dim` moved to the front."""
    local = list(layout.local_shape(shape, coords))
    return [local[dim], *local[:dim], *local[dim + 1 :]]


def piece_step(step: CommStep, k: int) -> CommStep:
    """The collective of one of k pieces: `step` on 1/k of its dim."""
    assert step.dim is not None

    def cut(layout: Layout) -> Layout:
        sizes = list(layout.shape)
        sizes[step.dim] //= k  # type: ignore[index]
        return replace(layout, shape=tuple(sizes))

    return replace(step, before=cut(step.before), after=cut(step.after))


def operands(matmul: fx.Node) -> tuple[int, int] | None:
    """Argument indices of a matmul's left and right operands (None: not one this pass rewrites)."""
    if matmul.kwargs:
        return None
    if matmul.target is aten.mm.default:
        return (0, 1)
    if matmul.target is aten.addmm.default:
        return (1, 2)
    return None


def matmul_work(matmul: fx.Node, shape: tuple[int, ...]) -> tuple[float, float]:
    """Local flops and bytes moved of a planned matmul (2 M K N; its operands and result)."""
    strategy = info(matmul).strategy
    assert strategy is not None
    indices = operands(matmul)
    assert indices is not None
    a, b = (strategy.inputs[i].local_shape(shape) for i in indices)
    flops = 2.0 * a[0] * a[1] * b[1]
    moved = sum(lay.local_bytes(shape) for lay in strategy.inputs) + out_bytes(matmul, shape)
    return flops, float(moved)


def out_bytes(matmul: fx.Node, shape: tuple[int, ...]) -> float:
    layouts = info(matmul).layouts
    return float(layouts[0].local_bytes(shape)) if layouts else 0.0


def operand_bytes(matmul: fx.Node, index: int, shape: tuple[int, ...]) -> float:
    strategy = info(matmul).strategy
    assert strategy is not None
    return float(strategy.inputs[index].local_bytes(shape))


def _pieces(rows: int, g: int, most: int | None) -> int:
    """Pieces to cut a rank's `rows` into: the group size (capped at `most`), or the largest
    divisor of `rows` below that."""
    top = g if most is None else min(g, most)
    return max((k for k in range(2, top + 1) if rows % k == 0), default=1)


def _cut(
    step: CommStep, blocks: Layout, whole: Layout, shape: tuple[int, ...], coords: tuple[int, ...], most: int | None
) -> tuple[int, list[int], int] | None:
    """The group size, the whole buffer (`whole`'s local shape, the collective's dim in front) and
    the piece count of a collective whose rank `blocks` are even along its dim (None: no pieces)."""
    assert step.dim is not None
    g = shape[step.axis]
    if step.dim in blocks.uneven_dims(shape):
        return None
    front = front_shape(whole, step.dim, shape, coords)
    k = _pieces(front[0] // g, g, most)
    return (g, front, k) if k >= 2 else None


def _gather_pair(
    node: fx.Node, wait: fx.Node, cut: tuple[int, list[int], int], shape: tuple[int, ...], coords: tuple[int, ...]
) -> Pair | None:
    g, front, k = cut
    chains = _follow_down(wait, front, g, k, shape, coords)
    return Pair(node, wait, chains, k) if chains else None


def _follow_down(
    start: fx.Node, local: list[int], g: int, k: int, shape: tuple[int, ...], coords: tuple[int, ...]
) -> list[Chain]:
    """Every chain from `start` (dim 0 in rank blocks) through view-like nodes to a matmul operand,
    in graph order. A branch may fork (one view read by a forward and a backward matmul): each
    matmul gets its own chain, sharing the nodes before the fork."""
    chains: list[Chain] = []

    def walk(prev: fx.Node, current: list[int], pos: int, ops: list[fx.Node], views: dict[fx.Node, list[int]]) -> None:
        for node in sorted(prev.users):  # fx nodes compare by their place in the graph
            if node.target in MATMULS:
                chain = _matmul_chain(node, prev, g, k, current, pos, ops, views, shape)
                if chain is not None:
                    chains.append(chain)
                continue
            if len(ops) >= MAX_CHAIN or node.op != "call_function" or node.args[0] is not prev or not _unary(node):
                continue
            moved = _track(node, current, pos, g, k, shape, coords)
            if moved is None:
                continue
            after, at, piece = moved
            walk(node, after, at, [*ops, node], {**views, node: piece} if piece is not None else views)

    walk(start, local, 0, [], {})
    return sorted(chains, key=lambda chain: chain.matmul)


def _matmul_chain(
    node: fx.Node,
    prev: fx.Node,
    g: int,
    k: int,
    current: list[int],
    pos: int,
    ops: list[fx.Node],
    views: dict[fx.Node, list[int]],
    shape: tuple[int, ...],
) -> Chain | None:
    """The chain ending at matmul `node`, read from `prev` with the rank blocks along `pos`."""
    indices = operands(node)
    if indices is None or [a is prev for a in node.args].count(True) != 1 or not _even(node, shape):
        return None
    index = list(node.args).index(prev)
    if index not in indices or len(current) != 2:
        return None
    left = index == indices[0]
    if pos == (1 if left else 0):  # A's columns / B's rows: the contracted dim
        if current[pos] % (g * k) != 0:
            return None
        dim = CONTRACTED
    else:
        dim = 0 if left else 1
        if not _bias_fits(node, dim, current[pos], shape):
            return None
    return Chain(list(ops), dict(views), node, index, dim, current[pos])


def _scatter_pair(
    node: fx.Node, wait: fx.Node, cut: tuple[int, list[int], int], shape: tuple[int, ...], coords: tuple[int, ...]
) -> Pair | None:
    g, front, k = cut
    ops: list[fx.Node] = []
    node_up = node.args[0]
    while isinstance(node_up, fx.Node) and node_up.target not in MATMULS:
        if node_up.op != "call_function" or len(node_up.users) != 1 or not _unary(node_up):
            return None
        ops.append(node_up)
        node_up = node_up.args[0]
    if not isinstance(node_up, fx.Node) or len(node_up.users) != 1 or operands(node_up) is None:
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
            indices = operands(matmul)
            assert indices is not None
            return Pair(node, wait, [Chain(ops, views, matmul, indices[dim], dim, out[dim])], k)
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


def _unary(node: fx.Node) -> bool:
    """A view, transpose or copy of its first argument whose other arguments are constants."""
    if node.target not in (*VIEWS, *SAME, *FLIPS):
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
    if node.target in SAME:
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
