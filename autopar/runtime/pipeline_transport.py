"""How a pipeline's ranks talk: the messages between stages and the few collectives over the pp
group (the step's loss, tied weights' gradients, a norm, outputs), behind one small interface.

`ProcessGroupTransport`, over a torch.distributed process group, is what every user's pipeline
runs on. The interface exists so that the same runtime can run every rank of a pipeline in one
process, round-robin (`autopar.testing.pipeline_lockstep`): the test suite checks a pipeline
against serial without forking gloo ranks, and the runtime it checks is the one users run.

Ranks are pipeline ranks (0 .. size-1 on the pp group), never global ones: the transport maps them.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.distributed as dist

ReduceKind = Literal["sum", "max"]


class Pending(Protocol):
    """A send in flight: `wait()` returns once its buffer may be reused."""

    def wait(self) -> object: ...


class PipelineTransport(Protocol):
    """Point-to-point messages tagged by the runtime (`pipeline_runtime.message_tag`) and
    collectives over the pipeline's ranks. A receive may be posted before or after its send; a
    tag names one message between two ranks within a step."""

    @property
    def rank(self) -> int:
        """This rank's pipeline rank."""
        ...

    @property
    def size(self) -> int:
        """The number of pipeline ranks."""
        ...

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending | None:
        """Start sending `tensor` (kept unchanged until the returned send is waited; None: done)."""
        ...

    def recv(self, buf: torch.Tensor, peer: int, tag: int) -> None:
        """Receive the message `tag` from `peer` into `buf`; returns once it is there."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """`tensor` on every rank becomes rank `src`'s (in place)."""
        ...

    def all_reduce(self, tensor: torch.Tensor, op: ReduceKind = "sum") -> None:
        """`tensor` on every rank becomes the sum (or max) over the ranks (in place)."""
        ...


class ProcessGroupTransport:
    """`PipelineTransport` over a torch.distributed process group (gloo, NCCL): what
    `parallelize` runs. `group=None`: messages on the default group, with pipeline rank r its
    global rank r, and no collectives (a caller without a pp group runs one pipeline rank's sums
    alone, as the runtime always did)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._size = dist.get_world_size(group) if group is not None else 1
        self._global: dict[int, int] = {}

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    @property
    def size(self) -> int:
        return self._size

    def _peer(self, rank: int) -> int:
        if self.group is None:
            return rank
        if rank not in self._global:
            self._global[rank] = dist.get_global_rank(self.group, rank)
        return self._global[rank]

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending | None:
        work: Pending | None = dist.isend(tensor, self._peer(peer), group=self.group, tag=tag)
        return work

    def recv(self, buf: torch.Tensor, peer: int, tag: int) -> None:
        work = dist.irecv(buf, self._peer(peer), group=self.group, tag=tag)
        if work is not None:
            work.wait()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self._size > 1:
            dist.broadcast(tensor, src=self._peer(src), group=self.group)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceKind = "sum") -> None:
        if self._size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)


def as_transport(comm: PipelineTransport | dist.ProcessGroup | None) -> PipelineTransport:
    """A transport for what a caller passed: one as it is, a process group (or None) wrapped."""
    if comm is None or isinstance(comm, dist.ProcessGroup):
        return ProcessGroupTransport(comm)
    return comm
