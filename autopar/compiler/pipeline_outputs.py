"""A loss computed outside a pipelined model (docs/pipeline.md#a-loss-outside-the-model): the
training loop of timm, torchvision and diffusers, `loss = F.cross_entropy(pmodel(x), y);
loss.backward()`.

The loss is not known while the forwards run, so such a call runs every microbatch's forward
through the stages keeping what the backwards need (`start_step`), returns the outputs whole on
every rank, and hangs the step's backwards on them (`OutputsBackward`): the user's
`loss.backward()` hands in the outputs' gradient, which is cut into the forward's microbatches and
runs every stage's backward (GPipe's order: all forwards, then all backwards), the gradients going
into `.grad` as autograd's own would."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autopar.compiler.pipeline_split import OutputLayout
from autopar.core.pipeline_schedule import Schedule, forwards_then_backwards
from autopar.runtime.pipeline_runtime import PendingStep, StepResult


def outside_loss_schedule(schedule: Schedule, named_by_user: bool, warned: list[bool]) -> Schedule:
    """The order a call whose loss is outside the model runs: all forwards, then all backwards, on
    the module's own stage placement. 1F1B, interleaved 1F1B and zero-bubble start backwards while
    forwards remain, which needs the loss before the last microbatch's outputs exist. A schedule the
    user named (not "auto"'s choice) is warned about once (`warned[0]`)."""
    if schedule.name == "gpipe":
        return schedule
    if named_by_user and not warned[0]:
        warned[0] = True
        warnings.warn(
            f"autopar pipeline: a training call without a loss inside the model runs the {schedule.name!r} "
            "schedule in GPipe's order (every forward, then every backward): its backwards can start "
            "only once the loss, computed from all microbatches' outputs, is known. Each rank holds "
            "all microbatches' activations of its stages (compute the loss inside forward, or pass "
            "the labels, to run the named schedule)",
            stacklevel=4,
        )
    return forwards_then_backwards(schedule.placement, schedule.microbatches)


class TrainedOutputs:
    """The backward half of a call whose loss is outside the model: `backward(grads)` cuts the
    outputs' gradients (one per output, whole batch) into the forward's microbatches, runs the
    step's backwards (`PendingStep.finish`) and returns the gradients of the tensors the call's
    outputs hang on (`gradients`: this rank's parameters, then inputs that require grad)."""

    def __init__(
        self,
        pending: PendingStep,
        layouts: Sequence[OutputLayout],
        gradients: Callable[[StepResult], list[torch.Tensor | None]],
    ) -> None:
        self.pending = pending
        self.layouts = list(layouts)
        self.gradients = gradients

    def backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        rows = [[layout.specs[i].shape[0] for layout in self.layouts] for i in range(len(grads))]
        per_output = [None if g is None else torch.split(g, r, dim=0) for g, r in zip(grads, rows, strict=True)]
        by_microbatch = {
            m: [None if pieces is None else pieces[m].contiguous() for pieces in per_output]
            for m in range(len(self.layouts))
        }
        return self.gradients(self.pending.finish(by_microbatch))


class OutputsBackward(torch.autograd.Function):
    """The outputs of a training call without a loss: copies of the broadcast tensors whose
    backward runs the pipeline's backwards (`TrainedOutputs`). Its other inputs are what the step's
    gradients go to (this rank's parameters, the call's inputs that require grad), so autograd
    accumulates them into `.grad`."""

    @staticmethod
    def forward(ctx: Any, trained: TrainedOutputs, count: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.trained = trained
        ctx.count = count
        ctx.set_materialize_grads(False)  # an output the loss does not read gets no gradient
        outs = tuple(t.clone() for t in tensors[:count])
        fixed = [o for o in outs if not (o.dtype.is_floating_point or o.dtype.is_complex)]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        found = ctx.trained.backward(grads)
        return (None, None, *(None for _ in range(ctx.count)), *found)


def attach_backward(
    whole: list[torch.Tensor], trained: TrainedOutputs, targets: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """`whole` (the outputs, on every rank) as outputs of `OutputsBackward`, whose backward
    deposits into `targets`."""
    outs = OutputsBackward.apply(trained, len(whole), *whole, *targets)  # type: ignore[no-untyped-call]
    return list(outs)

