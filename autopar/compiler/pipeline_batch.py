"""How a pipelined call is cut into microbatches and how its result goes back to the user: the
batch split on dim 0, the key of a stage program, the loss as the model returns it, and the
autograd function that hands the step's gradients to the parameters' `.grad`; for a call without
a loss (inference), the outputs put back together from the microbatches' on every rank."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.compiler.pipeline_shared import (
    BLOCKS,
    CHUNKS,
    WHOLE,
    agreed_ways,
    held_alone,
    sum_blocks,
    sum_in_row_chunks,
)
from autopar.compiler.pipeline_split import OutputLayout, PipelineLossError
from autopar.core.errors import UsageError
from autopar.runtime.pipeline_runtime import StepResult, sum_shared_grads
from autopar.runtime.pipeline_transport import PipelineTransport, ProcessGroupTransport, as_transport


def split_microbatches(args: Any, microbatches: int) -> list[Any]:
    """The batch (a tuple of arguments, or `(args, kwargs)`) cut on dim 0 into `microbatches`
    pieces of the same structure (`torch.tensor_split`: sizes differ by at most one when M does not
    divide the batch); other arguments are passed to every piece."""
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
        out.append(pytree.tree_unflatten(mb, spec))
    return out


def program_key(flat: Sequence[Any], training: bool | tuple[bool, ...], structure: Any = None) -> tuple[Any, ...]:
    """What a stage program is exported for: the modules' training flags, each input's shape and
    dtype (other values as they are)."""
    return (training, str(structure)) + tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (type(x).__name__, repr(x))
        for x in flat
    )


def as_output(loss: torch.Tensor, output_type: type | None) -> Any:
    """The loss as the model returns it: alone, or the only field set of its `ModelOutput` (the
    logits and caches stay on the last stage)."""
    if output_type is None:
        return loss
    return output_type({"loss": loss}) if output_type is dict else output_type(loss=loss)


class DepositGradients(torch.autograd.Function):
    """The returned loss's backward: hands the gradients the step computed to autograd, times the
    incoming gradient, so they accumulate into `.grad` as torch's own would.

    It hands them over once: the loss the user keeps (until the next call returns) holds this
    node, and a node that still held the step's gradients would keep a second copy of every
    gradient beside `.grad` through the next step's schedule, its memory peak. With an incoming
    gradient of 1 (`loss.backward()`) the tensors themselves go, so `.grad` takes them without a
    copy."""

    @staticmethod
    def forward(
        ctx: Any, loss: torch.Tensor, grads: list[torch.Tensor | None], done: Callable[[], None], *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.grads = grads
        ctx.done = done  # told inside the backward (the clipping watch records what `.grad` then holds)
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads: list[torch.Tensor | None] | None = ctx.grads
        if grads is None:
            raise UsageError(
                "this pipelined call's loss was already differentiated: its step's gradients went to "
                "the parameters then (a pipelined call is one training step)",
                hint="call the pipelined model again for another backward, or sum the losses before one backward",
            )
        ctx.grads = None
        ctx.done()
        if not grad.requires_grad and float(grad) == 1.0:
            return (None, None, None, *grads)
        scale = grad.item() if any(isinstance(g, DTensor) for g in grads) else grad
        return (None, None, None, *(None if g is None else g * scale for g in grads))


def broadcast_outputs(
    kept: dict[int, list[torch.Tensor]],
    layouts: Sequence[OutputLayout],
    src: int,
    group: dist.ProcessGroup | PipelineTransport | None,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """A call's outputs without a loss, whole on every rank: the last stage's outputs of every
    microbatch (`kept`, on pipeline rank `src`) concatenated on dim 0 and broadcast over the pp
    group (every rank knows their shapes from its own copy of the stage programs)."""
    transport = as_transport(group)
    whole = []
    for i, spec in enumerate(layouts[0].specs):
        if kept:  # as the spec's dtype, as every other rank's buffer is (autocast makes bfloat16)
            value = torch.cat([kept[m][i] for m in range(len(layouts))], dim=0).to(spec.dtype)
        else:
            rows = sum(layout.specs[i].shape[0] for layout in layouts)
            value = torch.empty((rows, *spec.shape[1:]), dtype=spec.dtype, device=device)
        if transport.size > 1:
            value = value.contiguous()
            transport.broadcast(value, src)
        whole.append(value)
    return whole


def rebuild_outputs(whole: list[torch.Tensor], layout: OutputLayout) -> Any:
    """The outputs in the model's structure (a `ModelOutput` with its logits, a tensor, a tuple)."""
    rebuilt = pytree.tree_unflatten(whole, layout.structure)
    if layout.output_type is None or layout.output_type is dict:
        return rebuilt
    return layout.output_type(**rebuilt)


def gather_outputs(
    kept: dict[int, list[torch.Tensor]],
    layouts: Sequence[OutputLayout],
    src: int,
    group: dist.ProcessGroup | PipelineTransport | None,
    device: torch.device | str,
) -> Any:
    """An inference call's outputs as the model returns them, on every rank (`broadcast_outputs`);
    under grad mode they carry a backward that refuses (`NoPipelineBackward`)."""
    whole = broadcast_outputs(kept, layouts, src, group, device)
    if torch.is_grad_enabled():  # a backward through them is refused with what to do
        anchor = torch.zeros((), requires_grad=True)
        whole = [NoPipelineBackward.apply(t, anchor) for t in whole]  # type: ignore[no-untyped-call]
    return rebuild_outputs(whole, layouts[0])


class NoPipelineBackward(torch.autograd.Function):
    """An inference call's outputs under grad mode (in eval(), no input requiring grad): they carry
    a backward that refuses, because the pipeline ran the forwards only and kept nothing for a
    backward."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        raise PipelineLossError(
            "backward through a pipelined model's outputs: the call returned outputs without a loss "
            "in eval(), so the pipeline ran the forwards only",
            hint="train in train() mode (a call without a loss then runs the backwards from the "
            "outputs' gradient), or compute the loss inside forward (a transformers model: pass its "
            "labels) and call backward on the loss the pipelined model returns; in eval(), a call "
            "whose input requires grad (a saliency map) keeps what its backward needs",
        )


def input_gradients(
    found: dict[tuple[int, int], torch.Tensor],
    wanted: Sequence[int],
    flats: Sequence[Sequence[Any]],
    given: Sequence[Any],
    group: dist.ProcessGroup | PipelineTransport | None,
) -> list[torch.Tensor]:
    """The gradients of the call's inputs that require grad (`given[i]` for i in `wanted`): each
    microbatch's (`found[(m, j)]`, j the position in `wanted`; zeros where this rank's stages do
    not read it) put back on dim 0 (summed, for a 0-d input every microbatch shares), then summed
    over the pp group, whose stages may each read the input. One all-reduce per input, on every rank."""
    transport = as_transport(group)
    out = []
    for j, i in enumerate(wanted):
        pieces = [found.get((m, j), torch.zeros_like(f[i])) for m, f in enumerate(flats)]
        whole = torch.cat(pieces, dim=0) if given[i].dim() > 0 else torch.stack(pieces).sum(0)
        whole = whole.detach().contiguous()
        transport.all_reduce(whole)
        out.append(whole.to(given[i].dtype))
    return out


def clip_pipelined_grad_norm(
    params: Sequence[torch.Tensor],
    counted: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup | PipelineTransport | None,
    device: torch.device | str,
) -> torch.Tensor:
    """`PipelinedModule.clip_grad_norm_`: the norm of `counted`'s gradients (each stage's on its
    sub-mesh, a tied weight once) reduced over the pp group; every gradient of `params` scaled
    by the same factor. Returns the whole model's norm on every rank."""
    p = float(norm_type)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for param in counted:
        grad = param.grad
        if grad is None:
            continue
        norm = torch.linalg.vector_norm(grad, p)
        value = (norm.full_tensor() if isinstance(norm, DTensor) else norm).to(torch.float64)
        total = torch.maximum(total, value) if math.isinf(p) else total + value**p
    as_transport(group).all_reduce(total, "max" if math.isinf(p) else "sum")
    norm_all = total if math.isinf(p) else total ** (1.0 / p)
    scale = min(1.0, max_norm / (float(norm_all) + 1e-6))
    if scale < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(scale)
    return norm_all.to(torch.float32)


def sum_shared_copies(
    shared: Sequence[tuple[str, nn.Parameter, list[nn.Parameter]]],
    grads: dict[int, torch.Tensor],
    group: dist.ProcessGroup | PipelineTransport | None,
    device: str,
    mesh_axes: int = 0,
    chunks: int = 1,
) -> None:
    """A weight several stages read (a tied embedding and head; `shared`: its name, the user's
    tensor, this rank's copies that stages train) gets the sum of their gradients on every copy
    (`grads`, by the copy's id). With tensor axes (`mesh_axes` of them beside pp, `chunks` ranks on
    a stage's sub-mesh), in the copies' blocks or in chunks of rows (`pipeline_shared`: the whole
    gradient is never made); otherwise (a 1-D pipeline, other placements) as whole tensors summed
    over the pp `group`, each copy then given its block."""
    ways: list[tuple[str, tuple[int, ...]]] = [(WHOLE, ())] * len(shared)
    transport = as_transport(group)
    if mesh_axes and transport.size > 1:
        # stages with tensor axes run on process groups only (lockstep runs a pp axis alone)
        if not isinstance(transport, ProcessGroupTransport) or transport.group is None:
            raise UsageError(
                "a pipeline whose stages have tensor axes sums tied weights over the pp process group",
                hint="run pipelines with tensor axes on a DeviceMesh (torch.distributed), not in lockstep",
            )
        pp_group = transport.group
        holders = [([grads.get(id(c)) for c in copies], copies) for _, _, copies in shared]
        ways = agreed_ways(holders, [user.shape for _, user, _ in shared], mesh_axes, pp_group, device)
        for (_, user, _), (held, copies), (way, block) in zip(shared, holders, ways, strict=True):
            mine = {id(c) for c in copies}
            others = [g for key, g in grads.items() if key not in mine]
            if way == BLOCKS:
                present = [g for g in held if g is not None]
                summed = sum_blocks(present, copies, block, user.dtype, others, pp_group, device)
            elif way == CHUNKS:
                summed = sum_in_row_chunks(grads, copies, user.shape, user.dtype, chunks, others, pp_group, device)
            else:
                continue
            grads.update((id(c), g) for c, g in zip(copies, summed, strict=True))
    whole = []
    owned = []  # whether the whole gradient may be summed into in place (made here, or held by it alone)
    rest = [entry for entry, (way, _) in zip(shared, ways, strict=True) if way == WHOLE]
    for _, user, copies in rest:
        total, made, plain = None, False, True
        for copy in copies:
            g = grads.get(id(copy))
            if g is not None:
                plain = plain and not isinstance(g, DTensor)
                gathered = isinstance(g, DTensor) and not all(p.is_replicate() for p in g.placements)
                g = g.full_tensor() if isinstance(g, DTensor) else g
                made = gathered if total is None else True
                total = g if total is None else total + g
        if total is not None and not made and plain:  # a 1-D pipeline's gradient: copied only if shared
            mine = {id(c) for c in copies}
            made = held_alone(total, [g for key, g in grads.items() if key not in mine])
        whole.append((user.shape, user.dtype, total))
        owned.append(made)
    summed = sum_shared_grads(whole, group, device, owned)
    for (_, _, copies), g in zip(rest, summed, strict=True):
        for copy in copies:
            if isinstance(copy, DTensor):
                grads[id(copy)] = distribute_tensor(g, copy.device_mesh, copy.placements, src_data_rank=None)
            else:
                grads[id(copy)] = g


def deposit_targets(local: Sequence[torch.Tensor], given: Sequence[Any], wanted: Sequence[int]) -> list[torch.Tensor]:
    """What a step's gradients go to on this rank: its trained tensors, then the call's inputs that
    require grad (`given[i]` for i in `wanted`); a rank with neither gets a 0-d stand-in parameter, so
    that what the call returns still takes a backward (whose messages the other ranks wait for)."""
    targets = list(local) + [given[i] for i in wanted]
    return targets if targets else [nn.Parameter(torch.zeros(()))]


def step_gradients(
    result: StepResult,
    stage_params: Mapping[int, Sequence[torch.Tensor]],
    shared: Sequence[tuple[str, nn.Parameter, list[nn.Parameter]]],
    local: Sequence[torch.Tensor],
    wanted: Sequence[int],
    flats: Sequence[Sequence[Any]],
    given: Sequence[Any],
    group: dist.ProcessGroup | PipelineTransport | None,
    device: str,
    mesh_axes: int = 0,
    chunks: int = 1,
) -> list[torch.Tensor | None]:
    """A step's gradients in `deposit_targets`' order: each of this rank's trained tensors (`local`)
    summed over the stages that read it (`stage_params[s]` are stage s's, `result.grads[s]` their
    gradients) and, for a weight several stages read, over the pp group (`sum_shared_copies`); then
    the inputs' gradients (`input_gradients`). None where a tensor got none. `mesh_axes`: the
    tensor axes beside pp, `chunks`: the ranks of a stage's sub-mesh."""
    grads: dict[int, torch.Tensor] = {}
    for s, stage_grads in result.grads.items():
        for p, g in zip(stage_params[s], stage_grads, strict=True):
            if g is not None:
                grads[id(p)] = g if id(p) not in grads else grads[id(p)] + g
    sum_shared_copies(shared, grads, group, device, mesh_axes, chunks)
    ordered: list[torch.Tensor | None] = [grads.get(id(p)) for p in local]
    if wanted:  # the inputs' gradients: every microbatch's rows, summed over the stages
        ordered += input_gradients(result.input_grads, wanted, flats, given, group)
    return ordered if ordered else [None]
