"""Several ranks' programs compiled in one process (the lockstep runs of the tests and the zoo
sweeps) schedule each distinct graph once.

A real job compiles one rank per process. An in-process run compiles every rank of the mesh from
one trace and one plan, so the ranks' lowered graphs (after insert_comm and the decomposition of
collective matmuls) are mostly the same graph: the same nodes, targets, layouts and local sizes,
differing only in where a rank's block starts (the offsets of the slices insert_comm cuts a
replicated value with). The schedule stage (bucketing, then the list schedule on the modeled clock)
reads the graph's structure, each node's metadata (`NodeInfo`, the fake value, the byte and flop
counts the passes record) and the arguments of the collectives, never the constant arguments of
the local copies around them. So two lowered graphs equal in all of that are scheduled the same
way, and the second rank's scheduled graph is the first's with the second's own constants and node
metadata put back: `RankShare.schedule` checks that equality node for node and makes it so, or
schedules the graph itself where anything differs (an uneven block, a rank that zeroes a pending
sum: another local size, another op).

It also holds the fake-tensor results of the emitted programs' shape check
(`autopar.passes.emit.CallMemo`): each distinct op call is propagated once for all the ranks.

Everything is held by the object the caller makes for one run of every rank (no global state);
`tests/test_rank_share.py` checks that every rank's program equals the one its own compile makes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autopar.core.collectives import COLLECTIVES
from autopar.core.meta import NODE_KEY, has_info, info
from autopar.passes.emit import CallMemo

c10d = torch.ops._c10d_functional
SCHEDULE_REPORT_KEY = "autopar_schedule"  # gm.meta: the schedule stage's report
MAX_TEMPLATES = 4  # distinct scheduled graphs kept: ranks of other block sizes, rank 0 of a zeroed sum


@dataclass(frozen=True)
class _Ref:
    """A node argument, by name (a constant string argument is not one)."""

    name: str


@dataclass
class _Form:
    """What the schedule stage may read of one lowered node, and the constants it does not."""

    name: str
    op: str
    target: Any
    spec: Any  # the containers of (args, kwargs) (`_flatten`)
    leaves: list[Any]  # nodes as their names; other leaves as they are
    meta: dict[str, Any]  # the "autopar..." entries
    val: Any  # the fake value's shape, stride and dtype
    free: bool  # a local copy of insert_comm's: its constant arguments may differ between ranks


@dataclass
class _Template:
    key: tuple[Any, ...]  # the schedule's own arguments
    forms: list[_Form]  # the lowered graph, before it was scheduled
    scheduled: fx.GraphModule  # what the schedule made of it (the rank's own graph)


@dataclass
class RankShare:
    """Made by the caller of an in-process compile of several ranks and handed to every rank's
    `compile_for_rank` (`share=`)."""

    templates: list[_Template] = field(default_factory=list)
    calls: CallMemo = field(default_factory=CallMemo)
    scheduled: int = 0  # graphs the schedule stage ran on
    reused: int = 0  # graphs made from a template

    def schedule(
        self, gm: fx.GraphModule, key: tuple[Any, ...], run: Callable[[fx.GraphModule], fx.GraphModule]
    ) -> fx.GraphModule:
        """`run(gm)` (the schedule stage with the arguments `key` names), or the same result made
        from the scheduled graph of an earlier rank whose lowered graph was this one but for the
        constant arguments of insert_comm's local copies."""
        forms = _forms(gm)
        for template in self.templates:
            if template.key != key:
                continue
            changes = _constant_changes(template.forms, forms)
            if changes is None:
                continue
            made = _rebuilt(template, gm, changes)
            if made is not None:
                self.reused += 1
                return made
        out = run(gm)
        self.scheduled += 1
        if len(self.templates) < MAX_TEMPLATES and _kept_metadata(forms, out):
            # the rank's own graph, not a copy: nothing after the schedule stage rewrites it
            # (emit copies its nodes), and the rebuild only reads it
            self.templates.append(_Template(key, forms, out))
        return out


def _forms(gm: fx.GraphModule) -> list[_Form]:
    forms = []
    for node in gm.graph.nodes:
        leaves: list[Any] = []
        spec = _flatten((node.args, node.kwargs), leaves)
        forms.append(
            _Form(
                node.name,
                node.op,
                node.target,
                spec,
                leaves,
                {k: v for k, v in node.meta.items() if k.startswith(NODE_KEY)},
                _value_form(node.meta.get("val")),
                node.op == "call_function"
                and has_info(node)
                and info(node).role == "comm"
                and node.target not in COLLECTIVES
                and node.target is not c10d.wait_tensor.default,
            )
        )
    return forms


def _flatten(x: Any, leaves: list[Any]) -> Any:
    """`x`'s containers (the spec: tuples, lists and dicts, each leaf a None) and its leaves in
    order, nodes as `_Ref`s; a cheaper `tree_flatten` for the containers fx arguments hold."""
    if isinstance(x, (tuple, list)):
        return (type(x), tuple([_flatten(v, leaves) for v in x]))
    if isinstance(x, dict):
        return (dict, tuple([(k, _flatten(v, leaves)) for k, v in x.items()]))
    leaves.append(_Ref(x.name) if isinstance(x, fx.Node) else x)
    return None


def _unflatten(spec: Any, leaves: Iterator[Any]) -> Any:
    if spec is None:
        return next(leaves)
    kind, items = spec
    if kind is dict:
        return {k: _unflatten(v, leaves) for k, v in items}
    return kind(_unflatten(v, leaves) for v in items)


def _value_form(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        if not all(isinstance(s, int) for s in (*val.shape, *val.stride())):
            return object()  # symbolic sizes: equal to no other
        return (tuple(val.shape), val.stride(), val.dtype)
    if isinstance(val, (list, tuple)):
        return tuple(_value_form(v) for v in val)
    return type(val) if val is not None else None


def _constant_changes(old: list[_Form], new: list[_Form]) -> dict[str, list[tuple[int, Any]]] | None:
    """Per node name, the leaves (index, new value) where `new` differs from `old`; None where the
    graphs differ in anything but the constants of free nodes."""
    if len(old) != len(new):
        return None
    changes: dict[str, list[tuple[int, Any]]] = {}
    for a, b in zip(old, new):
        if (
            a.name != b.name
            or a.op != b.op
            or a.target != b.target
            or a.spec != b.spec
            or a.val != b.val
            or a.free != b.free
            or a.meta != b.meta
        ):
            return None
        if a.leaves == b.leaves:
            continue
        if not a.free:
            return None
        diff = []
        for i, (x, y) in enumerate(zip(a.leaves, b.leaves)):
            if type(x) is not type(y):
                return None
            if x != y:
                if not isinstance(x, (int, float)):
                    return None  # another input, group or object: structure, not a number
                diff.append((i, y))
        changes[a.name] = diff
    return changes


def _kept_metadata(forms: list[_Form], scheduled: fx.GraphModule) -> bool:
    """Whether the schedule left every lowered node's own metadata as it was (it adds nodes, moves
    and removes them): then a later rank's scheduled graph carries that rank's metadata."""
    by_name = {f.name: f for f in forms}
    for node in scheduled.graph.nodes:
        form = by_name.get(node.name)
        if form is None:
            continue
        now = {k: v for k, v in node.meta.items() if k.startswith(NODE_KEY)}
        if now.keys() != form.meta.keys() or any(now[k] is not v for k, v in form.meta.items()):
            return False
    return True


def _rebuilt(template: _Template, gm: fx.GraphModule, changes: dict[str, list[tuple[int, Any]]]) -> fx.GraphModule | None:
    """`gm` given the template's scheduled graph, with its own node metadata and changed constants
    (nodes the schedule made keep the template's); None where a changed node's arguments are not
    where the template's lowered graph had them."""
    mine = {n.name: n for n in gm.graph.nodes}
    old = {f.name: f for f in template.forms}
    graph = fx.Graph(tracer_cls=gm.graph._tracer_cls)
    graph._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    for node in template.scheduled.graph.nodes:
        new = env[node] = graph.node_copy(node, env.__getitem__)
        if new.name != node.name:
            return None
        own = mine.get(node.name)
        if own is None:
            continue  # made by the schedule stage (a bucket's buffers)
        new.meta = own.meta
        diff = changes.get(node.name)
        if not diff:
            continue
        refs: list[Any] = []
        spec = _flatten((new.args, new.kwargs), refs)
        before = old[node.name].leaves
        for i, value in diff:
            if isinstance(refs[i], _Ref) or refs[i] != before[i]:
                return None
            refs[i] = value
        inputs = {n.name: n for n in new.all_input_nodes}
        new.args, new.kwargs = _unflatten(spec, iter([inputs[x.name] if isinstance(x, _Ref) else x for x in refs]))
    gm.graph = graph  # (recompiles)
    gm.meta[SCHEDULE_REPORT_KEY] = copy.deepcopy(template.scheduled.meta.get(SCHEDULE_REPORT_KEY))
    return gm
