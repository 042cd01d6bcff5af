"""What the plan search prices with: element counts (the greedy pass's units) or seconds on a
hardware table, and whole edge tables at once.

The search prices every pair of layouts a producer can hand a consumer: tens of thousands of pairs
per graph, most of them the same pair of placements on tensors of other shapes. Between even
layouts a redistribution's collectives depend only on the placements (`even_steps`), and each
step's block is the source block scaled by the axis sizes passed, so a table is worked out from
the steps of each pair of placements (found once per search) and the source block's elements,
with the same arithmetic as `redistribute_cost` and `cost.formulas.step_time`: the numbers are
those of pricing each pair alone (tests/test_search_tables.py), only much cheaper.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from autopar.core.layout import Layout, Partial, Placement, Shard, itemsize
from autopar.core.redistribute import exchanges_before
from autopar.cost.formulas import MeshCost, latency_steps
from autopar.cost.hardware import load_hardware
from autopar.planning.greedy import FLOP_WEIGHT, _redist
from autopar.planning.search_problem import settled
from autopar.planning.storage import gather_from_storage, storage_layout

# A step of `even_steps`: (kind, mesh axis, num, den): its block has `n * num / den` elements
# when the source block has n.
Step = tuple[str, int, int, int]
_FIELDS = 5  # per step of a program: elements per block element, num, den, bandwidth, latency


class ElementCost:
    """Elements sent per rank plus flops / 200: the greedy pass's units (no hardware table)."""

    memory_capacity: float | None = None  # no device, so no default memory limit

    def __init__(self, mesh_shape: Sequence[int]) -> None:
        self.shape = tuple(mesh_shape)
        self._placement_ids: dict[tuple[Placement, ...], int] = {}
        self._coded: list[tuple[int, ...]] = []  # per placement id, `_codes`
        self._lists: dict[tuple[Layout, ...], tuple[np.ndarray, bool]] = {}  # `_blocks`
        self._program_of = np.full((0, 0), -1, dtype=np.intp)  # per pair of placements; -1: not yet
        self._program_ids: dict[tuple[Step, ...], int] = {}
        self._programs = np.zeros((0, len(self.shape), _FIELDS))

    def redistribute(self, src: Layout, dst: Layout) -> float:
        return _redist(src, dst, self.shape)

    def gather_from_storage(self, want: Layout) -> float:
        return gather_from_storage(want, self.shape)

    def compute(self, work: float, split: int, dtype: torch.dtype = torch.float32) -> float:
        return FLOP_WEIGHT * work / split  # element counts: every dtype alike

    def redistribute_table(self, outs: Sequence[Layout], ins: Sequence[Layout]) -> np.ndarray:
        """`redistribute` between every pair (rows: `outs`, columns: `ins`, one tensor's layouts):
        from the steps of each pair of placements (`even_steps`) between even layouts, pair by
        pair otherwise (uneven blocks are recounted at every step)."""
        n, even_outs = self._blocks(outs)
        if not (even_outs and n.all() and self._blocks(ins)[1]):
            return np.array([[self.redistribute(o, w) for w in ins] for o in outs], dtype=float).reshape(
                len(outs), len(ins)
            )
        rows, cols = self._ids(outs), self._ids(ins)
        which = self._program_of[np.ix_(rows, cols)]
        new_i, new_j = np.nonzero(which < 0)
        if len(new_i):  # pairs of placements not met before in this search
            coded, shape = self._coded, self.shape
            found = [
                self._program(_coded_steps(coded[r], coded[c], shape))
                for r, c in zip(rows[new_i].tolist(), cols[new_j].tolist())
            ]
            which[new_i, new_j] = self._program_of[rows[new_i], cols[new_j]] = found
        # each (block size, program) once: a table has few of either
        blocks, block_of = np.unique(n, return_inverse=True)
        used, program_of = np.unique(which, return_inverse=True)
        programs = self._programs[used]  # programs x steps x fields
        value = np.zeros((len(blocks), len(used)))
        for k in range(programs.shape[1]):  # step by step, in order: the sums of pricing alone
            step = programs[None, :, k]
            elements = step[..., 0] * (blocks[:, None] * step[..., 1] / step[..., 2])
            value = value + self._step_cost(elements, step, outs[0])
        return value[block_of.reshape(-1, 1), program_of.reshape(which.shape)]

    def _step_cost(self, elements: np.ndarray, step: np.ndarray, layout: Layout) -> np.ndarray:
        return elements

    def _blocks(self, layouts: Sequence[Layout]) -> tuple[np.ndarray, bool]:
        """(local elements of each layout, whether all are even), once per list of layouts."""
        key = tuple(layouts)
        found = self._lists.get(key)
        if found is None:
            n = np.array([lay.local_numel(self.shape) for lay in layouts], dtype=float)
            found = self._lists[key] = (n, all(lay.is_even(self.shape) for lay in layouts))
        return found

    def _link(self, axis: int) -> tuple[float, float]:
        """(bandwidth, alpha) of a collective step on `axis`: none for element counts."""
        return 1.0, 0.0

    def _program(self, steps: Sequence[Step]) -> int:
        """The row of `_programs` for these steps: per step its element factor (the arithmetic of
        `CommStep.elements_sent`), block scale and link; unused steps price 0."""
        key = tuple(steps)
        found = self._program_ids.get(key)
        if found is not None:
            return found
        rows = np.zeros((len(self.shape), _FIELDS))
        rows[:, 2:4] = 1.0  # unused steps: nothing sent, den 1, bandwidth 1
        for k, (kind, a, num, den) in enumerate(steps):
            g = self.shape[a]
            bandwidth, alpha = self._link(a)
            rows[k] = (_element_factor(kind, g), num, den, bandwidth, latency_steps(kind, g) * alpha)
        found = self._program_ids[key] = len(self._program_ids)
        self._programs = np.concatenate([self._programs, rows[None]])
        return found

    def _id(self, placements: tuple[Placement, ...]) -> int:
        found = self._placement_ids.get(placements)
        if found is None:
            found = self._placement_ids[placements] = len(self._coded)
            self._coded.append(_codes(placements))
        return found

    def _ids(self, layouts: Sequence[Layout]) -> np.ndarray:
        """Rows / columns of `_program_of`: the steps depend only on which axes split which dims
        (and sum), so tensors of any rank with the same placements share them."""
        ids = np.array([self._id(lay.placements) for lay in layouts], dtype=np.intp)
        size = len(self._program_of)
        if len(self._placement_ids) > size:  # grow, keeping the pairs found so far
            grown = np.full((2 * len(self._placement_ids),) * 2, -1, dtype=np.intp)
            grown[:size, :size] = self._program_of
            self._program_of = grown
        return ids


class TimeCost(ElementCost):
    """Seconds per step on a hardware table: alpha-beta collectives on each axis's link (intra- or
    inter-node) and roofline compute, via `autopar.cost`."""

    def __init__(self, hardware: Any, mesh_shape: Sequence[int], in_process: int = 0) -> None:
        """`in_process`: trailing axes of batch chunks (`Mesh.in_process`), priced as memory copies."""
        hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
        self.mesh = MeshCost.build(hw, mesh_shape, in_process)
        self.memory_capacity = hw.memory_capacity
        super().__init__(mesh_shape)

    def redistribute(self, src: Layout, dst: Layout) -> float:
        return self.mesh.redistribute(src, dst) if src != dst else 0.0

    def gather_from_storage(self, want: Layout) -> float:
        return self.redistribute(storage_layout(want, self.shape), settled(want))

    def compute(self, work: float, split: int, dtype: torch.dtype = torch.float32) -> float:
        """At the table's peak for `dtype` (`cost.work.compute_dtype`): bfloat16 matmuls run at
        the tensor-core rate, float32 at the vector rate."""
        return self.mesh.compute(work / split, 0.0, dtype)

    def _link(self, axis: int) -> tuple[float, float]:
        link = self.mesh.links[axis]
        return link.bandwidth, link.alpha

    def _step_cost(self, elements: np.ndarray, step: np.ndarray, layout: Layout) -> np.ndarray:
        # `formulas.step_time`: bytes sent / bandwidth + latency steps * alpha
        return elements * itemsize(layout.dtype) / step[..., 3] + step[..., 4]


REPLICATE, PARTIAL = -2, -1  # per-axis codes of `_codes`; a dim d >= 0 is Shard(d)


def even_steps(src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]) -> tuple[Step, ...]:
    """The collectives of `plan_redistribute(src, dst)` on placements alone, for even layouts of
    any tensor, on axes of more than one rank: (kind, axis, num, den), the step's block being the
    source block times num / den. Even blocks stay even through every step, so every all_to_all
    moves equal blocks; the three phases are `redistribute_cost`'s."""
    return _coded_steps(_codes(src), _codes(dst), tuple(mesh_shape))


def _codes(placements: Sequence[Placement]) -> tuple[int, ...]:
    return tuple(
        p.dim if isinstance(p, Shard) else PARTIAL if isinstance(p, Partial) else REPLICATE for p in placements
    )


def _coded_steps(src: tuple[int, ...], dst: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[Step, ...]:
    """`even_steps` on per-axis codes (a dim, `PARTIAL` or `REPLICATE`): the planner prices tens
    of thousands of pairs, so this runs on small ints."""
    if src == dst:
        return ()
    have = {d: list(axes) for d, axes in _by_dim(src).items()}
    want = _by_dim(dst)
    num = den = 1
    steps: list[Step] = []
    if PARTIAL in src:  # 1. pending sums: reduce-scatter into the target split if it nests
        for a, c in enumerate(src):
            t = dst[a]
            if c != PARTIAL or t == PARTIAL:
                continue
            if t >= 0:  # move the axes nesting outside `a` there first (even: no shape check)
                for b, home in exchanges_before(have, a, want.get(t, ()), t):
                    have[home].pop()
                    have.setdefault(t, []).append(b)
                    if mesh_shape[b] > 1:
                        steps.append(("all_to_all", b, num, den))
            if t >= 0 and _extends(have.get(t, ()), a, want.get(t, ())):
                if mesh_shape[a] > 1:
                    steps.append(("reduce_scatter", a, num, den))
                have.setdefault(t, []).append(a)
                den *= mesh_shape[a]
            elif mesh_shape[a] > 1:
                steps.append(("all_reduce", a, num, den))
    for d in range(1 + max((*have, *want), default=-1)):  # 2. un-shard each dim to its kept prefix
        axes = have.get(d)
        if not axes:
            continue
        kept = want.get(d, ())
        keep = 0
        while keep < len(axes) and keep < len(kept) and axes[keep] == kept[keep]:
            keep += 1
        for a in reversed(axes[keep:]):
            t = dst[a]
            axes.pop()
            if t >= 0 and t != d:
                there = have.get(t, ())
                if (not there or there[-1] < a) and _extends(there, a, want.get(t, ())):
                    if mesh_shape[a] > 1:
                        steps.append(("all_to_all", a, num, den))
                    have.setdefault(t, []).append(a)
                    continue
            if mesh_shape[a] > 1:
                steps.append(("all_gather", a, num, den))
            num *= mesh_shape[a]
    return tuple(steps)  # 3. slicing and zeroing replicas send nothing


@functools.lru_cache(maxsize=4096)
def _by_dim(codes: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """Mesh axes splitting each dim, outermost first (`Layout.shard_axes`). Callers only read it."""
    out: dict[int, list[int]] = {}
    for a, c in enumerate(codes):
        if c >= 0:
            out.setdefault(c, []).append(a)
    return {d: tuple(axes) for d, axes in out.items()}


def _extends(axes: Sequence[int], a: int, full: Sequence[int]) -> bool:
    """Whether `axes` then `a` is a prefix of `full` (the split nests as the target's does)."""
    n = len(axes)
    return n < len(full) and full[n] == a and all(x == y for x, y in zip(axes, full))


def even_factor(src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]) -> float:
    """Elements `redistribute_cost(src, dst)` sends per element of the source block (even layouts)."""
    total = 0.0
    for kind, a, num, den in even_steps(src, dst, mesh_shape):
        total += _element_factor(kind, mesh_shape[a]) * (num / den)
    return total


def _element_factor(kind: str, g: int) -> float:
    """Elements a rank sends per element of its block (`CommStep.elements_sent`)."""
    if kind == "all_gather":
        return float(g - 1)
    return 2 * (g - 1) / g if kind == "all_reduce" else (g - 1) / g
