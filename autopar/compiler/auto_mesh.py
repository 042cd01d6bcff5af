"""The mesh choice run on a model: trace it once, rank every factorization of the world size by
the plan choice (`autopar.planning.mesh_choice`), pricing the best few with this driver's
scheduled step; under `parallelize`, rank 0 chooses and every rank builds the chosen DeviceMesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.compiler.driver import compile_conditions, scheduled_step_time
from autopar.core.errors import MeshError
from autopar.core.precision import AutocastState, MixedPrecision
from autopar.passes import fused
from autopar.passes.trace import trace
from autopar.planning.mesh_choice import OVERLAP_CANDIDATES, SEARCHED_CANDIDATES, MeshChoice, rank_meshes
from autopar.planning.search_steps import StepCache
from autopar.rules.base import RuleRegistry
from autopar.rules.registry import default_registry
from autopar.rules.routed_experts import require_dispatcher
from autopar.runtime.agreement import decided_on_rank0


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

    Raises `MemoryLimitError` when no candidate fits (with the leanest candidate's need) and
    `ShardingError`-like `AutoparError`s when no candidate has a plan at all.
    """
    registry = require_dispatcher(registry if registry is not None else default_registry(), token_dispatch)
    gm = traced if traced is not None else trace_for_choice(
        model, world_size, example_inputs, example_kwargs=example_kwargs, planner=planner,
        split_fused=split_fused, autocast=autocast, mixed_precision=mixed_precision,
        token_dispatch=token_dispatch,
    )  # fmt: skip
    choice = rank_meshes(
        gm,
        world_size,
        registry,
        scheduled_step_time,
        hardware=hardware,
        planner=planner,
        memory_limit=memory_limit,
        candidates=candidates,
        overlap_candidates=overlap_candidates,
        searched=searched_candidates,
        keep_plan=keep_plan,
        steps=steps,
        storage=storage,
    )
    if choice.chosen_plan is not None:
        gm.meta.pop("autopar_search", None)  # (the last search's report: not the chosen mesh's)
        choice.chosen_plan.graph = gm
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
) -> fx.GraphModule:
    """The joint graph `choose_mesh` plans (for `choose_mesh(..., traced=)`): traced once, it can be
    handed to every choice on the same inputs (the pipeline choice's stage sub-meshes).
    `token_dispatch` other than "allgather": MoE layers as routed-experts ops, as `compile_for_rank`
    traces them (`driver.trace_for`)."""
    return trace(
        model,
        tuple(example_inputs),
        decompose=world_size > 1,
        example_kwargs=example_kwargs,
        split_fused=fused.wanted(split_fused, planner),
        autocast=autocast,
        mixed_precision=mixed_precision,
        routed_experts=token_dispatch != "allgather" and world_size > 1,
    )


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
