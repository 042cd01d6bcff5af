"""Stage 4, schedule: issue collectives early, wait late, change nothing else."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pass_fixtures import (
    all_reduce_node,
    backward_node,
    c10d,
    call_node,
    collectives,
    gpt_compiled,
    input_node,
    is_comm,
    model_case,
    node_names,
    propagated,
    rank_programs,
    run_lockstep,
    run_programs,
    simulate_step,
    train_in_lockstep,
)

from autopar.core.collectives import COLLECTIVES
from autopar.core.layout import Layout, P, R
from autopar.core.mesh import Mesh
from autopar.core.meta import NodeInfo, info, set_info
from autopar.core.redistribute import CommStep
from autopar.passes.emit import emit
from autopar.passes.insert_comm import insert_comm
from autopar.passes.schedule import ScheduleReport, _group, _tail, schedule
from autopar.reporting.report import CollectiveRecord, build_report
from autopar.rules.registry import default_registry
from autopar.runtime.program import EmittedProgram
from autopar.testing import all_coords
from examples.models import make_gpt

aten = torch.ops.aten
MESH = (2, 2, 2)


# ---- a small hand-built graph ------------------------------------------------------------------
def _hand_built() -> fx.GraphModule:
    """Collectives issued late and waited on early, as insert_comm leaves them."""
    graph = fx.Graph()
    a = graph.placeholder("a")
    b = graph.placeholder("b")
    for i, ph in enumerate((a, b)):
        set_info(ph, NodeInfo(role="input", phase="forward", input_index=i))
    x = call_node(graph, "x", aten.mul.Tensor, (a, 2.0))
    y = call_node(graph, "y", aten.add.Tensor, (b, 1.0))
    z = call_node(graph, "z", aten.mul.Tensor, (y, 3.0))
    # collective 1: all_reduce of x (input x is ready long before)
    reduce_step = CommStep("all_reduce", 0, Layout((P,), (4, 6)), Layout((R,), (4, 6)))
    c1 = call_node(
        graph,
        "c1",
        c10d.all_reduce.default,
        (x, "sum", "<x>"),
        role="comm",
        comm=reduce_step,
        comm_group="<x>",
    )
    w1 = call_node(graph, "w1", c10d.wait_tensor.default, (c1,), role="comm")
    # collective 2: all_gather of x's transpose, with a private preparation chain
    p = call_node(graph, "p", aten.permute.default, (x, [1, 0]), role="comm")
    q = call_node(graph, "q", aten.clone.default, (p,), role="comm")
    gather_step = CommStep("all_gather", 0, Layout((P,), (6, 4)), Layout((R,), (6, 4)), dim=0)
    c2 = call_node(
        graph, "c2", c10d.all_gather_into_tensor.default, (q, 2, "<x>"), role="comm", comm=gather_step
    )
    w2 = call_node(graph, "w2", c10d.wait_tensor.default, (c2,), role="comm")
    u = call_node(graph, "u", aten.add.Tensor, (z, 1.0))
    v = call_node(graph, "v", aten.mul.Tensor, (u, u))
    out1 = call_node(graph, "out1", aten.add.Tensor, (w1, v))
    out2 = call_node(graph, "out2", aten.sum.default, (w2,))
    graph.output((out1, out2))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_schedule_moves_issues_up_and_waits_down() -> None:
    gm = _hand_built()
    assert node_names(gm) == [
        "a", "b", "x", "y", "z", "c1", "w1", "p", "q", "c2", "w2", "u", "v", "out1", "out2", "output",
    ]  # fmt: skip
    schedule(gm)
    assert node_names(gm) == [
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
    before = node_names(gm)
    again = schedule(gm)
    after = node_names(again)
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
        extra = call_node(gm.graph, "extra", aten.neg.default, (clone,))
    out.args = ((*out.args[0], extra),)
    gm.recompile()
    schedule(gm)
    names = node_names(gm)
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
    gradients = _tail(nodes)
    for wait in waits:
        first = min(wait.users, key=position.__getitem__)
        between = nodes[position[wait] + 1 : position[first]]
        if any(is_comm(n) and n.target in COLLECTIVES and _group(n) == _group(wait.args[0]) for n in between):
            # forced early: the next collective on its group may only start after this wait
            nxt = next(n for n in between if n.target in COLLECTIVES and _group(n) == _group(wait.args[0]))
            assert all(is_comm(n) for n in nodes[position[wait] + 1 : position[nxt]]), wait.name
            continue
        # otherwise only comm nodes (other waits, collectives released by them) sit in between, or
        # gradient work put off until its wait came (it runs then, at no cost to other work)
        assert all(is_comm(n) or n in gradients for n in between), (wait.name, [n.name for n in between])


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
    gradients = _tail(nodes)
    assert gradients & set(collectives(gm))
    for coll in collectives(gm):
        last = position[max(coll.all_input_nodes, key=position.__getitem__)]
        if info(coll).phase == "backward":  # a backward collective waits for the backward to begin
            last = max(last, first_backward - 1)
        previous_wait = in_flight_until.get(_group(coll), -1)
        assert previous_wait < position[coll], (coll.name, "two collectives in flight on one group")
        last = max(last, previous_wait)  # one collective in flight per process group
        between = nodes[last + 1 : position[coll]]
        # no computation delays it: only communication (other collectives with their buffers, or
        # the waits that free their groups) may sit between the moment it can start and its issue;
        # a gradient on its way out gives way to collectives that other work needs
        assert coll in gradients or all(is_comm(n) for n in between), (coll.name, [n.name for n in between])
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
    assert node_names(scheduled) != node_names(plain)


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


# ---- bucketing and the in-flight cap (schedule with a mesh) ----------------------------------------
def _capped(use_b_first: bool) -> fx.GraphModule:
    """Two 1 KiB all-reduces on different groups, both ready at the start, and some compute."""
    graph = fx.Graph()
    a, b, c = (input_node(graph, n, i) for i, n in enumerate("abc"))
    z1 = call_node(graph, "z1", aten.mul.Tensor, (c, 2.0))
    z2 = call_node(graph, "z2", aten.add.Tensor, (z1, 1.0))
    outs = {}
    for name, x, axis in (("b", b, 1), ("a", a, 0)) if use_b_first else (("a", a, 0), ("b", b, 1)):
        outs[name] = call_node(
            graph, f"use_{name}", aten.add.Tensor, (all_reduce_node(graph, x, name, (256,), axis, 2), z2)
        )
    graph.output((outs["a"], outs["b"]))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_in_flight_cap_delays_an_issue_until_a_wait_frees_memory() -> None:
    mesh = Mesh.from_shape((2, 2))
    assert node_names(_capped(False)) == [
        "a", "b", "c", "z1", "z2", "ar_a", "w_a", "use_a", "ar_b", "w_b", "use_b", "output",
    ]  # fmt: skip
    free = schedule(_capped(False), mesh)
    assert node_names(free) == [
        "a",
        "ar_a",
        "b",
        "ar_b",
        "c",
        "z1",
        "z2",
        "w_a",
        "use_a",
        "w_b",
        "use_b",
        "output",
    ]
    assert free.meta["autopar_schedule"].cap_delays == 0
    capped = schedule(_capped(False), mesh, in_flight_bytes=1500)  # room for one 1024-byte result
    # ar_b is ready at b but waits until w_a frees ar_a's buffer
    assert node_names(capped) == [
        "a",
        "ar_a",
        "b",
        "c",
        "z1",
        "z2",
        "w_a",
        "ar_b",
        "use_a",
        "w_b",
        "use_b",
        "output",
    ]
    report = capped.meta["autopar_schedule"]
    assert (report.cap_delays, report.cap_delayed, report.cap_forced_waits) == (1, ["ar_b"], 0)
    assert report.in_flight_cap == 1500
    assert "in-flight memory cap 0.001 MiB: 1 issues delayed" in _summary_line(report)


def test_in_flight_cap_forces_a_wait_when_a_collective_is_needed_now() -> None:
    capped = schedule(_capped(True), Mesh.from_shape((2, 2)), in_flight_bytes=1500)
    # ar_a is issued first (ready first) and ar_b held back; use_b comes first and needs ar_b now,
    # so ar_a's wait moves up to make room
    assert node_names(capped) == [
        "a",
        "ar_a",
        "b",
        "c",
        "z1",
        "z2",
        "w_a",
        "ar_b",
        "w_b",
        "use_b",
        "use_a",
        "output",
    ]
    report = capped.meta["autopar_schedule"]
    assert (report.cap_delayed, report.cap_forced_waits) == (["ar_b"], 1)
    assert "1 issues delayed, 1 waits moved earlier" in _summary_line(report)


def _summary_line(report: ScheduleReport) -> str:
    from autopar.reporting.report import PlanReport

    return str(
        PlanReport(mesh="(x=2, y=2)", world_size=4, param_bytes_local=0, param_bytes_total=0, schedule=report)
    )


# ---- compiled models: bucketing and any schedule settings keep every number ----------------------
PROPERTY_MESH = (2, 2)


def _programs(
    key: str, shape: tuple[int, ...], **settings: object
) -> dict[tuple[int, ...], tuple[fx.GraphModule, EmittedProgram]]:
    """Stages 3-5 per rank; `settings=None` keeps insert_comm's order (no schedule at all)."""
    mesh = Mesh.from_shape(shape)
    out = {}
    for coords in all_coords(shape):
        gm = insert_comm(copy.deepcopy(propagated(key, shape)), mesh, coords)
        if settings.get("off") is None:
            gm = schedule(gm, mesh, **settings)  # type: ignore[arg-type]
        out[coords] = (gm, emit(gm, mesh, default_registry(), coords))
    return out


def _step(key: str, shape: tuple[int, ...], programs: dict) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """Forward then backward of every rank in lockstep; outputs and gradients per rank."""
    model, inputs = model_case(key)
    progs = {c: p for c, (_, p) in programs.items()}
    fwd, bwd = run_programs(progs, model, inputs, shape)
    return {c: fwd[c][: len(progs[c].output_layouts)] + bwd[c] for c in progs}


@functools.cache
def _reference(key: str, shape: tuple[int, ...]) -> dict[tuple[int, ...], list[torch.Tensor]]:
    return _step(key, shape, _programs(key, shape, off=True))


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for c in want:
        assert len(got[c]) == len(want[c])
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got[c], want[c])), c


def test_bucketed_mlp_is_bit_identical_and_reports_every_collective() -> None:
    programs = _programs("mlp", PROPERTY_MESH)
    gm, program = programs[(0, 0)]
    report = gm.meta["autopar_schedule"]
    assert report.buckets >= 1 and report.bucketed >= 2 * report.buckets
    _assert_same(_step("mlp", PROPERTY_MESH, programs), _reference("mlp", PROPERTY_MESH))
    # the plan report still lists every collective the plan asked for, each with its own bytes
    mesh = Mesh.from_shape(PROPERTY_MESH)
    plain = build_report(_programs("mlp", PROPERTY_MESH, off=True)[(0, 0)][1], mesh)
    bucketed = build_report(program, mesh)

    def key(r: CollectiveRecord) -> tuple:
        return (r.node, r.phase, r.kind, r.axis, r.bytes, r.module_path, r.layout_before, r.layout_after)

    assert sorted(map(key, bucketed.collectives)) == sorted(map(key, plain.collectives))
    assert sum(1 for r in bucketed.collectives if r.bucket) == report.bucketed


def _check_order(gm: fx.GraphModule, max_in_flight: int) -> None:
    """A topological order in which no group has more than `max_in_flight` collectives outstanding."""
    seen: set[fx.Node] = set()
    flying: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        assert all(i in seen for i in node.all_input_nodes), node.name
        seen.add(node)
        if node.op == "call_function" and node.target in COLLECTIVES:
            flying.setdefault(_group(node), []).append(node)
            assert len(flying[_group(node)]) <= max_in_flight, node.name
        elif node.op == "call_function" and node.target is c10d.wait_tensor.default:
            flying[_group(node.args[0])].remove(node.args[0])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bucket_bytes=st.sampled_from([0, 256, 4096, 25 * 2**20]),
    bucket_count=st.integers(2, 6),
    in_flight_bytes=st.sampled_from([0, 2048, 2**16, 2**30]),
    lookahead=st.sampled_from([0, 3, 64]),
    max_in_flight=st.integers(1, 2),
)
def test_any_schedule_is_a_valid_order_with_identical_results(
    bucket_bytes: int, bucket_count: int, in_flight_bytes: int, lookahead: int, max_in_flight: int
) -> None:
    programs = _programs(
        "mlp",
        PROPERTY_MESH,
        bucket_bytes=bucket_bytes,
        bucket_count=bucket_count,
        in_flight_bytes=in_flight_bytes,
        lookahead=lookahead,
        max_in_flight=max_in_flight,
    )
    for gm, _ in programs.values():
        _check_order(gm, max_in_flight)
        report = gm.meta["autopar_schedule"]
        assert bucket_bytes > 0 or report.buckets == 0
        assert all(len(n.meta.get("autopar_bucket", ())) <= bucket_count for n in collectives(gm))
    _assert_same(_step("mlp", PROPERTY_MESH, programs), _reference("mlp", PROPERTY_MESH))


def _gradient_and_activation() -> fx.GraphModule:
    """Backward: a weight gradient (feeds one output) and an input gradient (feeds two) reduced on
    the same group, in the order insert_comm leaves them."""
    graph = fx.Graph()
    g, d = (input_node(graph, n, i) for i, n in enumerate("gd"))

    node = functools.partial(backward_node, graph)

    step = CommStep("all_reduce", 0, Layout((P,), (8,)), Layout((R,), (8,)))
    wgrad = node("wgrad", aten.mul.Tensor, (g, d))
    rs_w = node("rs_w", c10d.all_reduce.default, (wgrad, "sum", "<x>"), "comm", comm=step, comm_group="<x>")
    w_w = node("w_w", c10d.wait_tensor.default, (rs_w,), "comm", layouts=(step.after,))
    gout = node("gout", aten.mul.Tensor, (w_w, 0.5))
    dgrad = node("dgrad", aten.add.Tensor, (g, 1.0))
    ar_d = node("ar_d", c10d.all_reduce.default, (dgrad, "sum", "<x>"), "comm", comm=step, comm_group="<x>")
    w_d = node("w_d", c10d.wait_tensor.default, (ar_d,), "comm", layouts=(step.after,))
    h = node("h", aten.mul.Tensor, (w_d, 3.0))
    k1 = node("k1", aten.add.Tensor, (h, 1.0))
    k2 = node("k2", aten.mul.Tensor, (h, 2.0))
    graph.output((gout, k1, k2))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_gradient_gives_way_to_a_collective_needed_sooner() -> None:
    gm = _gradient_and_activation()
    assert {n.name for n in _tail(list(gm.graph.nodes))} == {"wgrad", "rs_w", "w_w", "gout", "k1", "k2"}
    schedule(gm)
    # rs_w is ready first, but ar_d (whose result the next nodes need) takes the group first; the
    # gradient goes as soon as the group is free, and nothing waits for it before the end
    assert node_names(gm) == [
        "g",
        "d",
        "wgrad",
        "dgrad",
        "ar_d",
        "w_d",
        "rs_w",
        "h",
        "k1",
        "k2",
        "w_w",
        "gout",
        "output",
    ]
    report = gm.meta["autopar_schedule"]
    assert report.yielded >= 1 and report.deferred == 1
    args = {
        c: [torch.randn(8, generator=torch.Generator().manual_seed(c[0] + 3)) for _ in "gd"]
        for c in [(0,), (1,)]
    }
    want = run_lockstep({c: _gradient_and_activation() for c in args}, args, (2,))
    got = run_lockstep({c: gm for c in args}, args, (2,))
    for c in args:
        assert all(torch.equal(x, y) for x, y in zip(got[c], want[c]))


def test_programs_ordered_on_the_clock_train_as_serial() -> None:
    """compile_for_rank schedules on the H100 table's clock, where collectives give way on the link
    to ones due sooner (with decomposed pairs' pieces among them): every rank issues the same
    collectives in the same order, and two SGD-momentum steps in lockstep equal serial."""
    model, batch = make_gpt(0, n_layer=2)
    result = train_in_lockstep(
        model, (2, 2), [batch, batch], lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), decompose_matmuls="on"
    )
    compiled = result["compiled"]
    for c in compiled.values():  # forward collectives too (weight gathers), not only gradients
        held = {n.name: info(n).phase for n in collectives(c.graph) if n.name in c.report.schedule.gave_way}
        assert "forward" in held.values(), held
    orders = {tuple(n.name for n in collectives(c.graph)) for c in compiled.values()}
    assert len(orders) == 1
    assert result["loss_err"] < 1e-5 and result["grad_err"] < 2e-5 and result["param_err"] < 1e-5, result
