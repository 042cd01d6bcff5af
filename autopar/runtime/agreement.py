"""Decisions made once on rank 0 and broadcast, so that every rank runs the identical plan.

A failure travels with the broadcast: a rank whose decision raised never leaves the others waiting
in a collective; every rank raises the same error instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from autopar.core.errors import AutoparError, InternalError, RankFailureError

T = TypeVar("T")


def decided_on_rank0(decide: Callable[[], T], what: str, group: dist.ProcessGroup | None = None) -> T:
    """`decide()` on rank 0 of `group` (default: all ranks), its result (or its error) on every
    rank of the group. An AutoparError (a plan that cannot fit, an op without a rule) is raised
    alike on every rank; any other failure of rank 0 (an InternalError too) is rank 0's own,
    raised there with its traceback, and a `RankFailureError` naming rank 0 and the error on the
    others."""
    payload: list[Any] = [None]
    own: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            payload[0] = ("value", decide())
        except Exception as exc:  # every rank must hear about it, whatever it is
            own = exc
            same_everywhere = isinstance(exc, AutoparError) and not isinstance(exc, InternalError)
            payload[0] = ("error", exc if same_everywhere else f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(payload, group=group, group_src=0)
    kind, value = payload[0]
    if kind == "value":
        return value  # type: ignore[no-any-return]
    if isinstance(value, AutoparError):
        raise value
    if own is not None:
        if isinstance(own, AutoparError):
            raise own
        raise AutoparError(f"{what} failed on rank 0: {value}") from own
    raise RankFailureError(
        f"rank 0 failed in {what}, inside parallelize: {value}",
        hint="the error and its traceback are in rank 0's log",
    )


Fingerprint = tuple[float, float, float, float]


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """Four numbers that differ between tensors made from different seeds or data: the sum, the
    sum of magnitudes, and the first and last element (float64; one pass, no copy of the tensor)."""
    if tensor.numel() == 0:
        return (0.0, 0.0, 0.0, 0.0)
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return (
        float(flat.sum(dtype=torch.float64)),
        float(flat.abs().sum(dtype=torch.float64)),
        float(flat[0]),
        float(flat[-1]),
    )


def first_disagreement(
    named: Sequence[tuple[str, torch.Tensor | Fingerprint]], group: dist.ProcessGroup | None = None
) -> tuple[str, int] | None:
    """The first of `named` (tensors, or their fingerprints) whose value differs between ranks,
    and a rank that differs from rank 0; None when all agree. Every rank gets the same answer.

    One all-reduce of the fingerprints (the largest of each number and of its negation: all ranks
    agree exactly when both give the same value) decides; only when some differ does an
    all-gather find which and where."""
    mine = [fingerprint(t) if isinstance(t, torch.Tensor) else t for _, t in named]
    if _all_agree(mine, group):
        return None
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for index, (name, _) in enumerate(named):
        for rank, theirs in enumerate(everyone):
            if not _same(theirs[index], everyone[0][index]):
                return name, rank
    return None


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where autopar's own small check tensors must be for a collective on `group`: NCCL moves
    only CUDA tensors; gloo and mixed backends take CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_agree(prints: Sequence[Fingerprint], group: dist.ProcessGroup | None) -> bool:
    values = torch.tensor(prints, dtype=torch.float64, device=collective_device(group)).reshape(-1)
    nan = torch.isnan(values)
    numbers = torch.where(nan, 0.0, values)  # NaN equals NaN here, as in `_same`
    both = torch.cat([numbers, -numbers, nan.double(), -nan.double()])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    largest, smallest = both[: 2 * len(values)].chunk(2), both[2 * len(values) :].chunk(2)
    return bool(torch.equal(largest[0], -largest[1]) and torch.equal(smallest[0], -smallest[1]))


def _same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return all(x == y or (x != x and y != y) for x, y in zip(a, b))  # NaN equals NaN here
