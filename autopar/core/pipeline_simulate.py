"""Run a pipeline schedule's action lists without processes: check that it cannot deadlock and that
every dependency holds, and model its timeline (docs/pipeline.md#the-simulator).

Semantics, those of a gloo runtime that posts `isend` / `irecv` where the lists say:

- a SEND never blocks its rank (an `isend` whose work is waited at the end of the step); it takes
  `send` time units of its rank;
- a RECV blocks its rank until the matching SEND has been issued, then the data takes `recv` time
  units to arrive (gloo moves the bytes once both sides have posted: the transfer starts when the
  later of the two is posted);
- with `in_order=True` every pair of ranks is one FIFO channel: the k-th receive on rank b from
  rank a must be the k-th send from a to b (what a runtime without per-message tags needs);
- compute runs for its duration once its rank reaches it; its inputs must already be there (a
  receive earlier in the list, or the producing action earlier on the same rank).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from autopar.core.pipeline_schedule import (
    RECV_KINDS,
    SEND_KINDS,
    Action,
    ActionKind,
    PipelineScheduleError,
    Schedule,
    ScheduleArgumentError,
)


class ScheduleDeadlockError(PipelineScheduleError):
    """Every rank that still has actions waits on a receive whose send never comes."""


class ScheduleDependencyError(PipelineScheduleError):
    """An action runs before what it needs, twice, on the wrong rank, or not at all."""


PerStage = float | tuple[float, ...]
_F, _B, _I, _W = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


@dataclass(frozen=True)
class Durations:
    """Time of each action kind, one number or one per stage. `send` is the time a send occupies its
    rank, `recv` the transfer time of the message a receive waits for."""

    forward: PerStage = 1.0
    backward: PerStage = 2.0
    backward_input: PerStage = 1.0
    backward_weight: PerStage = 1.0
    send: PerStage = 0.0
    recv: PerStage = 0.0

    def of(self, action: Action) -> float:
        value = {
            ActionKind.FORWARD: self.forward,
            ActionKind.BACKWARD: self.backward,
            ActionKind.BACKWARD_INPUT: self.backward_input,
            ActionKind.BACKWARD_WEIGHT: self.backward_weight,
            ActionKind.SEND_F: self.send,
            ActionKind.SEND_B: self.send,
            ActionKind.RECV_F: self.recv,
            ActionKind.RECV_B: self.recv,
        }[action.kind]
        return float(value if isinstance(value, (int, float)) else value[action.stage])


@dataclass(frozen=True)
class TimedAction:
    """One action of a simulated timeline; a receive's span includes its wait for the data."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """A simulated step: each rank's actions with start and end times, in the rank's order.
    `peak_in_flight[r]` is the most (stage, microbatch) pairs whose forward rank r had run and whose
    backward (B, or W after I) it had not: the activations it holds, in stage-microbatch units."""

    schedule: Schedule
    durations: Durations
    ranks: tuple[tuple[TimedAction, ...], ...]
    peak_in_flight: tuple[int, ...]

    @property
    def makespan(self) -> float:
        return max((row[-1].end for row in self.ranks if row), default=0.0)

    def busy(self, rank: int) -> float:
        """Time rank `rank` computes or posts sends (a receive's wait is idle)."""
        return sum(t.end - t.start for t in self.ranks[rank] if t.action.kind not in RECV_KINDS)


def bubble_fraction(timeline: Timeline, rank: int | None = None) -> float:
    """Idle share of the makespan, of one rank or averaged over ranks: (p-1)/(m+p-1) for GPipe and
    1F1B with uniform stages."""
    span = timeline.makespan
    if span <= 0:
        return 0.0
    ranks = range(timeline.schedule.pp) if rank is None else (rank,)
    return sum(1.0 - timeline.busy(r) / span for r in ranks) / len(ranks)


def bubble_ratio(timeline: Timeline) -> float:
    """Idle time over busy time, summed over ranks: the form of Megatron's (p-1)/(v*m), equal to
    `f / (1 - f)` of `bubble_fraction`'s f. Pooled, not a mean of each rank's ratio: a rank that
    holds almost nothing (a stage of an embedding alone) would make that mean unbounded (7e9 on a
    16-stage cut) while its idle time is only one rank's makespan."""
    span = timeline.makespan
    busy = sum(timeline.busy(r) for r in range(timeline.schedule.pp))
    return (span * timeline.schedule.pp - busy) / busy if busy > 0 else 0.0


def _source_of_recv(action: Action) -> tuple[ActionKind, int, int]:
    """The send a receive matches: RECV_F of stage s takes SEND_F of s-1, RECV_B of s takes SEND_B of s+1."""
    if action.kind == ActionKind.RECV_F:
        return ActionKind.SEND_F, action.stage - 1, action.microbatch
    return ActionKind.SEND_B, action.stage + 1, action.microbatch


class _Run:
    """The simulation state of one schedule (one object per call: no shared state)."""

    def __init__(self, schedule: Schedule, durations: Durations, in_order: bool) -> None:
        self.schedule = schedule
        self.durations = durations
        self.in_order = in_order
        self.place = schedule.placement
        self.pos = [0] * schedule.pp
        self.clock = [0.0] * schedule.pp
        self.rows: list[list[TimedAction]] = [[] for _ in range(schedule.pp)]
        self.done: dict[tuple[ActionKind, int, int], float] = {}  # compute and receives, per rank implied
        self.sent: dict[tuple[ActionKind, int, int], tuple[int, float]] = {}  # send key -> (rank, end)
        self.received: set[tuple[ActionKind, int, int]] = set()  # matched send keys
        self.channels: dict[tuple[int, int], deque[tuple[ActionKind, int, int]]] = defaultdict(deque)
        self.live = [0] * schedule.pp
        self.peak = [0] * schedule.pp

    def fail(self, rank: int, action: Action, why: str, hint: str | None = None) -> ScheduleDependencyError:
        return ScheduleDependencyError(
            f"{self.schedule.name} (pp={self.schedule.pp}, v={self.schedule.v}, microbatches="
            f"{self.schedule.microbatches}): rank {rank} action {self.pos[rank]} {action}: {why}",
            hint=hint
            or "a schedule generator or a hand-written action list is wrong; print the Schedule to see every rank's list",
        )

    def need(self, rank: int, action: Action, key: tuple[ActionKind, int, int], what: str) -> None:
        if key not in self.done:
            raise self.fail(rank, action, f"needs {what} earlier on rank {rank}")

    def check_compute(self, rank: int, a: Action) -> None:
        last = self.place.num_stages - 1
        s, m = a.stage, a.microbatch
        if a.kind == _F and s > 0:
            if self.place.rank_of(s - 1) == rank:
                self.need(rank, a, (_F, s - 1, m), f"F{s - 1}.{m}")
            else:
                self.need(rank, a, (ActionKind.RECV_F, s, m), f"RECV_F{s}.{m}")
        if a.kind in (_B, _I):
            self.need(rank, a, (_F, s, m), f"F{s}.{m}")
            if s < last:
                if self.place.rank_of(s + 1) != rank:
                    self.need(rank, a, (ActionKind.RECV_B, s, m), f"RECV_B{s}.{m}")
                elif (_B, s + 1, m) not in self.done and (_I, s + 1, m) not in self.done:
                    raise self.fail(
                        rank, a, f"needs the backward of stage {s + 1} microbatch {m} earlier on rank {rank}"
                    )
            other = _I if a.kind == _B else _B
            if (other, s, m) in self.done:
                raise self.fail(rank, a, f"stage {s} microbatch {m} already had a {other.value}")
        if a.kind == ActionKind.BACKWARD_WEIGHT:
            self.need(rank, a, (_I, s, m), f"I{s}.{m}")

    def check_send(self, rank: int, a: Action) -> None:
        forward = a.kind == ActionKind.SEND_F
        to_stage = a.stage + 1 if forward else a.stage - 1
        if (
            not 0 <= to_stage < self.place.num_stages
            or self.place.rank_of(to_stage) != a.peer
            or a.peer == rank
        ):
            raise self.fail(rank, a, f"stage {to_stage} is not on peer rank {a.peer}")
        made = [ActionKind.FORWARD] if forward else [ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT]
        if not any((k, a.stage, a.microbatch) in self.done for k in made):
            raise self.fail(rank, a, "sends a value this rank has not computed yet")

    def step(self, rank: int) -> bool:
        """Run rank `rank`'s next action if it can run now; False when it waits on a receive."""
        a = self.schedule.actions[rank][self.pos[rank]]
        key = (a.kind, a.stage, a.microbatch)
        if not 0 <= a.stage < self.place.num_stages or self.place.rank_of(a.stage) != rank:
            raise self.fail(rank, a, f"stage {a.stage} does not live on rank {rank}")
        if not 0 <= a.microbatch < self.schedule.microbatches:
            raise self.fail(rank, a, f"there are only {self.schedule.microbatches} microbatches")
        if key in self.done or key in self.sent:
            raise self.fail(rank, a, "runs a second time")
        start = self.clock[rank]
        end = start + self.durations.of(a)
        if a.kind in RECV_KINDS:
            source = _source_of_recv(a)
            if (
                not 0 <= source[1] < self.place.num_stages
                or self.place.rank_of(source[1]) != a.peer
                or a.peer == rank
            ):
                raise self.fail(rank, a, f"stage {source[1]} is not on peer rank {a.peer}")
            if source not in self.sent:
                return False
            channel = self.channels[(a.peer, rank)]
            if self.in_order and channel[0] != source:
                k, s, m = channel[0]
                raise self.fail(
                    rank,
                    a,
                    f"rank {a.peer} sent {k.value}{s}.{m} to this rank first; a FIFO channel delivers that one",
                    hint="a runtime without per-message tags cannot run this order; tag each message by "
                    "(direction, stage, microbatch)",
                )
            channel.remove(source)
            self.received.add(source)
            end = max(start, self.sent[source][1]) + self.durations.of(a)
        elif a.kind in SEND_KINDS:
            self.check_send(rank, a)
            self.sent[key] = (rank, end)
            self.channels[(rank, a.peer if a.peer is not None else -1)].append(key)
        else:
            self.check_compute(rank, a)
            if a.kind == ActionKind.FORWARD:
                self.live[rank] += 1
                self.peak[rank] = max(self.peak[rank], self.live[rank])
            elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                self.live[rank] -= 1
        if a.kind not in SEND_KINDS:
            self.done[key] = end
        self.rows[rank].append(TimedAction(a, start, end))
        self.clock[rank] = end
        self.pos[rank] += 1
        return True

    def deadlock(self) -> ScheduleDeadlockError:
        stuck = []
        for rank, acts in enumerate(self.schedule.actions):
            if self.pos[rank] >= len(acts):
                continue
            a = acts[self.pos[rank]]
            kind, s, m = _source_of_recv(a)
            peer = a.peer if a.peer is not None else -1
            later = [
                i
                for i, b in enumerate(self.schedule.actions[peer])
                if (b.kind, b.stage, b.microbatch) == (kind, s, m)
            ]
            where = (
                f"rank {peer} has it at position {later[0]}, behind its own {self.schedule.actions[peer][self.pos[peer]]}"
                if later and self.pos[peer] < len(self.schedule.actions[peer])
                else f"rank {peer} never sends it"
            )
            stuck.append(
                f"rank {rank} at action {self.pos[rank]} {a} waits for {kind.value}{s}.{m} ({where})"
            )
        return ScheduleDeadlockError(
            f"{self.schedule.name} (pp={self.schedule.pp}, v={self.schedule.v}, microbatches="
            f"{self.schedule.microbatches}) deadlocks:\n    " + "\n    ".join(stuck),
            hint="each rank's receive must come after the send it waits for can be reached",
        )

    def finish(self) -> None:
        """Everything computed exactly once and every send received."""
        for key in self.sent:
            if key not in self.received:
                rank = self.sent[key][0]
                raise ScheduleDependencyError(
                    f"{self.schedule.name}: rank {rank} sends {key[0].value}{key[1]}.{key[2]} that no rank receives",
                    hint="every send needs exactly one matching receive on its peer",
                )
        for s in range(self.place.num_stages):
            for m in range(self.schedule.microbatches):
                missing = [k.value for k in (_F,) if (k, s, m) not in self.done]
                if (_B, s, m) not in self.done:
                    missing += [k.value for k in (_I, _W) if (k, s, m) not in self.done]
                if missing:
                    raise ScheduleDependencyError(
                        f"{self.schedule.name}: stage {s} microbatch {m} never runs {'/'.join(missing)} "
                        f"(rank {self.place.rank_of(s)})",
                        hint="every stage runs the forward and the backward of every microbatch once",
                    )


def simulate(schedule: Schedule, durations: Durations | None = None, *, in_order: bool = False) -> Timeline:
    """Run all ranks' lists together (see the module docstring for the semantics) and return the
    timeline; raise ScheduleDeadlockError or ScheduleDependencyError when the schedule cannot run."""
    durations = durations or Durations()
    for name, value in vars(durations).items():
        if not isinstance(value, (int, float)) and len(value) != schedule.num_stages:
            raise ScheduleArgumentError(
                f"durations.{name} has {len(value)} entries for {schedule.num_stages} stages",
                hint="give one number for all stages or one per stage",
            )
    run = _Run(schedule, durations, in_order)
    lengths = [len(acts) for acts in schedule.actions]
    if len(lengths) != schedule.pp:
        raise ScheduleDependencyError(
            f"{schedule.name}: {len(lengths)} action lists for pp={schedule.pp} ranks"
        )
    while True:
        moved = False
        for rank in range(schedule.pp):
            while run.pos[rank] < lengths[rank] and run.step(rank):
                moved = True
        if all(run.pos[r] >= lengths[r] for r in range(schedule.pp)):
            break
        if not moved:
            raise run.deadlock()
    run.finish()
    return Timeline(schedule, run.durations, tuple(tuple(row) for row in run.rows), tuple(run.peak))
