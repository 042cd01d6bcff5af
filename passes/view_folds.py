"""Part of stage 5, emit: a transpose of a transpose is the tensor itself, and a reshape of a
reshape is one reshape.

The joint trace writes a linear's weight gradient as `t(t(mm(t(g), x)))` (the gradient of the
forward's `t(W)` is the transpose of the gradient of its result), so each linear's backward makes
two `t` calls whose result is the `mm`'s own tensor (the same values, sizes and strides): on the
peers GPT (24 linears) 48 of the backward's ~580 ATen calls per step. Each costs a rank a few
microseconds of dispatch in an emitted graph; Inductor would fold them, the eager graphs autopar
runs do not. The fold reads each user of the outer `t` the inner one's input instead; the inner
`t` goes when nothing else reads it.

Likewise the trace and localization leave reshapes of reshapes (a linear's [1, 64, 256] output
flattened to [64, 256] and back; 58 on that GPT's program): `reshape(reshape(x, a), b)` holds the
values of `reshape(x, b)`, which is one call (a view where the strides allow, as the chain's last
step is). Whether a reshape is a view or a copy then changes no value as long as nothing writes
in place: a graph with an ATen op that does (a masked write, a random fill) is left as it is (a
bucket's sum in place on the `cat` it made is a c10d op, on a fresh buffer).
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def fold_double_transposes(gm: fx.GraphModule) -> int:
    """Replace every `t(t(x))` of `gm` by `x`; returns how many were folded. (`t` takes tensors of
    at most 2 dims, on which it is its own inverse; a view of `x` or `x` itself reads the same.)"""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.t.default:
            continue
        inner = node.args[0]
        if not isinstance(inner, fx.Node) or inner.op != "call_function" or inner.target is not aten.t.default:
            continue
        source = inner.args[0]
        assert isinstance(source, fx.Node)
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        if not inner.users:
            gm.graph.erase_node(inner)
        folded += 1
    if folded:
        gm.recompile()
    return folded


_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def fold_reshape_chains(gm: fx.GraphModule) -> int:
    """Make every reshape (`reshape`, `view`, `_unsafe_view`) of a reshape one `reshape` of the
    first one's input; returns how many were folded. (A `view` becomes a `reshape`: `view` of the
    first input may be refused where its strides do not allow it, `reshape` then copies.)"""
    if any(_writes_in_place(n) for n in gm.graph.nodes):
        return 0
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _RESHAPES:
            continue
        inner = node.args[0]
        if not isinstance(inner, fx.Node) or inner.op != "call_function" or inner.target not in _RESHAPES:
            continue
        node.target = aten.reshape.default
        node.args = (inner.args[0], *node.args[1:])
        if not inner.users:
            gm.graph.erase_node(inner)
        folded += 1
    if folded:
        gm.recompile()
    return folded


def _writes_in_place(node: fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == "aten"
        and target._schema.is_mutable
    )
