"""The pipeline axis alone: `pipeline_entry.pipeline_parallelize` cuts a model into stages over a 1-D mesh named
"pp" and runs a schedule's action lists every call (docs/pipeline.md#runtime-pipeline-axis-alone).

The user's loop is unchanged: `loss = pmodel(*batch)` on every rank with the global batch runs the
whole step (every microbatch's forward and backward) and returns the serial loss of the batch;
`loss.backward()` deposits this rank's gradients (the serial ones) into its parameters' `.grad`;
an optimizer over `pmodel.parameters()` (this rank's stages' parameters, the user's own tensors
under the model's names) updates them. Tensor axes per stage come later; this entry point is not
wired into `autopar.parallelize` yet.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.compiler.pipeline_batch import (
    DepositGradients,
    as_output,
    broadcast_outputs,
    deposit_targets,
    gather_outputs,
    program_key,
    rebuild_outputs,
    split_microbatches,
    step_gradients,
)
from autopar.compiler.pipeline_checkpoint import pipelined_state_dict
from autopar.compiler.pipeline_choice import ScheduleChoice
from autopar.compiler.pipeline_guards import export_for_branch, serving
from autopar.compiler.pipeline_meta import MetaHolders, make_stage_tensors
from autopar.compiler.pipeline_outputs import TrainedOutputs, attach_backward, outside_loss_schedule
from autopar.compiler.pipeline_params import PipelineParameters
from autopar.compiler.pipeline_random import PipelineDropout
from autopar.compiler.pipeline_reports import PipelineReports
from autopar.compiler.pipeline_split import (
    OutputLayout,
    PipelineSplitError,
    StageProgram,
    batch_random_ops,
    module_flags,
    split_stages,
)
from autopar.compiler.pipeline_stage import (
    StageBuilder,
    StageModule,
    check_same_readers,
    check_same_tensors,
    parallel_stage_forward,
    stage_arguments,
    stage_budget,
    stage_forward,
    stage_specs,
)
from autopar.core.errors import UsageError
from autopar.core.pipeline_schedule import Schedule
from autopar.passes.routed_experts_trace import mark_routing_imbalance, routed_experts_traced
from autopar.planning.stage_result import StageCut
from autopar.runtime.clip_watch import watch_clipping
from autopar.runtime.defer_reduction import GradAccumulation
from autopar.runtime.materialize import InitFn, meta_tensor_names
from autopar.runtime.module_state import NotCopyable
from autopar.runtime.pipeline_runtime import (
    BoundaryScatter,
    StageRunner,
    StepResult,
    broadcast_loss,
    run_step,
    start_step,
)
from autopar.runtime.pipeline_transport import PipelineTransport, ProcessGroupTransport
from autopar.runtime.run_program import WeightDeferral
from autopar.runtime.source_attributes import (
    PIPELINE_WHOLE_WEIGHTS,
    ModuleAttributeError,
    first_dtype,
    remember_source,
    source_attribute,
)
from autopar.runtime.source_watch import SourceWatch

__all__ = ["MAX_PROGRAMS", "PipelinedModule", "split_microbatches"]

# Exported stage programs kept per module (one per microbatch shape and mode), the oldest dropped.
MAX_PROGRAMS = 8


class PipelinedModule(PipelineReports, PipelineParameters, NotCopyable, nn.Module):
    """This rank's stages of a pipelined model. `pmodel(*batch)` runs one training step of the
    schedule and returns the batch's loss; under `torch.no_grad()` it runs the forwards only. A
    call without a loss (logits, a transformers model without labels) runs the forwards only and
    returns the model's outputs on every rank (docs/pipeline.md#inference-a-call-without-a-loss).

    `parameters()` / `named_parameters()` are this rank's stages' parameters under the model's
    names: on a 1-D ("pp",) mesh the user's own tensors; with tensor axes beside "pp", the DTensor
    blocks of each stage's parallel module (`stage_parallel`). A tied weight held by several stages
    is one parameter on each rank that holds it; its gradient is the sum over all of them.
    Attributes: `schedule`, `stages` (this rank's stage indices), `boundaries` (the first module of
    each later stage), `stage_cut` (the cost model's report of the cut, chosen or forced; None for
    one stage), `schedule_choice` (what schedule="auto" compared), `stage_modules` (the units each
    stage holds)."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh | None,
        schedule: Schedule,
        boundaries: Sequence[str],
        stage_cut: StageCut | None,
        *,
        pp_group: dist.ProcessGroup | None = None,
        build_stage: StageBuilder | None = None,
        scatter: BoundaryScatter | None = None,
        init_fn: InitFn | None = None,
        seeded: torch.Tensor | None = None,
        routed_experts: bool = False,
        transport: PipelineTransport | None = None,
    ) -> None:
        super().__init__()
        self.__dict__["_model"] = model  # not a submodule: parameters() is this rank's only
        self.schedule = schedule
        self.boundaries = tuple(boundaries)
        self.stage_cut = stage_cut
        self.schedule_choice: ScheduleChoice | None = None  # what schedule="auto" compared
        if mesh is None and transport is None:
            raise UsageError("a pipelined module needs the mesh it runs on", hint="pass the DeviceMesh with the 'pp' axis")
        if transport is None:  # a user's pipeline: the pp process group
            assert mesh is not None
            transport = ProcessGroupTransport(pp_group if pp_group is not None else mesh.get_group("pp"))
        # the stages' messages and the pp group's sums: a process group's, or (in the tests) every
        # rank's in one process (`autopar.testing.pipeline_lockstep`)
        self.transport = transport
        self.device = mesh.device_type if mesh is not None else "cpu"
        self.rank = mesh.get_local_rank("pp") if mesh is not None else transport.rank
        # the tensor axes beside pp, and a stage sub-mesh's ranks (none without a mesh: pp alone)
        self._mesh_axes = mesh.ndim - 1 if mesh is not None else 0
        self._stage_ranks = mesh.size() // mesh.size((mesh.mesh_dim_names or ()).index("pp")) if mesh is not None else 1
        self.stages = schedule.placement.stages_of(self.rank)
        self.training = model.training
        # each submodule's mode (modules() order) as the model had it, until pmodel.train()/eval()
        self._flags = tuple(m.training for m in model.modules())
        self._build_stage = build_stage
        # export transformers' experts modules as routed-experts ops (PlanOptions.token_dispatch),
        # so that each stage's plan can place the all-to-all dispatcher
        self._routed_experts = routed_experts
        self._first_attrs: list[set[str]] = []  # what each stage read in the first program
        self._scatter = scatter
        # per microbatch signature, its programs: one per branch the inputs' values took
        self._programs: dict[tuple[Any, ...], list[StageProgram]] = {}
        self._variants: dict[tuple[Any, ...], int] = {}  # programs made per signature (`variant`)
        self._dropout = PipelineDropout()
        self._order_warned = [False]  # a named schedule run in GPipe's order for a loss outside
        self.schedule_named = False  # whether the user named the schedule (parallelize sets it)
        self._init_fn = init_fn
        self._seeded = torch.random.get_rng_state() if seeded is None else seeded
        self.materialized_bytes = 0  # what this rank made of a model built on meta (its stages')
        self._holders: MetaHolders | None = None  # on meta, 1-D: which rank holds which tensor
        self._names = self._parameter_names()
        self._local: list[tuple[str, nn.Parameter]] = []
        self._readers: dict[int, set[int]] = {}  # a trained user tensor -> the stages reading it (first call)
        # shared weights: (name, the user's tensor, this rank's copies of it that stages train)
        self._shared: list[tuple[str, nn.Parameter, list[nn.Parameter]]] = []
        self.stage_modules: tuple[tuple[str, ...], ...] = ()
        self.__dict__["_stage_wrappers"] = {}  # stage -> StageModule (holds the user's tensors)
        self.__dict__["stage_parallel"] = {}  # stage -> its parallel module on the tensor sub-mesh
        # torch's clip_grad_norm_ over this rank's stages alone: warned at the optimizer's step
        self._clip_watch = watch_clipping(self)
        remember_source(self, model)  # pmodel.config; what it lacks said with a hint (__getattr__)
        self._source_watch = SourceWatch(model, pipeline=True)  # hooks, modes set on the model later: said

    def __getattr__(self, name: str) -> Any:
        """The source model's plain attributes (`pmodel.config`) and `dtype`, as a tensor-only
        module's; for anything else an AttributeError that says where to read it instead."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        if name == "dtype":
            return first_dtype(self)
        return source_attribute(self, name, PIPELINE_WHOLE_WEIGHTS)

    def get_submodule(self, target: str) -> nn.Module:
        """Only `""` (the module itself): a pipelined module runs its stages' exported programs,
        not the model's submodules, so there is none to switch or hook (torch's lookup gave a bare
        AttributeError)."""
        if not target:
            return self
        raise ModuleAttributeError(
            f"a pipelined module has no submodule {target!r}: it runs this rank's stages {list(self.stages)} "
            "as exported programs, not the model's modules",
            hint="set a submodule's mode on the model before parallelize (model.get_submodule(path).eval(): the "
            "pipeline keeps it); pmodel.train()/pmodel.eval() switch every module; register forward hooks on "
            "the model before parallelize; a parameter is pmodel.get_parameter(name)",
        )

    def _materialize(self, program: StageProgram) -> None:
        """A model built on meta: this rank's stages' tensors, made now (`make_stage_tensors`): on a
        1-D pipeline mesh all of them; with tensor axes those no stage reads, as each stage's
        parallel module makes its own blocks of the rest."""
        if self._build_stage is None and meta_tensor_names(self._model):
            placement = self.schedule.placement
            self._holders = MetaHolders(self._model, program, [placement.stages_of(q) for q in range(placement.pp)])
        made = make_stage_tensors(
            self._model, program, self.stages, read=self._build_stage is None, init_fn=self._init_fn,
            seeded=self._seeded, device=self.device,
        )  # fmt: skip
        if made:
            self.materialized_bytes = made
            self._names = self._parameter_names()

    def train(self, mode: bool = True) -> PipelinedModule:
        """Every submodule's mode as the model's own `train(mode)` sets them: `nn.Module.train`
        (all in `mode`) or the model's override (mmdet's backbones keep their BatchNorms in eval,
        `norm_eval`). The stage programs are exported with these flags; the model's own flags are
        put back as they were."""
        self.training = mode
        with module_flags(self._model, self._flags):
            self._model.train(mode)
            self._flags = tuple(m.training for m in self._model.modules())
        for module in self.__dict__["stage_parallel"].values():
            module.train(mode)
        return self

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Refused: a rank holds only its stages' tensors; `autopar.load_checkpoint` loads a
        checkpoint (DCP or safetensors) into them, and `dcp.load(pmodel.state_dict(), ...)` in place."""
        raise PipelineSplitError(
            "load_state_dict on a pipelined module: each rank holds only its stages' tensors",
            hint="use autopar.load_checkpoint(pmodel, path), or torch.distributed.checkpoint.load("
            "pmodel.state_dict(), checkpoint_id=path)",
        )

    def state_dict(self, *args: Any, keep_vars: bool = False, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The tensor-only module's state dict for this rank's stages (docs/pipeline.md#checkpoints):
        the model's names and global shapes, for `torch.distributed.checkpoint.save`."""
        return pipelined_state_dict(self, keep_vars=keep_vars)

    # -- one step -----------------------------------------------------------------------------

    def _program(
        self,
        flat: Sequence[Any],
        call: tuple[tuple[Any, ...], dict[str, Any]],
        whole: tuple[tuple[Any, ...], dict[str, Any]],
        microbatch: int = 0,
        others: Sequence[tuple[list[Any], tuple[tuple[Any, ...], dict[str, Any]]]] = (),
    ) -> StageProgram:
        """The stage programs for microbatch `microbatch`'s call `(args, kwargs)` of the call
        `whole` (whose microbatches are `others`), exported once per shape and, for a model whose
        Python reads its inputs' values, once per branch the whole batch takes
        (`pipeline_guards`)."""
        key = program_key(flat, self._flags, pytree.tree_structure(call))
        found = self._programs.get(key, [])
        program = serving(found, whole, flat, self.device)
        if program is not None:
            self._programs[key] = self._programs.pop(key)  # most recently used last
            return program

        def export(example_flat: Sequence[Any], example: tuple[tuple[Any, ...], dict[str, Any]]) -> StageProgram:
            args, kwargs = example
            with routed_experts_traced(self._model, self._routed_experts):
                split = split_stages(
                    self._model, example_flat, args, self.boundaries, self.schedule.num_stages, example_kwargs=kwargs
                )
            for stage_graph in split.stages:  # each stage's routed-experts nodes priced at its model's imbalance
                mark_routing_imbalance(stage_graph.module, self._model)
            return split

        def same_key(example_flat: Sequence[Any], example: tuple[tuple[Any, ...], dict[str, Any]]) -> bool:
            return program_key(example_flat, self._flags, pytree.tree_structure(example)) == key

        with module_flags(self._model, self._flags):
            same_shape = [(f, c) for f, c in others if f is not flat and same_key(f, c)]
            program = export_for_branch(
                self._model, (flat, call), whole, microbatch, found, same_shape, export, self.device
            )
        # numbered per mode and shape, not per module flags: programs of other flags (a submodule
        # frozen at parallelize, all trained after pmodel.train()) are other variants, so a stage's
        # parallel module (tensor axes), which keys its programs by its own mode, compiles each
        same_call = program_key(flat, self.training, pytree.tree_structure(call))
        program.variant = self._variants.get(same_call, 0)
        self._variants[same_call] = program.variant + 1
        if not self._programs:  # a model on meta: this rank's stages' tensors, made now
            self._materialize(program)
        elif self._build_stage is None:
            check_same_readers(self._readers, program, lambda s: self._user_params(program, s), self._names)
        if self._programs and self._holders is not None and self._holders.receive(
            self._model, program, self.transport, self.rank, self.device
        ):  # a tensor another rank holds, read by this rank's stage in this call only
            self._names = self._parameter_names()
        if self.training:  # dropout: the serial masks where the stages run their own graphs
            self._dropout.adopt([(st.module, st.sources) for st in program.stages], program.random_ops)
        if self._build_stage is not None:
            check_same_tensors(self._first_attrs, program)
            self._add_stage_programs(program, flat)
        if not self._programs:
            self._first_program(program)
        self._programs.pop(key, None)
        self._programs[key] = [*found, program][-MAX_PROGRAMS:]
        return program

    def _add_stage_programs(self, program: StageProgram, flat: Sequence[Any]) -> None:
        """Give each of this rank's stage modules its program for this microbatch shape; the first
        time, plan and compile each stage on the tensor sub-mesh (`build_stage`)."""
        assert self._build_stage is not None
        wrappers: dict[int, StageModule] = self.__dict__["_stage_wrappers"]
        parallel: dict[int, nn.Module] = self.__dict__["stage_parallel"]
        ops = program.random_ops

        def example_mask(k: int) -> torch.Tensor:  # a dropout's mask is an input: one of its shape
            return torch.ones(ops[k].shape, dtype=ops[k].dtype, device=self.device)

        budget = stage_budget(self.schedule, self.rank, len(self.stages), program.loss is not None)
        for s in self.stages:
            graph = program.stages[s]
            received = [
                torch.zeros(spec.shape, dtype=spec.dtype, device=self.device).requires_grad_(
                    spec.differentiable
                )
                for spec in graph.input_specs
            ]
            args = stage_arguments(graph, flat, received, example_mask)
            if s in wrappers:
                wrappers[s].add(graph, args, self.training, program.variant)
                continue
            wrapper = StageModule(self._model, graph, program.constants)
            wrapper.train(self.training)
            wrapper.add(graph, args, self.training, program.variant)
            wrappers[s] = wrapper
            parallel[s] = self._build_stage(wrapper, args, budget)

    # torch.compile(pmodel) must not trace the runtime (checks, compiles, collectives):
    # it runs as pmodel does; compile=True sends the programs through Inductor
    @torch.compiler.disable
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._source_watch.check()
        schedule = self.schedule
        pieces = split_microbatches((args, kwargs), schedule.microbatches)
        flats = [pytree.tree_leaves(mb) for mb in pieces]
        # every microbatch's program is chosen (its value guards checked on the whole batch) before
        # any stage runs: a batch the model rejects raises on every rank, none waits for a peer
        pairs = list(zip(flats, pieces, strict=True))
        programs = [self._program(f, mb, (args, kwargs), m, pairs) for m, (f, mb) in enumerate(pairs)]
        while len(self._programs) > MAX_PROGRAMS:  # this call's programs were used last: kept
            del self._programs[next(iter(self._programs))]
        if self.training:
            self._draw_masks(programs, (args, kwargs))
        rule = programs[0].loss
        forward_only = not torch.is_grad_enabled()
        given = pytree.tree_leaves((args, kwargs))
        wanted = [] if forward_only else [i for i, t in enumerate(given) if isinstance(t, torch.Tensor) and t.requires_grad]
        # the loss is the user's, outside; in eval(), a backward to an input (a saliency map)
        if rule is None and (self.training or wanted) and not forward_only:
            return self._train_outputs(programs, flats, given, wanted)
        if rule is None:  # a call without a loss (inference): its outputs, microbatched
            return self._infer(programs, flats)
        counts = [rule.count(f) for f in flats]  # (microbatches' programs share the loss rule)
        denominator = 1 if rule.kind == "one" else sum(counts)
        _input_leaves(flats, wanted)
        runners = {s: self._runner(s, programs, flats, forward_only, wanted) for s in self.stages}
        result = run_step(
            schedule,
            self.rank,
            runners,
            self.transport,
            loss_scale=1.0 / denominator if denominator else math.inf,
            forward_only=forward_only,
            device=self.device,
            scatter=self._scatter,
        )
        last_rank = schedule.placement.rank_of(schedule.num_stages - 1)
        total = None if result.loss is None else result.loss / denominator
        loss = broadcast_loss(total, last_rank, self.transport, programs[0].loss_dtype, self.device)
        if forward_only:
            return as_output(loss, programs[0].output_type)
        local = [p for _, p in self._local]
        params = deposit_targets(local, given, wanted)
        stage_params = {s: runner.params for s, runner in runners.items()}
        ordered = step_gradients(
            result, stage_params, self._shared, local, wanted, flats, given, self.transport, self.device,
            self._mesh_axes, self._stage_ranks,
        )
        done = functools.partial(self._clip_watch.after_backward, local)
        out: torch.Tensor = DepositGradients.apply(loss, ordered, done, *params)  # type: ignore[no-untyped-call]
        return as_output(out, programs[0].output_type)

    def _draw_masks(self, programs: list[StageProgram], call: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        """This step's dropout masks: the serial model's, drawn from the generator on every rank."""

        def export_batch() -> list[Any]:
            return batch_random_ops(self._model, *call, flags=self._flags)

        key = program_key(pytree.tree_leaves(call), self._flags, pytree.tree_structure(call))
        key += tuple(p.variant for p in programs)  # a branch the inputs' values took may draw other ops
        micro = [p.random_ops for p in programs]
        self._dropout.prepare(key, export_batch, micro, self.stages, self.device)

    def _infer(self, programs: list[StageProgram], flats: list[list[Any]]) -> Any:
        """The forwards of every microbatch through the stages; the model's outputs, put back
        together on dim 0, on every rank (`gather_outputs`)."""
        layouts = _output_layouts(programs)
        runners = {s: self._runner(s, programs, flats, True) for s in self.stages}
        result = run_step(
            self.schedule, self.rank, runners, self.transport, loss_scale=1.0, forward_only=True,
            device=self.device, scatter=self._scatter, keep_outputs=True,
        )  # fmt: skip
        last_rank = self.schedule.placement.rank_of(self.schedule.num_stages - 1)
        return gather_outputs(result.outputs, layouts, last_rank, self.transport, self.device)

    def _train_outputs(
        self, programs: list[StageProgram], flats: list[list[Any]], given: list[Any], wanted: list[int]
    ) -> Any:
        """A training call whose loss the user computes from the outputs (or a call in eval() whose
        input requires grad: a saliency map): every microbatch's forward, kept for its backward;
        the outputs whole on every rank, whose backward runs the step's backwards
        (docs/pipeline.md#a-loss-outside-the-model)."""
        layouts = _output_layouts(programs)
        schedule = outside_loss_schedule(self.schedule, self.schedule_named, self._order_warned)
        _input_leaves(flats, wanted)
        runners = {s: self._runner(s, programs, flats, False, wanted, split=False) for s in self.stages}
        pending = start_step(schedule, self.rank, runners, self.transport, device=self.device, scatter=self._scatter)
        last_rank = schedule.placement.rank_of(schedule.num_stages - 1)
        whole = broadcast_outputs(pending.outputs, layouts, last_rank, self.transport, self.device)
        local = [p for _, p in self._local]
        stage_params = {s: runner.params for s, runner in runners.items()}

        def gradients(result: StepResult) -> list[torch.Tensor | None]:
            self._clip_watch.after_backward(local)
            return step_gradients(
                result, stage_params, self._shared, local, wanted, flats, given, self.transport, self.device,
                self._mesh_axes, self._stage_ranks,
            )

        trained = TrainedOutputs(pending, layouts, gradients)
        return rebuild_outputs(attach_backward(whole, trained, deposit_targets(local, given, wanted)), layouts[0])

    def _runner(
        self,
        stage: int,
        programs: list[StageProgram],
        flats: list[list[Any]],
        forward_only: bool,
        wanted: Sequence[int] = (),
        split: bool | None = None,
    ) -> StageRunner:
        """Stage `stage` as the runtime calls it for this step's microbatches; `split`: whether its
        backward runs in two parts (default: the schedule's)."""
        split = self.schedule.split_backward if split is None else split
        params = tuple(self._stage_params(programs[0], stage))
        parallel = self.__dict__["stage_parallel"].get(stage)
        backward_weight = None
        accumulation: GradAccumulation | None = None
        if parallel is None:
            forward = stage_forward(self._model, stage, programs, flats, self._dropout.masks)
        else:
            # zero-bubble: each microbatch's backward leaves its weight part here until its W action
            deferrals: dict[int, WeightDeferral] | None = None
            if split and not forward_only:
                deferrals = {}

                def backward_weight(m: int) -> list[torch.Tensor | None]:
                    assert deferrals is not None
                    return parallel.weight_gradients(deferrals.pop(m), params)

            if not split and not forward_only and parallel.can_accumulate_gradients:
                accumulation = GradAccumulation()  # reduced once per step, after the last backward

                def reduce_grads() -> list[torch.Tensor | None]:
                    assert accumulation is not None
                    return accumulation.reduce(params)

            forward = parallel_stage_forward(
                stage, parallel, programs, flats, self._dropout.masks, deferrals, accumulation
            )
        return StageRunner(
            index=stage,
            forward=forward,
            params=params,
            input_specs=stage_specs(programs, stage, "in"),
            output_specs=stage_specs(programs, stage, "out"),
            backward_weight=backward_weight,
            reduce_grads=reduce_grads if accumulation is not None else None,
            input_leaves=(lambda m: [flats[m][i] for i in wanted]) if wanted else None,
        )


def _output_layouts(programs: list[StageProgram]) -> list[OutputLayout]:
    """The outputs of every microbatch of a call without a loss; refused where some have one."""
    layouts = [p.outputs for p in programs]
    found = [x for x in layouts if x is not None]
    if len(found) != len(layouts):
        raise PipelineSplitError(
            "some microbatches of this call return a loss and others do not",
            hint="pass the labels for every sample of the batch, or for none",
        )
    return found


def _input_leaves(flats: list[list[Any]], wanted: Sequence[int]) -> None:
    """Inputs that require grad (`wanted`): a leaf per microbatch, whose gradient the step returns."""
    for f in flats:
        for i in wanted:
            f[i] = f[i].detach().requires_grad_(True)
