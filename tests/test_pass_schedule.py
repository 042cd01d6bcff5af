"""Stage 4, schedule: issue collectives early, wait late, change nothing else."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from pass_fixtures import c10d, collectives, gpt_compiled, is_comm, rank_programs, run_lockstep, simulate_step

from autopar.layout import Layout, P, R
from autopar.meta import NodeInfo, info, set_info
from autopar.passes.schedule import COLLECTIVES, ScheduleReport, _group, schedule
from autopar.redistribute import CommStep

aten = torch.ops.aten
MESH = (2, 2, 2)


# ---- a small hand-built graph ------------------------------------------------------------------
def _call(
    graph: fx.Graph, name: str, target: object, args: tuple, role: str = "compute", **extra: object
) -> fx.Node:
    node = graph.create_node("call_function", target, args, {}, name=name)
    set_info(node, NodeInfo(role=role, phase="forward", **extra))  # type: ignore[arg-type]
    return node


def _hand_built() -> fx.GraphModule:
    """Collectives issued late and waited on early, as insert_comm leaves them."""
    graph = fx.Graph()
    a = graph.placeholder("a")
    b = graph.placeholder("b")
    for i, ph in enumerate((a, b)):
        set_info(ph, NodeInfo(role="input", phase="forward", input_index=i))
    x = _call(graph, "x", aten.mul.Tensor, (a, 2.0))
    y = _call(graph, "y", aten.add.Tensor, (b, 1.0))
    z = _call(graph, "z", aten.mul.Tensor, (y, 3.0))
    # collective 1: all_reduce of x (input x is ready long before)
    reduce_step = CommStep("all_reduce", 0, Layout((P,), (4, 6)), Layout((R,), (4, 6)))
    c1 = _call(
        graph,
        "c1",
        c10d.all_reduce.default,
        (x, "sum", "<x>"),
        role="comm",
        comm=reduce_step,
        comm_group="<x>",
    )
    w1 = _call(graph, "w1", c10d.wait_tensor.default, (c1,), role="comm")
    # collective 2: all_gather of x's transpose, with a private preparation chain
    p = _call(graph, "p", aten.permute.default, (x, [1, 0]), role="comm")
    q = _call(graph, "q", aten.clone.default, (p,), role="comm")
    gather_step = CommStep("all_gather", 0, Layout((P,), (6, 4)), Layout((R,), (6, 4)), dim=0)
    c2 = _call(graph, "c2", c10d.all_gather_into_tensor.default, (q, 2, "<x>"), role="comm", comm=gather_step)
    w2 = _call(graph, "w2", c10d.wait_tensor.default, (c2,), role="comm")
    u = _call(graph, "u", aten.add.Tensor, (z, 1.0))
    v = _call(graph, "v", aten.mul.Tensor, (u, u))
    out1 = _call(graph, "out1", aten.add.Tensor, (w1, v))
    out2 = _call(graph, "out2", aten.sum.default, (w2,))
    graph.output((out1, out2))
    return fx.GraphModule(torch.nn.Module(), graph)


def _names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def test_schedule_moves_issues_up_and_waits_down() -> None:
    gm = _hand_built()
    assert _names(gm) == [
        "a", "b", "x", "y", "z", "c1", "w1", "p", "q", "c2", "w2", "u", "v", "out1", "out2", "output",
    ]  # fmt: skip
    schedule(gm)
    assert _names(gm) == [
        "a", "b", "x",
        "c1",  # issued right after its input x
        "y", "z", "u", "v",  # compute overlaps the collective
        "w1",  # the wait right before its first user
        "p", "q", "c2",  # the gather (same group: one in flight) issued as soon as w1 frees it
        "out1",  # ... so it overlaps out1
        "w2", "out2", "output",
    ]  # fmt: skip
    report = gm.meta["autopar_schedule"]
    assert report == ScheduleReport(collectives=2, waits_moved=2, issues_moved=1, overlapped_ops=4 + 1)
    gm.graph.lint()


def test_rescheduling_moves_no_wait_and_no_compute() -> None:
    gm = schedule(_hand_built())
    before = _names(gm)
    again = schedule(gm)
    after = _names(again)
    report = again.meta["autopar_schedule"]
    assert report.collectives == 2 and report.waits_moved == 0
    # collectives issued from the same point may trade places; every other node keeps its slot
    fixed = {"a", "b", "x", "y", "z", "u", "v", "w1", "out1", "w2", "out2", "output"}
    assert [(i, n) for i, n in enumerate(after) if n in fixed] == [
        (i, n) for i, n in enumerate(before) if n in fixed
    ]
    assert report.overlapped_ops == 5  # c2 shares c1's group: it starts at w1 and overlaps out1 only


def test_shared_preparation_nodes_stay_put() -> None:
    """A prepared buffer that something else also reads is not private to the collective."""
    gm = _hand_built()
    clone = next(n for n in gm.graph.nodes if n.name == "q")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        extra = _call(gm.graph, "extra", aten.neg.default, (clone,))
    out.args = ((*out.args[0], extra),)
    gm.recompile()
    schedule(gm)
    names = _names(gm)
    # the shared buffer stays put; the collective, whose group c1 occupies until w1, is issued
    # right after w1
    assert names.index("q") > names.index("z")
    assert names.index("c2") == names.index("w1") + 1


def test_scheduled_hand_built_graph_computes_the_same() -> None:
    before = _hand_built()
    after = schedule(copy.deepcopy(before))
    mesh = (2,)
    a = {c: torch.randn(4, 6, generator=torch.Generator().manual_seed(c[0])) for c in [(0,), (1,)]}
    b = {c: torch.randn(4, 6, generator=torch.Generator().manual_seed(9 + c[0])) for c in [(0,), (1,)]}
    args = {c: [a[c], b[c]] for c in a}
    want = run_lockstep({c: before for c in a}, args, mesh)
    got = run_lockstep({c: after for c in a}, args, mesh)
    for c in a:
        assert all(torch.equal(x, y) for x, y in zip(got[c], want[c]))
    # and the simulation itself is right: out1 = all_reduce(2a) + (3(b+1)+1)^2, out2 = sum(gather(2a^T))
    total = 2 * a[(0,)] + 2 * a[(1,)]
    for c in a:
        v = (3 * (b[c] + 1) + 1) ** 2
        torch.testing.assert_close(got[c][0], total + v)
        torch.testing.assert_close(got[c][1], total.sum())


# ---- the compiled MLP and GPT -------------------------------------------------------------------
def _graphs() -> list[fx.GraphModule]:
    return [rank_programs("two_linear", MESH)[(0, 0, 0)][0], gpt_compiled(MESH, (0, 0, 0))[0].graph]


@pytest.mark.parametrize("which", [0, 1], ids=["two_linear", "gpt"])
def test_waits_sit_right_before_their_first_user(which: int) -> None:
    gm = _graphs()[which]
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    waits = [n for n in nodes if n.op == "call_function" and n.target is c10d.wait_tensor.default]
    assert waits
    for wait in waits:
        first = min(wait.users, key=position.__getitem__)
        between = nodes[position[wait] + 1 : position[first]]
        if any(is_comm(n) and n.target in COLLECTIVES and _group(n) == _group(wait.args[0]) for n in between):
            # forced early: the next collective on its group may only start after this wait
            nxt = next(n for n in between if n.target in COLLECTIVES and _group(n) == _group(wait.args[0]))
            assert all(is_comm(n) for n in nodes[position[wait] + 1 : position[nxt]]), wait.name
            continue
        # otherwise only comm nodes (other waits, collectives released by them) sit in between
        assert all(is_comm(n) for n in between), (wait.name, [n.name for n in between])


@pytest.mark.parametrize("which", [0, 1], ids=["two_linear", "gpt"])
def test_collectives_sit_right_after_their_last_input(which: int) -> None:
    gm = _graphs()[which]
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    first_backward = min(
        i
        for i, n in enumerate(nodes)
        if n.op == "call_function" and not is_comm(n) and info(n).phase == "backward"
    )
    in_flight_until: dict[str, int] = {}
    for coll in collectives(gm):
        last = position[max(coll.all_input_nodes, key=position.__getitem__)]
        if info(coll).phase == "backward":  # a backward collective waits for the backward to begin
            last = max(last, first_backward - 1)
        previous_wait = in_flight_until.get(_group(coll), -1)
        assert previous_wait < position[coll], (coll.name, "two collectives in flight on one group")
        last = max(last, previous_wait)  # one collective in flight per process group
        between = nodes[last + 1 : position[coll]]
        # no computation delays it: only communication (other collectives with their buffers, or
        # the waits that free their groups) may sit between the moment it can start and its issue
        assert all(is_comm(n) for n in between), (coll.name, [n.name for n in between])
        in_flight_until[_group(coll)] = position[next(iter(coll.users))]
        # its private preparation chain (permute/clone of the buffer) moved along with it
        prep = coll.args[0]
        if is_comm(prep) and len(prep.users) == 1 and prep.target is not c10d.wait_tensor.default:
            assert position[prep] == position[coll] - 1 or all(
                is_comm(n) for n in nodes[position[prep] : position[coll]]
            )


@pytest.mark.parametrize("which", [0, 1], ids=["two_linear", "gpt"])
def test_report_matches_the_graph(which: int) -> None:
    gm = _graphs()[which]
    gm.graph.lint()
    report: ScheduleReport = gm.meta["autopar_schedule"]
    colls = collectives(gm)
    assert report.collectives == len(colls)
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    overlapped = 0
    for coll in colls:
        (wait,) = coll.users
        overlapped += sum(
            1
            for n in nodes[position[coll] + 1 : position[wait]]
            if n.op == "call_function" and info(n).role == "compute"
        )
    assert report.overlapped_ops == overlapped > 0
    waits = sum(1 for n in nodes if n.op == "call_function" and n.target is c10d.wait_tensor.default)
    assert 0 < report.issues_moved <= report.collectives and 0 < report.waits_moved <= waits


def test_schedule_only_reorders() -> None:
    scheduled = rank_programs("two_linear", MESH, True)[(1, 0, 1)][0]
    plain = rank_programs("two_linear", MESH, False)[(1, 0, 1)][0]

    def signature(gm: fx.GraphModule) -> set[tuple]:
        return {
            (
                n.name,
                n.op,
                str(n.target),
                str(n.args),
                str(n.kwargs),
                info(n).phase if n.op != "output" else "",
            )
            for n in gm.graph.nodes
        }

    assert signature(scheduled) == signature(plain)
    assert _names(scheduled) != _names(plain)


def test_scheduled_program_is_bit_identical_on_every_rank() -> None:
    fwd_s, bwd_s = simulate_step("two_linear", MESH, scheduled=True)
    fwd_p, bwd_p = simulate_step("two_linear", MESH, scheduled=False)
    assert fwd_s.keys() == fwd_p.keys() and len(fwd_s) == 8
    for c in fwd_s:
        assert len(fwd_s[c]) == len(fwd_p[c]) and len(bwd_s[c]) == len(bwd_p[c]) == 2
        assert all(torch.equal(a, b) for a, b in zip(fwd_s[c], fwd_p[c])), c
        assert all(torch.equal(a, b) for a, b in zip(bwd_s[c], bwd_p[c])), c


def test_backward_collectives_are_not_hoisted_into_the_forward() -> None:
    gm = rank_programs("two_linear", MESH)[(0, 0, 0)][0]
    nodes = list(gm.graph.nodes)
    last_forward = max(
        i
        for i, n in enumerate(nodes)
        if n.op == "call_function" and not is_comm(n) and info(n).phase == "forward"
    )
    early = [n.name for n in collectives(gm) if info(n).phase == "backward" and nodes.index(n) < last_forward]
    assert early == []
