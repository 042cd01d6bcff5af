"""One stored tensor's local block in the layout a program reads it in, differentiably, and a
missing gradient passed through.

A program may read a stored parameter in another layout than the one it is stored in (a second
input shape's program, a value guard's other branch). Its block comes from `DTensor.redistribute`
and the gradient goes back through the reverse relayout. But a program's backward may return no
gradient for it: a layer one branch skips, a pipeline stage whose reductions wait for the step's
end. Autograd then hands `DTensor.redistribute`'s backward plain zeros, on which it fails
(`'Tensor' object has no attribute '_local_tensor'`, torch 2.13). `Relayout` is one autograd
node for the whole relayout (the plain tensor's wrapping, the redistribute, `to_local`) whose
gradients are not materialized: with no gradient it returns none, so the stored tensor's
`.grad` stays None as in serial and no collective runs. Whether a gradient is missing depends on
the program's graph only, the same on every rank, so every rank skips the reverse collective
together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from autopar.core.user_warning import without_gloo_alltoall_notice


def relaid(value: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's block of stored `value` (a DTensor, or a plain tensor whole on every rank) in
    `placements`; its gradient comes back in the stored tensor's own layout (a plain tensor's
    whole), or not at all when the reader returns none."""
    if isinstance(value, DTensor) and tuple(value.placements) == tuple(placements):
        return value.to_local()  # (passes a missing gradient through itself)
    if not isinstance(value, DTensor) and all(isinstance(p, Replicate) for p in placements):
        return value  # a whole tensor read whole
    out: torch.Tensor = Relayout.apply(value, mesh, tuple(placements))
    return out


class Relayout(torch.autograd.Function):
    """forward(value, mesh, placements): `relaid`'s block; backward: the reverse relayout of the
    block's gradient, or None for none (module doc)."""

    @staticmethod
    def forward(
        ctx: Any, value: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
    ) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.plain = not isinstance(value, DTensor)
        stored = (
            value
            if isinstance(value, DTensor)
            else DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
        )
        ctx.mesh = mesh
        ctx.placements = placements
        ctx.stored = stored.placements
        ctx.shape = stored.shape
        ctx.stride = stored.stride()
        with without_gloo_alltoall_notice():
            block = stored.redistribute(mesh, placements).to_local()
        # a tensor of its own: autograd writes this node into it, never into the stored block
        return block.view_as(block)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:
        if grad is None:
            return None, None, None
        read = DTensor.from_local(
            grad, ctx.mesh, _for_grad(ctx.placements), run_check=False, shape=ctx.shape, stride=ctx.stride
        )
        with without_gloo_alltoall_notice():
            back = read.redistribute(ctx.mesh, _for_grad(ctx.stored))
        return (back.to_local() if ctx.plain else back), None, None


def _for_grad(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """The placements of a gradient of a value laid out in `placements`: a partial value's gradient
    is whole on every rank (as `DTensor.to_local`'s backward makes it)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
