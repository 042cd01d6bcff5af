"""Custom autograd.Functions with their own backward, traced as one `autopar::autograd_function`
op each (`autopar.passes.autograd_functions`): trained on (2,) and (2, 2) in lockstep equal to
serial, with the splits each Function's ops allow and no other."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from pass_fixtures import train_in_lockstep

from autopar.core.errors import AutoparError
from autopar.core.layout import Shard
from autopar.rules.autograd_function import AUTOGRAD_FUNCTION, FunctionEntry

MAX_SQRT_GRADIENT = 10.0


class ClippedSqrt(torch.autograd.Function):
    """sqrt, whose gradient is clipped at MAX_SQRT_GRADIENT (RecurrentGemma's SqrtBoundDerivative):
    at 0 the derivative of the forward is infinite, the Function's own backward is not."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clip(4.0 * x, min=1 / MAX_SQRT_GRADIENT**2))


class DampedCumsum(torch.autograd.Function):
    """A running sum along `dim` whose backward is the reversed running sum of the gradient times
    `damping` (not the forward's derivative, so training with that derivative would differ)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, options: dict[str, float]) -> torch.Tensor:
        ctx.dim, ctx.damping = dim, options["damping"]
        return torch.cumsum(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        reversed_sum = torch.flip(torch.cumsum(torch.flip(grad, (ctx.dim,)), ctx.dim), (ctx.dim,))
        return reversed_sum * ctx.damping, None, None


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = ClippedSqrt.apply(torch.relu(self.up(x)))  # relu: exact zeros, where the clip decides
        h = DampedCumsum.apply(h, 1, {"damping": 0.5})
        return nn.functional.mse_loss(self.down(h), y)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, 16, generator=gen), torch.randn(8, 4, 8, generator=gen)) for _ in range(2)]


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _kernels(graphs: tuple[fx.GraphModule, ...]) -> list[tuple[FunctionEntry, str]]:
    """The Function kernels a rank's program calls: (the trace's entry, "forward" or "backward")."""
    found = []
    for gm in graphs:
        for node in gm.graph.nodes:
            owner = getattr(node.target, "__self__", None)
            if node.op == "call_function" and isinstance(owner, FunctionEntry):
                found.append((owner, node.target.__name__.removesuffix("_kernel")))
    return found


def test_functions_train_equal_to_serial_with_their_own_backward() -> None:
    traced: list[list[tuple[FunctionEntry, str]]] = []
    for shape in [(2,), (2, 2)]:
        torch.manual_seed(0)
        model = Recurrent()
        result = train_in_lockstep(model, shape, _batches(), _sgd)
        assert result["loss_err"] < 1e-5 and result["grad_err"] < 1e-4 and result["param_err"] < 1e-5, (shape, result)
        program = next(iter(result["compiled"].values())).program
        kernels = _kernels((program.forward, program.backward))
        assert sorted(kind for _, kind in kernels) == ["backward", "backward", "forward", "forward"], kernels
        traced.append(kernels)
    # each trace owns its entries: the two compiles share none (nothing kept in the process)
    assert not {id(e) for e, _ in traced[0]} & {id(e) for e, _ in traced[1]}
    # the splits offered are the ones each Function's ops allow: any dim of the elementwise sqrt,
    # never the summed dim of the running sum
    entries = {e.function: e for e, _ in traced[1]}
    sqrt_splits = {s.inputs[0] for s in entries[ClippedSqrt].forward_strategies}
    sum_splits = {s.inputs[0] for s in entries[DampedCumsum].forward_strategies}
    assert sqrt_splits == {Shard(0), Shard(1), Shard(2)}, sqrt_splits
    assert sum_splits == {Shard(0), Shard(2)}, sum_splits
    assert {s.inputs[0] for s in entries[DampedCumsum].backward_strategies} == {Shard(0), Shard(2)}


def test_function_op_outside_its_trace_is_refused() -> None:
    """The op's kernel finds its Function in the trace that made it: called after that trace, or
    without one, it names the op instead of running another trace's Function."""
    with pytest.raises(AutoparError, match="outside the trace that made it"):
        AUTOGRAD_FUNCTION([torch.ones(2)], "tests.ClippedSqrt:000000000000")
    assert "apply" in torch.autograd.Function.__dict__ and ClippedSqrt.apply.__func__ is (  # type: ignore[attr-defined]
        torch.autograd.function.Function.__dict__["apply"].__func__
    )
