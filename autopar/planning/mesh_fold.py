"""Folded mesh ranking: price a deep model's candidate meshes on two shallow copies of its graph.

A transformer's N layers are one block traced once and copied (`autopar.passes.repeats`): the
screen, the searches of the kept meshes and the schedule stage all walk N copies of the same
subgraph. The mesh choice ranks candidates; only the chosen mesh's plan is compiled. So the
ranking is done on the same model cut to `DEPTHS` = 4 and 5 blocks (`trace(..., depth=)`), and
every number of a candidate (communication, compute, memory, scheduled step, gradient reduction,
stored bytes) is taken to the whole depth by adding N - 5 times what the fifth block added:
x(N) = x(5) + (N - 5) (x(5) - x(4)).

That line is exact for a candidate whose plans at both depths are *steady*: blocks 0 and 1, the
last block and everything outside the blocks planned alike at both depths, and every middle block
(block 2 at depth 4, blocks 2 and 3 at depth 5) planned op for op like the others. Then each middle
block receives the layouts it gives on (its input and its input's gradient are laid out alike), so
the whole depth's plan made of the same decisions adds the same cost per block. Block 0 reads the
embedding's layout and may be planned otherwise (tests/test_recompute_choice.py); block 1 and the
last block are kept whole at both depths for the same reason. `steady` checks it op for op; a
candidate that is not steady, or blocks that differ (no repeated blocks found by the trace), is not
folded: the caller ranks on the whole graph as before.

It is a ranking, not the plan: the caller searches the best candidates again on the whole graph,
in the folded order, until the best whole-depth result is no slower than the next candidate's
folded number (`autopar.compiler.auto_mesh`), and compiles that search's plan. Each copy is
searched under its depth's share of the job's memory limit (`_share`); a candidate whose folded
memory is over the limit is ranked as not fitting, and if such a candidate is folded faster than
the one chosen the fold cannot tell (its whole-depth plan would recompute or store otherwise): the
caller then ranks on the whole graph.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch.fx as fx

from autopar.core.errors import AutoparError, MemoryLimitError
from autopar.core.meta import info
from autopar.core.plan import Plan
from autopar.planning.mesh_choice import ChosenPlan, MeshCandidate, MeshChoice, rank_key

_COPY = re.compile(r"_b(\d+)$")  # the name `passes.repeats` gives block k's copy of a node of block 1
Key = tuple[tuple[int, ...], tuple[str, ...]]  # a candidate mesh: (shape, axis names)
Rank = Callable[..., MeshChoice]  # `rank_meshes` with everything but graph, candidates and what to keep

DEPTHS = (4, 5)  # the two shallow copies: blocks 0, 1, one or two middle blocks, the last
MIN_FOLDED = 16  # fold only a model at least this deep (the two copies hold 9 blocks and run 2 choices)
# numbers of a candidate that grow by one block's share per block
_EXTENSIVE = ("comm_time", "compute_time", "memory", "scheduled_time", "reduce_time", "param_bytes")


class RepeatedBlocks(Protocol):
    """The trace's record of identical blocks (`passes.repeats.RepeatedBlocks`, which planning
    does not import: the stages sit beside it)."""

    @property
    def count(self) -> int: ...

    def block_of(self, path: str) -> int | None: ...


def deep_enough(group: RepeatedBlocks) -> bool:
    """Whether a model of these identical blocks is deep enough to fold."""
    return group.count >= MIN_FOLDED


def rank_folded(
    gm: fx.GraphModule,
    group: RepeatedBlocks,
    shallow: Sequence[fx.GraphModule],
    rank: Rank,
    *,
    searched: int,
    keep_plan: bool,
    limit: float,
) -> MeshChoice | None:
    """The mesh choice of `gm` (traced with `group`, one container of identical blocks) ranked on
    `shallow` (its model cut to `DEPTHS` blocks, traced alike),
    its best candidates confirmed on `gm` itself (module doc); None where the fold cannot rank:
    no candidate fits at the deeper copy, a fitting candidate is not steady, or one that a limit
    the folded numbers exceed would rank first. `rank(graph, candidates=, searched=,
    overlap_candidates=, keep_plan=, keep_plans=, memory_limit=)` is `rank_meshes` with the job's
    other arguments; `limit` the job's memory limit per rank (each copy is searched under its
    depth's share of it, `_share`)."""
    assert len(shallow) == len(DEPTHS)
    try:
        # each copy searched under its share of the limit (a copy 5 blocks deep under the whole
        # limit stores 5 blocks' weights replicated where the whole depth cannot)
        deep = rank(shallow[1], candidates=None, searched=searched, keep_plans=True, memory_limit=_share(limit, 1, group))
        both = [(c.shape, c.names) for c in deep.candidates if (c.shape, c.names) in deep.plans]
        near = rank(
            shallow[0], candidates=both, searched=0, overlap_candidates=len(both), keep_plans=True,
            memory_limit=_share(limit, 0, group),
        )  # fmt: skip
    except AutoparError:  # (nothing fits even cut short: the whole graph's choice says why)
        return None
    other = {(c.shape, c.names): c for c in near.candidates}
    folded: list[MeshCandidate] = []
    for c in deep.candidates:
        key = (c.shape, c.names)
        if key not in deep.plans:  # screened out at the deeper copy: its estimate is that depth's
            folded.append(replace(c, error=f"{c.error} (at {DEPTHS[1]} of {group.count} blocks)", folded=group.count))
            continue
        if key not in near.plans or not steady(shallow[0], near.plans[key], shallow[1], deep.plans[key], group):
            if c.fits:
                return None
            folded.append(replace(c, folded=group.count))
            continue
        folded.append(replace(extrapolate(other[key], c, group.count, limit), folded=group.count))
    fitting = sorted((c for c in folded if c.fits), key=rank_key)
    if not fitting:
        return None
    best = fitting[0].rank_time
    if any(not c.fits and key_of(c) in deep.plans and c.error.endswith("(folded)") and c.rank_time < best for c in folded):
        return None  # over the limit where it is folded faster: its whole-depth plan is unknown
    return _confirmed(gm, rank, deep, folded, fitting, keep_plan, limit)


def _confirmed(
    gm: fx.GraphModule,
    rank: Rank,
    deep: MeshChoice,
    folded: list[MeshCandidate],
    fitting: list[MeshCandidate],
    keep_plan: bool,
    limit: float,
) -> MeshChoice | None:
    """The folded ranking with its best candidates searched and priced on `gm`, in the folded
    order, until the best whole-depth one is no slower than the next candidate's folded number."""
    whole: dict[Key, MeshCandidate] = {}
    kept: dict[Key, ChosenPlan | None] = {}
    best = math.inf
    for c in fitting:
        if c.rank_time >= best:
            break
        key = key_of(c)
        try:
            choice = rank(gm, candidates=[key], searched=0, overlap_candidates=1, keep_plan=keep_plan)
        except MemoryLimitError as exc:
            whole[key] = MeshCandidate(c.shape, c.names, memory=exc.memory, error="does not fit in memory")
            continue
        except AutoparError as exc:
            whole[key] = MeshCandidate(c.shape, c.names, error=f"{type(exc).__name__}: {exc.message}"[:160])
            continue
        whole[key], kept[key] = choice.chosen, choice.chosen_plan
        best = min(best, choice.chosen.rank_time)
    if not math.isfinite(best):
        return None
    ranked = [whole.get(key_of(c), c) for c in folded]
    order = sorted(range(len(ranked)), key=lambda i: (*rank_key(ranked[i]), ranked[i].folded > 0, i))
    first = ranked[order[0]]
    choice = MeshChoice(deep.world_size, deep.hardware, deep.planner, limit, [ranked[i] for i in order])
    choice.chosen_plan = kept.get(key_of(first))
    return choice


def _share(limit: float, which: int, group: RepeatedBlocks) -> float:
    """The limit copy `which` of `DEPTHS` is searched under: its share of the blocks (a heuristic:
    what lies outside the blocks is counted shared too, so the share is a little tight)."""
    return limit * DEPTHS[which] / group.count


def key_of(c: MeshCandidate) -> Key:
    return c.shape, c.names


def extrapolate(shallow: MeshCandidate, deeper: MeshCandidate, blocks: int, limit: float) -> MeshCandidate:
    """`deeper` (at DEPTHS[1] blocks) taken to `blocks` blocks by what its last middle block added
    over `shallow` (the same mesh at DEPTHS[0]); fits where the extrapolated memory is within
    `limit`. A number known at one depth only becomes nan."""
    more = blocks - DEPTHS[1]
    values: dict[str, Any] = {}
    for name in _EXTENSIVE:
        a, b = getattr(shallow, name), getattr(deeper, name)
        values[name] = b + more * (b - a) if math.isfinite(a) and math.isfinite(b) else math.nan
    fits = deeper.fits and shallow.fits and values["memory"] <= limit
    error = deeper.error or shallow.error
    if deeper.fits and not fits and not error:
        error = "does not fit in memory (folded)"
    return replace(deeper, **values, fits=fits, error=error)


def steady(
    shallow: fx.GraphModule, shallow_plan: Plan, deeper: fx.GraphModule, deeper_plan: Plan, group: RepeatedBlocks
) -> bool:
    """Whether the two depths' plans make the whole depth's cost a line in the number of blocks
    (module doc): every node outside the middle blocks has the same strategy and layouts at both
    depths, the last block's nodes too (block 3 at depth 4, block 4 at 5), and every middle
    block's nodes those of block 2 at depth 4, position by position (the copies' order)."""
    a, b = _blocks(shallow, group), _blocks(deeper, group)
    if a is None or b is None or len(a) != DEPTHS[0] + 1 or len(b) != DEPTHS[1] + 1:
        return False
    middle = a[2]
    pairs: list[tuple[list[fx.Node], list[fx.Node]]] = [
        (a[None], b[None]),  # outside the blocks
        (a[0], b[0]),
        (a[1], b[1]),
        (a[DEPTHS[0] - 1], b[DEPTHS[1] - 1]),  # the last block
        *((middle, b[k]) for k in range(2, DEPTHS[1] - 1)),
    ]
    return all(_alike(x, shallow_plan, y, deeper_plan) for x, y in pairs)


def _blocks(gm: fx.GraphModule, group: RepeatedBlocks) -> dict[int | None, list[fx.Node]] | None:
    """Placeholders and calls by the block they lie in (None: outside), in graph order. Block 1's
    backward run may hold calls of no module (sums of gradients): block 1 keeps them outside, as at
    every depth, and each copy's are its block's (named by `passes.repeats` after their block)."""
    found: dict[int | None, list[fx.Node]] = {None: []}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            name = info(node).param_name
            block = group.block_of(name) if name is not None else None
        elif node.op == "call_function":
            block = group.block_of(info(node).module_path)
            copied = _COPY.search(node.name)  # a node of block 1's run with no module (a gradient
            if block is None and copied is not None and 2 <= int(copied[1]) < group.count:  # sum): copied
                block = int(copied[1])
        else:
            continue
        found.setdefault(block, []).append(node)
    return found


def _alike(xs: Sequence[fx.Node], plan_x: Plan, ys: Sequence[fx.Node], plan_y: Plan) -> bool:
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys):
        if x.op != y.op or (x.op == "call_function" and x.target != y.target):
            return False
        if plan_x.strategies.get(x.name) != plan_y.strategies.get(y.name):
            return False
        if plan_x.layouts.get(x.name) != plan_y.layouts.get(y.name):
            return False
    return True
