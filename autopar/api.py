"""The public API: `parallelize` (compile for the ranks of this job) and `plan` (plan offline)."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from autopar.compiler import driver, lowering
from autopar.compiler.auto_mesh import auto_device_mesh, choose_mesh, job_world
from autopar.compiler.build import ModuleOptions, compile_module
from autopar.compiler.driver import compile_for_rank, example_tuple
from autopar.compiler.fixed import compare_fixed
from autopar.compiler.pipeline import PipelinedModule, split_microbatches
from autopar.compiler.pipeline_checkpoint import load_pipelined_checkpoint
from autopar.compiler.pipeline_entry import parallelize_on_pipeline_mesh
from autopar.compiler.pipeline_mesh import auto_pipeline_mesh, choose_pipeline_mesh
from autopar.compiler.pricing import Compared, PlanResult, price
from autopar.core.errors import AutoparError, CheckpointError, MeshError, UsageError
from autopar.core.graph_copy import graph_copy
from autopar.core.host_memory import return_freed_memory
from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.core.precision import Autocast, MixedPrecision, compilable_autocast
from autopar.cost.hardware import load_hardware
from autopar.options import (
    PLAN_FIELDS,
    DebugOptions,
    PipelineOptions,
    PlanOptions,
    default_tables,
    from_keywords,
)
from autopar.passes import fused
from autopar.planning.memory import MEMORY_HEADROOM
from autopar.rules.base import RuleRegistry
from autopar.rules.context_parallel import CP_AXIS, context_parallel_registry
from autopar.rules.registry import default_registry
from autopar.runtime.checkpoint import LoadResult
from autopar.runtime.checkpoint import load_checkpoint as load_parallel_checkpoint
from autopar.runtime.checkpoint_save import save_dcp, save_safetensors
from autopar.runtime.device_memory import rank_memory
from autopar.runtime.groups import (
    DEFAULT_TIMEOUT_S,
    as_timeout,
    check_device_mesh,
    make_groups,
    names_parallelize_failures,
)
from autopar.runtime.local_batch import GLOBAL, INPUT_MODES, LOCAL, global_stand_ins
from autopar.runtime.materialize import InitFn
from autopar.runtime.module import ParallelModule
from autopar.runtime.slips import watch_optimizers


@names_parallelize_failures
def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | int,
    *,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    mesh_shape: str | None = None,
    memory_limit: float | None = None,
    mp_policy: Any = None,
    compile: bool = False,
    timeout: float | timedelta = DEFAULT_TIMEOUT_S,
    inputs: str = GLOBAL,
    init_fn: InitFn | None = None,
    planning: PlanOptions | None = None,
    pipeline: PipelineOptions | None = None,
    debug: DebugOptions | None = None,
    **deprecated: Any,
) -> ParallelModule | PipelinedModule:
    """Compile `model` for `mesh`; every rank calls this with the same weights and inputs.

    Returns a module every rank calls as it would call `model` (numerically serial training).

    example_inputs, example_kwargs: a batch as the model's calls pass it (positions, keywords).
    mesh_shape: "auto" with the job's DeviceMesh or world size as `mesh`: every factorization is
        planned and the fastest that fits runs; the ranked table is `result.mesh_choice`.
    memory_limit: bytes per rank the plan's modeled memory must fit (default: 90% of a rank's
        device memory; a CPU rank's is the machine's memory over the job's ranks on it, less the
        runtime's fixed 286 MiB, `core.host_memory.RUNTIME_RESERVE`).
    mp_policy: torch's `MixedPrecisionPolicy(param_dtype=...)`: float32 master weights, compute in
        `param_dtype` (docs/architecture.md).
    compile: True runs every program's graphs through `torch.compile` (Inductor).
    timeout: seconds (default 300) any wait of autopar's collectives may take before every rank
        fails with a `RankFailureError` naming the first failure (docs/debugging.md).
    inputs: "global" (default): every rank passes the whole batch; "local": each rank its own
        shard (what a `DistributedSampler` yields), results as serial on the shards concatenated.
    init_fn: for a model built on the meta device, `init_fn(module)` initializes each module
        (default: `reset_parameters()` / `_init_weights`), one tensor at a time on each rank.
    planning: `autopar.PlanOptions` (planner, hardware, over_decompose, split_fused,
        in_flight_bytes, overlap, registry); the same object makes the same plan in `autopar.plan`.
    pipeline: `autopar.PipelineOptions` (microbatches, schedule, stage_boundaries,
        virtual_stages) for a mesh with a "pp" axis (docs/pipeline.md).
    debug: `autopar.DebugOptions` (dump_dir, check_inputs), docs/debugging.md.

    Other calls (input shapes, `eval()`, `no_grad()`, autocast, `pmodel.to(dtype)`) compile their
    own program once (docs/architecture.md, "Calls, modes and programs"). The keywords the groups
    replaced (`planner=`, `schedule=`, `dump_dir=`, ...) still work, with a DeprecationWarning,
    for one release (docs/api.md).
    """
    planning, pipeline, debug = from_keywords("parallelize", deprecated, planning, pipeline, debug, stacklevel=4)
    registry, planner = planning.registry, planning.planner
    over_decompose, split_fused, in_flight_bytes = planning.over_decompose, planning.split_fused, planning.in_flight_bytes
    microbatches, schedule = pipeline.microbatches, pipeline.schedule
    stage_boundaries, virtual_stages = pipeline.stage_boundaries, pipeline.virtual_stages
    _check_model(model)
    example_inputs = example_tuple(example_inputs, example_kwargs)
    names = tuple(mesh.mesh_dim_names or ()) if isinstance(mesh, DeviceMesh) else ()
    registry = _asked_registry(registry, names, planning)
    pipelined = isinstance(mesh, DeviceMesh) and "pp" in (mesh.mesh_dim_names or ())
    depths_wanted = mesh_shape == "auto" and microbatches is not None  # pipeline depths compete too
    if not pipelined and not depths_wanted and (schedule is not None or microbatches is not None):
        raise UsageError(
            f"PipelineOptions(schedule={schedule!r}, microbatches={microbatches!r}) describe a pipeline, but "
            "the mesh has no axis named \"pp\"",
            hint='PlanOptions(overlap=True/False) turns collective scheduling on or off; for a pipeline use a ("pp",) mesh',
        )
    # a DTensor example (another parallel module's output) stands for its global value, as in calls
    example_inputs, example_kwargs = pytree.tree_map_only(
        DTensor, lambda x: x.full_tensor(), (example_inputs, example_kwargs)
    )
    mixed_precision = MixedPrecision.of(mp_policy)
    if not isinstance(compile, bool):
        raise UsageError(f"compile must be True or False, got {compile!r}", hint="compile=True runs Inductor")
    if inputs not in INPUT_MODES:
        raise UsageError(
            f"inputs must be one of {', '.join(map(repr, INPUT_MODES))}, got {inputs!r}",
            hint='"global": every rank passes the whole batch; "local": each rank its own shard of it',
        )
    # hardware=None: by the mesh's device type, as `plan(device_type=...)` resolves it
    device_type = _device_type(mesh)
    cpu_ranks = device_type == "cpu"  # their step's buffers come from the C library's heap
    hardware, layout_hardware = default_tables(planning.hardware, device_type)
    if memory_limit is None:  # the device's memory (a CPU rank: the machine's over its local ranks, less the runtime's)
        memory_limit = default_memory_limit(device_type)
    options = ModuleOptions(
        registry=registry,
        planner=planner,
        storage=planning.storage,
        decompose_matmuls=planning.decompose_matmuls,
        token_dispatch=planning.token_dispatch,
        schedule=planning.overlap,
        hardware=layout_hardware,
        memory_limit=memory_limit,
        over_decompose=over_decompose,
        split_fused=split_fused,
        in_flight_bytes=in_flight_bytes,
        mixed_precision=mixed_precision,
        check_inputs=debug.check_inputs,
        inputs=inputs,
        dump_dir=debug.dump_dir,
        init_fn=init_fn,
        compile=compile,
    )
    depth_choice = None
    if depths_wanted and not pipelined:
        assert microbatches is not None
        mesh, depth_choice = auto_pipeline_mesh(
            model, mesh, example_inputs, microbatches=microbatches, hardware=hardware,
            memory_limit=memory_limit, registry=registry, example_kwargs=example_kwargs,
            weight_state=planning.weight_state, recompute=planning.recompute,
            token_dispatch=planning.token_dispatch,
        )  # fmt: skip
        mesh_shape, hardware = None, depth_choice.hardware
        options = dataclasses.replace(options, hardware=hardware)  # the layouts the choice priced
        pipelined = "pp" in (mesh.mesh_dim_names or ())
        if pipelined and schedule is None:  # the schedule the choice priced best
            schedule, virtual_stages = depth_choice.chosen.schedule, depth_choice.chosen.v
        elif not pipelined:  # the tensor-only mesh won: no microbatches
            schedule, microbatches = None, None
    if pipelined:
        if mesh_shape is not None:
            raise UsageError(
                f"mesh_shape={mesh_shape!r} with a pipeline mesh: the pipeline runs on the mesh given",
                hint="drop mesh_shape, or pass the world size / a mesh without a \"pp\" axis",
            )
        assert isinstance(mesh, DeviceMesh)
        pipelined_module = parallelize_on_pipeline_mesh(
            model, mesh, example_inputs, example_kwargs, schedule, microbatches, stage_boundaries,
            virtual_stages, hardware, options, timeout,
        )
        pipelined_module.mesh_choice = depth_choice  # type: ignore[assignment]  # nn.Module types attributes as tensors
        watch_optimizers(model, pipelined_module)
        return_freed_memory(cpu_ranks)  # what planning and compiling freed, not kept resident through training
        return pipelined_module
    seeded = torch.random.get_rng_state()  # what a meta-device model is initialized from
    traced_inputs, traced_kwargs = example_inputs, example_kwargs
    if inputs == LOCAL and dist.is_initialized():  # programs are for the batch the shards make together
        traced_inputs, traced_kwargs = global_stand_ins((example_inputs, example_kwargs), dist.get_world_size())
    # the first program is for calls in the autocast regions active here; others compile their own
    autocast = compilable_autocast(("cpu", mesh.device_type if isinstance(mesh, DeviceMesh) else "cpu"))
    choice = None
    if mesh_shape is not None:
        if mesh_shape != "auto":
            raise MeshError(
                f"mesh_shape {mesh_shape!r}", hint='pass "auto", or a DeviceMesh of the shape you want'
            )
        mesh, choice = auto_device_mesh(
            model,
            mesh,
            traced_inputs,
            hardware=hardware,
            planner=planner,
            memory_limit=memory_limit,
            example_kwargs=traced_kwargs,
            registry=registry,
            split_fused=split_fused,
            autocast=autocast,
            mixed_precision=mixed_precision,
            storage=planning.storage,
            token_dispatch=planning.token_dispatch,
        )
        options = dataclasses.replace(options, hardware=choice.hardware)  # the layouts the choice priced
    autopar_mesh = check_device_mesh(mesh)
    assert autopar_mesh.device_mesh is not None
    groups = make_groups(autopar_mesh.device_mesh, as_timeout(timeout))
    result = compile_module(
        model, autopar_mesh, groups, options, example_inputs, example_kwargs, traced_inputs, traced_kwargs,
        autocast=autocast, seeded=seeded, plain_when_replicated=True,
    )
    result.mesh_choice = depth_choice if depth_choice is not None else choice  # type: ignore[assignment]
    watch_optimizers(model, result)  # an optimizer over model.parameters() is refused at its step
    return_freed_memory(cpu_ranks)  # what planning and compiling freed, not kept resident through training
    return result


def _asked_registry(
    registry: RuleRegistry | None, axis_names: tuple[str, ...], planning: PlanOptions
) -> RuleRegistry | None:
    """The rules with the attention strategy `PlanOptions.context_parallel` names required on the
    mesh's "cp" axis (with "auto", `compile_for_rank` requires either where the mesh has one)."""
    if planning.context_parallel == "auto":
        return registry
    if CP_AXIS not in axis_names:
        raise UsageError(
            f"PlanOptions(context_parallel={planning.context_parallel!r}) names the attention strategy of a "
            f'"cp" mesh axis, but the mesh has axes {axis_names}',
            hint='name the axis that should split the sequence "cp", e.g. init_device_mesh("cpu", (2, 4), '
            'mesh_dim_names=("dp", "cp"))',
        )
    base = registry if registry is not None else default_registry()
    return context_parallel_registry(base, axis_names, planning.context_parallel)


def default_memory_limit(device_type: str, ranks: int | None = None) -> float | None:
    """`parallelize`'s default `memory_limit`: `MEMORY_HEADROOM` of one rank's memory on
    `device_type` (`runtime.device_memory`; a CPU rank's: the machine's over `ranks` on it, default
    the job's local ranks, less the runtime's reserve), None where that is not known. `plan` with
    `device_type="cpu"` takes it for its mesh's ranks, so both plan under one limit."""
    memory = rank_memory(device_type, ranks)
    return None if memory is None else MEMORY_HEADROOM * memory


def _device_type(mesh: DeviceMesh | int) -> str:
    """The device type `parallelize` plans for: the mesh's, or for a world size the job's."""
    if isinstance(mesh, DeviceMesh):
        return mesh.device_type
    if isinstance(mesh, bool) or not isinstance(mesh, int):
        check_device_mesh(mesh)  # raises: not a DeviceMesh
    return job_world(mesh)[1]


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"model must be an nn.Module, got {type(model).__name__}",
            hint="wrap a function in an nn.Module whose forward calls it",
        )
    if isinstance(model, (ParallelModule, PipelinedModule)):  # its parameters are this rank's blocks
        raise UsageError(
            f"model is already a {type(model).__name__} (what parallelize returned): its parameters are "
            "this rank's blocks, not the serial model's",
            hint="parallelize the original model again, or a serial model loaded from pmodel.full_state_dict()",
        )


def plan(
    model: nn.Module,
    mesh_shape: Sequence[int] | str,
    example_inputs: Sequence[Any],
    *,
    example_kwargs: dict[str, Any] | None = None,
    mesh_names: Sequence[str] | None = None,
    world_size: int | None = None,
    memory_limit: float | None = None,
    mp_policy: Any = None,
    autocast: torch.dtype | None = None,
    compare: bool = False,
    device_type: str = "cuda",
    planning: PlanOptions | None = None,
    pipeline: PipelineOptions | None = None,
    debug: DebugOptions | None = None,
    **deprecated: Any,
) -> PlanResult:
    """Plan `model` for a mesh of `mesh_shape` ranks, in this process, allocating no weights.

    `planning` (`autopar.PlanOptions`) and the plain keywords mean what they mean in
    `parallelize`, with the same defaults, so the same objects plan what `parallelize` compiles;
    `device_type` ("cuda", default, or "cpu") stands for the mesh's device type, which decides
    what `PlanOptions.hardware=None` means, as in `parallelize` (`autopar.options.default_tables`).
    `mesh_shape="auto"` with `world_size=N` plans every factorization of N and compiles the fastest
    that fits `memory_limit` (bytes per rank, default 90% of the table's device memory; with
    `device_type="cpu"` or a CPU table, `parallelize`'s default on a CPU job of the mesh's ranks on
    this machine: its memory over the ranks, less the runtime's reserve); the ranked
    table is `result.mesh_choice`. With `pipeline=PipelineOptions(microbatches=M)` too, pipeline
    depths compete (`result.pipeline_choice`); when one wins, the plan compiled is its stage
    sub-mesh's plan for one microbatch. `compare=True` also prices the fixed 1-D Megatron, 2-D
    SUMMA and 3-D cube schemes (`result.comparison`, `result.compare_text()`).
    `autocast=torch.bfloat16` plans the step as run inside `torch.autocast(dtype=torch.bfloat16)`.
    `debug=DebugOptions(dump_dir=...)` writes the planned rank's dump (`check_inputs` has no calls
    to check here). The keywords `PlanOptions` replaced (`planner=`, `hardware=`, ...) and `microbatches=` still
    work, with a DeprecationWarning, for one release (docs/api.md).
    """
    planning, pipeline, debug = from_keywords(
        "plan", deprecated, planning, pipeline, debug, allowed=(*PLAN_FIELDS, "microbatches")
    )
    if pipeline.schedule is not None or pipeline.stage_boundaries is not None or pipeline.virtual_stages != 1:
        raise UsageError(
            f"plan() takes PipelineOptions(microbatches=...) only, got {pipeline}",
            hint='pass mesh_shape="auto", world_size=N and PipelineOptions(microbatches=M) to rank pipeline depths',
        )
    if not isinstance(device_type, str):
        raise UsageError(f"plan(): device_type must be a str, got {device_type!r}", hint='device_type="cuda" or "cpu"')
    hardware, layout_hardware = default_tables(planning.hardware, device_type)
    if memory_limit is None and (device_type == "cpu" or load_hardware(hardware).memory_shared):
        # CPU ranks share the machine they run on: parallelize's default on a job of these ranks here
        ranks = world_size if isinstance(mesh_shape, str) else math.prod(mesh_shape)
        memory_limit = default_memory_limit("cpu", ranks)
    planner, registry, microbatches = planning.planner, planning.registry, pipeline.microbatches
    over_decompose, split_fused, in_flight_bytes = planning.over_decompose, planning.split_fused, planning.in_flight_bytes
    mixed_precision = MixedPrecision.of(mp_policy)
    example_inputs = example_tuple(example_inputs, example_kwargs)
    regions = (Autocast("cpu", autocast),) if autocast is not None else ()  # the trace runs on the CPU
    registry = registry if registry is not None else default_registry()
    split_fused = fused.wanted(split_fused, planner)
    choice = None
    depth_choice = None
    if isinstance(mesh_shape, str) and CP_AXIS in (mesh_names or ()):
        raise AutoparError(
            f'mesh_shape={mesh_shape!r} with mesh_names={tuple(mesh_names or ())!r}: the mesh choice names its own '
            f'axes, so it cannot keep a "{CP_AXIS}" axis',
            hint=f'give the shape (mesh_shape=(2, 4), mesh_names=("dp", "{CP_AXIS}")) to ask for context parallelism, '
            'or leave mesh_names out: the search splits attention along the sequence by itself where that is '
            "cheaper, or where memory_limit leaves no other plan",
        )
    if isinstance(mesh_shape, str) and microbatches is not None:
        if mesh_shape != "auto" or world_size is None:
            raise AutoparError(f"mesh_shape {mesh_shape!r}", hint='give "auto" with world_size=N and microbatches=M')
        depth_choice = choose_pipeline_mesh(
            model, world_size, example_inputs, microbatches=microbatches, hardware=hardware,
            memory_limit=memory_limit, registry=registry, example_kwargs=example_kwargs,
            weight_state=planning.weight_state, recompute=planning.recompute,
            token_dispatch=planning.token_dispatch, keep_plan=True,
        )  # fmt: skip
        best = depth_choice.chosen
        if best.error:
            raise AutoparError(f"no mesh of {world_size} ranks has a plan: {best.error}")
        choice = depth_choice.tensor_only if best.pp == 1 else None
        mesh_shape, mesh_names = best.stage_shape, best.stage_names
        if best.pp > 1:  # the stage sub-mesh's plan, for one microbatch
            example_inputs, example_kwargs = split_microbatches(
                (tuple(example_inputs), dict(example_kwargs or {})), microbatches
            )[0]
    elif isinstance(mesh_shape, str):
        if mesh_shape != "auto" or world_size is None:
            raise AutoparError(f"mesh_shape {mesh_shape!r}", hint='give a shape, or "auto" with world_size=N')
        choice = choose_mesh(
            model,
            world_size,
            example_inputs,
            hardware=hardware,
            planner=planner,
            memory_limit=memory_limit,
            example_kwargs=example_kwargs,
            registry=registry,
            split_fused=split_fused,
            autocast=regions,
            mixed_precision=mixed_precision,
            keep_plan=True,
            storage=planning.storage,
            token_dispatch=planning.token_dispatch,
        )
        mesh_shape, mesh_names = choice.chosen.shape, choice.chosen.names
    mesh = Mesh.from_shape(tuple(mesh_shape), tuple(mesh_names) if mesh_names else None)
    registry = _asked_registry(registry, mesh.axis_names, planning) or registry
    traced: list[fx.GraphModule] = []
    kept = choice.chosen_plan if choice is not None else None  # the choice's trace and search, reused

    def keep_traced(gm: fx.GraphModule, make_plan: Callable[[], Plan]) -> Plan:
        if compare:  # the joint graph as traced, before planning annotates it
            traced.append(graph_copy(gm))
        if kept is None:
            return make_plan()
        gm.meta["autopar_search"] = kept.report
        return kept.plan

    compiled = compile_for_rank(
        model,
        mesh,
        tuple(example_inputs),
        coords=(0,) * mesh.ndim,
        example_kwargs=example_kwargs,
        registry=registry,
        planner=planner,
        hardware=hardware if choice is not None or depth_choice is not None else layout_hardware,
        table=hardware,  # what the schedule models on, as the job's mesh of `device_type` gives it
        agree=keep_traced,
        memory_limit=memory_limit,
        over_decompose=over_decompose,
        split_fused=split_fused,
        in_flight_bytes=in_flight_bytes,
        traced=kept.graph if kept is not None else None,
        scheduled=kept.scheduled if kept is not None else None,  # (taken only if made for this plan)
        schedule=planning.overlap,
        dump_dir=debug.dump_dir,
        storage=planning.storage,
        decompose_matmuls=planning.decompose_matmuls,
        token_dispatch=planning.token_dispatch,
        autocast=regions,
        mixed_precision=mixed_precision,
        priced=True,
    )
    result = price(compiled, mesh, hardware, planner)
    # the choices' scheduled copies are taken or not this compile's: no scheduled graph stays in the result
    for ranked in (choice, depth_choice.tensor_only if depth_choice is not None else None):
        if ranked is not None and ranked.chosen_plan is not None:
            ranked.chosen_plan.scheduled = None
    result.mesh_choice = choice
    result.pipeline_choice = depth_choice
    if compare:
        chosen = Compared(f"chosen ({planner})", mesh.shape, "", result)
        fixed = compare_fixed(
            model, example_inputs, traced[0], mesh.size, hardware, registry, example_kwargs=example_kwargs,
            split_fused=split_fused, autocast=regions, mixed_precision=mixed_precision,
        )
        result.comparison = [chosen, *fixed]
    return result


def load_checkpoint(
    pmodel: ParallelModule | PipelinedModule,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    prefix: str | None = None,
) -> LoadResult:
    """Real weights into the module `parallelize` returned, pipelined or not: each rank reads only
    its own blocks from a DCP directory or a transformers `save_pretrained` directory (see
    `autopar.runtime.checkpoint` and docs/pipeline.md#checkpoints). Every rank calls it.

    A checkpoint of a model the user's module holds (`self.m = LlamaForCausalLM(...)`) loads
    into that submodule, found by its names; `prefix="m"` names it where several would match."""
    if isinstance(pmodel, PipelinedModule):
        return load_pipelined_checkpoint(pmodel, path, strict=strict, prefix=prefix)
    return load_parallel_checkpoint(pmodel, path, strict=strict, prefix=prefix)


def save_checkpoint(
    pmodel: ParallelModule | PipelinedModule, path: str | os.PathLike[str], *, format: str = "dcp"
) -> None:
    """Save the module `parallelize` returned at `path`; every rank calls it with the same path,
    on a filesystem all ranks share. The directory replaces what was at `path` in one step once
    every rank has written: a save killed at any point leaves the previous checkpoint there,
    complete (docs/large-models.md#save-a-checkpoint).

    `format="dcp"`: a torch.distributed.checkpoint directory, each rank writing only its own
    blocks; `autopar.load_checkpoint` loads it on any mesh, pipelined or not, and
    `torch.distributed.checkpoint.load` into a serial model's state dict does too.
    `format="safetensors"` (a tensor-only module): a transformers `save_pretrained` directory
    (`config.json` when the model has one, safetensors shards and their index) that
    `from_pretrained` loads; each tensor is made whole one at a time and written by one rank, so
    no rank holds more than its share of the model."""
    if not isinstance(pmodel, (ParallelModule, PipelinedModule)):
        raise CheckpointError(
            f"save_checkpoint takes the module autopar.parallelize returned, got {type(pmodel).__name__}",
            hint="for a serial model use torch.save(model.state_dict(), path) or save_pretrained",
        )
    if format not in ("dcp", "safetensors"):
        raise UsageError(f"save_checkpoint: format must be 'dcp' or 'safetensors', got {format!r}", hint="pass format='dcp' (default) or format='safetensors'")
    if format == "safetensors":
        if isinstance(pmodel, PipelinedModule):
            raise CheckpointError(
                "save_checkpoint(format='safetensors') of a pipelined module: not written yet",
                hint="save format='dcp', load it into a tensor-only module (autopar.load_checkpoint) "
                "and export that, or load the DCP directory into the serial model",
            )
        save_safetensors(pmodel.state_dict(), pmodel.aliases, pmodel.source_config, Path(path), pmodel.world_group)
        return
    # a pipelined module's stages' ranks hold different keys: DCP's collectives on every rank
    group = pmodel.world_group if isinstance(pmodel, ParallelModule) else None
    save_dcp(pmodel.state_dict(), Path(path), group)


# Names that lived here before the compiler had its own package; kept one release.
_MOVED = {"Compiled": driver, "in_flight_budget": lowering, "scheduled_step_time": lowering}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        warnings.warn(
            f"autopar.api.{name} is deprecated: import it from {_MOVED[name].__name__}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_MOVED[name], name)
    raise AttributeError(f"module 'autopar.api' has no attribute {name!r}")
