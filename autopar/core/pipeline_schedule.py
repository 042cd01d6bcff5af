"""Pipeline schedules as per-rank action lists: the vocabulary the pipeline runtime executes, the
cost model times and the planner compares (docs/pipeline.md#schedules).

A schedule is plain data: for every rank of the `pp` axis, the ordered actions it runs in one
training step (forward, backward, its input-gradient / weight-gradient halves, and the sends and
receives where a stage boundary crosses ranks). Nothing here touches tensors or processes;
`autopar.core.pipeline_simulate` checks a schedule and models its timeline.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from autopar.core.errors import AutoparError


class PipelineScheduleError(AutoparError):
    """A pipeline schedule cannot be built or does not run (a deadlock, a broken dependency)."""


class ScheduleArgumentError(PipelineScheduleError, ValueError):
    """The (stages, virtual stages, microbatches) asked for do not make a schedule of that kind."""


class ActionKind(StrEnum):
    """What one action does. The value is the short name used in printed schedules."""

    FORWARD = "F"
    BACKWARD = "B"  # input gradient and weight gradient together
    BACKWARD_INPUT = "I"  # input gradient only (zero-bubble)
    BACKWARD_WEIGHT = "W"  # weight gradient only, after the stage's BACKWARD_INPUT
    SEND_F = "SEND_F"  # the stage's output activation to the next stage's rank
    RECV_F = "RECV_F"  # the stage's input activation from the previous stage's rank
    SEND_B = "SEND_B"  # the gradient of the stage's input to the previous stage's rank
    RECV_B = "RECV_B"  # the gradient of the stage's output from the next stage's rank


COMPUTE_KINDS = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}
)
_F, _I, _W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
SEND_KINDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
RECV_KINDS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})


@dataclass(frozen=True)
class Action:
    """One step of one rank. `stage` is the stage on this rank the action belongs to: a SEND_F
    carries stage s's output to stage s+1 (whose RECV_F names s+1), a SEND_B carries the gradient
    of stage s's input to stage s-1 (whose RECV_B names s-1). `peer` is the other rank of a send or
    receive, None for compute."""

    kind: ActionKind
    stage: int
    microbatch: int
    peer: int | None = None

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        text = f"{self.kind.value}{self.stage}.{self.microbatch}"
        if self.kind in SEND_KINDS:
            return f"{text}->r{self.peer}"
        if self.kind in RECV_KINDS:
            return f"{text}<-r{self.peer}"
        return text


@dataclass(frozen=True)
class Placement:
    """Which rank holds which of the `pp * v` stages. "loop": stage s on rank s % pp (Megatron's
    interleaving); "v": rank r holds stages r and 2*pp-1-r (ZB-V, v=2), so the last stage sits on
    rank 0 beside the first and the turn at stage pp-1 / pp stays on one rank."""

    pp: int
    v: int = 1
    style: str = "loop"

    def __post_init__(self) -> None:
        if self.pp < 1 or self.v < 1:
            raise ScheduleArgumentError(
                f"a pipeline needs pp >= 1 and v >= 1, got pp={self.pp}, v={self.v}",
                hint="pp is the size of the pp mesh axis, v the number of stages per rank",
            )
        if self.style not in ("loop", "v"):
            raise ScheduleArgumentError(f"unknown stage placement {self.style!r}", hint='use "loop" or "v"')
        if self.style == "v" and self.v != 2:
            raise ScheduleArgumentError(
                f"the V placement holds exactly 2 stages per rank, got v={self.v}", hint="use v=2"
            )

    @property
    def num_stages(self) -> int:
        return self.pp * self.v

    def rank_of(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ScheduleArgumentError(f"stage {stage} is not one of the {self.num_stages} stages")
        if self.style == "v" and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The rank's stages, in model order."""
        return tuple(s for s in range(self.num_stages) if self.rank_of(s) == rank)


@dataclass(frozen=True)
class Schedule:
    """One training step of a pipeline: `actions[r]` is rank r's ordered action list, sends and
    receives included. `split_backward` says whether backwards are BACKWARD_INPUT + BACKWARD_WEIGHT
    pairs (zero-bubble) rather than one BACKWARD."""

    name: str
    placement: Placement
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    split_backward: bool = False

    @property
    def pp(self) -> int:
        return self.placement.pp

    @property
    def v(self) -> int:
        return self.placement.v

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    def compute_actions(self, rank: int) -> tuple[Action, ...]:
        """Rank `rank`'s compute actions in order (what a cost model or a comparison needs)."""
        return tuple(a for a in self.actions[rank] if a.is_compute)

    def __str__(self) -> str:
        head = f"{self.name}: pp={self.pp} v={self.v} microbatches={self.microbatches}"
        return "\n".join(
            [head] + [f"  rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions)]
        )


def with_comms(compute: Sequence[Sequence[Action]], placement: Placement) -> tuple[tuple[Action, ...], ...]:
    """Add the sends and receives a compute-only order needs: a send right after the action that
    makes the value, a receive right before the action that reads it, only where the two stages
    are on different ranks (adjacent stages on one rank pass the value locally)."""
    last = placement.num_stages - 1
    lists = []
    for rank, actions in enumerate(compute):
        out: list[Action] = []
        for a in actions:
            if a.kind == ActionKind.FORWARD and a.stage > 0:
                src = placement.rank_of(a.stage - 1)
                if src != rank:
                    out.append(Action(ActionKind.RECV_F, a.stage, a.microbatch, src))
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and a.stage < last:
                src = placement.rank_of(a.stage + 1)
                if src != rank:
                    out.append(Action(ActionKind.RECV_B, a.stage, a.microbatch, src))
            out.append(a)
            if a.kind == ActionKind.FORWARD and a.stage < last:
                dst = placement.rank_of(a.stage + 1)
                if dst != rank:
                    out.append(Action(ActionKind.SEND_F, a.stage, a.microbatch, dst))
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and a.stage > 0:
                dst = placement.rank_of(a.stage - 1)
                if dst != rank:
                    out.append(Action(ActionKind.SEND_B, a.stage, a.microbatch, dst))
        lists.append(tuple(out))
    return tuple(lists)


def _check_counts(pp: int, v: int, microbatches: int) -> None:
    if pp < 1 or v < 1 or microbatches < 1:
        raise ScheduleArgumentError(
            f"a pipeline schedule needs pp, v and microbatches >= 1, got pp={pp}, v={v}, "
            f"microbatches={microbatches}",
            hint="microbatches is how many pieces the batch is cut into; it may be below pp (the "
            "pipeline then never fills) but not 0",
        )


def _schedule(
    name: str,
    placement: Placement,
    microbatches: int,
    compute: Sequence[Sequence[Action]],
    split: bool = False,
) -> Schedule:
    return Schedule(name, placement, microbatches, with_comms(compute, placement), split)


def _f(stage: int, m: int) -> Action:
    return Action(ActionKind.FORWARD, stage, m)


def _b(stage: int, m: int, kind: ActionKind = ActionKind.BACKWARD) -> Action:
    return Action(kind, stage, m)


def gpipe(pp: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (in the same microbatch order): the simplest schedule and
    the one that keeps every microbatch's activations alive at once."""
    _check_counts(pp, 1, microbatches)
    placement = Placement(pp)
    ms = range(microbatches)
    compute = [[_f(r, m) for m in ms] + [_b(r, m) for m in ms] for r in range(pp)]
    return _schedule("gpipe", placement, microbatches, compute)


def forwards_then_backwards(placement: Placement, microbatches: int) -> Schedule:
    """GPipe's order on any placement: every rank runs all its forwards (stage by stage in model
    order, each stage's microbatches in order), then all its backwards (stages in reverse). The
    order a step needs when its loss is computed outside the model: no backward can start before
    the user has every microbatch's outputs. With one stage per rank it is `gpipe`; each rank holds
    all microbatches' activations of all its stages."""
    _check_counts(placement.pp, placement.v, microbatches)
    ms = range(microbatches)
    compute = []
    for r in range(placement.pp):
        stages = placement.stages_of(r)
        compute.append([_f(s, m) for s in stages for m in ms] + [_b(s, m) for s in reversed(stages) for m in ms])
    return _schedule("gpipe", placement, microbatches, compute)


def _one_f_one_b_order(forwards: Sequence[Action], backwards: Sequence[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then one forward and one backward alternately, then the backwards left."""
    warmup = min(warmup, len(forwards))
    order = list(forwards[:warmup])
    steady = len(forwards) - warmup
    for k in range(steady):
        order += [forwards[warmup + k], backwards[k]]
    return order + list(backwards[steady:])


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): rank r runs pp-1-r forwards ahead, then alternates one forward and
    one backward, so it holds at most pp-r microbatches' activations instead of all of them."""
    _check_counts(pp, 1, microbatches)
    placement = Placement(pp)
    ms = range(microbatches)
    compute = [
        _one_f_one_b_order([_f(r, m) for m in ms], [_b(r, m) for m in ms], pp - 1 - r) for r in range(pp)
    ]
    return _schedule("1f1b", placement, microbatches, compute)


def _rounds(pp: int, microbatches: int) -> list[range]:
    """Microbatches in rounds of at least pp (one round if there are fewer): each round goes
    through all of a rank's stages before the next starts (Megatron's groups of pp, generalized to
    any count by making some rounds one larger)."""
    count = max(1, microbatches // pp)
    size, extra = divmod(microbatches, count)
    rounds, start = [], 0
    for i in range(count):
        n = size + (1 if i < extra else 0)
        rounds.append(range(start, start + n))
        start += n
    return rounds


def interleaved_1f1b(pp: int, v: int, microbatches: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al., SC'21): v stages per rank (stage s on rank
    s % pp), forwards go round by round through the rank's stages in order and backwards in reverse,
    with (v-1)*round + 2*(pp-1-r) forwards of warmup. Any microbatch count works: rounds have at
    least pp microbatches where there are that many (Megatron asks for a multiple of pp)."""
    _check_counts(pp, v, microbatches)
    if v == 1:
        return one_f_one_b(pp, microbatches)
    placement = Placement(pp, v)
    rounds = _rounds(pp, microbatches)
    compute = []
    for r in range(pp):
        stages = placement.stages_of(r)
        forwards = [_f(s, m) for ms in rounds for s in stages for m in ms]
        backwards = [_b(s, m) for ms in rounds for s in reversed(stages) for m in ms]
        warmup = (v - 1) * len(rounds[0]) + 2 * (pp - 1 - r)
        compute.append(_one_f_one_b_order(forwards, backwards, warmup))
    return _schedule("interleaved-1f1b", placement, microbatches, compute)


def zero_bubble_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., ICLR'24): 1F1B whose backward is split into the input gradient (I), which
    the previous rank waits for, and the weight gradient (W), which nobody waits for. Rank r runs
    its I's in 1F1B order and lets up to r W's wait, running them where 1F1B would idle; rank r then
    holds at most pp microbatches' activations (those of F's whose W is not done), the first
    rank's 1F1B peak, so the peak over ranks stays 1F1B's."""
    _check_counts(pp, 1, microbatches)
    placement = Placement(pp)
    compute = []
    for r in range(pp):
        ms = range(microbatches)
        order = _one_f_one_b_order(
            [_f(r, m) for m in ms], [_b(r, m, ActionKind.BACKWARD_INPUT) for m in ms], pp - 1 - r
        )
        compute.append(_defer_weights(order, lag=r))
    return _schedule("zero-bubble", placement, microbatches, compute, split=True)


def _defer_weights(order: Sequence[Action], lag: int) -> list[Action]:
    """Put each I's W after the action that follows the I, once more than `lag` W's wait; the
    W's still waiting at the end run last, oldest first."""
    out: list[Action] = []
    waiting: list[Action] = []
    for a in order:
        out.append(a)
        if a.kind == ActionKind.BACKWARD_INPUT:
            waiting.append(Action(ActionKind.BACKWARD_WEIGHT, a.stage, a.microbatch))
            if len(waiting) > lag:
                out.append(waiting.pop(0))
    return out + waiting


def _zbv_rank_order(pp: int, r: int, microbatches: int) -> list[Action]:
    """Rank r's ZB-V order over `microbatches` (at least 2pp-1): the paper's warmup of forwards
    down the V, then F/I/W of the two stages alternately, then the drain of I's and W's."""
    down, up = r, 2 * pp - 1 - r
    order: list[Action] = []
    count: Counter[tuple[ActionKind, int]] = Counter()

    def run(*steps: tuple[int, ActionKind]) -> None:
        for stage, kind in steps:
            order.append(Action(kind, stage, count[(kind, stage)]))
            count[(kind, stage)] += 1

    for _ in range(2 * (pp - r) - 1):
        run((down, _F))
    for _ in range(r):
        run((up, _F), (down, _F))
    for _ in range(pp - r):
        run((up, _F), (up, _I), (up, _W))
    while count[(_F, up)] < count[(_F, down)] or count[(_F, down)] < microbatches:
        if count[(_F, down)] < microbatches:
            run((down, _F))
        run((down, _I), (down, _W), (up, _F), (up, _I), (up, _W))
    for _ in range(r):
        run((down, _I), (up, _I))
    for _ in range(pp - r):
        run((down, _I), (down, _W))
    for stage in (up, down):
        while count[(_W, stage)] < count[(_I, stage)]:
            run((stage, _W))
    return order


def zero_bubble_v(pp: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al., ICLR'24, section 6): two stages per rank in a V (rank r holds r and
    2pp-1-r), so the last stage's backward starts on rank 0 right after its forward. Built for
    max(M, 2pp-1) microbatches in the paper's phases and cut back to M (dropping whole
    microbatches keeps every remaining dependency, so the cut order still runs)."""
    _check_counts(pp, 2, microbatches)
    placement = Placement(pp, 2, "v")
    full = max(microbatches, 2 * pp - 1)
    compute = [[a for a in _zbv_rank_order(pp, r, full) if a.microbatch < microbatches] for r in range(pp)]
    return _schedule("zero-bubble-v", placement, microbatches, compute, split=True)


SCHEDULES: Mapping[str, Callable[[int, int, int], Schedule]] = MappingProxyType(
    {
        "gpipe": lambda pp, v, m: gpipe(pp, m),
        "1f1b": lambda pp, v, m: one_f_one_b(pp, m),
        "interleaved-1f1b": interleaved_1f1b,
        "zero-bubble": lambda pp, v, m: zero_bubble_v(pp, m) if v == 2 else zero_bubble_h1(pp, m),
    }
)


def schedule_by_name(name: str, pp: int, v: int, microbatches: int) -> Schedule:
    """The schedule `parallelize(schedule=...)` names. "zero-bubble" is ZB-H1 with v=1 and ZB-V
    with v=2; gpipe, 1f1b and zero-bubble with v=1 hold one stage per rank."""
    check_schedule(name, pp, v, microbatches)
    return SCHEDULES[name](pp, v, microbatches)


def check_schedule(name: str, pp: int, v: int, microbatches: int) -> None:
    """Raise what `schedule_by_name` raises for these arguments, without building the schedule
    (at a thousand ranks ZB-V's action lists take seconds to build)."""
    if name not in SCHEDULES:
        raise ScheduleArgumentError(
            f"unknown pipeline schedule {name!r}", hint=f"one of {', '.join(SCHEDULES)}"
        )
    allowed = {"gpipe": (1,), "1f1b": (1,), "zero-bubble": (1, 2)}.get(name)
    if allowed is not None and v not in allowed:
        raise ScheduleArgumentError(
            f"schedule {name!r} holds {' or '.join(map(str, allowed))} stage(s) per rank, got v={v}",
            hint='use "interleaved-1f1b" for more stages per rank',
        )
    _check_counts(pp, v, microbatches)
