"""Which schedule and which cut a pipeline runs (docs/pipeline.md#choosing-the-schedule): the
user's, or with `schedule="auto"` the candidate whose modeled step is shortest among those that
fit the memory limit, each candidate priced by its own stage cut (`cut_stages`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from autopar.compiler.driver import compile_conditions
from autopar.core.errors import AutoparError, UsageError
from autopar.core.pipeline_schedule import Schedule, schedule_by_name
from autopar.passes.trace import trace
from autopar.planning.stage_cut import cut_stages
from autopar.planning.stage_result import StageCut, format_seconds
from autopar.runtime.agreement import decided_on_rank0

# schedule="auto" compares these (name, virtual stages per rank), in this order on ties.
AUTO_CANDIDATES = (("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2), ("gpipe", 1))


@dataclass(frozen=True)
class Candidate:
    """One schedule priced: its modeled step, the largest rank memory, whether it fits, and why
    it was not priced (`skipped`) when it could not run here."""

    schedule: str
    v: int
    step_time: float = math.inf
    memory: float = math.inf
    fits: bool = False
    skipped: str = ""


@dataclass(frozen=True)
class ScheduleChoice:
    """What `schedule="auto"` compared; `chosen` is the first row. `str()` prints the table."""

    candidates: tuple[Candidate, ...]

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    def __str__(self) -> str:
        lines = ["schedule           v  modeled step  memory/rank  fits"]
        for c in self.candidates:
            if c.skipped:
                lines.append(f"{c.schedule:<18} {c.v}  skipped: {c.skipped}")
                continue
            lines.append(
                f"{c.schedule:<18} {c.v}  {format_seconds(c.step_time):>12}  {c.memory / 1e9:>8.2f} GB  "
                f"{'yes' if c.fits else 'no'}"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class PipelineDecision:
    """The schedule a pipeline runs, its stage boundaries, the cost model's cut (None when one
    stage), and the comparison when the schedule was "auto"."""

    schedule: Schedule
    boundaries: tuple[str, ...]
    cut: StageCut | None
    choice: ScheduleChoice | None = None


@compile_conditions
def decide_pipeline(
    model: nn.Module,
    example: tuple[Any, ...],
    *,
    pp: int,
    microbatches: int,
    schedule: str,
    virtual_stages: int,
    hardware: str,
    tensor_size: int = 1,
    stage_boundaries: Sequence[str] | None = None,
    memory_limit: float | None = None,
    split_backward: bool = True,
    example_kwargs: dict[str, Any] | None = None,
) -> PipelineDecision:
    """Rank 0 decides and every rank gets the same decision (a collective over all ranks).

    A named schedule runs with the cost model's cut unless `stage_boundaries` forces one (which is
    priced too, so the timeline is in seconds). "auto" prices every candidate of
    `AUTO_CANDIDATES` (with `virtual_stages` > 1: those with that many stages per rank) and keeps
    the fastest that fits `memory_limit`; `split_backward=False` leaves out zero-bubble (stages
    that cannot split their backward)."""

    def decide() -> PipelineDecision:
        if schedule != "auto":
            plan = schedule_by_name(schedule, pp, virtual_stages, microbatches)
            cut = _priced(
                model, example, example_kwargs, schedule, plan, hardware, tensor_size, stage_boundaries, memory_limit
            )
            bounds = cut.boundaries if cut is not None else tuple(stage_boundaries or ())
            return PipelineDecision(plan, tuple(bounds), cut)
        return _auto(
            model, example, example_kwargs, pp, microbatches, virtual_stages, hardware, tensor_size,
            stage_boundaries, memory_limit, split_backward,
        )  # fmt: skip

    return decided_on_rank0(decide, "choosing the pipeline's schedule and cut")


def _priced(
    model: nn.Module,
    example: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None,
    name: str,
    plan: Schedule,
    hardware: str,
    tensor_size: int,
    stage_boundaries: Sequence[str] | None,
    memory_limit: float | None,
) -> StageCut | None:
    if plan.num_stages == 1:
        return None
    gm = trace(model, example, decompose=True, example_kwargs=example_kwargs)
    return cut_stages(
        gm,
        pp=plan.pp,
        microbatches=plan.microbatches,
        v=plan.v,
        schedule=name,
        hardware=hardware,
        tensor_size=tensor_size,
        memory_limit=math.inf if memory_limit is None else memory_limit,
        stage_boundaries=stage_boundaries,
    )


def _auto(
    model: nn.Module,
    example: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None,
    pp: int,
    microbatches: int,
    virtual_stages: int,
    hardware: str,
    tensor_size: int,
    stage_boundaries: Sequence[str] | None,
    memory_limit: float | None,
    split_backward: bool,
) -> PipelineDecision:
    gm = trace(model, example, decompose=True, example_kwargs=example_kwargs)
    rows: list[tuple[Candidate, PipelineDecision | None]] = []
    for name, v in AUTO_CANDIDATES:
        if virtual_stages > 1 and v != virtual_stages:
            continue
        if name == "zero-bubble" and not split_backward:
            rows.append((Candidate(name, v, skipped="these stages cannot split their backward"), None))
            continue
        if stage_boundaries is not None and len(stage_boundaries) != pp * v - 1:
            rows.append((Candidate(name, v, skipped=f"stage_boundaries name {len(stage_boundaries) + 1} stages"), None))
            continue
        try:
            plan = schedule_by_name(name, pp, v, microbatches)
            cut = cut_stages(
                gm,
                pp=pp,
                microbatches=microbatches,
                v=v,
                schedule=name,
                hardware=hardware,
                tensor_size=tensor_size,
                memory_limit=math.inf if memory_limit is None else memory_limit,
                stage_boundaries=stage_boundaries,
            )
        except AutoparError as exc:  # too few modules for pp * v stages, no cut fits, M too small
            rows.append((Candidate(name, v, skipped=str(exc).splitlines()[0]), None))
            continue
        memory = max(cut.rank_memory)
        row = Candidate(name, v, cut.step_time, memory, cut.fits)
        rows.append((row, PipelineDecision(plan, cut.boundaries, cut)))
    priced = [(c, d) for c, d in rows if d is not None]
    if not priced:
        raise UsageError(
            f"schedule='auto' found no schedule that runs {pp} pipeline ranks on this model: "
            + "; ".join(f"{c.schedule} v={c.v}: {c.skipped}" for c, _ in rows),
            hint="use fewer pipeline ranks, or name the schedule and its stage_boundaries",
        )
    ranked = sorted(priced, key=lambda cd: (not cd[0].fits, cd[0].step_time))
    order = [c for c, _ in ranked] + [c for c, d in rows if d is None]
    best = ranked[0][1]
    assert best is not None
    return PipelineDecision(best.schedule, best.boundaries, best.cut, ScheduleChoice(tuple(order)))
