"""The search problem's parts: a variable per decided op, an edge per producer/consumer pair.

`autopar.planning.search_problem` builds them and `autopar.planning.search_blocks` solves blocks of
them; both read these types from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.core.strategy import Strategy

# the largest pair table an edge keeps between solves (float64 entries: 512 KiB)
CACHED_ENTRIES = 1 << 16


@dataclass
class Var:
    name: str
    cands: list[Strategy]
    key: Any  # identifies `cands` (shared by every op with the same candidate list)
    base: np.ndarray  # time cost of each candidate
    unary: np.ndarray  # base plus the memory price
    current: int
    edges: list[Edge] = field(default_factory=list)
    memory: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (bytes, regather cost)


@dataclass
class Edge:
    """Producer u's layout (an output, or an input it laid out) feeding consumer v's input."""

    u: int
    v: int
    table: np.ndarray  # cost between the distinct layouts on each side
    out_index: np.ndarray  # per candidate of u: row of `table`
    in_index: np.ndarray  # per candidate of v: column of `table`
    cached: np.ndarray | None = field(default=None, repr=False)  # `matrix()`, once computed

    def for_consumer(self, u_choice: int) -> np.ndarray:
        return self.table[self.out_index[u_choice], self.in_index]

    def for_producer(self, v_choice: int) -> np.ndarray:
        return self.table[self.out_index, self.in_index[v_choice]]

    def matrix(self) -> np.ndarray:
        """The cost of every (u candidate, v candidate) pair. Kept for the next solve only up to
        `CACHED_ENTRIES`; a larger one is gathered again from the small `table` of distinct
        layouts. Keeping every pair table (up to 512 x 512, 2 MiB each) grew the stage sub-mesh
        choice of Mixtral 8x7B's pipelined job (8 layers, benchmarks/moe_pipelined.py) past 9 GB."""
        if self.cached is not None:
            return self.cached
        matrix = self.table[np.ix_(self.out_index, self.in_index)]
        if matrix.size <= CACHED_ENTRIES:
            self.cached = matrix
        return matrix

    def value(self, u_choice: int, v_choice: int) -> float:
        return float(self.table[self.out_index[u_choice], self.in_index[v_choice]])


@dataclass
class Tally:
    """How much of the work the memoization saved (reported by the search)."""

    solves: int = 0
    memo_hits: int = 0
    distinct_chains: int = 0
