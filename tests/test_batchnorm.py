"""A ResNet-style CNN with BatchNorm in training mode: batch statistics over the global batch (the
ranks that split the batch add their sums), running statistics updated as the serial model's,
visible in `state_dict()`, and used by `eval()`. Every rank's program on (2,2,2), (8,) and (1,) in
lockstep checks a step's numbers and running statistics; two gloo ranks that split the batch check
the runtime around them over three steps (the buffers written back, `state_dict()`, `eval()`)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from multirank import run_ranks
from pass_fixtures import assert_call_matches_serial
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar

CLASSES = 8


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(Block(channels), Block(channels))
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(images)))
        x = self.blocks(x).mean((2, 3))
        return F.cross_entropy(self.head(x), labels)


def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(CLASSES, (n,), generator=g)


@pytest.mark.parametrize("shape", [(2, 2, 2), (8,), (1,)], ids=lambda s: "x".join(map(str, s)))
def test_one_step_with_running_stats_matches_serial(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = ResNet()
    compiled = assert_call_matches_serial(model, shape, _batch(1))  # loss, grads, new running stats
    program = next(iter(compiled.values())).program
    assert len(program.buffer_updates) == 15  # 5 norms: running mean, var, batches tracked
    assert program.buffer_updates[:3] == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]


def _job(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    torch.manual_seed(0)
    model = ResNet()
    serial = copy.deepcopy(model)
    pmodel = autopar.parallelize(model, mesh, example_inputs=_batch(0))
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    result: dict[str, Any] = {"losses": [], "grad_err": 0.0}
    for step in range(3):
        batch = _batch(step)
        loss, want = pmodel(*batch), serial(*batch)
        loss.backward()
        want.backward()
        result["losses"].append((float(loss), float(want)))
        grads = {n: p.grad for n, p in serial.named_parameters()}
        for name, p in pmodel.named_parameters():
            result["grad_err"] = max(result["grad_err"], float((p.grad.full_tensor() - grads[name]).abs().max()))
        opt.step()
        serial_opt.step()
        opt.zero_grad()
        serial_opt.zero_grad()
    state, serial_state = pmodel.state_dict(), serial.state_dict()
    result["keys"] = list(state) == list(serial_state)
    result["state_err"] = {
        k: float((v.full_tensor().double() - serial_state[k].double()).abs().max()) for k, v in state.items()
    }
    pmodel.eval()
    serial.eval()
    with torch.no_grad():
        result["eval"] = (float(pmodel(*_batch(9))), float(serial(*_batch(9))))
    return result


@pytest.mark.multirank
def test_trains_like_serial_on_two_ranks_and_evaluates_with_running_stats() -> None:
    for rank, r in enumerate(run_ranks(2, _job, timeout=600)):
        for loss, want in r["losses"]:
            assert loss == pytest.approx(want, rel=1e-5, abs=1e-6), (rank, r["losses"])
        assert r["grad_err"] < 1e-4, (rank, r["grad_err"])
        assert r["keys"], rank
        # parameters after 3 SGD steps and the running statistics after 3 updates
        assert max(r["state_err"].values()) < 1e-5, (rank, r["state_err"])
        assert r["state_err"]["bn.num_batches_tracked"] == 0, rank
        assert r["eval"][0] == pytest.approx(r["eval"][1], rel=1e-5), (rank, r["eval"])
