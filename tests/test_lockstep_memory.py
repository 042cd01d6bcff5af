"""The lockstep runner frees what it is done with: a value is dropped once its last reader has run
(8 ranks of a 23M-parameter BiT kept every intermediate and passed 11.8 GB), an argument handed
over (`consume=True`, the saved values a backward reads) too; a run asked to `record` keeps them."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import pytest
import torch
import torch.fx as fx
from lockstep_fixtures import last_reads, run_lockstep


def _probed_graph(seen: list[bool], refs: dict[str, Callable[[], object]]) -> fx.GraphModule:
    """x -> a = x * 2 -> b = a + 1 -> probe(b): the probe runs after `a`'s last reader and notes
    whether `a` (and the argument `x`) are still alive."""

    def keep_a(t: torch.Tensor) -> torch.Tensor:
        refs["a"] = weakref.ref(t)
        return t

    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.extend([refs["a"]() is not None, refs["x"]() is not None])
        return t * 3

    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(keep_a, (graph.call_function(torch.mul, (x, 2)),))
    b = graph.call_function(torch.add, (a, 1))
    graph.output((graph.call_function(probe, (b,)),))
    return fx.GraphModule({}, graph)


@pytest.mark.parametrize("record", [False, True])
def test_a_value_is_freed_after_its_last_reader_unless_recorded(record: bool) -> None:
    seen: list[bool] = []
    refs: dict[str, Callable[[], object]] = {}
    gm = _probed_graph(seen, refs)
    x = torch.ones(4)
    refs["x"] = weakref.ref(x)
    kept: dict = {}
    out = run_lockstep({(0,): gm, (1,): gm}, {(0,): [x], (1,): [x.clone()]}, (2,), kept if record else None)
    assert torch.equal(out[(0,)][0], torch.full((4,), 9.0))
    a_alive = seen[0::2]
    assert a_alive == [record, record]  # each rank's `a`, when the probe ran
    assert bool(kept) == record


def test_an_argument_handed_over_is_freed_after_its_last_reader() -> None:
    seen: list[bool] = []
    refs: dict[str, Callable[[], object]] = {}
    gm = _probed_graph(seen, refs)
    args = {(0,): [torch.ones(4)]}
    refs["x"] = weakref.ref(args[(0,)][0])
    run_lockstep({(0,): gm}, args, (1,), consume=True)
    assert seen == [False, False] and args == {(0,): []}  # x: read by the mul, then dropped


def test_last_reads_puts_each_node_at_its_last_reader() -> None:
    gm = _probed_graph([], {})
    nodes = list(gm.graph.nodes)  # x, mul, keep_a, add, probe, output
    at = {n.name: i for i, reads in enumerate(last_reads(nodes)) for n in reads}
    assert [at[n.name] for n in nodes] == [1, 2, 3, 4, 5, 5]
