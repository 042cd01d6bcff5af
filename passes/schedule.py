"""Stage 4, schedule: start collectives early and wait on them late, so communication overlaps compute.

A collective (with the local copies that prepare its buffer) moves up to just after the last of its
inputs is produced; its wait moves down to just before the first use of the result. Only the order
changes, never the computation, so results are bit-identical to the unscheduled graph.
"""

from __future__ import annotations

import heapq
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
    """Reorder in one list-scheduling pass (linear in the graph size).

    Nodes keep their order except that each collective, with the private copies preparing its
    buffer, is emitted as soon as all its inputs are (a backward collective not before the backward
    begins), and each wait only when a node needs its result. At most one collective per process
    group is in flight: gloo has deadlocked (and once aborted) with many outstanding operations on
    one group, and one in flight per axis still overlaps each axis with compute and the others.
    """
    nodes = list(gm.graph.nodes)
    original = {n: i for i, n in enumerate(nodes)}
    chains: dict[fx.Node, list[fx.Node]] = {}  # collective -> its chain, in graph order
    chain_of: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "call_function" and node.target in COLLECTIVES:
            chain = sorted(_chain(node), key=original.__getitem__)
            chains[node] = chain
            for member in chain:
                chain_of[member] = node
    waits = {n for n in nodes if n.op == "call_function" and n.target is c10d.wait_tensor.default}
    first_backward = next(
        (n for n in nodes if has_info(n) and info(n).phase == "backward" and info(n).role == "compute"), None
    )
    externals = {
        c: {i for m in chain for i in m.all_input_nodes if i not in chain_of or chain_of[i] is not c}
        for c, chain in chains.items()
    }
    missing = {c: len(ext) for c, ext in externals.items()}
    needed_by: dict[fx.Node, list[fx.Node]] = {}
    for c, ext in externals.items():
        for i in ext:
            needed_by.setdefault(i, []).append(c)

    order: list[fx.Node] = []
    emitted: set[fx.Node] = set()
    ready: list[tuple[int, fx.Node]] = []
    held: list[fx.Node] = []  # backward collectives ready before the backward begins
    in_flight: dict[str, fx.Node] = {}  # process group -> its issued, not yet waited collective
    blocked: dict[str, list[fx.Node]] = {}  # ready collectives waiting for their group to free up
    state = {"backward": first_backward is None, "flushing": False}

    def emit(node: fx.Node) -> None:
        order.append(node)
        emitted.add(node)
        for c in needed_by.get(node, ()):
            missing[c] -= 1
            if missing[c] == 0:
                heapq.heappush(ready, (original[c], c))
        if node in waits:
            group = _group(node.args[0])  # type: ignore[arg-type]
            if in_flight.get(group) is node.args[0]:
                del in_flight[group]
                for c in blocked.pop(group, []):  # the group is free: issue the next one now
                    heapq.heappush(ready, (original[c], c))
        flush()

    def flush() -> None:
        """Issue every ready collective whose group is free, right after what made it ready."""
        if state["flushing"]:
            return
        state["flushing"] = True
        try:
            while ready:
                _, c = heapq.heappop(ready)
                if c in emitted:
                    continue
                if not state["backward"] and info(c).phase == "backward":
                    held.append(c)
                elif _group(c) in in_flight:
                    blocked.setdefault(_group(c), []).append(c)
                else:
                    emit_chain(c)
        finally:
            state["flushing"] = False

    def emit_chain(c: fx.Node) -> None:
        if c in emitted:  # already issued (e.g. by a flush while its inputs were being ensured)
            return
        group = _group(c)
        busy = in_flight.get(group)
        if busy is not None:
            ensure(next(iter(busy.users)))  # its wait: one collective in flight per group
        in_flight[group] = c  # before emitting: nothing else may start on this group meanwhile
        for member in chains[c]:
            if member not in emitted:
                emit(member)

    def ensure(node: fx.Node) -> None:
        if node in emitted:
            return
        if node in chain_of:
            c = chain_of[node]
            for i in externals[c]:
                ensure(i)
            emit_chain(c)
            return
        # collectives first, then the waits: a wait lands right before the node that needs it
        for i in node.all_input_nodes:
            ensure(i.args[0] if i in waits else i)  # type: ignore[arg-type]
        for i in node.all_input_nodes:
            ensure(i)
        if node not in emitted:  # an input's ensure may have emitted it (a forced wait)
            emit(node)

    for node in nodes:
        if node in emitted or node in chain_of or node in waits:
            continue
        if node.op == "output":  # whatever nothing asked for (unused results) still runs, in order
            state["backward"] = True
            for c in held:
                heapq.heappush(ready, (original[c], c))
            held.clear()
            flush()
            for leftover in nodes:
                if leftover not in emitted and leftover is not node:
                    ensure(leftover)
        if node is first_backward:
            state["backward"] = True
            for c in held:
                heapq.heappush(ready, (original[c], c))
            held.clear()
            flush()
        ensure(node)
    if len(order) != len(nodes):  # pragma: no cover - a bug in this pass
        lost = [n.name for n in nodes if n not in emitted]
        raise AssertionError(f"schedule lost nodes {lost[:10]} (emitted {len(order)} of {len(nodes)})")

    report = _report(order, original, chains)
    _apply(gm, order)
    gm.graph.lint()
    gm.recompile()
    gm.meta["autopar_schedule"] = report
    return gm


def _group(collective: fx.Node) -> str:
    """The process group a functional collective runs on (its last argument)."""
    return str(collective.args[-1])


def _chain(collective: fx.Node) -> list[fx.Node]:
    """The collective and the comm-only copies that exist just to prepare its buffer."""
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
                and inp not in chain
            ):
                chain.append(inp)
                frontier.append(inp)
    return chain


def _report(
    order: list[fx.Node], original: dict[fx.Node, int], chains: dict[fx.Node, list[fx.Node]]
) -> ScheduleReport:
    final = {n: i for i, n in enumerate(order)}
    computes = [0]
    for node in order:
        is_compute = node.op == "call_function" and has_info(node) and info(node).role == "compute"
        computes.append(computes[-1] + int(is_compute))
    report = ScheduleReport(collectives=len(chains))
    for c in chains:
        wait = next(iter(c.users))
        report.issues_moved += int(final[c] < original[c])
        report.waits_moved += int(final[wait] > original[wait])
        report.overlapped_ops += computes[final[wait]] - computes[final[c] + 1]
    return report


def _apply(gm: fx.GraphModule, order: list[fx.Node]) -> None:
    """Make the graph's node list follow `order` (the output node stays last)."""
    body = [n for n in order if n.op != "output"]
    first = next(iter(gm.graph.nodes))
    if body and body[0] is not first:
        first.prepend(body[0])
    for previous, node in zip(body, body[1:]):
        previous.append(node)
