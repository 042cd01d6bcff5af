"""Regather: build chosen gathered weights again in backward instead of keeping them from forward.

A weight is stored split over the mesh and all-gathered before its forward use; backward needs it
again (dX = dY W^T). By default backward reuses the forward's gathered copy, which then lives from
forward to backward. Under a memory limit the plan search may decide to gather again instead
(`autopar.planning.memory`). This pass carries that out on the graph after insert_comm: for each named
forward value, the value and everything it is computed from (the stored parameter's collectives,
views and casts) are copied into backward just before their first backward use, and backward uses
switch to the copies. The computation is the same, so results are bit-identical.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.meta import has_info, info, is_backward, set_info
from autopar.core.plan import MAX_REGATHER_NODES


def regather(gm: fx.GraphModule, names: Collection[str]) -> fx.GraphModule:
    """Copy each named forward value's weight chain into backward (after insert_comm)."""
    if not names:
        return gm
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    missing = sorted(set(names) - set(by_name))
    if missing:
        raise AutoparError(
            f"the plan regathers {missing[0]}, which is not in this graph",
            hint="plan and compile the same traced graph (every rank must trace the same model)",
        )
    for name in sorted(names, key=lambda n: position[by_name[n]]):
        _regather_one(gm, by_name[name], position)
    gm.graph.lint()
    gm.recompile()
    return gm


def _regather_one(gm: fx.GraphModule, target: fx.Node, position: dict[fx.Node, int]) -> None:
    # the value, and its forward redistributions (comm nodes) that backward reuses
    derived = [target]
    frontier = [target]
    while frontier:
        for user in frontier.pop().users:
            if has_info(user) and info(user).role == "comm" and not is_backward(user) and user not in derived:
                derived.append(user)
                frontier.append(user)
    uses = [(u, d) for d in derived for u in list(d.users) if is_backward(u)]
    if not uses:
        return
    needed = _ancestors([d for d in derived if any(d is used for _, used in uses)], target)
    first = min((u for u, _ in uses), key=lambda u: position.get(u, len(position)))
    copies: dict[fx.Node, fx.Node] = {}
    with gm.graph.inserting_before(first):
        for node in sorted(needed, key=position.__getitem__):
            copy = gm.graph.node_copy(node, lambda x: copies.get(x, x))
            copy.meta = dict(node.meta)
            set_info(copy, replace(info(node), phase="backward"))
            copies[node] = copy
    for user, used in uses:
        user.replace_input_with(used, copies[used])


def _ancestors(roots: list[fx.Node], target: fx.Node) -> list[fx.Node]:
    """The roots and every non-placeholder node they are computed from (all in forward)."""
    seen: set[fx.Node] = set()
    frontier = list(roots)
    while frontier:
        node = frontier.pop()
        if node in seen or node.op == "placeholder":
            continue
        if is_backward(node) or node.op != "call_function":
            raise AutoparError(
                f"cannot gather {target.name} again in backward: it depends on {node.name}",
                where=info(target).where() if has_info(target) else None,
                hint="only weight chains (a parameter, its collectives, views and casts) can be regathered",
            )
        seen.add(node)
        frontier.extend(node.all_input_nodes)
    if len(seen) > 4 * MAX_REGATHER_NODES:  # its collectives add a few nodes per step
        raise AutoparError(
            f"the chain of {target.name} has {len(seen)} nodes; too long to copy into backward",
            where=info(target).where() if has_info(target) else None,
        )
    return list(seen)
