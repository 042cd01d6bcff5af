"""Which collective-matmul pairs the compiler decomposes (`PlanOptions.decompose_matmuls`): the
pass (`autopar.passes.decompose_matmul`) rewrites the pairs it is given; this module picks them by
the modeled step, scheduled as the schedule stage would schedule it."""

from __future__ import annotations

import torch.fx as fx

from autopar.core.collectives import DECOMPOSED_KEY, DECOMPOSED_STEPS_KEY
from autopar.core.errors import UsageError
from autopar.core.graph_copy import graph_copy
from autopar.core.mesh import Mesh
from autopar.cost.timeline import Timeline, exposed_by_collective, simulate
from autopar.passes.decompose_matmul import MODES as DECOMPOSE_MODES
from autopar.passes.decompose_matmul import decompose_matmuls as decompose_pass
from autopar.passes.decompose_matmul import find_pairs
from autopar.passes.schedule import schedule as schedule_pass


def check_decompose(mode: object) -> None:
    """`decompose_matmuls` must name a mode of the pass."""
    if mode not in DECOMPOSE_MODES:
        raise UsageError(
            f"decompose_matmuls={mode!r} is not a mode of the collective-matmul decomposition",
            hint='"auto" (where the modeled step is shorter), "on" (every pair that qualifies) or "off"',
        )


def decompose_chosen(
    gm: fx.GraphModule,
    work: Mesh,
    coords: tuple[int, ...],
    table: str,
    mode: str,
    schedule: bool,
    in_flight_bytes: int,
    every_pair: bool = True,
) -> tuple[fx.GraphModule, fx.GraphModule | None]:
    """The decomposition pass on the lowered graph; returns the graph and, where "auto" scheduled
    the graph it chose to decide so, that scheduled copy (the schedule stage's result).

    "auto" prices each pair against the time its collective stays exposed in the step scheduled
    without the rewrite (a scheduled copy, modeled on `table`). Where some pairs price shorter, the
    whole step is modeled, scheduled, with those pairs rewritten and (`every_pair`) with every pair
    rewritten, and the shortest of the steps is kept: a pair that prices faster alone can still
    slow the step (its pieces queue on the link ahead of other collectives). The mesh choice
    (`scheduled_step_time`) leaves out the every-pair trial, which a search's plans seldom win, to
    price each candidate with one scheduled trial. Batch chunks (over-decomposition) overlap their
    collectives already: not there."""
    if mode == "off" or work.in_process or not find_pairs(gm, tuple(work.shape), coords):
        return gm, None
    if mode == "on":
        return decompose_pass(gm, work, coords, hardware=table, mode="on"), None

    def scheduled_step(graph: fx.GraphModule) -> tuple[Timeline, fx.GraphModule]:
        if schedule:
            graph = schedule_pass(graph, work, hardware=table, in_flight_bytes=in_flight_bytes)
        return simulate(graph, work, table), graph

    timeline, scheduled = scheduled_step(graph_copy(gm))
    exposed = exposed_by_collective(scheduled, timeline)
    records = decompose_pass(gm, work, coords, hardware=table, exposed=exposed, rewrite=False).meta[DECOMPOSED_KEY]
    pieces = {r.collective: r.chunks for r in records}  # the trials cut each pair as it was priced
    shorter = frozenset(r.collective for r in records if r.kept)
    sets = {"whole": frozenset[str](), "pairs priced shorter": shorter, "every pair": frozenset(r.collective for r in records)}
    steps = {"whole": timeline.step_time}
    graphs = {"whole": scheduled}
    if shorter:
        for name in ("pairs priced shorter", "every pair"):
            if name == "pairs priced shorter" or (every_pair and sets[name] != shorter):
                trial = decompose_pass(graph_copy(gm), work, coords, hardware=table, only=sets[name], pieces=pieces)
                trial_timeline, graphs[name] = scheduled_step(trial)
                steps[name] = trial_timeline.step_time
    best = min(steps, key=lambda k: (steps[k], len(sets[k])))
    gm = decompose_pass(
        gm, work, coords, hardware=table, exposed=exposed, only=sets[best], rewrite=best != "whole", pieces=pieces
    )
    gm.meta[DECOMPOSED_STEPS_KEY] = steps
    if not schedule:
        return gm, None
    chosen = graphs[best]  # scheduled already: the schedule stage's result for the graph kept
    for key in (DECOMPOSED_KEY, DECOMPOSED_STEPS_KEY):
        chosen.meta[key] = gm.meta[key]
    return gm, chosen
