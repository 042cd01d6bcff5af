"""Part of trace: the user inputs whose values index a tensor, for the module to check at call time.

An embedding, a gather or a loss's target lookup fails on a value out of range, serially with an
IndexError. On a mesh the op holds a block on most ranks, so some ranks would raise and the others
wait in their next collective for peers that are gone. Following each such op's index back to a
user input through ops that keep its values (views, copies, slices, padding, the `where(x != c,
x, 0)` by which a loss masks its ignored targets) finds what to check on the global input before
any collective runs (`IndexCheck`, run by `autopar.runtime.module`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.core.meta import IndexCheck, has_info, info

aten = torch.ops.aten

# op -> (position of the indexed tensor, position of the index, position of the indexed dim or
# None for dim 0 of an embedding's weight)
INDEXING_OPS: dict[object, tuple[int, int, int | None]] = {
    aten.embedding.default: (0, 1, None),
    aten.gather.default: (0, 2, 1),
    aten.index_select.default: (0, 2, 1),
    aten.scatter.value: (0, 2, 1),
    aten.scatter.src: (0, 2, 1),
    aten.scatter_add.default: (0, 2, 1),
}
NLL_LOSSES = {aten.nll_loss_forward.default, aten.nll_loss2d_forward.default}

# ops whose output holds only values of their first argument (or constants they add)
VALUE_KEEPING = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.expand.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.clone.default,
    aten.alias.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.flatten.using_ints,
    aten.constant_pad_nd.default,
    aten.contiguous.default,
}


def find_index_checks(gm: fx.GraphModule) -> list[IndexCheck]:
    """One check per (input, bound, ignored values) that some forward op indexes with."""
    checks: dict[tuple[int, int, tuple[int, ...]], IndexCheck] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not has_info(node) or info(node).phase != "forward":
            continue
        found = _indexing(node)
        if found is None:
            continue
        index, bound, ignored = found
        source = _input_source(index)
        if source is None:
            continue
        input_index, masked = source
        kept = tuple(sorted(set(ignored) | masked))
        key = (input_index, bound, kept)
        if key not in checks:
            op = f"{node.target}"
            checks[key] = IndexCheck(input_index, bound, kept, op, info(node).where())
    return list(checks.values())


def _indexing(node: fx.Node) -> tuple[fx.Node, int, tuple[int, ...]] | None:
    """(index node, bound, values ignored by the op itself) of an op that indexes, else None."""
    if node.target in NLL_LOSSES:  # (self, target, weight, reduction, ignore_index)
        logits, target = node.args[0], node.args[1]
        ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
        shape = _shape(logits)
        if not isinstance(target, fx.Node) or shape is None:
            return None
        classes = shape[1] if len(shape) > 1 else shape[0]
        return target, classes, (int(ignore),)  # type: ignore[arg-type]
    spec = INDEXING_OPS.get(node.target)
    if spec is None:
        return None
    tensor_at, index_at, dim_at = spec
    if len(node.args) <= index_at:
        return None
    tensor, index = node.args[tensor_at], node.args[index_at]
    shape = _shape(tensor)
    if not isinstance(index, fx.Node) or shape is None:
        return None
    dim = 0 if dim_at is None else int(node.args[dim_at])  # type: ignore[arg-type]
    return index, shape[dim % len(shape)] if shape else 1, ()


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return tuple(int(d) for d in val.shape)
    except TypeError:  # a symbolic size
        return None


def _input_source(node: fx.Node) -> tuple[int, set[int]] | None:
    """The tensor input whose values `node` holds, with the values masked out on the way (a
    `where(x != c, x, other)`), or None when the index is computed from anything else."""
    masked: set[int] = set()
    while True:
        if node.op == "placeholder":
            if has_info(node) and info(node).role == "input" and info(node).input_index is not None:
                return info(node).input_index, masked  # type: ignore[return-value]
            return None
        if node.op != "call_function":
            return None
        if node.target in VALUE_KEEPING and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            continue
        if node.target == aten._to_copy.default and _is_integer(node) and _is_integer(node.args[0]):
            node = node.args[0]  # type: ignore[assignment]  # labels.long()
            continue
        if node.target == aten.where.self:
            cond, kept, _ = node.args
            if (
                isinstance(cond, fx.Node)
                and cond.target == aten.ne.Scalar
                and cond.args[0] is kept
                and isinstance(cond.args[1], int)
                and isinstance(kept, fx.Node)
            ):
                masked.add(cond.args[1])
                node = kept
                continue
        return None


def _is_integer(node: object) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and not val.is_floating_point() and not val.is_complex() and val.dtype != torch.bool
