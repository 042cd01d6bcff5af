"""The pipeline axis alone: `pipeline_parallelize` cuts a model into stages over a 1-D mesh named
"pp" and runs a schedule's action lists every call (docs/pipeline.md#runtime-pipeline-axis-alone).

The user's loop is unchanged: `loss = pmodel(*batch)` on every rank with the global batch runs the
whole step (every microbatch's forward and backward) and returns the serial loss of the batch;
`loss.backward()` deposits this rank's gradients (the serial ones) into its parameters' `.grad`;
an optimizer over `pmodel.parameters()` (this rank's stages' parameters, the user's own tensors
under the model's names) updates them. Tensor axes per stage come later; this entry point is not
wired into `autopar.parallelize` yet.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.compiler.pipeline_split import (
    PipelineSplitError,
    StageProgram,
    get_attr,
    split_stages,
)
from autopar.core.errors import UsageError
from autopar.core.pipeline_schedule import Schedule, schedule_by_name
from autopar.passes.trace import trace
from autopar.planning.stage_cut import StageCut, cut_stages
from autopar.runtime.pipeline_runtime import (
    StageRunner,
    TensorSpec,
    broadcast_loss,
    check_supported,
    run_step,
    sum_shared_grads,
)

__all__ = ["MAX_PROGRAMS", "PipelinedModule", "pipeline_parallelize", "split_microbatches"]

# Exported stage programs kept per module (one per microbatch shape and mode), the oldest dropped.
MAX_PROGRAMS = 8


def split_microbatches(args: tuple[Any, ...], microbatches: int) -> list[tuple[Any, ...]]:
    """The batch cut on dim 0 into `microbatches` pieces (`torch.tensor_split`: sizes differ by at
    most one when M does not divide the batch); other arguments are passed to every piece."""
    leaves, spec = pytree.tree_flatten(args)
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise UsageError(
            f"the pipeline cuts every tensor input on dim 0 into microbatches, but their sizes there are {sorted(sizes)}",
            hint="pass inputs that share the batch dimension first",
        )
    (batch,) = sizes
    if batch < microbatches:
        raise UsageError(
            f"a batch of {batch} cannot be cut into {microbatches} microbatches",
            hint="use at most as many microbatches as the batch has samples",
        )
    pieces = [
        torch.tensor_split(t, microbatches, dim=0) if isinstance(t, torch.Tensor) and t.dim() > 0 else None
        for t in leaves
    ]
    out = []
    for m in range(microbatches):
        mb = [p[m] if p is not None else leaf for p, leaf in zip(pieces, leaves, strict=True)]
        out.append(tuple(pytree.tree_unflatten(mb, spec)))
    return out


def _key(flat: Sequence[Any], training: bool) -> tuple[Any, ...]:
    """What a stage program is exported for: each input's shape and dtype (other values as they are)."""
    return (training,) + tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (type(x).__name__, repr(x))
        for x in flat
    )


class _DepositGradients(torch.autograd.Function):
    """The returned loss's backward: hands the gradients the step computed to autograd, times the
    incoming gradient, so they accumulate into `.grad` as torch's own would."""

    @staticmethod
    def forward(
        ctx: Any, loss: torch.Tensor, grads: list[torch.Tensor | None], *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, *(None if g is None else g * grad for g in ctx.grads))


class PipelinedModule(nn.Module):
    """This rank's stages of a pipelined model. `pmodel(*batch)` runs one training step of the
    schedule and returns the batch's loss; under `torch.no_grad()` it runs the forwards only.

    `parameters()` / `named_parameters()` are this rank's stages' parameters: the user's tensors
    under the model's names (a tied weight held by several stages is one parameter on each rank
    that holds it; its gradient is the sum over all of them). Attributes: `schedule`, `stages`
    (this rank's stage indices), `boundaries` (the first module of each later stage), `stage_cut`
    (the cost model's report when the cut was chosen, else None), `stage_modules` (the units each
    stage holds)."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        schedule: Schedule,
        boundaries: Sequence[str],
        stage_cut: StageCut | None,
    ) -> None:
        super().__init__()
        self.__dict__["_model"] = model  # not a submodule: parameters() is this rank's only
        self.schedule = schedule
        self.boundaries = tuple(boundaries)
        self.stage_cut = stage_cut
        self.group = mesh.get_group(0)
        self.device = mesh.device_type
        self.rank = mesh.get_local_rank(0)
        self.stages = schedule.placement.stages_of(self.rank)
        self.training = model.training
        self._programs: dict[tuple[Any, ...], StageProgram] = {}
        names: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        self._names = names
        self._local: list[nn.Parameter] = []
        self._shared: list[tuple[str, nn.Parameter]] = []
        self.stage_modules: tuple[tuple[str, ...], ...] = ()

    @property
    def _model(self) -> nn.Module:
        """The user's model (kept outside the module tree: it holds every stage's parameters)."""
        model: nn.Module = self.__dict__["_model"]
        return model

    # -- parameters ---------------------------------------------------------------------------

    def _stage_params(self, program: StageProgram, stage: int) -> list[nn.Parameter]:
        found: dict[int, nn.Parameter] = {}
        for attr in program.stages[stage].attrs:
            value = program.constants.get(attr)
            if value is None:
                value = get_attr(self._model, attr)
            if isinstance(value, nn.Parameter) and value.requires_grad:
                found.setdefault(id(value), value)
        return list(found.values())

    def _first_program(self, program: StageProgram) -> None:
        """Which parameters this rank holds and which are held on several ranks (summed)."""
        holders: dict[int, set[int]] = {}
        by_id: dict[int, nn.Parameter] = {}
        for s in range(self.schedule.num_stages):
            for p in self._stage_params(program, s):
                holders.setdefault(id(p), set()).add(self.schedule.placement.rank_of(s))
                by_id[id(p)] = p
        mine = {id(p) for s in self.stages for p in self._stage_params(program, s)}
        order = [p for p in self._model.parameters() if id(p) in by_id]
        self._local = [p for p in order if id(p) in mine]
        self._shared = [(self._names[id(p)], p) for p in order if len(holders[id(p)]) > 1]
        self.stage_modules = program.stage_units

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for p in self._local:
            yield prefix + self._names[id(p)], p

    # -- one step -----------------------------------------------------------------------------

    def _program(self, flat: Sequence[Any], args: tuple[Any, ...]) -> StageProgram:
        key = _key(flat, self.training)
        found = self._programs.get(key)
        if found is None:
            was = self._model.training
            self._model.train(self.training)
            try:
                found = split_stages(self._model, flat, args, self.boundaries, self.schedule.num_stages)
            finally:
                self._model.train(was)
            if not self._programs:
                self._first_program(found)
            self._programs[key] = found
        else:
            self._programs[key] = self._programs.pop(key)  # most recently used last
        return found

    def forward(self, *args: Any) -> torch.Tensor:
        schedule = self.schedule
        pieces = split_microbatches(args, schedule.microbatches)
        flats = [pytree.tree_leaves(mb) for mb in pieces]
        programs = [self._program(f, mb) for f, mb in zip(flats, pieces, strict=True)]
        while len(self._programs) > MAX_PROGRAMS:  # this call's programs were used last: kept
            del self._programs[next(iter(self._programs))]
        rule = programs[0].loss
        counts = [p.loss.count(f) for p, f in zip(programs, flats, strict=True)]
        denominator = 1 if rule.kind == "one" else sum(counts)
        forward_only = not torch.is_grad_enabled()
        runners = {
            s: StageRunner(
                index=s,
                forward=self._stage_forward(s, programs, flats),
                params=tuple(self._stage_params(programs[0], s)),
                input_specs=self._specs(programs, s, "in"),
                output_specs=self._specs(programs, s, "out"),
            )
            for s in self.stages
        }
        result = run_step(
            schedule,
            self.rank,
            runners,
            self.group,
            loss_scale=1.0 / denominator if denominator else math.inf,
            forward_only=forward_only,
            device=self.device,
        )
        last_rank = schedule.placement.rank_of(schedule.num_stages - 1)
        total = None if result.loss is None else result.loss / denominator
        loss = broadcast_loss(total, last_rank, self.group, programs[0].loss_dtype, self.device)
        if forward_only:
            return loss
        grads: dict[int, torch.Tensor] = {}
        for s, stage_grads in result.grads.items():
            for p, g in zip(runners[s].params, stage_grads, strict=True):
                if g is not None:
                    grads[id(p)] = g if id(p) not in grads else grads[id(p)] + g
        summed = sum_shared_grads(
            [(p.shape, p.dtype, grads.get(id(p))) for _, p in self._shared], self.group, self.device
        )
        for (_, p), g in zip(self._shared, summed, strict=True):
            if any(p is q for q in self._local):
                grads[id(p)] = g
        params = list(self._local)
        ordered = [grads.get(id(p)) for p in params]
        if not params:  # a rank without trainable parameters: the loss still takes .backward()
            params = [nn.Parameter(torch.zeros(()))]
            ordered = [None]
        out: torch.Tensor = _DepositGradients.apply(loss, ordered, *params)  # type: ignore[no-untyped-call]
        return out

    def _stage_forward(self, stage: int, programs: list[StageProgram], flats: list[list[Any]]) -> Any:
        model = self._model

        def run(m: int, received: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            graph = programs[m].stages[stage]
            values: dict[str, Any] = dict(zip(graph.crossing_in, received, strict=True))
            args = []
            for kind, what in graph.sources:
                if kind == "input":
                    args.append(flats[m][what])
                elif kind == "attr":
                    constants = programs[m].constants
                    args.append(constants[what] if what in constants else get_attr(model, what))
                else:
                    args.append(values[what])
            outs = graph.module(*args)
            values.update(zip(graph.outputs, outs, strict=True))
            return [values[name] for name in graph.crossing_out]

        return run

    @staticmethod
    def _specs(programs: list[StageProgram], stage: int, side: str) -> Any:
        def specs(m: int) -> tuple[TensorSpec, ...]:
            graph = programs[m].stages[stage]
            return graph.input_specs if side == "in" else graph.output_specs

        return specs


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
) -> PipelinedModule:
    """Cut `model` into `pp * virtual_stages` stages over the 1-D mesh `mesh` (axis "pp") and return
    this rank's part. Every rank calls it with the same model and example batch.

    The cut is the cost model's (`autopar.planning.stage_cut.cut_stages` on the joint trace, priced
    on `hardware`) unless `stage_boundaries` names the first module of every stage after the first.
    `schedule`: "1f1b", "gpipe" or "interleaved-1f1b" (with `virtual_stages` > 1); "zero-bubble"
    raises `UnsupportedScheduleError`."""
    if mesh.ndim != 1 or tuple(mesh.mesh_dim_names or ()) != ("pp",):
        raise UsageError(
            f"pipeline_parallelize takes a 1-D mesh whose axis is named 'pp', got dims {mesh.mesh_dim_names}",
            hint='init_device_mesh("cpu", (p,), mesh_dim_names=("pp",))',
        )
    pp = mesh.size(0)
    plan = schedule_by_name(schedule, pp, virtual_stages, microbatches)
    check_supported(plan)
    example = tuple(example_inputs)
    cut = None
    if stage_boundaries is None:
        if plan.num_stages > 1:
            gm = trace(model, example, decompose=True)
            cut = cut_stages(
                gm,
                pp=pp,
                microbatches=microbatches,
                v=virtual_stages,
                schedule=schedule,
                hardware=hardware,
                memory_limit=math.inf,
            )
            boundaries: list[str] = list(cut.boundaries)
        else:
            boundaries = []
        # Every rank must cut alike: rank 0's choice is the one used.
        box: list[Any] = [boundaries]
        group = mesh.get_group(0)
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        boundaries = list(box[0])
    else:
        boundaries = list(stage_boundaries)
    if len(boundaries) != plan.num_stages - 1:
        raise PipelineSplitError(
            f"{plan.num_stages} stages need {plan.num_stages - 1} stage boundaries, got {len(boundaries)}",
            hint="name the first module of every stage after the first",
        )
    pmodel = PipelinedModule(model, mesh, plan, boundaries, cut)
    pieces = split_microbatches(example, microbatches)
    pmodel._program(pytree.tree_leaves(pieces[0]), pieces[0])  # export and cut now: errors show here
    return pmodel
