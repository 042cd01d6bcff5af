"""`torch.autocast` around a pipelined call (docs/pipeline.md): the stages run their float32
programs under the user's autocast, so a stage whose boundary value comes out of a Linear makes
bfloat16 where the receiver's buffer, allocated from the exported spec, is float32. Before, the
bytes were read as float32 (gloo: a loss of 1e29, probe/user17.py distilbert on pp=2; lockstep: a
dtype mismatch); now the boundary values and a loss-outside call's outputs go as their specs'
dtype, exactly. Both ranks run in this process (lockstep)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import pipelined, run_in_lockstep

import autopar
from autopar.testing.pipeline_lockstep import LockstepTransport


class _Head(nn.Module):
    """A boundary after a Linear (bfloat16 under autocast), dropout before it, the loss inside or out."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.1)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.c(torch.tanh(self.b(self.drop(torch.tanh(self.a(x))))))
        return h if y is None else F.cross_entropy(h, y)


def _steps(rank: int, world: int, outside: bool, transport: LockstepTransport | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Head()
    serial = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    options = autopar.PipelineOptions(microbatches=2, schedule="gpipe", stage_boundaries=["b"])
    pmodel = pipelined(model, world, transport, example_inputs=(x,) if outside else (x, y), pipeline=options)
    found: dict[str, Any] = {"losses": []}
    for m in (serial, pmodel):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x), y) if outside else m(x, y)
        loss.backward()
        found["losses"].append(loss.detach().float())
    sp = dict(serial.named_parameters())
    found["grads"] = {name: (sp[name].grad, p.grad) for name, p in pmodel.named_parameters()}
    return found


@pytest.mark.parametrize("outside", [False, True], ids=["loss-inside", "loss-outside"])
def test_autocast_with_a_bfloat16_boundary_equals_serial_autocast(outside: bool) -> None:
    for found in run_in_lockstep(2, _steps, outside):
        serial_loss, loss = found["losses"]
        torch.testing.assert_close(loss, serial_loss, rtol=1e-6, atol=1e-6)
        assert found["grads"], found
        for name, (want, got) in found["grads"].items():  # microbatched: bfloat16's rounding apart
            assert got is not None and got.dtype == want.dtype, name
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()), msg=name)
