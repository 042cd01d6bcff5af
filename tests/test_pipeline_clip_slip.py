"""torch's `clip_grad_norm_(pmodel.parameters(), c)` on a pipelined module (README's loop on a
tensor-only module) clips each stage's gradients by that stage's own norm: the step differs from
serial's without an error (found by probe/pipeline_user.py: a timm ViT on pp=2 trained 4.5e-4 away
from serial in 3 steps). The step after such a clip warns (`autopar.PipelineClipWarning`), naming
`pmodel.clip_grad_norm_`; the module's own clip, torch's value clip, a power-of-two unscale
(GradScaler's) and no clip at all do not warn. Both ranks run in this process (lockstep)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import pipelined, run_in_lockstep

import autopar
from autopar.testing.pipeline_lockstep import LockstepTransport


def _habits(rank: int, world: int, transport: LockstepTransport | None = None) -> dict[str, list[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    options = autopar.PipelineOptions(microbatches=2, schedule="gpipe", stage_boundaries=["2"])
    pmodel = pipelined(model, world, transport, example_inputs=(x,), pipeline=options)
    params = list(pmodel.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def step(edit: Callable[[], object]) -> list[str]:
        opt.zero_grad()
        F.mse_loss(pmodel(x), y).backward()
        edit()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        return [f"{w.message} at {w.filename}" for w in caught if issubclass(w.category, autopar.PipelineClipWarning)]

    return {
        "none": step(lambda: None),
        "module clip": step(lambda: pmodel.clip_grad_norm_(1e-3)),
        "value clip": step(lambda: torch.nn.utils.clip_grad_value_(params, 1e-4)),
        "unscale": step(lambda: [p.grad.mul_(0.5) for p in params if p.grad is not None]),
        "torch clip": step(lambda: torch.nn.utils.clip_grad_norm_(params, 1e-3)),
        "after": step(lambda: None),
    }


def test_torch_clip_grad_norm_on_a_pipelined_module_warns_at_the_step() -> None:
    for found in run_in_lockstep(2, _habits):
        quiet = {name: said for name, said in found.items() if name != "torch clip"}
        assert all(not said for said in quiet.values()), quiet
        (said,) = found["torch clip"]
        assert "clip_grad_norm_" in said and "pmodel.clip_grad_norm_(" in said, said
        assert said.endswith(f"at {__file__}"), said  # the warning points at the user's opt.step()


def test_the_watch_keeps_every_gradient_in_one_conversion() -> None:
    """`ClipWatch.record` runs after every pipelined backward: it gathers the kept elements with one
    `cat` and one float64 conversion (not a copy per parameter: hundreds on a real model), gradients
    of mixed dtypes and a parameter without one included, and still tells a common norm-clip factor
    from a power-of-two unscale."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.runtime.clip_watch import ClipWatch

    class Conversions(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.count += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(6).bfloat16()),
              nn.Parameter(torch.randn(2)), nn.Parameter(torch.randn(3, 4).t())]
    opt = torch.optim.SGD(params, lr=0.1)

    def said(scale: float) -> list[str]:
        for p in params[:2] + params[3:]:
            p.grad = torch.randint(-8, 9, p.shape).to(p.dtype)  # times 0.75: exact in bfloat16 too
        params[2].grad = None
        watch = ClipWatch()
        with Conversions() as mode:
            watch.record(params)
        assert mode.count == 1, mode.count
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            watch.check(opt)
        return [str(w.message) for w in caught if issubclass(w.category, autopar.PipelineClipWarning)]

    (clipped,) = said(0.75)
    assert "scaled by 0.75" in clipped, clipped
    assert said(0.5) == [] == said(1.0)  # GradScaler's unscale; nothing done
