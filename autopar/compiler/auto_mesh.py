"""The mesh choice run on a model: trace it once, rank every factorization of the world size by
the plan choice (`autopar.planning.mesh_choice`), pricing the best few with this driver's
scheduled step; under `parallelize`, rank 0 chooses and every rank builds the chosen DeviceMesh."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.compiler.driver import compile_conditions
from autopar.compiler.lowering import ScheduledCopies, scheduled_step_time
from autopar.core.errors import MeshError
from autopar.core.precision import AutocastState, MixedPrecision
from autopar.passes import fused
from autopar.passes.repeats import REPEATS_KEY, RepeatedBlocks
from autopar.passes.trace import trace
from autopar.planning.memory import STATE_RATIOS_KEY
from autopar.planning.mesh_choice import OVERLAP_CANDIDATES, SEARCHED_CANDIDATES, MeshChoice, rank_meshes
from autopar.planning.mesh_fold import DEPTHS, deep_enough, rank_folded
from autopar.planning.search import default_memory_limit
from autopar.planning.search_cost import TimeCost
from autopar.planning.search_steps import StepCache
from autopar.rules.base import RuleRegistry
from autopar.rules.registry import default_registry
from autopar.rules.routed_experts import require_dispatcher
from autopar.runtime.agreement import decided_on_rank0

SHALLOW_KEY = "autopar_shallow_traces"  # gm.meta: depth -> the model cut to that many blocks, traced


@compile_conditions
def choose_mesh(
    model: nn.Module,
    world_size: int,
    example_inputs: Sequence[Any],
    *,
    hardware: str = "h100-nvlink-ib",
    planner: str = "search",
    memory_limit: float | None = None,
    example_kwargs: dict[str, Any] | None = None,
    registry: RuleRegistry | None = None,
    candidates: Sequence[tuple[tuple[int, ...], tuple[str, ...]]] | None = None,
    split_fused: bool | None = None,
    overlap_candidates: int = OVERLAP_CANDIDATES,
    searched_candidates: int = SEARCHED_CANDIDATES,
    autocast: AutocastState = (),
    mixed_precision: MixedPrecision | None = None,
    keep_plan: bool = False,
    traced: fx.GraphModule | None = None,
    steps: StepCache | None = None,
    storage: str = "auto",
    token_dispatch: str = "allgather",
    fold: bool = False,
) -> MeshChoice:
    """Trace `model` once and rank every candidate mesh of `world_size` ranks on it
    (`autopar.planning.mesh_choice.rank_meshes`, with `scheduled_step_time` for the overlap step).

    `overlap_candidates`: how many candidates at most are lowered and scheduled to rank them by
    their modeled step with overlap (0: rank by the no-overlap sum alone). `searched_candidates`:
    how many candidates at most are searched when there are more, the best by a cheap plan each
    (`autopar.planning.mesh_screen`; 0: search every one). `keep_plan`: keep the chosen mesh's
    searched plan and the traced graph in `choice.chosen_plan`, for `autopar.plan` to compile
    (otherwise None: a choice broadcast under `parallelize` carries the table only).
    `traced`: the joint graph of `model` on `example_inputs` as this function would trace it (same
    decompose, split_fused, autocast and precision), planned instead of tracing again: the pipeline
    choice asks one microbatch's choice for every depth, and a 96-layer trace costs seconds each.
    `steps`: a `StepCache` shared with other choices (the pairs of placements the searches price
    depend on the number of mesh axes only; the pipeline choice hands one to every depth).
    `token_dispatch` (`PlanOptions.token_dispatch`): with "alltoall" or "auto" the MoE layers are
    traced as routed-experts ops and every candidate mesh is screened and searched with the
    dispatchers that asks for (the screen and the search start from each dispatcher on each axis),
    so the mesh chosen is the fastest with its best dispatcher, not the all-gather one's.
    `fold`: a model of `mesh_fold.MIN_FOLDED` or more identical blocks is ranked on its graph cut
    to `mesh_fold.DEPTHS` blocks, numbers taken to the whole depth, and only its best candidates
    searched on the whole graph (`autopar.planning.mesh_fold`; it ranks on the whole graph where
    the fold cannot tell). Off by default: on the LLaMA-7B shape at 64 ranks the fold could not
    tell and its two shallow choices cost 80 % more CPU (docs/planning.md).

    Raises `MemoryLimitError` when no candidate fits (with the leanest candidate's need) and
    `ShardingError`-like `AutoparError`s when no candidate has a plan at all.
    """
    registry = require_dispatcher(registry if registry is not None else default_registry(), token_dispatch)
    traced_at = functools.partial(
        trace_for_choice, model, world_size, example_inputs, example_kwargs=example_kwargs, planner=planner,
        split_fused=split_fused, autocast=autocast, mixed_precision=mixed_precision,
        token_dispatch=token_dispatch,
    )  # fmt: skip
    gm = traced if traced is not None else traced_at()
    asked: dict[str, Any] = dict(
        hardware=hardware, planner=planner, memory_limit=memory_limit, candidates=candidates,
        overlap_candidates=overlap_candidates, searched=searched_candidates, keep_plan=keep_plan,
        steps=steps if steps is not None else StepCache(), storage=storage,
    )  # fmt: skip

    # with the plan kept, the scheduled copies of the fastest too: the compile of the chosen plan
    # takes its copy instead of scheduling it again (`ScheduledCopies`)
    copies = ScheduledCopies() if keep_plan else None
    step_time = copies if copies is not None else scheduled_step_time

    def rank(graph: fx.GraphModule, **changed: Any) -> MeshChoice:
        args = {**asked, **changed}
        args["candidates"] = candidates if args["candidates"] is None else args["candidates"]
        return rank_meshes(graph, world_size, registry, step_time, **args)

    choice = None
    group = folded_blocks(gm)
    if planner == "search" and fold and group is not None:  # deep: ranked cut short first
        shallow = [_shallow(gm, depth, lambda d: traced_at(depth=d)) for depth in DEPTHS]
        limit = memory_limit if memory_limit is not None else default_memory_limit(TimeCost(hardware, (world_size,)))
        choice = rank_folded(
            gm, group, shallow, rank, searched=searched_candidates, keep_plan=keep_plan, limit=float(limit)
        )
    if choice is None:
        choice = rank(gm)
    if choice.chosen_plan is not None:
        gm.meta.pop("autopar_search", None)  # (the last search's report: not the chosen mesh's)
        choice.chosen_plan.graph = gm
        choice.chosen_plan.scheduled = copies.of(choice.chosen_plan.plan) if copies is not None else None
    return choice


def trace_for_choice(
    model: nn.Module,
    world_size: int,
    example_inputs: Sequence[Any],
    *,
    example_kwargs: dict[str, Any] | None = None,
    planner: str = "search",
    split_fused: bool | None = None,
    autocast: AutocastState = (),
    mixed_precision: MixedPrecision | None = None,
    token_dispatch: str = "allgather",
    depth: int | None = None,
) -> fx.GraphModule:
    """The joint graph `choose_mesh` plans (for `choose_mesh(..., traced=)`): traced once, it can be
    handed to every choice on the same inputs (the pipeline choice's stage sub-meshes).
    `token_dispatch` other than "allgather": MoE layers as routed-experts ops, as `compile_for_rank`
    traces them (`driver.trace_for`). `depth`: the model cut to that many identical blocks
    (`trace(..., depth=)`)."""
    return trace(
        model,
        tuple(example_inputs),
        decompose=world_size > 1,
        example_kwargs=example_kwargs,
        split_fused=fused.wanted(split_fused, planner),
        autocast=autocast,
        mixed_precision=mixed_precision,
        routed_experts=token_dispatch != "allgather" and world_size > 1,
        depth=depth,
    )


def folded_blocks(gm: fx.GraphModule) -> RepeatedBlocks | None:
    """The one container of identical blocks `gm` was traced with, if it is deep enough to fold
    (`mesh_fold.MIN_FOLDED`); None for a model with no repeated blocks (blocks that differ) or
    several containers."""
    groups: tuple[RepeatedBlocks, ...] = gm.meta.get(REPEATS_KEY, ())
    return groups[0] if len(groups) == 1 and deep_enough(groups[0]) else None


def _shallow(gm: fx.GraphModule, depth: int, make: Callable[[int], fx.GraphModule]) -> fx.GraphModule:
    """`gm`'s model cut to `depth` blocks, traced by `make` once per graph (kept in its meta: the
    pipeline choice hands one trace to every depth's sub-mesh choice), with the weight state the
    caller set on `gm` (`planning.memory.set_state_ratios`)."""
    kept: dict[int, fx.GraphModule] = gm.meta.setdefault(SHALLOW_KEY, {})
    if depth not in kept:
        kept[depth] = make(depth)
    shallow = kept[depth]
    if STATE_RATIOS_KEY in gm.meta:
        shallow.meta[STATE_RATIOS_KEY] = gm.meta[STATE_RATIOS_KEY]
    else:
        shallow.meta.pop(STATE_RATIOS_KEY, None)
    return shallow


def default_hardware(device_type: str) -> str:
    """The table a mesh choice prices on when none is given: measured CPU/gloo, else H100."""
    return "cpu-gloo" if device_type == "cpu" else "h100-nvlink-ib"


def job_world(mesh: DeviceMesh | int) -> tuple[int, str]:
    """The job's world size and device type, for `mesh_shape="auto"` given the job's DeviceMesh
    (its device type and size are kept, its shape is not) or its world size."""
    if not dist.is_initialized():
        raise MeshError(
            "torch.distributed is not initialized", hint="run under torchrun or init_process_group first"
        )
    world = dist.get_world_size()
    size = mesh.size() if isinstance(mesh, DeviceMesh) else int(mesh)
    if size != world:
        raise MeshError(
            f"asked for {size} ranks but the job has {world}", hint=f"pass {world} or the job's DeviceMesh"
        )
    device_type = (
        mesh.device_type if isinstance(mesh, DeviceMesh) else "cuda" if torch.cuda.is_available() else "cpu"
    )
    return world, device_type


def auto_device_mesh(
    model: nn.Module,
    mesh: DeviceMesh | int,
    example_inputs: Sequence[Any],
    *,
    hardware: str | None = None,
    planner: str = "search",
    memory_limit: float | None = None,
    example_kwargs: dict[str, Any] | None = None,
    registry: RuleRegistry | None = None,
    split_fused: bool | None = None,
    autocast: AutocastState = (),
    mixed_precision: MixedPrecision | None = None,
    storage: str = "auto",
    token_dispatch: str = "allgather",
) -> tuple[DeviceMesh, MeshChoice]:
    """`parallelize(..., mesh_shape="auto")`: rank 0 chooses, every rank builds the same DeviceMesh.

    `mesh` is the job's DeviceMesh (its device type and size are kept, its shape is not) or the
    world size. A failure on rank 0 is raised on every rank, so none waits in a collective.
    """
    world, device_type = job_world(mesh)
    value = decided_on_rank0(
        lambda: choose_mesh(
            model,
            world,
            example_inputs,
            hardware=hardware or default_hardware(device_type),
            planner=planner,
            memory_limit=memory_limit,
            example_kwargs=example_kwargs,
            registry=registry,
            split_fused=split_fused,
            autocast=autocast,
            mixed_precision=mixed_precision,
            storage=storage,
            token_dispatch=token_dispatch,
        ),
        "mesh choice",
    )
    chosen = value.chosen
    return init_device_mesh(device_type, chosen.shape, mesh_dim_names=chosen.names), value
