"""Bucketing (part of stage 4): collectives that can travel together merge into one; results stay the same."""

from __future__ import annotations

import copy
import functools
import operator

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

from autopar.compiler.driver import compile_for_rank
from autopar.core.collectives import functional_sums
from autopar.core.layout import Layout, P, R, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import info
from autopar.core.redistribute import CommStep
from autopar.cost.timeline import StepClock
from autopar.passes.bucket import bucket
from autopar.passes.schedule import _tail, schedule
from examples.zoo import Llama, LlamaConfig

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
        c10d.all_reduce_.default, c10d.wait_tensor.default, aten.split_with_sizes.default,
        operator.getitem, aten.view.default, operator.getitem, aten.view.default,
        operator.getitem, aten.view.default,
        aten.mul.Tensor, aten.mul.Tensor, aten.mul.Tensor,
    ]  # fmt: skip
    flats, cat, merged, split = calls[:3], calls[3], calls[4], calls[6]
    assert [f.args[1] for f in flats] == [[24], [3], [10]] and cat.args == (flats, 0)
    assert merged.args == (cat, "sum", "<x>")
    # one split unpacks the bucket (not a narrow per member), its pieces in buffer order
    assert split.args == (calls[5], [24, 3, 10], 0)
    assert [n.args for n in calls[7:13:2]] == [(split, 0), (split, 1), (split, 2)]
    assert [n.args[1] for n in calls[8:13:2]] == [[4, 6], [3], [2, 5]]
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
    # for torch.compile the in-place sum goes back to the functional op (Inductor reinplaces it)
    functional_sums(bucketed)
    assert [n.target for n in collectives(bucketed)] == [c10d.all_reduce.default]
    got = _lockstep_small(bucketed)
    assert all(torch.equal(x, y) for c in want for x, y in zip(got[c], want[c]))


def test_sums_on_larger_groups_merge_unless_bit_identity_is_asked_for() -> None:
    """On groups of more than two ranks a merged sum may be added in another order by the backend
    (float rounding, as DDP's buckets): merged by default, kept apart with `max_sum_group=2`."""
    on_four = schedule(_small_reductions(), Mesh.from_shape((4,)))
    assert on_four.meta["autopar_schedule"].buckets == 1
    assert [n.target for n in collectives(on_four)] == [c10d.all_reduce_.default]
    gm = _small_reductions()
    report = bucket(gm, (4,), max_sum_group=2)
    assert (report.buckets, report.merged) == (0, 0)
    assert [n.name for n in collectives(gm)] == ["ar_a", "ar_b", "ar_c"]


def _apart(big: bool = False) -> fx.GraphModule:
    """Two all-reduces on one group ready apart: `a`'s at the start, `m`'s after a compute node;
    `a`'s result goes through a free view (a transpose) and both are used only at the end."""
    graph = fx.Graph()
    a, b = input_node(graph, "a", 0), input_node(graph, "b", 1)
    shape_a = (1024, 1024) if big else (4, 6)
    waited_a = all_reduce_node(graph, a, "a", shape_a, 0, 1)
    t = call_node(graph, "t", aten.transpose.int, (waited_a, 0, 1))
    m = call_node(graph, "m", aten.mul.Tensor, (b, 2.0))
    waited_m = all_reduce_node(graph, m, "m", shape_a[::-1], 0, 1)
    graph.output((call_node(graph, "s", aten.add.Tensor, (t, waited_m)),))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_collectives_ready_apart_merge_when_both_are_needed_later() -> None:
    """Windows, not points: `a` is ready before the compute node and `m` after it, but neither is
    used before both exist, so they travel together; `a`'s transpose moves down to the bucket's
    wait (a view reads nothing else), so it does not pin the wait right after `a`."""
    plain = _apart()
    gm = copy.deepcopy(plain)
    report = bucket(gm, (2,))
    assert (report.buckets, report.merged) == (1, 2)
    assert node_names(gm) == [
        "a", "b", "m", "reshape_default", "reshape_default_1", "cat_default", "all_reduce__default",
        "wait_tensor_default", "split_with_sizes_default", "getitem", "view_default", "t",
        "getitem_1", "view_default_1", "s", "output",
    ]  # fmt: skip
    (merged,) = collectives(gm)
    assert merged.args[0].args[0][0].args[0].name == "a" and merged.args[0].args[0][1].args[0].name == "m"
    gen = torch.Generator().manual_seed(3)
    args = {c: [torch.randn(4, 6, generator=gen), torch.randn(6, 4, generator=gen)] for c in [(0,), (1,)]}
    want = run_lockstep({c: plain for c in args}, args, (2,))
    got = run_lockstep({c: gm for c in args}, args, (2,))
    assert all(torch.equal(got[c][0], want[c][0]) for c in args)


class _SlowMul(StepClock):
    """The H100 table's clock, with the compute node `m` taking a whole second."""

    def duration(self, node: fx.Node) -> float:
        return 1.0 if node.name == "m" else super().duration(node)


@pytest.mark.parametrize(("big", "merged"), [(False, 1), (True, 0)])
def test_the_clock_keeps_a_collective_out_when_waiting_would_expose_it(big: bool, merged: int) -> None:
    """With a modeled clock, `a` (ready a second before `m`) joins `m`'s bucket only when the time
    it would then spend exposed is below the latency the merge saves: a small `a` (latency-bound)
    merges, a 4 MiB one (its transfer hidden behind `m` when alone) stays apart."""
    gm = _apart(big)
    report = bucket(gm, (2,), clock=_SlowMul(Mesh.from_shape((2,)), "h100-nvlink-ib"))
    assert report.buckets == merged
    names = [n.name for n in collectives(gm)]
    assert names == (["all_reduce__default"] if merged else ["ar_a", "ar_m"])


def _two_all_to_alls() -> fx.GraphModule:
    """Two all-to-alls on one 2-rank group, as insert_comm emits them (the split dim in front)."""
    graph = fx.Graph()
    outs = []
    inputs = [input_node(graph, f"x{i}", i) for i in range(2)]
    for i, (x, (rows, cols)) in enumerate(zip(inputs, [(4, 3), (6, 2)])):
        step = CommStep(
            "all_to_all",
            0,
            Layout((Shard(1),), (rows, 2 * cols)),
            Layout((Shard(0),), (rows, 2 * cols)),
            dim=1,
            dst_dim=0,
        )
        split = [rows // 2] * 2
        a2a = call_node(
            graph,
            f"a2a{i}",
            c10d.all_to_all_single.default,
            (x, split, split, "<x>"),
            "comm",
            comm=step,
            comm_group="<x>",
        )
        waited = call_node(graph, f"w{i}", c10d.wait_tensor.default, (a2a,), "comm", layouts=(step.after,))
        outs.append(call_node(graph, f"o{i}", aten.mul.Tensor, (waited, 2.0)))
    graph.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_all_to_alls_merge_row_by_row_and_stay_bit_identical() -> None:
    """Each member's [g, n / g] rows (one per destination) side by side, one exchange, each member's
    columns cut out of the received rows: the same values as two exchanges."""
    plain = _two_all_to_alls()
    gm = copy.deepcopy(plain)
    report = bucket(gm, (2,))
    assert (report.buckets, report.merged) == (1, 2)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [
        aten.reshape.default, aten.reshape.default, aten.cat.default, aten.view.default,
        c10d.all_to_all_single.default, c10d.wait_tensor.default, aten.view.default,
        aten.split_with_sizes.default, operator.getitem, aten.clone.default, aten.view.default,
        operator.getitem, aten.clone.default, aten.view.default,
        aten.mul.Tensor, aten.mul.Tensor,
    ]  # fmt: skip
    assert [c.args[1] for c in calls[:2]] == [[2, 6], [2, 6]] and calls[2].args[1] == 1
    assert calls[4].args[1:] == ([12, 12], [12, 12], "<x>")
    assert calls[6].args[1] == [2, 12]
    assert calls[7].args == (calls[6], [6, 6], 1)  # each member's columns of the received rows
    assert [c.args for c in (calls[8], calls[11])] == [(calls[7], 0), (calls[7], 1)]
    assert [c.args[1] for c in (calls[10], calls[13])] == [[4, 3], [6, 2]]
    step = info(calls[4]).comm
    assert step.kind == "all_to_all" and step.bytes_sent((2,)) == sum(
        m.step.bytes_sent((2,)) for m in calls[4].meta["autopar_bucket"]
    )
    gen = torch.Generator().manual_seed(4)
    args = {c: [torch.randn(4, 3, generator=gen), torch.randn(6, 2, generator=gen)] for c in [(0,), (1,)]}
    want = run_lockstep({c: plain for c in args}, args, (2,))
    got = run_lockstep({c: gm for c in args}, args, (2,))
    for c in args:
        assert all(torch.equal(x, y) for x, y in zip(got[c], want[c]))


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
    assert merged in added and len(added) == 10 and set(added) <= tail
    assert {"gout1", "gout2"} <= {n.name for n in tail}
    assert "h" not in {n.name for n in tail}  # it feeds two outputs
    # the bucket is issued as soon as its inputs exist and waited on only for the gradients
    assert node_names(schedule(gm)) == [
        "g", "d", "reshape_default", "reshape_default_1", "cat_default", "all_reduce__default",
        "h", "k1", "k2",
        "wait_tensor_default", "split_with_sizes_default", "getitem", "view_default", "gout1",
        "getitem_1", "view_default_1", "gout2", "output",
    ]  # fmt: skip


def _layer_norm_backward_sums() -> fx.GraphModule:
    """Layer norm's backward as traced: two independent row sums, the second computed after the
    first one's result is used."""
    graph = fx.Graph()
    g, x = input_node(graph, "g", 0), input_node(graph, "x", 1)
    s1 = call_node(graph, "s1", aten.sum.dim_IntList, (g, [1], True))
    gx = call_node(graph, "gx", aten.mul.Tensor, (g, x))
    s2 = call_node(graph, "s2", aten.sum.dim_IntList, (gx, [1], True))
    w1 = all_reduce_node(graph, s1, "1", (4, 1), 0, 1)
    u = call_node(graph, "u", aten.sub.Tensor, (g, w1))
    d2 = call_node(graph, "d2", aten.div.Tensor, (s2, 6.0))
    w2 = all_reduce_node(graph, d2, "2", (4, 1), 0, 1)
    graph.output((call_node(graph, "out", aten.mul.Tensor, (u, w2)),))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_collective_pulls_up_the_compute_it_needs_to_join_a_bucket() -> None:
    """The second sum's division comes after the first sum's use but does not depend on it: it
    moves up before that use, and both sums travel in one all-reduce."""
    plain = _layer_norm_backward_sums()
    gm = copy.deepcopy(plain)
    report = bucket(gm, (2,))
    assert (report.buckets, report.merged) == (1, 2)
    assert node_names(gm) == [
        "g", "x", "s1", "gx", "s2", "d2", "reshape_default", "reshape_default_1", "cat_default",
        "all_reduce__default", "wait_tensor_default", "split_with_sizes_default", "getitem",
        "view_default", "getitem_1", "view_default_1", "u", "out", "output",
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(6)
    args = {c: [torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)] for c in [(0,), (1,)]}
    want = run_lockstep({c: plain for c in args}, args, (2,))
    got = run_lockstep({c: gm for c in args}, args, (2,))
    assert all(torch.equal(got[c][0], want[c][0]) for c in args)


def test_a_round_of_merges_never_puts_a_wait_above_its_collective() -> None:
    """A merge that hoists compute can move a use of another bucket's member above that member's
    inputs within one round (a small LLaMA on 2x2x2 priced on the H100 table did, at its head);
    such a bucket waits for the next round. Every rank's scheduled graph stays in order, and
    every wait comes after its collective."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, seq_len=16, dim=32, n_layer=4, n_head=4, n_kv_head=4, hidden=64))
    idx = torch.randint(0, 64, (8, 16))
    compiled = compile_for_rank(model, Mesh.from_shape((2, 2, 2)), (idx, idx), coords=(0, 0, 0), hardware="h100-nvlink-ib")
    assert compiled.report.schedule is not None and compiled.report.schedule.buckets > 0
    position = {n: i for i, n in enumerate(compiled.graph.graph.nodes)}
    waits = [n for n in compiled.graph.graph.nodes if n.target is torch.ops._c10d_functional.wait_tensor.default]
    assert waits and all(position[w.args[0]] < position[w] for w in waits)
