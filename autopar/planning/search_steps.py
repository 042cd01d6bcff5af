"""The collectives between two placements, worked out once for every mesh with as many axes.

The search prices every pair of placements a producer can hand a consumer (about a million pairs on
a four-axis mesh), and the mesh choice searches dozens of meshes. Which collectives a pair needs,
on which axes and in which order, does not depend on the axis sizes: only which steps are dropped
(axes of one rank send nothing) and how big each step's block is (the source block times the sizes
of the axes gathered so far, over those reduce-scattered so far). So a pair's steps are kept as a
template naming those axes (`coded_template`), shared by every mesh of the same number of axes
through `StepTemplates`, and each mesh turns a template into numbers once (`instantiate`). The
numbers are those of `plan_redistribute` on the placements (tests/test_search_tables.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.core.layout import Layout, Partial, Placement, RowDisjoint, Shard, is_balanced
from autopar.core.redistribute import FORBIDDEN_FACTOR, exchanges_ahead, exchanges_before
from autopar.core.strategy import Strategy

# per-axis codes of `codes`; a dim d >= 0 is Shard(d), BALANCED + d the load-balanced split of d
DISJOINT, REPLICATE, PARTIAL = -3, -2, -1
BALANCED = 32  # more than any tensor's dims

# A step of `even_steps`: (kind, mesh axis, num, den): its block has `n * num / den` elements
# when the source block has n.
Step = tuple[str, int, int, int]
# A step of a template: (kind, mesh axis, axes whose sizes multiply the block, axes dividing it).
TemplateStep = tuple[str, int, tuple[int, ...], tuple[int, ...]]


def codes(placements: Sequence[Placement]) -> tuple[int, ...]:
    """Per mesh axis: the dim it splits (`BALANCED` + the dim for a load-balanced split, whose
    steps differ: `plan_redistribute` gathers and cuts again between the two orders of a dim, and
    takes none of its exchange-first shortcuts with one involved), `PARTIAL`, `DISJOINT` (a
    row-disjoint sum) or `REPLICATE`."""
    return tuple(
        p.dim + (BALANCED if is_balanced(p) else 0)
        if isinstance(p, Shard)
        else DISJOINT
        if isinstance(p, RowDisjoint)
        else PARTIAL
        if isinstance(p, Partial)
        else REPLICATE
        for p in placements
    )


@dataclass
class StepTemplates:
    """Pairs of placements of one number of mesh axes and the template of each pair's steps,
    shared by the searches of every mesh with that many axes (`StepCache`)."""

    ndim: int
    placement_ids: dict[tuple[int, ...], int] = field(default_factory=dict)  # codes -> id
    coded: list[tuple[int, ...]] = field(default_factory=list)  # per id, its codes
    program_of: np.ndarray = field(default_factory=lambda: np.full((0, 0), -1, dtype=np.intp))
    template_ids: dict[tuple[TemplateStep, ...], int] = field(default_factory=dict)
    templates: list[tuple[TemplateStep, ...]] = field(default_factory=list)
    known_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # `canonical`
    known_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intp))  # their templates
    # `silent_free` pairs: their canonical keys (sorted), and beside them their steps' ids in `compact`
    compact_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    compact_known: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intp))
    compact_ids: dict[tuple[TemplateStep, ...], int] = field(default_factory=dict)
    compact: list[tuple[TemplateStep, ...]] = field(default_factory=list)
    placed: dict[int, int] = field(default_factory=dict)  # compact id * 2^ndim + kept axes -> template id
    code_array: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))  # `coded`
    pairs: int = 0  # compacted canonical pairs worked out (each once for all meshes of `ndim` axes)

    def ids(self, placements: Sequence[tuple[Placement, ...]]) -> np.ndarray:
        """Rows / columns of `program_of` for these placements (new ones get the next ids)."""
        out = np.empty(len(placements), dtype=np.intp)
        for i, p in enumerate(placements):
            key = codes(p)
            found = self.placement_ids.get(key)
            if found is None:
                found = self.placement_ids[key] = len(self.coded)
                self.coded.append(key)
            out[i] = found
        size = len(self.program_of)
        if len(self.coded) > size:  # grow, keeping the pairs found so far
            grown = np.full((2 * len(self.coded),) * 2, -1, dtype=np.intp)
            grown[:size, :size] = self.program_of
            self.program_of = grown
        if len(self.coded) > len(self.code_array):
            self.code_array = np.array(self.coded, dtype=np.int64).reshape(len(self.coded), self.ndim)
        return out

    def programs(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """The template id of every pair (rows x cols), working out the pairs not met before.

        A template names no dims, and the steps depend on the dims only through their order, so
        pairs whose dims renumber in order to the same codes share it (`canonical`): about a
        quarter of the pairs of a four-axis mesh are new canonical forms, the rest looked up, in
        arrays (`known_keys` sorted, `known_ids` beside it: a four-axis mesh meets ~10^6 canonical
        keys). The new ones are worked out without their silent axes (`_work_out`)."""
        which = self.program_of[np.ix_(rows, cols)]
        new_i, new_j = np.nonzero(which < 0)
        if len(new_i):
            pairs = np.concatenate([self.code_array[rows[new_i]], self.code_array[cols[new_j]]], axis=1)
            distinct, back = np.unique(canonical(pairs), return_inverse=True)
            found, fresh = _look_up(self.known_keys, self.known_ids, distinct)
            if len(fresh):
                first = np.zeros(len(distinct), dtype=np.intp)
                first[back.reshape(-1)] = np.arange(len(pairs))  # a pair of each canonical form
                found[fresh] = self._work_out(pairs[first[fresh]])
                self.known_keys, self.known_ids = _merged(
                    self.known_keys, self.known_ids, distinct[fresh], found[fresh]
                )
            value = found[back.reshape(-1)]
            which[new_i, new_j] = self.program_of[rows[new_i], cols[new_j]] = value
        return which

    def _work_out(self, pairs: np.ndarray) -> np.ndarray:
        """The template ids of pairs of codes not met before. Axes on which a pair sends nothing
        whatever the others do are taken out and the rest moved to the front (`silent_free`), so
        pairs whose kept axes' codes renumber alike share their steps up to which axes they name:
        the steps are worked out once per compacted canonical key (`compact_keys`, about 0.6 of
        the whole keys on four axes) and put back on the pair's own axes once per (steps, kept
        axes) (`_placed`)."""
        compacted, kept = silent_free(pairs)
        distinct, back = np.unique(canonical(compacted), return_inverse=True)
        found, fresh = _look_up(self.compact_keys, self.compact_known, distinct)
        if len(fresh):
            first = np.zeros(len(distinct), dtype=np.intp)
            first[back.reshape(-1)] = np.arange(len(pairs))
            ids, compact, n = self.compact_ids, self.compact, self.ndim
            for u, row in zip(fresh.tolist(), compacted[first[fresh]].tolist()):
                steps = coded_template(tuple(row[:n]), tuple(row[n:]))
                k = ids.get(steps)
                if k is None:
                    k = ids[steps] = len(compact)
                    compact.append(steps)
                found[u] = k
            self.pairs += len(fresh)
            self.compact_keys, self.compact_known = _merged(
                self.compact_keys, self.compact_known, distinct[fresh], found[fresh]
            )
        combos, where = np.unique(found[back.reshape(-1)] * (1 << self.ndim) + kept, return_inverse=True)
        return np.array([self._placed(c) for c in combos.tolist()], dtype=np.intp)[where.reshape(-1)]

    def _placed(self, combo: int) -> int:
        """The template id of compact steps `combo >> ndim` on the axes whose bits `combo` sets."""
        found = self.placed.get(combo)
        if found is None:
            axes = [a for a in range(self.ndim) if combo >> a & 1]
            steps = tuple(
                (kind, axes[a], tuple(axes[x] for x in num), tuple(axes[x] for x in den))
                for kind, a, num, den in self.compact[combo >> self.ndim]
            )
            found = self.template_ids.get(steps)
            if found is None:
                found = self.template_ids[steps] = len(self.templates)
                self.templates.append(steps)
            self.placed[combo] = found
        return found


def _look_up(keys: np.ndarray, ids: np.ndarray, distinct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the id beside each of `distinct` in sorted `keys`, -1 where absent; where absent)."""
    if not len(keys):
        return np.full(len(distinct), -1, dtype=np.intp), np.arange(len(distinct))
    at = np.minimum(np.searchsorted(keys, distinct), len(keys) - 1)
    hit = keys[at] == distinct
    return np.where(hit, ids[at], -1), np.flatnonzero(~hit)


def _merged(
    keys: np.ndarray, ids: np.ndarray, more: np.ndarray, more_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted `keys` with `more` added, `ids` kept beside them."""
    all_keys = np.concatenate([keys, more])
    order = np.argsort(all_keys, kind="stable")
    return all_keys[order], np.concatenate([ids, more_ids])[order]


def silent_free(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of codes (source then target per mesh axis): the codes with the axes that send
    nothing taken out, the others moved to the front in order and the freed places Replicate on
    both sides, and a bit per axis kept. An axis sends nothing, and no other axis's steps look at
    it, when neither side splits a dim on it and it is not made a row-disjoint sum (forbidden):
    Replicate, Partial or row-disjoint on both sides alike, or a Replicate or row-disjoint block
    read as a pending sum (`coded_template` reads such an axis nowhere: not a pending sum to
    reduce, not in any dim's axes, and it compares the kept axes only by their order), so
    `coded_template` of the compacted row names the kept axes by their places among them."""
    n = pairs.shape[1] // 2
    src, dst = pairs[:, :n], pairs[:, n:]
    silent = (src < 0) & (dst < 0) & ((src == dst) | ((dst == PARTIAL) & (src != PARTIAL)))
    kept = (~silent).astype(np.int64) @ (np.int64(1) << np.arange(n, dtype=np.int64))
    order = np.argsort(silent, axis=1, kind="stable")
    moved = np.take_along_axis(silent, order, axis=1)
    compacted = np.concatenate(
        [np.where(moved, REPLICATE, np.take_along_axis(side, order, axis=1)) for side in (src, dst)], axis=1
    )
    return compacted, kept


def canonical(pairs: np.ndarray) -> np.ndarray:
    """One key (int64) per row of codes (source then target, per mesh axis) after renumbering the
    dims they split in order (0, 1, ... for the dims used): rows with equal keys have the same
    steps (`coded_template` compares dims only for equality and visits them in order). Each code
    takes 4 bits: up to 15 per row, meshes of up to 7 axes. A row with a load-balanced split
    takes 5 bits a code (the fifth: balanced) and bit 62 (no key of the 4-bit rows has it): up to
    12 codes, meshes of up to 6 axes."""
    if pairs.shape[1] > 15:
        raise ValueError(f"canonical keys hold 15 codes per pair, not {pairs.shape[1]} (mesh of > 7 axes)")
    balanced = pairs >= BALANCED
    dims = np.where(balanced, pairs - BALANCED, pairs)
    top = int(dims.max()) + 1 if dims.size else 0
    used = np.zeros((len(pairs), max(top, 1)), dtype=bool)
    for d in range(top):
        used[:, d] = (dims == d).any(axis=1)
    renumber = np.cumsum(used, axis=1) - 1
    shard = dims >= 0
    renamed = np.where(shard, np.take_along_axis(renumber, np.where(shard, dims, 0), axis=1), dims)
    digits = (renamed - DISJOINT).astype(np.int64)  # 0 .. 3 + renumbered dims (< 16)
    keys = digits @ (np.int64(16) ** np.arange(pairs.shape[1], dtype=np.int64))
    with_balanced = balanced.any(axis=1)
    if with_balanced.any():
        if pairs.shape[1] > 12:
            raise ValueError(
                f"canonical keys hold 12 codes per pair with a load-balanced split, not {pairs.shape[1]} "
                "(mesh of > 6 axes)"
            )
        rows = np.flatnonzero(with_balanced)
        wide = digits[rows] + 16 * balanced[rows]
        keys[rows] = (wide @ (np.int64(32) ** np.arange(pairs.shape[1], dtype=np.int64))) | (np.int64(1) << 62)
    return keys


@dataclass
class StepCache:
    """`StepTemplates` per number of mesh axes: one per search by default, one per mesh choice
    when `autopar.planning.mesh_choice` hands the same cache to every candidate's cost. `lists`:
    the screen's candidate lists by op call and mesh signature (`rules.calls.ExpandCache`), shared
    the same way (a pipeline choice's sub-mesh choices reuse the tensor-only choice's)."""

    by_ndim: dict[int, StepTemplates] = field(default_factory=dict)
    lists: dict[Any, list[Strategy]] = field(default_factory=dict)

    def templates(self, ndim: int) -> StepTemplates:
        found = self.by_ndim.get(ndim)
        if found is None:
            found = self.by_ndim[ndim] = StepTemplates(ndim)
        return found


def instantiate(template: Sequence[TemplateStep], mesh_shape: Sequence[int]) -> tuple[Step, ...]:
    """A template's steps on a mesh of these sizes: steps on axes of one rank dropped."""
    return tuple(
        (kind, a, math.prod(mesh_shape[x] for x in num), math.prod(mesh_shape[x] for x in den))
        for kind, a, num, den in template
        if mesh_shape[a] > 1
    )


@functools.lru_cache(maxsize=262144)
def placement_template(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> tuple[TemplateStep, ...]:
    """`coded_template` of two placements, worked out once for every mesh with as many axes: the
    greedy passes of the screen's meshes ask the same pairs with other axis sizes."""
    return coded_template(codes(src), codes(dst))


def even_steps(
    src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[Step, ...]:
    """The collectives of `plan_redistribute(src, dst)` on placements alone, for even layouts of
    any tensor, on axes of more than one rank: (kind, axis, num, den), the step's block being the
    source block times num / den. Even blocks stay even through every step, so every all_to_all
    moves equal blocks; the three phases are `redistribute_cost`'s."""
    return instantiate(placement_template(tuple(src), tuple(dst)), mesh_shape)


def element_factor(kind: str, g: int) -> float:
    """Elements a rank sends per element of its block (`CommStep.elements_sent`)."""
    if kind == "all_gather":
        return float(g - 1)
    if kind == "forbidden":
        return FORBIDDEN_FACTOR
    return 2 * (g - 1) / g if kind == "all_reduce" else (g - 1) / g


@functools.lru_cache(maxsize=262144)
def _even_scales(
    src: tuple[Placement, ...], dst: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> tuple[tuple[float, float, float], ...]:
    return tuple(
        (element_factor(kind, mesh_shape[a]), float(num), float(den))
        for kind, a, num, den in even_steps(src, dst, mesh_shape)
    )


def even_redistribute_cost(src: Layout, dst: Layout, mesh_shape: tuple[int, ...]) -> float:
    """`redistribute_cost` of two even layouts from their placements' steps (worked out once per
    pair of placements and mesh, whatever the tensor), with the arithmetic of
    `search_cost.ElementCost.redistribute_table`, so the greedy pass and the search price alike."""
    n = float(src.local_numel(mesh_shape))
    total = 0.0
    for factor, num, den in _even_scales(src.placements, dst.placements, mesh_shape):
        total = total + factor * (n * num / den)
    return total


def coded_template(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[TemplateStep, ...]:
    """The steps from placements `src` to `dst` (per-axis codes) on a mesh whose axes all have more
    than one rank, naming the axes that scale each step's block instead of multiplying sizes.

    A load-balanced split (`BALANCED` + dim) splits its dim as a contiguous one does, but, as in
    `plan_redistribute`, a dim is kept on an axis only in the same order (else gathered and cut
    again), and with one on either side now no reduce-first, exchange-first or exchange-ahead
    shortcut is taken (its chunk order would be a second reordering)."""
    if src == dst:
        return ()
    want_balanced = tuple(c >= BALANCED for c in dst)
    balanced = [c >= BALANCED for c in src]  # per axis, whether it holds a load-balanced split now
    src = tuple(c - BALANCED if c >= BALANCED else c for c in src)
    dst = tuple(c - BALANCED if c >= BALANCED else c for c in dst)

    def plain() -> bool:  # no load-balanced split now nor in the target
        return not (any(balanced) or any(want_balanced))

    forbidden = [a for a, (c, t) in enumerate(zip(src, dst)) if t == DISJOINT and c != DISJOINT]
    if forbidden:  # nothing makes a row-disjoint sum (`redistribute.forbidden_axes`)
        return tuple(("forbidden", a, (), ()) for a in forbidden)
    have = {d: list(axes) for d, axes in _by_dim(src).items()}
    want = _by_dim(dst)
    num: tuple[int, ...] = ()
    den: tuple[int, ...] = ()
    steps: list[TemplateStep] = []
    if PARTIAL in src or DISJOINT in src:  # 1. pending sums: reduce-scatter into the target split
        for a, c in enumerate(src):
            t = dst[a]
            if c not in (PARTIAL, DISJOINT) or t in (PARTIAL, DISJOINT):
                continue
            if t >= 0:  # move the axes nesting outside `a` there first (even: no shape check)
                moves = exchanges_before(have, a, want.get(t, ()), t)
                if (
                    len(moves) == 1
                    and plain()
                    and _extends((*have.get(t, ()), moves[0][0]), a, want.get(t, ()))
                ):
                    (b, home) = moves[0]  # reduce first, then exchange the reduced block
                    steps.append(("reduce_scatter", a, num, den))
                    den = (*den, a)
                    steps.append(("all_to_all", b, num, den))
                    have[home].pop()
                    have.setdefault(t, []).extend((b, a))
                    continue
                for b, home in moves:  # b takes `a`'s target placement (`plan_redistribute`)
                    have[home].pop()
                    have.setdefault(t, []).append(b)
                    balanced[b] = want_balanced[a]
                    steps.append(("all_to_all", b, num, den))
                if not moves and plain() and not _extends(have.get(t, ()), a, want.get(t, ())):
                    pending = [b for b, c in enumerate(src) if c in (PARTIAL, DISJOINT) and dst[b] >= 0]
                    targets = [d if d >= 0 else None for d in dst]
                    later = pending[pending.index(a) + 1 :]
                    for b, home, dest in exchanges_ahead(have, want, targets, a, later):
                        have[home].pop()
                        have.setdefault(dest, []).append(b)
                        balanced[b] = want_balanced[b]
                        steps.append(("all_to_all", b, num, den))
            if t >= 0 and _extends(have.get(t, ()), a, want.get(t, ())):
                steps.append(("reduce_scatter", a, num, den))
                have.setdefault(t, []).append(a)
                balanced[a] = want_balanced[a]
                den = (*den, a)
            else:
                steps.append(("all_reduce", a, num, den))
    for d in range(1 + max((*have, *want), default=-1)):  # 2. un-shard each dim to its kept prefix
        axes = have.get(d)
        if not axes:
            continue
        kept = want.get(d, ())
        keep = 0
        while (
            keep < len(axes)
            and keep < len(kept)
            and axes[keep] == kept[keep]
            and balanced[axes[keep]] == want_balanced[axes[keep]]  # the same order too
        ):
            keep += 1
        removed = axes[keep:]
        moved = _exchange_first(removed, d, dst, have, want) if plain() else None
        if moved is not None:  # the outermost axis exchanged on the small block, then the gathers
            del axes[keep:]
            steps.append(("all_to_all", removed[0], num, den))
            have.setdefault(moved, []).append(removed[0])
            for c in reversed(removed[1:]):
                steps.append(("all_gather", c, num, den))
                num = (*num, c)
            continue
        for a in reversed(removed):
            t = dst[a]
            axes.pop()
            if t >= 0 and t != d:
                there = have.get(t, ())
                if (not there or there[-1] < a) and _extends(there, a, want.get(t, ())):
                    steps.append(("all_to_all", a, num, den))
                    have.setdefault(t, []).append(a)
                    balanced[a] = want_balanced[a]
                    continue
            steps.append(("all_gather", a, num, den))
            balanced[a] = False
            num = (*num, a)
    return tuple(steps)  # 3. slicing and zeroing replicas send nothing


def _exchange_first(
    removed: Sequence[int],
    d: int,
    dst: tuple[int, ...],
    have: dict[int, list[int]],
    want: dict[int, tuple[int, ...]],
) -> int | None:
    """`redistribute._exchange_first` on codes: the dim the outermost of `removed` (the axes
    leaving dim `d`) moves to by an all-to-all before the others are gathered, or None."""
    if len(removed) < 2:
        return None
    a, t = removed[0], dst[removed[0]]
    if t < 0 or t == d or any(dst[c] >= 0 and dst[c] != d for c in removed[1:]):
        return None
    there = have.get(t, ())
    if (there and there[-1] > a) or not _extends(there, a, want.get(t, ())):
        return None
    return t


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
