"""autopar: compile an unmodified PyTorch model into a 3-D tensor-parallel distributed module."""

import importlib
from typing import TYPE_CHECKING

from autopar.core.errors import (
    AutoparError,
    CheckpointError,
    ForwardHookWarning,
    IndexOutOfRangeError,
    InitError,
    InputMismatchError,
    InternalError,
    MemoryLimitError,
    MeshError,
    MissingRuleError,
    ModelAssertionError,
    ModelValueError,
    OriginalModelWarning,
    PipelineClipWarning,
    RankFailureError,
    ShardingError,
    TraceError,
)
from autopar.core.layout import Layout, Partial, Replicate, Shard
from autopar.core.mesh import Mesh

if TYPE_CHECKING:
    from autopar.api import load_checkpoint, parallelize, plan, save_checkpoint
    from autopar.compiler.driver import compile_for_rank
    from autopar.compiler.pricing import PlanResult
    from autopar.options import DebugOptions, PipelineOptions, PlanOptions
    from autopar.runtime.checkpoint import LoadResult

__all__ = [
    "AutoparError",
    "CheckpointError",
    "InitError",
    "IndexOutOfRangeError",
    "InputMismatchError",
    "InternalError",
    "Layout",
    "MemoryLimitError",
    "Mesh",
    "MeshError",
    "ForwardHookWarning",
    "OriginalModelWarning",
    "PipelineClipWarning",
    "MissingRuleError",
    "ModelAssertionError",
    "ModelValueError",
    "Partial",
    "RankFailureError",
    "Replicate",
    "Shard",
    "ShardingError",
    "TraceError",
    "PlanResult",
    "LoadResult",
    "PlanOptions",
    "PipelineOptions",
    "DebugOptions",
    "compile_for_rank",
    "load_checkpoint",
    "parallelize",
    "plan",
    "save_checkpoint",
]

# The compiler (torch.distributed, the stages, the planners) loads on first use of these names, so
# that `import autopar` and the vocabulary stay cheap for rule authors and property tests.
_LOADED_ON_USE = {
    "parallelize": "autopar.api",
    "plan": "autopar.api",
    "compile_for_rank": "autopar.compiler.driver",
    "PlanResult": "autopar.compiler.pricing",
    "PlanOptions": "autopar.options",
    "PipelineOptions": "autopar.options",
    "DebugOptions": "autopar.options",
    "load_checkpoint": "autopar.api",
    "save_checkpoint": "autopar.api",
    "LoadResult": "autopar.runtime.checkpoint",
}


def __getattr__(name: str) -> object:
    module = _LOADED_ON_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
