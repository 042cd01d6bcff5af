"""A custom `torch.autograd.Function` as ONE op of the joint graph, so training uses its own backward.

torch.export records the ATen ops of a Function's forward and drops the Function: the joint
graph's backward would be the derivative of that forward, not the Function's backward (a
straight-through estimator would train with zero gradients, RecurrentGemma's clipped square root
with an unbounded one). While tracing for training, each application of such a Function is made
one opaque op (`autopar.passes.autograd_functions` swaps `Function.apply` for the trace):

    autopar::autograd_function(inputs: Tensor[], key: str) -> Tensor[]
    autopar::autograd_function_backward(inputs: Tensor[], grads: Tensor[], key: str) -> Tensor[]

`key` names a `FunctionEntry` of the trace's `FunctionTable`: the Function class, the non-tensor
arguments of the application (plain data only) and which tensor arguments get a gradient. The
forward op runs the Function's forward; the backward op runs the forward again on the saved
inputs, to rebuild the context its backward reads (`ctx.saved_tensors`, attributes), then the
Function's backward: nothing of the Function's inner values crosses between the two ops, at the
price of computing its forward twice.

The table belongs to one trace. While the trace runs, the ops' kernels (which receive only the key
string) find it through `tracing_functions`; after it, each op node carries its entry's verified
splits and a kernel bound to the entry (`NodeInfo.traced`, read by the rule through
`OpCall.traced`), and emit makes each rank's program call that kernel. No registry outlives the
trace, and two traces of the same Function never share an entry.

Per mesh axis each op offers the all-replicated strategy (every rank runs the Function on the
whole tensors, as serial does) and the splits the trace verified for this Function
(`TracedKernel.strategies`, from `FunctionEntry.forward_strategies` / `backward_strategies`): the trace runs the Function's
forward and backward through `make_fx` and propagates a candidate split through autopar's own
rules for the ops they are made of, so a split is offered only where each of its ops is
(`autopar.passes.autograd_functions.verify_function_splits`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import FunctionCtx
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.core.errors import AutoparError, TraceError
from autopar.core.strategy import AxisStrategy, OpCall, TracedKernel
from autopar.rules.base import LocalCall, LocalContext, RuleRegistry, with_replicated

# plain data a Function application may take besides its tensors (a config dict, flags, a dim)
PLAIN_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device)


class PlainContext(FunctionCtx):
    """The `ctx` a Function's forward and backward see when run by the ops: what they save, the
    attributes they set, and which inputs need a gradient (as at the traced application)."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple[Any, ...] = ()

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        return tuple(self.to_save)


@dataclass(eq=False)  # one application of one trace: compared (and hashed, in kernels) by identity
class FunctionEntry:
    """One application's Function and everything but its tensors, keyed by `key`.

    `args` holds the application's positional arguments with None where `tensor_positions` put
    the op's tensor inputs; `grad_inputs` are the indices (into the op's tensor inputs) of the
    floating tensors that required a gradient; `single` whether the forward returned one tensor."""

    function: type
    args: tuple[Any, ...]
    tensor_positions: tuple[int, ...]
    grad_inputs: tuple[int, ...]
    single: bool = True
    forward_strategies: tuple[AxisStrategy, ...] = ()
    backward_strategies: tuple[AxisStrategy, ...] = ()
    verified: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.function.__module__}.{self.function.__qualname__}"

    def call_args(self, tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        args = list(self.args)
        for position, tensor in zip(self.tensor_positions, tensors):
            args[position] = tensor
        return tuple(args)

    def needs_input_grad(self) -> tuple[bool, ...]:
        grad_positions = {self.tensor_positions[i] for i in self.grad_inputs}
        return tuple(i in grad_positions for i in range(len(self.args)))

    def run_forward(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], PlainContext]:
        """The Function's forward on `tensors` (no grad, as autograd runs it): outputs and context."""
        ctx = PlainContext(self.needs_input_grad())
        args = self.call_args(tensors)
        with torch.no_grad():
            if _has_setup_context(self.function):
                result = self.function.forward(*args)  # type: ignore[attr-defined]
                self.function.setup_context(ctx, args, result)  # type: ignore[attr-defined]
            else:
                result = self.function.forward(ctx, *args)  # type: ignore[attr-defined]
        if getattr(ctx, "dirty_tensors", None):
            raise self.error("writes into its input in place (ctx.mark_dirty)")
        self.single = isinstance(result, torch.Tensor)
        outputs = [result] if isinstance(result, torch.Tensor) else list(result)
        if not all(isinstance(out, torch.Tensor) for out in outputs):
            raise self.error("returns something other than tensors from forward")
        return _unaliased(outputs, tensors), ctx

    def run_backward(self, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The Function's backward, after its forward rebuilt the context: one gradient for each
        of `grad_inputs` (zeros where the backward returns None, summed to the input's shape
        and cast to its dtype, as autograd does with a Function's gradients)."""
        _, ctx = self.run_forward(tensors)
        with torch.no_grad():
            result = self.function.backward(ctx, *grads)  # type: ignore[attr-defined]
        returned = (result,) if not isinstance(result, tuple) else result
        out: list[torch.Tensor] = []
        for index in self.grad_inputs:
            position = self.tensor_positions[index]
            grad = returned[position] if position < len(returned) else None
            tensor = tensors[index]
            if grad is None:
                out.append(torch.zeros_like(tensor))
                continue
            if tuple(grad.shape) != tuple(tensor.shape):
                grad = grad.sum_to_size(tensor.shape)
            out.append(grad.to(tensor.dtype))
        return _unaliased(out, [*tensors, *grads])

    def forward_kernel(self, inputs: list[torch.Tensor], key: str) -> list[torch.Tensor]:
        """What a rank runs in place of `autograd_function(inputs, key)`."""
        return self.run_forward(inputs)[0]

    def backward_kernel(self, inputs: list[torch.Tensor], grads: list[torch.Tensor], key: str) -> list[torch.Tensor]:
        """What a rank runs in place of `autograd_function_backward(inputs, grads, key)`."""
        return self.run_backward(inputs, grads)

    def traced(self, backward: bool) -> TracedKernel:
        """The record its forward (or backward) op's node carries after the trace."""
        if backward:
            return TracedKernel(self.backward_strategies, self.backward_kernel)
        return TracedKernel(self.forward_strategies, self.forward_kernel)

    def error(self, what: str) -> TraceError:
        return TraceError(
            f"the custom autograd.Function {self.function.__qualname__} {what}",
            op=f"autograd.Function {self.name}",
            hint="make it a torch.library.custom_op with register_autograd and a sharding rule "
            "(examples/custom_op.py)",
        )


def _has_setup_context(function: type) -> bool:
    base = torch.autograd.function._SingleLevelFunction.setup_context
    return getattr(function, "setup_context", base) is not base


def _unaliased(outputs: list[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`outputs` with every one that shares storage with an input or an earlier output cloned:
    a custom op's outputs may alias nothing (`x.view_as(x)` of a gradient-reversal layer)."""
    seen = {StorageWeakRef(t.untyped_storage()) for t in inputs}
    result = []
    for out in outputs:
        ref = StorageWeakRef(out.untyped_storage())
        if ref in seen:
            out = out.clone()
            ref = StorageWeakRef(out.untyped_storage())
        seen.add(ref)
        result.append(out)
    return result


@dataclass
class FunctionTable:
    """The Function applications one trace made ops (`entries`, by key) and the Function classes
    it left as torch.export traces them, with why (`refused`). A trace owns its table; after the
    trace, each op node carries its entry's splits and kernel (`NodeInfo.traced`)."""

    entries: dict[str, FunctionEntry] = field(default_factory=dict)
    refused: dict[type, str] = field(default_factory=dict)

    def entry(self, key: str) -> FunctionEntry:
        found = self.entries.get(key)
        if found is None:
            raise AutoparError(
                f"no custom autograd.Function is traced under {key!r} in this trace",
                op="autopar::autograd_function",
                hint="a graph holding Function ops runs through the kernels its nodes record (NodeInfo.traced)",
            )
        return found


# The table of the trace running in this context, while it runs (`tracing_functions`): the ops'
# kernels receive only the key, a string, as a custom op's schema allows. Nothing else reads it,
# and it is reset when the trace ends, so no table outlives its trace.
_TRACING: ContextVar[FunctionTable | None] = ContextVar("autopar_tracing_functions", default=None)


@contextmanager
def tracing_functions(table: FunctionTable) -> Iterator[FunctionTable]:
    """While open, the Function ops that run (torch.export's calls of their kernels and of
    their autograd formula) find their entries in `table`."""
    token = _TRACING.set(table)
    try:
        yield table
    finally:
        _TRACING.reset(token)


def entry_key(function: type, args: tuple[Any, ...], grad_inputs: tuple[int, ...]) -> str:
    """A key equal on every rank for the same application (a digest of its plain arguments; never
    Python's salted `hash`)."""
    name = f"{function.__module__}.{function.__qualname__}"
    material = repr((name, [None if isinstance(a, torch.Tensor) else a for a in args], grad_inputs))
    return f"{name}:{hashlib.sha1(material.encode()).hexdigest()[:12]}"


def entry(key: str) -> FunctionEntry:
    """The entry of `key` in the trace running now."""
    table = _TRACING.get()
    if table is None:
        raise AutoparError(
            f"the custom autograd.Function op {key!r} runs outside the trace that made it",
            op="autopar::autograd_function",
            hint="a graph holding Function ops runs through the kernels its nodes record (NodeInfo.traced)",
        )
    return table.entry(key)


@torch.library.custom_op("autopar::autograd_function", mutates_args=())
def autograd_function(inputs: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return entry(key).run_forward(inputs)[0]


@autograd_function.register_fake
def _(inputs: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return entry(key).run_forward(inputs)[0]


@torch.library.custom_op("autopar::autograd_function_backward", mutates_args=())
def autograd_function_backward(inputs: list[torch.Tensor], grads: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return entry(key).run_backward(inputs, grads)


@autograd_function_backward.register_fake
def _(inputs: list[torch.Tensor], grads: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return [torch.empty_like(inputs[i]) for i in entry(key).grad_inputs]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    tensors, key = inputs
    ctx.save_for_backward(*tensors)
    ctx.key = key
    ctx.outputs = [(out.shape, out.dtype) for out in output]


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], None]:
    tensors = list(ctx.saved_tensors)
    found = entry(ctx.key)
    # autograd hands a Function zeros for an output nothing used (materialized gradients)
    full = [
        torch.zeros(shape, dtype=dtype, device=tensors[0].device) if grad is None else grad
        for grad, (shape, dtype) in zip(grads, ctx.outputs)
    ]
    computed = autograd_function_backward(tensors, full, ctx.key) if found.grad_inputs else []
    result: list[torch.Tensor | None] = [None] * len(tensors)
    for index, grad in zip(found.grad_inputs, computed):
        result[index] = grad
    return result, None


autograd_function.register_autograd(_backward, setup_context=_setup_context)

AUTOGRAD_FUNCTION = torch.ops.autopar.autograd_function.default
AUTOGRAD_FUNCTION_BACKWARD = torch.ops.autopar.autograd_function_backward.default


def _traced(call: OpCall) -> TracedKernel:
    """The record on the op's node; for a call not made from a node, the entry of the trace
    running now (`entry` refuses when none runs)."""
    if call.traced is not None:
        return call.traced
    return entry(call.args[-1]).traced(backward=call.op is AUTOGRAD_FUNCTION_BACKWARD)


def function_rule(call: OpCall) -> list[AxisStrategy]:
    """All-replicated, and the splits the trace verified for this Function's forward (or backward)."""
    return with_replicated(call, _traced(call).strategies)


def localize_function(ctx: LocalContext) -> LocalCall:
    """Each rank runs the Function's own code on its local tensors, through the kernel its trace
    recorded on the node (the key argument stays, unread)."""
    return LocalCall(_traced(ctx.call).kernel, ctx.args, ctx.kwargs)


def register(registry: RuleRegistry) -> None:
    family = registry.family("autograd_function")
    family.register(AUTOGRAD_FUNCTION, function_rule, localize=localize_function)
    family.register(AUTOGRAD_FUNCTION_BACKWARD, function_rule, localize=localize_function)
