"""What a pipeline stage cut is and what it is modeled to cost: one `Stage` per stage, the
`StageCut` with the simulated schedule and the step beyond it (gradient reduction once per step,
optimizer step), and its printed table. Made by `autopar.planning.stage_cut`, read by the
pipeline compiler and the step model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from autopar.core.pipeline_simulate import Durations, Timeline, bubble_fraction, bubble_ratio, simulate
from autopar.cost.formulas import format_bytes
from autopar.cost.hardware import Hardware, axis_links, load_hardware
from autopar.planning.stage_units import BoundaryTensor, compact
from autopar.planning.step_accounting import rank_step_end


@dataclass(frozen=True)
class Stage:
    """One stage of a cut. Times are seconds per training step (all microbatches) on one of its t
    tensor ranks; bytes are per tensor rank."""

    index: int
    rank: int
    units: tuple[str, ...]
    forward: float
    backward: float
    backward_input: float  # the part of `backward` the previous stage waits for (zero-bubble's I)
    param_bytes: float  # weights and buffers held, tied copies included
    state_bytes: float  # weights + gradients + masters + AdamW states (`WeightState`)
    activation_bytes: float  # saved for backward per microbatch
    fixed_activation_bytes: float  # saved once per step (views of weights)
    in_flight: int  # microbatches whose activations the schedule keeps at once
    send: tuple[BoundaryTensor, ...]  # to the next stage
    send_bytes: float  # per microbatch
    shared: tuple[str, ...]  # tied parameters another stage holds too (buffers are copied silently)
    recompute_bytes: float = 0.0  # recomputation: one block's rebuilt activations, while its backward runs
    recompute_time: float = 0.0  # the part of `backward` (and of `backward_input`) recomputation adds

    @property
    def time(self) -> float:
        return self.forward + self.backward

    @property
    def modules(self) -> str:
        return compact(self.units)

    @property
    def memory(self) -> float:
        return (
            self.state_bytes
            + self.in_flight * self.activation_bytes
            + self.fixed_activation_bytes
            + self.recompute_bytes
        )


@dataclass(frozen=True)
class StageCut:
    """A cut and what it is modeled to cost; `str()` prints the table."""

    stages: tuple[Stage, ...]
    boundaries: tuple[str, ...]  # the first module of stages 1.. (`stage_boundaries=` forces them)
    pp: int
    v: int
    microbatches: int
    schedule: str
    tensor_size: int
    hardware: str
    total_time: float  # modeled compute of the whole graph per step per tensor rank
    rank_memory: tuple[float, ...]  # per pp rank: its stages' states and its peak activations
    memory_limit: float
    forced: bool
    timeline: Timeline  # the schedule simulated with the stages' durations per microbatch
    # per pp rank, once per step: its gradients' reduction over the data axis (all of it, before
    # overlap), the optimizer step over its states, and its units (the reduction's buckets)
    reduce_time: tuple[float, ...] = ()
    optimizer_time: tuple[float, ...] = ()
    buckets: tuple[int, ...] = ()
    recompute: str = "none"  # `step_accounting.RECOMPUTE_MODES`: what the blocks run again in backward
    recompute_time: float = 0.0  # the part of `total_time` that recomputation adds

    @property
    def step_time(self) -> float:
        """The modeled training step: each rank's simulated schedule, then the part of its gradient
        reduction that runs past its last backward (`step_accounting.exposed_reduction`) and its
        optimizer step; the slowest rank's end."""
        return max(
            (
                rank_step_end(
                    row,
                    self.reduce_time[r] if self.reduce_time else 0.0,
                    self.buckets[r] if self.buckets else 1,
                    self.optimizer_time[r] if self.optimizer_time else 0.0,
                )
                for r, row in enumerate(self.timeline.ranks)
            ),
            default=0.0,
        )

    @property
    def fits(self) -> bool:
        """Whether every rank stays under the memory limit (a forced cut need not)."""
        return all(m <= self.memory_limit for m in self.rank_memory)

    @property
    def max_stage_time(self) -> float:
        return max(s.time for s in self.stages)

    @property
    def makespan(self) -> float:
        return self.timeline.makespan

    @property
    def bubble(self) -> float:
        """Idle share of the simulated step, averaged over ranks."""
        return bubble_fraction(self.timeline)

    @property
    def bubble_ratio(self) -> float:
        """Idle over busy time: the form of Megatron's (p-1)/(v*m), printed beside it."""
        return bubble_ratio(self.timeline)

    def slowed(self, overhead: float) -> StageCut:
        """This cut with `overhead` more seconds per step of each tensor rank's work (a stage
        sub-mesh plan's collectives and imbalance beyond the ideal division by t), spread over the
        stages in proportion to their compute without recomputation (the sub-mesh plan's, which
        recomputes nothing: the same overhead lands where it lands without it), and simulated again."""
        total = sum(st.time - st.recompute_time for st in self.stages)
        if overhead <= 0 or total <= 0:
            return self
        scale = 1.0 + overhead / total
        stages = tuple(
            replace(
                st,
                forward=st.forward * scale,
                backward=(st.backward - st.recompute_time) * scale + st.recompute_time,
                backward_input=(st.backward_input - st.recompute_time) * scale + st.recompute_time,
            )
            for st in self.stages
        )
        schedule = self.timeline.schedule
        durations = stage_durations(
            stages, self.pp, self.microbatches, self.tensor_size, load_hardware(self.hardware)
        )
        return replace(
            self, stages=stages, total_time=self.total_time + overhead, timeline=simulate(schedule, durations)
        )

    def __str__(self) -> str:
        head = (
            f"stage cut: pp={self.pp} v={self.v} microbatches={self.microbatches} schedule={self.schedule} "
            f"tensor ranks per stage={self.tensor_size} on {self.hardware}{' (forced)' if self.forced else ''}"
        )
        cols = (
            "stage",
            "rank",
            "modules",
            "time",
            "fwd / bwd per mb",
            "weights",
            "w+grad+adam",
            "act per mb x in flight",
            "memory",
            "sends per mb",
        )
        rows = []
        m = self.microbatches
        for s in self.stages:
            rows.append(
                (
                    str(s.index),
                    str(s.rank),
                    s.modules + (f" (tied: {', '.join(s.shared)})" if s.shared else ""),
                    format_seconds(s.time),
                    f"{format_seconds(s.forward / m)} / {format_seconds(s.backward / m)}",
                    format_bytes(s.param_bytes),
                    format_bytes(s.state_bytes),
                    f"{format_bytes(s.activation_bytes)} x {s.in_flight}",
                    format_bytes(s.memory),
                    f"{format_bytes(s.send_bytes)} ({len(s.send)})"
                    if s.index < len(self.stages) - 1
                    else "-",
                )
            )
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
        lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        ideal = (self.pp - 1) / (self.v * self.microbatches)
        lines.append(
            f"sum of stage times {format_seconds(self.total_time)}, longest stage {format_seconds(self.max_stage_time)} "
            f"(balance {self.total_time / len(self.stages) / self.max_stage_time:.3f})"
        )
        lines.append(
            "rank memory "
            + ", ".join(format_bytes(b) for b in self.rank_memory)
            + f" (limit {format_bytes(self.memory_limit) if math.isfinite(self.memory_limit) else 'none'}"
            + ("" if self.fits else ", OVER IT")
            + ")"
        )
        lines.append(
            f"simulated schedule {format_seconds(self.makespan)}, bubble {self.bubble:.3f} of it, "
            f"idle/busy {self.bubble_ratio:.3f} vs (p-1)/(v*m) = {ideal:.3f}"
        )
        lines.append(
            f"step {format_seconds(self.step_time)}: + gradient reduction once per step (largest "
            f"{format_seconds(max(self.reduce_time, default=0.0))} before overlap) + optimizer step "
            f"(largest {format_seconds(max(self.optimizer_time, default=0.0))})"
            + (f", blocks recomputed in backward ({self.recompute})" if self.recompute != "none" else "")
        )
        return "\n".join(lines)


def format_seconds(x: float) -> str:
    """Seconds in s, ms or us, three significant decimals."""
    if x >= 1.0:
        return f"{x:.3f} s"
    return f"{x * 1e3:.3f} ms" if x >= 1e-3 else f"{x * 1e6:.3f} us"


def stage_durations(
    stages: Sequence[Stage], pp: int, microbatches: int, tensor_size: int, hardware: Hardware
) -> Durations:
    """Per microbatch: each stage's forward, backward and its I/W parts; a receive takes the
    transfer of the larger of the stage's boundary tensors (in or out) over the pp axis's link,
    each tensor rank sending its 1/t block."""
    m = microbatches
    link = axis_links((pp, tensor_size), hardware)[0]

    def transfer(nbytes: float) -> float:
        return link.alpha + nbytes / link.bandwidth if nbytes > 0 else 0.0

    recv = tuple(
        transfer(max(st.send_bytes, stages[st.index - 1].send_bytes if st.index else 0.0)) for st in stages
    )
    return Durations(
        forward=tuple(st.forward / m for st in stages),
        backward=tuple(st.backward / m for st in stages),
        backward_input=tuple(st.backward_input / m for st in stages),
        backward_weight=tuple((st.backward - st.backward_input) / m for st in stages),
        send=0.0,
        recv=recv if pp > 1 else 0.0,
    )
