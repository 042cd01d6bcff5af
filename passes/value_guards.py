"""Split the value guards out of a graph exported on the example batch's real values.

`torch.export` with real-tensor propagation (`autopar.passes.trace`, where a plain trace fails on
a value read by Python) takes the branches the example's values take and records each condition
as a runtime assertion in the graph (`aten._assert_scalar` of a comparison of `aten.item` of a
tensor). Left in the graph, those reads would run inside the distributed program on blocks of
the inputs. They are instead cut out here into a small serial program over the user's inputs
(`ValueGuards`), which every rank evaluates on the global batch before the distributed program
runs; the graph keeps only the branch taken.

Sound only where a condition is a function of the inputs. A condition computed from the model's
weights or activations fed by them, or from a random draw (LayerDrop's `torch.rand([]) < p`),
cannot be evaluated ahead of the program and is refused with the reason; so is a value that
feeds a size the rest of the graph uses.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch.fx as fx
import torch.nn as nn
from torch._subclasses import meta_utils
from torch.utils import _pytree as pytree

from autopar.core.errors import TraceError
from autopar.core.graph_order import ancestors, inputs_with_writes, reachable, written_root
from autopar.core.value_guards import ValueGuards, generators_kept
from autopar.passes.masked_writes import masked_writes_as_where
from autopar.passes.random_guards import (
    ValueStep,
    copy_drawing,
    draws,
    draws_before,
    replayable,
    value_ancestors,
    value_inputs,
)
from autopar.passes.trace_errors import DATA_DEPENDENT_HINT

_ASSERT = torch.ops.aten._assert_scalar.default
# ops that only constrain a symbolic value: part of a guard's chain, never of the model's result
_CONSTRAINTS = (
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten._assert_async.msg,
)
_VALUE_READS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)

WEIGHT_GUARD_HINT = (
    "the value Python reads here is computed from the model's weights or a random draw, not from "
    "the inputs alone, so it cannot be checked before the program runs; compute both sides with "
    "torch.where, move the check out of forward, or turn off random layer skipping (LayerDrop: "
    "layerdrop=0 in the model's config)"
)
SIZE_GUARD_HINT = (
    "a value read by Python sets a size later ops use (x.view(n.item(), -1), torch.arange(t.max())): "
    "a plan is made for fixed sizes; compute the size from input shapes, or pad to a fixed size"
)


def split_value_guards(
    module: fx.GraphModule, where: Callable[[fx.Node], str], example: Sequence[Any] | None = None
) -> ValueGuards | None:
    """Cut every runtime assertion and the value reads only they use out of `module` (an unlifted
    exported module: parameters as get_attr, the flat user inputs as placeholders), in place, and
    return them as `ValueGuards`; None where the graph has none. Writes through a boolean mask
    become `torch.where` first (`autopar.passes.masked_writes`). `where(node)`: the user's module
    path and source line of a node, for the errors. `example`: the example's flat inputs, whose
    values fix the sizes of `nonzero` on the inputs alone (`_fix_input_sizes`)."""
    graph = module.graph
    masked_writes_as_where(module)  # `x[mask] = v`: no size the mask decides, so no guard either
    counted = _fix_input_sizes(module, example) if example is not None else set()
    checks = [n for n in graph.nodes if n.target is _ASSERT or n.target in _CONSTRAINTS]
    # one scan of the graph for every walk below: from here on nodes are only erased or rewired
    inputs_of = value_inputs(graph)
    _sizes_as_numbers(module, checks, inputs_of)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    asserts = []
    for check in checks:
        chain = value_ancestors([check], inputs_of)
        outside = next((n for n in chain if reads_state(module, n) or (draws(n) and not replayable(n))), None)
        if outside is None:  # a function of the inputs and of draws that depend on shapes alone: a guard
            asserts.append(check)
            continue
        read = _first_read(chain, outside)
        if read is None:
            # a constraint on a size computed from activations (boolean indexing of hidden
            # states): not a value Python reads; the size itself is refused later, with its op
            continue
        if outside.op == "call_function":
            raise TraceError(
                "Python reads a tensor's value here to choose a branch, and that value is drawn by a "
                "random op whose numbers depend on values, not only on shapes",
                op=str(outside.target),
                where=where(read),
                hint=WEIGHT_GUARD_HINT,
            )
        sized = _sets_a_size(read)
        raise TraceError(
            "Python reads a tensor's value here and the model uses it as a size (rows per expert "
            "split out of a tensor, a count), and that value depends on the model's weights: the "
            "weights and the activations they compute set it anew every step (tokens per expert of "
            "a router), so no program made for one value could serve the next, and no guard on it "
            "can be checked before the program runs"
            if sized
            else "Python reads a tensor's value here to choose a branch or check a condition, and "
            "that value depends on the model's weights",
            op=str(read.target),
            where=where(read),
            hint=DATA_DEPENDENT_HINT if sized else WEIGHT_GUARD_HINT,
        )
    if not asserts:
        return None
    _pin_read_sizes(graph, asserts)
    chain = value_ancestors(asserts, inputs_of)
    replays = draws_before(graph, chain, where)
    guard_module, inputs = _guard_program(module, placeholders, chain, asserts, replays)
    conditions = tuple(_condition(a, where, inputs_of) for a in asserts if a.target is _ASSERT)
    counts = tuple(a in counted for a in asserts if a.target is _ASSERT)
    for node in reversed(list(graph.nodes)):  # the asserts, then what only they used; draws stay
        unused_part = node.target is operator.getitem and node.args[0] in chain  # of a tuple they read
        # an in-place write (`mask[:, 0] = 1`) has no users, and the program still needs it
        removable = node.op == "call_function" and not draws(node) and written_root(node) is None
        if (node in chain or unused_part) and not node.users and removable:
            graph.erase_node(node)
    _erase_dead_reads(module)
    left = [n for n in graph.nodes if n.op == "call_function" and n.target in _VALUE_READS]
    if left:
        raise TraceError(
            "Python reads a tensor's value here and the rest of the model uses it (a size, a count)",
            op=str(left[0].target),
            where=where(left[0]),
            hint=SIZE_GUARD_HINT,
        )
    graph.lint()
    module.recompile()
    return ValueGuards(guard_module, inputs, conditions, draws=any(draws(n) for n in chain), counts=counts)


def _sizes_as_numbers(
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


def _pin_read_sizes(graph: fx.Graph, asserts: list[fx.Node]) -> None:
    """A value read that a guard pins to one number (`Eq(u2, 1)`: torch.export on real values
    specialized a size on it) is that number everywhere outside the guards: Longformer's
    `torch.arange(max_num_global_attn_indices)` and `new_zeros` of that many rows get the
    example's count, which the guard checks on every call (another count: another program)."""
    for check in asserts:
        test = check.args[0]
        if not (isinstance(test, fx.Node) and test.target is operator.eq and len(test.args) == 2):
            continue
        read, number = test.args
        if not (isinstance(read, fx.Node) and read.target in _VALUE_READS and isinstance(number, (int, bool))):
            continue
        # tensor ops get the number; Python's arithmetic on it stays the guards' (or is refused)
        users = [u for u in read.users if u.target is not _ASSERT and u.target not in _CONSTRAINTS]
        pinned = functools.partial(_pinned, read, number)
        for user in [u for u in users if getattr(u.target, "__module__", "") != "_operator"]:
            user.args = fx.node.map_arg(user.args, pinned)
            user.kwargs = fx.node.map_arg(user.kwargs, pinned)
        # `x.narrow(-1, t, n)` with a 0-d tensor `t` reads `t`'s value inside the op
        for user in list(read.args[0].users) if isinstance(read.args[0], fx.Node) else []:
            if user.target is torch.ops.aten.narrow.Tensor and user.args[2] is read.args[0]:
                user.target = torch.ops.aten.narrow.default
                user.args = (*user.args[:2], number, *user.args[3:])


def _pinned(read: fx.Node, number: int | bool, node: fx.Node) -> Any:
    return number if node is read else node


def _erase_dead_reads(module: fx.GraphModule) -> None:
    """Erase the value reads nothing uses, with the ops only they used. Longformer's chunk count,
    `torch.div(seq_len, w) - 1` on Python ints, is a tensor whose value Python reads as a size;
    torch.export took the number (the same in every call of these shapes) and left the read
    behind, dead. Its `max_num_global_attn_indices`, read again by every op that sizes a tensor
    by it, leaves a dead read each time torch knew the value already (the first read's symbol,
    pinned by its guard). A read nobody uses decides nothing; random draws and in-place writes
    stay (the stream's position, the values written)."""
    graph = module.graph
    for read in [n for n in graph.nodes if n.target in _VALUE_READS and not n.users]:
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


def _sets_a_size(read: fx.Node) -> bool:
    """Whether the value `read` takes is used by a tensor op (a split's sizes, a view's shape),
    directly or through Python arithmetic on it, and not only by the checks on it: JetMoE's
    `expert_size.tolist()` feeding `split`, where a branch's read feeds only its condition."""
    frontier = list(read.users)
    seen: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node in seen or node.target is _ASSERT or node.target in _CONSTRAINTS:
            continue
        seen.add(node)
        value = node.meta.get("val")
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, torch.Tensor) for v in values):
            return True
        frontier.extend(node.users)
    return False


def _first_read(chain: set[fx.Node], near: fx.Node) -> fx.Node | None:
    """The value read (`item`) in `chain` downstream of `near`, for the error's location."""
    frontier = [near]
    seen: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target in _VALUE_READS:
            return node
        frontier.extend(u for u in node.users if u in chain)
    return None


def _read_of(node: fx.Node) -> fx.Node:
    """The value read (`item`) a guard tests: the user's line for it (the assertion itself is
    torch's)."""
    reads = [n for n in ancestors([node]) if n.target in _VALUE_READS]
    return reads[0] if reads else node


def _fix_input_sizes(module: fx.GraphModule, example: Sequence[Any]) -> set[fx.Node]:
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
        program, inputs = _subprogram(module, placeholders, written_ancestors([mask]), [mask])
        count = int(torch.count_nonzero(program(*(example[i] for i in inputs))[0]))
        with graph.inserting_before(near):
            counted = graph.call_function(torch.ops.aten.count_nonzero.default, (mask,))
            same = graph.call_function(torch.ops.aten.eq.Scalar, (counted, count))
            read = graph.call_function(torch.ops.aten.item.default, (same,))
            check = graph.call_function(_ASSERT, (read, f"the count of nonzero values is {count}"))
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
        if node.target is _ASSERT or node.target in _CONSTRAINTS:
            chain = ancestors([node])
            reads_size = any(n.target is torch.ops.aten.sym_size.int and n in downstream for n in chain)
            if reads_size and not any(n.target in _VALUE_READS for n in chain):
                graph.erase_node(node)
    for node in reversed(list(graph.nodes)):  # the size arithmetic only those assertions used
        if node.op == "call_function" and not node.users and _is_size_arithmetic(node):
            graph.erase_node(node)


def _is_size_arithmetic(node: fx.Node) -> bool:
    return node.target is torch.ops.aten.sym_size.int or getattr(node.target, "__module__", "") in (
        "_operator",
        "operator",
    )


def _subprogram(
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


def _guard_program(
    module: fx.GraphModule,
    placeholders: list[fx.Node],
    chain: set[fx.Node],
    asserts: list[fx.Node],
    replays: Sequence[fx.Node],
) -> tuple[fx.GraphModule, tuple[int, ...]]:
    """A graph over the inputs the guards read, returning each assertion's condition."""
    body = {n for n in chain if n.target is not _ASSERT and n.target not in _CONSTRAINTS}
    conditions = [a.args[0] for a in asserts if a.target is _ASSERT]
    return _subprogram(module, placeholders, body, conditions or [True], replays)


def _condition(
    check: fx.Node, where: Callable[[fx.Node], str], inputs_of: ValueStep
) -> str:
    """What a guard's log line calls it: the value Python reads (or the random draw) and where."""
    drawn = [n for n in value_ancestors([check], inputs_of) if draws(n)]
    if drawn:
        return f"the random draw at {where(drawn[0])}"
    return f"the value Python reads at {where(_read_of(check))}"


def flat_values(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
    """The flat leaves of the example's `(args, kwargs)`, as the exported module's placeholders
    take them; None where a tensor has no values (on the meta device)."""
    return pytree.tree_leaves((args, kwargs)) if inputs_have_values(args, kwargs) else None


def inputs_have_values(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the example inputs hold values (none on the meta device): what a trace on real
    values needs. The weights need not: see `valued_copy`."""
    return all(
        x.device.type != "meta" for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)
    )


def valued_copy(model: nn.Module, device: torch.device) -> nn.Module:
    """A copy of `model`'s module structure for a trace on real values, which runs the forward for
    real: the same parameter objects where they hold values, copies of the buffers (a forward that
    updates its buffers, BatchNorm's statistics, must not update the user's), zeros on `device`
    where they are on the meta device (a model built on meta, the structure a later compile traces). The values of
    the weights never decide a guard: a condition computed from them is refused
    (`split_value_guards`), so zeros trace the same branches the real weights would."""
    memo: dict[int, Any] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for _, tensor in named:
        if id(tensor) in memo:
            continue
        if tensor.device.type != "meta":  # a parameter shared; a buffer copied: forward may update it
            memo[id(tensor)] = tensor if isinstance(tensor, nn.Parameter) else tensor.detach().clone()
            continue
        zeros = torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
        is_param = isinstance(tensor, nn.Parameter)
        memo[id(tensor)] = nn.Parameter(zeros, requires_grad=tensor.requires_grad) if is_param else zeros
    return copy.deepcopy(model, memo)


def private_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], frozen: bool) -> tuple[Any, Any]:
    """Copies of the example inputs for a trace that runs the forward for real: a model that
    updates an input in place (`labels.masked_fill_`) must not change the user's batch. `frozen`:
    none requires grad (a forward-only trace)."""

    def copied(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return x.detach().clone().requires_grad_(x.requires_grad and not frozen)

    return pytree.tree_map(copied, (args, kwargs))


def serial_raises(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], raised: BaseException) -> bool:
    """Whether the model run eagerly on the example inputs raises what the trace on real values
    raised (`raised`): only then is the error the serial model's. A trace computes a few values
    differently from eager (uninitialized memory a kernel leaves, read as real values), and an
    error only the trace meets is a refusal, not the user's."""
    device = next((x.device for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)), None)
    copy_ = valued_copy(model, device or torch.device("cpu"))
    args, kwargs = private_inputs(args, kwargs, frozen=True)
    try:
        with torch.no_grad(), generators_kept(device or torch.device("cpu")):
            copy_(*args, **kwargs)
    except Exception as exc:  # the same check failing: its type and message (the values it quotes aside)
        return type(exc) is type(raised) and str(exc).split("\n")[0] == str(raised).split("\n")[0]
    return False


@contextlib.contextmanager
def quiet_symbolic_shapes() -> Iterator[None]:
    """torch logs, at warning level, each value Python read during an export (with the graph so
    far) and each decision real-value propagation took: an export that fails on such a read is
    reported by autopar's own error, and the decisions are the guards autopar keeps, so neither
    is for the user to act on."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def reading_real_values() -> Iterator[None]:
    """torch.export's real-tensor propagation (what its draft export uses): fake tensors carry the
    real values, so a value Python reads is known, the branch it picks is taken and the condition
    is kept as a runtime assertion.

    torch 2.13 fakes a parameter with uninitialized memory as its real value: the meta converter
    copies the real data only from a tensor whose type is exactly `torch.Tensor`
    (`meta_utils._safe_copy`), and an `nn.Parameter` is not. A value computed from the weights
    then differed from run to run (a softmax of garbage made `multinomial` raise, I-BERT's range
    check saw NaN). While the export runs, the copy takes parameters too
    (docs/debugging.md#value-guards; tests/test_value_guards.py)."""
    original = meta_utils._safe_copy

    def copy_parameters_too(dst: torch.Tensor, src: torch.Tensor | None) -> None:
        if isinstance(src, nn.Parameter):
            dst.copy_(src.detach())
            return
        original(dst, src)

    meta_utils._safe_copy = copy_parameters_too
    try:
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            yield
    finally:
        meta_utils._safe_copy = original
