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
  beside the blocks.

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
from autopar.rules.calls import tensor_inputs
from autopar.rules.ring_attention import BACKWARD, FORWARD, key_index, ring_axis

LIFETIMES_KEY = "autopar_working_lifetimes"  # gm.meta: the graph's `_Lifetimes`


def _alias_of(node: fx.Node) -> fx.Node | None:
    """The tensor `node` aliases (a view's base, a `getitem`'s op), or None if it is its own."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem or is_view(node):
        source = node.args[0] if node.args else None
        return source if isinstance(source, fx.Node) else None
    return None


def _root(node: fx.Node, aliases: Mapping[fx.Node, fx.Node | None]) -> fx.Node:
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


@dataclass(frozen=True)
class _Lifetimes:
    """What of the working memory depends on the graph alone, worked out once per graph (the search
    counts the memory of many plans of one graph): the ops in order, each value's alias root, the
    position of each root's last reader, each op's tensor inputs."""

    count: int  # nodes in the graph when built (a changed graph is built again)
    nodes: tuple[fx.Node, ...]
    roots: dict[fx.Node, fx.Node]
    values: frozenset[fx.Node]  # ops making memory of their own (no alias, a tensor or tuple value)
    ends: dict[int, tuple[fx.Node, ...]]  # position -> the values whose last reader it is
    inputs: dict[fx.Node, list[fx.Node]]

    @staticmethod
    def of(gm: fx.GraphModule) -> _Lifetimes:
        found = gm.meta.get(LIFETIMES_KEY)
        first = next(iter(gm.graph.nodes), None)
        if isinstance(found, _Lifetimes) and found.count == len(gm.graph.nodes) and (
            not found.nodes or found.nodes[0] is first
        ):  # (a copy of the graph, which may carry its meta, has nodes of its own)
            return found
        nodes = tuple(n for n in gm.graph.nodes if n.op != "output")
        aliases = {n: _alias_of(n) for n in nodes}
        roots = {n: _root(n, aliases) for n in nodes}
        values = frozenset(
            n for n in nodes
            if n.op == "call_function" and aliases[n] is None
            and isinstance(n.meta.get("val"), (torch.Tensor, tuple, list))
        )  # fmt: skip
        last = {n: i for i, n in enumerate(nodes) if n in values}
        for i, node in enumerate(nodes):
            for source in node.all_input_nodes:
                root = roots.get(source, source)
                if root in last:
                    last[root] = max(last[root], i)
        ends: dict[int, list[fx.Node]] = {}
        for root, at in last.items():
            ends.setdefault(at, []).append(root)
        inputs = {n: tensor_inputs(n) for n in nodes if n.op == "call_function"}
        built = _Lifetimes(len(gm.graph.nodes), nodes, roots, values, {k: tuple(v) for k, v in ends.items()}, inputs)
        gm.meta[LIFETIMES_KEY] = built
        return built


def op_working_bytes(
    gm: fx.GraphModule, plan: Plan, mesh_shape: Sequence[int], held: Mapping[str, Collection[Layout]]
) -> list[tuple[str, float]]:
    """(op name, working bytes per rank while it runs) for every op with a strategy, in the traced
    order (module doc). `held`: the saved values (`memory.SavedValue.name`) and the layouts each is
    kept in, which are counted as saved activations, not here."""
    shape = tuple(mesh_shape)
    graph = _Lifetimes.of(gm)
    held_roots = {graph.roots[n] for n in graph.nodes if n.name in held}
    size = {n: _output_bytes(n, plan, shape) for n in graph.values if n not in held_roots}
    live = 0.0
    found: list[tuple[str, float]] = []
    for position, node in enumerate(graph.nodes):
        live += size.get(node, 0.0)
        strategy = plan.strategies.get(node.name)
        if strategy is not None:
            copies: set[tuple[str, Layout]] = set()
            extra = 0.0
            for source, want in zip(graph.inputs.get(node, ()), strategy.inputs):
                have = plan.layouts.get(source.name)
                if not have or want == have[0] or want in held.get(source.name, ()):
                    continue
                if (source.name, want) not in copies:
                    copies.add((source.name, want))
                    extra += want.local_bytes(shape)
            if node.target in (FORWARD, BACKWARD) and ring_axis(node.target, strategy) is not None:
                extra += ring_scratch_bytes(node.target, strategy.inputs, strategy.outputs, shape)
            found.append((node.name, live + extra))
        for root in graph.ends.get(position, ()):
            live -= size.get(root, 0.0)
    return found


def working_bytes(
    gm: fx.GraphModule, plan: Plan, mesh_shape: Sequence[int], held: Mapping[str, Collection[Layout]]
) -> float:
    """The step's working memory per rank: the most `op_working_bytes` gives (0 without ops)."""
    return max((b for _, b in op_working_bytes(gm, plan, mesh_shape, held)), default=0.0)
