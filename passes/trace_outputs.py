"""The forward the trace exports (`autopar.passes.trace`): the model's own forward, then the
model's own forward hooks, its output cut down to its tensors, flat."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.core.errors import TraceError
from autopar.core.meta import PLAIN_OUTPUT_TYPES, OutputStructure
from autopar.core.precision import AutocastState, MixedPrecision, autocast_as
from autopar.passes.autograd_functions import custom_functions
from autopar.passes.hooks import take_root_forward_hooks
from autopar.passes.mixed_precision import cast_inputs, cast_outputs


@dataclass
class OutputRecord:
    structure: OutputStructure | None = None
    functions: list[type] = field(default_factory=list)  # custom autograd.Functions in the forward
    hidden: list[str] = field(default_factory=list)  # output objects holding tensors (`hidden_tensors`)


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
        dropped, dropped_leaves = [], []
        for i, leaf in enumerate(others):
            if leaf is not None and not isinstance(leaf, PLAIN_OUTPUT_TYPES):
                dropped.append(type(leaf).__name__)
                dropped_leaves.append(leaf)
                others[i] = None
        record.structure = OutputStructure(spec, positions, tuple(others), tuple(dropped))
        record.functions = custom_functions(leaves[i] for i in positions)
        record.hidden = hidden_tensors(dropped_leaves, bool(positions))
        return tuple(leaves[i] for i in positions)

    return tensors_only


def hidden_tensors(dropped: list[Any], any_tensor: bool) -> list[str]:
    """The types of output objects that hold the model's results where autopar cannot see them:
    a dataclass with tensor fields that is no pytree node (a user's own `Out(loss, logits)`), or,
    when the output has no tensor autopar can see at all, every object in it. The parallel module
    would return None in their place (as it does for a transformers `Cache`, state for generation
    beside the logits), and a training call would have no loss to run backward from."""
    hidden = []
    for leaf in dropped:
        if not any_tensor:
            hidden.append(type(leaf).__qualname__)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            values = [getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)]
            if any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(values)):
                hidden.append(type(leaf).__qualname__)
    return hidden


def hidden_tensors_error(model: nn.Module, hidden: list[str]) -> TraceError:
    """The refusal of an output whose results autopar cannot see (`hidden_tensors`)."""
    forward = type(model).forward
    where = None
    with contextlib.suppress(OSError, TypeError):
        where = f"{inspect.getsourcefile(forward)}:{inspect.getsourcelines(forward)[1]} in forward"
    return TraceError(
        f"{type(model).__name__}'s forward returns {' and '.join(dict.fromkeys(hidden))}, an object "
        "holding its tensors that is not a pytree container (torch.utils._pytree): autopar sees no "
        "tensor in it, so the parallel module would return None in its place",
        op=f"return {hidden[0]}",
        where=where,
        hint=f"register the class before parallelize: torch.export.register_dataclass({hidden[0]}) "
        "for a dataclass (torch.utils._pytree.register_pytree_node for another class), and the "
        "parallel module returns it as the model does; or return a dict, a tuple or a NamedTuple",
    )
