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
cannot be evaluated ahead of the program and is refused with the reason; so is such a value
where it feeds a size the rest of the graph uses. A size read from the inputs alone is made a
number at the example's value, with its guard (`autopar.passes.value_sizes`).
"""

from __future__ import annotations

import contextlib
import copy
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
from autopar.core.graph_order import ancestors, written_root
from autopar.core.value_guards import ValueGuards, generators_kept
from autopar.passes.masked_writes import masked_writes_as_where
from autopar.passes.random_guards import (
    ValueStep,
    draws,
    draws_before,
    replayable,
    value_ancestors,
    value_inputs,
)
from autopar.passes.trace_errors import DATA_DEPENDENT_HINT
from autopar.passes.value_sizes import (
    ASSERT,
    CONSTRAINTS,
    VALUE_READS,
    erase_dead_reads,
    fix_input_sizes,
    guard_sized_reads,
    pin_read_sizes,
    reads_state,
    sets_a_size,
    sizes_as_numbers,
    subprogram,
)

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
    values fix the sizes of `nonzero` on the inputs alone (`fix_input_sizes`)."""
    graph = module.graph
    masked_writes_as_where(module)  # `x[mask] = v`: no size the mask decides, so no guard either
    counted = fix_input_sizes(module, example) if example is not None else set()
    # a size read from the inputs gets its guard (a whole-batch condition, as a branch: on a
    # pipeline the value is the serial model's, not a microbatch's)
    guard_sized_reads(module, value_inputs(graph))
    checks = [n for n in graph.nodes if n.target is ASSERT or n.target in CONSTRAINTS]
    # one scan of the graph for every walk below: from here on nodes are only erased or rewired
    inputs_of = value_inputs(graph)
    sizes_as_numbers(module, checks, inputs_of)
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
        sized = sets_a_size(read)
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
    pin_read_sizes(graph, asserts)
    chain = value_ancestors(asserts, inputs_of)
    replays = draws_before(graph, chain, where)
    guard_module, inputs = _guard_program(module, placeholders, chain, asserts, replays)
    conditions = tuple(_condition(a, where, inputs_of) for a in asserts if a.target is ASSERT)
    counts = tuple(a in counted for a in asserts if a.target is ASSERT)
    for node in reversed(list(graph.nodes)):  # the asserts, then what only they used; draws stay
        unused_part = node.target is operator.getitem and node.args[0] in chain  # of a tuple they read
        # an in-place write (`mask[:, 0] = 1`) has no users, and the program still needs it
        removable = node.op == "call_function" and not draws(node) and written_root(node) is None
        if (node in chain or unused_part) and not node.users and removable:
            graph.erase_node(node)
    erase_dead_reads(module)
    left = [n for n in graph.nodes if n.op == "call_function" and n.target in VALUE_READS]
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


def _first_read(chain: set[fx.Node], near: fx.Node) -> fx.Node | None:
    """The value read (`item`) in `chain` downstream of `near`, for the error's location."""
    frontier = [near]
    seen: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target in VALUE_READS:
            return node
        frontier.extend(u for u in node.users if u in chain)
    return None


def _read_of(node: fx.Node) -> fx.Node:
    """The value read (`item`) a guard tests: the user's line for it (the assertion itself is
    torch's)."""
    reads = [n for n in ancestors([node]) if n.target in VALUE_READS]
    return reads[0] if reads else node


def _guard_program(
    module: fx.GraphModule,
    placeholders: list[fx.Node],
    chain: set[fx.Node],
    asserts: list[fx.Node],
    replays: Sequence[fx.Node],
) -> tuple[fx.GraphModule, tuple[int, ...]]:
    """A graph over the inputs the guards read, returning each assertion's condition."""
    body = {n for n in chain if n.target is not ASSERT and n.target not in CONSTRAINTS}
    conditions = [a.args[0] for a in asserts if a.target is ASSERT]
    return subprogram(module, placeholders, body, conditions or [True], replays)


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
