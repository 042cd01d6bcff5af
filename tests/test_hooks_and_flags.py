"""Gradient hooks and submodule training flags, against the serial model on 2 gloo ranks.

Hooks on the original model's parameters are refused at parallelize (tests/test_bad_inputs.py);
what the refusal's hint says to do instead (the same hooks on the parallel module's parameters,
which see the whole gradient as a DTensor) trains equal to serial here. A dropout the user keeps
in eval() inside a training model stays in eval in every program: the first, the one a smaller
last batch compiles, and after `pmodel.train()` and the user's own re-freeze, as in serial. The
parallel module's submodules have the model's classes, so batch norm frozen by type
(`isinstance(m, nn.BatchNorm2d)`) stays frozen (it silently trained before), in a channels_last
model."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import run_ranks

import autopar


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(self.drop(torch.relu(self.fc1(x)))), y)


def _clamp(g: torch.Tensor) -> torch.Tensor:
    return g.clamp(-0.01, 0.01)


def _unit(g: torch.Tensor) -> torch.Tensor:
    return g / g.norm()  # not elementwise: equal only on the whole gradient


def _halve(p: torch.Tensor) -> None:
    assert p.grad is not None
    p.grad.mul_(0.5)


def _hook(module: nn.Module) -> None:
    module.get_parameter("fc1.weight").register_hook(_clamp)
    module.get_parameter("fc1.bias").register_hook(_unit)
    module.get_parameter("fc2.weight").register_post_accumulate_grad_hook(_halve)


class BatchNormNet(nn.Module):
    """A CNN whose batch norm a fine-tuning recipe freezes by type, built in channels_last."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return F.cross_entropy(self.head(h), y)


def _freeze_batch_norm(model: nn.Module) -> None:
    """timm's and detectron's idiom: every module of a batch norm type to eval."""
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eval()


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return BatchNormNet().to(memory_format=torch.channels_last)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 16, generator=gen), torch.randint(8, (n,), generator=gen)) for n in (8, 8, 6)]


def _model() -> DropoutMLP:
    torch.manual_seed(0)
    model = DropoutMLP()
    model.drop.eval()  # frozen inside a training model
    return model


def _side_by_side(serial: nn.Module, pmodel: nn.Module, batches: Any, between: Any = None) -> float:
    """Largest difference of loss, gradients and parameters over SGD-with-momentum steps."""
    worst = 0.0
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (serial, pmodel)]
    for step, batch in enumerate(batches):
        if between is not None:
            between(step)
        losses = []
        for module, opt in zip((serial, pmodel), opts):
            opt.zero_grad()
            loss = module(*batch)
            loss.backward()
            losses.append(loss)
        worst = max(worst, abs(float(losses[0]) - float(losses[1])))
        for p, q in zip(serial.parameters(), pmodel.parameters()):
            worst = max(worst, float((p.grad - q.grad.full_tensor()).abs().max()))
        for opt in opts:
            opt.step()
    for p, q in zip(serial.parameters(), pmodel.parameters()):
        worst = max(worst, float((p - q.full_tensor()).abs().max()))
    return worst


def _job(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    batches = _batches()
    found: dict[str, Any] = {}
    original = _model()
    serial, pmodel = _model(), autopar.parallelize(original, mesh, example_inputs=batches[0])
    _hook(serial)
    _hook(pmodel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found["hooks"] = _side_by_side(serial, pmodel, batches)
        found["dropout flag"] = pmodel.drop.training
        # the original model changed after parallelize: each change is said once, at the next call
        original.drop.train()
        pmodel(*batches[0])
        pmodel(*batches[0])  # the same change: not said again
        original.drop.eval()  # back as at parallelize: nothing to say
        pmodel(*batches[0])
        handle = original.fc1.register_forward_hook(lambda m, i, o: o * 2)
        pmodel(*batches[0])
        handle.remove()
        original.fc2.weight.register_hook(_clamp)
        pmodel(*batches[0])
    found["original changed"] = [str(w.message) for w in caught if w.category is autopar.OriginalModelWarning]
    serial, pmodel = _model(), autopar.parallelize(_model(), mesh, example_inputs=batches[0])

    def epoch_start(step: int) -> None:  # an evaluation pass, then train() and the re-freeze
        if step == 2:
            for module in (serial, pmodel):
                module.eval()
                module.train()
                module.drop.eval()  # type: ignore[operator]

    found["flags"] = _side_by_side(serial, pmodel, batches * 2, epoch_start)
    found["programs"] = [why for why, _ in pmodel.programs]
    # a channels_last model (a raw stride error at parallelize before), batch norm frozen by type
    gen = torch.Generator().manual_seed(2)
    images = [(torch.randn(4, 3, 6, 6, generator=gen), torch.randint(0, 8, (4,), generator=gen)) for _ in range(2)]
    serial, pmodel = _bn_net(), autopar.parallelize(_bn_net(), mesh, example_inputs=images[0])
    for module in (serial, pmodel):
        _freeze_batch_norm(module)
    found["frozen bn"] = (_side_by_side(serial, pmodel, images), pmodel.get_submodule("bn").training)
    found["repr"] = repr(pmodel)
    return found


@pytest.mark.multirank
def test_hooks_on_the_parallel_parameters_and_frozen_dropout_train_as_serial() -> None:
    for found in run_ranks(2, _job, timeout=180):
        assert found["hooks"] < 1e-5, found
        assert found["dropout flag"] is False, found
        said = found["original changed"]
        assert len(said) == 3, said
        assert "model.drop.train() was called" in said[0] and "call pmodel.get_submodule('drop').train()" in said[0]
        assert "a forward hook was added to or removed from model.fc1" in said[1] and "before parallelize" in said[1]
        assert "model's parameter fc2.weight" in said[2] and "pmodel.get_parameter('fc2.weight').register_hook" in said[2]
        assert found["flags"] < 1e-5, found
        assert len(found["programs"]) == 2, found  # the last batch's shape; the re-freeze reuses both
        assert found["frozen bn"][0] < 1e-5 and found["frozen bn"][1] is False, found["frozen bn"]
        assert "(bn): BatchNorm2d(8, eps=1e-05" in found["repr"] and "bias=False" in found["repr"], found["repr"]
