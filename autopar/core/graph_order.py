"""Orders and walks over a graph's nodes that passes and the runtime share, not each other's."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

import torch.fx as fx


def apply_order(graph: fx.Graph, order: Sequence[fx.Node]) -> None:
    """Make the node list follow `order`, a topological order of every node but the output, which
    stays last."""
    body = [n for n in order if n.op != "output"]
    first = next(iter(graph.nodes))
    if body and body[0] is not first:
        first.prepend(body[0])
    for previous, node in zip(body, body[1:]):
        previous.append(node)


def reachable(start: Collection[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    """`start` and every node `step` leads to from them, transitively (`step`: a node's inputs
    for its ancestors, its users for what it feeds, or a walk that stops at some nodes)."""
    found: set[fx.Node] = set()
    stack = list(start)
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        stack.extend(step(node))
    return found


def ancestors(start: Collection[fx.Node]) -> set[fx.Node]:
    """`start` and every node they read, transitively."""
    return reachable(start, lambda node: node.all_input_nodes)


def is_view(node: fx.Node) -> bool:
    """Whether an op returns a view of its first argument (`slice`, `select`, `view`, `transpose`)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments or not schema.returns:
        return False
    first, ret = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and ret is not None and not first.is_write and first.before_set == ret.before_set


def view_root(node: fx.Node) -> fx.Node:
    """The value `node` is a view of, followed back through views (itself where it is none)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and is_view(node):
        node = node.args[0]
    return node


def written_root(node: fx.Node) -> fx.Node | None:
    """The value an in-place op (`copy_` into a slice, `masked_fill_`, `index_put_`) writes into,
    followed back through the views it was written through; None for an op that writes nothing.
    Such a node has no users of its own: what it made is read through the value it wrote."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return None
    written = [
        node.args[i]
        for i, arg in enumerate(schema.arguments)
        if i < len(node.args) and arg.alias_info is not None and arg.alias_info.is_write
    ]
    if not written or not isinstance(written[0], fx.Node):
        return None
    return view_root(written[0])


def inputs_with_writes(graph: fx.Graph) -> Callable[[fx.Node], list[fx.Node]]:
    """A step for `reachable`: a node's inputs and the in-place writes into each input's storage
    (through any view of it) that run before the node. What a value depends on in a graph that
    keeps in-place ops, as torch.export's unlifted module does: `mask[:, 0] = 1` is a `fill_` of a
    `select` that nothing reads, and a walk over inputs alone would miss it."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    writes: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        root = written_root(node)
        if root is not None:
            writes.setdefault(root, []).append(node)

    def step(node: fx.Node) -> list[fx.Node]:
        inputs = node.all_input_nodes
        if not writes:
            return list(inputs)
        earlier = [w for a in inputs for w in writes.get(view_root(a), ()) if order[w] < order[node]]
        return [*inputs, *earlier]

    return step
