"""Bucketing (run by the schedule stage): merge small collectives that become ready together.

Each collective pays its link latency once per ring step, so many small ones (bias and norm-weight
gathers, gradient reductions of small parameters) cost far more than their bytes. Collectives of one
kind on one process group whose inputs all exist at the same point of the graph (no compute node in
between) become one collective over a flat buffer: the members are flattened and concatenated,
reduced or gathered once, and cut back into their own shapes. Every element sees the same reduction
(or copy) as before, only at another offset of the buffer. The in-process lockstep simulation, which
sums a group in rank order, therefore gives bit-identical results; on a real backend a ring all-reduce
may add an element's summands in another order at another offset, so results agree to float rounding
when a group has more than two ranks.

All-to-all is never bucketed: a merged all-to-all would need each member's chunks interleaved per
destination rank, a copy as large as the message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from autopar.core.collectives import BUCKET_KEY, BYTES_KEY, COLLECTIVES, BucketMember, comm_group
from autopar.core.layout import Layout, Partial, Replicate, Shard, itemsize
from autopar.core.meta import has_info, info, set_info
from autopar.core.redistribute import CommStep

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BUCKETABLE = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
}

# DDP's default bucket (25 MiB): large enough that a bucket's latency is small next to its
# transfer on any link of the tables, small enough to keep little memory in flight.
BUCKET_BYTES = 25 * 2**20
BUCKET_COUNT = 64
EXACT_SUM_GROUP = 2  # sums merge only on groups this small: bit-identical results (see `bucket`)
MAX_ROUNDS = 8  # gathers over several axes are chained (z, then y, then x): one round per link


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
    max_sum_group: int = EXACT_SUM_GROUP,
) -> BucketReport:
    """Merge collectives in place, in rounds until nothing merges; `max_bytes` bounds a bucket's
    largest buffer (the gathered output of an all-gather, the input of a reduction).

    Sums (all-reduce, reduce-scatter) merge only on groups of at most `max_sum_group` ranks: a
    backend's ring splits a buffer by its length, so in a merged buffer an element may be summed in
    another order; with two ranks every order gives the same float, so results stay bit-identical.
    Raise it to trade that guarantee for fewer collectives on larger groups."""
    report = BucketReport()
    if max_count < 2 or max_bytes <= 0:
        return report
    shape = tuple(mesh_shape)
    for _ in range(MAX_ROUNDS):
        groups = _plan_round(gm, shape, max_bytes, max_count, max_sum_group)
        if not groups:
            break
        report.rounds += 1
        for members in groups:
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
    ready: int  # position of the last input of its chain
    need: int  # position of the first user of its wait
    point: int  # compute nodes before the moment it is ready
    size: int  # bytes of its largest buffer
    key: tuple[object, ...]


def _plan_round(
    gm: fx.GraphModule, shape: tuple[int, ...], max_bytes: int, max_count: int, max_sum_group: int
) -> list[list[_Candidate]]:
    """Buckets for one round, each a list of candidates in graph order.

    A collective whose input is the wait of a collective merged in this round waits for the next
    round, when that input is a piece of the merged buffer; this keeps every node the merge moves
    or removes away from the places where other buckets are inserted.
    """
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    computes_before = [0] * (len(nodes) + 1)
    first_backward = None
    for i, n in enumerate(nodes):
        is_compute = n.op == "call_function" and has_info(n) and info(n).role == "compute"
        computes_before[i + 1] = computes_before[i] + int(is_compute)
        if first_backward is None and is_compute and info(n).phase == "backward":
            first_backward = i
    candidates: list[_Candidate] = []
    for node in nodes:
        cand = _candidate(node, position, computes_before, first_backward, shape, max_bytes, max_sum_group)
        if cand is not None:
            candidates.append(cand)
    candidates.sort(key=lambda c: (c.point, c.ready, position[c.node]))
    open_buckets: dict[tuple[object, ...], list[_Candidate]] = {}
    closed: list[list[_Candidate]] = []
    for cand in candidates:
        key = (*cand.key, cand.point)
        current = open_buckets.get(key)
        if current is not None and (
            len(current) >= max_count
            or sum(c.size for c in current) + cand.size > max_bytes
            or max(c.ready for c in current) >= cand.need
            or cand.ready >= min(c.need for c in current)
        ):
            closed.append(current)
            current = None
        if current is None:
            open_buckets[key] = current = []
        current.append(cand)
    closed.extend(open_buckets.values())
    closed.sort(key=lambda b: min(c.ready for c in b))
    merged_waits: set[fx.Node] = set()
    chosen = []
    for members in closed:
        eligible = [c for c in members if not _reads_any(c.node, merged_waits)]
        if len(eligible) < 2:
            continue
        chosen.append(sorted(eligible, key=lambda c: position[c.node]))
        merged_waits.update(c.wait for c in eligible)
    return chosen


def _reads_any(collective: fx.Node, waits: set[fx.Node]) -> bool:
    return any(i in waits for member in prep_chain(collective) for i in member.all_input_nodes)


def _candidate(
    node: fx.Node,
    position: dict[fx.Node, int],
    computes_before: list[int],
    first_backward: int | None,
    shape: tuple[int, ...],
    max_bytes: int,
    max_sum_group: int,
) -> _Candidate | None:
    if node.op != "call_function" or node.target not in BUCKETABLE or BUCKET_KEY in node.meta:
        return None
    if not has_info(node) or info(node).comm is None or len(node.users) != 1:
        return None
    step = info(node).comm
    assert step is not None
    if node.target is not c10d.all_gather_into_tensor.default and node.args[1] != "sum":
        return None
    if not (_even(step.before, shape) and _even(step.after, shape)):
        return None  # padded blocks differ in size between ranks
    if node.target is not c10d.all_gather_into_tensor.default and shape[step.axis] > max_sum_group:
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
    point = computes_before[ready + 1]
    phase = info(node).phase
    if phase == "backward" and first_backward is not None:
        point = max(point, computes_before[first_backward])
    need = min(position[u] for u in wait.users)
    group_size = shape[step.axis]
    key = (node.target, comm_group(node), group_size, step.before.dtype, phase)
    return _Candidate(node, wait, ready, need, point, size, key)


def _even(layout: Layout, shape: tuple[int, ...]) -> bool:
    splits = math.prod(shape[a] for a, p in enumerate(layout.placements) if isinstance(p, Shard))
    return layout.local_numel(shape) * splits == math.prod(layout.shape)


# ---- the rewrite ---------------------------------------------------------------------------------
def _merge(gm: fx.GraphModule, members: list[_Candidate], shape: tuple[int, ...]) -> fx.Node:
    """Replace `members` (same kind and group, in graph order) by one collective on a flat buffer.

    The buffer is built right after the last input of any member and waited on right before the
    first use of any member's result; each member's result becomes a slice of it.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
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

    chains = [sorted(prep_chain(c.node), key=position.__getitem__) for c in members]
    inputs = [i for chain in chains for m in chain for i in m.all_input_nodes if i not in chain]
    anchor = max(inputs, key=position.__getitem__)
    if anchor.op == "placeholder":  # keep the placeholders together at the top
        anchor = max((n for n in nodes if n.op == "placeholder"), key=position.__getitem__)
    need = min((u for c in members for u in c.wait.users), key=position.__getitem__)

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
        if kind == "reduce_scatter":  # rows = destination ranks: [g, numel / g] per member
            flats.append(after(aten.reshape.default, (buffer, [g, numel // g]), numel * bpe))
        else:
            flats.append(after(aten.reshape.default, (buffer, [numel]), numel * bpe))
    total = sum(numels)
    cat = after(aten.cat.default, (flats, 1 if kind == "reduce_scatter" else 0), total * bpe)
    step = _bucket_step(kind, axis, total, g, dtype, len(shape))
    if kind == "all_reduce":
        merged = after(c10d.all_reduce.default, (cat, "sum", group), total * bpe, comm=step, comm_group=group)
    elif kind == "all_gather":
        merged = after(
            c10d.all_gather_into_tensor.default, (cat, g, group), g * total * bpe, comm=step, comm_group=group
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
    rows = after(aten.view.default, (wait, [g, total]), out_total * bpe) if kind == "all_gather" else wait
    offset = 0
    for c, numel, out_shape in zip(members, numels, out_shapes):
        n = numel // g if kind == "reduce_scatter" else numel
        if kind == "all_gather":  # member i's block of every rank: a strided slice, copied out
            piece = after(aten.narrow.default, (rows, 1, offset, n), g * n * bpe)
            rows_i = after(aten.clone.default, (piece,), g * n * bpe)
            rows_i.kwargs = {"memory_format": torch.contiguous_format}
            result = after(aten.view.default, (rows_i, list(out_shape)), g * n * bpe)
        else:
            piece = after(aten.narrow.default, (wait, 0, offset, n), n * bpe)
            result = after(aten.view.default, (piece, list(out_shape)), n * bpe)
        offset += n
        old = info(c.wait)
        set_info(result, replace(info(result), layouts=old.layouts))  # the old wait's promise
        if "val" in c.wait.meta:
            result.meta["val"] = c.wait.meta["val"]
        c.wait.replace_all_uses_with(result)
        graph.erase_node(c.wait)
        graph.erase_node(c.node)
    return merged


def _buffer_shape(step: CommStep, shape: tuple[int, ...], which: str) -> tuple[int, ...]:
    """Local shape of a collective's input ("in") or output ("out") as insert_comm lays it out:
    all-gather and reduce-scatter work on the tensor with their dim moved to the front."""
    local = list(step.before.local_shape(shape))
    if step.kind == "all_reduce":
        return tuple(local)
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
    before = Layout(placements(Partial()), (total,), dtype)
    return CommStep("reduce_scatter", axis, before, Layout(placements(Shard(0)), (total,), dtype), dim=0)
