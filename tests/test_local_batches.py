"""`parallelize(..., inputs="local")`: each rank passes only its own shard of the batch, as a
DistributedSampler yields it, and training equals serial on the shards concatenated in rank order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from multirank import run_ranks

import autopar
from autopar.runtime.local_batch import global_stand_ins
from examples.models import make_gpt


def test_programs_are_traced_for_the_batch_the_shards_make_together() -> None:
    ids = torch.zeros(2, 8, dtype=torch.int64)
    embeds = torch.zeros(2, 8, 4, requires_grad=True)
    args, kwargs = global_stand_ins(((ids,), {"embeds": embeds, "flag": True}), 4)
    assert args[0].shape == (8, 8) and args[0].dtype == torch.int64
    assert kwargs["embeds"].shape == (8, 8, 4) and kwargs["embeds"].requires_grad
    assert kwargs["flag"] is True


def _train_on_shards(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    model, (ids, targets) = make_gpt(0, batch_size=8)
    serial, _ = make_gpt(0, batch_size=8)
    mine = slice(2 * rank, 2 * rank + 2)  # a DistributedSampler's contiguous shard of rank `rank`
    pmodel = autopar.parallelize(model, mesh, example_inputs=(ids[mine], targets[mine]), inputs="local")
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(2):
        for module, optimizer, batch in ((pmodel, opt, (ids[mine], targets[mine])), (serial, serial_opt, (ids, targets))):
            optimizer.zero_grad()
            loss = module(*batch)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
    result: dict[str, Any] = {"losses": losses}
    result["params"] = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(pmodel.parameters(), serial.parameters()))
    bad = ids[mine].clone()
    if rank == 3:
        bad[0, 0] = 10**6  # on one rank's shard only: every rank must raise, none may hang
    try:
        pmodel(bad, targets[mine])
        result["bad_token"] = "no error"
    except IndexError as exc:
        result["bad_token"] = str(exc)
    rows = 1 if rank == 0 else 2
    try:
        pmodel(ids[mine][:rows], targets[mine][:rows])
        result["uneven"] = "no error"
    except autopar.InputMismatchError as exc:
        result["uneven"] = str(exc)
    from torch.distributed.tensor import Replicate, distribute_tensor

    try:
        pmodel(distribute_tensor(ids, mesh, [Replicate(), Replicate()]), targets[mine])
        result["dtensor"] = "no error"
    except autopar.InputMismatchError as exc:
        result["dtensor"] = str(exc)
    # the last, smaller batch: one row per rank compiles a program for the 4 rows together
    result["small"] = (float(pmodel(ids[rank : rank + 1], targets[rank : rank + 1])), float(serial(ids[:4], targets[:4])))
    return result


@pytest.mark.multirank
def test_each_rank_passes_its_shard_and_training_equals_serial_on_the_whole_batch() -> None:
    for result in run_ranks(4, _train_on_shards, timeout=300):
        first, first_serial, second, second_serial = result["losses"]
        assert abs(first - first_serial) < 1e-6 and abs(second - second_serial) < 1e-5, result["losses"]
        assert result["params"] < 1e-5, result["params"]
        assert "idx holds 1000000, but aten.embedding.default takes 0 to 63" in result["bad_token"], result["bad_token"]
        assert "idx has 1 rows on rank 0 but 2 on rank 1" in result["uneven"], result["uneven"]
        assert 'a DTensor argument is a global value, but with inputs="local"' in result["dtensor"], result["dtensor"]
        small, small_serial = result["small"]
        assert abs(small - small_serial) < 1e-6, result["small"]
