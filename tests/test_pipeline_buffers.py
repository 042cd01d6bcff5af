"""A pipelined module's buffers (docs/pipeline.md#checkpoints): `named_buffers()` and `state_dict()`
hold every stage's buffers under the model's names (BatchNorm's running statistics and its
`num_batches_tracked`, which an eval forward never reads; a root buffer nobody reads; a
non-persistent table in `named_buffers()` only), equal to serial's, and a checkpoint round-trips
them into a pipelined module built from other weights (and, on 4 ranks, into a tensor-only (2, 2)
module); on 2 and 4 gloo ranks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar

TOL = {"rtol": 1e-5, "atol": 1e-6}


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.bn = nn.Linear(8, 16), nn.BatchNorm1d(16)
        self.mid, self.bn2 = nn.Linear(16, 16), nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)
        self.register_buffer("scale", torch.tensor(2.0))  # read by the last stage
        self.register_buffer("version", torch.tensor(3))  # read by nobody: kept by stage 0
        self.register_buffer("table", torch.arange(16.0) / 16, persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.inp(x))) + self.table
        h = torch.relu(self.bn2(self.mid(h)))
        return F.cross_entropy(self.head(h) * self.scale, y)


def _model(seed: int) -> NormNet:
    torch.manual_seed(seed)
    model = NormNet()
    with torch.no_grad():
        for i, bn in enumerate((model.bn, model.bn2)):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
            bn.num_batches_tracked.fill_(seed * 10 + i + 1)
        model.version.fill_(seed + 3)
    return model.eval()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    model = _model(0)
    serial = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    options = autopar.PipelineOptions(microbatches=2, stage_boundaries=["mid"])
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x, y), pipeline=options)
    with torch.no_grad():
        torch.testing.assert_close(pmodel(x, y), serial(x, y), **TOL)
    buffers = {name: _whole(b) for name, b in pmodel.named_buffers()}
    state = {name: _whole(t) for name, t in pmodel.state_dict().items()}
    autopar.save_checkpoint(pmodel, f"{root}/ckpt")

    other = _model(1)  # other weights and statistics: the load must replace every one
    fresh = autopar.parallelize(other, mesh, example_inputs=(x, y), pipeline=options)
    result = autopar.load_checkpoint(fresh, f"{root}/ckpt")
    assert not result.missing and not result.unexpected, result
    loaded = {name: _whole(t) for name, t in fresh.state_dict().items()}
    with torch.no_grad():
        torch.testing.assert_close(fresh(x, y), serial(x, y), **TOL)
    out = {"buffers": buffers, "state": state, "loaded": loaded}
    if world == 4:  # the pipelined checkpoint loads into a tensor-only (2, 2) module, buffers included
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
        tensor_only = autopar.parallelize(_model(2), grid, example_inputs=(x, y))
        result = autopar.load_checkpoint(tensor_only, f"{root}/ckpt")
        assert not result.missing and not result.unexpected, result
        want = serial.state_dict()
        got = {name: _whole(t) for name, t in tensor_only.state_dict().items()}
        assert sorted(got) == sorted(want)
        for name, value in got.items():
            torch.testing.assert_close(value, want[name], **TOL, msg=f"tensor-only {name}")
    return out


def _check(results: list[dict[str, Any]]) -> None:
    serial = _model(0)
    want_buffers = dict(serial.named_buffers())
    want_state = serial.state_dict()
    for field, want in (("buffers", want_buffers), ("state", want_state), ("loaded", want_state)):
        union: dict[str, torch.Tensor] = {}
        for got in results:
            union.update(got[field])
        assert sorted(union) == sorted(want), field
        for name, value in union.items():
            torch.testing.assert_close(value, want[name], **TOL, msg=f"{field} {name}")
    assert "table" in want_buffers and "table" not in want_state  # non-persistent: named_buffers only
    def ranks(name: str) -> list[int]:
        return [r for r, got in enumerate(results) if name in got["state"]]

    half = len(results) // 2  # pp is the mesh's first axis: stage 0 on the first half of the ranks
    assert ranks("version") == list(range(half))  # read by no stage: its (root) module's, stage 0
    assert ranks("bn2.num_batches_tracked") == list(range(half, len(results)))


@pytest.mark.multirank
def test_buffers_and_checkpoint_round_trip_on_pp2(tmp_path: Path) -> None:
    _check(run_ranks(2, _job, str(tmp_path), timeout=120))


@pytest.mark.multirank
def test_buffers_with_tensor_axes_in_each_stage(tmp_path: Path) -> None:
    _check(run_ranks(4, _job, str(tmp_path), timeout=180))
