"""The multi-rank harness itself: results in rank order, failures named, hangs killed, all fast."""

from __future__ import annotations

import faulthandler
import functools
import os
import time
from pathlib import Path

import multirank
import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks
from torch.distributed.device_mesh import init_device_mesh

pytestmark = pytest.mark.multirank


def _all_reduce(rank: int, world_size: int, scale: float) -> tuple[int, int, float]:
    t = torch.tensor([scale * (rank + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def test_all_reduce_on_eight_ranks_returns_in_rank_order() -> None:
    results = run_ranks(8, _all_reduce, 0.5, timeout=60)
    assert results == [(rank, 8, 0.5 * 36) for rank in range(8)]


def _mesh_axis_sums(rank: int, world_size: int) -> list[float]:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("x", "y", "z"))
    sums = []
    for axis in ("x", "y", "z"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.get_group(axis))
        sums.append(t.item())
    return sums


def test_device_mesh_groups_work_in_forked_ranks() -> None:
    # Rank r has coordinates (r // 4, r // 2 % 2, r % 2); the partner along x is r ^ 4, and so on.
    results = run_ranks(8, _mesh_axis_sums, timeout=60)
    assert results == [[float(r + (r ^ 4)), float(r + (r ^ 2)), float(r + (r ^ 1))] for r in range(8)]


def _broken_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("the scenario's own check")


def test_scenarios_share_one_job_and_a_failing_one_is_named_with_its_error() -> None:
    """`run_scenarios`: each scenario's results by name, in rank order; a scenario that raises
    fails the job, named, with the rank's error (the tests sharing its fixture then all fail)."""
    scenarios = {"first": _mesh_axis_sums, "second": functools.partial(_all_reduce, scale=1.0)}
    results = multirank.run_scenarios(8, scenarios, timeout=60)
    assert results["first"] == [[float(r + (r ^ 4)), float(r + (r ^ 2)), float(r + (r ^ 1))] for r in range(8)]
    assert results["second"] == [(rank, 8, 36.0) for rank in range(8)]
    with pytest.raises(AssertionError) as info:
        multirank.run_scenarios(2, {"fine": functools.partial(_all_reduce, scale=1.0), "broken": _broken_on_rank_one}, timeout=60)
    message = str(info.value)
    assert "scenario broken failed on rank 1" in message and "the scenario's own check" in message, message
    assert "scenario fine" not in message, message


def _fail_on_rank_two_while_others_are_stuck(rank: int, world_size: int) -> None:
    if rank == 2:
        raise ValueError("rank two is broken")
    # Like a rank stuck in a collective that will never complete: only the harness can end it.
    time.sleep(3600)


def test_failing_rank_is_named_and_the_waiting_ranks_are_killed() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(4, _fail_on_rank_two_while_others_are_stuck, timeout=60)
    message = str(info.value)
    assert "4 of 4 ranks failed" in message
    assert "rank 2 raised" in message
    assert "ValueError: rank two is broken" in message
    assert "rank 0 was killed after another rank failed" in message
    assert "_fail_on_rank_two_while_others_are_stuck" in message  # the stuck ranks' stacks
    assert time.monotonic() - start < 10  # the grace period, not the 60 s timeout


def _hang_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def test_hung_rank_is_killed_at_the_timeout_with_its_stack() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(2, _hang_on_rank_one, timeout=1.5)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "1 of 2 ranks failed" in message
    assert "rank 1 timed out after 1.5 s" in message
    assert "_hang_on_rank_one" in message  # faulthandler's dump names the function it hung in
    assert elapsed < 10


def _exit_abruptly(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)


def test_rank_that_dies_without_answering_is_reported() -> None:
    with pytest.raises(AssertionError, match=r"rank 0 died:\nexited with code 3"):
        run_ranks(2, _exit_abruptly, timeout=30)


def _unpicklable(rank: int, world_size: int) -> object:
    return lambda: rank


def test_unpicklable_result_is_an_error_not_a_hang() -> None:
    with pytest.raises(AssertionError, match="rank 1 raised"):
        run_ranks(2, _unpicklable, timeout=30)


def _abort_once(rank: int, world_size: int, marker: str) -> int:
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        faulthandler.disable()  # keep the intended abort out of the test log
        os.abort()  # killed by SIGABRT, as gloo has rarely done under heavy load
    return rank


def _abort_always(rank: int, world_size: int) -> int:
    if rank == 1:
        faulthandler.disable()
        os.abort()
    return rank


def test_a_rank_killed_by_a_signal_is_retried_once(tmp_path: Path) -> None:
    assert run_ranks(2, _abort_once, str(tmp_path / "aborted"), timeout=30) == [0, 1]
    with pytest.raises(AssertionError, match=r"rank 1 died:\nexited with code -6"):
        run_ranks(2, _abort_always, timeout=30)


def test_a_test_without_the_multirank_mark_cannot_fork_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """What tests/conftest.py records for an unmarked test: run_ranks refuses before forking, so
    an unmarked rank-forking test fails instead of running beside another test's rank set."""
    monkeypatch.setattr(multirank, "CURRENT_TEST_MARKED", False)
    for start in (run_ranks, multirank.run_ranks_with_faults):
        with pytest.raises(AssertionError, match="not marked @pytest.mark.multirank"):
            start(2, _all_reduce, 1.0, timeout=10)
