"""Writes through a boolean mask (`x[mask] = v`) as `torch.where`: the same values, with no size
that the mask's values decide.

`x[mask] = v` is `index_put_(x, [mask], v)`, whose derivative (and the joint export's fake
kernels) turn the mask into `nonzero(mask)`: a size set by the mask's count, which a plan made
for fixed shapes cannot hold (T5Gemma2 writes its end-of-image embedding so,
`embeds[input_ids == eoi] = eoi_embedding`). When `v` is one value broadcast over the selected
positions (its shape broadcasts to `x`'s dims after the mask's), the write is
`where(mask[..., None, ...], v, x)` for every mask, whatever its count: no guard, no recompile.
A value per selected position (`v` of shape `(count, ...)`) or an accumulating write is left as
it is (and refused downstream with the data-dependent size's reason).
"""

from __future__ import annotations

import torch
import torch.fx as fx

_WRITES = (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default)


def masked_writes_as_where(module: fx.GraphModule) -> int:
    """Rewrite, in place, each `index_put(_)` of `module` (torch.export's module) by one boolean
    mask with a value broadcast over the selected positions into `aten.where`; an in-place write
    to an intermediate also redirects the later reads of what it wrote to. Returns how many."""
    graph = module.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    done = 0
    for node in list(graph.nodes):
        if node.target not in _WRITES or not _broadcast_write(node):
            continue
        target, (mask,), value = node.args[:3]  # type: ignore[misc]
        assert isinstance(target, fx.Node) and isinstance(mask, fx.Node)
        in_place = node.target is torch.ops.aten.index_put_.default
        if in_place and not _rewritable_in_place(target, node, order):
            continue
        trailing = _val(target).dim() - _val(mask).dim()
        with graph.inserting_before(node):
            wide = graph.call_function(torch.ops.aten.view.default, (mask, [*_val(mask).shape, *[1] * trailing]))
            where = graph.call_function(torch.ops.aten.where.self, (wide, value, target))
        for made in (wide, where):
            made.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
        where.meta["val"] = node.meta.get("val")
        if in_place:  # the reads of `target` after the write see the written values
            for user in list(target.users):
                if user is not node and user is not where and order.get(user, -1) > order[node]:
                    user.replace_input_with(target, where)
        node.replace_all_uses_with(where)
        graph.erase_node(node)
        done += 1
    if done:
        graph.lint()
        module.recompile()
    return done


def _val(node: fx.Node) -> torch.Tensor:
    value = node.meta.get("val")
    assert isinstance(value, torch.Tensor)
    return value


def _broadcast_write(node: fx.Node) -> bool:
    """One boolean mask over `x`'s leading dims, a value that broadcasts to `x`'s other dims (one
    value for every selected position), no accumulation."""
    target, indices, value = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if accumulate or not isinstance(target, fx.Node) or not isinstance(indices, (list, tuple)) or len(indices) != 1:
        return False
    mask = indices[0]
    if not isinstance(mask, fx.Node) or not isinstance(mask.meta.get("val"), torch.Tensor):
        return False
    if _val(mask).dtype != torch.bool or not isinstance(target.meta.get("val"), torch.Tensor):
        return False
    x, m = _val(target), _val(mask)
    if tuple(x.shape[: m.dim()]) != tuple(m.shape):
        return False
    rest = tuple(x.shape[m.dim() :])
    if isinstance(value, fx.Node):
        v = value.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dim() > len(rest):
            return False
        try:
            return torch.broadcast_shapes(tuple(v.shape), rest) == rest
        except RuntimeError:
            return False
    return isinstance(value, (int, float, bool))


def _rewritable_in_place(target: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> bool:
    """An in-place write can become a new value only where nothing else sees the old storage: the
    target is an op's fresh result (not an input, weight or view of one), and nothing read it
    before the write as a view that a later read would see updated."""
    if target.op != "call_function" or is_view_op(target):
        return False
    earlier = [u for u in target.users if u is not write and order.get(u, -1) < order[write]]
    return not any(is_view_op(u) for u in earlier)


def is_view_op(node: fx.Node) -> bool:
    """Whether `node`'s ATen op returns a view of its first argument (its schema says `Tensor(a)`)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    return any(a.alias_info is not None and not a.alias_info.is_write for a in schema.arguments[:1]) or bool(
        schema.returns and schema.returns[0].alias_info is not None and not schema.returns[0].alias_info.is_write
    )
