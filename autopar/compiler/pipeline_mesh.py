"""Pipeline depths in the mesh choice (docs/pipeline.md#pipeline-depths-in-the-mesh-choice).

For a world of N ranks and M microbatches, every pipeline depth pp dividing N is a candidate
beside the tensor-only mesh choice: its stages run on sub-meshes of t = N / pp ranks. Every
candidate is priced with one step accounting (`autopar.planning.step_accounting`): the weight
state's bytes per parameter element (`weight_state_for`: mixed precision's float32 gradients,
masters and AdamW states for a 16-bit model), the data axis's gradient reduction once per step,
the optimizer step, and recomputation.

- The tensor-only candidate (pp = 1) is the tensor mesh choice (`choose_mesh`) on the whole batch
  as one step (what `parallelize` then runs: no microbatches). Its plan search counts every plan
  with the weight state's bytes per stored byte (`StateBytes.ratios`, recorded on the graph it
  plans: `planning.memory.set_state_ratios`), so each plan's storage is counted as it stores (a
  replicated plan holds p times a sharded one's state) and the search recomputes what it must to fit
  the limit with it; its step adds the optimizer step over the state it stores
  (`tensor_only_candidate`).
- A pipeline candidate's stage sub-mesh is the tensor mesh choice for t ranks on one microbatch,
  re-ranked for a step of M microbatches that reduces its gradients once (`per_step_best`: M times
  its time per microbatch without its gradient reduction, plus that reduction once). Its modeled
  step per microbatch over the ideal compute of that microbatch on t ranks is the sub-mesh's
  *efficiency factor* (its collectives and imbalance; 1 for t = 1). For each schedule of
  `AUTO_CANDIDATES` and each recomputation mode asked for (`recompute`, default "auto": none,
  selective and full, the fastest that fits), the stage cut is priced by `cut_stages` with work
  divided ideally by t, the sub-mesh's extra time per microbatch spread over the stages by compute
  (`StageCut.slowed`) and the schedule simulated again; the sub-mesh plan's gradient reduction is
  priced once per step by the cut, each pp rank its stages' share, where it runs past the rank's
  last backward (`StageCut.step_time`), and its weight state split as the plan splits the
  parameters.

The sub-mesh choice is the expensive part (hundreds of meshes at a thousand ranks), so it is
skipped where it cannot matter: every depth's ideal cuts are priced first, and a depth whose fastest
fitting ideal cut is already slower than the best candidate priced so far is listed as not priced.
The ideal cut bounds the depth's candidates from below: the sub-mesh's plan only adds time to the
stages (the schedule's order is fixed), adds its gradient reduction's exposed part, and splits the
weight state at most t ways, as the ideal cut does (branch and bound: the same choice as pricing
every depth; `bound_depths=False` prices them all). Depths are visited from the lowest bound up,
and every depth's sub-mesh choice plans one trace of one microbatch. The product is a model of a
model: the sub-mesh plan is of the whole model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.compiler.auto_mesh import choose_mesh, default_hardware, job_world, trace_for_choice
from autopar.compiler.driver import compile_conditions
from autopar.compiler.pipeline import split_microbatches
from autopar.compiler.pipeline_choice import AUTO_CANDIDATES
from autopar.core.errors import AutoparError, MeshError
from autopar.core.meta import has_info, info, signature
from autopar.cost.hardware import Hardware, load_hardware
from autopar.passes.trace import trace
from autopar.planning.memory import MEMORY_HEADROOM, StateRatios, set_state_ratios
from autopar.planning.mesh_choice import SEARCHED_CANDIDATES, MeshCandidate, MeshChoice, experts_text
from autopar.planning.search_seeds import has_grouped_mm
from autopar.planning.search_steps import StepCache
from autopar.planning.stage_cut import Schedules, cut_graph
from autopar.planning.stage_result import StageCut, format_seconds
from autopar.planning.stage_units import StageGraph, stage_graph
from autopar.planning.step_accounting import (
    RECOMPUTE_MODES,
    WeightState,
    optimizer_seconds,
    recompute_mode,
    weight_state_for,
)
from autopar.rules.base import RuleRegistry
from autopar.runtime.agreement import decided_on_rank0


@dataclass(frozen=True)
class PipelineCandidate:
    """One (pipeline depth, schedule) priced; pp = 1 is the tensor-only mesh choice's best."""

    pp: int
    stage_mesh: str  # the stage sub-mesh the tensor choice picked, e.g. "2x4 (x,y)"
    schedule: str
    v: int
    step_time: float = math.inf
    memory: float = math.inf
    fits: bool = False
    bubble: float = 0.0  # idle share of the modeled step, averaged over ranks
    factor: float = 1.0  # the sub-mesh's modeled step over its ideal compute
    error: str = ""  # why it has no price
    stage_shape: tuple[int, ...] = ()  # the sub-mesh (pp = 1: the whole mesh)
    stage_names: tuple[str, ...] = ()
    # what the blocks run again in backward (`step_accounting.RECOMPUTE_MODES`); the tensor-only
    # candidate: "search", what its plan search recomputes to fit the memory limit; "-": not priced
    recompute: str = "none"
    # the stage sub-mesh's axis names holding the MoE layers' experts (`MeshCandidate.experts`): ()
    # whole on every rank, None no expert dim or not priced
    experts: tuple[str, ...] | None = None

    @property
    def experts_on(self) -> str:
        """Where its plan holds the experts, as the table shows it (`mesh_choice.experts_text`)."""
        return experts_text(self.experts, self.stage_names, self.stage_shape)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The DeviceMesh this candidate runs on: ("pp", *stage_names) unless pp = 1."""
        return self.stage_shape if self.pp == 1 else (self.pp, *self.stage_shape)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        return self.stage_names if self.pp == 1 else ("pp", *self.stage_names)


@dataclass
class PipelineMeshChoice:
    """Every depth priced, fastest that fits first; `tensor_only` is the pp = 1 choice's table."""

    world_size: int
    microbatches: int
    hardware: str
    candidates: list[PipelineCandidate]
    tensor_only: MeshChoice | None

    @property
    def chosen(self) -> PipelineCandidate:
        return self.candidates[0]

    def table(self) -> str:
        """One row per candidate; with MoE layers, a last column says which stage sub-mesh axes hold
        the experts (`PipelineCandidate.experts_on`)."""
        moe = any(c.experts is not None for c in self.candidates)
        lines = [
            f"mesh choice with pipeline depths: {self.world_size} ranks, {self.microbatches} microbatches, "
            f"on {self.hardware}",
            "  pp  stage mesh            schedule          v  recompute  modeled step  bubble  factor  memory/rank  fits"
            + ("  experts on" if moe else ""),
        ]
        for c in self.candidates:
            head = f"{c.pp:>4}  {c.stage_mesh:<20}  {c.schedule:<16} {c.v}  {c.recompute:<9}"
            if c.error:
                lines.append(f"{head}  {c.error}")
                continue
            row = (
                f"{head}  {format_seconds(c.step_time):>12}  "
                f"{c.bubble:>6.3f}  {c.factor:>6.2f}  {c.memory / 1e9:>8.2f} GB  {'yes' if c.fits else 'no':<4}"
            )
            lines.append(f"{row}  {c.experts_on}" if moe else row.rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@compile_conditions
def choose_pipeline_mesh(
    model: nn.Module,
    world_size: int,
    example_inputs: Sequence[Any],
    *,
    microbatches: int,
    hardware: str = "h100-nvlink-ib",
    memory_limit: float | None = None,
    registry: RuleRegistry | None = None,
    depths: Sequence[int] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    weight_state: WeightState | str | None = None,
    recompute: bool | str = "auto",
    bound_depths: bool = True,
    searched_candidates: int = SEARCHED_CANDIDATES,
    token_dispatch: str = "allgather",
    stage_meshes: Sequence[tuple[tuple[int, ...], tuple[str, ...]]] | None = None,
    schedules: Sequence[tuple[str, int]] = AUTO_CANDIDATES,
    with_tensor_only: bool = True,
    keep_plan: bool = False,
) -> PipelineMeshChoice:
    """Rank the tensor-only mesh choice's best beside every pipeline depth of `depths` (default:
    every divisor of `world_size` above 1 that the model has modules enough for) and schedule.

    Every candidate is priced with one step accounting (module doc): `weight_state` (a
    `WeightState`, "plain", "mixed", or None: by the parameters' dtype, `weight_state_for`) sets
    the bytes per parameter element and the optimizer step of every candidate; `recompute`
    ("auto", "none", "selective", "full"; True is "full") what a pipeline cut's blocks run again in
    backward, "auto" each and the fastest that fits per depth and schedule. The tensor-only
    candidate recomputes what its plan search chooses to fit `memory_limit` (default: 90 % of the
    table's device memory). `bound_depths`: skip a depth's stage sub-mesh choice (its most
    expensive part) when its fastest fitting ideal cut is already slower than the best candidate
    priced (module doc: branch and bound, the same choice as pricing every depth); False prices
    every depth. `searched_candidates`: handed to every mesh choice (`choose_mesh`; 0 searches
    every mesh): with `bound_depths=False` and 0 the ranking is exhaustive
    (`tests/test_plan_scale.py` holds the default's choice to it). `token_dispatch`
    (`PlanOptions.token_dispatch`): how the tensor-only choice and every stage sub-mesh's choice
    dispatch MoE layers' tokens (`choose_mesh`), so a depth's sub-mesh is priced with the
    dispatcher its stages will run.

    Restricting the space prices a given layout with the same accounting (a published job against
    the choice, `benchmarks/moe_pipelined.py`): `stage_meshes` (shape, names) are the only stage
    sub-meshes each depth's choice considers (`choose_mesh(candidates=...)`), `schedules` the
    (schedule, virtual stages) pairs priced (default `AUTO_CANDIDATES`), and `with_tensor_only=False`
    leaves the tensor-only candidate out (a pipeline is wanted: its mesh choice on every rank is
    the costliest part at thousands of ranks). `keep_plan`: the tensor-only choice keeps its trace and
    searched plan (`choose_mesh(keep_plan=)`), so that where pp = 1 wins `autopar.plan` compiles the
    plan that was ranked instead of searching again (a graph: never sent between ranks)."""
    example = tuple(example_inputs)
    modes = RECOMPUTE_MODES if recompute == "auto" else (recompute_mode(recompute),)
    hw = load_hardware(hardware)
    # a rank's memory: the device's, or on a CPU table the machine's over the job's ranks, less the runtime's
    limit = hw.rank_memory(world_size) * MEMORY_HEADROOM if memory_limit is None else float(memory_limit)
    gm = trace(model, example, decompose=True, example_kwargs=example_kwargs)
    state = StateBytes.of(gm, weight_state_for(gm, weight_state))
    moe = has_grouped_mm(gm)  # an expert dim: the rows say where each candidate holds the experts
    candidates: list[PipelineCandidate] = []
    tensor_only: MeshChoice | None = None
    steps = StepCache()  # pairs of placements, shared by every choice below (they depend on ndim only)
    if with_tensor_only:
        try:
            # every plan the search weighs is counted with the weight state (module doc): a limit taken
            # down by the sharded share, as before, let replicated storage through 5 bytes per stored
            # byte over it (PTD-P 1.7B on 4x8: 95.8 GB of 80)
            whole = trace_for_choice(model, world_size, example, example_kwargs=example_kwargs, token_dispatch=token_dispatch)
            set_state_ratios(whole, state.ratios)
            tensor_only = choose_mesh(model, world_size, example, hardware=hardware, memory_limit=limit,
                                      example_kwargs=example_kwargs, registry=registry, traced=whole,
                                      searched_candidates=searched_candidates, steps=steps,
                                      token_dispatch=token_dispatch, keep_plan=keep_plan)  # fmt: skip
            candidates.append(tensor_only_candidate(tensor_only.chosen, state, hw, limit, world_size))
        except AutoparError as exc:
            candidates.append(PipelineCandidate(1, "-", "-", 1, error=str(exc).splitlines()[0], recompute="search"))
    piece_args, piece_kwargs = split_microbatches((example, dict(example_kwargs or {})), microbatches)[0]
    wanted = depths if depths is not None else [p for p in range(2, world_size + 1) if world_size % p == 0]
    graphs = _StageGraphs(gm, hw)  # one analysis per stage sub-mesh size, shared by its schedules
    cut_all = functools.partial(
        _cuts, graphs, microbatches=microbatches, limit=limit, weight_state=state.weight_state,
        modes=modes, schedules=schedules,
    )  # fmt: skip
    # every depth's ideal cuts first: they do not need the stage sub-mesh's plan, which only slows them
    cuts = {pp: cut_all(pp, world_size // pp) for pp in wanted}
    fastest = min((c.step_time for c in candidates if c.fits and not c.error), default=math.inf)
    rows: dict[int, list[PipelineCandidate]] = {}
    piece: list[fx.GraphModule] = []  # one microbatch's trace, shared by every depth's sub-mesh choice
    for pp in sorted(wanted, key=lambda pp: (_bound(cuts[pp]), wanted.index(pp))):
        t = world_size // pp
        priced = [cut for *_, cut in cuts[pp] if not isinstance(cut, AutoparError)]
        bound = _bound(cuts[pp])
        if bound_depths and priced and t > 1 and bound > fastest:  # (t = 1: nothing to save)
            why = "not priced: no cut fits"
            if math.isfinite(bound):
                why = f"not priced: ideal cut {format_seconds(bound)} > best {format_seconds(fastest)}"
            rows[pp] = [PipelineCandidate(pp, f"{t} rank{'s' if t > 1 else ''}", "-", 1, error=why, recompute="-")]
            continue
        factor, label = 1.0, "1 rank"
        shape: tuple[int, ...] = (1,)
        names: tuple[str, ...] = ("stage",)
        sub_time = 0.0
        experts: tuple[str, ...] | None = () if moe else None  # one rank per stage: every expert of its layers on it
        if t > 1 and priced:
            try:
                if not piece:
                    piece.append(trace_for_choice(
                        model, t, piece_args, example_kwargs=piece_kwargs, token_dispatch=token_dispatch
                    ))  # fmt: skip
                # the whole model on t ranks need not fit: a stage holds 1/pp of it (the cut's memory)
                sub = choose_mesh(
                    model, t, piece_args, hardware=hardware, registry=registry, example_kwargs=piece_kwargs,
                    memory_limit=math.inf, traced=piece[0], searched_candidates=searched_candidates,
                    steps=steps, token_dispatch=token_dispatch, candidates=stage_meshes,
                )  # fmt: skip
            except AutoparError as exc:
                rows[pp] = [PipelineCandidate(pp, f"{t} ranks", "-", 1, error=str(exc).splitlines()[0], recompute="-")]
                continue
            pick = per_step_best(sub, microbatches)
            label, shape, names, experts = pick.label, pick.shape, pick.names, pick.experts
            sub_time = per_microbatch(pick)  # its gradient reduction: once per step, by the cut
            shards = state.stored / pick.param_bytes if pick.param_bytes > 0 else None  # as the plan splits them
            cuts[pp] = cut_all(pp, t, shards=shards, grad=pick.reduce_time)
        elif t > 1:
            label = f"{t} ranks"
        rows[pp] = []
        for name, v, group in _by_schedule(cuts[pp]):
            options: list[PipelineCandidate] = []
            for mode, cut in group:
                if isinstance(cut, AutoparError):
                    options.append(PipelineCandidate(pp, label, name, v, error=str(cut).splitlines()[0], recompute=mode))
                    continue
                if t > 1:  # the sub-mesh's collectives and imbalance, per microbatch, added to the stages
                    ideal = (cut.total_time - cut.recompute_time) / microbatches  # (its plan recomputes nothing)
                    factor = sub_time / ideal if ideal > 0 else 1.0
                    cut = cut.slowed(max(0.0, sub_time - ideal) * microbatches)
                memory = max(cut.rank_memory)
                options.append(PipelineCandidate(
                    pp, label, name, v, cut.step_time, memory, memory <= limit, cut.bubble, factor,
                    stage_shape=shape, stage_names=names, recompute=mode, experts=experts,
                ))  # fmt: skip
            row = _best_option(options)
            rows[pp].append(row)
            if row.fits and not row.error:
                fastest = min(fastest, row.step_time)
    candidates.extend(row for pp in wanted for row in rows[pp])
    candidates.sort(key=lambda c: (bool(c.error), not c.fits, c.step_time))
    return PipelineMeshChoice(world_size, microbatches, hardware, candidates, tensor_only)


@dataclass(frozen=True)
class StateBytes:
    """The model's weight state under `weight_state`, whole: `stored` bytes of parameters and
    buffers as traced, `extra` bytes of state per stored byte beyond the plain count (the
    parameter, its gradient and two AdamW states in the traced dtype: 4 per byte), `step` bytes
    the optimizer step moves per stored byte, and `grad` gradient bytes per stored byte."""

    weight_state: WeightState
    stored: float
    extra: float
    step: float
    grad: float = 1.0

    @property
    def ratios(self) -> StateRatios:
        """Gradient and optimizer bytes per stored byte, as the plan search counts a plan's state
        (`planning.memory.StateRatios`): the gradient's, and the rest of the state beyond it."""
        return StateRatios(grad=self.grad, optimizer=3.0 + self.extra - self.grad)

    @staticmethod
    def of(gm: fx.GraphModule, weight_state: WeightState) -> StateBytes:
        sig = signature(gm)
        stored = held = step = grad = 0.0
        for n in gm.graph.nodes:
            if n.op != "placeholder" or not has_info(n) or info(n).role not in ("param", "buffer", "constant"):
                continue
            val = n.meta["val"]
            size = val.element_size()
            stored += val.numel() * size
            if info(n).role == "param" and sig.requires_grad.get(info(n).param_name or n.name, True):
                held += val.numel() * weight_state.bytes(size)
                step += val.numel() * weight_state.step_bytes(size)
                grad += val.numel() * weight_state.grad_bytes(size)
            else:
                held += 4 * val.numel() * size  # a buffer: counted as the plain count counts it
                grad += val.numel() * size
        if stored <= 0:
            return StateBytes(weight_state, 0.0, 0.0, 0.0)
        return StateBytes(weight_state, stored, held / stored - 4.0, step / stored, grad / stored)


def tensor_only_candidate(
    best: MeshCandidate, state: StateBytes, hw: Hardware, limit: float, world_size: int
) -> PipelineCandidate:
    """The tensor-only mesh choice's best (the whole batch in one step, its gradient reduction in
    it) under the weight state's accounting: its memory as its search counted it (with the
    state's ratios, `StateBytes.ratios`), its step with the optimizer step over the state it
    stores."""
    stored = best.param_bytes if math.isfinite(best.param_bytes) else state.stored / world_size
    memory = best.memory
    step = best.rank_time + optimizer_seconds(state.step * stored, hw)
    return PipelineCandidate(
        1, best.label, "-", 1, step, memory, memory <= limit, stage_shape=best.shape, stage_names=best.names,
        recompute="search", experts=best.experts,
    )  # fmt: skip


def per_microbatch(candidate: MeshCandidate) -> float:
    """A stage sub-mesh plan's time per microbatch without its gradient reduction (which a pipeline
    or accumulated microbatches run once per step): min(scheduled step, no-overlap sum - reduction),
    an upper bound either way, since taking work out cannot lengthen a step."""
    return min(candidate.rank_time, candidate.step_time - candidate.reduce_time)


def per_step_best(choice: MeshChoice, microbatches: int) -> MeshCandidate:
    """The sub-mesh candidate fastest over a step of `microbatches` microbatches: M times its time
    per microbatch (`per_microbatch`) plus its gradient reduction once, not overlapped (the choice's
    own ranking counts the reduction in each microbatch's step, which favours small data axes)."""
    fitting = [c for c in choice.candidates if c.fits and math.isfinite(c.step_time)]
    if not fitting:
        return choice.chosen
    return min(fitting, key=lambda c: microbatches * per_microbatch(c) + c.reduce_time)


def _by_schedule(
    cuts: list[tuple[str, int, str, StageCut | AutoparError]],
) -> list[tuple[str, int, list[tuple[str, StageCut | AutoparError]]]]:
    """The cuts of one depth grouped by schedule (name, v), each with its recomputation modes."""
    groups: dict[tuple[str, int], list[tuple[str, StageCut | AutoparError]]] = {}
    for name, v, mode, cut in cuts:
        groups.setdefault((name, v), []).append((mode, cut))
    return [(name, v, group) for (name, v), group in groups.items()]


def _best_option(options: list[PipelineCandidate]) -> PipelineCandidate:
    """Of one schedule's recomputation modes: the fastest that fits, else the leanest priced, else
    the last mode's error (the leanest mode's: its need is the smallest)."""
    priced = [c for c in options if not c.error]
    fitting = [c for c in priced if c.fits]
    if fitting:
        return min(fitting, key=lambda c: c.step_time)
    if priced:
        return min(priced, key=lambda c: c.memory)
    return options[-1]


class _StageGraphs:
    """`stage_graph` of one traced graph per stage sub-mesh size t, each analysed once: every
    depth cuts it for each schedule of `AUTO_CANDIDATES`, before and after its sub-mesh choice
    (a walk over every node of a 96-layer graph each time, otherwise)."""

    def __init__(self, gm: fx.GraphModule, hardware: Hardware) -> None:
        self.gm, self.hardware = gm, hardware
        self.by_size: dict[int, StageGraph] = {}
        self.schedules = Schedules()  # each (schedule, depth) built once for every mode and cut

    def of(self, t: int) -> StageGraph:
        found = self.by_size.get(t)
        if found is None:
            found = self.by_size[t] = stage_graph(self.gm, self.hardware, t)
        return found


def _cuts(
    graphs: _StageGraphs,
    pp: int,
    t: int,
    *,
    microbatches: int,
    limit: float,
    weight_state: WeightState,
    modes: Sequence[str],
    schedules: Sequence[tuple[str, int]] = AUTO_CANDIDATES,
    shards: float | None = None,
    grad: float | None = None,
) -> list[tuple[str, int, str, StageCut | AutoparError]]:
    """Each schedule of `schedules` under each recomputation mode of `modes`, cut at depth
    `pp` with work divided ideally by `t`, or why it cannot be. Without the sub-mesh plan's `shards`
    (how many ways it splits the weight state) and `grad` (its gradient reduction, priced once per
    step) the cut is the ideal one: state split t ways, no reduction."""
    out: list[tuple[str, int, str, StageCut | AutoparError]] = []
    for name, v in schedules:
        for mode in modes:
            try:
                cut = cut_graph(
                    graphs.of(t), pp=pp, microbatches=microbatches, v=v, schedule=name, memory_limit=limit, weight_state=weight_state, state_shards=shards,
                    grad_reduce=grad, recompute=mode, schedules=graphs.schedules,
                )  # fmt: skip
            except AutoparError as exc:
                out.append((name, v, mode, exc))
                continue
            out.append((name, v, mode, cut))
    return out


def _bound(cuts: list[tuple[str, int, str, StageCut | AutoparError]]) -> float:
    """A lower bound on every fitting candidate of one depth: the fastest fitting ideal cut's step.
    The sub-mesh's plan only adds time to the stages (`StageCut.slowed`, never shorter: the
    schedule's order is fixed) and a gradient reduction, and splits the weight state at most t ways
    as the ideal cut does (so no more memory fits); inf when none fits."""
    fitting = [cut.step_time for *_, cut in cuts if not isinstance(cut, AutoparError) and cut.fits]
    return min(fitting, default=math.inf)


def auto_pipeline_mesh(
    model: nn.Module,
    mesh: DeviceMesh | int,
    example_inputs: Sequence[Any],
    *,
    microbatches: int,
    hardware: str | None = None,
    memory_limit: float | None = None,
    registry: RuleRegistry | None = None,
    example_kwargs: dict[str, Any] | None = None,
    weight_state: WeightState | str | None = None,
    recompute: bool | str = "auto",
    token_dispatch: str = "allgather",
) -> tuple[DeviceMesh, PipelineMeshChoice]:
    """`parallelize(..., mesh_shape="auto", microbatches=M)`: rank 0 ranks every pipeline depth
    beside the tensor-only meshes (`weight_state`, `recompute`, `token_dispatch`: `PlanOptions`'s), every rank builds
    the chosen DeviceMesh (with a "pp" axis when a pipeline won). `mesh`: the job's DeviceMesh or
    its world size."""
    world, device_type = job_world(mesh)
    choice = decided_on_rank0(
        lambda: choose_pipeline_mesh(
            model, world, example_inputs, microbatches=microbatches,
            hardware=hardware or default_hardware(device_type), memory_limit=memory_limit, registry=registry,
            example_kwargs=example_kwargs, weight_state=weight_state, recompute=recompute,
            token_dispatch=token_dispatch,
        ),
        "choosing the mesh with pipeline depths",
    )  # fmt: skip
    best = choice.chosen
    if best.error or not best.fits:
        raise MeshError(
            f"no mesh of {world} ranks, with or without a pipeline, fits: {best.error or 'over the memory limit'}",
            hint="raise memory_limit, or use more ranks",
        )
    chosen = init_device_mesh(device_type, best.mesh_shape, mesh_dim_names=best.mesh_names)
    return chosen, choice
