"""Checks of a call's inputs before its program runs: the same batch on every rank in the same
call, indices in range, gradients the program computes; and the names users know inputs by,
for those checks' errors. Each check that needs other ranks is one small collective that every
rank runs alike, so all raise together and none is left waiting in the program's collectives."""

from __future__ import annotations

import enum
import inspect
import operator
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.core.errors import IndexOutOfRangeError, InputMismatchError
from autopar.core.meta import IndexCheck
from autopar.runtime.agreement import (
    Disagreement,
    Fingerprint,
    PendingAgreement,
    collective_device,
    fingerprint,
)
from autopar.runtime.local_batch import index_extremes
from autopar.runtime.wire import all_gathered

CALLS = "the count of calls"  # the name of the call counter among the fingerprints
STRUCTURE = "the call's structure"  # arguments' nesting, keywords, shapes, dtypes, flag values


def refuse_input_gradients(
    tensors: Sequence[torch.Tensor], names: Sequence[str], computed: Sequence[int]
) -> None:
    """An input that wants a gradient the program does not compute would silently get none: a
    module built around one program (no compiler) refuses such a call."""
    if not torch.is_grad_enabled():
        return
    covered = {id(tensors[i]) for i in computed}  # a tensor passed twice is one input of the trace
    wanting = [name for name, x in zip(names, tensors) if x.requires_grad and id(x) not in covered]
    if wanting:
        raise InputMismatchError(
            f"{wanting[0]} requires a gradient, but the program was compiled for inputs that do not",
            hint="pass example_inputs that require grad as the call's do, or detach() the input",
        )


def check_indices(
    checks: Sequence[IndexCheck],
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    group: dist.ProcessGroup | None = None,
    across_ranks: bool = False,
) -> None:
    """Refuse, on every rank alike and before the program's first collective, an input value that
    an op would index out of range with (`IndexCheck`): the IndexError the serial model raises.
    Global inputs are the same on every rank; local shards are checked together (`across_ranks`)."""
    if not checks:
        return
    for check, extremes in zip(checks, index_extremes(checks, tensors, across_ranks, group)):
        if extremes is None:
            continue
        low, high = extremes
        if low >= 0 and high < check.bound:
            continue
        also = f" (or {', '.join(map(str, check.ignored))}, which the model ignores)" if check.ignored else ""
        raise IndexOutOfRangeError(
            f"index out of range: {names[check.input_index]} holds "
            f"{low if low < 0 else high}, but {check.op} takes 0 to {check.bound - 1}{also}",
            op=check.op,
            where=check.where,
            hint="the serial model raises IndexError on this batch too, and no rank has run any of "
            "it: check the data (token ids below the vocabulary size, targets below the number of "
            "classes) or skip the batch",
        )


def input_names(args: tuple[Any, ...], kwargs: dict[str, Any], positional: Sequence[str] = ()) -> list[str]:
    """The name of every tensor input as the user knows it: a keyword (`labels`), the forward's
    parameter a positional argument binds to (`positional`), else `argument 0`; `[1]`, `['a']`
    below that for a leaf inside a list or dict."""
    names = []
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        top, rest = path[1], path[2:]
        if isinstance(top, pytree.MappingKey):
            head = str(top.key)
        else:
            index = top.idx  # type: ignore[attr-defined]
            head = positional[index] if index < len(positional) else f"argument {index}"
        names.append(head + pytree.keystr(rest))
    return names


def positional_names(model: nn.Module) -> list[str]:
    """The names of the forward's parameters that a positional argument can bind to."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


@dataclass
class CallHistory:
    """What a rank remembers of its calls of a module to name a rank out of step: how many it
    made, and the fingerprints of the inputs of the last one that was checked."""

    calls: int = 0
    previous: list[Fingerprint] = field(default_factory=list)


def structure_digest(flat: Sequence[Any], spec: pytree.TreeSpec) -> float:
    """A number every rank computes alike for the same kind of call: the arguments' nesting and
    keywords, each tensor's shape and dtype, each plain value (flags) by type and value, other
    objects by type alone (their repr may hold an address that differs between processes)."""
    leaves: list[tuple[Any, ...]] = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            leaves.append(("tensor", tuple(x.shape), str(x.dtype)))
        elif x is None or isinstance(x, (bool, int, float, str, enum.Enum)):
            leaves.append((type(x).__name__, repr(x)))
        else:
            leaves.append((type(x).__qualname__,))
    return float(zlib.crc32(repr((str(spec), leaves)).encode()))


def refuse_differing_inputs(
    flat: Sequence[Any],
    names: Sequence[str],
    history: CallHistory,
    group: dist.ProcessGroup | None,
    structure: float = 0.0,
) -> None:
    """Every rank must pass the same global batch, in the same call: ranks that pass their own
    shards (as with a DistributedSampler) would train on a mixture, and so would a rank a call out
    of step (a batch repeated or a call that failed on it alone). The count of calls goes into the
    same all-reduce as the inputs' fingerprints; the call is refused on every rank alike, naming a
    rank whose count differs, or whose inputs are the ones the others passed a call before, as a
    call behind. (`InputCheck` without waiting: this is its start and its `settle` at once.)"""
    InputCheck(flat, names, history, group, structure).settle()


class InputCheck:
    """`refuse_differing_inputs` in two halves: made at the start of a call, it fingerprints the
    inputs and issues the all-reduce without waiting; `settle()` waits for it and raises what
    `refuse_differing_inputs` raises. Every rank must settle before its first other collective of
    the call (a compile's, the program's first: `InputGate`), since ranks that passed different
    calls may be about to run different programs, whose collectives would not match; settled
    there, every rank still refuses together before any result leaves the call, and the
    all-reduce travels while the rank computes its forward up to that collective."""

    def __init__(
        self,
        flat: Sequence[Any],
        names: Sequence[str],
        history: CallHistory,
        group: dist.ProcessGroup | None,
        structure: float = 0.0,
    ) -> None:
        self.prints = [fingerprint(x) for x in flat if isinstance(x, torch.Tensor)]
        self.previous, history.previous = history.previous, self.prints
        self.group = group
        self.named = [(CALLS, (float(history.calls),)), (STRUCTURE, (structure,)), *zip(names, self.prints)]
        self.pending: PendingAgreement | None = PendingAgreement([(n, t, 0, 1) for n, t in self.named], group)

    def settle(self) -> None:
        """Wait for the all-reduce (once) and refuse the call on every rank alike if the ranks differ."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        differing = pending.result()
        if differing is not None:
            _refuse(differing, self.prints, self.previous, self.group)


GATE = "autopar_input_gate"  # the forward graph's attribute holding its `InputGate`


class InputGate:
    """Where a program's forward settles its call's `InputCheck` (`gate_forward`): the module
    hands the gate the check it started, and the forward settles it right before the first node
    that may communicate. A copy of the graph gets a gate of its own, with no check."""

    def __init__(self) -> None:
        self.check: InputCheck | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> InputGate:
        return InputGate()

    def settle(self) -> None:
        check, self.check = self.check, None
        if check is not None:
            check.settle()


def settle_gate(gate: InputGate) -> None:
    """The forward graph's call of its gate (a function, so that the graph's code names it)."""
    gate.settle()


def gate_forward(gm: fx.GraphModule) -> InputGate:
    """`gm`'s `InputGate`, inserted once before its first node that may communicate: anything but
    an ATen op or a tuple's item (a functional collective, a custom op that exchanges tokens, a
    call of a module), or its output. Under DDP's plan that is the loss's all-reduce, at the end
    of the forward: the check's all-reduce travels while the forward computes, and the rank waits
    at one collective where it waited at two."""
    found = getattr(gm, GATE, None)
    if isinstance(found, InputGate):
        return found
    gate = InputGate()
    setattr(gm, GATE, gate)
    graph = gm.graph
    first = next(n for n in graph.nodes if _may_communicate(n))
    with graph.inserting_before(first):
        # (create_node: `get_attr` warns about an attribute that is not a module, parameter or buffer)
        graph.call_function(settle_gate, (graph.create_node("get_attr", GATE),))
    gm.recompile()
    return gate


def _may_communicate(node: fx.Node) -> bool:
    if node.op in ("placeholder", "get_attr"):
        return False
    if node.op != "call_function":
        return True  # the output, a module's call
    if node.target is operator.getitem:
        return False
    return not (isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in ("aten", "prims"))


def _refuse(
    differing: Disagreement, prints: list[Fingerprint], previous: list[Fingerprint], group: dist.ProcessGroup | None
) -> None:
    """Raise the error of `InputCheck`'s disagreement: a rank calls behind, a call's structure, a
    rank one call behind or ahead, or another batch."""
    hint = (
        "every rank must call the module the same number of times, with the same batches in the "
        "same order: a rank that repeated a batch, or whose call failed alone, must be brought back in step"
    )
    if differing.name == CALLS:
        counts = [int(v[0]) for v in differing.values if v is not None]
        ahead = max(counts)
        behind = [f"rank {r} is {_calls(ahead - c)} behind" for r, c in enumerate(counts) if c < ahead]
        raise InputMismatchError(
            f"{', '.join(behind)} the others: this is call {ahead} of the module on the ranks ahead, "
            "so the ranks would train on different steps' batches",
            hint=hint,
        )
    if differing.name == STRUCTURE:
        raise InputMismatchError(
            f"rank {differing.rank} calls the module differently from rank {differing.first}: the "
            "arguments' structure (keywords where the others pass positions, or the reverse), a "
            "tensor's shape or dtype, or a flag's value differ, so the ranks would run different programs",
            hint="call the module the same way on every rank, with the same arguments by position or keyword",
        )
    everyone = all_gathered((prints, previous), group, collective_device(group))  # every rank is here alike
    for ahead in (False, True):  # a rank behind the others is its peers ahead of it: name it so
        for rank, (mine, before) in enumerate(everyone):
            others = [e for r, e in enumerate(everyone) if r != rank]
            if not others or any(o != others[0] for o in others):
                continue
            if not ahead and mine == others[0][1]:
                raise InputMismatchError(
                    f"rank {rank} is 1 call behind the others: it passes the inputs the others passed "
                    f"in their previous call ({differing.name} differs between rank {differing.first} "
                    f"and rank {differing.rank})",
                    hint=hint,
                )
            if ahead and before == others[0][0]:
                raise InputMismatchError(
                    f"rank {rank} is 1 call ahead of the others: it passed in its previous call the "
                    f"inputs the others pass now ({differing.name} differs between rank "
                    f"{differing.first} and rank {differing.rank})",
                    hint=hint,
                )
    raise InputMismatchError(
        f"{differing.name} differs between rank {differing.first} and rank {differing.rank}: "
        "every rank must pass the same global batch",
        hint="give every rank the whole batch (the same sampler seed on every rank, no "
        "DistributedSampler); parallelize(..., debug=DebugOptions(check_inputs=False)) skips this check",
    )


def _calls(n: int) -> str:
    return f"{n} call{'s' if n > 1 else ''}"
