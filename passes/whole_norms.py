"""Layer norms put back whole in a rank's emitted graphs where the plan left them whole.

The trace writes layer norm and its backward as sums and pointwise ops whenever the mesh has more
than one rank (`autopar.rules.decompositions`), so that a plan may split the normalized dim and pay
a small all-reduce of the sums. A plan that does not split it (DDP's, and every plan that splits
only the batch or sequence around a norm) then runs ~11 ops in forward and ~15 in backward per
norm where serial runs one kernel each way: on a CPU rank that is per-op dispatch and passes over
the activation, paid at every step.

This part of emit finds each decomposition in the local graphs, by the ops our decomposition
writes and by torch's record of which op a node was decomposed from (`original_aten`), and puts
`native_layer_norm` / `native_layer_norm_backward` back where the local computation is exactly a
layer norm of the local tensor: every op of the group directly reads the previous one (no
collective, so no sum crosses ranks), the summed dims are the tensor's trailing dims, whole on
this rank (their local element count is the count the decomposition divides by), and nothing
outside the group reads an intermediate. Anything else is left as traced. The kernels compute the
same function with their own summation order, serial's.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

aten = torch.ops.aten
FORWARD = aten.native_layer_norm.default
BACKWARD = aten.native_layer_norm_backward.default
_FORWARD, _BACKWARD = str(FORWARD), str(BACKWARD)

# Patterns: (target, *args); a str names a value (upper case: a node or constant from outside the
# group, bound once; lower case: a node of the group); other values must be equal.
_MEAN = (aten.div.Tensor, (aten.sum.dim_IntList, "X", "$dims", True), "$count")
_CENTERED = (aten.sub.Tensor, "X", _MEAN)
_RSTD = (
    aten.rsqrt.default,
    (aten.add.Tensor, (aten.div.Tensor, (aten.sum.dim_IntList, (aten.mul.Tensor, _CENTERED, _CENTERED), "$dims", True), "$count"), "$eps"),
)
_NORMED = (aten.mul.Tensor, _CENTERED, _RSTD)
_FORWARD_WB = (aten.add.Tensor, (aten.mul.Tensor, _NORMED, "W"), "B")
_FORWARD_W = (aten.mul.Tensor, _NORMED, "W")

_XHAT = (aten.mul.Tensor, (aten.sub.Tensor, "X", "MEAN"), "RSTD")
_G = (aten.mul.Tensor, "GO", "W")
_GRAD_X = (
    aten.mul.Tensor,
    (
        aten.sub.Tensor,
        (aten.sub.Tensor, _G, (aten.div.Tensor, (aten.sum.dim_IntList, _G, "$dims", True), "$count")),
        (aten.mul.Tensor, _XHAT, (aten.div.Tensor, (aten.sum.dim_IntList, (aten.mul.Tensor, _G, _XHAT), "$dims", True), "$count")),
    ),
    "RSTD",
)
_GRAD_W = (aten.sum.dim_IntList, (aten.mul.Tensor, "GO", _XHAT), "$outer")


def _origin(node: fx.Node) -> str:
    """The op `node` was decomposed from, by name: the record is an `OpOverload`, and copies of
    the graph (`graph_copy`, repeated blocks) hold copies of it."""
    return str(node.meta.get("original_aten"))


@dataclass
class _Match:
    """One attempt at matching a pattern: what its names stand for and which nodes it covered."""

    origin: str  # the op the group's nodes were decomposed from
    bound: dict[str, Any] = field(default_factory=dict)
    nodes: dict[tuple[Any, ...], fx.Node] = field(default_factory=dict)  # pattern -> node (shared subpatterns once)

    def match(self, pattern: Any, value: Any) -> bool:
        if isinstance(pattern, str):
            if pattern in self.bound:
                return self.bound[pattern] is value or (not isinstance(value, fx.Node) and self.bound[pattern] == value)
            self.bound[pattern] = value
            return True
        if not isinstance(pattern, tuple):
            return not isinstance(value, fx.Node) and pattern == value
        if pattern in self.nodes:
            return self.nodes[pattern] is value
        if not isinstance(value, fx.Node) or value.op != "call_function" or value.target is not pattern[0]:
            return False
        if _origin(value) != self.origin or value.kwargs or len(value.args) != len(pattern) - 1:
            return False
        self.nodes[pattern] = value
        return all(self.match(p, a) for p, a in zip(pattern[1:], value.args))

    def trailing(self, x: fx.Node) -> list[int] | None:
        """The normalized shape, when the summed dims are x's trailing dims and hold the count the
        decomposition divides by (whole on this rank)."""
        val = x.meta.get("val")
        dims, count = self.bound.get("$dims"), self.bound.get("$count")
        if not isinstance(val, torch.Tensor) or not isinstance(dims, list) or not dims:
            return None
        axis = val.dim() - len(dims)
        if axis < 0 or dims != list(range(axis, val.dim())):
            return None
        shape = [int(s) for s in val.shape[axis:]]
        return shape if math.prod(shape) == count else None


def _closed(group: set[fx.Node], outputs: Sequence[fx.Node]) -> bool:
    """Nothing outside the group reads a value of it other than `outputs`."""
    return all(u in group for n in group if n not in outputs for u in n.users)


def _insert_point(graph: fx.Graph, inputs: Sequence[Any], outputs: Sequence[fx.Node], group: set[fx.Node]) -> fx.Node | None:
    """The node the fused op goes before: right after the last of its inputs, provided every reader
    of the outputs outside the group comes later. None when the order does not allow it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max((order[i] for i in inputs if isinstance(i, fx.Node)), default=-1)
    first_use = min((order[u] for o in outputs for u in o.users if u not in group), default=len(order))
    if first_use <= last:
        return None
    return next(n for n in graph.nodes if order[n] == last + 1)


def _fits(op: Any, args: tuple[Any, ...], outputs: Sequence[fx.Node | None]) -> bool:
    """The kernel's results have the shapes and dtypes of the values it replaces (a norm of low
    precision tensors whose kernel keeps its statistics in float32 stays decomposed)."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
    if mode is None or any(isinstance(a, fx.Node) and not isinstance(v, FakeTensor) for a, v in zip(args, vals)):
        return False
    with mode:
        results = op(*vals)
    for result, old in zip(results, outputs):
        val = old.meta.get("val") if old is not None else None
        if old is not None and (
            not isinstance(val, torch.Tensor) or val.shape != result.shape or val.dtype != result.dtype
        ):
            return False
    return True


def _replace(
    graph: fx.Graph,
    before: fx.Node,
    call: Callable[[], fx.Node],
    outputs: Sequence[fx.Node | None],
    group: set[fx.Node],
) -> set[fx.Node]:
    root = outputs[0]
    assert root is not None
    items: dict[fx.Node, fx.Node] = {}  # replaced value -> the fused op's result standing for it
    with graph.inserting_before(before):
        fused = call()
        fused.meta.update({k: v for k, v in root.meta.items() if k in ("stack_trace", "nn_module_stack")})
        for index, old in enumerate(outputs):
            if old is not None:
                items[old] = graph.call_function(operator.getitem, (fused, index))
                items[old].meta.update({k: v for k, v in old.meta.items() if k != "original_aten"})  # (no longer one)
    fused.meta["val"] = tuple(old.meta.get("val") if old is not None else None for old in outputs)
    for old, item in items.items():
        old.replace_all_uses_with(item)
    for node in reversed(list(graph.nodes)):
        if node in group and not node.users:
            graph.erase_node(node)
    return group


def _whole_forward(graph: fx.Graph, root: fx.Node) -> set[fx.Node]:
    for pattern in (_FORWARD_WB, _FORWARD_W):
        m = _Match(_FORWARD)
        if m.match(pattern, root):
            break
    else:
        return set()
    x, eps = m.bound["X"], m.bound["$eps"]
    shape = m.trailing(x)
    if shape is None or not isinstance(eps, (int, float)):
        return set()
    mean, rstd = m.nodes[_MEAN], m.nodes[_RSTD]
    group = set(m.nodes.values())
    outputs = [root, mean, rstd]
    if not _closed(group, outputs):
        return set()
    w, b = m.bound["W"], m.bound.get("B")
    before = _insert_point(graph, [x, w, b], outputs, group)
    if before is None:
        return set()
    args = (x, shape, w, b, float(eps))
    if not _fits(FORWARD, args, outputs):
        return set()
    return _replace(graph, before, lambda: graph.call_function(FORWARD, args), outputs, group)


def _whole_backward(graph: fx.Graph, root: fx.Node) -> set[fx.Node]:
    m = _Match(_BACKWARD)
    if not m.match(_GRAD_X, root):
        return set()
    x = m.bound["X"]
    shape = m.trailing(x)
    if shape is None:
        return set()
    xhat = m.nodes[_XHAT]
    grad_w = None
    for user in xhat.users:  # the weight's gradient: sum over the outer dims of GO * xhat
        for candidate in user.users:
            trial = _Match(_BACKWARD, dict(m.bound), dict(m.nodes))
            axis = len(x.meta["val"].shape) - len(shape)
            if trial.match(_GRAD_W, candidate) and trial.bound["$outer"] == list(range(axis)) and axis > 0:
                m, grad_w = trial, candidate
                break
        if grad_w is not None:
            break
    group = set(m.nodes.values())
    outputs = [root, grad_w] if grad_w is not None else [root]
    if not _closed(group, outputs):
        return set()
    go, mean, rstd, w = m.bound["GO"], m.bound["MEAN"], m.bound["RSTD"], m.bound["W"]
    before = _insert_point(graph, [go, x, mean, rstd, w], outputs, group)
    if before is None:
        return set()
    mask = [True, grad_w is not None, False]  # the bias's gradient stays the one sum it is
    args = (go, x, shape, mean, rstd, w, None, mask)
    if not _fits(BACKWARD, args, [root, grad_w]):
        return set()
    return _replace(graph, before, lambda: graph.call_function(BACKWARD, args), [root, grad_w], group)


def whole_layer_norms(gm: fx.GraphModule) -> int:
    """Put back whole every decomposed layer norm of `gm` (a rank's local forward or backward graph,
    its nodes' `val` local) whose computation is one on this rank; returns how many."""
    count = 0
    gone: set[fx.Node] = set()
    # last to first: a norm's last op (the bias's add) is met before the weight's mul it reads
    for node in reversed(list(gm.graph.nodes)):
        if node in gone or node.op != "call_function":
            continue
        origin = _origin(node)
        replaced: set[fx.Node] = set()
        if origin == _FORWARD and node.target in (aten.add.Tensor, aten.mul.Tensor):
            replaced = _whole_forward(gm.graph, node)
        elif origin == _BACKWARD and node.target is aten.mul.Tensor:
            replaced = _whole_backward(gm.graph, node)
        gone |= replaced
        count += bool(replaced)
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
