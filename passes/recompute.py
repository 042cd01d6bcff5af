"""Recompute: run chosen forward ops again in backward instead of keeping their results.

The plan names forward ops (`autopar.planning.recompute`: cheap ops one by one, whole blocks, the
user's `torch.utils.checkpoint` regions). After insert_comm, each backward use of such an op's
result, or of a forward redistribution of it, switches to a copy made in backward: the op and its
redistributions are copied, their inputs being copies too where those are recomputed, and the kept
forward values otherwise. A kept input's forward redistribution that only copies read (no backward
op reads it itself) is copied too, so backward keeps the input in its own layout, not in both
(`autopar.planning.recompute` counts the same). Each copy is placed just before
the first backward op that needs it, so a recomputed block lives only while its backward runs. The
ops are the same ATen calls on the same inputs, so results are bit-identical; random ops are never
recomputed (their results are kept), so no random state has to be replayed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.meta import has_info, info, is_backward, set_info

RECOMPUTE_KEY = "autopar_recompute"  # gm.meta: how many forward ops were copied into backward


def recompute(gm: fx.GraphModule, names: Collection[str]) -> fx.GraphModule:
    """Copy the named forward ops into backward for their backward uses (after insert_comm)."""
    if not names:
        return gm
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    chosen = set(names)
    missing = sorted(chosen - {n.name for n in nodes})
    if missing:
        raise AutoparError(
            f"the plan recomputes {missing[0]}, which is not in this graph",
            hint="plan and compile the same traced graph (every rank must trace the same model)",
        )
    copied = _copyable(nodes, chosen)
    uses = [
        (user, node)
        for node in nodes
        if node in copied
        for user in node.users
        if user.op == "call_function" and is_backward(user)
    ]
    if not uses:
        return gm
    # the earliest backward op that needs each copy, through the copies that read it
    first: dict[fx.Node, int] = {}
    for user, node in uses:
        first[node] = min(first.get(node, len(nodes)), position[user])
    for node in sorted(copied, key=position.__getitem__, reverse=True):
        if node not in first:
            continue
        for source in node.all_input_nodes:
            if source in copied:
                first[source] = min(first.get(source, len(nodes)), first[node])
    copies: dict[fx.Node, fx.Node] = {}
    for node in sorted(first, key=position.__getitem__):
        with gm.graph.inserting_before(nodes[first[node]]):
            copy = gm.graph.node_copy(node, lambda x: copies.get(x, x))
        copy.meta = dict(node.meta)
        if has_info(node):
            set_info(copy, replace(info(node), phase="backward"))
        copies[node] = copy
    for user, node in uses:
        user.replace_input_with(node, copies[node])
    gm.meta[RECOMPUTE_KEY] = gm.meta.get(RECOMPUTE_KEY, 0) + len(copies)
    gm.graph.lint()
    gm.recompile()
    return gm


def _copyable(nodes: list[fx.Node], chosen: Collection[str]) -> set[fx.Node]:
    """The chosen forward ops, the forward redistributions (insert_comm's nodes) of them, and
    those of kept values that reach chosen ops only and no backward op directly."""
    copied: set[fx.Node] = set()
    for node in nodes:
        if node.op != "call_function" or is_backward(node):
            continue
        if node.name in chosen or _is_comm(node) and any(i in copied for i in node.all_input_nodes):
            copied.add(node)
    for node in reversed(nodes):  # (a chain's later steps first)
        if (
            _is_comm(node)
            and not is_backward(node)
            and node not in copied
            and any(u in copied for u in node.users)
            and not any(is_backward(u) for u in node.users)
        ):
            copied.add(node)
    return copied


def _is_comm(node: fx.Node) -> bool:
    return node.op == "call_function" and has_info(node) and info(node).role == "comm"
