"""`pipeline_parallelize`: the entry point that cuts a model into stages over a mesh's "pp" axis
and returns this rank's `PipelinedModule` (docs/pipeline.md). Apart from the module it builds, so
that the module's runtime and its construction read as two things."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.compiler.build import ModuleOptions, compile_module
from autopar.compiler.pipeline import PipelinedModule
from autopar.compiler.pipeline_batch import split_microbatches
from autopar.compiler.pipeline_choice import PipelineDecision, decide_pipeline
from autopar.compiler.pipeline_split import PipelineSplitError
from autopar.compiler.pipeline_stage import StageBudget, StageBuilder, StageModule
from autopar.core.errors import UsageError
from autopar.core.mesh import Mesh
from autopar.core.precision import compilable_autocast
from autopar.reporting.dump import dump_dir_from
from autopar.rules.routed_experts import ROUTED_OPS
from autopar.runtime.groups import as_timeout, check_device_mesh, make_pipeline_groups
from autopar.runtime.local_batch import GLOBAL
from autopar.runtime.materialize import InitFn
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline_runtime import BoundaryScatter, check_supported
from autopar.runtime.pipeline_transport import PipelineTransport

__all__ = ["parallelize_on_pipeline_mesh", "pipeline_parallelize"]


def pipeline_parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    example_inputs: Sequence[Any],
    *,
    microbatches: int,
    schedule: str = "1f1b",
    stage_boundaries: Sequence[str] | None = None,
    virtual_stages: int = 1,
    hardware: str = "h100-nvlink-ib",
    pp_group: dist.ProcessGroup | None = None,
    build_stage: StageBuilder | None = None,
    scatter: BoundaryScatter | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
    decision: PipelineDecision | None = None,
    example_kwargs: dict[str, Any] | None = None,
    init_fn: InitFn | None = None,
    seeded: torch.Tensor | None = None,
    token_dispatch: str = "allgather",
    transport: PipelineTransport | None = None,
) -> PipelinedModule:
    """Cut `model` into `pp * virtual_stages` stages over the axis "pp" of `mesh` and return this
    rank's part. Every rank calls it with the same model and example batch.

    On a mesh with other axes too, `build_stage` compiles each stage module on the tensor
    sub-mesh (the caller's `parallelize` with the sub-mesh's groups), `pp_group` is this rank's
    pipeline group and `scatter` how boundary tensors are split among the slice's ranks.
    `dump_dir` (or AUTOPAR_DUMP_DIR): rank 0 writes the modeled pipeline timeline there.

    The cut is the cost model's (`autopar.planning.stage_cut.cut_stages` on the joint trace, priced
    on `hardware`) unless `stage_boundaries` names the first module of every stage after the first.
    `schedule`: "1f1b", "gpipe", "interleaved-1f1b" (with `virtual_stages` > 1), "zero-bubble"
    (stages built by `build_stage` only) or "auto" (`decide_pipeline`); `decision`: one the caller
    made already (every rank the same).

    A model built on the meta device: each rank makes only its stages' tensors, equal to the model
    built on a real device from the random state `seeded` (default: the state at this call), by
    the model's own initialization or `init_fn(module)` (docs/pipeline.md#a-model-built-on-meta).
    `token_dispatch` (`PlanOptions.token_dispatch`) other than "allgather", with stages built by
    `build_stage`: the stages are exported with transformers' experts modules as routed-experts
    ops, whose dispatcher each stage's plan places. `transport` (with no mesh): the pipeline's
    messages and sums go by it, not by a process group (every rank in one process, in the tests:
    `autopar.testing.pipeline_lockstep`)."""
    if seeded is None:
        seeded = torch.random.get_rng_state()
    if mesh is None:  # a transport's pipeline: the pp axis alone, of the transport's ranks
        if transport is None or build_stage is not None:
            raise UsageError(
                "pipeline_parallelize without a mesh runs the pp axis alone, over a transport",
                hint='pass the mesh: init_device_mesh("cpu", (p,), mesh_dim_names=("pp",))',
            )
        pp = transport.size
    else:
        names = tuple(mesh.mesh_dim_names or ())
        if "pp" not in names or (mesh.ndim > 1 and build_stage is None):
            raise UsageError(
                f"pipeline_parallelize takes a mesh with an axis named 'pp' (and, beside it, a stage builder "
                f"for the tensor axes), got dims {mesh.mesh_dim_names}",
                hint='init_device_mesh("cpu", (p,), mesh_dim_names=("pp",)), or autopar.parallelize for more axes',
            )
        pp = mesh.size(names.index("pp"))
    if decision is None:
        decision = decide_pipeline(
            model,
            tuple(example_inputs),
            pp=pp,
            microbatches=microbatches,
            schedule=schedule,
            virtual_stages=virtual_stages,
            hardware=hardware,
            stage_boundaries=stage_boundaries,
            split_backward=build_stage is not None,
            example_kwargs=example_kwargs,
        )
    plan, boundaries, cut = decision.schedule, list(decision.boundaries), decision.cut
    if build_stage is None:  # stages run by parallel modules split their backward (zero-bubble)
        check_supported(plan)
    example = tuple(example_inputs)
    if len(boundaries) != plan.num_stages - 1:
        raise PipelineSplitError(
            f"{plan.num_stages} stages need {plan.num_stages - 1} stage boundaries, got {len(boundaries)}",
            hint="name the first module of every stage after the first",
        )
    pmodel = PipelinedModule(
        model, mesh, plan, boundaries, cut, pp_group=pp_group, build_stage=build_stage, scatter=scatter,
        init_fn=init_fn, seeded=seeded, routed_experts=token_dispatch != "allgather" and build_stage is not None,
        transport=transport,
    )  # fmt: skip
    pmodel.schedule_choice = decision.choice
    pieces = split_microbatches((example, dict(example_kwargs or {})), microbatches)
    whole = (example, dict(example_kwargs or {}))
    pairs = [(pytree.tree_leaves(mb), mb) for mb in pieces]
    pmodel._program(*pairs[0], whole, 0, pairs)  # export and cut now: errors show here
    if (dist.get_rank() if transport is None else transport.rank) == 0:
        path = dump_dir_from(dump_dir, 0)
        if path is not None:
            pmodel.write_pipeline_timeline(path)
    return pmodel


def parallelize_on_pipeline_mesh(
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[Any],
    example_kwargs: dict[str, Any] | None,
    schedule: str | None,
    microbatches: int | None,
    stage_boundaries: Sequence[str] | None,
    virtual_stages: int,
    hardware: str,
    options: ModuleOptions,
    timeout: float | timedelta,
) -> PipelinedModule:
    """`parallelize` on a mesh with a "pp" axis: the pipeline runtime (`autopar.compiler.pipeline`),
    each stage compiled on the other axes by `compile_module` when there are any."""
    if microbatches is None or isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise UsageError(
            f"a pipeline needs microbatches= (a positive int), got {microbatches!r}",
            hint="parallelize(model, mesh, example_inputs=..., pipeline=autopar.PipelineOptions(microbatches=8))",
        )
    name = "1f1b" if schedule is None else schedule
    if not isinstance(name, str):
        raise UsageError(
            f"PipelineOptions(schedule={schedule!r}) on a pipeline mesh: name the pipeline schedule",
            hint='schedule="1f1b", "gpipe", "interleaved-1f1b", "zero-bubble" or "auto"',
        )
    if name == "zero-bubble" and options.compile:
        raise UsageError(
            "a zero-bubble pipeline splits each stage's backward program in two, which compile=True "
            "(Inductor compiles the whole backward) does not do yet",
            hint='drop compile=True, or use schedule="1f1b" / "interleaved-1f1b" / "auto"',
        )
    if options.inputs != GLOBAL:
        raise UsageError(
            'a pipeline takes the global batch on every rank (inputs="local" is not supported with a "pp" axis)',
            hint='drop inputs="local"',
        )
    seeded = torch.random.get_rng_state()  # what a meta-device model's stages are initialized from
    names = tuple(mesh.mesh_dim_names or ())
    pp = mesh.size(names.index("pp"))
    decision = decide_pipeline(
        model,
        tuple(example_inputs),
        pp=pp,
        microbatches=microbatches,
        schedule=name,
        virtual_stages=virtual_stages,
        hardware=hardware,
        tensor_size=mesh.size() // pp,
        stage_boundaries=stage_boundaries,
        memory_limit=options.memory_limit,
        split_backward=not options.compile,  # Inductor-compiled stages do not split their backward
        example_kwargs=example_kwargs,
    )
    build_stage = None
    pp_group = None
    scatter = None
    if mesh.ndim == 1 and (decision.schedule.split_backward or options.compile):
        # zero-bubble splits each stage's backward program, and compile=True runs each stage's
        # programs through Inductor: every stage is compiled by `compile_module`, on one rank
        mesh = init_device_mesh(mesh.device_type, (mesh.size(), 1), mesh_dim_names=("pp", "stage"))
    if mesh.ndim > 1:
        names = tuple(mesh.mesh_dim_names or ())
        check_device_mesh(mesh)
        groups = make_pipeline_groups(mesh, names.index("pp"), as_timeout(timeout))
        stage_mesh = Mesh.from_device_mesh(mesh[tuple(n for n in names if n != "pp")])
        autocast = compilable_autocast(("cpu", mesh.device_type))
        stage_options = dataclasses.replace(options, check_inputs=False)  # stages' inputs are the runtime's

        def build_stage(module: nn.Module, args: tuple[Any, ...], budget: StageBudget) -> ParallelModule:
            limit = stage_options.memory_limit
            chosen = dataclasses.replace(
                stage_options,
                memory_limit=None if limit is None else limit * budget.memory_share,
                activation_copies=budget.activation_copies,
                # Inductor-compiled stages reduce each microbatch's gradients (can_accumulate_gradients)
                gradient_copies=1 if budget.accumulates and not stage_options.compile else 0,
            )
            if isinstance(module, StageModule) and not module.calls_any(ROUTED_OPS):  # a stage without MoE layers
                chosen = dataclasses.replace(chosen, token_dispatch="allgather")
            return compile_module(
                module, stage_mesh, groups.stage, chosen, args, None, args, None,
                autocast=autocast, seeded=seeded, init_model=model,
            )

        pp_group = groups.pp
        scatter = BoundaryScatter(groups.stage.world, stage_mesh.size, dist.get_rank(groups.stage.world))
    pmodel = pipeline_parallelize(
        model,
        mesh,
        tuple(example_inputs),
        microbatches=microbatches,
        schedule=name,
        stage_boundaries=stage_boundaries,
        virtual_stages=virtual_stages,
        hardware=hardware,
        pp_group=pp_group,
        build_stage=build_stage,
        scatter=scatter,
        dump_dir=options.dump_dir,
        decision=decision,
        example_kwargs=example_kwargs,
        init_fn=options.init_fn,
        seeded=seeded,
        token_dispatch=options.token_dispatch,
    )
    pmodel.schedule_named = schedule not in (None, "auto")  # a loss outside runs GPipe's order: warned
    return pmodel
