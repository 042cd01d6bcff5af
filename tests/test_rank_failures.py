"""Bounded failure: a rank that is killed, raises between steps, or never calls parallelize ends
every other rank within parallelize's `timeout`, each with an AutoparError that names what it saw
and the first failure recorded in the job; never torch's 30-minute default wait."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from multirank import run_ranks_with_faults

import autopar
import autopar.compiler.driver as driver
from examples.models import make_mlp

TIMEOUT_S = 10.0  # parallelize's bound in these jobs
ENDED_WITHIN_S = 45.0  # start-up and compile of 4 forked ranks on 2 shared cores, plus the bound


def _train(rank: int, world_size: int, fault: str, peers_dir: str = "") -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    model, batch = make_mlp(0)
    if fault == "absent" and rank == 3:  # busy elsewhere: it never calls parallelize in time
        _stay_away_until_the_others_gave_up(peers_dir, world_size - 1)
        return "absent"
    try:
        pmodel = autopar.parallelize(model, mesh, example_inputs=batch, timeout=TIMEOUT_S)
    except autopar.AutoparError:
        if peers_dir:  # this rank has given up waiting: the absent one may stop staying away
            Path(peers_dir, f"gave_up.{rank}").touch()
        raise
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


def _stay_away_until_the_others_gave_up(peers_dir: str, others: int) -> None:
    """The absent rank's wait: until every other rank has raised from `parallelize` (each leaves a
    file in `peers_dir`), at most three times their bound. It used to sleep the three bounds whole,
    30 s of an idle rank that the job waited for after its peers had long failed."""
    deadline = time.monotonic() + 3 * TIMEOUT_S
    while len(list(Path(peers_dir).glob("gave_up.*"))) < others and time.monotonic() < deadline:
        time.sleep(0.1)


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
def test_parallelize_on_three_of_four_ranks_names_the_absent_rank(tmp_path: Path) -> None:
    results = run_ranks_with_faults(4, _train, "absent", str(tmp_path), timeout=180)
    assert results[3][:2] == ("ok", "absent"), results[3]
    for rank, (status, value, seconds) in enumerate(results[:3]):
        assert status == "raised" and "not every rank called parallelize within 10 s" in value, value
        assert seconds < ENDED_WITHIN_S, (rank, seconds)
    assert "3" in results[0][1].split("not every rank called parallelize")[1], results[0][1]


# ---- failures inside parallelize (issue 30 item 6) ----------------------------------------------


class _Faulty(torch.nn.Module):
    """The user's model, whose forward fails on one rank while parallelize traces it."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.inner, _ = make_mlp(0)
        self.fault = fault

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.fault == "raise":
            raise ValueError("the model's forward failed on this rank")
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(x, y)


def _parallelize_with_fault(rank: int, world_size: int, where: str, failing: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    _, batch = make_mlp(0)
    kind, _, how = where.partition("_")
    mine = rank == failing
    model = _Faulty(how if kind == "trace" and mine else "")
    init_fn = None
    if kind == "plan" and mine:  # a failure (a bug, a kill) inside the planner, on the rank that plans

        def failing_search(*args: Any, **kwargs: Any) -> Any:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("the planner failed on this rank")

        driver.search_layouts = failing_search
    if kind == "init":  # materialization: the model on the meta device, the user's init fails on one rank
        with torch.device("meta"):
            model = _Faulty("")

        def init_fn(module: torch.nn.Module) -> None:
            if mine:
                raise ValueError("the user's init_fn failed on this rank")
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight)
                torch.nn.init.zeros_(module.bias)

    inputs = "every rank's own" if kind == "args" and mine else "global"  # refused before the meeting
    autopar.parallelize(model, mesh, example_inputs=batch, timeout=TIMEOUT_S, init_fn=init_fn, inputs=inputs)
    return "parallelized"


# what the failing rank's peers must say: the rank, and its error where it lived to record it
PARALLELIZE_FAULTS = {
    "trace_raise": (1, r"first failure recorded in the job: rank 1: .*the model's forward failed on this rank"),
    "trace_kill": (1, r"still waiting\): \[1\]"),
    "plan_raise": (0, r"rank 0 failed in planning, inside parallelize: InternalError: .*RuntimeError: the planner failed on this rank"),
    "plan_kill": (0, r"still waiting\): \[0\]"),
    "args_raise": (1, r"not every rank called parallelize within 10 s: .*first failure recorded in the job: "
                   r"rank 1: UsageError: inputs must be one of"),
    "init_raise": (1, r"first failure recorded in the job: rank 1: .*the user's init_fn failed on this rank"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("where", list(PARALLELIZE_FAULTS))
def test_a_rank_that_fails_inside_parallelize_is_named_on_every_other_rank(where: str) -> None:
    failing, said = PARALLELIZE_FAULTS[where]
    results = run_ranks_with_faults(2, _parallelize_with_fault, where, failing, timeout=120)
    status, value, _ = results[failing]
    assert status == ("died" if where.endswith("kill") else "raised"), results[failing]
    other = 1 - failing
    status, value, seconds = results[other]
    assert status == "raised" and "RankFailureError" in value, value
    assert re.search(said, value), value
    assert seconds < ENDED_WITHIN_S, seconds


def _retry_after_a_caught_failure(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.groups import first_failure, record_failure

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    model, batch = make_mlp(0)
    with contextlib.suppress(autopar.AutoparError):  # every rank's mistake, caught: the user retries
        autopar.parallelize(model, mesh, example_inputs=batch, inputs="everything", timeout=TIMEOUT_S)
    caught = first_failure()
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch, timeout=TIMEOUT_S)
    after = first_failure()  # the retry's steps start with no failure on record
    pmodel(*batch).backward()
    if rank == 1:
        record_failure(rank, RuntimeError("a later step failed"))
    torch.distributed.barrier()
    return {"caught": caught, "after": after, "later": first_failure()}


@pytest.mark.multirank
def test_a_failure_caught_in_one_parallelize_is_not_the_next_ones_first_failure() -> None:
    from multirank import run_ranks

    for result in run_ranks(2, _retry_after_a_caught_failure, timeout=120):
        assert result["caught"] is not None and "UsageError: inputs must be one of" in result["caught"]
        assert result["after"] is None, result
        assert result["later"] == "rank 1: RuntimeError: a later step failed", result
