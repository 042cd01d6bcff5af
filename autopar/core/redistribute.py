"""How to get a tensor from one layout to another: a list of per-axis collective steps.

Pure data (no torch.distributed): insert_comm turns the steps into functional collectives, the
cost model prices them, and the in-process oracle simulates them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from autopar.core.layout import Layout, Partial, Replicate, RowDisjoint, Shard, is_balanced, itemsize

StepKind = Literal[
    "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "ring_shift", "slice", "zero_partial", "forbidden"
]

# "ring_shift": a rank's whole block to the next rank of the axis (ring attention's exchange,
# `rules.ring_attention`; never a redistribution between layouts, so `plan_redistribute` makes none)
COLLECTIVE_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "ring_shift")
# Elements a "forbidden" step is priced at per element of its block: no redistribution makes a
# row-disjoint pending sum (`RowDisjoint`) out of another placement, since which rank owns a row
# comes from the routing; the planners see such a pair as far too dear, and insert_comm refuses it.
FORBIDDEN_FACTOR = 1e9


def forbidden_axes(src: Sequence[object], dst: Sequence[object]) -> list[int]:
    """Mesh axes where `dst` wants a row-disjoint pending sum that `src` does not hold."""
    return [a for a, (s, t) in enumerate(zip(src, dst)) if isinstance(t, RowDisjoint) and s != t]


@dataclass(frozen=True)
class CommStep:
    kind: StepKind
    axis: int
    before: Layout
    after: Layout
    dim: int | None = None  # tensor dim gathered / scattered / sliced; all_to_all: the dim given up
    dst_dim: int | None = None  # all_to_all: the dim that becomes split
    # (outer, inner): `dim`'s blocks are transposed (`layout.swap_blocks`) after an all_gather /
    # before a reduce_scatter, where an exchange over an outer axis of the dim runs on the small
    # block (`_exchange_first`, `_reduce_first`); the layouts name the sizes, not this order
    swap: tuple[int, int] | None = None

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    def elements_sent(self, mesh_shape: Sequence[int]) -> float:
        """Elements one rank sends with ring algorithms (the convention of comm_volumes.md)."""
        g = mesh_shape[self.axis]
        n = self.before.local_numel(mesh_shape)
        if self.kind == "all_gather":
            return n * (g - 1)
        if self.kind == "all_reduce":
            return 2 * (g - 1) / g * n
        if self.kind in ("reduce_scatter", "all_to_all"):
            return (g - 1) / g * n
        if self.kind == "ring_shift":
            return n
        if self.kind == "forbidden":
            return FORBIDDEN_FACTOR * n
        return 0.0

    def bytes_sent(self, mesh_shape: Sequence[int]) -> float:
        return self.elements_sent(mesh_shape) * itemsize(self.before.dtype)

    def describe(self, axis_names: Sequence[str]) -> str:
        axis = axis_names[self.axis]
        if self.kind == "all_to_all":
            return f"all_to_all[{axis}] dim {self.dim}->{self.dst_dim}"
        if self.dim is not None:
            swapped = f" (blocks {self.swap[0]}x{self.swap[1]} swapped)" if self.swap else ""
            return f"{self.kind}[{axis}] dim {self.dim}{swapped}"
        return f"{self.kind}[{axis}]"


def _is_prefix(prefix: Sequence[int], full: Sequence[int]) -> bool:
    return tuple(full[: len(prefix)]) == tuple(prefix)


def _even_exchange(
    shape: Sequence[int],
    gathered: int,
    scattered: int,
    axes_of: Callable[[int], Sequence[int]],
    axis: int,
    mesh_shape: Sequence[int],
) -> bool:
    """An all_to_all moves equal blocks: both dims must split evenly before and after it.

    Uneven (`torch.chunk`) dims are un-sharded by all_gather and re-split by slicing instead.
    """
    before = math.prod(mesh_shape[b] for b in axes_of(gathered))
    after = math.prod(mesh_shape[b] for b in axes_of(scattered)) * mesh_shape[axis]
    return shape[gathered] % before == 0 and shape[scattered] % after == 0


def exchanges_before(
    by_dim: Mapping[int, Sequence[int]],
    axis: int,
    want: Sequence[int],
    dim: int,
    shape: Sequence[int] | None = None,
    mesh_shape: Sequence[int] = (),
) -> list[tuple[int, int]]:
    """All-to-alls (axis, from dim) that first move to `dim` the axes the target nests outside
    `axis` there (`want`: the target's axes on `dim`), so that `axis`'s pending sum can
    reduce-scatter into `dim` instead of all-reducing: an exchange of summands is one of sums, and
    it moves the block it would move after an all-reduce. `by_dim`: the current axes of each dim,
    outermost first (not modified). Empty unless every such axis can move: innermost on its dim,
    and with `shape` given, in even blocks (without it the layouts are known to be even)."""
    if axis not in want:
        return []
    there = list(by_dim.get(dim, ()))
    outer = list(want[: list(want).index(axis)])
    if there != outer[: len(there)] or len(there) == len(outer):
        return []
    trial = {d: list(axes) for d, axes in by_dim.items()}
    moves = []
    for b in outer[len(there) :]:
        home = next((d for d, axes in trial.items() if b in axes), None)
        if home is None or home == dim or trial[home][-1] != b:
            return []
        if shape is not None and not _even_exchange(
            shape, home, dim, lambda d: trial.get(d, ()), b, mesh_shape
        ):
            return []
        trial[home].pop()
        trial.setdefault(dim, []).append(b)
        moves.append((b, home))
    return moves


def exchanges_ahead(
    have: Mapping[int, Sequence[int]],
    want: Mapping[int, Sequence[int]],
    targets: Sequence[int | None],
    axis: int,
    later: Sequence[int],
    shape: Sequence[int] | None = None,
    mesh_shape: Sequence[int] = (),
) -> list[tuple[int, int, int]]:
    """All-to-alls (axis, from dim, to dim) that move away the axes splitting `axis`'s target dim
    outside the target's nesting there, innermost first, each to the dim it splits in the target,
    so that `axis`'s pending sum reduce-scatters into that dim instead of all-reducing: an exchange
    of summands is one of sums and moves the block the un-sharding phase would move after the
    all-reduce, and a reduce-scatter sends half an all-reduce (a GPT embedding's vocabulary-split
    output, laid out for the residual stream on 4x8x16, went all-reduce then two exchanges).

    Empty unless every such axis can move as the un-sharding phase exchanges it (innermost on the
    dim it lands on, nesting as the target's there), and only for the last pending sum reduced
    (`later`: those reduced after it): before another one's reduce-scatter the exchange would run
    on the larger block, which can cost more (a pending sum over an axis of one rank is free to
    all-reduce, and the choice cannot depend on axis sizes: `planning.search_steps` shares it
    between meshes). `have` / `want`: each dim's axes now and in the target, outermost first;
    `targets`: the dim each axis splits in the target (None: none). With `shape` given, each
    exchange must move even blocks (without it the layouts are known to be even)."""
    t = targets[axis]
    assert t is not None
    if later:
        return []
    axes, kept = list(have.get(t, ())), tuple(want.get(t, ()))
    keep = 0
    while keep < min(len(axes), len(kept)) and axes[keep] == kept[keep]:
        keep += 1
    if keep == len(axes) or not _is_prefix((*axes[:keep], axis), kept):
        return []
    trial = {d: list(v) for d, v in have.items()}
    moves: list[tuple[int, int, int]] = []
    for b in reversed(axes[keep:]):
        home = targets[b]
        there = trial.get(home, []) if home is not None else []
        if (
            home is None
            or home == t
            or not all(c < b for c in there)
            or not _is_prefix((*there, b), want.get(home, ()))
            or shape is not None
            and not _even_exchange(shape, t, home, lambda x: trial.get(x, ()), b, mesh_shape)
        ):
            return []
        trial[t].pop()
        trial.setdefault(home, []).append(b)
        moves.append((b, t, home))
    return moves


def _reduce_first(
    cur: Layout, dst: Layout, axis: int, moves: Sequence[tuple[int, int]], mesh_shape: Sequence[int]
) -> bool:
    """Whether `axis`'s pending sum reduce-scatters into its target dim before the one exchange
    `moves` names brings the axis nesting outside it there: the exchange then moves the reduced
    block, 1/g of the summands' (the dim's blocks are put in (axis, exchanged axis) order first).
    Not with a load-balanced split involved (its chunk order is a second reordering)."""
    if len(moves) != 1 or any(map(is_balanced, (*cur.placements, *dst.placements))):
        return False
    (b, _), t = moves[0], dst.placements[axis]
    assert isinstance(t, Shard)
    want = dst.shard_axes(t.dim)
    split = math.prod(mesh_shape[c] for c in cur.shard_axes(t.dim)) * mesh_shape[b] * mesh_shape[axis]
    return _is_prefix((*cur.shard_axes(t.dim), b, axis), want) and cur.shape[t.dim] % split == 0


def _exchange_first(
    cur: Layout,
    dst: Layout,
    dim: int,
    removed: Sequence[int],
    axes_of: Callable[[int], Sequence[int]],
    mesh_shape: Sequence[int],
) -> int | None:
    """Where `dim` gives up the axes `removed` (outermost first) and only the outermost moves to
    another dim by an all-to-all, the others being gathered: that dim, so that the exchange runs
    on the stored block before the gathers grow it (they then gather the dim's blocks in (inner,
    outer) order, which the last gather swaps back). None where the usual order (innermost axis
    first) is taken. `axes_of`: the current axes of each dim, outermost first."""
    if len(removed) < 2 or any(map(is_balanced, (*cur.placements, *dst.placements))):
        return None
    a = removed[0]
    target = dst.placements[a]
    if not isinstance(target, Shard) or target.dim == dim:
        return None
    inner = [dst.placements[c] for c in removed[1:]]
    if any(isinstance(p, Shard) and p.dim != dim for p in inner):
        return None  # an inner axis moves too: the usual order
    there = axes_of(target.dim)
    if not (
        all(b < a for b in there)
        and _is_prefix((*there, a), dst.shard_axes(target.dim))
        and _even_exchange(cur.shape, dim, target.dim, axes_of, a, mesh_shape)
    ):
        return None
    return target.dim


def _ahead(
    cur: Layout, dst: Layout, axis: int, order: Sequence[int], mesh_shape: Sequence[int]
) -> list[tuple[int, int, int]]:
    """`exchanges_ahead` between two layouts, pending sums reduced in `order` (not with a
    load-balanced split: its chunk order is a second reordering)."""
    if any(map(is_balanced, (*cur.placements, *dst.placements))):
        return []
    ndim = len(cur.shape)
    targets = [p.dim if isinstance(p, Shard) else None for p in dst.placements]
    pending = [b for b in order if isinstance(cur.placements[b], Partial) and targets[b] is not None]
    later = pending[pending.index(axis) + 1 :]
    have = {d: cur.shard_axes(d) for d in range(ndim) if cur.shard_axes(d)}
    want = {d: dst.shard_axes(d) for d in range(ndim) if dst.shard_axes(d)}
    return exchanges_ahead(have, want, targets, axis, later, cur.shape, mesh_shape)


def plan_redistribute(
    src: Layout, dst: Layout, mesh_shape: Sequence[int], sums_first: Sequence[int] = ()
) -> list[CommStep]:
    """Steps from `src` to `dst`: reductions first (smallest tensors), then un-sharding, then slicing.

    A load-balanced split (`BalancedShard`) takes the same steps as a contiguous one of its dim:
    the step's layouts say the order, and insert_comm and the oracle reorder the dim after an
    all-gather (or the all-to-all that gathers it) and before a reduce-scatter, an all-to-all into
    it or a slice. Between the two orders of one dim on one axis the dim is gathered and cut
    again (an all-gather's volume).

    Pending sums are reduced in axis order, except that `sums_first` axes go first: over-decomposed
    batch chunks add up their gradients in memory before one collective sends the total."""
    if src.shape != dst.shape:
        raise ValueError(f"redistribute between shapes {src.shape} and {dst.shape}")
    cur = src
    steps: list[CommStep] = []
    forbidden = [a for a in forbidden_axes(src.placements, dst.placements) if mesh_shape[a] > 1]
    if forbidden:  # a single step per such axis, priced so that no plan chooses it
        return [CommStep("forbidden", a, src, dst) for a in forbidden]

    def step(
        kind: StepKind,
        axis: int,
        new: Layout,
        dim: int | None = None,
        dst_dim: int | None = None,
        swap: tuple[int, int] | None = None,
    ) -> None:
        nonlocal cur
        if mesh_shape[axis] > 1 or kind in ("slice", "zero_partial"):
            steps.append(CommStep(kind, axis, cur, new, dim, dst_dim, swap))
        cur = new

    # 1. pending sums: reduce-scatter straight into the target split where the nesting allows.
    order = [*sums_first, *(a for a in range(len(mesh_shape)) if a not in sums_first)]
    for a in order:
        p = cur.placements[a]
        if not isinstance(p, Partial) or isinstance(dst.placements[a], Partial):
            continue
        target = dst.placements[a]
        if isinstance(target, Shard):
            by_dim = {d: cur.shard_axes(d) for d in range(len(cur.shape))}
            want = dst.shard_axes(target.dim)
            moves = exchanges_before(by_dim, a, want, target.dim, cur.shape, mesh_shape)
            if _reduce_first(cur, dst, a, moves, mesh_shape):
                (b, d), g = moves[0], mesh_shape[a]
                swap = (mesh_shape[b], g) if mesh_shape[b] > 1 else None
                step("reduce_scatter", a, cur.with_placement(a, target), dim=target.dim, swap=swap)
                step("all_to_all", b, cur.with_placement(b, target), dim=d, dst_dim=target.dim)
                continue
            for b, d in moves:
                step("all_to_all", b, cur.with_placement(b, target), dim=d, dst_dim=target.dim)
            if not moves and not _is_prefix((*cur.shard_axes(target.dim), a), want):
                for b, d, home in _ahead(cur, dst, a, order, mesh_shape):
                    step("all_to_all", b, cur.with_placement(b, dst.placements[b]), dim=d, dst_dim=home)
        if isinstance(target, Shard) and _is_prefix(
            (*cur.shard_axes(target.dim), a), dst.shard_axes(target.dim)
        ):
            step("reduce_scatter", a, cur.with_placement(a, target), dim=target.dim)
        else:
            step("all_reduce", a, cur.with_placement(a, Replicate()))

    # 2. un-shard every dim down to the prefix of axes it keeps, innermost axis first.
    for d in range(len(cur.shape)):
        src_axes = cur.shard_axes(d)
        dst_axes = dst.shard_axes(d)
        keep = 0
        while (
            keep < min(len(src_axes), len(dst_axes))
            and src_axes[keep] == dst_axes[keep]
            and cur.placements[src_axes[keep]] == dst.placements[src_axes[keep]]  # the same order too
        ):
            keep += 1
        removed = src_axes[keep:]
        moved = _exchange_first(cur, dst, d, removed, cur.shard_axes, mesh_shape)
        if moved is not None:
            a = removed[0]
            step("all_to_all", a, cur.with_placement(a, dst.placements[a]), dim=d, dst_dim=moved)
            gathered = [c for c in reversed(removed[1:]) if mesh_shape[c] > 1]
            inner = math.prod(mesh_shape[c] for c in gathered)
            for c in reversed(removed[1:]):
                swap = (inner, mesh_shape[a]) if gathered and c == gathered[-1] and mesh_shape[a] > 1 else None
                step("all_gather", c, cur.with_placement(c, Replicate()), dim=d, swap=swap)
            continue
        for a in reversed(removed):
            target = dst.placements[a]
            if (
                isinstance(target, Shard)
                and target.dim != d
                and all(b < a for b in cur.shard_axes(target.dim))
                and _is_prefix((*cur.shard_axes(target.dim), a), dst.shard_axes(target.dim))
                and _even_exchange(cur.shape, d, target.dim, cur.shard_axes, a, mesh_shape)
            ):
                step("all_to_all", a, cur.with_placement(a, target), dim=d, dst_dim=target.dim)
            else:
                step("all_gather", a, cur.with_placement(a, Replicate()), dim=d)

    # 3. local work: slice replicated axes into their split, zero replicas that must become summands.
    for a, target in enumerate(dst.placements):
        now = cur.placements[a]
        if now == target:
            continue
        if isinstance(target, Shard) and isinstance(now, Replicate):
            step("slice", a, cur.with_placement(a, target), dim=target.dim)
        elif isinstance(target, Partial) and isinstance(now, Replicate):
            step("zero_partial", a, cur.with_placement(a, target))
        elif isinstance(now, RowDisjoint) and target == Partial():
            cur = cur.with_placement(a, target)  # a row-disjoint sum is a sum: a new name only
        elif isinstance(now, Partial) and mesh_shape[a] == 1:
            cur = cur.with_placement(a, target)  # one rank: every pending sum is the value
        else:  # pragma: no cover - the three steps above leave no other case
            raise AssertionError(f"cannot redistribute {src} -> {dst} (stuck at {cur})")
    if cur != dst:  # pragma: no cover
        raise AssertionError(f"redistribution {src} -> {dst} ended at {cur}")
    return steps


def redistribute_cost(src: Layout, dst: Layout, mesh_shape: Sequence[int]) -> float:
    """Elements sent per rank by `plan_redistribute(src, dst)`'s steps, in arithmetic only.

    The planner prices millions of layout pairs; this follows the same three phases as
    `plan_redistribute` without building layouts (a property test keeps the two equal).
    """
    if src == dst:
        return 0.0
    if src.shape != dst.shape:
        raise ValueError(f"redistribute between shapes {src.shape} and {dst.shape}")
    cur = list(src.placements)
    target = dst.placements
    n = float(src.local_numel(mesh_shape))
    total = 0.0
    forbidden = [a for a in forbidden_axes(src.placements, dst.placements) if mesh_shape[a] > 1]
    if forbidden:
        return FORBIDDEN_FACTOR * n * len(forbidden)

    def axes(dim: int) -> list[int]:
        return [a for a, p in enumerate(cur) if isinstance(p, Shard) and p.dim == dim]

    # Even layouts stay even through every step, so scaling n by g is exact; uneven blocks round
    # up, so there each step's block is recounted.
    exact = not (src.is_even(mesh_shape) and dst.is_even(mesh_shape))

    def block() -> float:
        # each dim's split factor in one pass over the axes (`axes(d)` per dim walked them per dim:
        # a quarter of the search's time on uneven tables, which price pair by pair)
        split = [1] * len(src.shape)
        for b, p in enumerate(cur):
            if isinstance(p, Shard):
                split[p.dim] *= mesh_shape[b]
        return float(math.prod(-(-size // f) for size, f in zip(src.shape, split)))

    for a, p in enumerate(cur):
        if not isinstance(p, Partial) or isinstance(target[a], Partial):
            continue
        g = mesh_shape[a]
        t = target[a]
        if isinstance(t, Shard) and not _is_prefix((*axes(t.dim), a), dst.shard_axes(t.dim)):
            by_dim = {d: axes(d) for d in range(len(src.shape))}  # only where a move may help
            moves = exchanges_before(by_dim, a, dst.shard_axes(t.dim), t.dim, src.shape, mesh_shape)
            if _reduce_first(Layout(tuple(cur), src.shape, src.dtype), dst, a, moves, mesh_shape):
                (b, _), gb = moves[0], mesh_shape[moves[0][0]]
                total += (g - 1) / g * n
                cur[a] = t
                n = block() if exact else n / g
                total += (gb - 1) / gb * n
                cur[b] = t
                n = block() if exact else n
                continue
            for b, _ in moves:
                total += (mesh_shape[b] - 1) / mesh_shape[b] * n
                cur[b] = t
                n = block() if exact else n
            if not moves:
                layout = Layout(tuple(cur), src.shape, src.dtype)
                for b, _, _ in _ahead(layout, dst, a, range(len(mesh_shape)), mesh_shape):
                    total += (mesh_shape[b] - 1) / mesh_shape[b] * n
                    cur[b] = target[b]
                    n = block() if exact else n
        if isinstance(t, Shard) and _is_prefix((*axes(t.dim), a), dst.shard_axes(t.dim)):
            total += (g - 1) / g * n
            cur[a] = t
            n = block() if exact else n / g
        else:
            total += 2 * (g - 1) / g * n
            cur[a] = Replicate()
    for d in range(len(src.shape)):
        src_axes = axes(d)
        dst_axes = dst.shard_axes(d)
        keep = 0
        while (
            keep < min(len(src_axes), len(dst_axes))
            and src_axes[keep] == dst_axes[keep]
            and cur[src_axes[keep]] == target[src_axes[keep]]
        ):
            keep += 1
        removed = src_axes[keep:]
        if len(removed) > 1 and _exchange_first(
            Layout(tuple(cur), src.shape, src.dtype), dst, d, removed, axes, mesh_shape
        ) is not None:
            a = removed[0]
            total += (mesh_shape[a] - 1) / mesh_shape[a] * n
            cur[a] = target[a]
            n = block() if exact else n
            for c in reversed(removed[1:]):
                total += n * (mesh_shape[c] - 1)
                cur[c] = Replicate()
                n = block() if exact else n * mesh_shape[c]
            continue
        for a in reversed(removed):
            g = mesh_shape[a]
            t = target[a]
            if (
                isinstance(t, Shard)
                and t.dim != d
                and all(b < a for b in axes(t.dim))
                and _is_prefix((*axes(t.dim), a), dst.shard_axes(t.dim))
                and _even_exchange(src.shape, d, t.dim, axes, a, mesh_shape)
            ):
                total += (g - 1) / g * n
                cur[a] = t
                n = block() if exact else n
            else:
                total += n * (g - 1)
                cur[a] = Replicate()
                n = block() if exact else n * g
    return total
