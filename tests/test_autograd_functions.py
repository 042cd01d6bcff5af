"""Custom autograd.Functions: never trained with the derivative of their forward in place of their
own backward. A straight-through estimator and a gradient-reversal layer train equal to serial (each
is traced as one op with its own backward); a Function that cannot be one (an object argument, a
random draw in its forward) is refused with its name, module and line; Functions that do compute
their forward's derivative are traced as their ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from pass_fixtures import assert_call_matches_serial

from autopar.core.errors import TraceError
from autopar.passes.autograd_functions import DERIVATIVE_PRESERVING, qualified_name
from autopar.passes.trace import trace
from examples import hf_zoo


class RoundStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class GradientReversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


@dataclass(frozen=True)
class Rounding:
    scale: float


class ConfiguredRound(torch.autograd.Function):
    """A straight-through estimator configured by an object: an argument the op cannot carry."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rounding: Rounding) -> torch.Tensor:
        return torch.round(x * rounding.scale) / rounding.scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class DitheredRound(torch.autograd.Function):
    """Rounding after uniform noise: its backward would be run after a forward drawn again."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x + torch.rand_like(x) - 0.5)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Quantizer(nn.Module):
    def __init__(self, function: type[torch.autograd.Function] | None, extra: tuple[Any, ...] = ()) -> None:
        super().__init__()
        self.function = function
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.function is None:  # the same estimator without a Function: traceable as it is
            return x + (torch.round(x) - x).detach()
        return self.function.apply(x, *self.extra)


class QuantizedMLP(nn.Module):
    def __init__(self, function: type[torch.autograd.Function] | None, extra: tuple[Any, ...] = ()) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.quant = Quantizer(function, extra)
        self.down = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.down(self.quant(self.up(x) * 4)), y)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=gen), torch.randint(4, (8,), generator=gen)


@pytest.mark.parametrize("function", [RoundStraightThrough, GradientReversal])
def test_a_function_whose_backward_is_not_its_derivative_trains_with_it(function: type) -> None:
    """Traced as its forward's ops, the estimator would give `up` no gradient (round's derivative
    is zero) and the reversal layer the gradient's sign flipped back."""
    torch.manual_seed(0)
    assert_call_matches_serial(QuantizedMLP(function), (2, 2), _batch())


def test_a_function_taking_an_object_is_refused_by_name() -> None:
    torch.manual_seed(0)
    with pytest.raises(TraceError) as caught:
        trace(QuantizedMLP(ConfiguredRound, (Rounding(4.0),)), _batch())
    error = caught.value
    assert error.op == f"autograd.Function {qualified_name(ConfiguredRound)}"
    assert "drops its backward" in error.message and "takes a Rounding argument" in error.message
    assert error.where is not None and error.where.startswith("quant @ ")
    assert f"{__file__}:" in error.where  # the line inside the Function's forward
    assert "plain data" in (error.hint or "")


def test_a_function_drawing_random_numbers_is_refused_by_name() -> None:
    torch.manual_seed(0)
    with pytest.raises(TraceError, match="DitheredRound draws random numbers") as caught:
        trace(QuantizedMLP(DitheredRound), _batch())
    assert caught.value.where is not None and caught.value.where.startswith("quant @ ")


def test_the_straight_through_estimator_written_with_detach_matches_serial() -> None:
    torch.manual_seed(0)
    assert_call_matches_serial(QuantizedMLP(None), (2, 2), _batch())


def test_a_forward_only_trace_keeps_the_function_forward() -> None:
    """Without a backward to lose (evaluation under no_grad), the Function's forward is traced."""
    torch.manual_seed(0)
    gm = trace(QuantizedMLP(RoundStraightThrough), _batch(), forward_only=True)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.round.default in targets


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)
        return nn.functional.cross_entropy(out, y)


def test_checkpoint_without_reentrance_matches_serial() -> None:
    torch.manual_seed(0)
    assert_call_matches_serial(Checkpointed(reentrant=False), (2, 2), _batch())


def test_reentrant_checkpoint_is_refused_rather_than_trained_without_its_gradients() -> None:
    """Its forward runs under no_grad, so the traced graph would give the block no gradient."""
    torch.manual_seed(0)
    x, y = _batch()
    with pytest.raises(TraceError, match="CheckpointFunction") as caught:
        trace(Checkpointed(reentrant=True), (x.requires_grad_(), y))
    assert "use_reentrant=False" in (caught.value.hint or "")


def test_bloom_gelu_function_backward_is_the_derivative_of_its_forward() -> None:
    """Why BLOOM's GeLUFunction is in DERIVATIVE_PRESERVING: its backward equals autograd's
    derivative of its forward to float64 rounding."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    assert qualified_name(bloom.GeLUFunction) in DERIVATIVE_PRESERVING
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(1001, dtype=torch.float64)
    (custom,) = torch.autograd.grad(bloom.GeLUFunction.apply(x), x, grad)
    (derivative,) = torch.autograd.grad(bloom.bloom_gelu_forward(x), x, grad)
    torch.testing.assert_close(custom, derivative, rtol=1e-7, atol=1e-7)


def test_bloom_in_training_matches_serial() -> None:
    model, kwargs, _ = hf_zoo.build_working(hf_zoo.find("BloomForCausalLM"))
    assert model.training
    torch.manual_seed(0)
    assert_call_matches_serial(model, (2, 2, 2), (), kwargs)

