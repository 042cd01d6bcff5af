"""The collectives between uneven layouts, worked out once per pair of placements and divisibility,
priced for every tensor size in arrays.

Between layouts whose blocks do not all have the same size (`torch.chunk` blocks), the search used
to price pair by pair through `redistribute_cost` (~15 us a pair): the zoo's Qwen3Next at toy
sizes on (2, 2, 2) asks ~1.5 M such pairs. But which steps `plan_redistribute` takes depends on
the tensor's size only through which of its dim sizes the products of mesh axis sizes divide (an
all-to-all needs even blocks, `_even_exchange`; a reduce-scatter before an exchange, `_reduce_first`),
and each step's block is the rounded-up block of the layout before it (`redistribute_cost`
recounts it at every step). So a pair of placements has one program per divisibility signature of
the shape (`signature`): per step the elements a rank sends per element of its block, and each
dim's split before the step. There Qwen3Next's pairs reduce to ~0.1 M programs, each worked out
once; a table's cells are then the programs' sums over their steps, each block recounted from the
table's shape, with `redistribute_cost`'s arithmetic in its order: the numbers of pricing each pair
alone, bit for bit (tests/test_uneven_steps.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from autopar.core.layout import Layout, Placement, Shard
from autopar.core.redistribute import FORBIDDEN_FACTOR, plan_redistribute

# A signature: per dim of the tensor, whether each product of mesh axis sizes divides its size.
Signature = tuple[tuple[bool, ...], ...]


def _factor(kind: str, g: int) -> float:
    """Elements a rank sends per element of its block (`redistribute_cost`'s arithmetic)."""
    if kind == "all_gather":
        return float(g - 1)
    return 2 * (g - 1) / g if kind == "all_reduce" else (g - 1) / g


def splits(placements: Sequence[Placement], ndim: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """How many blocks each dim is cut into (the product of the sizes of the axes splitting it)."""
    out = [1] * ndim
    for g, p in zip(mesh_shape, placements):
        if isinstance(p, Shard):
            out[p.dim] *= g
    return tuple(out)


class _Pairs:
    """The programs of one signature's pairs: placements -> ids, and per pair of ids its program
    (-1: not met yet), grown as placements are met."""

    def __init__(self) -> None:
        self.ids: dict[tuple[Placement, ...], int] = {}
        self.program_of = np.full((0, 0), -1, dtype=np.intp)

    def place(self, layouts: Sequence[Layout]) -> np.ndarray:
        ids = self.ids
        out = np.array([ids.setdefault(lay.placements, len(ids)) for lay in layouts], dtype=np.intp)
        if len(ids) > len(self.program_of):
            grown = np.full((2 * len(ids),) * 2, -1, dtype=np.intp)
            grown[: len(self.program_of), : len(self.program_of)] = self.program_of
            self.program_of = grown
        return out


class UnevenPrograms:
    """Programs of uneven pairs on one mesh: per pair of placements and `signature`, the factor of
    each collective step and the splits of the layout it starts from, kept in arrays padded with
    steps that send nothing (factor 0, splits 1) so that a table's cells are priced together."""

    def __init__(self, mesh_shape: Sequence[int]) -> None:
        self.shape = tuple(mesh_shape)
        sizes = {math.prod(c) for k in range(len(self.shape) + 1) for c in itertools.combinations(self.shape, k)}
        self._divisors = tuple(sorted(sizes))  # every product of axis sizes a step may divide by
        self._signatures: dict[tuple[int, ...], Signature] = {}
        self._pairs: dict[Signature, _Pairs] = {}
        self._ids: dict[tuple[object, ...], int] = {}  # a program's contents -> its id
        self.count = 0  # programs; the arrays below hold room for more (grown by doubling)
        self.factor = np.zeros((16, 1))  # programs x steps
        self.split = np.ones((16, 1, 1), dtype=np.int64)  # programs x steps x dims
        self.calls = np.zeros(16, dtype=np.int64)  # collectives of each program
        self.forbidden = np.zeros(16, dtype=np.int64)  # "forbidden" steps (no other step then)
        self.worked_out = 0  # pairs (of placements, per signature) worked out through plan_redistribute

    def signature(self, shape: tuple[int, ...]) -> Signature:
        found = self._signatures.get(shape)
        if found is None:
            found = self._signatures[shape] = tuple(tuple(s % f == 0 for f in self._divisors) for s in shape)
        return found

    def price(
        self, outs: Sequence[Layout], ins: Sequence[Layout], n: np.ndarray, rows: np.ndarray, cols: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(elements sent, collectives) of `redistribute_cost(outs[i], ins[j])` for each cell (i, j)
        of `rows`, `cols`: the layouts of one tensor (one shape), `n` the blocks of `outs`."""
        shape = outs[0].shape
        if any(lay.shape != shape for lay in (*outs, *ins)):
            raise ValueError(f"one table prices the layouts of one shape, not {shape} and others")
        sig = self.signature(shape)
        pairs = self._pairs.get(sig)
        if pairs is None:
            pairs = self._pairs[sig] = _Pairs()
        out_ids, in_ids = pairs.place(outs), pairs.place(ins)
        which = pairs.program_of
        program = which[out_ids[rows], in_ids[cols]]
        for k in np.flatnonzero(program < 0).tolist():
            i, j = int(rows[k]), int(cols[k])
            found = which[out_ids[i], in_ids[j]]
            if found < 0:
                found = which[out_ids[i], in_ids[j]] = self._work_out(outs[i], ins[j])
            program[k] = found
        used, back = np.unique(program, return_inverse=True)
        value = self._sums(used, shape)[back.reshape(-1)]
        forbidden = self.forbidden[program]
        if forbidden.any():  # `redistribute_cost`: FORBIDDEN_FACTOR elements per block element per axis
            at = np.flatnonzero(forbidden)
            value[at] = FORBIDDEN_FACTOR * n[rows[at]] * forbidden[at]
        return value, self.calls[program]

    def _sums(self, used: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Each program's elements on a tensor of `shape`: its steps' blocks recounted (rounded up
        per dim) and added in order, as `redistribute_cost` adds them."""
        ndim = len(shape)
        split = self.split[used][..., :ndim]  # programs x steps x dims
        sizes = np.array(shape, dtype=np.int64)
        blocks = (-(-sizes // split)).prod(axis=-1).astype(float)  # (no dims: a block of 1)
        factor = self.factor[used]
        value = np.zeros(len(used))
        for k in range(factor.shape[1]):
            value = value + factor[:, k] * blocks[:, k]
        return value

    def _work_out(self, src: Layout, dst: Layout) -> int:
        """The program of `plan_redistribute(src, dst)`: its collectives' factors and splits."""
        self.worked_out += 1
        steps = plan_redistribute(src, dst, self.shape)
        ndim = len(src.shape)
        forbidden = sum(step.kind == "forbidden" for step in steps)
        kept = [] if forbidden else [step for step in steps if step.is_collective]
        factors = tuple(_factor(step.kind, self.shape[step.axis]) for step in kept)
        cuts = tuple(splits(step.before.placements, ndim, self.shape) for step in kept)
        key = (forbidden, ndim, factors, cuts)
        found = self._ids.get(key)
        if found is not None:
            return found
        found = self._ids[key] = self.count
        self._make_room(len(kept), ndim)
        self.factor[found, : len(factors)] = factors
        if cuts:
            self.split[found, : len(cuts), :ndim] = cuts
        self.calls[found] = len(kept)
        self.forbidden[found] = forbidden
        self.count += 1
        return found

    def _make_room(self, steps: int, ndim: int) -> None:
        """Room for one more program of `steps` steps on `ndim` dims (padding: factor 0, splits 1)."""
        rows, width, dims = len(self.calls), self.factor.shape[1], self.split.shape[2]
        if self.count < rows and steps <= width and ndim <= dims:
            return
        rows, width, dims = 2 * rows if self.count == rows else rows, max(width, steps), max(dims, ndim)
        factor = np.zeros((rows, width))
        factor[: len(self.factor), : self.factor.shape[1]] = self.factor
        split = np.ones((rows, width, dims), dtype=np.int64)
        split[: len(self.split), : self.split.shape[1], : self.split.shape[2]] = self.split
        calls, forbidden = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        calls[: len(self.calls)], forbidden[: len(self.forbidden)] = self.calls, self.forbidden
        self.factor, self.split, self.calls, self.forbidden = factor, split, calls, forbidden
