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
from collections.abc import Callable
from typing import Any

import numpy as np

from autopar.core.layout import Layout
from autopar.planning.search_problem import Problem
from autopar.planning.search_vars import Edge, PairTable

POLISH_SWEEPS = 4


def polish(problem: Problem, max_sweeps: int = POLISH_SWEEPS) -> bool:
    """Move single ops of `problem` (in place) while the once-per-layout objective falls.
    Returns whether anything moved.

    Each op takes the candidate of lowest objective (the earliest of equals; the current one on a
    tie with it). A group's cost depends on the op's candidate only through the rows and columns it
    reads, and most of an op's hundreds of candidates share them, so each group is priced once per
    distinct one (`_Group.facing`); a candidate stops being summed once it can no longer win
    (every cost is >= 0). The sums are the same, added in the same order, as pricing every
    candidate in full (`tests/test_search_polish.py` holds it to that).

    An op is evaluated again only when something its objective reads (its groups' producer and
    readers, itself included) moved since its last evaluation: the objective is a function of
    those ops' candidates alone, and an op that did not move and sees the same objective again
    does not move (the same sums, the same ties). After the first sweep only the neighbourhoods of
    the ops that moved are priced again."""
    lists = _Lists()
    groups = [_Group(edges, lists) for edges in _reader_groups(problem)]
    touching: list[list[int]] = [[] for _ in problem.vars]  # per var: the groups it reads or feeds
    for g, group in enumerate(groups):
        for op in {group.u, *group.readers}:
            touching[op].append(g)
    # per op: the ops its objective reads (itself included), when it was last evaluated and when
    # it last moved (`tick` counts evaluations and moves)
    reads = [
        sorted({v, *(x for g in near for x in (groups[g].u, *groups[g].readers))})
        for v, near in enumerate(touching)
    ]
    evaluated, changed = [-1] * len(problem.vars), [-1] * len(problem.vars)
    tick = 0
    current = [var.current for var in problem.vars]
    moved = False
    for _ in range(max_sweeps):
        moves = 0
        for v, var in enumerate(problem.vars):
            if len(var.cands) < 2 or not touching[v]:
                continue
            last = evaluated[v]
            if last >= 0 and all(changed[x] < last for x in reads[v]):
                problem.tally.polish_skipped += 1
                continue  # it would stand where it stands: nothing it reads moved since
            problem.tally.polished += 1
            tick += 1
            evaluated[v] = tick
            mine = [groups[g].facing(v, current) for g in touching[v]]
            unary = var.unary.tolist()
            now = float(unary[current[v]]) + sum(cost(current[v]) for cost in mine)
            best, best_value = current[v], now
            for c in range(len(var.cands)):
                if c == current[v]:
                    continue
                value = float(unary[c])
                if not value < best_value:  # (costs are >= 0: it cannot end lower)
                    continue
                total = 0.0  # as `sum` adds: from 0, in the groups' order
                for cost in mine:
                    total += cost(c)
                    if not value + total < best_value:
                        break
                else:
                    best, best_value = c, value + total
            if best != current[v] and best_value < now - 1e-9 * max(1.0, abs(now)):
                current[v] = var.current = best
                moves += 1
                tick += 1
                changed[v] = tick
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


class _Lists:
    """Index arrays and wanted layouts as plain lists, each converted once per polish (edges share
    their index arrays and pair tables), with one number per distinct layout."""

    def __init__(self) -> None:
        self.arrays: dict[int, list[int]] = {}
        self.wants: dict[int, list[int]] = {}
        self.numbers: dict[Layout, int] = {}

    def of(self, array: np.ndarray) -> list[int]:
        found = self.arrays.get(id(array))
        if found is None:
            found = self.arrays[id(array)] = array.tolist()
        return found

    def wanted(self, pairs: PairTable) -> list[int]:
        """Per column of `pairs`' data: the number of the consumer layout it stands for."""
        found = self.wants.get(id(pairs))
        if found is None:
            numbers = self.numbers
            found = self.wants[id(pairs)] = [
                numbers.setdefault(pairs.ins[i], len(numbers)) for i in pairs.col_layout.tolist()
            ]
        return found


class _Group:
    """One producer layout's edges as plain lists: the producer's row per candidate, and per edge
    its reader, the column per candidate of the reader, its table, and the wanted layout of each
    column as a number (equal layouts, one number)."""

    def __init__(self, edges: list[Edge], lists: _Lists) -> None:
        self.u = edges[0].u
        self.rows = lists.of(edges[0].out_index)  # (one index array for the group)
        self.readers = [edge.v for edge in edges]
        self.cols = [lists.of(edge.in_index) for edge in edges]
        self.tables = [edge.table for edge in edges]
        self.shares: list[int] = []
        self.wants: list[list[int]] = []
        for edge in edges:
            pairs = edge.pairs
            assert pairs is not None, "an edge is read after Problem._fill"
            self.shares.append(pairs.share)
            self.wants.append(lists.wanted(pairs))

    def facing(self, v: int, current: list[int]) -> Callable[[int], float]:
        """The group's cost as a function of op `v`'s candidate, every other op at `current`,
        each distinct (row, columns) priced once."""
        mine = [k for k, reader in enumerate(self.readers) if reader == v]
        producer = self.u == v
        fixed_row = self.rows[current[self.u]]
        fixed_cols = [cols[current[reader]] for cols, reader in zip(self.cols, self.readers)]
        known: dict[Any, float] = {}

        def cost(c: int) -> float:
            row = self.rows[c] if producer else fixed_row
            if len(mine) == 1 and not producer:
                key: Any = self.cols[mine[0]][c]
            else:
                key = (row, *(self.cols[k][c] for k in mine))
            found = known.get(key)
            if found is None:
                cols = list(fixed_cols)
                for k in mine:
                    cols[k] = self.cols[k][c]
                found = known[key] = self._priced(row, cols)
            return found

        return cost

    def _priced(self, row: int, cols: list[int]) -> float:
        """The producer's layout at `row` redistributed once per distinct layout its readers want
        (at `cols`), as `plan_cost` counts it."""
        made: dict[int, float] = {}
        for col, table, want, share in zip(cols, self.tables, self.wants, self.shares):
            wanted = want[col]
            if wanted in made:
                continue
            cell = table.item(row, col)
            made[wanted] = math.inf if math.isnan(cell) else cell * share
        return sum(made.values())
