"""`relaid`, the one relayout between a stored tensor and the layout a program reads it in, on two
gloo ranks: its gradient is the reverse relayout of the program's, and a program that returns no
gradient for it (a branch's skipped layer, a pipeline stage whose reductions wait for the step)
leaves none, as serial does, instead of reaching `DTensor.redistribute`'s backward with the
zeros autograd makes of a missing gradient (which fails: `'Tensor' object has no attribute
'_local_tensor'`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.runtime.relayout import relaid
from tests.multirank import run_ranks


class _NoGradientFor(torch.autograd.Function):
    """`x * y` whose backward returns y's gradient only: a program whose backward hands back
    nothing for one of the parameters it was given."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (x,) = ctx.saved_tensors
        return None, grad * x


def _job(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    whole = torch.arange(8.0).reshape(4, 2)
    weight = torch.linspace(-1, 1, 8).reshape(4, 2)  # the loss's gradient, whole
    found: dict[str, Any] = {}

    # a stored split, read whole: the gradient comes back split (each rank its rows)
    stored = torch.nn.Parameter(DTensor.from_local(whole.chunk(2)[rank].clone(), mesh, [Shard(0)]))
    local = relaid(stored, mesh, [Replicate()])
    found["read_whole"] = torch.equal(local, whole)
    (local * weight).sum().backward()
    found["split_grad"] = torch.equal(stored.grad.full_tensor(), weight)
    found["split_grad_placements"] = stored.grad.placements

    # a plain stored tensor (whole on every rank), read split: the gradient is gathered whole
    plain = torch.nn.Parameter(whole.clone())
    local = relaid(plain, mesh, [Shard(0)])
    found["read_rows"] = torch.equal(local, whole.chunk(2)[rank])
    (local * weight.chunk(2)[rank]).sum().backward()
    found["plain_grad"] = torch.equal(plain.grad, weight)

    # no gradient comes back for the relaid block: none reaches the stored tensor
    skipped = torch.nn.Parameter(DTensor.from_local(whole.chunk(2)[rank].clone(), mesh, [Shard(0)]))
    other = torch.nn.Parameter(whole.clone())
    _NoGradientFor.apply(relaid(skipped, mesh, [Replicate()]), other).sum().backward()
    found["skipped_grad"] = skipped.grad
    found["other_grad"] = torch.equal(other.grad, whole)
    # nor when it is asked of by name (a pipeline stage's backward that leaves its reductions)
    asked = torch.autograd.grad(
        _NoGradientFor.apply(relaid(skipped, mesh, [Replicate()]), other).sum(), [skipped], allow_unused=True
    )
    found["asked"] = asked
    return found


@pytest.mark.multirank
def test_relaid_returns_the_reverse_relayout_and_passes_a_missing_gradient_through() -> None:
    for rank, found in enumerate(run_ranks(2, _job)):
        assert found["read_whole"] and found["read_rows"], (rank, found)
        assert found["split_grad"] and found["split_grad_placements"] == (Shard(0),), (rank, found)
        assert found["plain_grad"], (rank, found)
        assert found["skipped_grad"] is None and found["other_grad"], (rank, found)
        assert found["asked"] == (None,), (rank, found)
