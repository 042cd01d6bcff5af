"""The search and the counting under a pipeline cut (`autopar.planning.stage_cut`): the exact
dynamic program that cuts priced units into contiguous stages, and the activations a schedule
keeps in flight per stage and per rank."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from autopar.core.pipeline_schedule import ActionKind, Schedule

TIME_TOLERANCE = 1e-9  # relative: stage times this close to the optimum count as tied

Fits = Callable[[int, int, int], bool]  # (first unit, end unit, stage) -> fits the memory limit


def balance(
    times: Sequence[float],
    sizes: Sequence[float],
    num_stages: int,
    *,
    allowed: Sequence[bool] | None = None,
    fits: Fits | None = None,
) -> tuple[int, ...] | None:
    """The cut of units with `times` into `num_stages` contiguous non-empty stages that minimizes
    the longest stage and, among cuts within `TIME_TOLERANCE` of that, the sum of `sizes[k]` (bytes
    crossing a cut before unit k) over its cuts. Returns each stage's first unit after the first
    (`num_stages - 1` positions), or None when no cut satisfies `allowed` (per position) and `fits`.
    Two exact dynamic programs over positions, O(num_stages * n^2): the min-max time first, then the
    fewest bytes under it (one program on (time, bytes) pairs would not be exact: a prefix with a
    longer stage but fewer bytes can win once a later stage is longer still)."""
    n = len(times)
    if num_stages < 1 or num_stages > n:
        return None
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    ok = [True] * (n + 1) if allowed is None else list(allowed)
    ok[0] = ok[n] = True

    def fitting(i: int, j: int, s: int) -> bool:
        return fits is None or fits(i, j, s)

    # `fits` (a stage's memory) is what costs: asked lazily, after the cheap time test, so each
    # entry below is the min / first of the same candidates the full scan takes.
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n + 1):
            if not ok[j] or (s == num_stages) != (j == n):
                continue
            # min over fitting i of max(best[s-1][i], time of [i, j)): candidates by that value
            # (ties: the earlier i), the first that fits is the min
            ranked = [
                (max(best[s - 1][i], prefix[j] - prefix[i]), i)
                for i in range(s - 1, j)
                if best[s - 1][i] < inf
            ]
            if not ranked:
                continue
            value, i = min(ranked)
            if not fitting(i, j, s - 1):  # (usually the lowest fits: sort only when it does not)
                ranked.sort()
                value = next((value for value, i in ranked if fitting(i, j, s - 1)), inf)
            best[s][j] = value
    limit = best[num_stages][n]
    if limit == inf:
        return None
    bound = limit * (1 + TIME_TOLERANCE) + 1e-300
    cost = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    back = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n + 1):
            if not ok[j] or (s == num_stages) != (j == n):
                continue
            extra = sizes[j] if j < n else 0.0
            for i in range(s - 1, j):
                if (
                    cost[s - 1][i] < inf
                    and cost[s - 1][i] + extra < cost[s][j]
                    and prefix[j] - prefix[i] <= bound
                    and fitting(i, j, s - 1)
                ):
                    cost[s][j], back[s][j] = cost[s - 1][i] + extra, i
    cuts = []
    j = n
    for s in range(num_stages, 1, -1):
        j = back[s][j]
        cuts.append(j)
    return tuple(reversed(cuts))


def in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most microbatches whose forward its rank has run and whose backward (B, or W
    after I) it has not: what the simulator's `peak_in_flight` counts, stage by stage."""
    peak = [0] * schedule.num_stages
    for rank in range(schedule.pp):
        held = [0] * schedule.num_stages
        for a in schedule.compute_actions(rank):
            if a.kind == ActionKind.FORWARD:
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                held[a.stage] -= 1
    return tuple(peak)


def peak_activations(schedule: Schedule, per_microbatch: Sequence[float]) -> tuple[float, ...]:
    """Per rank, the most activation bytes it holds at once, its stages' microbatches weighted by
    `per_microbatch[stage]` (at most the sum of each stage's own peak: they need not coincide)."""
    out = []
    for rank in range(schedule.pp):
        held = peak = 0.0
        for a in schedule.compute_actions(rank):
            if a.kind == ActionKind.FORWARD:
                held += per_microbatch[a.stage]
                peak = max(peak, held)
            elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                held -= per_microbatch[a.stage]
        out.append(peak)
    return tuple(out)
