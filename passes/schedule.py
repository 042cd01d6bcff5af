"""Stage 4, schedule: start collectives early and wait on them late, so communication overlaps compute.

A collective (with the local copies that prepare its buffer) moves up to just after the last of its
inputs is produced; its wait moves down to just before the first use of the result. Only the order
changes, never the computation, so results are bit-identical to the unscheduled graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.meta import has_info, info

c10d = torch.ops._c10d_functional
COLLECTIVES = (
    c10d.all_gather_into_tensor.default,
    c10d.reduce_scatter_tensor.default,
    c10d.all_reduce.default,
    c10d.all_to_all_single.default,
)


@dataclass
class ScheduleReport:
    collectives: int = 0
    waits_moved: int = 0
    issues_moved: int = 0
    overlapped_ops: int = 0  # compute ops between issue and wait, summed over collectives


def schedule(gm: fx.GraphModule) -> fx.GraphModule:
    report = ScheduleReport()
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op == "call_function" and node.target in COLLECTIVES:
            report.collectives += 1
            if _hoist(gm, node):
                report.issues_moved += 1
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is c10d.wait_tensor.default and _sink(node):
            report.waits_moved += 1
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in COLLECTIVES:
            wait = next(iter(node.users))
            cursor = node.next
            while cursor is not wait and cursor.op != "output":
                if cursor.op == "call_function" and has_info(cursor) and info(cursor).role == "compute":
                    report.overlapped_ops += 1
                cursor = cursor.next
    gm.graph.lint()
    gm.recompile()
    gm.meta["autopar_schedule"] = report
    return gm


def _hoist(gm: fx.GraphModule, collective: fx.Node) -> bool:
    """Move the collective and its private preparation chain right after their external inputs."""
    chain = [collective]
    frontier = [collective]
    while frontier:
        current = frontier.pop()
        for inp in current.all_input_nodes:
            if (
                has_info(inp)
                and info(inp).role == "comm"
                and inp.target not in COLLECTIVES
                and inp.target is not c10d.wait_tensor.default
                and len(inp.users) == 1
            ):
                chain.append(inp)
                frontier.append(inp)
    chain_set = set(chain)
    ordered = [n for n in gm.graph.nodes if n in chain_set]
    external = [i for n in ordered for i in n.all_input_nodes if i not in chain_set]
    position = {n: k for k, n in enumerate(gm.graph.nodes)}
    anchor = max(external, key=lambda n: position[n]) if external else None
    if anchor is None:
        return False
    # never move a node before the phase it belongs to begins: a backward collective cannot
    # overlap forward compute, which runs in another graph
    if info(collective).phase == "backward":
        first_backward = next(
            n
            for n in gm.graph.nodes
            if has_info(n) and info(n).phase == "backward" and info(n).role == "compute"
        )
        if position[anchor] < position[first_backward]:
            anchor = first_backward.prev
    if position[anchor] + 1 >= position[ordered[0]]:
        return False
    target = anchor
    for n in ordered:
        target.append(n)
        target = n
    return True


def _sink(wait: fx.Node) -> bool:
    users = list(wait.users)
    if not users:
        return False
    position = {n: k for k, n in enumerate(wait.graph.nodes)}
    first = min(users, key=lambda n: position[n])
    if position[first] == position[wait] + 1:
        return False
    first.prepend(wait)
    return True
