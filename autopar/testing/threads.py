"""Ranks as threads of one process, for runtime code that calls collectives (the all-to-all token
dispatcher, `autopar.rules.token_dispatch`): every rank's code runs at once, as processes would,
and each collective meets the other ranks at a barrier. The lockstep runner of the compiled
programs steps the ranks one op at a time in one thread, where a collective inside an op would
wait for ranks that never reach it: it runs such an op (`autopar::routed_experts`) on thread
ranks, one group of its axis at a time."""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autopar.core.errors import AutoparError
from autopar.rules import routed_experts
from autopar.rules.token_dispatch import axes_exchange


class ThreadGroup:
    """The meeting place of `size` thread ranks."""

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.board: list[Any] = [None] * size

    def exchange(self, rank: int) -> ThreadExchange:
        return ThreadExchange(self, rank)


class ThreadExchange:
    """`autopar.rules.token_dispatch.Exchange` among thread ranks: an all-to-all with split sizes,
    checked as a process group would (the sizes a rank expects must be the sizes sent to it)."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self._rank = rank

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self._rank

    def all_to_all(self, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int]) -> torch.Tensor:
        group = self.group
        if len(in_splits) != group.size or len(out_splits) != group.size or sum(in_splits) != x.shape[0]:
            raise AutoparError(
                f"all_to_all on rank {self._rank}: split sizes {list(in_splits)} / {list(out_splits)} "
                f"for {x.shape[0]} rows among {group.size} ranks",
                op="all_to_all_single",
                hint="one input and one output split size per rank, the input sizes summing to the rows",
            )
        group.board[self._rank] = list(x.split(list(in_splits)))
        group.barrier.wait()
        got = [group.board[s][self._rank] for s in range(group.size)]
        group.barrier.wait()  # nobody overwrites the board before everyone has read it
        sizes = [piece.shape[0] for piece in got]
        if sizes != list(out_splits):
            raise AutoparError(
                f"all_to_all on rank {self._rank} expected {list(out_splits)} rows from the ranks, got {sizes}",
                op="all_to_all_single",
                hint="exchange the counts before the rows",
            )
        return torch.cat(got).clone()


def run_threads(
    size: int, fn: Callable[[int, Any], Any], timeout: float = 60.0, grid: tuple[int, ...] | None = None
) -> list[Any]:
    """`fn(rank, exchange)` on `size` thread ranks at once; their results in rank order. An
    exception on one rank releases the others (their barriers break) and is raised here.

    `grid=(a, b, ...)`: the ranks are those of several mesh axes, numbered with the earlier axis
    outer (rank `i * b + j` of (a, b)), each exchanging through `token_dispatch.axes_exchange` of
    one thread group per axis (the ranks that differ only in that axis's coordinate), as
    processes do through the axes' process groups."""
    if grid is None or len(grid) == 1:
        groups = [ThreadGroup(size, timeout)]
        exchanges: list[Any] = [groups[0].exchange(r) for r in range(size)]
    else:
        coords = list(itertools.product(*(range(n) for n in grid)))
        # one group per axis and per setting of the other axes' coordinates
        by_axis = [
            {rest: ThreadGroup(n, timeout) for rest in {c[:a] + c[a + 1 :] for c in coords}}
            for a, n in enumerate(grid)
        ]
        groups = [g for axis in by_axis for g in axis.values()]
        exchanges = [
            axes_exchange([by_axis[a][c[:a] + c[a + 1 :]].exchange(c[a]) for a in range(len(grid))]) for c in coords
        ]
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, exchanges[rank])
        except BaseException as error:  # noqa: BLE001  (handed to the caller below)
            errors[rank] = error
            for group in groups:
                group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def run_routed_calls(calls: dict[tuple[int, ...], Sequence[Any]], mesh_shape: Sequence[int]) -> dict[tuple[int, ...], Any]:
    """Every rank's local call of an `autopar::routed_experts(_backward)` op (the arguments
    `routed_experts.localize` gives it, by mesh coordinates): where it exchanges tokens, the
    ranks of the groups of its axes (`routed_experts.exchange_axes`) run it at once
    as threads, through `ThreadExchange` or, over several axes, `token_dispatch.axes_exchange` of
    the axes' thread groups, as processes do through their process groups; elsewhere each rank
    alone."""
    axes = routed_experts.exchange_axes(next(iter(calls.values())))
    out: dict[tuple[int, ...], Any] = {}
    for c in calls:
        if c in out:
            continue
        group = [
            tuple(ix[axes.index(a)] if a in axes else x for a, x in enumerate(c))
            for ix in itertools.product(*(range(mesh_shape[a]) for a in axes))
        ]  # the exchange's ranks in its order: the earlier mesh axis outer
        grid = tuple(mesh_shape[a] for a in axes) if len(axes) > 1 else None
        ordered = [calls[g] for g in group]
        out.update(zip(group, run_threads(len(group), functools.partial(_routed_call, ordered), grid=grid)))
    return out


def _routed_call(calls: list[Sequence[Any]], rank: int, exchange: Any) -> Any:
    """One rank's local call (tensors, act, first_expert, then its encoded exchange) through
    `exchange`."""
    head, tensors = routed_experts.local_call_parts(calls[rank])
    if tensors == 6:  # the backward: the gradient first
        grad, x, ids, weights, gate_up, down, act, first = head
        return routed_experts.experts_backward(grad, x, ids, weights, gate_up, down, act, first, exchange)
    x, ids, weights, gate_up, down, act, first = head
    return routed_experts.experts_forward(x, ids, weights, gate_up, down, act, first, exchange)
