"""The search problem's parts: a variable per decided op, an edge per producer/consumer pair.

`autopar.planning.search_problem` builds them and `autopar.planning.search_blocks` solves blocks of
them; both read these types from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.core.layout import Layout
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
    # the table `table` is the data of (set by `Problem._fill`): its layout lists and share
    pairs: PairTable | None = field(default=None, repr=False)
    # the pair matrices of the search this edge belongs to (set by `Problem._fill`)
    matrices: SharedMatrices | None = field(default=None, repr=False)

    def for_consumer(self, u_choice: int) -> np.ndarray:
        """The cost of each v candidate with u at `u_choice` (read only: it may be shared)."""
        if self.matrices is None:
            return self.table[self.out_index[u_choice], self.in_index]
        return self.matrices.line(self.table, self.in_index, int(self.out_index[u_choice]), True)

    def for_producer(self, v_choice: int) -> np.ndarray:
        """The cost of each u candidate with v at `v_choice` (read only: it may be shared)."""
        if self.matrices is None:
            return self.table[self.out_index, self.in_index[v_choice]]
        return self.matrices.line(self.table, self.out_index, int(self.in_index[v_choice]), False)

    def matrix(self) -> np.ndarray:
        """The cost of every (u candidate, v candidate) pair. Kept for the next solve only up to
        `CACHED_ENTRIES`; a larger one is gathered again from the small `table` of distinct
        layouts. Keeping every pair table (up to 512 x 512, 2 MiB each) grew the stage sub-mesh
        choice of Mixtral 8x7B's pipelined job (8 layers, benchmarks/moe_pipelined.py) past 9 GB."""
        if self.cached is not None:
            return self.cached
        if self.matrices is not None and len(self.out_index) * len(self.in_index) <= CACHED_ENTRIES:
            self.cached = self.matrices.get(self.table, self.out_index, self.in_index)
            return self.cached
        matrix = self.table[np.ix_(self.out_index, self.in_index)]
        if matrix.size <= CACHED_ENTRIES:
            self.cached = matrix
        return matrix

    def distinct(self, producer: bool) -> tuple[np.ndarray, np.ndarray]:
        """The distinct rows (`producer`) or columns of `table` the candidates read, and each
        candidate's position among them (`np.unique`); worked out once per index array where the
        edge has its `PairTable` (repeated layers share their index arrays)."""
        index = self.out_index if producer else self.in_index
        return self.pairs.distinct(index) if self.pairs is not None else _distinct(index)

    def value(self, u_choice: int, v_choice: int) -> float:
        return float(self.table[self.out_index[u_choice], self.in_index[v_choice]])


class SharedMatrices:
    """The kept pair matrices of one search (`Edge.matrix`), one per (table, producer index,
    consumer index): the edges of repeated layers read one table through the same index arrays
    (`PairTable.compact`, `Problem._pruned_index`), so their matrices are equal, and one copy
    serves them all. With one per edge, the 2x2x2 search of rank 0's mesh choice for
    benchmarks/peers.py's 4-layer GPT set the process's peak: malloc's bytes in use rose from 144
    to 273 MiB in it, 207 with one per distinct matrix (peak RSS 562 -> 495 MiB,
    `benchmarks/setup_memory.py`). Callers only read the matrices."""

    def __init__(self) -> None:
        # keyed by the arrays' ids; the arrays are kept in the value, so no id is reused meanwhile
        self._found: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        # (table, index array, row or column, which) -> (those arrays, the line): `line`
        self._lines: dict[tuple[int, int, int, bool], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def get(self, table: np.ndarray, out_index: np.ndarray, in_index: np.ndarray) -> np.ndarray:
        key = (id(table), id(out_index), id(in_index))
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = (table, out_index, in_index, table[np.ix_(out_index, in_index)])
        return found[3]

    def line(self, table: np.ndarray, index: np.ndarray, at: int, row: bool) -> np.ndarray:
        """`table[at, index]` (`row`) or `table[index, at]`, one read-only copy per (table, index
        array, row or column): a block's solve reads one per edge leaving it (`search_blocks._local`),
        and the edges of repeated layers read the same tables through the same index arrays."""
        key = (id(table), id(index), at, row)
        found = self._lines.get(key)
        if found is None:
            line = table[at, index] if row else table[index, at]
            line.flags.writeable = False
            found = self._lines[key] = (table, index, line)
        return found[2]

    def __len__(self) -> int:
        return len(self._found)


# prices the cells (rows x cols, indices into the two layout lists) of a pair table
PriceCells = Callable[[Sequence[Layout], Sequence[Layout], np.ndarray, np.ndarray], np.ndarray]


class PairTable:
    """The redistribution costs between two layout lists (a producer's side and a consumer's), for
    every edge between them in one search, held compactly: a row per producer layout and a column
    per consumer layout that some kept candidate reads, priced once each.

    The lists are those of the unpruned candidates: on a four-axis mesh thousands of layouts each,
    of which the 512 candidates `Problem._prune` keeps read a few hundred. A full table per pair of
    lists, mostly never priced, held 1.2 GB for a 2-layer Mixtral stage on 2x2x2x2 (226 tables) and
    grew the 8-layer job's (4, 2, 2, 2) search past 2.5 GB (`tests/test_search_tables.py`)."""

    def __init__(self, outs: tuple[Layout, ...], ins: tuple[Layout, ...], share: int) -> None:
        self.outs, self.ins, self.share = outs, ins, share
        self.row_at = np.full(len(outs), -1, dtype=np.intp)  # per layout of `outs`: its row, or -1
        self.col_at = np.full(len(ins), -1, dtype=np.intp)
        self.data = np.empty((0, 0))  # rows x columns in the order they were first wanted; nan: not priced
        self.col_layout = np.empty(0, dtype=np.intp)  # per column of `data`: its index in `ins`
        self.done = np.zeros((0, 0), dtype=bool)
        # id of a full index array -> (that array, kept alive so the id stays its own; its compact one)
        self._compact: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # id of a compact index array -> (that array, kept alive; `_distinct` of it)
        self._distinct: dict[int, tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]] = {}

    def fill(self, out_indices: list[np.ndarray], in_indices: list[np.ndarray], price: PriceCells) -> None:
        """Price every cell the full index arrays can read that is not priced yet. Rows and columns
        only ever get added, so earlier compact indices stay valid; growing makes a new `data`
        array (edges of earlier searches keep the old one, which has every cell they read)."""
        rows, cols = np.unique(np.concatenate(out_indices)), np.unique(np.concatenate(in_indices))
        new_rows, new_cols = rows[self.row_at[rows] < 0], cols[self.col_at[cols] < 0]
        if len(new_rows) or len(new_cols):
            n, m = self.data.shape
            self.row_at[new_rows] = np.arange(n, n + len(new_rows))
            self.col_at[new_cols] = np.arange(m, m + len(new_cols))
            self.col_layout = np.concatenate([self.col_layout, new_cols])
            data = np.full((n + len(new_rows), m + len(new_cols)), np.nan)
            done = np.zeros(data.shape, dtype=bool)
            data[:n, :m], done[:n, :m] = self.data, self.done
            self.data, self.done = data, done
        at_rows, at_cols = self.row_at[rows], self.col_at[cols]
        have = self.done[np.ix_(at_rows, at_cols)]
        if have.all():
            return
        # two blocks, so that no cell is priced twice: the rows none of whose cells are priced
        # (new rows) against every column, then the other rows' missing cells. One block of every
        # row and column with a missing cell re-priced the whole table when a later seed's
        # candidates added a row and a column (uneven tables price pair by pair: on the zoo's
        # Qwen3Next, half the cells priced had been priced before)
        fresh = ~have.any(axis=1)
        if fresh.any():
            self._price(rows[fresh], cols, at_rows[fresh], at_cols, price)
        rest = ~have[~fresh]
        keep_rows, keep_cols = rest.any(axis=1), rest.any(axis=0)
        if keep_rows.any():
            rows, at_rows = rows[~fresh][keep_rows], at_rows[~fresh][keep_rows]
            self._price(rows, cols[keep_cols], at_rows, at_cols[keep_cols], price)

    def _price(self, rows: np.ndarray, cols: np.ndarray, at_rows: np.ndarray, at_cols: np.ndarray, price: PriceCells) -> None:
        self.data[np.ix_(at_rows, at_cols)] = price(self.outs, self.ins, rows, cols) / self.share
        self.done[np.ix_(at_rows, at_cols)] = True

    def wanted(self, column: int) -> Layout:
        """The consumer's layout of a column of `data`."""
        return self.ins[int(self.col_layout[column])]

    def compact(self, index: np.ndarray, side: str) -> np.ndarray:
        """`index` (into the full `outs` or `ins` list, every entry filled) as rows or columns of
        `data`; one array per full one, so blocks of repeated layers keep one signature."""
        key = id(index)
        found = self._compact.get(key)
        if found is None:
            at = self.row_at if side == "out" else self.col_at
            found = self._compact[key] = (index, at[index])
        return found[1]


    def distinct(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`_distinct(index)`, once per index array."""
        found = self._distinct.get(id(index))
        if found is None:
            found = self._distinct[id(index)] = (index, _distinct(index))
        return found[1]


def _distinct(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values, position = np.unique(index, return_inverse=True)
    return values, position.reshape(-1)


@dataclass
class Tally:
    """How much of the work the memoization saved (reported by the search)."""

    solves: int = 0
    memo_hits: int = 0
    distinct_chains: int = 0
    polished: int = 0  # ops the one-op polish priced (`search_polish.polish`)
    polish_skipped: int = 0  # and those it did not price again: nothing they read had moved
