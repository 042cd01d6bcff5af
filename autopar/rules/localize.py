"""Turning a global op call into the call one rank runs on its local pieces."""

from __future__ import annotations

from typing import Any

import torch

from autopar.rules.base import LocalCall, LocalContext

# Schema argument names that carry a tensor's (global) shape.
_SIZE_ARGS = ("size",)


def localize_sizes(ctx: LocalContext) -> LocalCall:
    """Replace shape arguments (view/expand/new_zeros/...) by the first output's local shape."""
    op = ctx.call.op
    schema = getattr(op, "_schema", None)
    args = list(ctx.args)
    kwargs = dict(ctx.kwargs)
    if schema is None or not ctx.strategy.outputs:
        return LocalCall(op, tuple(args), kwargs)
    local = list(ctx.strategy.outputs[0].local_shape(ctx.mesh_shape, ctx.coords))
    for index, argument in enumerate(schema.arguments):
        if argument.name not in _SIZE_ARGS or not isinstance(argument.type, torch.ListType):
            continue
        value: Any
        if index < len(args):
            value = args[index]
            if isinstance(value, (list, tuple)) and len(value) == len(local):
                args[index] = local
        elif argument.name in kwargs:
            value = kwargs[argument.name]
            if isinstance(value, (list, tuple)) and len(value) == len(local):
                kwargs[argument.name] = local
    return LocalCall(op, tuple(args), kwargs)
