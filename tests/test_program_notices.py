"""What a new program prints: a model called with the last, smaller batch, or under no_grad in
eval, compiles programs that may read a parameter in another split than it is stored in.
torch's notice "CPU process group does not support alltoall yet, falling back with allgather +
chunk!" about that internal layout change reached the user on every such program (a user probe);
now it does not, and other torch log records still do."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from multirank import run_ranks
from transformers import ConvNextV2Config, ConvNextV2ForImageClassification

import autopar
from autopar.core.user_warning import GLOO_ALLTOALL_NOTICE, without_gloo_alltoall_notice


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train_then_eval(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    torch.manual_seed(0)
    config = ConvNextV2Config(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                              image_size=32, num_labels=10)
    model = ConvNextV2ForImageClassification(config)
    serial = copy.deepcopy(model)
    records = _Records()
    logging.getLogger("torch.distributed.tensor").addHandler(records)  # it does not propagate
    x = torch.randn(8, 3, 32, 32)
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x,))
    F.cross_entropy(pmodel(x).logits, torch.zeros(8, dtype=torch.long)).backward()
    # the last, smaller batch: its program reads some weights in another split than stored
    F.cross_entropy(pmodel(x[:3]).logits, torch.zeros(3, dtype=torch.long)).backward()
    pmodel.eval()
    serial.eval()
    with torch.no_grad():
        diff = float((pmodel(x[:5]).logits.full_tensor() - serial(x[:5]).logits).abs().max())
    with without_gloo_alltoall_notice():  # another record from the same logger passes
        logging.getLogger("torch.distributed.tensor._collective_utils").warning("a real warning")
    return {"notices": records.messages, "diff": diff, "programs": len(pmodel.programs)}


@pytest.mark.multirank
def test_new_programs_print_no_gloo_alltoall_notice() -> None:
    for result in run_ranks(2, _train_then_eval, timeout=300):
        assert GLOO_ALLTOALL_NOTICE not in result["notices"], result["notices"]
        assert "a real warning" in result["notices"], result["notices"]
        assert result["diff"] < 1e-5, result
        assert result["programs"] >= 2, result
