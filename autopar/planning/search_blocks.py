"""The plan search's exact block moves: chains, and trees of chains around a join or a fork.

A block is a set of variables whose edges among themselves form a tree; with every variable
outside it held fixed, dynamic programming over the tree (messages from the leaves to the root,
then choices back out) gives the block's exact optimum. A chain (an op whose only decided producer
is the previous one) is the simplest tree. Chains alone get stuck where several chains meet: the
q, k and v projections of attention are three chains joining at the attention op (and three more
leaving its backward), so moving one of them alone pays for disagreeing with the other two at the
attention, and none moves. A tree block takes the chain of a join (or fork) with the chains that
feed it (or leave it) and moves them together. An attached chain is trimmed to the part that
touches the block through its one link only, which keeps the block a tree: where q, k and v fork
from the layer norm's output, the views next to the fork stay out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.planning.search_vars import CACHED_ENTRIES, Edge, Tally, Var


@dataclass(frozen=True)
class Block:
    members: tuple[int, ...]  # variables, every parent before its children; members[0] is the root
    parents: tuple[int, ...]  # position in `members` of each member's parent (-1 for the root)
    links: tuple[tuple[tuple[Edge, bool], ...], ...]  # per member: edges to its parent, child is u?
    signature: int  # blocks with equal structure (candidate lists, tables, shape) share it
    scope: tuple[int, ...]  # members and the variables next to them: all a solve reads
    # per member: its edges to variables outside the block (edge, member is the consumer, the other)
    outside: tuple[tuple[tuple[Edge, bool, int], ...], ...]


def _producers(vars: Sequence[Var], edges: Sequence[Edge]) -> list[set[int]]:
    """The variables each variable reads from."""
    producers: list[set[int]] = [set() for _ in vars]
    for edge in edges:
        producers[edge.v].add(edge.u)
    return producers


def chains(vars: Sequence[Var], edges: Sequence[Edge]) -> list[list[int]]:
    """Partition the variables into paths u -> v where u is v's only producing variable."""
    producers = _producers(vars, edges)
    chain_of: dict[int, int] = {}
    found: list[list[int]] = []
    for v in range(len(vars)):
        if len(producers[v]) == 1:
            (u,) = producers[v]
            c = chain_of[u]
            if found[c][-1] == u:
                found[c].append(v)
                chain_of[v] = c
                continue
        chain_of[v] = len(found)
        found.append([v])
    return found


def trees(
    vars: Sequence[Var], edges: Sequence[Edge], chain_list: Sequence[list[int]]
) -> list[list[tuple[int, int]]]:
    """Per join or fork with two or more attached chains: its tree as (member, parent) pairs, the
    root (the join's chain head) first with parent -1."""
    chain_of = {v: c for c, chain in enumerate(chain_list) for v in chain}
    producers = _producers(vars, edges)
    neighbours: list[set[int]] = [set() for _ in vars]
    for edge in edges:
        neighbours[edge.u].add(edge.v)
        neighbours[edge.v].add(edge.u)
    found = []
    for chain in chain_list:
        inside = set(chain)
        tree = [(v, -1 if k == 0 else chain[k - 1]) for k, v in enumerate(chain)]
        attached = 0
        links = [(p, chain[0]) for p in sorted(producers[chain[0]]) if p not in inside]
        links += [
            (chain_list[c][0], u)
            for u in chain
            for c in sorted({chain_of[w] for w in neighbours[u] if w not in inside})
            if producers[chain_list[c][0]] == {u}
        ]
        for start, anchor in links:
            if start in inside:
                continue
            path = _trimmed(chain_list[chain_of[start]], start, inside, neighbours)
            if not path:
                continue
            attached += 1
            tree += [(start, anchor), *path[1:]]
            inside.update(v for v, _ in path)
        if attached >= 2:
            found.append(tree)
    return found


def _trimmed(
    chain: list[int], start: int, inside: set[int], neighbours: Sequence[set[int]]
) -> list[tuple[int, int]]:
    """The longest piece of `chain` around `start` that touches `inside` only through `start`'s
    link, as (member, parent) pairs growing away from `start`; empty if `start` itself touches
    `inside` twice."""
    at = chain.index(start)
    if len(neighbours[start] & inside) != 1:
        return []
    path = [(start, -1)]
    for step in (-1, 1):
        k = at + step
        while 0 <= k < len(chain) and not (neighbours[chain[k]] & inside):
            path.append((chain[k], chain[k - step]))
            k += step
    return path


def make_blocks(vars: Sequence[Var], shapes: Sequence[list[tuple[int, int]]]) -> list[Block]:
    """Blocks from (member, parent) lists, root first; equal structures share a signature."""
    ids: dict[Any, int] = {}
    blocks = []
    for shape in shapes:
        members = tuple(v for v, _ in shape)
        position = {v: k for k, v in enumerate(members)}
        parents = tuple(position[p] if p >= 0 else -1 for _, p in shape)
        links = tuple(
            tuple((e, e.u == v) for e in vars[v].edges if p >= 0 and {e.u, e.v} == {v, p}) for v, p in shape
        )
        key = (
            tuple(vars[v].key for v in members),
            parents,
            tuple(
                tuple((id(e.table), id(e.out_index), id(e.in_index), up) for e, up in link) for link in links
            ),
        )
        inside = set(members)
        outside = tuple(
            tuple(
                (e, e.v == v, e.u if e.v == v else e.v)
                for e in vars[v].edges
                if (e.u if e.v == v else e.v) not in inside
            )
            for v in members
        )
        scope = tuple(sorted(inside | {other for edges in outside for _, _, other in edges}))
        blocks.append(Block(members, parents, links, ids.setdefault(key, len(ids)), scope, outside))
    return blocks


def sweep(
    blocks: Sequence[Block],
    vars: Sequence[Var],
    memo: dict[Any, np.ndarray],
    tally: Tally,
    clock: Clock,
) -> None:
    """Solve each block in turn, skipping a block when nothing in its scope moved since its last
    solve (it would return its current choices): later sweeps only revisit where moves happened."""
    for block in blocks:
        last = clock.solved.get(id(block))
        if last is not None and all(clock.changed[v] < last for v in block.scope):
            continue
        before = [vars[v].current for v in block.members]
        solve(block, vars, memo, tally)
        for v, was in zip(block.members, before):
            if vars[v].current != was:
                clock.changed[v] = clock.tick()
        clock.solved[id(block)] = clock.tick()


@dataclass
class Clock:
    """When each variable last moved and each block was last solved (one optimize call)."""

    changed: list[int]
    solved: dict[int, int]
    now: int = 0

    @classmethod
    def fresh(cls, n_vars: int) -> Clock:
        return cls([-1] * n_vars, {})

    def tick(self) -> int:
        self.now += 1
        return self.now


def solve(block: Block, vars: Sequence[Var], memo: dict[Any, np.ndarray], tally: Tally) -> None:
    """Set the block's variables to its exact optimum with every other variable held fixed."""
    local = _local(block, vars)
    tally.solves += 1
    digest = hashlib.blake2b(b"".join(vec.tobytes() for vec in local), digest_size=16).digest()
    key = (block.signature, digest)
    choices = memo.get(key)
    if choices is None:
        choices = memo[key] = _tree_dp(block, local)
    else:
        tally.memo_hits += 1
    for v, choice in zip(block.members, choices):
        vars[v].current = int(choice)


def _local(block: Block, vars: Sequence[Var]) -> list[np.ndarray]:
    """Each member's cost per candidate with everything outside the block held fixed."""
    local = []
    for v, outside in zip(block.members, block.outside):
        var = vars[v]
        vec = var.unary.copy()
        vec[var.current] -= 1e-9 * (1.0 + abs(float(vec[var.current])))  # stay put on ties
        for edge, consumer, other in outside:
            vec += (
                edge.for_consumer(vars[other].current) if consumer else edge.for_producer(vars[other].current)
            )
        local.append(vec)
    return local


def _tree_dp(block: Block, local: list[np.ndarray], grouped: bool = True) -> np.ndarray:
    """The block's exact optimum: messages from the leaves to the root, then choices back out.
    A member linked to its parent by one edge (most are) sends its message through the edge's
    small table of distinct layouts (`_grouped_message`; `grouped=False`: through the candidates'
    whole pair matrix, which gives the same choices and sums), or where that is not smaller adds
    its cost to the edge's matrix directly, with no zero-filled pair table (`x + 0.0 == x`); where
    the layouts do not group on the member's side, on the parent's only (`_column_message`)."""
    value = [vec.copy() for vec in local]
    back: list[np.ndarray | None] = [None] * len(local)
    for k in range(len(local) - 1, 0, -1):
        links = block.links[k]
        if len(links) == 1:
            edge, child_is_u = links[0]
            message = _grouped_message(value[k], edge, child_is_u) if grouped else None
            if message is None and grouped:
                message = _column_message(value[k], edge, child_is_u)
            if message is not None:
                back[k], best = message
                value[block.parents[k]] += best
                continue
            matrix = edge.matrix()
            total = value[k][:, None] + (matrix if child_is_u else matrix.T)
        else:
            pair = np.zeros((len(local[k]), len(local[block.parents[k]])))
            for edge, child_is_u in links:
                pair += edge.matrix() if child_is_u else edge.matrix().T
            total = value[k][:, None] + pair
        arg = total.argmin(axis=0)
        back[k] = arg
        value[block.parents[k]] += total[arg, np.arange(total.shape[1])]
    choices = np.zeros(len(local), dtype=np.intp)
    choices[0] = int(value[0].argmin())
    for k in range(1, len(local)):
        arg = back[k]
        assert arg is not None
        choices[k] = arg[choices[block.parents[k]]]
    return choices


# candidate pairs below which the whole matrix is as cheap (and kept: `Edge.matrix`)
GROUPED_FROM = 4096
# a ulp bound, relative to |cost| + the table's largest |entry|: two costs nearer than this may add
# up to the same float with one table entry (then the lower candidate index must win the tie)
_NEAR = 2.0**-50


def _grouped_message(value: np.ndarray, edge: Edge, child_is_u: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """The message of a member linked to its parent by one edge, per parent candidate: the member's
    best candidate (`back`) and the cost it adds, as the pair matrix's column argmin gives them
    (ties: the lowest index), computed on the edge's table of distinct layouts.

    Hundreds of candidates share a few layouts on each side, and an edge's cost depends on a
    candidate only through its layout: the member's cheapest candidate per layout (the lowest index
    among equal costs) is the only one of that layout that can win, so the min over candidates is a
    min over its layouts, and each distinct parent layout is asked once. Adding a table entry is
    monotone, so the sums are the matrix's, bit for bit. One case could pick another index: a
    candidate of lower index whose cost is above its layout's cheapest by less than rounding can
    tell after the addition; there (and where a cost is not finite, or the table is no smaller, or the matrix small) this
    returns None and the caller takes the whole matrix."""
    (rows, row_of), (cols, col_of) = edge.distinct(child_is_u), edge.distinct(not child_is_u)
    pairs = len(row_of) * len(col_of)
    if pairs <= GROUPED_FROM or 2 * len(rows) * len(cols) > pairs or not np.isfinite(value).all():
        return None
    table = edge.table if child_is_u else edge.table.T
    small = table[np.ix_(rows, cols)]
    n = len(value)
    order = np.lexsort((np.arange(n), value, row_of))  # by layout, then cost, then index
    starts = np.flatnonzero(np.diff(row_of[order], prepend=-1))
    best_of = order[starts]  # per distinct layout (in `rows`' order): its cheapest candidate
    best = value[best_of]
    if not (np.isfinite(best).all() and np.isfinite(small).all()):
        return None
    slack = (np.abs(value) + np.abs(small).max(initial=0.0)) * _NEAR
    if np.any((np.arange(n) < best_of[row_of]) & (value - best[row_of] <= slack)):
        return None
    by_index = np.argsort(best_of)  # layouts by their candidate's index: argmin's first is the lowest
    total = best[by_index][:, None] + small[by_index]
    arg = total.argmin(axis=0)
    per_col = total[arg, np.arange(total.shape[1])]
    return best_of[by_index][arg][col_of], per_col[col_of]


def _column_message(
    value: np.ndarray, edge: Edge, child_is_u: bool, smallest: int = CACHED_ENTRIES
) -> tuple[np.ndarray, np.ndarray] | None:
    """The message of a member linked to its parent by one edge, computed once per distinct parent
    layout: parent candidates of one layout read the same column of the pair matrix, so their
    columns of `value[:, None] + matrix` are the same floats and have the same argmin (lowest
    index on ties) and minimum. Exact bit for bit whatever the costs (no rounding argument: the
    member's candidates are all kept), so it serves where `_grouped_message` declines. None where
    the parent's layouts are not fewer than half its candidates, or where the whole matrix has at
    most `smallest` cells: `Edge.matrix` keeps such a matrix for the next solve, which then needs
    no gather at all, where this one would gather its part again."""
    cols, col_of = edge.distinct(not child_is_u)
    if len(value) * len(col_of) <= smallest or 2 * len(cols) > len(col_of):
        return None
    if child_is_u:
        part = edge.table[np.ix_(edge.out_index, cols)]
    else:
        part = edge.table.T[np.ix_(edge.in_index, cols)]
    total = value[:, None] + part
    arg = total.argmin(axis=0)
    return arg[col_of], total[arg, np.arange(len(cols))][col_of]
