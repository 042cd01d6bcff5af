"""What the plan search prices with: element counts (the greedy pass's units) or seconds on a
hardware table, and whole edge tables at once.

The search prices every pair of layouts a producer can hand a consumer: tens of thousands of pairs
per graph, most of them the same pair of placements on tensors of other shapes. Between even
layouts a redistribution's collectives depend only on the placements (`even_steps`), and each
step's block is the source block scaled by the axis sizes passed, so a table is worked out from
the steps of each pair of placements (found once per number of mesh axes, `search_steps`) and the source block's elements,
with the same arithmetic as `redistribute_cost` and `cost.formulas.step_time`: the numbers are
those of pricing each pair alone (tests/test_search_tables.py), only much cheaper.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from autopar.core.layout import Layout, Placement, itemsize, summed
from autopar.core.redistribute import CommStep, plan_redistribute
from autopar.cost.formulas import MeshCost, latency_steps, redistribute_time
from autopar.cost.hardware import Link, Rate, load_hardware
from autopar.planning.greedy import FLOP_WEIGHT, _redist
from autopar.planning.search_steps import StepCache, element_factor, even_steps, instantiate
from autopar.planning.storage import gather_from_storage, storage_layout
from autopar.planning.uneven_steps import UnevenPrograms

# What one collective costs beyond its elements, in element counts: a tie-breaker, 2**-5 of an
# element, so that of two plans moving the same elements the one with fewer collectives wins (one
# all-reduce of a loss's [sum, count] pair against two of 1 number, `rules.decompositions`). It
# must beat the flop term's credit to ops with a pending-sum output (`work_split` divides their
# work over the axis: the pair's `unbind` and division, 3 (1 - 1/g) / 200 elements, at most 0.015)
# and stay far below one element: at 1.0 (ddp15) it flipped plans 8 elements apart, here a plan
# needs 32 collectives more to lose one element. A power of two keeps sums of halves exact.
# gloo's measured per-call cost would be 91,275 (the cpu-gloo table's 1.0 ms `call` at its
# 365.1 MB/s, in float32 elements), but at that price the tests' small shapes plan otherwise
# (test_search_golden's 3-D grid regime, test_search_memory's stored transpose): left open.
CALL_ELEMENTS = 2.0**-5

# per step of a program: elements per block element, num, den, bandwidth, latency plus call, latency
# (latency steps x alpha), call
_FIELDS = 7


class ElementCost:
    """Elements sent per rank plus flops / 200, plus `CALL_ELEMENTS` per collective: the greedy
    pass's units (no hardware table) with a per-call tie-breaker, so that of two plans moving the
    same elements the one with fewer collectives wins (a CPU mesh's default).
    Collectives the schedule stage merges into buckets (`bucketed`: gradient reductions into their
    weights; weight gathers from storage) pay no call each, as `TimeCost.bucketed` pays none.

    `steps`: where pairs of placements keep their steps (`search_steps.StepCache`); the mesh
    choice shares one between the candidates, so each pair is worked out once per number of axes."""

    memory_capacity: float | None = None  # no device, so no default memory limit
    # the busiest rank's routed rows over the mean, charged to every expert split of a routed-experts
    # op (`ring_cost.routed_exchange_cost`): None prices each op at its model's published figure
    # (recorded by the trace, `cost.dispatch.routing_imbalance`); a number overrides it everywhere
    routing_imbalance: float | None = None

    def __init__(
        self, mesh_shape: Sequence[int], steps: StepCache | None = None, flops_per_element: float | None = None
    ) -> None:
        """`flops_per_element`: the flops a rank does in the time it sends one element, which
        weighs compute (repeated work, a causal split's busiest rank) against the elements: None,
        the greedy pass's CPU/gloo-like 200 (`greedy.FLOP_WEIGHT`); `table_flops_per_element`
        gives a hardware table's."""
        self.shape = tuple(mesh_shape)
        self.flop_weight = FLOP_WEIGHT if flops_per_element is None else 1.0 / flops_per_element
        self._templates = (steps if steps is not None else StepCache()).templates(len(self.shape))
        self._placement_ids = self._templates.placement_ids  # codes -> row of the pair tables
        self._lists: dict[tuple[Layout, ...], tuple[np.ndarray, np.ndarray]] = {}  # `_blocks`
        self._programs = np.zeros((0, len(self.shape), _FIELDS))  # per template: its numbers here
        self._uneven = UnevenPrograms(self.shape)  # steps of pairs with an uneven side

    def redistribute(self, src: Layout, dst: Layout) -> float:
        if src == dst:
            return 0.0
        return _redist(src, dst, self.shape) + CALL_ELEMENTS * collective_count(src, dst, self.shape)

    def gather_from_storage(self, want: Layout) -> float:
        """Elements received to build `want` from storage, no call: the schedule stage gathers
        weights in buckets (one call for many weights)."""
        return gather_from_storage(want, self.shape)

    def bucketed(self, src: Layout, dst: Layout) -> float:
        """`redistribute` without the call: a collective the schedule stage merges with many like
        it (gradient reductions into their weights) pays one call per bucket, a small share each."""
        return _redist(src, dst, self.shape)

    def compute(self, work: float, split: int, rate: Rate = torch.float32) -> float:
        return self.flop_weight * work / split  # element counts: every dtype alike

    def ring_shift(self, block: Layout, axis: int) -> tuple[float, float]:
        """(what a block's compute can hide, what it cannot) of passing `block` to the next rank on
        `axis` (ring attention's exchange, `ring_cost.ring_exchange_cost`): in element counts
        nothing overlaps (every collective's elements count whole), so all of it shows, its call too."""
        return 0.0, CommStep("ring_shift", axis, block, block).elements_sent(self.shape) + CALL_ELEMENTS

    def redistribute_table(
        self,
        outs: Sequence[Layout],
        ins: Sequence[Layout],
        rows: np.ndarray | None = None,
        cols: np.ndarray | None = None,
    ) -> np.ndarray:
        """`redistribute` between every pair (rows: `outs`, columns: `ins`, one tensor's layouts),
        or only between `outs[rows]` and `ins[cols]`: from the steps of each pair of placements
        (`search_steps`) between even layouts, from each pair's program per divisibility of the
        shape where a side is uneven (`uneven_steps`: the blocks are recounted at every step; in
        seconds pair by pair); in lists holding an uneven layout the even pairs' steps are
        added up as `redistribute` adds them (`_even_table(exact=True)`). A cell's number does not
        depend on which others are asked for, so a table may be filled piece by piece."""
        n, out_even = self._blocks(outs)
        in_even = self._blocks(ins)[1]
        out_even = out_even & (n > 0)
        even = out_even.all() and in_even.all()  # (the whole lists: a cell's number is its lists')
        if rows is not None:
            outs, n, out_even = [outs[i] for i in rows.tolist()], n[rows], out_even[rows]
        if cols is not None:
            ins, in_even = [ins[j] for j in cols.tolist()], in_even[cols]
        if even:
            return self._even_table(outs, ins, n)
        # lists with uneven layouts: their even pairs from their steps as `redistribute` adds them up
        # (`exact`), the others pair by pair
        table = np.empty((len(outs), len(ins)))
        at_rows, at_cols = np.flatnonzero(out_even), np.flatnonzero(in_even)
        if len(at_rows) and len(at_cols):
            table[np.ix_(at_rows, at_cols)] = self._even_table(
                [outs[i] for i in at_rows.tolist()], [ins[j] for j in at_cols.tolist()], n[at_rows], exact=True
            )
        uneven_rows, uneven_cols = np.nonzero(~out_even[:, None] | ~in_even[None, :])
        if len(uneven_rows):
            table[uneven_rows, uneven_cols] = self._uneven_cells(outs, ins, n, uneven_rows, uneven_cols)
        return table

    def _uneven_cells(
        self, outs: Sequence[Layout], ins: Sequence[Layout], n: np.ndarray, rows: np.ndarray, cols: np.ndarray
    ) -> np.ndarray:
        """`redistribute(outs[i], ins[j])` for the cells (i, j) of `rows`, `cols` with an uneven
        side: from the programs of their placements (`uneven_steps`), each step's block recounted,
        added up as `redistribute` adds them (its elements, then a call per collective)."""
        elements, calls = self._uneven.price(outs, ins, n, rows, cols)
        return elements + CALL_ELEMENTS * calls

    def _even_table(self, outs: Sequence[Layout], ins: Sequence[Layout], n: np.ndarray, exact: bool = False) -> np.ndarray:
        """`redistribute_table` between even layouts (`n`: the source blocks' elements, none 0) from
        their placements' steps. `exact`: each step's seconds added up in `redistribute`'s order
        (`TimeCost._step_cost`), so the cells are its numbers bit for bit, as pricing pair by pair
        gives them in a table with uneven layouts."""
        templates = self._templates
        which = templates.programs(
            templates.ids([lay.placements for lay in outs]), templates.ids([lay.placements for lay in ins])
        )
        # each (block size, program) once: a table has few of either
        blocks, block_of = np.unique(n, return_inverse=True)
        used, program_of = _distinct(which)
        if used[-1] >= len(self._programs):
            self._add_programs(len(templates.templates))
        programs = self._programs[used]  # programs x steps x fields
        value = np.zeros((len(blocks), len(used)))
        for k in range(programs.shape[1]):  # step by step, in order: the sums of pricing alone
            step = programs[None, :, k]
            elements = step[..., 0] * (blocks[:, None] * step[..., 1] / step[..., 2])
            value = value + self._step_cost(elements, step, outs[0], exact)
        value = value + self._calls(programs)  # (after the elements, as `redistribute` adds it)
        return value[block_of.reshape(-1, 1), program_of.reshape(which.shape)]

    def _calls(self, programs: np.ndarray) -> np.ndarray:
        """`CALL_ELEMENTS` per collective of each program (its steps that send: unused steps are
        zeros), as `redistribute` adds it."""
        return CALL_ELEMENTS * (programs[..., 0] > 0).sum(axis=1)

    def _step_cost(self, elements: np.ndarray, step: np.ndarray, layout: Layout, exact: bool) -> np.ndarray:
        return elements

    def _blocks(self, layouts: Sequence[Layout]) -> tuple[np.ndarray, np.ndarray]:
        """(local elements of each layout, whether each is even), once per list of layouts."""
        key = tuple(layouts)
        found = self._lists.get(key)
        if found is None:
            n = np.array([lay.local_numel(self.shape) for lay in layouts], dtype=float)
            even = np.array([lay.is_even(self.shape) for lay in layouts], dtype=bool)
            found = self._lists[key] = (n, even)
        return found

    def _link(self, axis: int) -> tuple[float, float, float]:
        """(bandwidth, alpha, call) of a collective step on `axis`: none for element counts."""
        return 1.0, 0.0, 0.0

    def _add_programs(self, upto: int) -> None:
        """Numbers for templates up to `upto`: per step its element factor (the arithmetic of
        `CommStep.elements_sent`), block scale and link; unused steps price 0."""
        start = len(self._programs)
        steps = [instantiate(template, self.shape) for template in self._templates.templates[start:upto]]
        # a step per axis at most, but for a load-balanced split gathered and cut again on an axis
        # that also reduce-scatters into it (`(Sb(0), P) -> (S(0), S(0))`: three steps on two axes)
        width = max([self._programs.shape[1], *map(len, steps)])
        if width > self._programs.shape[1]:
            wider = np.zeros((start, width, _FIELDS))
            wider[:, :, 2:4] = 1.0
            wider[:, : self._programs.shape[1]] = self._programs
            self._programs = wider
        rows = np.zeros((upto - start, width, _FIELDS))
        rows[:, :, 2:4] = 1.0  # unused steps: nothing sent, den 1, bandwidth 1
        for i, program in enumerate(steps):
            for k, (kind, a, num, den) in enumerate(program):
                g = self.shape[a]
                bandwidth, alpha, call = self._link(a)
                latency = latency_steps(kind, g) * alpha
                rows[i, k] = (element_factor(kind, g), num, den, bandwidth, latency + call, latency, call)
        self._programs = np.concatenate([self._programs, rows])


class TimeCost(ElementCost):
    """Seconds per step on a hardware table: alpha-beta collectives on each axis's link (intra- or
    inter-node) and roofline compute, via `autopar.cost`."""

    def __init__(
        self, hardware: Any, mesh_shape: Sequence[int], in_process: int = 0, steps: StepCache | None = None
    ) -> None:
        """`in_process`: trailing axes of batch chunks (`Mesh.in_process`), priced as memory copies."""
        hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
        self.mesh = MeshCost.build(hw, mesh_shape, in_process)
        self._bulk_links = tuple(Link(0.0, link.bandwidth, link.name) for link in self.mesh.links)
        # a rank's memory: the device's, or the machine's over its local ranks (a CPU table)
        self.memory_capacity = hw.rank_memory(math.prod(tuple(mesh_shape)[: len(mesh_shape) - in_process]))
        super().__init__(mesh_shape, steps)

    def redistribute(self, src: Layout, dst: Layout) -> float:
        return self.mesh.redistribute(src, dst) if src != dst else 0.0

    def bucketed(self, src: Layout, dst: Layout) -> float:
        """`redistribute` at bandwidth only: a collective that the schedule stage merges into a
        bucket with many like it (gradient reductions into their weights) pays its latency and
        its call once per bucket, a small share per weight."""
        if src == dst:
            return 0.0
        return redistribute_time(src, dst, self.shape, self._bulk_links)

    def gather_from_storage(self, want: Layout) -> float:
        return self.redistribute(storage_layout(want, self.shape), summed(want))

    def compute(self, work: float, split: int, rate: Rate = torch.float32) -> float:
        """`work` divided over `split` ranks at its rate (`cost.work.compute_rate`): bfloat16
        matmuls at the tensor-core rate, float32 at the vector rate, element-wise ops by their
        bytes where the table has measured kernel rates."""
        return self.mesh.compute(work / split, 0.0, rate)

    def ring_shift(self, block: Layout, axis: int) -> tuple[float, float]:
        """Passing `block` to the next rank on `axis`, priced as `formulas.step_time` prices the
        emitted step: its bytes over the link and one message's latency, which compute can hide,
        and the link's own time on the rank (`Link.call`), which it cannot."""
        link = self.mesh.links[axis]
        sent = CommStep("ring_shift", axis, block, block).bytes_sent(self.shape)
        return sent / link.bandwidth + link.alpha, link.call

    def _link(self, axis: int) -> tuple[float, float, float]:
        link = self.mesh.links[axis]
        return link.bandwidth, link.alpha, link.call

    def _uneven_cells(
        self, outs: Sequence[Layout], ins: Sequence[Layout], n: np.ndarray, rows: np.ndarray, cols: np.ndarray
    ) -> np.ndarray:
        """Pair by pair: seconds add each step's latency and call beside its bytes
        (`formulas.redistribute_time`), which the element programs do not carry."""
        return np.array([self.redistribute(outs[i], ins[j]) for i, j in zip(rows.tolist(), cols.tolist())])

    def _calls(self, programs: np.ndarray) -> np.ndarray:
        return np.zeros(programs.shape[0])  # each step's latency and call are in `_step_cost`

    def _step_cost(self, elements: np.ndarray, step: np.ndarray, layout: Layout, exact: bool) -> np.ndarray:
        # `formulas.step_time`: bytes sent / bandwidth + latency steps * alpha + the call's own time
        # (`exact`: added in its order; else the latency and the call as one term, as the even
        # tables have always been priced: the same to a few ulps)
        sent = elements * itemsize(layout.dtype) / step[..., 3]
        return sent + step[..., 5] + step[..., 6] if exact else sent + step[..., 4]


def table_flops_per_element(hardware: Any, dtype: torch.dtype = torch.bfloat16) -> float:
    """The flops a rank of `hardware` (a table or its name) does in the time it sends one element
    of `dtype` on its fastest link: a large matmul's time at the table's rate for `dtype` (the
    calibrated fraction of the peak where the table has measured kernels) against the element's
    bytes at the intra-node bandwidth. The flop weight of element counts that stand for that
    machine: h100-calibrated, bfloat16: ~3,800 (the greedy pass's default is 200, CPU/gloo-like)."""
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    flops = 2.0 * 8192**3  # a matmul large enough to run at the table's sustained rate
    seconds = MeshCost.build(hw, (1,)).compute(flops, 0.0, dtype)
    return flops / seconds * itemsize(dtype) / hw.intra_node.bandwidth


@functools.lru_cache(maxsize=200_000)
def collective_count(src: Layout, dst: Layout, mesh_shape: tuple[int, ...]) -> int:
    """How many collectives `redistribute(src, dst)` issues (its steps; a local slice is none)."""
    if src.shape == dst.shape and src.is_even(mesh_shape) and dst.is_even(mesh_shape):
        return len(even_steps(src.placements, dst.placements, mesh_shape))
    return sum(step.is_collective for step in plan_redistribute(src, dst, mesh_shape))


def _distinct(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(ids, return_inverse=True)` of small non-negative ids (template ids), without the
    sort: a table of a four-axis mesh has ~10^5 pairs and a few hundred programs."""
    if ids.size == 0:
        return np.unique(ids, return_inverse=True)
    present = np.zeros(int(ids.max()) + 1, dtype=bool)
    present[ids.ravel()] = True
    return np.flatnonzero(present), (np.cumsum(present) - 1)[ids]


def even_factor(src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]) -> float:
    """Elements `redistribute_cost(src, dst)` sends per element of the source block (even layouts)."""
    total = 0.0
    for kind, a, num, den in even_steps(src, dst, mesh_shape):
        total += element_factor(kind, mesh_shape[a]) * (num / den)
    return total
