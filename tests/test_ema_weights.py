"""EMA and SWA weights of a parallel module: `AveragedModel(pmodel)` deep-copies the module,
which is refused with a hint naming what works; the two ways it names, diffusers'
`EMAModel(pmodel.parameters())` and torch's `get_ema_multi_avg_fn` over copies of the
parameters, keep averages equal to the serial model's (a user probe met only the refusal)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.training_utils import EMAModel
from multirank import run_ranks
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import autopar
from autopar.core.errors import UsageError


def _ema(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 10))
    serial = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x,))
    try:
        AveragedModel(pmodel)
        refusal = "no error"
    except UsageError as exc:
        refusal = str(exc)
    averages = {}
    for name, m in (("parallel", pmodel), ("serial", serial)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        diffusers_ema = EMAModel(m.parameters(), decay=0.9)
        torch_ema = [p.detach().clone() for p in m.parameters()]
        update = get_ema_multi_avg_fn(0.9)
        for step in range(3):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
            diffusers_ema.step(m.parameters())
            update(torch_ema, [p.detach() for p in m.parameters()], torch.tensor(step + 1))
        averages[name] = (diffusers_ema.shadow_params, torch_ema)
    whole = [
        [t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t for t in ts]
        for ts in (*averages["parallel"], *averages["serial"])
    ]
    return {
        "refusal": refusal,
        "diffusers": max(float((a - b).abs().max()) for a, b in zip(whole[0], whole[2])),
        "torch": max(float((a - b).abs().max()) for a, b in zip(whole[1], whole[3])),
        "moved": max(float((a - b).abs().max()) for a, b in zip(whole[1], [p.detach() for p in serial.parameters()])),
    }


@pytest.mark.multirank
def test_ema_of_a_parallel_module_equals_serial_and_averagedmodel_names_how() -> None:
    for result in run_ranks(2, _ema, timeout=300):
        assert "cannot deep-copy a ParallelModule" in result["refusal"], result["refusal"]
        assert "EMAModel(pmodel.parameters())" in result["refusal"], result["refusal"]
        assert "get_ema_multi_avg_fn" in result["refusal"], result["refusal"]
        assert result["diffusers"] < 1e-6 and result["torch"] < 1e-6, result
        assert result["moved"] > 1e-4, result  # the averages lag the weights: the test can tell
