"""Which collective-matmul pairs the compiler decomposes (`PlanOptions.decompose_matmuls`): the
pass (`autopar.passes.decompose_matmul`) rewrites the pairs it is given; this module picks them by
the modeled step, scheduled as the schedule stage would schedule it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch.fx as fx

from autopar.core.collectives import DECOMPOSED_KEY, DECOMPOSED_STEPS_KEY, DecomposedPair
from autopar.core.errors import AutoparError, UsageError
from autopar.core.graph_copy import graph_copy
from autopar.core.mesh import Mesh
from autopar.cost.timeline import Timeline, exposed_by_collective, simulate
from autopar.passes.decompose_matmul import MODES as DECOMPOSE_MODES
from autopar.passes.decompose_matmul import decompose_matmuls as decompose_pass
from autopar.passes.decompose_matmul import find_pairs
from autopar.passes.schedule import schedule as schedule_pass
from autopar.runtime.agreement import ChoiceAgreement
from autopar.runtime.wire import JsonWire, RefusedPayload, exact_fields, field_of, pairs_of, strings_of


def check_decompose(mode: object) -> None:
    """`decompose_matmuls` must name a mode of the pass."""
    if mode not in DECOMPOSE_MODES:
        raise UsageError(
            f"decompose_matmuls={mode!r} is not a mode of the collective-matmul decomposition",
            hint='"auto" (where the modeled step is shorter), "on" (every pair that qualifies) or "off"',
        )


@dataclass(frozen=True)
class DecompositionChoice:
    """What "auto" decided for the program, made once and the same on every rank (a rank that
    chose for its own coordinates could pick other pairs than its peers, or cut them into other
    piece counts, and their collectives would no longer match): the pairs as priced, which kept
    and in how many pieces, and the modeled steps the choice compared. Pairs are named by their
    collective's node name, which every rank's lowered graph gives alike (one trace, one plan, the
    same stages)."""

    records: tuple[DecomposedPair, ...] = ()
    steps: tuple[tuple[str, float], ...] = ()


_PAIR_FIELDS = frozenset(f.name for f in fields(DecomposedPair))
_KINDS = ("all_gather", "reduce_scatter")
_DIMS = ("M", "N", "K")


def _encoded(choice: DecompositionChoice) -> dict[str, Any]:
    return {"records": [asdict(r) for r in choice.records], "steps": [list(step) for step in choice.steps]}


def _decoded(data: Any) -> DecompositionChoice:
    """The pairs and steps of a choice, else `RefusedPayload`: every field of every pair present
    and of its type, kinds and dims the pass's, piece counts at least 1."""
    what = "the collective-matmul decomposition"
    whole = exact_fields(data, frozenset({"records", "steps"}), what)
    records = []
    for record in field_of(whole, "records", list, what):
        pair = exact_fields(record, _PAIR_FIELDS, what)
        kind, chunks = field_of(pair, "kind", str, what), field_of(pair, "chunks", int, what)
        matmuls, dims = strings_of(pair, "matmuls", what), strings_of(pair, "dims", what)
        if kind not in _KINDS or chunks < 1 or len(dims) != len(matmuls) or not set(dims) <= set(_DIMS):
            raise RefusedPayload(f"{what}: not a pair the pass makes: {record!r}")
        records.append(
            DecomposedPair(
                collective=field_of(pair, "collective", str, what), kind=kind, matmuls=matmuls, dims=dims,
                where=field_of(pair, "where", str, what), chunks=chunks,
                before=float(field_of(pair, "before", (int, float), what)),
                after=float(field_of(pair, "after", (int, float), what)), kept=field_of(pair, "kept", bool, what),
            )
        )  # fmt: skip
    return DecompositionChoice(tuple(records), pairs_of(whole, "steps", str, what))


# how the choice travels between ranks (`runtime.wire`); its `what` names it in messages
DECOMPOSITION = JsonWire("the collective-matmul decomposition", _encoded, _decoded)


def decompose_chosen(
    gm: fx.GraphModule,
    work: Mesh,
    coords: tuple[int, ...],
    table: str,
    mode: str,
    schedule: bool,
    in_flight_bytes: int,
    every_pair: bool = True,
    agree: ChoiceAgreement | None = None,
    whole: Callable[[], tuple[Timeline, fx.GraphModule]] | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule | None]:
    """The decomposition pass on the lowered graph; returns the graph and, where "auto" scheduled
    the graph it chose to decide so, that scheduled copy (the schedule stage's result).

    "auto" decides once per program (`agree`; None: this rank decides alone) and every rank
    applies that choice to its own graph; the rank that decided keeps the graph it scheduled to
    decide. "on" rewrites every pair that qualifies on each rank, "off" none. `whole`, when given,
    hands "auto" the timeline and schedule stage's graph of `gm` as it is (not decomposed), made
    already (`lowering.ScheduledCopy`: the mesh choice scheduled this plan), instead of
    scheduling a copy of `gm` again."""
    if mode == "off" or work.in_process:
        return gm, None
    if mode == "on":
        if not find_pairs(gm, tuple(work.shape), coords):
            return gm, None
        return decompose_pass(gm, work, coords, hardware=table, mode="on"), None
    decided: list[tuple[fx.GraphModule, fx.GraphModule | None]] = []

    def decide() -> DecompositionChoice:
        chosen, scheduled = _auto(gm, work, coords, table, schedule, in_flight_bytes, every_pair, whole)
        decided.append((chosen, scheduled))
        steps = chosen.meta.get(DECOMPOSED_STEPS_KEY, {})
        return DecompositionChoice(tuple(chosen.meta.get(DECOMPOSED_KEY, ())), tuple(steps.items()))

    choice = agree(decide, DECOMPOSITION) if agree is not None else decide()
    if decided:  # this rank decided: its graph (and scheduled copy) is the choice applied
        return decided[0]
    return _applied(gm, work, coords, table, choice), None


def _applied(gm: fx.GraphModule, work: Mesh, coords: tuple[int, ...], table: str, choice: DecompositionChoice) -> fx.GraphModule:
    """The choice another rank made, applied to this rank's graph: the same pairs rewritten into
    the same piece counts (else an error, before any collective could mismatch), and the same
    records and steps for the report."""
    kept = {r.collective: r.chunks for r in choice.records if r.kept}
    if kept:
        gm = decompose_pass(
            gm, work, coords, hardware=table, only=frozenset(kept), pieces={r.collective: r.chunks for r in choice.records}
        )
        mine = {r.collective: r.chunks for r in gm.meta[DECOMPOSED_KEY] if r.kept}
        differing = [r for r in choice.records if r.kept and mine.get(r.collective) != r.chunks]
        if differing:
            pair = differing[0]
            raise AutoparError(
                f"the {pair.kind} {pair.collective} into {', '.join(pair.matmuls)} at {pair.where} was decomposed into"
                f" {pair.chunks} pieces for the program, but rank {coords}'s block cannot be cut so"
                f" ({mine.get(pair.collective, 'no')} pieces)",
                hint='decompose_matmuls="off" (or "on") compiles it; a block that divides alike on every rank decomposes',
            )
    if choice.records:
        gm.meta[DECOMPOSED_KEY] = choice.records
    if choice.steps:
        gm.meta[DECOMPOSED_STEPS_KEY] = dict(choice.steps)
    return gm


def _auto(
    gm: fx.GraphModule,
    work: Mesh,
    coords: tuple[int, ...],
    table: str,
    schedule: bool,
    in_flight_bytes: int,
    every_pair: bool,
    whole: Callable[[], tuple[Timeline, fx.GraphModule]] | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule | None]:
    """"auto" at this rank's coordinates: the graph with the pairs it keeps rewritten and, where
    it scheduled that graph to decide, the scheduled copy.

    It prices each pair against the time its collective stays exposed in the step scheduled
    without the rewrite (a scheduled copy, modeled on `table`). Where some pairs price shorter, the
    whole step is modeled, scheduled, with those pairs rewritten and (`every_pair`) with every pair
    rewritten, and the shortest of the steps is kept: a pair that prices faster alone can still
    slow the step (its pieces queue on the link ahead of other collectives). The mesh choice
    (`scheduled_step_time`) leaves out the every-pair trial, which a search's plans seldom win, to
    price each candidate with one scheduled trial. Batch chunks (over-decomposition) overlap their
    collectives already: not there."""
    if not find_pairs(gm, tuple(work.shape), coords):
        return gm, None

    def scheduled_step(graph: fx.GraphModule) -> tuple[Timeline, fx.GraphModule]:
        if schedule:
            graph = schedule_pass(graph, work, hardware=table, in_flight_bytes=in_flight_bytes)
        return simulate(graph, work, table), graph

    # (`whole`: the choice's scheduled copy of this very lowered graph, when it is at hand)
    timeline, scheduled = whole() if whole is not None and schedule else scheduled_step(graph_copy(gm))
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
