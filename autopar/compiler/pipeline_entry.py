"""`pipeline_parallelize`: the entry point that cuts a model into stages over a mesh's "pp" axis
and returns this rank's `PipelinedModule` (docs/pipeline.md). Apart from the module it builds, so
that the module's runtime and its construction read as two things."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.compiler.pipeline import PipelinedModule
from autopar.compiler.pipeline_batch import split_microbatches
from autopar.compiler.pipeline_choice import PipelineDecision, decide_pipeline
from autopar.compiler.pipeline_split import PipelineSplitError
from autopar.compiler.pipeline_stage import StageBuilder
from autopar.core.errors import UsageError
from autopar.reporting.dump import dump_dir_from
from autopar.runtime.materialize import InitFn
from autopar.runtime.pipeline_runtime import BoundaryScatter, check_supported

__all__ = ["pipeline_parallelize"]


def pipeline_parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
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
    ops, whose dispatcher each stage's plan places."""
    if seeded is None:
        seeded = torch.random.get_rng_state()
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
    )  # fmt: skip
    pmodel.schedule_choice = decision.choice
    pieces = split_microbatches((example, dict(example_kwargs or {})), microbatches)
    whole = (example, dict(example_kwargs or {}))
    pairs = [(pytree.tree_leaves(mb), mb) for mb in pieces]
    pmodel._program(*pairs[0], whole, 0, pairs)  # export and cut now: errors show here
    if dist.get_rank() == 0:
        path = dump_dir_from(dump_dir, 0)
        if path is not None:
            pmodel.write_pipeline_timeline(path)
    return pmodel
