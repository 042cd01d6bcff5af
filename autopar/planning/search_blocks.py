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

from autopar.planning.search_vars import Edge, Tally, Var


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


def _tree_dp(block: Block, local: list[np.ndarray]) -> np.ndarray:
    """The block's exact optimum: messages from the leaves to the root, then choices back out.
    A member linked to its parent by one edge (most are) adds its cost to the edge's matrix
    directly, with no zero-filled pair table: on 512 x 512 tables the extra pass was a third of
    the search's dynamic program, and adding to zeros changes no sum (`x + 0.0 == x`)."""
    value = [vec.copy() for vec in local]
    back: list[np.ndarray | None] = [None] * len(local)
    for k in range(len(local) - 1, 0, -1):
        links = block.links[k]
        if len(links) == 1:
            edge, child_is_u = links[0]
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
