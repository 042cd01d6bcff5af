"""Inputs that require grad in a pipeline (docs/pipeline.md#inputs-that-require-grad): after
`loss.backward()` the inputs' `.grad` (an input several stages read, on different ranks; a 0-d
input every microbatch shares) and every parameter's gradient equal serial's, on 2 ranks run in this process
(`autopar.testing.pipeline_lockstep`), and with tensor axes in each stage on 4 gloo ranks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import pipelined, run_in_lockstep, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.testing.pipeline_lockstep import LockstepTransport

TOL = {"rtol": 1e-4, "atol": 1e-6}


class ReadsInputTwice(nn.Module):
    """`x` is read by the first stage and again by the head (the last stage); `temperature` is a
    0-d input that divides the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, temperature: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        logits = (self.head(h) + x) / temperature
        return F.cross_entropy(logits, y)


def _job(rank: int, world: int, cases: list[dict[str, Any]], transport: LockstepTransport | None = None) -> None:
    for case in cases:
        torch.manual_seed(0)
        model = ReadsInputTwice()
        serial = copy.deepcopy(model)
        x, y = torch.randn(8, 8), torch.randint(0, 8, (8,))
        options = autopar.PipelineOptions(
            microbatches=case["M"], schedule=case["schedule"], stage_boundaries=case["boundaries"],
            virtual_stages=case.get("v", 1),
        )  # fmt: skip
        example = (x, torch.tensor(2.0), y)
        if world == 4:  # tensor axes beside pp: each stage a parallel module on its sub-mesh
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
            pmodel = autopar.parallelize(model, mesh, example_inputs=example, pipeline=options)
        else:
            pmodel = pipelined(model, world, transport, example_inputs=example, pipeline=options)
        grads = []
        for module in (pmodel, serial):
            xi = x.clone().requires_grad_(True)
            t = torch.tensor(1.5, requires_grad=True)
            module(xi * 1.0, t, y).backward()  # a non-leaf input: its gradient flows on to xi
            grads.append((xi.grad, t.grad))
        assert grads[0][0] is not None and grads[0][1] is not None
        torch.testing.assert_close(grads[0][0], grads[1][0], **TOL, msg=f"{case} x.grad")
        torch.testing.assert_close(grads[0][1], grads[1][1], **TOL, msg=f"{case} temperature.grad")
        ref = dict(serial.named_parameters())
        for name, p in pmodel.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, ref[name].grad, **TOL, msg=f"{case} {name}")


def test_input_gradients_equal_serial() -> None:
    """1F1B with microbatches of 3, 3 and 2 samples; interleaved 1F1B with 4 stages on 2 ranks."""
    cases = [
        {"M": 3, "schedule": "1f1b", "boundaries": ["layers.1"]},
        {"M": 2, "schedule": "interleaved-1f1b", "v": 2, "boundaries": ["layers.0", "layers.1", "layers.2"]},
    ]
    run_in_lockstep(2, _job, cases)


@pytest.mark.multirank
def test_input_gradients_with_tensor_axes_in_each_stage() -> None:
    """pp=2 x tp=2: 1F1B (gradients reduced once per step) and zero-bubble (each backward split)."""
    cases = [
        {"M": 2, "schedule": "1f1b", "boundaries": ["layers.1"]},
        {"M": 2, "schedule": "zero-bubble", "boundaries": ["layers.1"]},
    ]
    run_ranks(4, _job, cases, timeout=240)
