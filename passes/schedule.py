"""Stage 4, schedule: start collectives early and wait on them late, so communication overlaps compute.

Given the mesh, collectives of one kind and group that can travel together are first merged into
buckets (`passes/bucket.py`; with a hardware table, only where the modeled clock says the merge
saves more latency than it exposes). Then a collective (with the local copies that prepare its
buffer) moves up to just after the last of its inputs is produced, and its wait moves down to just
before the first use of the result. The reordering changes no computation: results are
bit-identical to the unscheduled graph (bucketing is bit-identical in the lockstep simulation and
on 2-rank groups; on larger groups a bucketed sum may round differently on a real backend; see
its module).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Generator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.core.collectives import COLLECTIVES, comm_group
from autopar.core.graph_order import apply_order
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from autopar.cost.hardware import Hardware
from autopar.cost.timeline import StepClock
from autopar.passes.bucket import BUCKET_BYTES, BUCKET_COUNT, bucket, prep_chain
from autopar.passes.link_order import LinkOrder

c10d = torch.ops._c10d_functional
# Bound on the output buffers of issued, not yet waited collectives (bytes per rank) where no
# memory budget is known (a graph scheduled on its own; compile_for_rank passes the budget's
# headroom). 1 GiB is 1.25 % of an 80 GB H100: it never binds one-in-flight-per-axis schedules of
# bucket-sized messages, and stops several axes from each holding a large gathered weight early.
IN_FLIGHT_BYTES = 2**30

# Before a wait, compute among the next LOOKAHEAD nodes that is ready runs first. A window, not the
# whole graph: pulling work from far ahead would keep its inputs and outputs alive much longer.
LOOKAHEAD = 64

__all__ = ["COLLECTIVES", "IN_FLIGHT_BYTES", "LOOKAHEAD", "ScheduleReport", "schedule"]


@dataclass
class ScheduleReport:
    collectives: int = 0
    waits_moved: int = 0
    issues_moved: int = 0
    overlapped_ops: int = 0  # compute ops between issue and wait, summed over collectives
    buckets: int = 0  # merged collectives made by bucketing
    bucketed: int = 0  # collectives folded into them
    cap_delays: int = 0  # issues held back by the in-flight cap
    cap_delayed: list[str] = field(default_factory=list)  # those collectives, in order
    cap_forced_waits: int = 0  # waits moved earlier to make room for a collective needed now
    in_flight_cap: int | None = None  # the cap on buffers in flight (bytes; None: no mesh, no cap)
    filled: int = 0  # compute nodes moved up to run before a wait (the lookahead)
    deferred: int = 0  # backward nodes feeding only the output, put off until their inputs exist
    yielded: int = 0  # times a ready collective gave way to a collective needed sooner
    gave_way: list[str] = field(default_factory=list)  # on the clock: collectives held back so, in order


def schedule(
    gm: fx.GraphModule,
    mesh: Mesh | None = None,
    *,
    bucket_bytes: int = BUCKET_BYTES,
    bucket_count: int = BUCKET_COUNT,
    in_flight_bytes: int = IN_FLIGHT_BYTES,
    lookahead: int = LOOKAHEAD,
    max_in_flight: int = 1,
    hardware: str | Hardware | None = None,
    streams: str = "single",
) -> fx.GraphModule:
    """Bucket, then reorder in one list-scheduling pass (linear in the graph size).

    Nodes keep their order except that each collective, with the private copies preparing its
    buffer, is emitted as soon as all its inputs are (a backward collective not before the backward
    begins), and each wait only when a node needs its result; before a wait, ready compute among
    the next `lookahead` nodes runs first. At most `max_in_flight` (default one) collectives per
    process group are in flight: gloo has deadlocked (and once aborted) with many outstanding
    operations on one group, and one in flight per axis still overlaps each axis with compute and
    the others.

    Buffer sizes need the mesh: without `mesh` nothing is bucketed and the cap does not apply.
    With it, collectives are bucketed (`bucket_bytes`, `bucket_count`; 0 turns it off), and a
    collective is not issued early while the output buffers in flight would exceed `in_flight_bytes`
    (`compile_for_rank` passes what the memory limit leaves after the plan, `compiler.lowering.in_flight_budget`;
    `IN_FLIGHT_BYTES` is the default for graphs scheduled on their own).

    Gradients on their way to the output (nodes that feed one output only) are never waited for
    on their own behalf, and their collectives give way to collectives that other work needs soon
    on the same group: within `lookahead` nodes. With `hardware` and a mesh the pass keeps the
    modeled clock of `autopar.cost.timeline` (`streams`: one communication stream, or one per
    link), and the order in which collectives take a link is chosen on it, earliest deadline first:
    a ready collective (a gradient, a weight prefetch, an activation alike) is held back while a
    collective due sooner (its result needed earlier) reaches the same stream before it would end
    and the clock says the pair's exposed time is shorter that way round (`autopar.passes.link_order`). A
    collective whose group holds one back is waited on as soon as the clock says it is done (a
    gradient's always), which frees its group for the next.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
    bucketing = None
    if mesh is not None:
        timing = StepClock(mesh, hardware) if hardware is not None else None
        bucketing = bucket(gm, mesh.shape, max_bytes=bucket_bytes, max_count=bucket_count, clock=timing)
    sizes = _buffer_bytes(gm, mesh)
    nodes = list(gm.graph.nodes)
    clock = StepClock(mesh, hardware, streams) if mesh is not None and hardware is not None else None
    elapsed = [0.0]  # compute seconds of the nodes before each position, in the original order
    if clock is not None:
        for node in nodes:
            busy = node.op == "call_function" and node.target not in COLLECTIVES
            elapsed.append(elapsed[-1] + (clock.duration(node) if busy else 0.0))
    original = {n: i for i, n in enumerate(nodes)}
    chains: dict[fx.Node, list[fx.Node]] = {}  # collective -> its chain, in graph order
    chain_of: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "call_function" and node.target in COLLECTIVES:
            chain = sorted(prep_chain(node), key=original.__getitem__)
            chains[node] = chain
            for member in chain:
                chain_of[member] = node
    waits = {n for n in nodes if n.op == "call_function" and n.target is c10d.wait_tensor.default}
    first_backward = next(
        (n for n in nodes if has_info(n) and info(n).phase == "backward" and info(n).role == "compute"), None
    )
    # in chain order (not a set of nodes, whose order follows memory addresses): every rank must
    # place the same nodes in the same order, or ranks issue collectives in different orders
    externals = {
        c: list(
            dict.fromkeys(
                i for m in chain for i in m.all_input_nodes if i not in chain_of or chain_of[i] is not c
            )
        )
        for c, chain in chains.items()
    }
    missing = {c: len(ext) for c, ext in externals.items()}
    needed_by: dict[fx.Node, list[fx.Node]] = {}
    for c, ext in externals.items():
        for i in ext:
            needed_by.setdefault(i, []).append(c)

    tail = _tail(nodes)
    urgent: dict[str, list[int]] = {}  # group -> original positions of its non-tail collectives
    for c in chains:
        if c not in tail:
            urgent.setdefault(_group(c), []).append(original[c])
    for positions in urgent.values():
        positions.sort()
    # on the clock, the order collectives take a link: earliest deadline first (all of them)
    order_on_link = LinkOrder(clock, nodes, original, externals, tail, elapsed) if clock is not None else None
    low: dict[str, list[fx.Node]] = {}  # without a clock: ready gradient collectives giving way
    deferred: dict[fx.Node, int] = {}  # tail node put off -> its inputs not yet emitted
    deferred_by: dict[fx.Node, list[fx.Node]] = {}  # input -> the deferred nodes it holds up

    order: list[fx.Node] = []
    emitted: set[fx.Node] = set()
    ready: list[tuple[int, fx.Node]] = []
    held: list[fx.Node] = []  # backward collectives ready before the backward begins
    in_flight: dict[str, list[fx.Node]] = {}  # process group -> its issued, not yet waited collectives
    blocked: dict[str, list[fx.Node]] = {}  # ready collectives waiting for their group to free up
    capped: list[fx.Node] = []  # ready collectives waiting for in-flight memory to free up
    issued: dict[fx.Node, int] = {}  # issue order, to free memory by waiting on the oldest first
    load = [0]  # bytes of output buffers in flight
    report = ScheduleReport()
    state = {"backward": first_backward is None, "flushing": False, "filling": False}
    cursor = [0]  # index in `nodes` of the node the main loop is placing

    def over_cap(c: fx.Node) -> bool:
        return bool(sizes) and any(in_flight.values()) and load[0] + sizes[c] > in_flight_bytes

    def group_full(group: str) -> bool:
        return len(in_flight.get(group, ())) >= max_in_flight

    def emit(node: fx.Node) -> None:
        """Place `node`, then each put-off gradient node its placing released (and what those
        release, depth first): on a stack of our own, not Python's, as a gradient accumulated over
        a long loop releases a chain as long as the loop."""
        pending = [iter(place(node))]
        while pending:
            d = next(pending[-1], None)
            if d is None:
                pending.pop()
            elif d not in emitted:  # a put-off gradient node whose wait came: it runs now, at no cost
                pending.append(iter(place(d)))

    def place(node: fx.Node) -> list[fx.Node]:
        """Place one node: what it makes ready is queued and issued; the put-off nodes it releases
        are returned, for `emit` to place."""
        order.append(node)
        emitted.add(node)
        if clock is not None:
            clock.place(node)
        released = []
        for d in deferred_by.pop(node, ()):
            deferred[d] -= 1
            if deferred[d] == 0:
                released.append(d)
        for c in needed_by.get(node, ()):
            missing[c] -= 1
            if missing[c] == 0:
                heapq.heappush(ready, (original[c], c))
                if order_on_link is not None:
                    order_on_link.ready(c)
        if node in waits:
            if order_on_link is not None:
                order_on_link.events += 1
            group = _group(node.args[0])  # type: ignore[arg-type]
            flying = in_flight.get(group, [])
            done = node.args[0]
            if isinstance(done, fx.Node) and done in flying:
                flying.remove(done)
                load[0] -= sizes.get(done, 0)
                for c in blocked.pop(group, []):  # the group is free: issue the next one now
                    heapq.heappush(ready, (original[c], c))
                for c in capped:  # memory is free: try again
                    heapq.heappush(ready, (original[c], c))
                capped.clear()
        flush()
        return released

    def flush() -> None:
        """Issue every ready collective whose group is free, right after what made it ready."""
        if state["flushing"]:
            return
        state["flushing"] = True
        try:
            while take_ready():
                pass
            for group, queue in low.items():  # gradients go when the group has nothing urgent
                while (
                    queue
                    and not group_full(group)
                    and not urgent_soon(group, queue[0])
                    and not over_cap(queue[0])
                ):
                    c = queue.pop(0)
                    if c not in emitted:
                        emit_chain(c)
        finally:
            state["flushing"] = False

    def take_ready() -> bool:
        """Issue or set aside every ready collective, then let one held collective go if none need
        hold it any more; whether that one went (its issue may have made others ready)."""
        while ready:
            _, c = heapq.heappop(ready)
            if c in emitted:
                continue
            if not state["backward"] and info(c).phase == "backward":
                held.append(c)
            elif order_on_link is None and c in tail and urgent_soon(_group(c), c):
                low.setdefault(_group(c), []).append(c)
                report.yielded += 1
            elif group_full(_group(c)):
                blocked.setdefault(_group(c), []).append(c)
            elif over_cap(c):
                if c not in delayed:
                    delayed.add(c)
                    report.cap_delayed.append(c.name)
                capped.append(c)
            elif order_on_link is not None and give_way(c):
                report.yielded += 1
                if c.name not in report.gave_way:
                    report.gave_way.append(c.name)
                order_on_link.held.append(c)
            else:
                emit_chain(c)
        return order_on_link is not None and release_held()

    def give_way(c: fx.Node) -> bool:
        assert order_on_link is not None
        order_on_link.priced(c)
        return order_on_link.hold(c, cursor[0], emitted, in_flight)

    def release_held() -> bool:
        """Issue the first held collective that need not give way any more (its issue may make
        others ready: the caller's loop takes those, then comes back here)."""
        assert order_on_link is not None
        kept = order_on_link.held
        kept[:] = [c for c in kept if c not in emitted]
        for c in kept:
            if group_full(_group(c)) or over_cap(c) or not order_on_link.look_again(c) or give_way(c):
                continue
            kept.remove(c)
            emit_chain(c)
            return True
        return False

    def urgent_soon(group: str, gradient: fx.Node) -> bool:
        """Without a clock: whether a collective that something other than the output needs is
        ready on `group`, or comes within `lookahead` nodes: issuing `gradient` now would hold it up."""
        if any(c not in tail for c in blocked.get(group, ())):
            return True
        positions = urgent.get(group, [])
        i = bisect.bisect_left(positions, cursor[0])
        return i < len(positions) and positions[i] <= cursor[0] + max(lookahead, 1)

    def collect_finished() -> None:
        """Wait on gradient collectives the clock says are done, and on any done collective whose
        group a ready one is waiting for: free, and it frees their group."""
        if clock is None:
            return
        queued = {_group(c) for c in order_on_link.held if c not in emitted} if order_on_link is not None else set()
        queued.update(g for g, cs in blocked.items() if cs)
        for group, flying in list(in_flight.items()):
            for c in list(flying):
                if (c in tail or group in queued) and clock.finished(c):
                    ensure(next(iter(c.users)))

    delayed: set[fx.Node] = set()

    def emit_chain(c: fx.Node) -> None:
        """Issue `c` now (it is ready); first wait on what must finish before it may start."""
        if c in emitted:  # already issued (e.g. by a flush while its inputs were being ensured)
            return
        group = _group(c)
        flushing, state["flushing"] = state["flushing"], True  # no other issue may take the room
        try:
            while group_full(group):  # wait on its oldest: at most max_in_flight per group
                fill()
                ensure(next(iter(in_flight[group][0].users)))
            while over_cap(c):  # needed now: wait on the oldest in flight until it fits
                oldest = min((x for xs in in_flight.values() for x in xs), key=issued.__getitem__)
                ensure(next(iter(oldest.users)))
                report.cap_forced_waits += 1
        finally:
            state["flushing"] = flushing
        in_flight.setdefault(group, []).append(c)  # before emitting: nothing else may take its place
        issued[c] = len(issued)
        if order_on_link is not None:
            order_on_link.issued(c)
        load[0] += sizes.get(c, 0)
        for member in chains[c]:
            if member not in emitted:
                emit(member)

    def ensure(node: fx.Node) -> None:
        """Emit `node` after whatever it needs that is not emitted yet, depth first. The depth is
        kept on a stack of our own, not Python's: a collective whose input is the wait of another,
        whose input is the wait of another... (a sequential loop's carried state, resharded each
        step) is first needed, and so ensured, only at its end, as deep as the loop is long."""
        if node in emitted:
            return
        stack = [ensure_steps(node)]
        thrown: BaseException | None = None
        while stack:
            try:
                needed = stack[-1].throw(thrown) if thrown is not None else next(stack[-1])
            except StopIteration:
                stack.pop()
                thrown = None
                continue
            except BaseException as exc:  # into the caller's frame, as a recursive call would
                stack.pop()
                if not stack:
                    raise
                thrown = exc
                continue
            thrown = None
            if needed not in emitted:
                stack.append(ensure_steps(needed))

    def ensure_steps(node: fx.Node) -> Generator[fx.Node, None, None]:
        """`ensure`'s work for one node; it yields each node to be ensured before it goes on."""
        if node in emitted:
            return
        c = chain_of.get(node)
        inputs = externals[c] if c is not None else node.all_input_nodes
        # collectives first, then the waits: a wait lands right before the node that needs it
        for i in inputs:
            yield i.args[0] if i in waits else i  # type: ignore[misc]
        if any(i in waits and i not in emitted for i in inputs) or (c is not None and group_full(_group(c))):
            fill()
        filling, state["filling"] = state["filling"], True  # from here on, only its waits
        try:
            for i in inputs:
                yield i
            if c is not None:
                emit_chain(c)
        finally:
            state["filling"] = filling
        if node not in emitted:  # an input's ensure may have emitted it (a forced wait)
            emit(node)

    def fill() -> None:
        """Before a wait, run the compute of the next `lookahead` nodes that is ready already.

        Work that does not depend on the collective runs while it is on the wire (in backward,
        typically a weight-gradient matmul beside the input-gradient's collective) instead of after.
        """
        if state["filling"] or lookahead <= 0:
            return
        state["filling"] = True
        try:
            phase = "backward" if state["backward"] else "forward"
            for node in nodes[cursor[0] : cursor[0] + lookahead]:
                if (
                    node not in emitted
                    and node.op == "call_function"
                    and node not in chain_of
                    and node not in waits
                    and has_info(node)
                    # in forward also a copy of a buffer already received (over-decomposed
                    # chunks: the next chunk's input waits behind it)
                    and (info(node).role == "compute" or (info(node).role == "comm" and phase == "forward"))
                    and info(node).phase == phase
                    and all(i in emitted for i in node.all_input_nodes)
                    # random ops draw in graph order, the serial model's: none may run ahead
                    and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())
                ):
                    emit(node)
                    report.filled += 1
        finally:
            state["filling"] = False

    def enter_backward() -> None:
        """The schedule enters backward: the backward collectives that were ready before it began,
        held until now, are queued and issued."""
        state["backward"] = True
        for c in held:
            heapq.heappush(ready, (original[c], c))
        held.clear()
        flush()

    for index, node in enumerate(nodes):
        cursor[0] = index
        if node in emitted or node in chain_of or node in waits:
            continue
        if node.op == "output":  # whatever nothing asked for (unused results) still runs, in order
            enter_backward()
            for leftover in nodes:
                if leftover not in emitted and leftover is not node:
                    ensure(leftover)
        if node is first_backward:
            enter_backward()
        if node in tail:
            holding = [i for i in node.all_input_nodes if i not in emitted and (i in waits or i in deferred)]
            if holding:  # only the output needs it: do not wait for a collective on its behalf
                deferred[node] = len(holding)
                for i in holding:
                    deferred_by.setdefault(i, []).append(node)
                report.deferred += 1
                continue
        ensure(node)
        collect_finished()
    if len(order) != len(nodes):  # pragma: no cover - a bug in this pass
        lost = [n.name for n in nodes if n not in emitted]
        raise AssertionError(f"schedule lost nodes {lost[:10]} (emitted {len(order)} of {len(nodes)})")

    _report(report, order, original, chains)
    if bucketing is not None:
        report.buckets, report.bucketed = bucketing.buckets, bucketing.merged
    report.cap_delays = len(report.cap_delayed)
    report.in_flight_cap = in_flight_bytes if sizes else None
    apply_order(gm.graph, order)
    gm.graph.lint()
    gm.recompile()
    gm.meta["autopar_schedule"] = report
    return gm


def _group(collective: fx.Node) -> str:
    """The process group a functional collective runs on (its last argument)."""
    return comm_group(collective)


def _tail(nodes: list[fx.Node]) -> set[fx.Node]:
    """Backward nodes that feed exactly one output (one parameter's gradient) and nothing else:
    the weight-gradient computation and the collectives taking the gradient to its storage layout.
    Nothing on the way to another output waits for them (the input-gradient path feeds many).

    A bucket of such collectives feeds several gradients, but only through its own buffer copies:
    it stays in the tail (it stands for "gradients only"), and so does what only feeds it."""
    many, grads = -1, -2
    reach: dict[fx.Node, int] = {}  # node -> the one output position it feeds, grads, or many
    output = nodes[-1]
    if output.op == "output":
        for i, value in enumerate(output.all_input_nodes):
            reach[value] = i if value not in reach else many
    for node in reversed(nodes):
        targets = {reach.get(u, many) for u in node.users if u.op != "output"}
        if node in reach:
            targets.add(reach[node])
        if not node.users:
            continue
        if len(targets) == 1:
            reach[node] = targets.pop()
        elif many not in targets and has_info(node) and info(node).note == "bucket":
            reach[node] = grads
        else:
            reach[node] = many
    return {
        n
        for n, r in reach.items()
        if r != many and n.op == "call_function" and has_info(n) and info(n).phase == "backward"
    }


def _buffer_bytes(gm: fx.GraphModule, mesh: Mesh | None) -> dict[fx.Node, int]:
    """Bytes of each collective's output buffer on this rank (empty without a mesh)."""
    if mesh is None:
        return {}
    out = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in COLLECTIVES and has_info(node):
            step = info(node).comm
            out[node] = step.after.local_bytes(mesh.shape) if step is not None else 0
    return out


def _report(
    report: ScheduleReport,
    order: list[fx.Node],
    original: dict[fx.Node, int],
    chains: dict[fx.Node, list[fx.Node]],
) -> None:
    final = {n: i for i, n in enumerate(order)}
    computes = [0]
    for node in order:
        is_compute = node.op == "call_function" and has_info(node) and info(node).role == "compute"
        computes.append(computes[-1] + int(is_compute))
    report.collectives = len(chains)
    for c in chains:
        wait = next(iter(c.users))
        report.issues_moved += int(final[c] < original[c])
        report.waits_moved += int(final[wait] > original[wait])
        report.overlapped_ops += computes[final[wait]] - computes[final[c] + 1]

