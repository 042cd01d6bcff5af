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
