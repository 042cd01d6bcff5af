"""Part of the trace stage: a mixed-precision policy (FSDP2's `MixedPrecisionPolicy`) traced
into the graph.

Parameters stay in their own dtype (float32 master weights, which the optimizer updates); every
read of a parameter in the forward reads a `param_dtype` copy, so every op that uses a weight
computes in that dtype and the weight's gradient comes back through the cast in the weight's own
dtype. The cast happens where the parameter is read, inside the module that reads it (a tied head
reading the embedding's weight casts it there), so repeated blocks keep identical graphs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.core.precision import MixedPrecision


def cast_parameters_on_read(model: nn.Module, dtype: torch.dtype) -> None:
    """Make every module of `model` (a structural copy the trace owns) return a `dtype` copy of a
    floating-point parameter whenever one is read as an attribute (`self.weight`)."""
    for module in model.modules():
        if module._parameters:
            module.__class__ = _casting_class(type(module), dtype)


def _casting_class(cls: type[nn.Module], dtype: torch.dtype) -> type[nn.Module]:
    def __getattr__(self: nn.Module, name: str) -> Any:  # only reached for parameters, buffers, modules
        value = nn.Module.__getattr__(self, name)
        if name in self._parameters and isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    # the same names as the user's class, so module types in dumps and errors read as theirs
    return type(cls.__name__, (cls,), {"__getattr__": __getattr__, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def cast_inputs(policy: MixedPrecision, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The forward's floating-point inputs in `param_dtype`, as FSDP2's `cast_forward_inputs`."""
    if not policy.cast_forward_inputs or policy.param_dtype is None:
        return args, kwargs
    return _cast_floats((args, kwargs), policy.param_dtype)  # type: ignore[no-any-return]


def cast_outputs(policy: MixedPrecision, outputs: Any) -> Any:
    """The forward's floating-point outputs in `output_dtype`, when the policy names one."""
    return outputs if policy.output_dtype is None else _cast_floats(outputs, policy.output_dtype)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda x: x.to(dtype) if x.is_floating_point() else x, tree)
