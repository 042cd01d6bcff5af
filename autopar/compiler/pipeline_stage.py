"""A pipeline stage as a module of its own, so that the tensor search plans it on the stage's
sub-mesh like any model (docs/pipeline.md#tensor-axes-inside-each-stage).

`StageModule` holds the parameters and buffers that one stage reads, under their names in the
user's model (the parallel stage's DTensor parameters keep those names, so checkpoints and
optimizers see the model's names), and runs the stage's program for its inputs. A stage has one
program per microbatch shape (export specializes shapes); the module picks the one its inputs fit,
so later shapes (a smaller last batch) compile through the parallel module's own program cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.compiler.pipeline_random import DropoutMasks
from autopar.compiler.pipeline_split import PipelineSplitError, StageGraph, StageProgram, get_attr
from autopar.core.errors import AutoparError
from autopar.core.pipeline_schedule import Schedule
from autopar.core.pipeline_simulate import simulate
from autopar.runtime.defer_reduction import GradAccumulation
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline_runtime import TensorSpec
from autopar.runtime.run_program import WeightDeferral


@dataclass(frozen=True)
class StageBudget:
    """What one stage module's plan may take of its rank's memory: a share of the rank's
    `memory_limit` (its stages split it evenly), how many microbatches' saved activations the
    rank holds at once (`activation_copies`: the schedule's peak in flight, per stage) and whether
    the stage sums its microbatches' unreduced gradients before one reduction (`accumulates`:
    more than one microbatch and a backward run whole; the sums are held through the step,
    docs/pipeline.md#a-pipelined-ranks-memory)."""

    memory_share: float
    activation_copies: int
    accumulates: bool = False


def stage_budget(schedule: Schedule, rank: int, stage_count: int, loss_inside: bool) -> StageBudget:
    """The budget of each of `rank`'s `stage_count` stages under `schedule`. A call whose loss is
    outside the model runs every forward before any backward (`outside_loss_schedule`): each
    stage then holds every microbatch's activations."""
    if loss_inside:
        in_flight = simulate(schedule).peak_in_flight[rank]  # (stage, microbatch) pairs
        copies = math.ceil(in_flight / stage_count)
    else:
        copies = schedule.microbatches
    accumulates = schedule.microbatches > 1 and not schedule.split_backward  # zero-bubble reduces per W
    return StageBudget(1.0 / stage_count, max(1, copies), accumulates)


# Compiles a stage module on the stage's tensor sub-mesh, given its example arguments and its
# memory budget, and returns the parallel module this rank runs; every rank of the stage's slice
# calls it together.
StageBuilder = Callable[[nn.Module, tuple[Any, ...], StageBudget], ParallelModule]

Signature = tuple[tuple[tuple[int, ...], torch.dtype] | str, ...]


def signature_of(args: Sequence[Any]) -> Signature:
    """What picks a stage program: each argument's shape and dtype (other values by their repr)."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in args)


class _Programs:
    """A stage's programs by argument signature, shared (not copied) by the module's meta copies
    that later compiles trace."""

    def __init__(self) -> None:
        self.by_call: dict[tuple[bool, int, Signature], StageGraph] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> _Programs:
        return self


class StageModule(nn.Module):
    """Stage `index` of a pipelined model: `forward(*args)` takes the stage's arguments (the
    user's inputs it reads and the values it receives, in `StageGraph.sources` order without the
    attributes) and returns the values it makes that cross the next boundary (the last stage: its
    microbatch's loss term)."""

    def __init__(self, model: nn.Module, first: StageGraph, constants: dict[str, Any]) -> None:
        super().__init__()
        self.index = first.index
        self.attrs = first.attrs
        for name in first.attrs:
            value = constants[name] if name in constants else get_attr(model, name)
            _place(self, name, value, constant=name in constants)
        self._programs = _Programs()

    def add(self, graph: StageGraph, args: Sequence[Any], training: bool, variant: int = 0) -> None:
        """Run `graph` for calls in mode `training` whose arguments look like `args` (one
        microbatch shape; eval's program differs from training's, e.g. without dropout), called
        with `variant=variant` (a branch the inputs' values took, `StageProgram.variant`: the
        parallel module compiles a program per value of a plain argument). The caller has checked
        that it reads no tensor this module lacks (`check_same_tensors`)."""
        self._programs.by_call.setdefault((training, variant, signature_of(args)), graph)

    def calls_any(self, ops: Sequence[Any]) -> bool:
        """Whether some program of this stage calls one of `ops` (a stage holding MoE layers traced
        as routed-experts ops, for the token dispatcher its plan must place)."""
        return any(
            n.op == "call_function" and n.target in ops
            for graph in self._programs.by_call.values()
            for n in graph.module.graph.nodes
        )

    def forward(self, *args: Any, variant: int = 0) -> tuple[Any, ...]:
        graph = self._programs.by_call.get((self.training, variant, signature_of(args)))
        if graph is None:
            raise AutoparError(
                f"stage {self.index} has no program for arguments {signature_of(args)}",
                hint="this is a bug in autopar's pipeline: every microbatch shape is cut before it runs",
            )
        given = iter(args)
        full = [get_attr(self, what) if kind == "attr" else next(given) for kind, what in graph.sources]
        outs = graph.module(*full)
        made = dict(zip(graph.outputs, outs, strict=True))
        return tuple(made[name] for name in graph.crossing_out if name in made)


def check_same_tensors(first_attrs: list[set[str]], program: StageProgram) -> None:
    """Each stage's parallel module holds the tensors its first program read (`first_attrs`, filled
    by the first call): a later call whose stage reads another (BERT reads its `token_type_ids`
    buffer only when that argument is missing) is refused, on every rank alike (every rank exports
    every stage) and before any message, so no rank waits for another."""
    if not first_attrs:
        first_attrs.extend(set(st.attrs) for st in program.stages)
    for stage, before in zip(program.stages, first_attrs, strict=True):
        extra = sorted(set(stage.attrs) - before)
        if extra:
            raise PipelineSplitError(
                f"stage {stage.index} reads {extra} in this call but not in the first: its parallel "
                "module holds only what the first call's program read (the call's arguments differ: a "
                "model may read a buffer only when an argument is missing)",
                hint="pass the same set of arguments on every call as in example_inputs / example_kwargs",
            )


def check_same_readers(
    readers: dict[int, set[int]],
    program: StageProgram,
    trained: Callable[[int], Sequence[nn.Parameter]],
    names: dict[int, str],
) -> None:
    """On a 1-D mesh a later call may read tensors the first did not (`MetaHolders` sends those of
    a model on meta), but a stage newly training a parameter (`trained(stage)`: the parameters it
    reads that require grad; `readers`: the stages that read each in the first call) is refused on
    every rank alike, before any message: which stages sum a parameter's gradient, and which ranks
    hand it to the optimizer, was fixed by the first call, so that stage's part would be lost."""
    for stage in program.stages:
        for p in trained(stage.index):
            if stage.index not in readers.get(id(p), set()):
                raise PipelineSplitError(
                    f"stage {stage.index} trains {names.get(id(p), 'a parameter')} in this call but not in "
                    "the first: which stages sum its gradient was fixed by the first call (the call's "
                    "arguments differ: a model may read a weight only when an argument is missing)",
                    hint="pass the same set of arguments on every call as in example_inputs / example_kwargs",
                )


def stage_forward(
    model: nn.Module, stage: int, programs: list[StageProgram], flats: list[list[Any]], masks: DropoutMasks
) -> Any:
    """Stage `stage` run from the user's own modules' exported program (a 1-D pp mesh); its
    dropouts take microbatch m's rows of the step's `masks`."""

    def run(m: int, received: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        graph = programs[m].stages[stage]
        masks.current = m
        values: dict[str, Any] = dict(zip(graph.crossing_in, received, strict=True))
        args = []
        for kind, what in graph.sources:
            if kind == "input":
                args.append(flats[m][what])
            elif kind == "attr":
                constants = programs[m].constants
                args.append(constants[what] if what in constants else get_attr(model, what))
            elif kind == "mask":
                args.append(masks.rows(what))
            else:
                args.append(values[what])
        outs = graph.module(*args)
        values.update(zip(graph.outputs, outs, strict=True))
        return [values[name] for name in graph.crossing_out]

    return run


def parallel_stage_forward(
    stage: int,
    parallel: ParallelModule,
    programs: list[StageProgram],
    flats: list[list[Any]],
    masks: DropoutMasks,
    deferrals: dict[int, WeightDeferral] | None,
    accumulation: GradAccumulation | None = None,
) -> Any:
    """Stage `stage` run by its parallel module: its outputs come back as DTensors, made whole
    here (free for a replicated one; a split one is gathered inside the stage's slice, whose
    links are the fast ones) so that each rank sends its 1/t of them (`BoundaryScatter`).
    With `deferrals`, microbatch m's backward runs its input part only and leaves the weight
    part in `deferrals[m]`; with `accumulation`, every microbatch's backward leaves its
    unreduced gradients there (reduced once per step). Its dropouts take microbatch m's rows of
    the step's `masks`, as inputs."""

    def run(m: int, received: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        graph = programs[m].stages[stage]
        masks.current = m
        args = stage_arguments(graph, flats[m], received, masks.rows)
        # a later branch's program (`StageProgram.variant`) is called with its number: a program
        # of the parallel module's own; the first is called as it was compiled, without it
        variant = {"variant": programs[m].variant} if programs[m].variant else {}
        if deferrals is not None:
            deferrals[m] = WeightDeferral()
            with parallel.deferring_weights(deferrals[m]):
                outs = parallel(*args, **variant)
        elif accumulation is not None:
            with parallel.accumulating_gradients(accumulation):
                outs = parallel(*args, **variant)
        else:
            outs = parallel(*args, **variant)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        values: dict[str, Any] = dict(zip(graph.crossing_in, received, strict=True))
        whole = [o.full_tensor() if isinstance(o, DTensor) else o for o in outs]
        values.update(zip(made_here(graph), whole, strict=True))
        return [values[name] for name in graph.crossing_out]

    return run


def stage_arguments(
    graph: StageGraph,
    flat: Sequence[Any],
    received: Sequence[Any],
    mask: Callable[[int], torch.Tensor] | None = None,
) -> tuple[Any, ...]:
    """The arguments of the stage's module for one microbatch: its flat inputs, what it received
    and its dropout masks (`mask(k)`: op k's rows for this microbatch, `pipeline_random`)."""
    values = dict(zip(graph.crossing_in, received, strict=True))
    out = []
    for kind, what in graph.sources:
        if kind == "input":
            out.append(flat[what])
        elif kind == "mask":
            if mask is None:
                raise AutoparError(
                    f"stage {graph.index} reads dropout mask {what} but none was given",
                    hint="this is a bug in autopar's pipeline dropout",
                )
            out.append(mask(what))
        elif kind != "attr":
            out.append(values[what])
    return tuple(out)


def stage_specs(programs: list[StageProgram], stage: int, side: str) -> Callable[[int], tuple[TensorSpec, ...]]:
    """Microbatch m's input (`side` "in") or output specs of stage `stage`, as the runtime asks."""

    def specs(m: int) -> tuple[TensorSpec, ...]:
        graph = programs[m].stages[stage]
        return graph.input_specs if side == "in" else graph.output_specs

    return specs


def made_here(graph: StageGraph) -> list[str]:
    """The values of `crossing_out` that the stage computes (the others pass through it)."""
    return [name for name in graph.crossing_out if name in set(graph.outputs)]


def _place(root: nn.Module, qualname: str, value: Any, constant: bool) -> None:
    """Register `value` at `qualname` under `root`, making the plain container modules on its path."""
    *path, leaf = qualname.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if isinstance(value, nn.Parameter):
        module.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        module.register_buffer(leaf, value, persistent=not constant)
    else:
        setattr(module, leaf, value)
