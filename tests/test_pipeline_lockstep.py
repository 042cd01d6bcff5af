"""The in-process pipeline runner (`autopar.testing.pipeline_lockstep`): messages meet their
receives in any order, collectives meet when every rank has joined, each rank keeps its own random
state, and a mismatch is named, not a hang. The pipelines it runs against serial are in the
test_pipeline_* files (docs/pipeline.md#testing-in-one-process)."""

from __future__ import annotations

import warnings

import pytest
import torch
from multirank import pipelined, run_in_lockstep

import autopar
from autopar.core.errors import AutoparError, UsageError
from autopar.core.pipeline_schedule import schedule_by_name
from autopar.runtime.pipeline_runtime import StageRunner, TensorSpec, run_step
from autopar.testing.pipeline_lockstep import LockstepDeadlock, LockstepTransport, run_round_robin


def test_a_receive_posted_first_waits_for_its_send_and_tags_pick_the_message() -> None:
    order: list[str] = []

    def body(rank: int, t: LockstepTransport) -> dict[int, float]:
        if rank == 0:
            order.append("rank 0 runs")
            for tag in (5, 7):
                t.isend(torch.tensor([float(tag)]), 1, tag)
            return {}
        got = {tag: torch.zeros(1) for tag in (7, 5)}  # the opposite order to the sends
        for tag, buf in got.items():
            t.recv(buf, 0, tag)
        order.append("rank 1 received")
        return {tag: buf.item() for tag, buf in got.items()}

    assert run_round_robin(2, body) == [{}, {7: 7.0, 5: 5.0}]
    assert order == ["rank 0 runs", "rank 1 received"]

    def receive_first(rank: int, t: LockstepTransport) -> float:
        if rank == 1:  # rank 1 posts its send only after rank 0 waits: the turn moves to it
            t.isend(torch.tensor([3.0]), 0, 0)
            return 0.0
        buf = torch.zeros(1)
        t.recv(buf, 1, 0)
        return buf.item()

    assert run_round_robin(2, receive_first) == [3.0, 0.0]

    def one_tag_twice(rank: int, t: LockstepTransport) -> list[float]:
        if rank == 0:  # two messages under one tag: received in the order sent, as gloo matches them
            t.isend(torch.tensor([1.0]), 1, 0)
            t.isend(torch.tensor([2.0]), 1, 0)
            return []
        bufs = [torch.zeros(1), torch.zeros(1)]
        for buf in bufs:
            t.recv(buf, 0, 0)
        return [b.item() for b in bufs]

    assert run_round_robin(2, one_tag_twice) == [[], [1.0, 2.0]]


def test_collectives_meet_every_rank_and_reduce_in_rank_order() -> None:
    def body(rank: int, t: LockstepTransport) -> tuple[float, float, float]:
        total = torch.tensor([float(rank + 1)])
        t.all_reduce(total)
        largest = torch.tensor([float(10 - rank)])
        t.all_reduce(largest, "max")
        value = torch.tensor([float(rank)])
        t.broadcast(value, 2)
        return total.item(), largest.item(), value.item()

    assert run_round_robin(3, body) == [(6.0, 10.0, 2.0)] * 3


def test_ranks_keep_their_own_random_state() -> None:
    start = torch.get_rng_state()
    expected = torch.rand(3)
    torch.set_rng_state(start)

    def body(rank: int, t: LockstepTransport) -> torch.Tensor:
        if rank == 0:
            torch.manual_seed(1234)  # a seed rank 0 sets moves no other rank's generator
            t.isend(torch.zeros(1), 1, 0)
            t.recv(torch.zeros(1), 1, 1)
            return torch.rand(3)
        t.recv(torch.zeros(1), 0, 0)
        drawn = torch.rand(3)
        t.isend(torch.zeros(1), 0, 1)
        return drawn

    mine, other = run_round_robin(2, body)
    assert torch.equal(torch.get_rng_state(), start)  # the caller's generator is left as it was
    torch.testing.assert_close(other, expected)  # the state every rank started from (a fork's)
    torch.manual_seed(1234)
    torch.testing.assert_close(mine, torch.rand(3))
    torch.set_rng_state(start)


def test_ranks_keep_their_own_warnings_state() -> None:
    """A rank inside `warnings.catch_warnings` while the turn moves: each rank records its own
    warnings, and the caller's filters are what they were (catch_warnings exits in any order)."""
    before = (warnings.filters, warnings.showwarning)

    def body(rank: int, t: LockstepTransport) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.warn(f"from rank {rank}", stacklevel=1)
            if rank == 0:
                t.recv(torch.zeros(1), 1, 0)  # rank 1 enters its own block meanwhile
            else:
                t.isend(torch.zeros(1), 0, 0)
            warnings.warn(f"again from rank {rank}", stacklevel=1)
        return [str(w.message) for w in caught]

    assert run_round_robin(2, body) == [
        ["from rank 0", "again from rank 0"],
        ["from rank 1", "again from rank 1"],
    ]
    assert (warnings.filters, warnings.showwarning) == before


def test_mismatched_messages_and_collectives_are_named_not_hung() -> None:
    def both_receive(rank: int, t: LockstepTransport) -> None:
        t.recv(torch.zeros(1), 1 - rank, 9)

    with pytest.raises(LockstepDeadlock, match=r"rank 0 waits for message 9 from rank 1; rank 1 waits for message 9"):
        run_round_robin(2, both_receive)

    def left_waiting(rank: int, t: LockstepTransport) -> None:
        if rank == 0:  # returns after its receive, without the send rank 1 then waits for
            t.recv(torch.zeros(1), 1, 0)
        else:
            t.isend(torch.zeros(1), 0, 0)
            t.recv(torch.zeros(1), 0, 4)

    with pytest.raises(LockstepDeadlock, match=r"rank 1 waits for message 4 from rank 0"):
        run_round_robin(2, left_waiting)

    def other_collectives(rank: int, t: LockstepTransport) -> None:
        x = torch.zeros(1)
        t.all_reduce(x) if rank == 0 else t.broadcast(x, 0)

    with pytest.raises(LockstepDeadlock, match="rank 1 calls broadcast from 0, another rank all_reduce sum"):
        run_round_robin(2, other_collectives)

    def wrong_shape(rank: int, t: LockstepTransport) -> None:
        if rank == 0:
            t.isend(torch.zeros(2), 1, 0)
        else:
            t.recv(torch.zeros(3), 0, 0)

    with pytest.raises(LockstepDeadlock, match=r"into torch.float32 \(3,\), sent as torch.float32 \(2,\)"):
        run_round_robin(2, wrong_shape)

    def one_fails(rank: int, t: LockstepTransport) -> None:
        if rank == 0:
            t.recv(torch.zeros(1), 1, 0)  # waits for a rank that raises instead of sending
        raise ValueError("rank 1's own error")

    with pytest.raises(ValueError, match="rank 1's own error"):
        run_round_robin(2, one_fails)


def test_the_runtime_steps_a_1f1b_schedule_over_the_transport_like_serial() -> None:
    """`run_step` itself, each rank a linear stage, over the in-process transport: the loss and
    both stages' gradients are autograd's on the whole chain."""
    torch.manual_seed(0)
    w = [torch.randn(4, 4), torch.randn(4, 1)]
    x = torch.randn(6, 4)
    schedule = schedule_by_name("1f1b", 2, 1, 3)
    spec = (TensorSpec((2, 4), torch.float32),)

    def body(rank: int, t: LockstepTransport) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        weight = w[rank].clone().requires_grad_(True)

        def forward(m: int, received: list[torch.Tensor]) -> list[torch.Tensor]:
            if rank == 0:
                return [torch.tanh(x[2 * m : 2 * m + 2] @ weight)]
            return [(received[0] @ weight).pow(2).sum()]

        stage = StageRunner(rank, forward, (weight,), lambda m: () if rank == 0 else spec, lambda m: spec if rank == 0 else ())
        result = run_step(schedule, rank, {rank: stage}, t, loss_scale=1.0)
        return result.loss, result.grads[rank][0]

    (_, g0), (loss, g1) = run_round_robin(2, body)
    whole = [v.clone().requires_grad_(True) for v in w]
    serial = (torch.tanh(x @ whole[0]) @ whole[1]).pow(2).sum()
    serial.backward()
    torch.testing.assert_close(loss, serial.detach())
    torch.testing.assert_close(g0, whole[0].grad)
    torch.testing.assert_close(g1, whole[1].grad)


def test_rank_0s_refusal_in_deciding_is_raised_on_every_rank() -> None:
    """As on gloo ranks (`decided_on_rank0`): a refusal rank 0 meets while deciding the pipeline
    (a module backward hook) is raised on every rank, so a test that expects it on each rank sees
    it there; before, rank 1 waited for the decision and the run ended in `LockstepDeadlock`."""

    def hooked(rank: int, world: int, transport: LockstepTransport | None = None) -> str:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        model[0].register_full_backward_hook(lambda m, gi, go: None)
        options = autopar.PipelineOptions(microbatches=2, schedule="gpipe", stage_boundaries=["2"])
        with pytest.raises(UsageError) as refused:
            pipelined(model, world, transport, example_inputs=(torch.randn(8, 8),), pipeline=options)
        return str(refused.value)

    for said in run_in_lockstep(2, hooked):
        assert "module 0 (Linear) has a backward hook" in said and "hint:" in said, said

    def fails(rank: int, t: LockstepTransport) -> str:
        try:
            t.hub.agree(rank, lambda: 1 // 0)
        except ZeroDivisionError as exc:
            return f"own {exc}"
        except AutoparError as exc:
            return str(exc)
        return "decided"

    assert run_round_robin(2, fails) == ["own integer division or modulo by zero",
                                         "rank 0 failed in deciding: ZeroDivisionError: integer division or modulo by zero"]
