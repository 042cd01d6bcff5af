"""Every rank of a pipeline in one process, round-robin: the test suite's way to check a pipelined
model against serial without forking gloo ranks (docs/pipeline.md#testing-in-one-process).

Each rank's code (build the pipelined model, train it beside serial) runs in a thread of its own,
but only one thread runs at a time: a rank runs until it waits for another (a message not yet
sent, a collective not yet joined by every rank), and then the next rank in rank order that can
go on runs. The ranks talk through `LockstepTransport`, the in-process `PipelineTransport`: a
send is a tensor left in a mailbox under (sender, receiver, tag), a receive takes the oldest, and a
collective meets when every rank has joined it. The runtime is the users' (`pipeline_runtime`,
`PipelinedModule`); only the transport differs.

What one process cannot stand in for, and stays on gloo ranks: stages compiled on tensor
sub-meshes (tensor axes beside "pp", zero-bubble's and compile=True's per-stage modules), whose
collectives run on process groups; and what only processes show (a rank that dies, timeouts).

Each rank keeps its own CPU random state and its own warnings state (filters, where warnings
go), saved and restored as the turn moves, as a process would: a seed one rank sets, a dropout
mask it draws, or a `warnings.catch_warnings` it is inside never touches another rank's.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from autopar.compiler.pipeline import PipelinedModule
from autopar.compiler.pipeline_choice import PipelineDecision, decide_pipeline
from autopar.compiler.pipeline_entry import pipeline_parallelize
from autopar.core.errors import AutoparError, InternalError, UsageError
from autopar.options import PipelineOptions, default_tables
from autopar.planning.memory import MEMORY_HEADROOM
from autopar.runtime.device_memory import rank_memory
from autopar.runtime.pipeline_transport import Pending, ReduceKind

T = TypeVar("T")


class LockstepDeadlock(AutoparError):
    """Every rank still running waits for another: the programs' messages or collectives do not
    match (what each rank waits for is in the message)."""


class LockstepAborted(AutoparError):
    """This rank was stopped because another rank failed (its error is the one raised)."""


@dataclass
class _Collective:
    kind: str
    parts: dict[int, torch.Tensor] = field(default_factory=dict)
    read: set[int] = field(default_factory=set)


@dataclass
class _RankState:
    """What a process would hold apart from the others: its generator and its warnings state."""

    rng: torch.Tensor
    filters: list[Any]
    showwarning: Any
    showwarnmsg: Any

    @staticmethod
    def now() -> _RankState:
        impl = warnings._showwarnmsg_impl  # type: ignore[attr-defined]  # what catch_warnings(record=True) swaps
        return _RankState(torch.get_rng_state(), warnings.filters, warnings.showwarning, impl)  # type: ignore[arg-type]  # the list itself

    def restore(self) -> None:
        torch.set_rng_state(self.rng)
        warnings.filters = self.filters  # type: ignore[misc]
        warnings.showwarning = self.showwarning
        warnings._showwarnmsg_impl = self.showwarnmsg  # type: ignore[attr-defined]
        warnings._filters_mutated()  # type: ignore[attr-defined]


class RoundRobin:
    """The turn among `size` thread ranks, the mailbox and the collectives they share."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._turn = 0
        self._live = set(range(size))
        self._waiting: dict[int, str] = {}  # rank -> what it waits for, since the last progress
        self.failed: BaseException | None = None
        start = _RankState.now()  # every rank starts from the caller's state, as forked processes do
        self._state = [_RankState(start.rng, list(start.filters), start.showwarning, start.showwarnmsg) for _ in range(size)]
        # messages sent and not yet received, by (sender, receiver, tag), oldest first (as gloo
        # matches sends with one tag to receives in order)
        self.mailbox: dict[tuple[int, int, int], deque[torch.Tensor]] = {}
        self._collectives: dict[int, _Collective] = {}
        self._joined = [0] * size  # collectives each rank has joined
        self._agreed: dict[int, Any] = {}
        self._agreements = [0] * size

    # -- the turn ------------------------------------------------------------------------------

    def _hand_on(self, rank: int) -> None:
        """Give the turn to the next live rank after `rank` and wait (lock held) until it is back."""
        self._state[rank] = _RankState.now()
        order = [(rank + k) % self.size for k in range(1, self.size + 1)]
        self._turn = next(r for r in order if r in self._live)
        self._cond.notify_all()
        self._cond.wait_for(lambda: self._turn == rank or self.failed is not None)
        self._check(rank)
        self._state[rank].restore()

    def _check(self, rank: int) -> None:
        if self.failed is not None:
            raise LockstepAborted(f"rank {rank} stopped: another rank failed ({type(self.failed).__name__})")

    def begin(self, rank: int) -> None:
        """Wait for `rank`'s first turn."""
        with self._cond:
            self._cond.wait_for(lambda: self._turn == rank or self.failed is not None)
            self._check(rank)
            self._state[rank].restore()

    def end(self, rank: int, error: BaseException | None) -> None:
        """`rank` returned (or raised `error`): the turn goes on without it."""
        with self._cond:
            self._live.discard(rank)
            self._waiting.pop(rank, None)
            if error is not None and self.failed is None:
                self.failed = error
            if self._live and self.failed is None:
                order = [(rank + k) % self.size for k in range(1, self.size + 1)]
                self._turn = next(r for r in order if r in self._live)
                if set(self._waiting) >= self._live:  # the rest wait for what nobody left can give
                    self.failed = self._deadlock()
            self._cond.notify_all()

    def wait_until(self, rank: int, ready: Callable[[], bool], what: str) -> None:
        """Hand the turn on until `ready()`; every live rank waiting with no progress between is a
        deadlock, raised on every rank."""
        with self._cond:
            while not ready():
                self._waiting[rank] = what
                if set(self._waiting) >= self._live:
                    self.failed = self._deadlock()
                    self._cond.notify_all()
                    raise self.failed
                self._hand_on(rank)
            self._waiting.pop(rank, None)

    def progress(self) -> None:
        """Something another rank may wait for happened (a send, a collective joined)."""
        with self._cond:
            self._waiting.clear()

    def _deadlock(self) -> LockstepDeadlock:
        waits = "; ".join(f"rank {r} waits for {w}" for r, w in sorted(self._waiting.items()))
        return LockstepDeadlock(
            f"every rank still running waits for another: {waits}",
            hint="the ranks' programs send, receive or reduce in orders that do not match",
        )

    # -- what ranks exchange --------------------------------------------------------------------

    def collective(self, rank: int, kind: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Join this rank's next collective with `tensor`; every rank's part, in rank order."""
        k = self._joined[rank]
        self._joined[rank] += 1
        with self._cond:
            slot = self._collectives.setdefault(k, _Collective(kind))
            if slot.kind != kind:
                raise LockstepDeadlock(
                    f"collective {k}: rank {rank} calls {kind}, another rank {slot.kind}",
                    hint="every rank must call the pp group's collectives in one order",
                )
            slot.parts[rank] = tensor.detach().clone()
        self.progress()
        self.wait_until(rank, lambda: len(slot.parts) == self.size, f"the other ranks in {kind} {k}")
        parts = [slot.parts[r] for r in range(self.size)]
        with self._cond:
            slot.read.add(rank)
            if len(slot.read) == self.size:
                del self._collectives[k]
        return parts

    def agree(self, rank: int, decide: Callable[[], T]) -> T:
        """`decide()` on rank 0, its result on every rank (`decided_on_rank0` in one process). Its
        error too, as on gloo ranks: an `AutoparError` (a refusal) is raised alike on every rank,
        another error is rank 0's own and an `AutoparError` naming it on the others. (Before, the
        others waited for a decision that never came: a refusal rank 0's caller caught, as a test
        of the refusal does on every rank, showed as `LockstepDeadlock` on rank 1.)"""
        k = self._agreements[rank]
        self._agreements[rank] += 1
        if rank == 0:
            try:
                self._agreed[k] = decide()
            except Exception as exc:
                self._agreed[k] = _Refused(exc)
                raise
            finally:
                self.progress()
        else:
            self.wait_until(rank, lambda: k in self._agreed, f"rank 0's decision {k}")
        found = self._agreed[k]
        if isinstance(found, _Refused):
            raise found.on_other_rank()
        return found  # type: ignore[no-any-return]


@dataclass
class _Refused:
    """Rank 0's error in deciding, for the other ranks of an agreement."""

    error: Exception

    def on_other_rank(self) -> AutoparError:
        if isinstance(self.error, AutoparError) and not isinstance(self.error, InternalError):
            return copy.copy(self.error)  # each rank's own exception object (its own traceback)
        return AutoparError(f"rank 0 failed in deciding: {type(self.error).__name__}: {self.error}")


class LockstepTransport:
    """`PipelineTransport` among the thread ranks of one `RoundRobin`."""

    def __init__(self, hub: RoundRobin, rank: int) -> None:
        self.hub = hub
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.hub.size

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending | None:
        self.hub.mailbox.setdefault((self._rank, peer, tag), deque()).append(tensor.detach().clone())
        self.hub.progress()
        return None

    def recv(self, buf: torch.Tensor, peer: int, tag: int) -> None:
        key = (peer, self._rank, tag)
        mailbox = self.hub.mailbox
        self.hub.wait_until(self._rank, lambda: bool(mailbox.get(key)), f"message {tag} from rank {peer}")
        got = mailbox[key].popleft()
        if got.shape != buf.shape or got.dtype != buf.dtype:
            raise LockstepDeadlock(
                f"rank {self._rank} receives message {tag} from rank {peer} into {buf.dtype} {tuple(buf.shape)}, "
                f"sent as {got.dtype} {tuple(got.shape)}",
                hint="both ends of a message must agree on its shape (the stages' boundary specs)",
            )
        buf.copy_(got)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        parts = self.hub.collective(self._rank, f"broadcast from {src}", tensor)
        tensor.copy_(parts[src])

    def all_reduce(self, tensor: torch.Tensor, op: ReduceKind = "sum") -> None:
        parts = self.hub.collective(self._rank, f"all_reduce {op}", tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total = torch.maximum(total, part) if op == "max" else total + part
        tensor.copy_(total)


def run_round_robin(size: int, fn: Callable[[int, LockstepTransport], T], timeout: float = 600.0) -> list[T]:
    """`fn(rank, transport)` for every rank of a `size`-rank pipeline, in one process, one rank at
    a time (the module docstring); their results in rank order. The first rank's error is raised
    (a `LockstepDeadlock` names what each rank waited for)."""
    hub = RoundRobin(size)
    results: list[Any] = [None] * size
    state = _RankState.now()

    def body(rank: int) -> None:
        error: BaseException | None = None
        try:
            hub.begin(rank)
            results[rank] = fn(rank, LockstepTransport(hub, rank))
        except BaseException as exc:  # noqa: BLE001  (handed to the caller below)
            error = exc
        hub.end(rank, error)

    threads = [threading.Thread(target=body, args=(r,), name=f"lockstep-rank{r}", daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    state.restore()
    if any(t.is_alive() for t in threads):
        raise LockstepDeadlock(f"the ranks did not finish within {timeout} s", hint="a rank loops or hangs")
    if hub.failed is not None:  # the first failure: a rank's own error, or the deadlock that stopped them
        raise hub.failed
    return results


def parallelize_in_lockstep(
    model: nn.Module,
    transport: LockstepTransport,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    pipeline: PipelineOptions,
) -> PipelinedModule:
    """`autopar.parallelize(model, mesh, example_inputs, example_kwargs, pipeline=pipeline)` on a
    1-D ("pp",) CPU mesh of `transport.size` ranks, for the rank of `transport`, at parallelize's
    defaults (the cost model's hardware table and memory limit for a CPU rank): rank 0 decides the
    schedule and cut, every rank builds its stages. Refuses what one process cannot run (stages
    compiled on process groups: zero-bubble)."""
    hub, rank, pp = transport.hub, transport.rank, transport.size
    microbatches = pipeline.microbatches
    if microbatches is None:
        raise UsageError("a pipeline needs microbatches=", hint="PipelineOptions(microbatches=...)")
    name = "1f1b" if pipeline.schedule is None else pipeline.schedule
    hardware, _ = default_tables(None, "cpu")
    memory = rank_memory("cpu", pp)
    limit = None if memory is None else MEMORY_HEADROOM * memory
    seeded = torch.random.get_rng_state()
    boundaries, v = pipeline.stage_boundaries, pipeline.virtual_stages

    def decide() -> PipelineDecision:
        return decide_pipeline(
            model, tuple(example_inputs), pp=pp, microbatches=microbatches, schedule=name, virtual_stages=v,
            hardware=hardware, stage_boundaries=boundaries, memory_limit=limit, example_kwargs=example_kwargs,
        )  # fmt: skip

    decision = hub.agree(rank, decide)
    if decision.schedule.split_backward:
        raise UsageError(
            f"the {decision.schedule.name!r} schedule runs each stage as a module compiled on a process group",
            hint="run this case on gloo ranks (tests/multirank.py)",
        )
    pmodel = pipeline_parallelize(
        model, None, tuple(example_inputs), microbatches=microbatches, schedule=name, stage_boundaries=boundaries,
        virtual_stages=v, hardware=hardware, decision=decision, example_kwargs=example_kwargs, seeded=seeded,
        transport=transport,
    )  # fmt: skip
    pmodel.schedule_named = pipeline.schedule not in (None, "auto")
    return pmodel
