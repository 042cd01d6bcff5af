"""The calibrated training step of a tensor-, pipeline- and data-parallel run (issue 29): the one
step model `benchmarks/published.py` holds against published GPU runs and a planner prices a
configuration with. docs/planning.md, "The step model", works one row by hand.

A run is traced for ONE microbatch of one data-parallel replica and cut into its pipeline stages
(`stage_parts`); each stage's forward and backward are split into matmul time and element-wise
time (a second stage graph on the table with element-wise ops free); a causal attention call is
priced as the run's kernel does it (`StepConfig.attention`: its lower triangle under flash
attention, at the published rate of the kernel the run's framework uses for its head dimension
and sequence (`KernelRates.attention_fraction`: FlashAttention-2 under torch's SDPA, cuDNN under
Transformer Engine on Hopper), counted with the matmul time; all the scores under Megatron-LM
2021's masked softmax, as batched matmuls; `cost.work.PLANNED_ATTENTION`).
`price_step` then adds, in order:

1. compute: matmul time over the table's `kernels.sustained_matmul` (eta) plus element-wise time
   times the framework's `kernels.elementwise_factor` (phi, 1 for autopar's own unfused runtime);
2. the tensor-parallel collectives of every block: two all-reduces of a microbatch's
   activations (b s h, bf16) in forward, two in backward, over the tensor group's link (a
   sequence-parallel reduce-scatter + all-gather pair moves the same bytes); none when the run
   overlaps them;
3. recomputation of the blocks (`step_accounting.is_recomputed`: embeddings and head keep their
   activations): "full" runs a block's forward again, its collectives included, inside its
   backward; "selective" (torchtitan's op policy) every second matmul and the element-wise ops;
4. the pipeline schedule over the microbatches (`simulate`: bubble and point-to-point sends);
5. once per step on each pipeline rank (`step_accounting.rank_step_end`): the data axis's
   gradient reduction, float32 gradients (`WeightState.grad_bytes`), of what the rank holds, on
   `span_link`'s link; "allreduce" after the flush, or overlapped in one bucket per unit;
   "distopt" a reduce-scatter of the gradients and an all-gather of the bf16 weights, each
   overlapped with the rank's last backward / first forward when the run overlaps them; "fsdp"
   two weight all-gathers and a gradient reduce-scatter, hidden behind the rank's busy time; then
   the AdamW step over the rank's share of the states (`WeightState.step_bytes`, 30 bytes per
   element under mixed precision) at the bandwidth a pass of that size reaches.

The weight state a rank keeps (mixed precision: bf16 weight 2 + fp32 gradient 4 + fp32 master 4 +
AdamW 8 bytes): all of it replicated under "allreduce", master and AdamW split over the data axis
under "distopt" (Megatron's 6 + 12/d), all of it under "fsdp" (18/d).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.pipeline_schedule import ActionKind, schedule_by_name
from autopar.core.pipeline_simulate import simulate
from autopar.cost.formulas import collective_time
from autopar.cost.hardware import Hardware, KernelRates, span_link
from autopar.cost.work import ATTENTION_KERNELS, PLANNED_ATTENTION, AttentionKernel
from autopar.planning.stage_cut import cut_graph
from autopar.planning.stage_result import Stage, stage_durations
from autopar.planning.stage_units import StageGraph, stage_graph
from autopar.planning.step_accounting import (
    MIXED_ADAMW,
    WeightState,
    exposed_reduction,
    is_recomputed,
    optimizer_seconds,
    rank_step_end,
)

RECOMPUTE = ("none", "full", "selective")
REDUCTION = ("allreduce", "distopt", "fsdp")
ACTIVATION_BYTES = 2  # the tensor-parallel collectives move bf16 activations


@dataclass(frozen=True)
class StepConfig:
    """How a run is parallelized and what its framework does beyond the traced graph."""

    tensor: int
    pipeline: int
    data: int
    microbatches: int  # per pipeline replica per step
    v: int = 1
    schedule: str = "1f1b"
    tp_elements: float = 0.0  # elements of one tensor-parallel all-reduce: microbatch x sequence x hidden
    tp_overlap: bool = False
    recompute: str = "none"  # RECOMPUTE
    reduction: str = "allreduce"  # REDUCTION
    reduction_overlap: bool = False
    framework: str = "autopar"  # the key of `kernels.elementwise_factor`
    attention: AttentionKernel = PLANNED_ATTENTION  # how its kernel does causal attention (`cost.work`)
    weight_state: WeightState = MIXED_ADAMW
    itemsize: int = 2  # the traced parameters' bytes per element

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE or self.reduction not in REDUCTION or self.attention not in ATTENTION_KERNELS:
            raise AutoparError(
                f"step model: recompute={self.recompute!r}, reduction={self.reduction!r}, attention={self.attention!r}",
                hint=f"recompute is one of {RECOMPUTE}, reduction one of {REDUCTION}, attention one of {ATTENTION_KERNELS}",
            )


@dataclass(frozen=True)
class StageParts:
    """One stage per microbatch, per tensor rank, before the constants: its cut `stage`, its
    forward / backward / backward-input seconds split into matmul (`mm_*`) and element-wise
    (`el_*`), the forward of its recomputable blocks likewise (`again_mm`, `again_el`), its blocks
    (`layers`), its units (reduction buckets) and its trainable parameter elements."""

    stage: Stage
    mm_f: float
    mm_b: float
    mm_bi: float
    el_f: float
    el_b: float
    el_bi: float
    again_mm: float
    again_el: float
    layers: int
    units: int
    params: float


@dataclass(frozen=True)
class StepPrice:
    """A modeled step (seconds) and its parts; `state_bytes` per rank."""

    step: float
    pipeline: float  # the simulated schedule's makespan
    reduction: float  # the slowest rank's data-axis collectives before overlap
    exposed: float  # what of them the step waits for, on the rank that ends last
    optimizer: float
    tp_per_microbatch: float  # the largest stage's tensor-parallel collectives
    bubble: float
    state_bytes: float


def _kernels(hw: Hardware) -> KernelRates:
    if hw.kernels is None:
        raise AutoparError(
            f"the calibrated step model needs kernel rates; {hw.name} has none",
            hint="use a calibrated table (a100-calibrated, h100-calibrated) or add `kernels` to it",
        )
    return hw.kernels


def unscaled(hw: Hardware, framework: str = "autopar") -> Hardware:
    """`hw` without its fitted constants (eta = 1, no element-wise factors): the rates the
    microbenchmarks measured, what `stage_parts` splits so the constants apply after; attention
    at the rates of the kernel `framework` runs (`KernelRates.for_framework`)."""
    kernels = _kernels(hw).for_framework(framework)
    return replace(hw, kernels=replace(kernels, sustained_matmul=1.0, elementwise_factor={}))


def _matmul_only(hw: Hardware) -> Hardware:
    """`hw` with element-wise ops free (infinite bandwidth, no launch floor)."""
    return replace(hw, memory_bandwidth=1e30, kernels=replace(_kernels(hw), launch=0.0))


def stage_parts(gm: fx.GraphModule, hw: Hardware, config: StepConfig) -> tuple[StageParts, ...]:
    """Cut the joint graph of one microbatch of one replica (`trace`) into the run's stages and
    split each stage's time (see the module docstring)."""
    base = unscaled(hw, config.framework)
    full = stage_graph(gm, base, config.tensor, config.attention)
    mm = stage_graph(gm, _matmul_only(base), config.tensor, config.attention)
    cut = cut_graph(
        full, pp=config.pipeline, microbatches=1, v=config.v, schedule=config.schedule, memory_limit=math.inf
    )
    index = {u.name: i for i, u in enumerate(full.units)}
    trainable = {p for p, ok in full.trainable.items() if ok}
    parts = []
    for st in cut.stages:
        ids = [index[name] for name in st.units]
        again = [i for i in ids if is_recomputed(full.units[i].name)]

        def total(graph: StageGraph, field: str, which: Sequence[int]) -> float:
            return sum(getattr(graph.units[i], field) for i in which)

        mf, mb, mbi = (total(mm, f, ids) for f in ("forward", "backward", "backward_input"))
        f, b, bi = (total(full, f, ids) for f in ("forward", "backward", "backward_input"))
        again_mm = total(mm, "forward", again)
        names = {p for i in ids for p in full.units[i].params + full.units[i].reads} & trainable
        params = sum(full.state_bytes[p] / full.itemsize.get(p, 4) for p in names) / config.tensor
        again_el = total(full, "forward", again) - again_mm
        parts.append(
            StageParts(
                st, mf, mb, mbi, f - mf, b - mb, bi - mbi, again_mm, again_el, len(again), len(ids), params
            )
        )
    return tuple(parts)


def tp_collective_time(config: StepConfig, hw: Hardware) -> float:
    """One all-reduce of a microbatch's activations over the tensor group (ranks adjacent)."""
    link = span_link(hw, config.tensor, 1)
    return collective_time("all_reduce", config.tp_elements, ACTIVATION_BYTES, config.tensor, link)


def state_bytes(config: StepConfig, params: float) -> float:
    """Weight-state bytes a rank keeps for `params` elements (per tensor rank) under its reduction."""
    weight, grad, master, optimizer = config.weight_state.kinds(config.itemsize)
    d = config.data
    if config.reduction == "fsdp":
        return params * (weight + grad + master + optimizer) / d
    if config.reduction == "distopt":
        return params * (weight + grad + (master + optimizer) / d)
    return params * (weight + grad + master + optimizer)


def price_step(
    parts: Sequence[StageParts],
    config: StepConfig,
    hw: Hardware,
    *,
    eta: float | None = None,
    phi: float | None = None,
) -> StepPrice:
    """The modeled step of the module docstring. `eta` and `phi` default to the table's
    `kernels.sustained_matmul` and `kernels.elementwise(config.framework)` (a fit passes trials)."""
    kernels = _kernels(hw)
    eta = kernels.sustained_matmul if eta is None else eta
    phi = kernels.elementwise(config.framework) if phi is None else phi
    tp = 0.0 if config.tp_overlap else tp_collective_time(config, hw)
    stages = []
    for sp in parts:
        fwd = sp.mm_f / eta + phi * sp.el_f
        bwd = sp.mm_b / eta + phi * sp.el_b
        bwd_in = sp.mm_bi / eta + phi * sp.el_bi
        tp_f = tp_b = 2 * sp.layers * tp
        if config.recompute == "full":
            again = sp.again_mm / eta + phi * sp.again_el + tp_f
        elif config.recompute == "selective":
            again = 0.5 * sp.again_mm / eta + phi * sp.again_el
        else:
            again = 0.0
        stages.append(replace(sp.stage, forward=fwd + tp_f, backward=bwd + tp_b + again,
                              backward_input=bwd_in + tp_b + again))  # fmt: skip
    p = config.pipeline
    durations = stage_durations(stages, p, 1, config.tensor, hw)
    timeline = simulate(schedule_by_name(config.schedule, p, config.v, config.microbatches), durations)
    pipeline = timeline.makespan

    grad = int(config.weight_state.grad_bytes(config.itemsize))
    weight = int(config.weight_state.kinds(config.itemsize)[0])
    step_bytes = config.weight_state.step_bytes(config.itemsize)
    link = span_link(hw, config.data, config.tensor)
    d = config.data
    ends, reductions, exposures, optimizers, states = [], [], [], [], []
    for r, row in enumerate(timeline.ranks):
        mine = parts[r::p]
        params = sum(sp.params for sp in mine)
        buckets = sum(sp.units for sp in mine) if config.reduction_overlap else 1
        end = row[-1].end if row else 0.0
        if config.reduction == "allreduce":
            reduce = collective_time("all_reduce", params, grad, d, link)
            gather = 0.0
        elif config.reduction == "distopt":
            reduce = collective_time("reduce_scatter", params, grad, d, link)
            gather = collective_time("all_gather", params, weight, d, link)
        else:
            reduce = collective_time("reduce_scatter", params, grad, d, link)
            gather = 2 * collective_time("all_gather", params, weight, d, link)
        shards = d if config.reduction in ("distopt", "fsdp") else 1
        optimizer = optimizer_seconds(step_bytes * params / shards, hw)
        if config.reduction == "fsdp":
            busy = timeline.busy(r)
            exposed = max(0.0, reduce + gather - busy) if config.reduction_overlap else reduce + gather
            finish = end + exposed + optimizer
        else:
            finish = rank_step_end(row, reduce, buckets, optimizer)
            first = next((a.end - a.start for a in row if a.action.kind is ActionKind.FORWARD), 0.0)
            finish += exposed_reduction(gather, first, buckets) if config.reduction_overlap else gather
            exposed = finish - end - optimizer
        ends.append(finish)
        reductions.append(reduce + gather)
        exposures.append(exposed)
        optimizers.append(optimizer)
        states.append(state_bytes(config, params))
    last = max(range(p), key=ends.__getitem__)
    busiest = max(timeline.busy(r) for r in range(p))
    return StepPrice(
        step=ends[last],
        pipeline=pipeline,
        reduction=max(reductions),
        exposed=exposures[last],
        optimizer=optimizers[last],
        tp_per_microbatch=4 * tp * max(sp.layers for sp in parts),
        bubble=1.0 - busiest / pipeline if pipeline > 0 else 0.0,
        state_bytes=max(states),
    )
