"""Orders and walks over a graph's nodes that passes and the runtime share, not each other's."""

from __future__ import annotations

from collections.abc import Sequence

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


def ancestors(start: Sequence[fx.Node]) -> set[fx.Node]:
    """`start` and every node they read, transitively."""
    found: set[fx.Node] = set()
    stack = list(start)
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        stack.extend(node.all_input_nodes)
    return found
