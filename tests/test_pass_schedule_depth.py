"""Stage 4, schedule: how deep the pass goes does not depend on how long the graph is.

A sequential loop (transformers' Qwen3-Next linear attention walks its sequence chunk by chunk)
leaves chains as long as the loop: a collective whose input is the wait of the one before
(the carried state, resharded each step), first needed only at the loop's end; and in backward a
gradient accumulated step by step, every step put off until one collective's wait comes. The
pass walks both on a stack of its own: a chain longer than Python's recursion limit schedules
like a short one, in the same order (a RecursionError here reached users as an InternalError).
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.fx as fx
from pass_fixtures import all_reduce_node, backward_node, call_node, input_node, node_names, run_lockstep

from autopar.core.meta import info
from autopar.passes.schedule import schedule

aten = torch.ops.aten
RANKS = [(0,), (1,)]


def _longer_than_the_stack() -> int:
    """More links than Python allows frames now: a pass recursing once per link cannot finish."""
    return sys.getrecursionlimit() + 200


def _collective_chain(links: int) -> fx.GraphModule:
    """x, then `links` all-reduces each of the previous one's wait, an independent z, y = w + z."""
    graph = fx.Graph()
    a = input_node(graph, "a", 0)
    x = call_node(graph, "x", aten.mul.Tensor, (a, 2.0))
    for i in range(links):
        x = all_reduce_node(graph, x, str(i), (4, 6), 0, 1)
    z = call_node(graph, "z", aten.mul.Tensor, (a, 3.0))
    y = call_node(graph, "y", aten.add.Tensor, (x, z))
    graph.output((y,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _accumulated_gradient(steps: int) -> fx.GraphModule:
    """A backward whose gradient `d` is summed over `steps` steps after one all-reduce: only the
    output needs it, so every step is put off until the wait comes; `e`, needed twice, is not."""
    graph = fx.Graph()
    a = input_node(graph, "a", 0)
    x = call_node(graph, "x", aten.mul.Tensor, (a, 2.0))
    b = backward_node(graph, "b", aten.mul.Tensor, (x, 3.0))
    wait = all_reduce_node(graph, b, "g", (4, 6), 0, 1)
    for node in (wait, wait.args[0]):
        info(node).phase = "backward"
    d = backward_node(graph, "d0", aten.mul.Tensor, (wait, 2.0))
    for i in range(steps):
        d = backward_node(graph, f"d{i + 1}", aten.add.Tensor, (d, float(i)))
    e = backward_node(graph, "e", aten.mul.Tensor, (b, 5.0))
    e1 = backward_node(graph, "e1", aten.add.Tensor, (e, 1.0))
    graph.output((x, d, e, e1))
    return fx.GraphModule(torch.nn.Module(), graph)


def _same_numbers(before: fx.GraphModule, after: fx.GraphModule) -> None:
    args = {c: [torch.randn(4, 6, generator=torch.Generator().manual_seed(c[0]))] for c in RANKS}
    want = run_lockstep({c: before for c in RANKS}, args, (2,))
    got = run_lockstep({c: after for c in RANKS}, args, (2,))
    for c in RANKS:
        assert len(got[c]) == len(want[c])
        assert all(torch.equal(g, w) for g, w in zip(got[c], want[c]))


def test_a_chain_of_collectives_longer_than_the_stack_is_scheduled() -> None:
    links = _longer_than_the_stack()
    before = _collective_chain(links)
    gm = schedule(copy.deepcopy(before))
    chain = [name for i in range(links) for name in (f"ar_{i}", f"w_{i}")]
    # the first all-reduce is issued right after x and z runs while it is on the wire; each
    # later one waits for the one before (its input), so the rest stays in a row
    assert node_names(gm) == ["a", "x", "ar_0", "z", *chain[1:], "y", "output"]
    report = gm.meta["autopar_schedule"]
    assert (report.collectives, report.waits_moved, report.overlapped_ops) == (links, links, 1)  # z moved up
    _same_numbers(before, gm)


def test_a_gradient_accumulated_over_more_steps_than_the_stack_is_put_off_whole() -> None:
    steps = _longer_than_the_stack()
    before = _accumulated_gradient(steps)
    gm = schedule(copy.deepcopy(before))
    accumulated = [f"d{i}" for i in range(steps + 1)]
    # e and e1 run while the gradient's all-reduce is on the wire; the whole sum after its wait
    assert node_names(gm) == ["a", "x", "b", "ar_g", "e", "e1", "w_g", *accumulated, "output"]
    assert gm.meta["autopar_schedule"].deferred == steps + 1
    _same_numbers(before, gm)
