"""Working memory: what a step holds beyond its weight state and saved activations while ops run.

`plan_memory` counts the weight state and the activations the forward keeps for the backward. A
step also holds, while each op runs, the values that are neither: the intermediates of the
forward nobody saves (alive from the op that makes them to their last reader), the gradients of
the backward (the same), the copies insert_comm makes of an op's inputs in the layout the op
reads them in (gathered keys and values, a gathered token block, a pending sum's reduction)
unless backward keeps them anyway, and the op's own scratch: ring attention's blocks in flight.
Measured on 2 gloo ranks at sequence 2048 (docs/long-context.md), a step's live heap rose its
saved activations plus 7 to 16 MiB, most with the ring and the balanced all-gather: that is this
term, and a `memory_limit` that left it out let plans through whose step does not fit.

The term is the peak over the ops, in the traced order (forward, then backward), of:

- the live transient values: every op output that is not saved, not a parameter or input, and not a
  view of another (a view is its base's memory; a multi-output op's `getitem`s too), from the op
  that makes it to its last reader. A graph output (the loss, a parameter's gradient) counts
  while it is made and read: after that it is the step's gradient, counted with the weight state,
  or the caller's;
- the op's input copies: each (input, layout it reads) that differs from the input's own layout and
  is not among the layouts the saved value is kept in;
- ring attention's scratch (`ring_scratch_bytes`): the key/value block the rank computes on and
  the one arriving (two blocks), the step's partial result before its merge (out and logsumexp in
  forward, dq in backward), and in backward the two key/value gradient accumulators travelling
  beside the blocks (a backward step sums each kernel call's gradients into its results in place,
  `ring_attention.block_backward`, so no more: on 2 gloo ranks, the live peak of a ring step
  41.9 MiB against 29.2 saved + 14.0 working modeled).
- the causal attention backward of a rank's query block against whole keys
  (`causal_rows_scratch_bytes`): one kernel call's key, value and query gradients beside its
  results (its local call sums each into them in place, `device_attention.attention_backward`).

The schedule's gradient buckets (`passes/bucket.py`) are not in the traced order, where each
gradient is reduced as it is made: a bucket is issued after its last member is made, so its
members are held until then, and it adds its concatenated buffer (made beside the members, which
are freed after it) and, on gloo, the collective's own copy of that buffer, both held until the
program waits on the sum (measured: the live peak of a ring plan on gloo ranks is at its bucket's
reduce-scatter, docs/long-context.md). `with_buckets` adds them to the traced walk at the op after
which the emitted program issues each bucket (`GradientBucket`, read off the scheduled graph by the
compiler); the search, which plans before any collective exists, does not see them.

Not counted: a kernel's internal workspace (the CPU flash kernel's per-thread score blocks, small
against these), the allocator's cache (on CPU malloc keeps freed blocks, 1.5 to 1.7x the live
rise measured), and saved values freed during the backward (they stay counted whole: the peak is
bounded from above where it falls late in the backward). The order is the traced one, not the
schedule's, which moves collectives and so their copies' lifetimes.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.layout import Layout
from autopar.core.plan import Plan
from autopar.cost.work import is_view
from autopar.rules.calls import op_call, tensor_inputs
from autopar.rules.context_parallel import SEQ, row_runs
from autopar.rules.ring_attention import BACKWARD, FORWARD, key_index, ring_axis


def _alias_of(node: fx.Node) -> fx.Node | None:
    """The tensor `node` aliases (a view's base, a `getitem`'s op), or None if it is its own."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem or is_view(node):
        source = node.args[0] if node.args else None
        return source if isinstance(source, fx.Node) else None
    return None


def _root(node: fx.Node, aliases: dict[fx.Node, fx.Node | None]) -> fx.Node:
    found = node
    while (base := aliases.get(found)) is not None:
        found = base
    return found


def _output_bytes(node: fx.Node, plan: Plan, shape: tuple[int, ...]) -> float:
    return float(sum(layout.local_bytes(shape) for layout in plan.layouts.get(node.name, ())))


def ring_scratch_bytes(op: object, inputs: Sequence[Layout], outputs: Sequence[Layout], shape: tuple[int, ...]) -> float:
    """Ring attention's working memory beyond its inputs and outputs, per rank (module doc): two
    key/value blocks in flight, the step's partial result, and in backward two key/value gradient
    accumulators. `inputs`/`outputs`: the strategy's layouts of the attention op `op`."""
    k = key_index(op)
    blocks = 2.0 * (inputs[k].local_bytes(shape) + inputs[k + 1].local_bytes(shape))
    if op == BACKWARD:
        return 2.0 * blocks + outputs[0].local_bytes(shape)  # blocks, accumulators, dq's partial
    return blocks + outputs[0].local_bytes(shape) + outputs[1].local_bytes(shape)  # out and lse partials


def causal_rows_scratch_bytes(runs: int, inputs: Sequence[Layout], outputs: Sequence[Layout], shape: tuple[int, ...]) -> float:
    """What the backward of a causal attention call with its queries split along the sequence and
    its keys whole holds beyond its results, per rank (module doc): its local call
    (`device_attention.attention_backward` at each of `runs` runs of rows' offsets) sums each
    kernel call's key and value gradients into the whole ones in place, so one call's exist beside
    them at a time: at most those of the keys before the rank's last run (the whole keys less one
    run of rows), with that call's query gradient and the run's own. With a mask of the model's,
    one call sees the keys up to the run's end, and the run's causal mask is added to its rows
    of the model's.
    `inputs`/`outputs`: the strategy's layouts of the backward op (grad_out, q, k, v, out, lse,
    mask), (dq, dk, dv)."""
    q, masked = inputs[1], len(inputs) > 6
    # the share of the keys one kernel call sees at most: those before the last run (with a mask,
    # up to the run's end: the keys it may see, in one call)
    seen = 1.0 if masked else 1.0 - q.local_shape(shape)[SEQ] / runs / q.shape[SEQ]
    scratch = seen * (outputs[1].local_bytes(shape) + outputs[2].local_bytes(shape)) + outputs[0].local_bytes(shape)
    if masked:  # the run's causal mask, added to its rows of the model's
        scratch += inputs[6].local_bytes(shape) / runs
    return scratch


def op_working_bytes(
    gm: fx.GraphModule, plan: Plan, mesh_shape: Sequence[int], held: Mapping[str, Collection[Layout]]
) -> list[tuple[str, float]]:
    """(op name, working bytes per rank while it runs) for every op with a strategy, in the traced
    order (module doc). `held`: the saved values (`memory.SavedValue.name`) and the layouts each is
    kept in, which are counted as saved activations, not here."""
    shape = tuple(mesh_shape)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    position = {n: i for i, n in enumerate(nodes)}
    aliases = {n: _alias_of(n) for n in nodes}
    held_roots = {_root(n, aliases) for n in nodes if n.name in held}
    size: dict[fx.Node, float] = {}
    last: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op != "call_function" or aliases[node] is not None or node in held_roots:
            continue
        if not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
            continue
        size[node] = _output_bytes(node, plan, shape)
        last[node] = position[node]
    for node in nodes:
        for source in node.all_input_nodes:
            root = _root(source, aliases)
            if root in last:
                last[root] = max(last[root], position[node])
    ends: dict[int, list[fx.Node]] = {}
    for root, at in last.items():
        ends.setdefault(at, []).append(root)
    live = 0.0
    found: list[tuple[str, float]] = []
    for node in nodes:
        live += size.get(node, 0.0)
        strategy = plan.strategies.get(node.name)
        if strategy is not None:
            copies: set[tuple[str, Layout]] = set()
            extra = 0.0
            for source, want in zip(tensor_inputs(node), strategy.inputs):
                have = plan.layouts.get(source.name)
                if not have or want == have[0] or want in held.get(source.name, ()):
                    continue
                if (source.name, want) not in copies:
                    copies.add((source.name, want))
                    extra += want.local_bytes(shape)
            if node.target in (FORWARD, BACKWARD) and ring_axis(node.target, strategy) is not None:
                extra += ring_scratch_bytes(node.target, strategy.inputs, strategy.outputs, shape)
            elif node.target is BACKWARD and (runs := row_runs(op_call(node), strategy)):
                extra += causal_rows_scratch_bytes(runs, strategy.inputs, strategy.outputs, shape)
            found.append((node.name, live + extra))
        for root in ends.get(position[node], ()):
            live -= size[root]
    return found


@dataclass(frozen=True)
class GradientBucket:
    """A sum of gradients the emitted backward issues as one collective (a bucket of several, or
    one alone), per rank: the traced ops that make its members, each member's bytes, whether the
    members are concatenated into a buffer of their own (a bucket's `cat`; one sum alone reads its
    member), how many copies of the buffer the collective makes beside it (gloo's reduce-scatter and
    all-reduce: one), and the traced op after which the program waits on it (None: at once): the
    buffer and the copies are held until then (the schedule waits late, to overlap the sum with the
    ops after it)."""

    members: tuple[str, ...]
    member_bytes: tuple[float, ...]
    concatenated: bool
    copies: int
    released: str | None = None

    @property
    def buffer_bytes(self) -> float:
        return float(sum(self.member_bytes))

    @property
    def issued_bytes(self) -> float:
        """The most that exists beside the members' bytes while the bucket is issued. Concatenated:
        the concatenation makes the buffer beside the members, which it reads last (they are
        freed after it), and the collective then makes its copies beside the buffer, so one
        buffer or the copies, whichever is more. On 4 gloo ranks a ring plan's one bucket (1.57
        MiB) rose the live heap by 1.57 at its `cat` and 1.97 at its reduce-scatter (the copy and
        the reduced block), where the members, buffer and copy counted together had made the model
        1.14 of the live rise. A lone member: the collective reads it, its copies beside it."""
        if self.concatenated:
            return max(1, self.copies) * self.buffer_bytes
        return self.copies * self.buffer_bytes

    @property
    def waited_bytes(self) -> float:
        """What the collective holds from its issue until the program waits on it: its input (the
        buffer, or the lone member) and its copies of it."""
        return (1 + self.copies) * self.buffer_bytes


def with_buckets(steps: Sequence[tuple[str, float]], buckets: Sequence[GradientBucket]) -> list[tuple[str, float]]:
    """`steps` (`op_working_bytes`) with each bucket in it (module doc): each member held from the
    op after the one that makes it until the bucket is issued, after the last member's op, where
    the concatenated buffer and the collective's copies exist beside the members, and are held
    until the op after which the program waits on it (a member made by an op that `steps` does
    not list leaves its bucket out)."""
    position = {name: i for i, (name, _) in enumerate(steps)}
    change = [0.0] * (len(steps) + 1)  # held bytes start at one op and end after another: prefix sums
    at_issue = [0.0] * len(steps)
    for bucket in buckets:
        if not bucket.members or any(m not in position for m in bucket.members):
            continue
        issue = max(position[m] for m in bucket.members)
        for member, nbytes in zip(bucket.members, bucket.member_bytes):
            change[position[member] + 1] += nbytes
            change[issue + 1] -= nbytes
        at_issue[issue] += bucket.issued_bytes
        released = position.get(bucket.released, issue) if bucket.released is not None else issue
        if released > issue:  # waited on later: the collective's input (a lone member, or the
            # buffer) and its copies held through the ops between
            change[issue + 1] += bucket.waited_bytes
            change[released + 1] -= bucket.waited_bytes
    found, held = [], 0.0
    for (name, nbytes), moved, issued in zip(steps, change, at_issue):
        held += moved
        found.append((name, nbytes + held + issued))
    return found
