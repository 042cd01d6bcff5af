"""Bucketing (run by the schedule stage): merge collectives that can travel together.

Each collective pays its link latency once per ring step, so many small ones (bias and norm-weight
gathers, gradient reductions, the q, k and v pieces of one attention) cost far more than their
bytes; where latency dominates (gloo on shared cores: milliseconds a collective) their count sets
the step time. Collectives of one kind on one process group merge into one collective over a flat
buffer when there is a point of the graph where all their inputs exist and no member's result is
needed yet (their windows overlap): the members are flattened and concatenated, reduced, gathered
or exchanged once, and cut back into their own shapes. The bucket is issued after its last input
and waited on before its first use, so a member ready early leaves later than it would alone; with
a modeled clock (a hardware table) a collective joins a bucket only when the time it then spends
exposed grows by less than the link time the merge saves (one latency), so on fast links buckets
stay within what overlap hides and on slow ones (latency-bound) they grow, as DDP's gradient
buckets and FSDP's per-block flat gathers do. A collective whose input is computed after the
bucket's first use but does not depend on it pulls that compute (a few nodes) up before the use
(layer norm's backward makes its two independent sums one after the other's use).

Every element sees the same reduction (or copy) as before, only at another offset of the buffer:
the in-process lockstep simulation, which sums a group in rank order, gives bit-identical results,
and so does a 2-rank group on a real backend; on larger groups a ring may add an element's summands
in another order at another offset, so sums agree to float rounding (as with DDP's buckets).

All-to-alls (equal splits) merge like reduce-scatters: each member's buffer is [g, n / g] rows, one
per destination rank; the rows are concatenated side by side, exchanged once, and each member's
columns are cut out of the received rows.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from autopar.core.collectives import BUCKET_KEY, BYTES_KEY, COLLECTIVES, PIECE_KEY, BucketMember, comm_group
from autopar.core.layout import Layout, Partial, Replicate, Shard, itemsize
from autopar.core.meta import has_info, info, set_info
from autopar.core.redistribute import CommStep
from autopar.cost.timeline import StepClock
from autopar.cost.work import is_view

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BUCKETABLE = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
    c10d.all_to_all_single.default: "all_to_all",
}
SUMS = ("all_reduce", "reduce_scatter")

# DDP's default bucket (25 MiB): large enough that a bucket's latency is small next to its
# transfer on any link of the tables, small enough to keep little memory in flight.
BUCKET_BYTES = 25 * 2**20
BUCKET_COUNT = 64
MAX_ROUNDS = 8  # gathers over several axes are chained (z, then y, then x): one round per link
MAX_HOIST = 8  # compute nodes a collective may pull up to join a bucket (layer norm backward: one)


@dataclass
class BucketReport:
    buckets: int = 0  # merged collectives created
    merged: int = 0  # collectives they replaced
    rounds: int = 0
    names: list[str] = field(default_factory=list)  # merged collectives, in creation order


def prep_chain(collective: fx.Node) -> list[fx.Node]:
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


def bucket(
    gm: fx.GraphModule,
    mesh_shape: Sequence[int],
    *,
    max_bytes: int = BUCKET_BYTES,
    max_count: int = BUCKET_COUNT,
    max_sum_group: int | None = None,
    clock: StepClock | None = None,
) -> BucketReport:
    """Merge collectives in place, in rounds until nothing merges; `max_bytes` bounds a bucket's
    largest buffer (the gathered output of an all-gather, the input of a reduction).

    `clock` (the schedule stage's modeled clock, a hardware table's times) keeps a collective out
    of a bucket where waiting for the bucket's last input would expose more of it than the merge
    saves; without one every collective whose window overlaps the bucket's joins it.
    `max_sum_group`, when given, merges sums (all-reduce, reduce-scatter) only on groups of at most
    that many ranks: there, results stay bit-identical to the unbucketed graph on any backend (2
    ranks: every order of adding two summands gives the same float)."""
    report = BucketReport()
    if max_count < 2 or max_bytes <= 0:
        return report
    shape = tuple(mesh_shape)
    for _ in range(MAX_ROUNDS):
        groups = _plan_round(gm, shape, max_bytes, max_count, max_sum_group, clock)
        if not groups:
            break
        report.rounds += 1
        for members in groups:
            if not _still_ordered(gm, members):
                continue  # an earlier merge of this round moved a use above an input: next round
            report.names.append(_merge(gm, members, shape).name)
            report.buckets += 1
            report.merged += len(members)
    if report.buckets:
        gm.graph.lint()
        gm.recompile()
    return report


@dataclass
class _Candidate:
    node: fx.Node
    wait: fx.Node
    ready: int  # position of the last input of its chain (the backward's start at the earliest)
    need: int  # position of the first user of its wait
    size: int  # bytes of its largest buffer
    elements: int  # local elements of its buffer as `_bucket_step` counts them
    key: tuple[object, ...]
    hoist: tuple[fx.Node, ...] = ()  # compute to move up before the bucket's first use (see `_hoistable`)


@dataclass
class _Open:
    """A bucket being filled: its members and what the clock's test needs of it."""

    members: list[_Candidate]
    elements: int
    need: int  # first use of any member's result
    bytes: int


def _plan_round(
    gm: fx.GraphModule,
    shape: tuple[int, ...],
    max_bytes: int,
    max_count: int,
    max_sum_group: int | None,
    clock: StepClock | None,
) -> list[list[_Candidate]]:
    """Buckets for one round, each a list of candidates in graph order.

    Candidates are taken in the order they become ready; each joins the open bucket of its kind
    and group while that bucket's first use comes after it is ready (all members then exist at the
    bucket's issue point) and the limits and the clock's test allow, else opens the next one.
    A collective whose input is the wait of a collective merged in this round (or a view of it)
    waits for the next round, when that input is a piece of the merged buffer; this keeps every
    node the merge moves or removes away from the places where other buckets are inserted.
    """
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    elapsed = [0.0]  # modeled compute seconds before each position (with a clock)
    first_backward = None
    for i, n in enumerate(nodes):
        is_compute = n.op == "call_function" and has_info(n) and info(n).role == "compute"
        if clock is not None:
            busy = n.op == "call_function" and n.target not in COLLECTIVES
            elapsed.append(elapsed[-1] + (clock.duration(n) if busy else 0.0))
        if first_backward is None and is_compute and info(n).phase == "backward":
            first_backward = i
    candidates: list[_Candidate] = []
    for node in nodes:
        cand = _candidate(node, position, first_backward, shape, max_bytes, max_sum_group)
        if cand is not None:
            candidates.append(cand)
    candidates.sort(key=lambda c: (c.ready, position[c.node]))

    def exposed(kind: str, axis: int, elements: int, dtype: torch.dtype, ready: int, need: int) -> float:
        assert clock is not None
        seconds = clock.cost.step(_bucket_step(kind, axis, elements, shape[axis], dtype, len(shape)))
        return max(0.0, seconds - (elapsed[need] - elapsed[ready + 1]))  # issued after `ready`

    def worth_it(current: _Open, cand: _Candidate) -> bool:
        """Whether the merge's extra exposed time is below the latency it saves (the clock's test)."""
        if clock is None:
            return True
        step = info(cand.node).comm
        assert step is not None
        kind, axis, dtype = BUCKETABLE[cand.node.target], step.axis, step.before.dtype  # type: ignore[index]
        ready = max(c.ready for c in current.members)
        alone = exposed(kind, axis, current.elements, dtype, ready, current.need) + exposed(
            kind, axis, cand.elements, dtype, cand.ready, cand.need
        )
        total = current.elements + cand.elements
        together = exposed(kind, axis, total, dtype, cand.ready, min(current.need, cand.need))
        seconds = [
            clock.cost.step(_bucket_step(kind, axis, n, shape[axis], dtype, len(shape)))
            for n in (current.elements, cand.elements, total)
        ]
        return together - alone <= seconds[0] + seconds[1] - seconds[2]

    open_buckets: dict[tuple[object, ...], _Open] = {}
    closed: list[list[_Candidate]] = []
    for cand in candidates:
        current = open_buckets.get(cand.key)
        if current is not None and cand.ready >= current.need:
            hoist = _hoistable(cand, nodes, position, current)
            if hoist is not None:
                cand = replace(cand, ready=current.need - 1, hoist=hoist)
        if current is not None and (
            len(current.members) >= max_count
            or current.bytes + cand.size > max_bytes
            or cand.ready >= current.need
            or not worth_it(current, cand)
        ):
            closed.append(current.members)
            current = None
        if current is None:
            open_buckets[cand.key] = _Open([cand], cand.elements, cand.need, cand.size)
            continue
        current.members.append(cand)
        current.elements += cand.elements
        current.need = min(current.need, cand.need)
        current.bytes += cand.size
    closed.extend(b.members for b in open_buckets.values())
    closed.sort(key=lambda b: min(c.ready for c in b))
    moved: set[fx.Node] = set()  # nodes the buckets chosen so far move or remove
    chosen = []
    for members in closed:
        eligible = [
            c
            for c in members
            if not _reads_any(c.node, moved) and not any(h in moved or _reads(h, moved) for h in c.hoist)
        ]
        if len(eligible) < 2:
            continue
        chosen.append(sorted(eligible, key=lambda c: position[c.node]))
        for c in eligible:  # its wait, the views of it that the merge moves down, what it hoists
            moved.add(c.wait)
            moved.update(_uses(c.wait)[1])
            moved.update(c.hoist)
    return chosen


def _hoistable(
    cand: _Candidate, nodes: list[fx.Node], position: dict[fx.Node, int], current: _Open
) -> tuple[fx.Node, ...] | None:
    """The compute between the bucket's first use and `cand`'s inputs that `cand` depends on, if
    it may move up before that use: a few nodes that read no member's result, draw no random
    numbers and are no collective; else None. Layer norm's backward makes its two sums one after
    the other's use, though the second does not depend on it: moving the second up lets both
    travel in one all-reduce."""
    need = current.need
    blocked = {c.wait for c in current.members}
    for c in current.members:
        blocked.update(_uses(c.wait)[1])
    chain = prep_chain(cand.node)
    frontier = [i for m in chain for i in m.all_input_nodes if i not in chain]
    found: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if position[node] < need or node in found:
            continue
        if (
            len(found) >= MAX_HOIST
            or node.op != "call_function"
            or node.target in COLLECTIVES
            or node.target is c10d.wait_tensor.default
            or node in blocked
            or _reads(node, blocked)
            or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        ):
            return None
        found.add(node)
        frontier.extend(node.all_input_nodes)
    return tuple(sorted(found, key=position.__getitem__))


def _reads(node: fx.Node, nodes: set[fx.Node]) -> bool:
    return any(i in nodes for i in node.all_input_nodes)


def _reads_any(collective: fx.Node, waits: set[fx.Node]) -> bool:
    return any(i in waits for member in prep_chain(collective) for i in member.all_input_nodes)


def _candidate(
    node: fx.Node,
    position: dict[fx.Node, int],
    first_backward: int | None,
    shape: tuple[int, ...],
    max_bytes: int,
    max_sum_group: int | None,
) -> _Candidate | None:
    if node.op != "call_function" or node.target not in BUCKETABLE or BUCKET_KEY in node.meta:
        return None
    if not has_info(node) or info(node).comm is None or len(node.users) != 1:
        return None
    step = info(node).comm
    assert step is not None
    kind = BUCKETABLE[node.target]  # type: ignore[index]
    if kind in SUMS and node.args[1] != "sum":
        return None
    if kind == "all_to_all" and len(set(node.args[1]) | set(node.args[2])) != 1:  # type: ignore[arg-type]
        return None  # unequal splits
    if not (_even(step.before, shape) and _even(step.after, shape)):
        return None  # padded blocks differ in size between ranks
    if kind in SUMS and max_sum_group is not None and shape[step.axis] > max_sum_group:
        return None  # a merged sum could round differently (see `bucket`)
    (wait,) = node.users
    if wait.target is not c10d.wait_tensor.default or not wait.users:
        return None
    size = max(step.before.local_bytes(shape), step.after.local_bytes(shape))
    if size >= max_bytes:
        return None
    chain = prep_chain(node)
    inputs = [i for m in chain for i in m.all_input_nodes if i not in chain]
    ready = max((position[i] for i in inputs), default=0)
    phase = info(node).phase
    if phase == "backward" and first_backward is not None:
        ready = max(ready, first_backward)  # the schedule holds it until the backward begins
    need = min(position[u] for u in _uses(wait)[0])
    if ready >= need:
        return None
    # batch chunks (over-decomposition) stay apart: one chunk's collectives are to overlap the
    # other chunks' compute, which a bucket spanning chunks would wait for
    # and so do the pieces of a decomposed collective matmul (each its own key)
    key = (node.target, comm_group(node), shape[step.axis], step.before.dtype, phase, info(node).chunk, node.meta.get(PIECE_KEY))
    elements = step.before.local_numel(shape)
    return _Candidate(node, wait, ready, need, size, elements, key)


def _uses(wait: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """The first real uses of a collective's result and the views in between, in graph order.

    A view of the result (q's transpose before attention) is free and reads nothing else, so it
    can move down to its own first use: a merged wait then lands before the attention, not before
    the transpose right after q's collective, and q, k and v can travel together."""
    uses: list[fx.Node] = []
    views: list[fx.Node] = []
    frontier = list(wait.users)
    while frontier:
        node = frontier.pop()
        if node in uses or node in views:
            continue
        if (
            node.op == "call_function"
            and is_view(node)
            and node.all_input_nodes in ([wait], *([v] for v in views))
            and node.users
        ):
            views.append(node)
            frontier.extend(node.users)
        else:
            uses.append(node)
    return uses, views


def _even(layout: Layout, shape: tuple[int, ...]) -> bool:
    splits = math.prod(shape[a] for a, p in enumerate(layout.placements) if isinstance(p, Shard))
    return layout.local_numel(shape) * splits == math.prod(layout.shape)


def _still_ordered(gm: fx.GraphModule, members: list[_Candidate]) -> bool:
    """Whether every member's input (but what it hoists) still comes before the first use of any
    member's result in the graph as earlier merges of the round left it (a merge that hoists
    compute can move a user of another bucket's member above that member's inputs), and nothing
    hoisted reads a member's result (a member that joined after the hoist was planned)."""
    hoisted = {h for c in members for h in c.hoist}
    results = {c.wait for c in members} | {v for c in members for v in _uses(c.wait)[1]}
    if any(_reads(h, results) for h in hoisted):
        return False  # hoisted above the bucket's wait, it would read a result before it exists
    inputs = [
        i
        for c in members
        for m in prep_chain(c.node)
        for i in m.all_input_nodes
        if i not in hoisted and i not in prep_chain(c.node)
    ]
    uses = [u for c in members for u in _uses(c.wait)[0]]
    if not uses:
        return True
    first_use = min(uses)  # (nodes compare by their place in the graph, kept as nodes move)
    if any(h < first_use for h in hoisted):
        return False  # already above the first use: moving it "up" to there would move it down
    return not inputs or max(inputs) < first_use


# ---- the rewrite ---------------------------------------------------------------------------------
def _merge(gm: fx.GraphModule, members: list[_Candidate], shape: tuple[int, ...]) -> fx.Node:
    """Replace `members` (same kind and group, in graph order) by one collective on a flat buffer.

    The buffer is built right after the last input of any member and waited on right before the
    first use of any member's result; each member's result becomes a slice of it.
    """
    graph = gm.graph
    hoisted = [h for c in members for h in c.hoist]
    # (nodes compare by their place in the graph, kept up to date as nodes move: no renumbering)
    if hoisted:  # up before the first use of any member's result, in their order
        first_use = min(u for c in members for u in _uses(c.wait)[0])
        for node in sorted(hoisted):
            first_use.prepend(node)
    first = members[0].node
    kind = BUCKETABLE[first.target]  # type: ignore[index]
    steps = [info(c.node).comm for c in members]
    assert all(s is not None for s in steps)
    axis = steps[0].axis  # type: ignore[union-attr]
    g = shape[axis]
    dtype = steps[0].before.dtype  # type: ignore[union-attr]
    group = comm_group(first)
    chunks = {info(m.node).chunk for m in members}  # over-decomposition: one batch chunk, or several
    chunk = chunks.pop() if len(chunks) == 1 else None
    base = replace(info(first), comm=None, comm_group=None, layouts=(), strategy=None, note="bucket", chunk=chunk)

    chains = [sorted(prep_chain(c.node)) for c in members]
    inputs = [i for chain in chains for m in chain for i in m.all_input_nodes if i not in chain]
    anchor = max(inputs)
    if anchor.op == "placeholder":  # keep the placeholders together at the top
        anchor = max(graph.find_nodes(op="placeholder"))
    need = min(u for c in members for u in _uses(c.wait)[0])
    views = {c.node: sorted(_uses(c.wait)[1]) for c in members}

    in_shapes = [_buffer_shape(s, shape, "in") for s in steps]  # type: ignore[arg-type]
    out_shapes = [_buffer_shape(s, shape, "out") for s in steps]  # type: ignore[arg-type]
    numels = [math.prod(s) for s in in_shapes]
    bpe = itemsize(dtype)

    cursor = anchor

    def after(target: object, args: tuple[object, ...], nbytes: int, **extra: object) -> fx.Node:
        nonlocal cursor
        with graph.inserting_after(cursor):
            node = graph.call_function(target, args)  # type: ignore[arg-type]
        set_info(node, replace(base, **extra))  # type: ignore[arg-type]
        node.meta[BYTES_KEY] = nbytes
        cursor = node
        return node

    for chain, c in zip(chains, members):  # the members' own buffer preparation moves along
        for member in chain:
            if member is not c.node:
                cursor.append(member)
                cursor = member
    flats = []
    for c, numel in zip(members, numels):
        buffer = c.node.args[0]
        if kind in ("reduce_scatter", "all_to_all"):  # rows = destination ranks: [g, numel / g]
            flats.append(after(aten.reshape.default, (buffer, [g, numel // g]), numel * bpe))
        else:
            flats.append(after(aten.reshape.default, (buffer, [numel]), numel * bpe))
    total = sum(numels)
    rowwise = kind in ("reduce_scatter", "all_to_all")
    cat = after(aten.cat.default, (flats, 1 if rowwise else 0), total * bpe)
    step = _bucket_step(kind, axis, total, g, dtype, len(shape))
    if kind == "all_reduce":  # in place on the buffer `cat` just made: the functional op would copy it first
        merged = after(c10d.all_reduce_.default, (cat, "sum", group), total * bpe, comm=step, comm_group=group)
    elif kind == "all_gather":
        merged = after(
            c10d.all_gather_into_tensor.default, (cat, g, group), g * total * bpe, comm=step, comm_group=group
        )
    elif kind == "all_to_all":
        flat = after(aten.view.default, (cat, [total]), total * bpe)
        splits = [total // g] * g
        merged = after(
            c10d.all_to_all_single.default, (flat, splits, splits, group), total * bpe, comm=step, comm_group=group
        )
    else:
        flat = after(aten.view.default, (cat, [total]), total * bpe)
        merged = after(
            c10d.reduce_scatter_tensor.default,
            (flat, "sum", g, group),
            total // g * bpe,
            comm=step,
            comm_group=group,
        )
    merged.meta[BUCKET_KEY] = tuple(
        BucketMember(c.node.name, s, info(c.node).module_path)  # type: ignore[arg-type]
        for c, s in zip(members, steps)
    )

    cursor = need.prev  # the wait and the pieces go right before the first use of any member
    out_total = g * total if kind == "all_gather" else (total // g if kind == "reduce_scatter" else total)
    wait = after(c10d.wait_tensor.default, (merged,), out_total * bpe)
    if kind == "all_gather":
        rows = after(aten.view.default, (wait, [g, total]), out_total * bpe)
    elif kind == "all_to_all":
        rows = after(aten.view.default, (wait, [g, total // g]), out_total * bpe)
    else:
        rows = wait
    # one split cuts every member's piece out (one ATen call, not one narrow per member); the
    # split itself is views only, so the model prices each piece as it priced a narrow
    gathered = kind in ("all_gather", "all_to_all")  # member i's block of every rank: strided, copied out
    lengths = [numel // g if kind in ("reduce_scatter", "all_to_all") else numel for numel in numels]
    pieces = after(aten.split_with_sizes.default, (rows, lengths, 1 if gathered else 0), 0)
    for i, (c, n, out_shape) in enumerate(zip(members, lengths, out_shapes)):
        if gathered:
            piece = after(operator.getitem, (pieces, i), g * n * bpe)
            rows_i = after(aten.clone.default, (piece,), g * n * bpe)
            rows_i.kwargs = {"memory_format": torch.contiguous_format}
            result = after(aten.view.default, (rows_i, list(out_shape)), g * n * bpe)
        else:
            piece = after(operator.getitem, (pieces, i), n * bpe)
            result = after(aten.view.default, (piece, list(out_shape)), n * bpe)
        old = info(c.wait)
        set_info(result, replace(info(result), layouts=old.layouts))  # the old wait's promise
        if "val" in c.wait.meta:
            result.meta["val"] = c.wait.meta["val"]
        c.wait.replace_all_uses_with(result)
        for view in views[c.node]:  # down to the bucket's wait: they read only this result
            cursor.append(view)
            cursor = view
        graph.erase_node(c.wait)
        graph.erase_node(c.node)
    return merged


def _buffer_shape(step: CommStep, shape: tuple[int, ...], which: str) -> tuple[int, ...]:
    """Local shape of a collective's input ("in") or output ("out") as insert_comm lays it out:
    all-gather and reduce-scatter work on the tensor with their dim moved to the front."""
    local = list(step.before.local_shape(shape))
    if step.kind == "all_reduce":
        return tuple(local)
    if step.kind == "all_to_all":  # the dim to split moved to the front; the output is as large
        assert step.dst_dim is not None
        return (local[step.dst_dim], *(s for d, s in enumerate(local) if d != step.dst_dim))
    assert step.dim is not None
    front = [local[step.dim]] + [s for d, s in enumerate(local) if d != step.dim]
    if which == "out":
        g = shape[step.axis]
        front[0] = front[0] * g if step.kind == "all_gather" else front[0] // g
    return tuple(front)


def _bucket_step(kind: str, axis: int, total: int, g: int, dtype: torch.dtype, ndim: int) -> CommStep:
    """The merged collective as one step on a flat tensor, so that bytes and time price the bucket:
    `total` local input elements (a reduce-scatter's full input, an all-gather's own shard)."""
    rep = [Replicate()] * ndim

    def placements(p: object) -> tuple:
        out = list(rep)
        out[axis] = p  # type: ignore[call-overload]
        return tuple(out)

    if kind == "all_reduce":
        before = Layout(placements(Partial()), (total,), dtype)
        return CommStep("all_reduce", axis, before, Layout(tuple(rep), (total,), dtype))
    if kind == "all_gather":
        before = Layout(placements(Shard(0)), (g * total,), dtype)
        return CommStep("all_gather", axis, before, Layout(tuple(rep), (g * total,), dtype), dim=0)
    if kind == "all_to_all":  # [g, total / g] rows, one per destination: columns split before, rows after
        before = Layout(placements(Shard(1)), (g, total), dtype)
        after = Layout(placements(Shard(0)), (g, total), dtype)
        return CommStep("all_to_all", axis, before, after, dim=1, dst_dim=0)
    before = Layout(placements(Partial()), (total,), dtype)
    return CommStep("reduce_scatter", axis, before, Layout(placements(Shard(0)), (total,), dtype), dim=0)
