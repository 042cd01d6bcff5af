"""Custom `torch.autograd.Function`s met while tracing a model for training.

torch.export (non-strict, as the trace stage runs it) records the ATen ops of a Function's
forward and drops the Function itself, so the joint graph's backward would be the derivative of
that forward, not the Function's own backward: a straight-through estimator (round forward,
identity backward) would train with zero gradients, a gradient-reversal layer with the sign
flipped back. Rather than train differently from serial, the trace stage finds every Function on
the autograd graph of the traced forward and refuses the ones not known to compute their
forward's derivative.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable

import torch
import torch.fx as fx
from torch.autograd.function import BackwardCFunction

# Functions whose backward is the derivative of their forward, so tracing the forward loses
# nothing (tests/test_autograd_functions.py checks the transformers one numerically):
DERIVATIVE_PRESERVING = frozenset(
    {
        "transformers.models.bloom.modeling_bloom.GeLUFunction",  # tanh-GELU and its exact derivative
    }
)


# torch.library makes a Function for each custom op with register_autograd: export keeps the op
# whole and the joint graph uses its registered backward, so nothing is lost
CUSTOM_OP_FUNCTIONS = "torch._library."


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def custom_functions(outputs: Iterable[object]) -> list[type]:
    """The custom Function classes on the autograd graph behind `outputs`, first met first,
    without those in DERIVATIVE_PRESERVING."""
    found: list[type] = []
    seen: set[object] = set()
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        cls = getattr(node, "_forward_cls", None)
        if (
            isinstance(node, BackwardCFunction)
            and isinstance(cls, type)
            and not cls.__module__.startswith(CUSTOM_OP_FUNCTIONS)
            and qualified_name(cls) not in DERIVATIVE_PRESERVING
            and cls not in found
        ):
            found.append(cls)
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return found


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def definition_of(cls: type) -> str:
    """The "file:line" of the Function's forward, or its class name when the source is not at hand."""
    try:
        lines, first = inspect.getsourcelines(cls.forward)  # type: ignore[attr-defined]
        return f"{inspect.getsourcefile(cls.forward)}:{first}"  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return cls.__qualname__


def first_node_of(graph: fx.Graph, cls: type) -> fx.Node | None:
    """The first node of `graph` that the Function's forward produced (its stack trace passes
    through the forward's source lines), for the module path and call site of the error."""
    try:
        lines, first = inspect.getsourcelines(cls.forward)  # type: ignore[attr-defined]
        path = inspect.getsourcefile(cls.forward)  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return None
    span = range(first, first + len(lines))
    for node in graph.nodes:
        for file, line, _ in _FRAME.findall(node.meta.get("stack_trace") or ""):
            if file == path and int(line) in span:
                return node
    return None
