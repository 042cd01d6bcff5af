"""Custom `torch.autograd.Function`s met while tracing a model for training (part of trace).

torch.export (non-strict, as the trace stage runs it) records the ATen ops of a Function's
forward and drops the Function itself, so the joint graph's backward would be the derivative of
that forward, not the Function's own backward: a straight-through estimator (round forward,
identity backward) would train with zero gradients, a gradient-reversal layer with the sign
flipped back. So while the trace runs (`functions_as_ops`), `Function.apply` makes each
application whose backward matters (grad on, a tensor argument requiring grad) one
`autopar::autograd_function` op, whose autograd formula is the Function's own backward
(`autopar.rules.autograd_function`). After the joint export, `verify_function_splits` finds, for
each such op, the splits its ops allow by autopar's own rules.

Each trace has its own `FunctionTable` (`functions_as_ops` yields it): the entries its ops name
and the Functions refused, with why. After the trace, every Function op node carries its splits
and kernel in its metadata (`NodeInfo.traced`), so the table is read by nothing after the trace.

A Function that cannot be made an op (a tensor hidden in a container argument, a non-plain
argument such as a module, a random draw in its forward, which recomputing it in backward would
draw again) stays as torch.export traces it and is refused by name (`custom_function_error`),
unless it is known to compute its forward's derivative.
"""

from __future__ import annotations

import inspect
import operator
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.function import BackwardCFunction
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from autopar.core.errors import TraceError
from autopar.core.layout import Placement, Replicate, Shard
from autopar.core.meta import has_info, update_info
from autopar.core.strategy import AxisStrategy
from autopar.passes.trace_errors import module_path, user_frame
from autopar.rules.autograd_function import (
    AUTOGRAD_FUNCTION,
    AUTOGRAD_FUNCTION_BACKWARD,
    PLAIN_TYPES,
    FunctionEntry,
    FunctionTable,
    autograd_function,
    entry_key,
    tracing_functions,
)
from autopar.rules.base import RuleRegistry, make_call
from autopar.rules.registry import default_registry

# Functions whose backward is the derivative of their forward, so tracing the forward loses
# nothing and its ops stay visible to the planner (tests/test_autograd_functions.py checks the
# transformers one numerically):
DERIVATIVE_PRESERVING = frozenset(
    {
        "transformers.models.bloom.modeling_bloom.GeLUFunction",  # tanh-GELU and its exact derivative
    }
)

# torch.library makes a Function for each custom op with register_autograd: export keeps the op
# whole and the joint graph uses its registered backward, so nothing is lost
CUSTOM_OP_FUNCTIONS = "torch._library."
# reentrant checkpointing runs its block under no_grad and backpropagates into parameters that are
# not its inputs: as an op, those gradients would be lost (use_reentrant=False is traced whole)
NOT_AN_OP = frozenset({"torch.utils.checkpoint.CheckpointFunction"})


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _kept_as_traced(cls: type) -> bool:
    name = qualified_name(cls)
    return cls.__module__.startswith(CUSTOM_OP_FUNCTIONS) or name in DERIVATIVE_PRESERVING


def custom_functions(outputs: Iterable[object]) -> list[type]:
    """The custom Function classes on the autograd graph behind `outputs` that were traced as
    their forward's ops (not made an op), first met first, without those in DERIVATIVE_PRESERVING."""
    found: list[type] = []
    seen: set[object] = set()
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        cls = getattr(node, "_forward_cls", None)
        if isinstance(node, BackwardCFunction) and isinstance(cls, type) and not _kept_as_traced(cls) and cls not in found:
            found.append(cls)
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return found


def _plain(value: Any) -> bool:
    return all(isinstance(leaf, PLAIN_TYPES) for leaf in pytree.tree_leaves(value))


def _why_not_an_op(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why this application stays traced as its forward's ops (None: it becomes an op)."""
    if qualified_name(cls) in NOT_AN_OP:
        return "its backward runs autograd into tensors that are not its inputs"
    if kwargs:
        return "it is applied with keyword arguments"
    for arg in args:
        if not isinstance(arg, torch.Tensor) and not _plain(arg):
            return f"it takes a {type(arg).__name__} argument, which is neither a tensor nor plain data"
    return None


@contextmanager
def functions_as_ops(enabled: bool) -> Iterator[FunctionTable]:
    """While open (when `enabled`), every application of a custom Function whose backward
    matters computes with `autopar::autograd_function`, recorded in the table it yields (one per
    trace); others run as torch runs them. `Function.apply` is swapped for the block alone (the
    only way in: torch calls no mode or hook before a Function runs) and restored on exit."""
    table = FunctionTable()
    if not enabled:
        yield table
        return
    original = torch.autograd.function.Function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        backward_matters = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        if not backward_matters or _kept_as_traced(cls):
            return original.__func__(cls, *args, **kwargs)
        reason = _why_not_an_op(cls, args, kwargs)
        if reason is not None:
            table.refused[cls] = reason
            return original.__func__(cls, *args, **kwargs)
        grad_inputs = tuple(
            i for i, t in enumerate(tensors) if t.requires_grad and (t.is_floating_point() or t.is_complex())
        )
        key = entry_key(cls, args, grad_inputs)
        found = table.entries.setdefault(
            key,
            FunctionEntry(
                cls,
                tuple(None if isinstance(a, torch.Tensor) else a for a in args),
                tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor)),
                grad_inputs,
            ),
        )
        outputs = autograd_function(tensors, key)
        return outputs[0] if found.single else tuple(outputs)

    torch.autograd.function.Function.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
    try:
        with tracing_functions(table):
            yield table
    finally:
        torch.autograd.function.Function.apply = original  # type: ignore[method-assign]


def verify_function_splits(gm: fx.GraphModule, table: FunctionTable, registry: RuleRegistry | None = None) -> None:
    """For each Function op of `gm` (entries of the trace's `table`), the splits (per mesh axis)
    its forward and its backward allow: its forward and backward are traced with make_fx on fake
    tensors of the op's shapes, refused if they draw random numbers, and a split of one dim of
    the inputs is kept where autopar's rule of every op they are made of places it
    (`_propagate`). Each op node then carries its splits and kernel (`NodeInfo.traced`), so
    nothing after the trace looks the table up."""
    registry = registry or default_registry()
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (AUTOGRAD_FUNCTION, AUTOGRAD_FUNCTION_BACKWARD)]
    for node in ops:  # verified at a forward op's shapes (a backward op's outputs are its inputs' gradients)
        found = table.entry(node.args[-1])
        if node.target is AUTOGRAD_FUNCTION and not found.verified:
            _verify(found, [arg.meta["val"] for arg in node.args[0]], list(node.meta["val"]), registry, node)
    for node in ops:
        if has_info(node):
            update_info(node, traced=table.entry(node.args[-1]).traced(backward=node.target is AUTOGRAD_FUNCTION_BACKWARD))


def _verify(
    found: FunctionEntry, inputs: list[torch.Tensor], outputs: list[torch.Tensor], registry: RuleRegistry, node: fx.Node
) -> None:
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")) for t in inputs]
        grads = [mode.from_tensor(torch.empty(o.shape, dtype=o.dtype, device="meta")) for o in outputs]
    n_in = len(fakes)
    forward = make_fx(lambda *ts: found.run_forward(ts)[0], tracing_mode="fake")(*fakes)
    backward = None
    if found.grad_inputs:
        backward = make_fx(lambda *ts: found.run_backward(ts[:n_in], ts[n_in:]), tracing_mode="fake")(*fakes, *grads)
    for graph in (forward, backward):
        random = next((n for n in graph.graph.nodes if _draws(n)), None) if graph is not None else None
        if random is not None:
            raise TraceError(
                f"the custom autograd.Function {found.function.__qualname__} draws random numbers "
                f"({random.target}): running its forward again for its backward would draw others",
                op=f"autograd.Function {found.name}",
                where=f"{module_path(node) or '<root>'} @ {user_frame(node.meta.get('stack_trace') or '')}",
                hint="draw the random tensor outside the Function and pass it in as an argument",
            )
    forward_strategies: list[AxisStrategy] = []
    backward_strategies: list[AxisStrategy] = []
    for dim in range(max((t.ndim for t in inputs), default=0)):
        size = next(t.shape[dim] for t in inputs if t.ndim > dim)
        split: list[Placement] = [Shard(dim) if t.ndim > dim and t.shape[dim] == size else Replicate() for t in inputs]
        out = _propagate(forward, split, registry)
        if out is None:
            continue
        forward_strategies.append(AxisStrategy(tuple(split), tuple(out)))
        if backward is None:
            continue
        grad_split = [p if isinstance(p, Shard) else Replicate() for p in out]
        back = _propagate(backward, [*split, *grad_split], registry)
        if back is not None:
            backward_strategies.append(AxisStrategy((*split, *grad_split), tuple(back)))
    found.forward_strategies = tuple(forward_strategies)
    found.backward_strategies = tuple(backward_strategies)
    found.verified = True


def _draws(node: fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _propagate(gm: fx.GraphModule, placements: list[Placement], registry: RuleRegistry) -> list[Placement] | None:
    """The placements of `gm`'s outputs when its inputs have `placements` on one mesh axis and
    every op takes the one strategy of its rule that accepts its inputs' placements; None where
    an op has no rule, or no strategy accepts them."""
    env: dict[fx.Node, Any] = {}
    given = iter(placements)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(given)
        elif node.op == "get_attr":
            env[node] = Replicate()
        elif node.op == "call_function" and node.target is operator.getitem:
            env[node] = env[node.args[0]][node.args[1]]
        elif node.op == "call_function":
            found = _placed(node, env, registry)
            if found is None:
                return None
            env[node] = found
        elif node.op == "output":
            result = [env[n] for n in pytree.tree_leaves(node.args[0]) if isinstance(n, fx.Node)]
            if any(not isinstance(p, Placement) for p in result):
                return None
            return result
    return None


def _placed(node: fx.Node, env: dict[fx.Node, Any], registry: RuleRegistry) -> Any:
    rule = registry.get(node.target)
    if rule is None or rule.admits is not None or rule.localize is not None:
        return None  # a rule that rewrites its call per rank would need a local call here too
    leaves = [n for n in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(n, fx.Node)]
    if any(not isinstance(n.meta.get("val"), torch.Tensor) for n in leaves):
        return None  # a size read from a tensor's value or shape
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
    try:
        call = make_call(node.target, args, kwargs, node.meta.get("val"))
        wanted = tuple(env[n] for n in leaves)
        match = next((s for s in rule.strategies(call) if s.inputs == wanted), None)
    except Exception:  # a rule that does not take this call: not verified, so not split
        return None
    if match is None:
        return None
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return match.outputs[0]
    if isinstance(value, (tuple, list)):
        placed = iter(match.outputs)
        return tuple(next(placed) if isinstance(v, torch.Tensor) else None for v in value)
    return None


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


def custom_function_error(functions: list[type], graph: fx.Graph, table: FunctionTable) -> TraceError:
    """The refusal of the Functions traced as their forward's ops, with why each was not made one."""
    cls = functions[0]
    node = first_node_of(graph, cls)
    where = None
    if node is not None:
        where = f"{module_path(node) or '<root>'} @ {user_frame(node.meta.get('stack_trace') or '')}"
    others = f" (and {', '.join(c.__qualname__ for c in functions[1:])})" if functions[1:] else ""
    reason = table.refused.get(cls)
    why = f"; it is not traced as one op with its backward because {reason}" if reason else ""
    return TraceError(
        f"{cls.__qualname__} is a custom torch.autograd.Function{others}: torch.export records the "
        f"ops of its forward ({definition_of(cls)}) and drops its backward, so training would use "
        f"the derivative of the forward instead of the Function's backward{why}",
        op=f"autograd.Function {qualified_name(cls)}",
        where=where,
        hint="pass it tensors and plain data (numbers, strings, flags) only, or make it a "
        "torch.library.custom_op with register_autograd and a sharding rule (examples/custom_op.py); "
        "for torch.utils.checkpoint, pass use_reentrant=False",
    )
