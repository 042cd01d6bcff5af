"""Sizes that values Python reads decide, made numbers at the example's values, each with its guard.

A plan is made for fixed shapes. Where the inputs' values set a size (`nonzero` of an input mask,
a count read by `.item()` and used to slice), the graph exported on the example's real values is
rewritten to that size, and the condition that the value is the example's becomes an assertion
that `autopar.passes.value_guards` cuts out as a guard: a batch with another value gets its own
program, as a batch of another shape would. Sizes of tensors computed from the weights are the
same on every call a program serves (they follow the input shapes and the guarded values) and
become numbers too. The helpers here also build the guards' own small program (`subprogram`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.core.graph_order import ancestors, inputs_with_writes, reachable, written_root
from autopar.passes.random_guards import ValueStep, copy_drawing, draws, value_ancestors

ASSERT = torch.ops.aten._assert_scalar.default
# ops that only constrain a symbolic value: part of a guard's chain, never of the model's result
CONSTRAINTS = (
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten._assert_async.msg,
)
VALUE_READS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)


def sizes_as_numbers(
    module: fx.GraphModule, checks: list[fx.Node], inputs_of: ValueStep
) -> None:
    """A size read (`sym_size`) in a check's chain, of a tensor computed from the weights, as the
    number it is in this program. A plan is made for fixed shapes: a tensor's size is set by the
    input shapes (the program's cache key) and by the values Python reads from the inputs (each a
    guard, or refused), never by the weights' values, so the size is the same on every call this
    program serves. Longformer checks `attn_scores.size(-1) - max_num_global_attn_indices` (the
    scores concatenated with the global keys' columns): the size is set by the global-attention
    count, and a walk into the scores' values would reach the weights and refuse the guard."""
    chain = value_ancestors(checks, inputs_of)
    for node in [n for n in module.graph.nodes if n in chain and n.target is torch.ops.aten.sym_size.int]:
        tensor, dim = node.args[:2]
        size = node.meta.get("val")
        if isinstance(size, torch.SymInt):  # unbacked: the example's value the trace on real values took
            size = _example_int(size)
        if not isinstance(size, int) or not isinstance(tensor, fx.Node):
            continue
        if any(reads_state(module, n) for n in value_ancestors([tensor], inputs_of)):
            node.replace_all_uses_with(size)  # type: ignore[arg-type]
            module.graph.erase_node(node)


def _example_int(size: torch.SymInt) -> int | None:
    """The number a symbolic size took on the example (torch.export on real values records each
    unbacked symbol's value); None where it is not known."""
    node = size.node
    known = node.maybe_as_int()
    if known is not None:
        return known
    value = node.expr.xreplace(getattr(node.shape_env, "real_tensor_prop_unbacked_vals", {}))
    return int(value) if value.is_number else None


def pin_read_sizes(graph: fx.Graph, asserts: list[fx.Node]) -> None:
    """A value read that a guard pins to one number (`Eq(u2, 1)`: torch.export on real values
    specialized a size on it) is that number everywhere outside the guards: Longformer's
    `torch.arange(max_num_global_attn_indices)` and `new_zeros` of that many rows get the
    example's count, which the guard checks on every call (another count: another program)."""
    for check in asserts:
        test = check.args[0]
        if not (isinstance(test, fx.Node) and test.target is operator.eq and len(test.args) == 2):
            continue
        read, number = test.args
        if not (isinstance(read, fx.Node) and read.target in VALUE_READS and isinstance(number, (int, bool))):
            continue
        # tensor ops get the number; Python's arithmetic on it stays the guards' (or is refused)
        users = [u for u in read.users if u.target is not ASSERT and u.target not in CONSTRAINTS]
        pinned = functools.partial(_pinned, read, number)
        for user in [u for u in users if getattr(u.target, "__module__", "") != "_operator"]:
            user.args = fx.node.map_arg(user.args, pinned)
            user.kwargs = fx.node.map_arg(user.kwargs, pinned)
            user.meta.pop("unbacked_bindings", None)  # a slice to the read's value: a number now
        # `x.narrow(-1, t, n)` with a 0-d tensor `t` reads `t`'s value inside the op
        for user in list(read.args[0].users) if isinstance(read.args[0], fx.Node) else []:
            if user.target is torch.ops.aten.narrow.Tensor and user.args[2] is read.args[0]:
                user.target = torch.ops.aten.narrow.default
                user.args = (*user.args[:2], number, *user.args[3:])


def guard_sized_reads(module: fx.GraphModule, inputs_of: ValueStep) -> None:
    """A value read from the inputs alone that sets a size (`n = count.item(); h[:, :n]`), and that
    no `Eq` guard pins yet, gets one at the example's value: the program is made for that size, and
    a batch with another value fails the guard and gets its own program (as a new shape would). A
    count read twice, by a branch (`if count == 1:`, a guard on the comparison) and again as a
    size, is then pinned by its second read's own guard. A read computed from the weights or a
    random draw is left for `split_value_guards` to refuse."""
    graph = module.graph
    for read in [n for n in graph.nodes if n.target in VALUE_READS]:
        value = read.meta.get("val")
        number = _example_int(value) if isinstance(value, torch.SymInt) else None
        if number is None or _eq_pinned(read) or not sets_a_size(read):
            continue
        chain = value_ancestors([read], inputs_of)
        if any(reads_state(module, n) or draws(n) for n in chain):
            continue
        with graph.inserting_after(read):
            same = graph.call_function(operator.eq, (read, number))
        with graph.inserting_after(same):
            check = graph.call_function(ASSERT, (same, f"the value read is {number}"))
        for node in (same, check):
            node.meta.update({k: v for k, v in read.meta.items() if k in ("stack_trace", "nn_module_stack")})


def _eq_pinned(read: fx.Node) -> bool:
    """Whether an assertion already holds `read` equal to a number (`Eq(u2, 1)`)."""
    return any(
        user.target is operator.eq
        and user.args[0] is read
        and isinstance(user.args[1], (int, bool))
        and any(u.target is ASSERT for u in user.users)
        for user in read.users
    )


def _pinned(read: fx.Node, number: int | bool, node: fx.Node) -> Any:
    return number if node is read else node


def erase_dead_reads(module: fx.GraphModule) -> None:
    """Erase the value reads nothing uses, with the ops only they used. Longformer's chunk count,
    `torch.div(seq_len, w) - 1` on Python ints, is a tensor whose value Python reads as a size;
    torch.export took the number (the same in every call of these shapes) and left the read
    behind, dead. Its `max_num_global_attn_indices`, read again by every op that sizes a tensor
    by it, leaves a dead read each time torch knew the value already (the first read's symbol,
    pinned by its guard). A read nobody uses decides nothing; random draws and in-place writes
    stay (the stream's position, the values written)."""
    graph = module.graph
    for read in [n for n in graph.nodes if n.target in VALUE_READS and not n.users]:
        chain = ancestors([read])
        for dead in reversed(list(graph.nodes)):  # the read, then what only it used
            unused = dead in chain and not dead.users and dead.op == "call_function"
            if unused and not draws(dead) and written_root(dead) is None:
                graph.erase_node(dead)


def reads_state(module: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` reads the model's state: a parameter or buffer (`get_attr`), a submodule. A
    tensor constant the forward made from Python data (torch.export's `lifted_tensor_0`: the
    `torch.tensor(...)` a mask's arithmetic makes, as Longformer's global-attention flag reads) is
    not state: it is the same in every call, so a guard may compute with it."""
    if node.op == "call_module":
        return True
    if node.op != "get_attr":
        return False
    target = str(node.target)
    owner_path, _, name = target.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if name in owner._parameters or name in owner._buffers:
        return True
    return not isinstance(getattr(owner, name, None), torch.Tensor)


def sets_a_size(read: fx.Node) -> bool:
    """Whether the value `read` takes is used by a tensor op (a split's sizes, a view's shape),
    directly or through Python arithmetic on it, and not only by the checks on it: JetMoE's
    `expert_size.tolist()` feeding `split`, where a branch's read feeds only its condition."""
    frontier = list(read.users)
    seen: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node in seen or node.target is ASSERT or node.target in CONSTRAINTS:
            continue
        seen.add(node)
        value = node.meta.get("val")
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, torch.Tensor) for v in values):
            return True
        frontier.extend(node.users)
    return False


def fix_input_sizes(module: fx.GraphModule, example: Sequence[Any]) -> set[fx.Node]:
    """Sizes the inputs' values decide, made static at the example's: `nonzero` of a mask computed
    from the inputs alone, and boolean indexing by such a mask (`hidden_states[eos_mask]`, as
    BART-family sequence classifiers pick their end-of-sequence states) become `nonzero_static` at
    the example's count, with the count as a guard (an assertion the guard program then takes),
    so a batch with another count gets its own program. A plan is made for fixed sizes; this fixes
    the sizes the inputs decide. Size constraints torch recorded on the old, unbacked size are
    erased: the size is a number now, and the guard holds it. Returns the count guards made."""
    graph = module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    made: list[fx.Node] = []
    checks: set[fx.Node] = set()

    def written_ancestors(nodes: list[fx.Node]) -> set[fx.Node]:  # the graph grows: a fresh walk each
        return reachable(nodes, inputs_with_writes(graph))

    def input_only(node: fx.Node) -> bool:
        return not any(reads_state(module, n) or draws(n) for n in written_ancestors([node]))

    def static_nonzero(mask: fx.Node, near: fx.Node) -> fx.Node:
        # with the in-place writes into the mask's inputs (Longformer's `global_attention_mask[:, 0] = 1`)
        program, inputs = subprogram(module, placeholders, written_ancestors([mask]), [mask])
        count = int(torch.count_nonzero(program(*(example[i] for i in inputs))[0]))
        with graph.inserting_before(near):
            counted = graph.call_function(torch.ops.aten.count_nonzero.default, (mask,))
            same = graph.call_function(torch.ops.aten.eq.Scalar, (counted, count))
            read = graph.call_function(torch.ops.aten.item.default, (same,))
            check = graph.call_function(ASSERT, (read, f"the count of nonzero values is {count}"))
            static = graph.call_function(torch.ops.aten.nonzero_static.default, (mask,), {"size": count})
        for node in (counted, same, read, check, static):
            node.meta.update({k: v for k, v in near.meta.items() if k in ("stack_trace", "nn_module_stack")})
        made.append(static)
        checks.add(check)
        return static

    for node in list(graph.nodes):
        if node.target is torch.ops.aten.nonzero.default and input_only(node):
            node.replace_all_uses_with(static_nonzero(node.args[0], node))  # type: ignore[arg-type]
            graph.erase_node(node)
        elif node.target is torch.ops.aten.index.Tensor:
            source, indices = node.args[0], list(node.args[1])  # type: ignore[arg-type]
            masks = [
                k for k, index in enumerate(indices)
                if isinstance(index, fx.Node) and _is_bool(index) and input_only(index)
            ]  # fmt: skip
            if not masks:
                continue
            for k in reversed(masks):  # a mask over d dims becomes d index tensors in its place
                mask = indices[k]
                assert isinstance(mask, fx.Node)
                rows = static_nonzero(mask, node)
                with graph.inserting_before(node):
                    columns = [
                        graph.call_function(torch.ops.aten.select.int, (rows, 1, d))
                        for d in range(_ndim(mask))
                    ]
                indices[k : k + 1] = columns
            node.args = (source, indices)
            node.meta.pop("unbacked_bindings", None)  # its size is a number now
    if made:
        _erase_size_constraints(graph, made)
    graph.lint()
    module.recompile()
    return checks


def _is_bool(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _ndim(node: fx.Node) -> int:
    value = node.meta.get("val")
    assert isinstance(value, torch.Tensor)
    return value.dim()


def _erase_size_constraints(graph: fx.Graph, made: list[fx.Node]) -> None:
    """The assertions torch recorded on sizes downstream of the now static nodes (`u1 >= 8`,
    `Eq(u1, 8*(u1//8))`): each reads a size of a value computed from a static node's output, and
    with the size a number it says nothing the count guard does not."""
    downstream = reachable(made, lambda node: node.users)
    for node in reversed(list(graph.nodes)):
        if node.target is ASSERT or node.target in CONSTRAINTS:
            chain = ancestors([node])
            reads_size = any(n.target is torch.ops.aten.sym_size.int and n in downstream for n in chain)
            if reads_size and not any(n.target in VALUE_READS for n in chain):
                graph.erase_node(node)
    for node in reversed(list(graph.nodes)):  # the size arithmetic only those assertions used
        if node.op == "call_function" and not node.users and _is_size_arithmetic(node):
            graph.erase_node(node)


def _is_size_arithmetic(node: fx.Node) -> bool:
    return node.target is torch.ops.aten.sym_size.int or getattr(node.target, "__module__", "") in (
        "_operator",
        "operator",
    )


def subprogram(
    module: fx.GraphModule,
    placeholders: list[fx.Node],
    chain: set[fx.Node],
    outputs: Sequence[Any],
    replays: Sequence[fx.Node] = (),
) -> tuple[fx.GraphModule, tuple[int, ...]]:
    """The nodes of `chain` (placeholders and pure ops) as a graph over the inputs they read,
    returning `outputs` (nodes of `chain`, or constants as they are). With random draws in `chain`
    or `replays` (random ops to run before them, `autopar.passes.random_guards`), the graph takes
    the program's device last and draws each on stand-ins of its inputs, in graph order."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for index, node in enumerate(placeholders):
        if node in chain:
            env[node] = graph.placeholder(node.name)
            inputs.append(index)
    drawing = set(replays) | {n for n in chain if draws(n)}
    device = graph.placeholder("program_device") if drawing else None
    for node in module.graph.nodes:
        if node in drawing:
            assert device is not None
            copied = copy_drawing(graph, node, env, device)
            if copied is not None:
                env[node] = copied
        elif node in chain and node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] if isinstance(n, fx.Node) else n for n in outputs))
    # the tensor constants the chain reads (`reads_state`: no parameter or buffer gets this far)
    constants = {str(n.target): _attr(module, str(n.target)) for n in graph.nodes if n.op == "get_attr"}
    return fx.GraphModule(constants, graph), tuple(inputs)


def _attr(module: nn.Module, target: str) -> Any:
    owner_path, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner_path) if owner_path else module, name)
