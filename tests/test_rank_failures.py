"""Bounded failure: a rank that is killed, raises between steps, or never calls parallelize ends
every other rank within parallelize's `timeout`, each with an AutoparError that names what it saw
and the first failure recorded in the job; never torch's 30-minute default wait."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest
import torch
from multirank import run_ranks_with_faults

import autopar
from examples.models import make_mlp

TIMEOUT_S = 10.0  # parallelize's bound in these jobs
ENDED_WITHIN_S = 45.0  # start-up and compile of 4 forked ranks on 2 shared cores, plus the bound


def _train(rank: int, world_size: int, fault: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    model, batch = make_mlp(0)
    if fault == "absent" and rank == 3:  # busy elsewhere: it never calls parallelize in time
        time.sleep(3 * TIMEOUT_S)
        return "absent"
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch, timeout=TIMEOUT_S)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    for step in range(4):
        if step == 2 and rank == 3:
            if fault == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "raised":
                raise ValueError("the user's own code failed on rank 3")
        loss = pmodel(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return "finished"


@pytest.mark.multirank
@pytest.mark.parametrize("fault", ["killed", "raised"])
def test_a_rank_that_dies_mid_training_ends_every_other_rank_in_bounded_time(fault: str) -> None:
    results = run_ranks_with_faults(4, _train, fault, timeout=180)
    status, value, _ = results[3]
    assert status == ("died" if fault == "killed" else "raised"), results[3]
    for rank, (status, value, seconds) in enumerate(results[:3]):
        assert status == "raised", (rank, status, value)
        assert "RankFailureError" in value and "a collective failed on rank" in value, value
        assert re.search(r"still waiting\): \[[0-9, ]*3\]", value), value  # rank 3 never reported
        assert seconds < ENDED_WITHIN_S, (rank, seconds)


@pytest.mark.multirank
def test_parallelize_on_three_of_four_ranks_names_the_absent_rank() -> None:
    results = run_ranks_with_faults(4, _train, "absent", timeout=180)
    assert results[3][:2] == ("ok", "absent"), results[3]
    for rank, (status, value, seconds) in enumerate(results[:3]):
        assert status == "raised" and "not every rank called parallelize within 10 s" in value, value
        assert seconds < ENDED_WITHIN_S, (rank, seconds)
    assert "3" in results[0][1].split("not every rank called parallelize")[1], results[0][1]
