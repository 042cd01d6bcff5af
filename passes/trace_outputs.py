"""The forward the trace exports (`autopar.passes.trace`): the model's own forward, then the
model's own forward hooks, its output cut down to its tensors, flat."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.core.meta import PLAIN_OUTPUT_TYPES, OutputStructure
from autopar.core.precision import AutocastState, MixedPrecision, autocast_as
from autopar.passes.autograd_functions import custom_functions
from autopar.passes.hooks import take_root_forward_hooks
from autopar.passes.mixed_precision import cast_inputs, cast_outputs


@dataclass
class OutputRecord:
    structure: OutputStructure | None = None
    functions: list[type] = field(default_factory=list)  # custom autograd.Functions in the forward


def tensor_outputs(
    model: nn.Module, record: OutputRecord, autocast: AutocastState = (), mixed_precision: MixedPrecision | None = None
) -> Any:
    """`model`'s forward returning only the tensors of its output, flat; `record` keeps how to
    rebuild the rest (`OutputStructure`). torch.export then traces any output (a transformers
    `ModelOutput` with a cache object, a dict with flags) and the program returns just the tensors.
    The forward runs in the `autocast` regions of the call being compiled. The model's own forward
    hooks are taken off it and run here, on the forward's output as in serial
    (`take_root_forward_hooks`): left on the module, they would be handed the flat tuple."""
    forward, root_hooks = model.forward, take_root_forward_hooks(model)[0]

    @functools.wraps(forward)
    def tensors_only(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        if mixed_precision is not None:
            args, kwargs = cast_inputs(mixed_precision, args, kwargs)
        with autocast_as(autocast):
            result = root_hooks(args, kwargs, forward(*args, **kwargs))
        if mixed_precision is not None:
            result = cast_outputs(mixed_precision, result)
        leaves, spec = pytree.tree_flatten(result)
        positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        others = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        dropped = []
        for i, leaf in enumerate(others):
            if leaf is not None and not isinstance(leaf, PLAIN_OUTPUT_TYPES):
                dropped.append(type(leaf).__name__)
                others[i] = None
        record.structure = OutputStructure(spec, positions, tuple(others), tuple(dropped))
        record.functions = custom_functions(leaves[i] for i in positions)
        return tuple(leaves[i] for i in positions)

    return tensors_only
