"""autopar: compile an unmodified PyTorch model into a 3-D tensor-parallel distributed module."""

from typing import TYPE_CHECKING

from autopar.errors import (
    AutoparError,
    InputMismatchError,
    MemoryLimitError,
    MeshError,
    MissingRuleError,
    ShardingError,
    TraceError,
)
from autopar.layout import Layout, Partial, Replicate, Shard
from autopar.mesh import Mesh

if TYPE_CHECKING:
    from autopar.api import compile_for_rank, parallelize
    from autopar.planning import PlanResult, plan

__all__ = [
    "AutoparError",
    "InputMismatchError",
    "Layout",
    "MemoryLimitError",
    "Mesh",
    "MeshError",
    "MissingRuleError",
    "Partial",
    "Replicate",
    "Shard",
    "ShardingError",
    "TraceError",
    "PlanResult",
    "compile_for_rank",
    "parallelize",
    "plan",
]


def __getattr__(name: str) -> object:
    # The pipeline imports torch.distributed and the passes; load it on first use only.
    if name in ("parallelize", "compile_for_rank"):
        from autopar import api

        return getattr(api, name)
    if name in ("plan", "PlanResult"):
        from autopar import planning

        return getattr(planning, name)
    raise AttributeError(name)
