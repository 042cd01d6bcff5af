"""Bucketing (part of stage 4): small collectives ready together merge into one; results stay the same."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.fx as fx
from pass_fixtures import (
    all_reduce_node,
    backward_node,
    c10d,
    call_node,
    collectives,
    input_node,
    node_names,
    run_lockstep,
)

from autopar.core.layout import Layout, P, R
from autopar.core.mesh import Mesh
from autopar.core.meta import info
from autopar.core.redistribute import CommStep
from autopar.passes.bucket import bucket
from autopar.passes.schedule import _tail, schedule

aten = torch.ops.aten


SMALL = {"a": (4, 6), "b": (3,), "c": (2, 5)}


def _small_reductions() -> fx.GraphModule:
    """Three small all-reduces on one group, all ready at the start (their inputs are inputs)."""
    graph = fx.Graph()
    inputs = {n: input_node(graph, n, i) for i, n in enumerate(SMALL)}
    outs = []
    for name, shape in SMALL.items():
        waited = all_reduce_node(graph, inputs[name], name, shape, 0, 1)
        outs.append(call_node(graph, f"m_{name}", aten.mul.Tensor, (waited, 2.0)))
    graph.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _lockstep_small(gm: fx.GraphModule) -> dict[tuple[int, ...], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    args = {c: [torch.randn(s, generator=gen) for s in SMALL.values()] for c in [(0,), (1,)]}
    return run_lockstep({c: gm for c in args}, args, (2,))


def test_small_all_reduces_ready_together_become_one_bucket() -> None:
    plain = _small_reductions()
    bucketed = schedule(copy.deepcopy(plain), Mesh.from_shape((2,)))
    report = bucketed.meta["autopar_schedule"]
    assert (report.buckets, report.bucketed, report.collectives) == (1, 3, 1)
    calls = [n for n in bucketed.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [
        aten.reshape.default, aten.reshape.default, aten.reshape.default, aten.cat.default,
        c10d.all_reduce.default, c10d.wait_tensor.default,
        aten.narrow.default, aten.view.default, aten.narrow.default, aten.view.default,
        aten.narrow.default, aten.view.default,
        aten.mul.Tensor, aten.mul.Tensor, aten.mul.Tensor,
    ]  # fmt: skip
    flats, cat, merged = calls[:3], calls[3], calls[4]
    assert [f.args[1] for f in flats] == [[24], [3], [10]] and cat.args == (flats, 0)
    assert merged.args == (cat, "sum", "<x>")
    assert [(n.args[2], n.args[3]) for n in calls[6:12:2]] == [(0, 24), (24, 3), (27, 10)]
    assert [n.args[1] for n in calls[7:12:2]] == [[4, 6], [3], [2, 5]]
    # the merged collective is priced as one all-reduce of the 37 elements and reports its members
    step = info(merged).comm
    assert step.kind == "all_reduce" and step.before.local_numel((2,)) == 37
    assert step.bytes_sent((2,)) == sum(
        s.bytes_sent((2,)) for s in (m.step for m in merged.meta["autopar_bucket"])
    )
    assert [m.name for m in merged.meta["autopar_bucket"]] == ["ar_a", "ar_b", "ar_c"]
    want, got = _lockstep_small(plain), _lockstep_small(bucketed)
    for c in want:
        assert all(torch.equal(x, y) for x, y in zip(got[c], want[c]))


def test_sums_merge_only_where_the_result_stays_bit_identical() -> None:
    """On groups of more than two ranks a merged sum may be added in another order by the backend,
    so by default only 2-rank groups merge reductions (all-gathers merge anywhere)."""
    on_four = schedule(_small_reductions(), Mesh.from_shape((4,)))
    assert on_four.meta["autopar_schedule"].buckets == 0
    gm = _small_reductions()
    report = bucket(gm, (4,), max_sum_group=4)
    assert (report.buckets, report.merged) == (1, 3)


@pytest.mark.parametrize(
    ("max_bytes", "max_count", "sizes"), [(25 * 2**20, 2, [2, 1]), (28 * 4, 64, [2, 1]), (0, 64, [])]
)
def test_bucket_limits(max_bytes: int, max_count: int, sizes: list[int]) -> None:
    """A bucket holds at most `bucket_count` collectives and `bucket_bytes` of buffer; 0 turns it off."""
    gm = schedule(_small_reductions(), Mesh.from_shape((2,)), bucket_bytes=max_bytes, bucket_count=max_count)
    merged = [n for n in collectives(gm) if "autopar_bucket" in n.meta]
    assert sorted((len(n.meta["autopar_bucket"]) for n in merged), reverse=True) == [
        s for s in sizes if s > 1
    ]
    assert len(collectives(gm)) == 3 - sum(s - 1 for s in sizes)


def _two_gradients_and_activation() -> fx.GraphModule:
    """Backward: two small weight gradients (one output each, inputs to the graph here), all-reduced
    on one group and ready together, and an input gradient that feeds two outputs."""
    graph = fx.Graph()
    g, d = (input_node(graph, n, i) for i, n in enumerate("gd"))

    node = functools.partial(backward_node, graph)

    step = CommStep("all_reduce", 0, Layout((P,), (8,)), Layout((R,), (8,)))
    h = node("h", aten.sub.Tensor, (g, 1.0))
    grads = []
    for name, wgrad in (("1", g), ("2", d)):
        ar = node(
            f"ar{name}", c10d.all_reduce.default, (wgrad, "sum", "<x>"), "comm", comm=step, comm_group="<x>"
        )
        waited = node(f"w{name}", c10d.wait_tensor.default, (ar,), "comm", layouts=(step.after,))
        grads.append(node(f"gout{name}", aten.mul.Tensor, (waited, 0.5)))
    k1 = node("k1", aten.add.Tensor, (h, 1.0))
    k2 = node("k2", aten.mul.Tensor, (h, 2.0))
    graph.output((*grads, k1, k2))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_bucket_of_gradients_stays_a_gradient() -> None:
    """A bucket feeds several gradients, through its own pieces only: it is still in the tail, so
    it is not waited on before the end. (Once it was not, and a bucket of bias gradients at the
    end of the backward held every gradient collective behind it: 47.8 % exposed -> 20.6 %.)"""
    gm = _two_gradients_and_activation()
    report = bucket(gm, (2,))
    assert (report.buckets, report.merged) == (1, 2)
    nodes = list(gm.graph.nodes)
    (merged,) = collectives(gm)
    tail = _tail(nodes)
    # every node the bucket added (its buffer, collective, wait and pieces) is in the tail, and
    # so are the gradients after it; the input gradient's path is not
    added = [n for n in nodes if n.op == "call_function" and info(n).note == "bucket"]
    assert merged in added and len(added) == 9 and set(added) <= tail
    assert {"gout1", "gout2"} <= {n.name for n in tail}
    assert "h" not in {n.name for n in tail}  # it feeds two outputs
    # the bucket is issued as soon as its inputs exist and waited on only for the gradients
    assert node_names(schedule(gm)) == [
        "g", "d", "reshape_default", "reshape_default_1", "cat_default", "all_reduce_default",
        "h", "k1", "k2",
        "wait_tensor_default", "narrow_default", "view_default", "gout1", "narrow_default_1",
        "view_default_1", "gout2", "output",
    ]  # fmt: skip
