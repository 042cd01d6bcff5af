"""Decisions made once on rank 0 and broadcast, so that every rank runs the identical plan.

A failure travels with the broadcast: a rank whose decision raised never leaves the others waiting
in a collective; every rank raises the same error instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from autopar.core.errors import AutoparError

T = TypeVar("T")


def decided_on_rank0(decide: Callable[[], T], what: str) -> T:
    """`decide()` on rank 0, its result (or its error) on every rank."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("value", decide())
        except Exception as exc:  # every rank must hear about it, whatever it is
            error = (
                exc if isinstance(exc, AutoparError) else AutoparError(f"{what} failed on rank 0: {exc!r}")
            )
            payload[0] = ("error", error)
    dist.broadcast_object_list(payload, src=0)
    kind, value = payload[0]
    if kind == "error":
        raise value
    return value  # type: ignore[no-any-return]
