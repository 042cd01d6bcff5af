"""Running an emitted program under autograd: the forward graph inside an autograd.Function whose
backward runs the emitted backward graph (whole, or its input-gradient part first and the
weight-gradient part later for zero-bubble pipelines), and programs compiled by Inductor."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from autopar.core.collectives import functional_sums
from autopar.core.precision import autocast_off
from autopar.runtime.defer_reduction import GradAccumulation
from autopar.runtime.groups import failures_named
from autopar.runtime.param_feed import ParamFeed, SourceMeta
from autopar.runtime.program import EmittedProgram
from autopar.runtime.split_backward import SplitBackward, split_backward


@dataclass
class _PendingWeight:
    """A backward whose weight-gradient part has not run yet: what running it needs."""

    split: SplitBackward
    saved: tuple[torch.Tensor, ...]
    tangents: list[torch.Tensor]
    carried: list[torch.Tensor]
    local_params: tuple[torch.Tensor, ...]  # the program's parameter inputs (views of the DTensors)
    timeout: timedelta | None


@dataclass
class WeightDeferral:
    """Given to one call of a `ParallelModule` (`deferring_weights`): that call's backward runs only
    the input-gradient part of the program's backward (zero-bubble's I) and leaves the
    weight-gradient part here, run later by `ParallelModule.weight_gradients` (W)."""

    pending: list[_PendingWeight] = field(default_factory=list)
    splits: dict[int, SplitBackward] = field(default_factory=dict)  # the module's, by program
    local_params: tuple[torch.Tensor, ...] = ()

    def split(self, program: EmittedProgram) -> SplitBackward:
        found = self.splits.get(id(program.backward))
        if found is None:
            found = self.splits[id(program.backward)] = split_backward(program)
        return found


class RunProgram(torch.autograd.Function):
    """One call of an emitted program: forward(program, feed, num_outputs, timeout, deferral,
    *sources, *local inputs, *whole inputs wanting gradients), where `feed` (a `ParamFeed`) says
    which program parameter reads which source (a stored DTensor as it is, or a local tensor); its
    backward runs the emitted backward (with a `WeightDeferral`: its input part only; with a
    `GradAccumulation`: all but the gradient reductions, whose inputs it accumulates) and returns
    each source's gradient (a DTensor's as a DTensor)."""

    @staticmethod
    def forward(
        ctx: Any,
        program: EmittedProgram,
        feed: ParamFeed,
        num_outputs: int,
        timeout: timedelta | None,
        deferral: WeightDeferral | GradAccumulation | None,
        *flat: torch.Tensor,
    ) -> Any:
        sources = flat[: feed.num_sources]
        local_inputs = flat[feed.num_sources : len(flat) - len(program.input_grads)]  # then the whole
        params = feed.program_params(sources)  # inputs wanting gradients
        with failures_named(timeout), autocast_off():  # the graph holds the casts autocast made
            results = program.forward(*params, *local_inputs)
        ctx.timeout = timeout
        ctx.deferral = deferral
        ctx.feed = feed
        ctx.sources = [SourceMeta.of(s) for s in sources]
        # the calls that keep per-parameter views pass them one to one (`ParamFeed.one_to_one`)
        ctx.local_params = sources if isinstance(deferral, GradAccumulation) else ()
        if isinstance(deferral, WeightDeferral):
            deferral.local_params = sources
        outputs, saved = results[:num_outputs], results[num_outputs:]
        ctx.program = program
        ctx.save_for_backward(*saved)
        ctx.num_sources = feed.num_sources
        ctx.num_inputs = len(program.input_layouts)
        has_tangent = set(program.tangent_outputs)  # the others get no gradient: buffers' new values,
        ctx.mark_non_differentiable(  # integer outputs, every output of a forward-only program
            *[o for i, o in enumerate(outputs) if i not in has_tangent or not o.is_floating_point()]
        )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        program: EmittedProgram = ctx.program
        tangents = []
        for index in program.tangent_outputs:
            grad = grads[index]
            if grad is None:
                layout = program.output_layouts[index]
                grad = torch.zeros(
                    layout.local_shape(_mesh_shape_of(program), program.coords),
                    dtype=layout.dtype,
                    device=program.device_type,
                )
            tangents.append(grad.contiguous())
        none = (None,) * (5 + ctx.num_sources + ctx.num_inputs)  # program .. deferral, sources, local inputs
        deferral: WeightDeferral | GradAccumulation | None = ctx.deferral
        if isinstance(deferral, GradAccumulation):  # pipelines: reduce the gradients once per step
            split_r = deferral.split(program)
            saved_r = tuple(ctx.saved_tensors)
            with failures_named(ctx.timeout), autocast_off():
                input_grads, frontier = split_r.run_local(saved_r, tangents, deferral.sums_of(program))
            deferral.add(program, frontier, ctx.local_params, ctx.timeout, (*saved_r, *tangents, *input_grads))
            return (*none, *input_grads)
        if deferral is not None:  # zero-bubble: the input gradients now, the weights' later
            split = deferral.split(program)
            saved = tuple(ctx.saved_tensors)
            with failures_named(ctx.timeout), autocast_off():
                input_grads, carried = split.run_input(saved, tangents)
            deferral.pending.append(
                _PendingWeight(split, saved, tangents, carried, deferral.local_params, ctx.timeout)
            )
            return (*none, *input_grads)
        with failures_named(ctx.timeout), autocast_off():
            grads_out = program.backward(*ctx.saved_tensors, *tangents)
        num_params = len(program.param_names)
        param_grads, input_grads = grads_out[:num_params], grads_out[num_params:]
        feed: ParamFeed = ctx.feed
        source_grads = feed.source_grads(param_grads, ctx.sources)
        # the local blocks of the inputs get none: the whole inputs after them get theirs
        return (None, None, None, None, None, *source_grads, *[None] * ctx.num_inputs, *input_grads)


def compiled_by_inductor(program: EmittedProgram) -> EmittedProgram:
    """`program` whose forward and backward graphs run through `torch.compile` with Inductor:
    whole graphs (`fullgraph`: a graph break would be a bug here), static shapes (a program is
    for one input signature), each compiled on its first call. The graphs are plain ATen plus
    functional collectives, so nothing needs dynamo's guards beyond the inputs' metadata; torch's
    FX graph cache lets ranks (and later runs) with an identical local graph reuse one compile."""
    graphs = []
    for gm in (program.forward, program.backward):
        functional_sums(gm)  # (the same sums: Inductor makes them in place again)
        if isinstance(gm, _LazyGraphModule):
            gm.real_recompile()  # dynamo must see the real code, not the lazy stub (a graph break)
        graphs.append(torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False))
    return replace(program, forward=graphs[0], backward=graphs[1])  # type: ignore[arg-type]


def _mesh_shape_of(program: EmittedProgram) -> tuple[int, ...]:
    return tuple(program.forward.meta.get("autopar_mesh_shape", ()))
