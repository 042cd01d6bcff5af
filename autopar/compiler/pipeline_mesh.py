"""Pipeline depths in the mesh choice (docs/pipeline.md#pipeline-depths-in-the-mesh-choice).

For a world of N ranks and M microbatches, every pipeline depth pp dividing N is a candidate
beside the tensor-only meshes: its stages run on sub-meshes of t = N / pp ranks. A candidate is
priced in two parts that already exist:

- the stage sub-mesh: the tensor mesh choice (`choose_mesh`) for t ranks on one microbatch, whose
  best plan's modeled step over the ideal compute of that microbatch on t ranks is the sub-mesh's
  *efficiency factor* (its collectives and imbalance; 1 for t = 1);
- the pipeline: for each schedule of `AUTO_CANDIDATES`, the stage cut priced by `cut_stages` with
  work divided ideally by t, then the sub-mesh's extra time per microbatch (its modeled step less
  the ideal) spread over the stages by compute (`StageCut.slowed`) and the schedule simulated again.

The sub-mesh choice is the expensive part (hundreds of meshes at a thousand ranks), so it is
skipped where it cannot matter: every depth's ideal cuts are priced first, and a depth whose fastest
fitting ideal cut is already slower than the best candidate priced so far is listed as not priced.
The ideal cut bounds the depth's candidates from below: the sub-mesh's plan only adds time to the
stages (the schedule's order is fixed), adds its gradient reduction's exposed part, and splits the
weight state at most t ways, as the ideal cut does (branch and bound: the same choice as pricing
every depth; `bound_depths=False` prices them all). Depths are visited from the lowest bound up,
and every depth's sub-mesh choice plans one trace of one microbatch.

The product is a model of a model: the sub-mesh plan is of the whole model. Its gradient
reduction (`step_accounting.gradient_reduction_time`: the gradient outputs' redistributions) is
taken out of the per-microbatch time and priced once per step by the cut, each pp rank its
stages' share, where it runs past the rank's last backward (`StageCut.step_time`). The
per-microbatch time without it is min(scheduled step, no-overlap sum - reduction): an upper bound
either way, since taking work out cannot lengthen a step. The memory is the cut's: weight state
(`weight_state`) split as the sub-mesh plan splits the parameters, activations the schedule keeps
in flight.
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
from autopar.core.meta import has_info, info
from autopar.cost.hardware import Hardware, load_hardware
from autopar.passes.trace import trace
from autopar.planning.mesh_choice import SEARCHED_CANDIDATES, MeshChoice
from autopar.planning.search_steps import StepCache
from autopar.planning.stage_cut import cut_graph
from autopar.planning.stage_result import StageCut, format_seconds
from autopar.planning.stage_units import StageGraph, stage_graph
from autopar.planning.step_accounting import PLAIN, WeightState, gradient_reduction_time
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
        lines = [
            f"mesh choice with pipeline depths: {self.world_size} ranks, {self.microbatches} microbatches, "
            f"on {self.hardware}",
            "  pp  stage mesh            schedule          v  modeled step  bubble  factor  memory/rank  fits",
        ]
        for c in self.candidates:
            if c.error:
                lines.append(f"{c.pp:>4}  {c.stage_mesh:<20}  {c.schedule:<16} {c.v}  {c.error}")
                continue
            lines.append(
                f"{c.pp:>4}  {c.stage_mesh:<20}  {c.schedule:<16} {c.v}  {format_seconds(c.step_time):>12}  "
                f"{c.bubble:>6.3f}  {c.factor:>6.2f}  {c.memory / 1e9:>8.2f} GB  {'yes' if c.fits else 'no'}"
            )
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
    weight_state: WeightState = PLAIN,
    recompute: bool = False,
    bound_depths: bool = True,
    searched_candidates: int = SEARCHED_CANDIDATES,
) -> PipelineMeshChoice:
    """Rank the tensor-only mesh choice's best beside every pipeline depth of `depths` (default:
    every divisor of `world_size` above 1 that the model has modules enough for) and schedule.

    `weight_state` and `recompute` price the pipelines' cuts (`cut_graph`); the pipeline runtime
    does not recompute, so `recompute=True` models a run that does (the PTD-P benchmark).
    `bound_depths`: skip a depth's stage sub-mesh choice (its most expensive part) when its
    fastest fitting ideal cut is already slower than the best candidate priced (module doc:
    branch and bound, the same choice as pricing every depth); False prices every depth.
    `searched_candidates`: handed to every mesh choice (`choose_mesh`; 0 searches every mesh):
    with `bound_depths=False` and 0 the ranking is exhaustive (`tests/test_plan_scale.py` holds the
    default's choice to it)."""
    example = tuple(example_inputs)
    candidates: list[PipelineCandidate] = []
    tensor_only: MeshChoice | None = None
    steps = StepCache()  # pairs of placements, shared by every choice below (they depend on ndim only)
    try:
        tensor_only = choose_mesh(model, world_size, example, hardware=hardware, memory_limit=memory_limit,
                                  example_kwargs=example_kwargs, registry=registry,
                                  searched_candidates=searched_candidates, steps=steps)  # fmt: skip
        best = tensor_only.chosen
        candidates.append(
            PipelineCandidate(
                1,
                best.label,
                "-",
                1,
                best.rank_time,
                best.memory,
                best.fits,
                stage_shape=best.shape,
                stage_names=best.names,
            )  # fmt: skip
        )
    except AutoparError as exc:
        candidates.append(PipelineCandidate(1, "-", "-", 1, error=str(exc).splitlines()[0]))
    gm = trace(model, example, decompose=True, example_kwargs=example_kwargs)
    piece_args, piece_kwargs = split_microbatches((example, dict(example_kwargs or {})), microbatches)[0]
    wanted = depths if depths is not None else [p for p in range(2, world_size + 1) if world_size % p == 0]
    limit = math.inf if memory_limit is None else memory_limit
    hw = load_hardware(hardware)
    graphs = _StageGraphs(gm, hw)  # one analysis per stage sub-mesh size, shared by its schedules
    cut_all = functools.partial(
        _cuts, graphs, microbatches=microbatches, limit=limit, weight_state=weight_state,
        recompute=recompute,
    )  # fmt: skip
    # every depth's ideal cuts first: they do not need the stage sub-mesh's plan, which only slows them
    cuts = {pp: cut_all(pp, world_size // pp) for pp in wanted}
    fastest = min((c.step_time for c in candidates if c.fits and not c.error), default=math.inf)
    rows: dict[int, list[PipelineCandidate]] = {}
    piece: list[fx.GraphModule] = []  # one microbatch's trace, shared by every depth's sub-mesh choice
    for pp in sorted(wanted, key=lambda pp: (_bound(cuts[pp]), wanted.index(pp))):
        t = world_size // pp
        priced = [cut for _, _, cut in cuts[pp] if not isinstance(cut, AutoparError)]
        bound = _bound(cuts[pp])
        if bound_depths and priced and t > 1 and bound > fastest:  # (t = 1: nothing to save)
            why = "not priced: no cut fits"
            if math.isfinite(bound):
                why = f"not priced: ideal cut {format_seconds(bound)} > best {format_seconds(fastest)}"
            rows[pp] = [PipelineCandidate(pp, f"{t} rank{'s' if t > 1 else ''}", "-", 1, error=why)]
            continue
        factor, label = 1.0, "1 rank"
        shape: tuple[int, ...] = (1,)
        names: tuple[str, ...] = ("stage",)
        if t > 1 and priced:
            try:
                if not piece:
                    piece.append(trace_for_choice(model, t, piece_args, example_kwargs=piece_kwargs))
                # the whole model on t ranks need not fit: a stage holds 1/pp of it (the cut's memory)
                sub = choose_mesh(
                    model, t, piece_args, hardware=hardware, registry=registry, example_kwargs=piece_kwargs,
                    memory_limit=math.inf, traced=piece[0], searched_candidates=searched_candidates,
                    steps=steps,
                )  # fmt: skip
            except AutoparError as exc:
                rows[pp] = [PipelineCandidate(pp, f"{t} ranks", "-", 1, error=str(exc).splitlines()[0])]
                continue
            label, shape, names = sub.chosen.label, sub.chosen.shape, sub.chosen.names
            sub_time = sub.chosen.rank_time
            kept = sub.chosen_plan
            if kept is not None and kept.graph is not None:  # its gradient reduction: once per step
                grad = gradient_reduction_time(kept.graph, kept.plan, shape, hw)
                sub_time = min(sub_time, sub.chosen.step_time - grad)
                stored = getattr(kept.plan, "memory", None)
                shards = None
                if stored is not None and stored.params > 0:  # weights split as the plan splits them
                    shards = _param_bytes(gm) / stored.params
                cuts[pp] = cut_all(pp, t, shards=shards, grad=grad)
        elif t > 1:
            label = f"{t} ranks"
        rows[pp] = []
        for name, v, cut in cuts[pp]:
            if isinstance(cut, AutoparError):
                rows[pp].append(PipelineCandidate(pp, label, name, v, error=str(cut).splitlines()[0]))
                continue
            if t > 1:  # the sub-mesh's collectives and imbalance, per microbatch, added to the stages
                ideal = cut.total_time / microbatches
                factor = sub_time / ideal if ideal > 0 else 1.0
                cut = cut.slowed(max(0.0, sub_time - ideal) * microbatches)
            memory = max(cut.rank_memory)
            row = PipelineCandidate(
                pp, label, name, v, cut.step_time, memory, memory <= limit, cut.bubble, factor,
                stage_shape=shape, stage_names=names,
            )  # fmt: skip
            rows[pp].append(row)
            if row.fits:
                fastest = min(fastest, row.step_time)
    candidates.extend(row for pp in wanted for row in rows[pp])
    candidates.sort(key=lambda c: (bool(c.error), not c.fits, c.step_time))
    return PipelineMeshChoice(world_size, microbatches, hardware, candidates, tensor_only)


def _param_bytes(gm: Any) -> float:
    """Bytes of the traced graph's parameters and buffers, whole."""
    return float(
        sum(
            n.meta["val"].numel() * n.meta["val"].element_size()
            for n in gm.graph.nodes
            if n.op == "placeholder" and has_info(n) and info(n).role in ("param", "buffer", "constant")
        )
    )


class _StageGraphs:
    """`stage_graph` of one traced graph per stage sub-mesh size t, each analysed once: every
    depth cuts it for each schedule of `AUTO_CANDIDATES`, before and after its sub-mesh choice
    (a walk over every node of a 96-layer graph each time, otherwise)."""

    def __init__(self, gm: fx.GraphModule, hardware: Hardware) -> None:
        self.gm, self.hardware = gm, hardware
        self.by_size: dict[int, StageGraph] = {}

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
    recompute: bool,
    shards: float | None = None,
    grad: float | None = None,
) -> list[tuple[str, int, StageCut | AutoparError]]:
    """Each schedule of `AUTO_CANDIDATES` cut at depth `pp` with work divided ideally by `t`, or
    why it cannot be. Without the sub-mesh plan's `shards` (how many ways it splits the weight
    state) and `grad` (its gradient reduction, priced once per step) the cut is the ideal one: state
    split t ways, no reduction."""
    out: list[tuple[str, int, StageCut | AutoparError]] = []
    for name, v in AUTO_CANDIDATES:
        try:
            cut = cut_graph(
                graphs.of(t), pp=pp, microbatches=microbatches, v=v, schedule=name,
                memory_limit=limit, weight_state=weight_state, state_shards=shards,
                grad_reduce=grad, recompute=recompute,
            )  # fmt: skip
        except AutoparError as exc:
            out.append((name, v, exc))
            continue
        out.append((name, v, cut))
    return out


def _bound(cuts: list[tuple[str, int, StageCut | AutoparError]]) -> float:
    """A lower bound on every fitting candidate of one depth: the fastest fitting ideal cut's step.
    The sub-mesh's plan only adds time to the stages (`StageCut.slowed`, never shorter: the
    schedule's order is fixed) and a gradient reduction, and splits the weight state at most t ways
    as the ideal cut does (so no more memory fits); inf when none fits."""
    fitting = [cut.step_time for _, _, cut in cuts if not isinstance(cut, AutoparError) and cut.fits]
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
) -> tuple[DeviceMesh, PipelineMeshChoice]:
    """`parallelize(..., mesh_shape="auto", microbatches=M)`: rank 0 ranks every pipeline depth
    beside the tensor-only meshes, every rank builds the chosen DeviceMesh (with a "pp" axis when
    a pipeline won). `mesh`: the job's DeviceMesh or its world size."""
    world, device_type = job_world(mesh)
    choice = decided_on_rank0(
        lambda: choose_pipeline_mesh(
            model, world, example_inputs, microbatches=microbatches,
            hardware=hardware or default_hardware(device_type), memory_limit=memory_limit, registry=registry,
            example_kwargs=example_kwargs,
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
