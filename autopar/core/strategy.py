"""What a rule sees of one op call and what it answers: the types every layer shares.

`OpCall` is an op call with tensors replaced by their global specs; a rule answers per mesh axis
with `AxisStrategy`s, expanded to whole-mesh `Strategy`s (`autopar.rules.base.expand`). They sit in
the vocabulary because node metadata, the planners and the cost model all carry strategies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.core.layout import Layout, Placement


@dataclass(frozen=True)
class TensorSpec:
    """Global shape and dtype of a tensor argument or result."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class OpCall:
    """One call of an op with tensors replaced by their specs: what a rule looks at."""

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # an op that runs code of the model (a custom autograd.Function): what the trace recorded for
    # this node (`NodeInfo.traced`); None for every op with a fixed kernel
    traced: TracedKernel | None = None
    # per tensor input, whether it is a parameter or a view or cast of one (`rules.calls.op_call`;
    # empty where unknown): where the value came from, not what the op computes, so it is left out
    # of equality; a requirement that keeps weights whole on an axis (pure Ulysses) reads it
    weights: tuple[bool, ...] = field(default=(), compare=False)

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Argument by position or keyword, falling back to the schema default."""
        if index < len(self.args):
            return self.args[index]
        if name in self.kwargs:
            return self.kwargs[name]
        schema = getattr(self.op, "_schema", None)
        if schema is not None:
            for a in schema.arguments:
                if a.name == name and a.has_default_value():
                    return a.default_value
        return default


@dataclass(frozen=True)
class AxisStrategy:
    """Placements on one mesh axis: one per tensor input, one per tensor output."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]


@dataclass(frozen=True, eq=False)
class TracedKernel:
    """What one trace recorded for an op whose kernel is code of the model (one custom
    autograd.Function application): the splits per mesh axis it verified for that code, and the
    callable a rank runs in place of the op (same arguments). It travels on the node, so the op's
    rule and its localization read this trace's record, never a registry of the process."""

    strategies: tuple[AxisStrategy, ...]
    kernel: Callable[..., Any]


@dataclass(frozen=True)
class Strategy:
    """Full layouts for one op call on the whole mesh."""

    inputs: tuple[Layout, ...]
    outputs: tuple[Layout, ...]

    def __str__(self) -> str:
        ins = ", ".join(lay.per_axis_str() for lay in self.inputs)
        outs = ", ".join(lay.per_axis_str() for lay in self.outputs)
        return f"({ins}) -> ({outs})"
