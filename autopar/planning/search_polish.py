"""One-op moves priced as insert_comm emits them: each (value, wanted layout) redistributed once.

The search's block moves minimize a pairwise objective (`search_problem.Problem`): every edge
from a producer to a reader pays its own redistribution, or, in the second round, 1/k of it for a
value read by k ops of one phase. Neither is what the program pays where a value's readers want
different layouts: the first round charges a layout that two readers share twice, the second
charges a layout that only one of three readers wants a third. On a GPT at h = 4096 over 1x2x4 the
second round gathers attn.proj's output gradient over y (8.4 M elements, priced 2.8 M: three
backward ops read it, the other two where it lies) and exchanges the weight (4.2 M) to get an
input gradient split by heads, where a pending input gradient reduce-scattered into heads (8.4 M)
needs neither.

`polish` moves one op at a time to its candidate that lowers the objective counted once per
(producer output, wanted layout), the count `plan_cost` makes, until no op moves. It reads the
problem's own candidates, unary costs and edge tables (undoing the second round's 1/k), so it
costs a few table lookups per candidate and reader. Its plan is one more option of the search,
compared with the others by `plan_cost`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from autopar.core.layout import Layout
from autopar.planning.search_problem import Problem
from autopar.planning.search_vars import Edge

POLISH_SWEEPS = 4


def polish(problem: Problem, max_sweeps: int = POLISH_SWEEPS) -> bool:
    """Move single ops of `problem` (in place) while the once-per-layout objective falls.
    Returns whether anything moved."""
    groups = _reader_groups(problem)
    touching: list[list[int]] = [[] for _ in problem.vars]  # per var: the groups it reads or feeds
    for g, edges in enumerate(groups):
        for op in {edges[0].u, *(e.v for e in edges)}:
            touching[op].append(g)
    moved = False
    for _ in range(max_sweeps):
        moves = 0
        for v, var in enumerate(problem.vars):
            if len(var.cands) < 2 or not touching[v]:
                continue
            mine = [groups[g] for g in touching[v]]
            current = var.current
            now = float(var.unary[current]) + sum(_group_cost(problem, edges, {}) for edges in mine)
            best, best_value = current, now
            for c in range(len(var.cands)):
                if c == current:
                    continue
                value = float(var.unary[c])
                if value >= best_value:
                    continue
                value += sum(_group_cost(problem, edges, {v: c}) for edges in mine)
                if value < best_value:
                    best, best_value = c, value
            if best != current and best_value < now - 1e-9 * max(1.0, abs(now)):
                var.current = best
                moves += 1
        if not moves:
            break
        moved = True
    return moved


def _reader_groups(problem: Problem) -> list[list[Edge]]:
    """The edges that read one producer layout (an output of an op, or an input it laid out), in
    the problem's order: the edges of one `Problem._layouts` index array."""
    by_source: dict[tuple[int, int], list[Edge]] = {}
    for edge in problem.edges:
        by_source.setdefault((edge.u, id(edge.out_index)), []).append(edge)
    return list(by_source.values())


def _group_cost(problem: Problem, edges: list[Edge], trial: Mapping[int, int]) -> float:
    """One producer layout's redistributions, once per distinct wanted layout, with the ops in
    `trial` at the given candidates and every other at its current one."""
    vars_ = problem.vars
    u = edges[0].u
    cu = trial.get(u, vars_[u].current)
    made: dict[Layout, float] = {}
    for edge in edges:
        cv = trial.get(edge.v, vars_[edge.v].current)
        col = int(edge.in_index[cv])
        pairs = edge.pairs
        assert pairs is not None, "an edge is read after Problem._fill"
        want = pairs.wanted(col)
        if want in made:
            continue
        cell = float(edge.table[edge.out_index[cu], col])
        made[want] = math.inf if np.isnan(cell) else cell * pairs.share
    return sum(made.values())
