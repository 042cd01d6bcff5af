"""A loss outside the model on a 2-D mesh reduces in one collective: the mean of an output split
on both axes is partial over both, and without a flattened mesh DTensor all-reduced it axis by
axis and logged on every rank that sequential reductions may differ between ranks (a user probe:
`F.mse_loss(out, t)` on a (2, 2) mesh)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import run_ranks

import autopar


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _loss_on_a_2d_mesh(rank: int, world_size: int, names: tuple[str, str]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    serial = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    serial.load_state_dict(model.state_dict())
    x, t = torch.randn(8, 16), torch.randn(8, 16)
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x,))
    records = _Records()
    logging.getLogger("torch.distributed.tensor").addHandler(records)
    out = pmodel(x)
    loss = F.mse_loss(out, t)
    loss.backward()
    expected = F.mse_loss(serial(x), t)
    expected.backward()
    grad = pmodel.get_parameter("2.weight").grad
    assert grad is not None and serial[2].weight.grad is not None
    return {
        "logged": [m for m in records.messages if "sequential" in m],
        "loss": (loss.item(), expected.item()),
        "grad": float((grad.full_tensor() - serial[2].weight.grad).abs().max()),
    }


@pytest.mark.multirank
def test_a_loss_partial_over_both_axes_is_one_reduction_equal_to_serial() -> None:
    """torch flattens named meshes only: an unnamed mesh keeps DTensor's per-axis reductions."""
    for result in run_ranks(4, _loss_on_a_2d_mesh, ("x", "y"), timeout=300):
        assert result["logged"] == [], result["logged"]
        value, expected = result["loss"]
        assert abs(value - expected) < 1e-6, result
        assert result["grad"] < 1e-6, result
