"""Forward hooks that cannot run at each call as in serial are said, not dropped silently: a hook
of the model that returns None runs once, at the trace (its side effects are not repeated), and a
hook registered on a submodule of the parallel module never runs (its program does not call it).
Hooks on the model itself see and change its whole output, as in serial, in the tensor trace and
in the pipeline's export alike."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import pipelined, run_in_lockstep
from pass_fixtures import assert_call_matches_serial
from torch.distributed.tensor import DTensor

import autopar
from autopar import ForwardHookWarning
from autopar.passes.trace import trace
from autopar.runtime.source_watch import SourceWatch
from autopar.testing.pipeline_lockstep import LockstepTransport


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _trace(model: nn.Module) -> list[warnings.WarningMessage]:
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace(model, (x,), decompose=True)
    return [w for w in caught if issubclass(w.category, ForwardHookWarning)]


def test_a_hook_that_keeps_features_is_named_at_the_trace() -> None:
    model = _net()
    kept: list[torch.Tensor] = []
    calls = {"pre": 0}

    def keep(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        kept.append(out.detach())

    def count(module: nn.Module, args: Any) -> None:
        calls["pre"] += 1

    model[0].register_forward_hook(keep)
    model[2].register_forward_pre_hook(count)
    said = [str(w.message) for w in _trace(model)]
    assert len(said) == 2, said
    assert any("forward hook" in s and ".keep on 0 returned None" in s for s in said), said
    assert any("forward pre-hook" in s and ".count on 2 returned None" in s for s in said), said
    assert all("side effects" in s and "Hint:" in s for s in said)
    # the user's own hooks are left as they were (the trace wraps its copy's)
    assert list(model[0]._forward_hooks.values()) == [keep]


def test_a_hook_that_changes_the_output_is_traced_without_a_warning() -> None:
    model = _net()
    model[0].register_forward_hook(lambda module, args, out: out * 0.5)
    assert _trace(model) == []


def test_a_hook_on_a_submodule_of_the_parallel_module_is_said_at_the_next_call() -> None:
    source, containers = _net(), _net()
    watch = SourceWatch(source, [("2", containers[2])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch.check()
        assert caught == []
        containers[2].register_forward_hook(lambda module, args, out: None)
        watch.check()
        watch.check()  # once per change
    said = [str(w.message) for w in caught if issubclass(w.category, ForwardHookWarning)]
    assert len(said) == 1, said
    assert "pmodel.get_submodule('2')" in said[0] and "never runs" in said[0]


class _Scored(nn.Module):
    """A model returning a mapping, its loss inside (as transformers' models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(torch.relu(x))
        return {"loss": F.cross_entropy(x, y), "logits": x}


def _regularize(module: nn.Module, args: Any, kwargs: dict[str, Any], out: dict[str, torch.Tensor]) -> Any:
    return {**out, "loss": out["loss"] + 0.1 * out["logits"].pow(2).mean()}


def _doubled(module: nn.Module, args: Any, out: dict[str, torch.Tensor]) -> Any:
    return {**out, "loss": out["loss"] * 2}


def _hooked() -> nn.Module:
    torch.manual_seed(0)
    model = _Scored()
    model.register_forward_hook(_regularize, with_kwargs=True)
    model.register_forward_hook(_doubled)
    return model


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=g), torch.randint(4, (8,), generator=g)


def test_hooks_on_the_model_itself_see_and_change_its_output_as_in_serial() -> None:
    """Forward hooks on the model itself (one with kwargs) are handed the model's own output (the
    mapping) and what they return is the output, in their order: the trace used to hand them its
    flat tuple of tensors, and the first hook failed inside the user's code (`{**out}`)."""
    model = _hooked()
    compiled = assert_call_matches_serial(model, (2, 2), _batch())
    program = next(iter(compiled.values())).program
    assert len(program.output_layouts) == 2  # the loss and the logits
    assert list(model._forward_hooks.values()) == [_regularize, _doubled]  # the user's hooks as they were


def _logits_loss(module: nn.Module, args: Any, kwargs: dict[str, Any], out: dict[str, torch.Tensor]) -> Any:
    return {**out, "loss": out["logits"].pow(2).mean()}


def _pipelined_hooks(rank: int, world: int, transport: LockstepTransport | None = None) -> float:
    torch.manual_seed(0)
    model = _Scored()
    model.register_forward_hook(_logits_loss, with_kwargs=True)
    serial = copy.deepcopy(model)
    x, y = _batch()
    options = autopar.PipelineOptions(microbatches=2, stage_boundaries=["layers.2"])
    pmodel = pipelined(model, world, transport, example_inputs=(x, y), pipeline=options)
    assert list(model._forward_hooks.values()) == [_logits_loss]  # put back after the export
    losses = [m(x, y)["loss"] for m in (pmodel, serial)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0].detach(), losses[1].detach(), rtol=1e-5, atol=1e-6)
    ref = dict(serial.named_parameters())
    for name, p in pmodel.named_parameters():
        assert p.grad is not None
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, ref[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    return float(losses[0])


def test_hooks_on_a_pipelined_model_see_its_whole_output_as_in_serial() -> None:
    """The pipeline's export keeps only the output mapping's loss; the model's hooks run before that
    cut, on the mapping, as in serial (the stage trace handed it a flat tuple, the export the loss
    alone); a loss a hook makes
    (a mean of the logits) trains the pipeline as it trains the serial model."""
    losses = run_in_lockstep(2, _pipelined_hooks)
    assert losses[0] == losses[1]
