"""Part of the trace stage: rewrites of the joint graph right after AOTAutograd's export, before
any layout is chosen: tied parameters made one placeholder, identity checks dropped, whole-buffer
restrides made views, and repeated identical calls merged (each keeps the graph's meaning and
makes it simpler to plan)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.core.meta import SIGNATURE_KEY, JointSignature, NodeInfo, info, set_info


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Parameter names of the user's model that alias the same tensor."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def merge_tied(gm: fx.GraphModule, groups: list[list[str]]) -> None:
    """One placeholder per tied weight, named by the first alias; its gradient sums the aliases'.

    torch.export may route every use of a tied weight through one alias and give the others no
    uses and no gradient; either way one placeholder and one summed gradient remain.
    """
    sig: JointSignature = gm.meta[SIGNATURE_KEY]
    placeholders = {
        info(n).param_name: n for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "param"
    }
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    nu = sig.num_user_outputs
    input_grads = outs[sig.num_param_grads_end :]
    for group in groups:
        present = [name for name in group if name in placeholders]
        canonical = group[0]
        for alias in group[1:]:
            sig.aliases[alias] = canonical
        if not present:
            continue
        keep = next((placeholders[n] for n in present if placeholders[n].users), placeholders[present[0]])
        with_grads = [n for n in present if n in sig.grad_of]  # none in a forward-only graph
        grads = [outs[nu + sig.grad_of.index(n)] for n in with_grads]
        grads = [g for g in grads if g is not None]
        total = grads[0] if grads else None
        for g in grads[1:]:
            with gm.graph.inserting_before(output):
                summed = gm.graph.call_function(torch.ops.aten.add.Tensor, (total, g))
            summed.meta["val"] = g.meta["val"]
            set_info(summed, NodeInfo(role="compute", phase="backward", module_path="<tied weights>"))
            total = summed
        for name in present:
            node = placeholders[name]
            if node is not keep:
                node.replace_all_uses_with(keep)
                gm.graph.erase_node(node)
        info(keep).param_name = canonical
        for name in present:
            sig.param_names.remove(name)
        if not with_grads:
            continue
        slots = sorted(sig.grad_of.index(n) for n in with_grads)
        outs[nu + slots[0]] = total
        for slot in reversed(slots[1:]):
            del outs[nu + slot]
        for name in with_grads:
            sig.grad_of.remove(name)
        sig.grad_of.insert(slots[0], canonical)
    sig.param_names = [
        info(n).param_name or n.name
        for n in gm.graph.nodes
        if n.op == "placeholder" and info(n).role == "param"
    ]
    # Parameters the output does not depend on (a pooler the loss skips, a mask token used only
    # when masking) get no gradient, as in the serial model: their .grad stays None.
    kept = [(g, v) for g, v in zip(sig.grad_of, outs[nu:]) if v is not None]
    sig.grad_of = [g for g, _ in kept]
    output.args = (tuple(outs[:nu] + [v for _, v in kept] + input_grads),)


def drop_identities(gm: fx.GraphModule) -> None:
    """detach/alias nodes carry no computation for us; removing them keeps dumps readable.

    torch.export's `_assert_tensor_metadata` checks (emitted for dtype casts) have no result and
    no users; they were checked while tracing, and their global sizes would not hold locally.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
            continue
        if node.op == "call_function" and (
            node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) or _is_restride(node)
        ):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def simplify_strided(gm: fx.GraphModule) -> None:
    """`as_strided` and `as_strided_scatter` over a whole contiguous tensor in row-major strides
    are a view and a full overwrite: rewritten as `view` and `clone` + `view`, which have rules.
    Decompositions make them (adaptive average pooling's backward in Swin and FocalNet)."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.as_strided.default, aten.as_strided_scatter.default):
            continue
        scatter = node.target is aten.as_strided_scatter.default
        base = node.args[0]
        size, stride = node.args[2:4] if scatter else node.args[1:3]
        offset = node.args[4 if scatter else 3] if len(node.args) > (4 if scatter else 3) else 0
        val = base.meta.get("val") if isinstance(base, fx.Node) else None
        if not (isinstance(val, torch.Tensor) and val.is_contiguous() and val.storage_offset() == 0):
            continue
        if offset not in (0, None) or math.prod(size) != val.numel() or not _row_major(size, stride):  # type: ignore[arg-type]
            continue
        with gm.graph.inserting_before(node):
            if scatter:  # the whole of base overwritten by src, in row-major order
                src = node.args[1]
                copied = gm.graph.call_function(aten.clone.default, (src,), {"memory_format": torch.contiguous_format})
                copied.meta.update(node.meta)
                copied.meta["val"] = src.meta["val"].clone(memory_format=torch.contiguous_format)  # type: ignore[union-attr]
                new = gm.graph.call_function(aten.view.default, (copied, list(val.shape)))
            else:
                new = gm.graph.call_function(aten.view.default, (base, list(size)))  # type: ignore[arg-type]
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)


def _row_major(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Contiguous strides for `size`, dims of length 1 aside (their stride is never used)."""
    expected = 1
    for n, s in reversed(list(zip(size, stride))):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _is_restride(node: fx.Node) -> bool:
    """`as_strided(x, size, stride, offset)` that reads exactly x's elements where x has them: x's
    size and offset, and x's stride on every dim longer than 1. Decompositions restride this way
    (adaptive average pooling's keepdim mean in Swin and FocalNet): the identity on values."""
    if node.op != "call_function" or node.target is not torch.ops.aten.as_strided.default:
        return False
    source = node.args[0]
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    size, stride = list(node.args[1]), list(node.args[2])  # type: ignore[arg-type]
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
    if size != list(val.shape) or (offset is not None and offset != val.storage_offset()):
        return False
    return all(s == own for n, s, own in zip(size, stride, val.stride()) if n > 1)


def merge_repeated_calls(gm: fx.GraphModule) -> None:
    """One node per repeated pure call within a phase. The linears that `split_fused` makes from
    one fused linear each flatten the same input (three equal views): left apart, each would get
    its own redistribution of that input, where one serves all three."""
    seen: dict[Any, fx.Node] = {}
    outputs = set(next(n for n in reversed(gm.graph.nodes) if n.op == "output").all_input_nodes)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node in outputs or not _mergeable(node.target):
            continue
        try:
            key = (node.target, _frozen(node.args), _frozen(node.kwargs), info(node).phase)
            hash(key)
        except TypeError:  # an unhashable constant argument
            continue
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)


def _mergeable(target: Any) -> bool:
    """Functional ATen ops whose result depends only on their arguments (no randomness)."""
    return (
        isinstance(target, torch._ops.OpOverload)
        and not target._schema.is_mutable
        and torch.Tag.nondeterministic_seeded not in target.tags
        and torch.Tag.nondeterministic_bitwise not in target.tags
    )


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _frozen(v)) for k, v in value.items()))
    return value
