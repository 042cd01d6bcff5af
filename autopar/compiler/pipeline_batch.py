"""How a pipelined call is cut into microbatches and how its result goes back to the user: the
batch split on dim 0, the key of a stage program, the loss as the model returns it, and the
autograd function that hands the step's gradients to the parameters' `.grad`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from autopar.compiler.pipeline_split import StageProgram, all_arguments
from autopar.core.errors import UsageError


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


def program_key(flat: Sequence[Any], training: bool, structure: Any = None) -> tuple[Any, ...]:
    """What a stage program is exported for: each input's shape and dtype (other values as they are)."""
    return (training, str(structure)) + tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (type(x).__name__, repr(x))
        for x in flat
    )


def draws_random(program: StageProgram) -> bool:
    """Whether a stage program draws random numbers (dropout with p > 0, bernoulli, rand)."""
    for stage in program.stages:
        for n in stage.module.graph.nodes:
            if n.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
                continue
            arguments = all_arguments(n)
            rate = arguments.get("p", arguments.get("dropout_p"))  # dropout, attention's dropout
            if isinstance(rate, (int, float)) and rate == 0:
                continue
            return True
    return False


def as_output(loss: torch.Tensor, output_type: type | None) -> Any:
    """The loss as the model returns it: alone, or the only field set of its `ModelOutput` (the
    logits and caches stay on the last stage)."""
    if output_type is None:
        return loss
    return output_type({"loss": loss}) if output_type is dict else output_type(loss=loss)


class DepositGradients(torch.autograd.Function):
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
        scale = grad.item() if any(isinstance(g, DTensor) for g in ctx.grads) else grad
        return (None, None, *(None if g is None else g * scale for g in ctx.grads))
