"""The working memory of the emitted program: the traced-order walk (`planning.working`) with the
gradient buckets the schedule made, at the points the program issues them.

The search counts the working memory before any collective exists. After the schedule stage the
gradient sums are known: which gradients each bucket holds until its last member is made, its
concatenated buffer, and (gloo) the collective's own copy of that buffer. Measured on gloo ranks,
a ring plan's step peaks at the first bucket's reduce-scatter (docs/long-context.md), so the
modeled memory `autopar.plan` reports counts them (`PlanResult.memory.working`). Only a compile
for that report counts them (`compile_for_rank(..., priced=True)`): `parallelize`'s compiles on
every rank do not read the figure.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.fx as fx

from autopar.core.collectives import BUCKET_KEY, BYTES_KEY
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from autopar.planning.working import GradientBucket, with_buckets

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
SUMS = (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)


def _made_by(node: fx.Node, position: dict[fx.Node, int]) -> fx.Node:
    """The op that made the tensor `node` carries: back through the comm glue (reshapes, views,
    contiguous copies insert_comm and bucketing add, and the load-balanced layout's reorder, a cat
    of slices of one tensor) to the first node that is not comm; through glue of several inputs,
    the latest made (`position`: graph order). Stopping at the reorder's cat, which the traced
    walk does not list, left the bucket of a balanced all-gather's key/value gradients out."""
    while has_info(node) and info(node).role == "comm" and node.all_input_nodes:
        node = max(node.all_input_nodes, key=position.__getitem__)
    return node


def _feeds_output(node: fx.Node) -> bool:
    """Whether `node`'s result reaches the graph output through comm nodes alone (a gradient)."""
    frontier, seen = [node], {node}
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user.op == "output":
                return True
            if has_info(user) and info(user).role == "comm" and user not in seen:
                seen.add(user)
                frontier.append(user)
    return False


def _released(collective: fx.Node, run_before: list[int], position: dict[fx.Node, int], traced: Sequence[str]) -> str | None:
    """The op of `traced` (the traced walk's names, in its order) at which the walk stops holding
    what `collective` holds until the program waits on it: the walk's op as far along it as the
    scheduled graph is when it waits (as many traced ops run before the wait: `run_before[i]` of
    them before the scheduled graph's node i), or None (no wait, or no traced op before it).

    By count, not by the last traced op before the wait: the schedule hoists ops that read only
    saved values (an RMSNorm backward's `pow` and `mul` of its saved input) above a wait, and the
    last of them before it was the norm of the first layer, the walk's last ops; a balanced plan
    on 4 gloo ranks then held the first bucket's buffer and gloo's copy (1.9 MiB) over the next
    layer's attention backward, where the program had waited on them before it (the model 1.16 of
    the measured live rise at the step's peak)."""
    waits = [u for u in collective.users if u.target is c10d.wait_tensor.default]
    if not waits:
        return None
    run = run_before[position[waits[0]]]
    return traced[min(run, len(traced)) - 1] if run else None


def gradient_buckets(
    gm: fx.GraphModule, mesh_shape: Sequence[int], copies: int, traced: Sequence[str] = ()
) -> list[GradientBucket]:
    """Every sum of the scheduled backward `gm` on a mesh of `mesh_shape`: a bucket (its members
    the inputs of its concatenation, `passes/bucket.py`) or one collective alone that makes a
    gradient. `copies`: what the backend copies of a sum's input (gloo: 1, NCCL: 0). `traced`:
    the traced ops' names in the walk's order, to find where the walk stands at each sum's wait
    (measured on 4 gloo ranks: a bucket's buffer and gloo's copy lived from the issue to the wait, over the attention
    backward between them)."""
    shape = tuple(mesh_shape)
    order = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    names = set(traced)
    run_before = list(itertools.accumulate((node.name in names for node in order), initial=0))
    buckets = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in SUMS or not has_info(node) or info(node).phase != "backward":
            continue
        buffer = node.args[0]
        assert isinstance(buffer, fx.Node)
        if buffer.target is aten.view.default:  # a reduce-scatter bucket's flat view of its rows
            buffer = buffer.args[0]  # type: ignore[assignment]
        if node.meta.get(BUCKET_KEY) and buffer.target is aten.cat.default:
            flats = [f for f in buffer.args[0] if isinstance(f, fx.Node)]  # type: ignore[union-attr]
            members = tuple(_made_by(f, position).name for f in flats)
            sizes = tuple(float(f.meta[BYTES_KEY]) for f in flats)
            released = _released(node, run_before, position, traced)
            buckets.append(GradientBucket(members, sizes, True, copies, released))
        elif _feeds_output(node) and (step := info(node).comm) is not None:
            size = float(step.before.local_bytes(shape))
            made = _made_by(node.args[0], position).name  # type: ignore[arg-type]
            buckets.append(GradientBucket((made,), (size,), False, copies, _released(node, run_before, position, traced)))
    return buckets


def emitted_working(steps: list[tuple[str, float]], scheduled: fx.GraphModule, mesh: Mesh) -> float:
    """The working memory per rank of the scheduled graph: the traced-order `steps` of its plan
    (`PlanMemory.working_steps`) on `mesh` (the graph's, a chunk axis included) with its gradient buckets in them. On CPU the program's sums run
    on gloo, which copies a sum's input (one copy); elsewhere (NCCL) none is counted."""
    traced = [name for name, _ in steps]
    buckets = gradient_buckets(scheduled, mesh.shape, 1 if mesh.device_type == "cpu" else 0, traced)
    return max((b for _, b in with_buckets(steps, buckets)), default=0.0)
