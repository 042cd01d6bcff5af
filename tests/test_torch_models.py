"""Models made of torch.nn's own layers, as their docs write them (`examples/torch_models.py`): an
LSTM and a GRU language model, `nn.TransformerEncoderLayer` with its default dropout and a causal
mask made in forward, `nn.MultiheadAttention`, and a top-k mixture of experts. Every rank's program
in lockstep against serial on 2x2x2 for three training steps (the gloo runtime around the programs
is checked on real ranks by `test_parallelize_multirank.py`)."""

from __future__ import annotations

import pytest
import torch
from pass_fixtures import assert_call_matches_serial, assert_compiled_matches_serial, compile_every_rank
from torch import nn

import autopar
from autopar.compiler.driver import compile_for_rank
from autopar.core.mesh import Mesh
from autopar.passes.trace import DATA_DEPENDENT_HINT
from autopar.passes.value_guards import WEIGHT_GUARD_HINT
from examples import torch_models


@pytest.mark.parametrize("name", list(torch_models.MODELS))
def test_trains_like_serial_on_2x2x2(name: str) -> None:
    """Three steps of SGD with momentum, each on a new batch from the weights the last update
    left: loss, outputs and every gradient of every rank's program against serial."""
    torch.manual_seed(0)
    model = torch_models.MODELS[name]()
    compiled = compile_every_rank(model, (2, 2, 2), torch_models.batch())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        # the serial call inside leaves its gradients on the model: the serial update of this step
        assert_compiled_matches_serial(compiled, model, (2, 2, 2), torch_models.batch(step))
        opt.step()
        opt.zero_grad()


def test_data_dependent_expert_dispatch_is_refused_with_what_to_do() -> None:
    with pytest.raises(autopar.TraceError) as err:
        compile_for_rank(torch_models.SparseMoE(), Mesh.from_shape((2,)), torch_models.batch(), coords=(0,))
    assert err.value.hint == DATA_DEPENDENT_HINT
    assert err.value.where is not None and "torch_models.py" in err.value.where, err.value.where


class _ChecksItsActivations(torch.nn.Module):
    """The check IBert's quantizer makes on every call: an assert on a value the weights compute
    (a check on the inputs alone is a guard: tests/test_value_guards.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        assert h.isnan().sum() == 0, "NaN in the activations"
        return torch.nn.functional.cross_entropy(h, y)


def test_control_flow_on_a_value_the_weights_compute_is_refused_with_what_to_do() -> None:
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    with pytest.raises(autopar.TraceError) as err:
        compile_for_rank(_ChecksItsActivations(), Mesh.from_shape((2,)), (x, y), coords=(0,))
    assert err.value.hint == WEIGHT_GUARD_HINT
    assert err.value.where is not None and "test_torch_models.py" in err.value.where, err.value.where


class _WithUnusedLayer(torch.nn.Module):
    """A layer the loss never reaches, as a transformers pooler skipped by a masked-LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(16, 16)
        self.pooler = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(torch.relu(self.used(x))), y)


def test_a_parameter_the_loss_does_not_use_gets_no_gradient_as_serially() -> None:
    torch.manual_seed(0)
    model = _WithUnusedLayer()
    batch = (torch.randn(8, 16), torch.randint(4, (8,)))
    compiled = assert_call_matches_serial(model, (2, 2), batch)  # every other gradient equal serial
    assert model.pooler.weight.grad is None and model.pooler.bias.grad is None
    sig = next(iter(compiled.values())).graph.meta["autopar_signature"]
    assert "pooler.weight" not in sig.grad_of and "used.weight" in sig.grad_of


class StochasticDepth(nn.Module):
    """Residual blocks dropped per sample, as timm and BEiT/Swin write it: `x.new_empty(...)
    .bernoulli_(keep)` in one block, `keep + torch.rand(...)` floored in the other, and noise
    from `randn_like` on a transposed view."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = 0.7
        mask = x.new_empty(x.shape[0], 1).bernoulli_(keep) / keep
        x = x + self.a(x) * mask
        mask = torch.floor(keep + torch.rand(x.shape[0], 1, dtype=x.dtype)) / keep
        x = x + self.b(x) * mask
        noisy = x.t() + 0.01 * torch.randn_like(x.t())
        return noisy.pow(2).mean()


def test_stochastic_depth_draws_the_serial_numbers_on_2x2x2() -> None:
    torch.manual_seed(0)
    assert_call_matches_serial(StochasticDepth(), (2, 2, 2), (torch.randn(8, 16),))
