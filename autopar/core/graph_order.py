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
