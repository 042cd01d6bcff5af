"""The modeled timeline: exact times on a hand-built graph, exports, and the compiled GPT's before/after."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from pass_fixtures import gpt_compiled, run_lockstep

from autopar.core.collectives import COLLECTIVES
from autopar.core.layout import Layout, P, R
from autopar.core.mesh import Mesh
from autopar.core.meta import NodeInfo, set_info
from autopar.core.redistribute import CommStep
from autopar.cost import collective_time, hardware_from_dict
from autopar.cost.timeline import StepClock, Timeline, simulate
from autopar.passes.schedule import schedule
from autopar.reporting.timeline_views import chrome_trace, overlap_text, write_chrome_trace, write_png
from autopar.rules.base import Strategy
from autopar.testing import all_coords

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
PEAK, BW, ALPHA = 1e12, 1e10, 1e-6  # FLOP/s, link bytes/s, link s per ring step
HW = hardware_from_dict(
    {
        "name": "toy",
        "description": "round numbers for hand-computed timelines",
        "devices_per_node": 8,
        "peak_flops": {"float32": PEAK},
        "memory_bandwidth": 1e18,  # views and copies cost ~nothing: matmuls are flop-bound
        "memory_capacity": 1e9,
        "intra_node": {"alpha": ALPHA, "bandwidth": BW},
        "inter_node": {"alpha": 10 * ALPHA, "bandwidth": BW / 10},
        "source": {},
    }
)
M, K, N1, N2 = 64, 128, 256, 512


def _tensor(graph: fx.Graph, node: fx.Node, shape: tuple[int, ...], **extra: object) -> fx.Node:
    node.meta["val"] = torch.empty(shape, device="meta")
    set_info(node, NodeInfo(phase="forward", **extra))  # type: ignore[arg-type]
    return node


def _mm(graph: fx.Graph, name: str, a: fx.Node, w: fx.Node, n: int, ndim: int) -> fx.Node:
    node = graph.create_node("call_function", aten.mm.default, (a, w), {}, name=name)
    lay = lambda *s: Layout((R,) * ndim, s)  # noqa: E731
    strategy = Strategy((lay(M, K), lay(K, n)), (lay(M, n),))
    return _tensor(graph, node, (M, n), role="compute", strategy=strategy, layouts=(lay(M, n),))


def _all_reduce(graph: fx.Graph, name: str, x: fx.Node, axis: int, ndim: int) -> fx.Node:
    placements = [R] * ndim
    placements[axis] = P
    step = CommStep("all_reduce", axis, Layout(tuple(placements), (M, N1)), Layout((R,) * ndim, (M, N1)))
    group = f"<{'xy'[axis]}>"
    coll = graph.create_node("call_function", c10d.all_reduce.default, (x, "sum", group), {}, name=name)
    set_info(coll, NodeInfo(role="comm", phase="forward", comm=step, comm_group=group))
    wait = graph.create_node("call_function", c10d.wait_tensor.default, (coll,), {}, name=f"wait_{name}")
    set_info(wait, NodeInfo(role="comm", phase="forward", layouts=(step.after,)))
    return wait


def _two_matmuls(ndim: int = 1) -> fx.GraphModule:
    """mm1 -> all_reduce -> wait, then an independent mm2: insert_comm's order (nothing overlaps)."""
    graph = fx.Graph()
    a = _tensor(graph, graph.placeholder("a"), (M, K), role="input", layouts=(Layout((R,) * ndim, (M, K)),))
    w1 = _tensor(
        graph, graph.placeholder("w1"), (K, N1), role="param", layouts=(Layout((R,) * ndim, (K, N1)),)
    )
    w2 = _tensor(
        graph, graph.placeholder("w2"), (K, N2), role="param", layouts=(Layout((R,) * ndim, (K, N2)),)
    )
    mm1 = _mm(graph, "mm1", a, w1, N1, ndim)
    reduced = _all_reduce(graph, "ar", mm1, 0, ndim)
    mm2 = _mm(graph, "mm2", a, w2, N2, ndim)
    out = graph.output((reduced, mm2))
    set_info(out, NodeInfo(role="output", phase="forward"))
    return fx.GraphModule(torch.nn.Module(), graph)


T1 = 2 * M * K * N1 / PEAK
T2 = 2 * M * K * N2 / PEAK
T_AR = 2 * (2 - 1) / 2 * M * N1 * 4 / BW + 2 * (2 - 1) * ALPHA  # ring all-reduce over 2 ranks


def test_hand_computed_timeline_before_and_after_scheduling() -> None:
    assert collective_time("all_reduce", M * N1, 4, 2, HW.intra_node) == pytest.approx(T_AR)
    assert T2 < T_AR  # mm2 hides most, not all, of the all-reduce
    mesh = Mesh.from_shape((2,))
    gm = _two_matmuls()
    before = simulate(gm, mesh, HW)
    (ar,) = before.collectives
    assert (ar.issue, ar.start, ar.end) == pytest.approx((T1, T1, T1 + T_AR), rel=1e-12)
    assert ar.exposed == pytest.approx(T_AR, rel=1e-12) and ar.overlapped == 0
    assert [s.name for s in before.compute] == ["mm1", "mm2"]
    assert [(s.start, s.end) for s in before.compute][0] == pytest.approx((0.0, T1), rel=1e-12)
    assert [(s.start, s.end) for s in before.compute][1] == pytest.approx(
        (T1 + T_AR, T1 + T_AR + T2), rel=1e-12
    )
    assert before.step_time == pytest.approx(T1 + T_AR + T2, rel=1e-12)
    assert before.exposed_fraction == pytest.approx(1.0)

    after = simulate(schedule(gm), mesh, HW)
    assert [n.name for n in gm.graph.nodes] == ["a", "w1", "w2", "mm1", "ar", "mm2", "wait_ar", "output"]
    (ar,) = after.collectives
    assert (ar.issue, ar.start, ar.end) == pytest.approx((T1, T1, T1 + T_AR), rel=1e-12)
    assert ar.exposed == pytest.approx(T_AR - T2, rel=1e-9)
    assert (ar.overlapped, ar.overlapped_names) == (1, ("mm2",))
    assert ar.overlap_time == pytest.approx(T2, rel=1e-12)
    assert after.step_time == pytest.approx(T1 + T_AR, rel=1e-12)
    assert after.compute_time == pytest.approx(T1 + T2, rel=1e-12)
    assert after.totals() == pytest.approx(
        {
            "collectives": 1.0,
            "comm_time": T_AR,
            "exposed_comm": T_AR - T2,
            "compute_time": T1 + T2,
            "step_time": T1 + T_AR,
            "exposed_fraction": (T_AR - T2) / T_AR,
        },
        rel=1e-9,
    )
    (wait,) = after.waits
    assert wait.collective == "ar"
    assert (wait.start, wait.end) == pytest.approx((T1 + T2, T1 + T_AR), rel=1e-12)


def test_one_comm_stream_queues_collectives_and_link_streams_do_not() -> None:
    """Two all-reduces on axes with different links, issued back to back: one stream runs them one
    after the other; streams="link" runs the NVLink and the network one side by side."""
    graph = fx.Graph()
    mesh = Mesh.from_shape((2, 8))  # axis x spans 2 nodes of 8 devices (network), y stays in a node
    ndim = 2
    a = _tensor(graph, graph.placeholder("a"), (M, K), role="input", layouts=(Layout((R, R), (M, K)),))
    w = _tensor(graph, graph.placeholder("w"), (K, N1), role="param", layouts=(Layout((R, R), (K, N1)),))
    mm = _mm(graph, "mm", a, w, N1, ndim)
    ar_x = _all_reduce(graph, "ar_x", mm, 0, ndim)
    ar_y = _all_reduce(graph, "ar_y", mm, 1, ndim)
    out = graph.output((ar_x, ar_y))
    set_info(out, NodeInfo(role="output", phase="forward"))
    gm = schedule(fx.GraphModule(torch.nn.Module(), graph))
    assert [n.name for n in gm.graph.nodes][2:6] == ["mm", "ar_x", "ar_y", "wait_ar_x"]
    t_x = collective_time("all_reduce", M * N1, 4, 2, HW.inter_node)
    t_y = collective_time("all_reduce", M * N1, 4, 8, HW.intra_node)
    single = {c.name: c for c in simulate(gm, mesh, HW).collectives}
    assert (single["ar_x"].start, single["ar_y"].start) == pytest.approx((T1, T1 + t_x), rel=1e-12)
    assert single["ar_y"].exposed == pytest.approx(t_y, rel=1e-9)  # waited on after ar_x
    linked = simulate(gm, mesh, HW, streams="link")
    by_name = {c.name: c for c in linked.collectives}
    assert (by_name["ar_x"].start, by_name["ar_y"].start) == pytest.approx((T1, T1), rel=1e-12)
    assert by_name["ar_x"].stream == "comm inter_node" and by_name["ar_y"].stream == "comm intra_node"
    assert linked.step_time == pytest.approx(T1 + max(t_x, t_y), rel=1e-12)
    trace = chrome_trace(linked)
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"compute", "comm inter_node", "comm intra_node"}


def _scheduled_pair() -> tuple[Timeline, Timeline]:
    mesh = Mesh.from_shape((2,))
    gm = _two_matmuls()
    before = simulate(gm, mesh, HW)
    return before, simulate(schedule(copy.deepcopy(gm)), mesh, HW)


def test_chrome_trace_is_valid_trace_event_json_with_both_lanes(tmp_path: Path) -> None:
    before, after = _scheduled_pair()
    path = tmp_path / "timeline.json"
    write_chrome_trace(after, path, rank=3)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {(e["tid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {(0, "compute"), (1, "comm")}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["pid"] == 3 and e["dur"] >= 0 and {"name", "ts", "tid"} <= e.keys() for e in spans)
    by_name = {e["name"]: e for e in spans}
    assert by_name["mm2"]["tid"] == 0 and by_name["ar"]["tid"] == 1
    assert by_name["ar"]["ts"] == pytest.approx(T1 * 1e6) and by_name["ar"]["dur"] == pytest.approx(
        T_AR * 1e6
    )
    assert by_name["wait ar"]["cat"] == "exposed_wait"
    assert by_name["wait ar"]["dur"] == pytest.approx((T_AR - T2) * 1e6)
    assert trace["otherData"]["exposed_comm"] == pytest.approx(T_AR - T2)


def test_png_is_written(tmp_path: Path) -> None:
    before, after = _scheduled_pair()
    path = tmp_path / "timeline.png"
    write_png(path, after, before)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_overlap_table_rows_and_totals() -> None:
    before, after = _scheduled_pair()
    lines = overlap_text(before, after).splitlines()
    row = next(line for line in lines if line.startswith("ar "))
    fields = row.split()
    assert fields[1:4] == ["all_reduce", "x", "forward"]
    assert float(fields[4]) == M * N1 * 4  # bytes sent per rank: 2(g-1)/g * N * 4 with g = 2
    assert float(fields[5]) == pytest.approx(T_AR * 1e6, abs=0.01)  # modeled, us
    assert float(fields[9]) == pytest.approx((T_AR - T2) * 1e6, abs=0.01)  # exposed, us
    assert row.endswith("1 (mm2)")
    unscheduled = next(line for line in lines if line.startswith("unscheduled")).split()
    scheduled = next(line for line in lines if line.startswith("scheduled")).split()
    assert unscheduled[4] == "100.0%" and scheduled[4] == f"{100 * (T_AR - T2) / T_AR:.1f}%"


def test_gpt_dump_timeline_matches_the_compiled_graphs() -> None:
    """compile_for_rank's dump: the step before and after the schedule stage; the same bytes in
    fewer collectives (bucketing), less exposed time after scheduling."""
    compiled, path = gpt_compiled((2, 2, 2), (0, 0, 0))
    assert compiled.timelines is not None
    before, after = compiled.timelines
    assert before.hardware == after.hardware == "h100-nvlink-ib"  # a planning mesh has no device type
    # bucketing merges collectives but sends the same bytes
    assert sum(c.bytes for c in before.collectives) == pytest.approx(sum(c.bytes for c in after.collectives))
    assert sum(c.members for c in after.collectives) == len(before.collectives)
    assert after.exposed_comm < before.exposed_comm and after.step_time < before.step_time
    assert before.exposed_fraction == pytest.approx(1.0, abs=1e-9)
    for t in (before, after):
        assert t.step_time >= max(t.compute_time, t.comm_time) - 1e-12
        assert t.step_time == pytest.approx(t.compute_time + t.exposed_comm + _idle(t), rel=1e-9)
        assert all(c.issue <= c.start < c.end or c.start == c.end for c in t.collectives)
    trace = json.loads((path / "timeline.json").read_text())
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 1) == len(after.collectives)
    assert (path / "timeline.png").stat().st_size > 5000
    text = (path / "overlap.txt").read_text()
    assert f"{'unscheduled':<16} {len(before.collectives):>11}" in text
    assert f"{'scheduled':<16} {len(after.collectives):>11}" in text
    assert compiled.report.schedule.buckets > 0


def _idle(t: Timeline) -> float:
    """Time the compute stream neither computed nor waited: only after its last node, for the comm
    stream to drain."""
    end = max([s.end for s in t.compute] + [s.end for s in t.waits] + [0.0])
    return t.step_time - end


def test_step_clock_advances_like_the_simulation() -> None:
    """The schedule stage's clock: the same times as `simulate`, one placed node at a time."""
    gm = schedule(_two_matmuls())
    clock = StepClock(Mesh.from_shape((2,)), HW)
    times = {}
    for node in gm.graph.nodes:
        clock.place(node)
        times[node.name] = clock.now
    ar = next(n for n in gm.graph.nodes if n.name == "ar")
    assert clock.ends[ar] == pytest.approx(T1 + T_AR, rel=1e-12)
    assert (times["mm1"], times["mm2"], times["wait_ar"]) == pytest.approx(
        (T1, T1 + T2, T1 + T_AR), rel=1e-12
    )
    assert clock.finished(ar) and clock.duration(ar) == pytest.approx(T_AR, rel=1e-12)


def test_a_collectives_own_time_on_its_rank_is_not_overlapped() -> None:
    """`Link.call` (gloo on a CPU: the issuing rank's own time per collective) sits on the compute
    stream at the issue point; the transfer after it overlaps mm2 as before."""
    call = 3e-6
    table = HW.to_json()
    table["intra_node"] = {"alpha": ALPHA, "bandwidth": BW, "call": call}
    calling = hardware_from_dict(table)
    assert calling.intra_node.call == call and hardware_from_dict(calling.to_json()) == calling
    assert collective_time("all_reduce", M * N1, 4, 2, calling.intra_node) == pytest.approx(T_AR + call)
    mesh = Mesh.from_shape((2,))
    after = simulate(schedule(_two_matmuls()), mesh, calling)
    (ar,) = after.collectives
    assert [s.name for s in after.compute] == ["mm1", "ar", "mm2"]
    assert (ar.issue, ar.start, ar.end) == pytest.approx((T1 + call, T1 + call, T1 + call + T_AR), rel=1e-12)
    assert after.step_time == pytest.approx(T1 + call + T_AR, rel=1e-12)
    clock = StepClock(mesh, calling)
    for node in schedule(_two_matmuls()).graph.nodes:
        clock.place(node)
    assert clock.now == pytest.approx(after.step_time, rel=1e-12)


# ---- the order collectives take the link (the schedule stage on the clock) -----------------------
N3 = 1024


def _prefetch_and_activation() -> fx.GraphModule:
    """A large sum ready at the start and needed at the end (a weight prefetch's slack) on group y,
    and a small activation sum on group x that the compute needs right after the next matmul."""
    graph = fx.Graph()
    rep = lambda *s: Layout((R, R), s)  # noqa: E731
    a = _tensor(graph, graph.placeholder("a"), (M, K), role="input", layouts=(rep(M, K),))
    weights = [
        _tensor(graph, graph.placeholder(f"w{i}"), (K, n), role="param", layouts=(rep(K, n),))
        for i, n in ((1, N1), (2, N2), (3, N3))
    ]
    big = _tensor(graph, graph.placeholder("b"), (M, N3), role="param", layouts=(rep(M, N3),))
    mm1 = _mm(graph, "mm1", a, weights[0], N1, 2)
    act = _all_reduce(graph, "ar", mm1, 0, 2)
    mm2 = _mm(graph, "mm2", a, weights[1], N2, 2)
    use1 = _tensor(graph, graph.call_function(aten.add.Tensor, (act, 1.0)), (M, N1), role="compute")
    mm3 = _mm(graph, "mm3", a, weights[2], N3, 2)
    step = CommStep("all_reduce", 1, Layout((R, P), (M, N3)), rep(M, N3))
    pre = graph.create_node("call_function", c10d.all_reduce.default, (big, "sum", "<y>"), {}, name="pre")
    set_info(pre, NodeInfo(role="comm", phase="forward", comm=step, comm_group="<y>"))
    got = graph.create_node("call_function", c10d.wait_tensor.default, (pre,), {}, name="wait_pre")
    set_info(got, NodeInfo(role="comm", phase="forward", layouts=(step.after,)))
    use2 = _tensor(graph, graph.call_function(aten.add.Tensor, (got, mm3)), (M, N3), role="compute")
    out = graph.output((mm2, use1, use2))
    set_info(out, NodeInfo(role="output", phase="forward"))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_collective_due_sooner_takes_the_link_before_a_prefetch_with_slack() -> None:
    """Issued as soon as ready, the prefetch holds the one link when the activation sum arrives and
    the compute waits for both; on the clock the schedule holds the prefetch back (it has slack),
    the sum goes first and the prefetch right after it, still before its use."""
    mesh = Mesh.from_shape((2, 2))
    plain = schedule(_prefetch_and_activation(), mesh)  # no clock: issued in the order they are ready
    assert [n.name for n in collectives_of(plain)] == ["pre", "ar"]
    ordered = schedule(_prefetch_and_activation(), mesh, hardware=HW)
    names = [n.name for n in ordered.graph.nodes]
    assert names[names.index("mm1") + 1 : names.index("mm1") + 3] == ["ar", "pre"]
    assert names.index("pre") < names.index("mm2") and ordered.meta["autopar_schedule"].yielded == 1
    before, after = simulate(plain, mesh, HW), simulate(ordered, mesh, HW)
    t_pre = collective_time("all_reduce", M * N3, 4, 2, HW.intra_node)
    by_name = {c.name: c for c in after.collectives}
    assert by_name["ar"].start == pytest.approx(T1, rel=1e-12)
    assert by_name["ar"].exposed == pytest.approx(T_AR - T2, rel=1e-9)  # mm2 hides all but this
    assert by_name["pre"].start == pytest.approx(T1 + T_AR, rel=1e-12)
    assert by_name["pre"].end == pytest.approx(T1 + T_AR + t_pre, rel=1e-12)
    assert {c.name: c.start for c in before.collectives}["ar"] == pytest.approx(t_pre, rel=1e-12)
    assert after.exposed_comm < before.exposed_comm and after.step_time < before.step_time
    # the same results: a reorder only (every rank runs the same program, so sums agree)
    args = {c: [torch.randn(s, generator=torch.Generator().manual_seed(sum(c) + i)) for i, s in enumerate(SHAPES)]
            for c in all_coords((2, 2))}  # fmt: skip
    want = run_lockstep({c: _prefetch_and_activation() for c in args}, args, (2, 2))
    got = run_lockstep({c: ordered for c in args}, args, (2, 2))
    for c in args:
        assert all(torch.equal(x, y) for x, y in zip(got[c], want[c]))


SHAPES = [(M, K), (K, N1), (K, N2), (K, N3), (M, N3)]


def collectives_of(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVES]
