"""Stage 3, insert_comm: the exact collectives of a 3-D two-linear MLP, and lowered steps that compute.

The MLP is fc2(gelu(fc1(x))) without biases, loss sum((y - t)^2), T = 64 tokens, h = 64, width 4h,
on mesh (x, y, z) = (2, 2, 2): the AxoNN / Tensor3D grid of comm_volumes.md (k split on one tensor
axis, n on the other, tokens on z, weights stored split on z).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from pass_fixtures import (
    COLLECTIVES,
    H,
    T,
    aten,
    c10d,
    collectives,
    gpt_compiled,
    is_comm,
    rank_programs,
    run_lockstep,
)

from autopar.core.layout import Layout, P, R, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import NodeInfo, info, set_info, signature
from autopar.core.strategy import Strategy
from autopar.passes.insert_comm import insert_comm
from autopar.testing import all_coords, assemble, shard_tensor
from autopar.testing.strategies import layout_pairs

MESH = (2, 2, 2)
X, Y, Z = MESH
NAMES = ("x", "y", "z")
KIND_OF_TARGET = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
    c10d.all_reduce_.default: "all_reduce",  # a gradient bucket's sum, in place on its cat (passes/bucket.py)
    c10d.all_to_all_single.default: "all_to_all",
}


def _graph() -> fx.GraphModule:
    """The two-linear MLP after insert_comm for rank (0, 0, 0), not scheduled."""
    return rank_programs("two_linear", MESH, False)[(0, 0, 0)][0]


def _source(node: fx.Node) -> fx.Node:
    """Walk back through inserted (comm) nodes to the value being redistributed."""
    while is_comm(node):
        node = node.args[0]
    return node


def _record(node: fx.Node) -> tuple[str, str, str, float]:
    step = info(node).comm
    return (info(node).phase, step.kind, NAMES[step.axis], step.elements_sent(MESH))


def test_forward_weight_gathers_follow_the_axonn_closed_form() -> None:
    gm = _graph()
    fwd = [n for n in collectives(gm) if info(n).phase == "forward"]
    gathers = [n for n in fwd if info(n).comm.kind == "all_gather"]
    by_param = {info(_source(n)).param_name: n for n in gathers}
    assert len(gathers) == 2 and set(by_param) == {"fc1.weight", "fc2.weight"}
    for name, (k, n) in {"fc1.weight": (H, 4 * H), "fc2.weight": (4 * H, H)}.items():
        node = by_param[name]
        step = info(node).comm
        assert NAMES[step.axis] == "z"
        assert step.elements_sent(MESH) == pytest.approx((Z - 1) / Z * k * n / (X * Y))
        # from the ~1/8 storage layout to the compute layout that is still split on x and y
        assert step.before.local_numel(MESH) == k * n // 8
        assert step.after.local_numel(MESH) == k * n // 4
        assert info(node).module_path == name.split(".")[0]
        assert info(_source(node)).role == "param"


def test_forward_fc1_output_is_all_reduced_over_its_contraction_axis() -> None:
    gm = _graph()
    fwd = [n for n in collectives(gm) if info(n).phase == "forward"]
    fc1_mm = next(
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and info(n).module_path == "fc1"
        and not is_comm(n)
        and n.target is torch.ops.aten.mm.default
    )
    reduces = [n for n in fwd if info(n).comm.kind == "all_reduce" and _source(n) is fc1_mm]
    assert len(reduces) == 1
    step = info(reduces[0]).comm
    assert NAMES[step.axis] == "x" and step.before.partial_axes() == (0,)
    n = 4 * H
    assert step.elements_sent(MESH) == pytest.approx(2 * (X - 1) / X * T * n / (Z * Y))


def test_forward_collectives_exactly() -> None:
    """Everything the forward sends: weight gathers, fc1/fc2 output sums, the scalar loss."""
    gm = _graph()
    fwd = sorted(_record(n) for n in collectives(gm) if info(n).phase == "forward")
    k, n = H, 4 * H
    expected = sorted(
        [
            ("forward", "all_gather", "z", (Z - 1) / Z * k * n / (X * Y)),  # fc1.weight
            ("forward", "all_gather", "z", (Z - 1) / Z * k * n / (X * Y)),  # fc2.weight
            ("forward", "all_reduce", "x", 2 * (X - 1) / X * T * n / (Z * Y)),  # fc1 output
            ("forward", "reduce_scatter", "y", (Y - 1) / Y * T * H / (Z * X)),  # fc2 output
            # the loss: a scalar summed over every axis
            ("forward", "all_reduce", "x", 1.0),
            ("forward", "all_reduce", "y", 1.0),
            ("forward", "all_reduce", "z", 1.0),
        ]
    )
    assert fwd == expected


def test_every_collective_is_waited_on_and_names_its_group() -> None:
    for gm in (_graph(), gpt_compiled(MESH, (0, 0, 0))[0].graph):
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        colls = collectives(gm)
        assert colls
        for node in colls:
            step = info(node).comm
            assert step is not None and step.is_collective
            assert KIND_OF_TARGET[node.target] == step.kind
            assert info(node).role == "comm"
            assert info(node).comm_group == f"<{NAMES[step.axis]}>"  # planning mesh: no process groups
            assert MESH[step.axis] > 1
            (wait,) = node.users
            assert wait.target is c10d.wait_tensor.default and wait.args == (node,)
            assert order[wait] > order[node]
            assert info(wait).role == "comm" and info(wait).comm is None
        # only these four collective kinds, and every CommStep-carrying node is one of them
        carriers = [n for n in gm.graph.nodes if n.op == "call_function" and info(n).comm is not None]
        assert set(carriers) == set(colls)
        assert {n.target for n in colls} <= set(COLLECTIVES)
        waits = [
            n for n in gm.graph.nodes if n.op == "call_function" and n.target is c10d.wait_tensor.default
        ]
        assert len(waits) == len(colls)


def test_collective_arguments_are_local_sizes() -> None:
    gm = _graph()
    for node in collectives(gm):
        step = info(node).comm
        g = MESH[step.axis]
        if node.target is c10d.all_gather_into_tensor.default:
            assert node.args[1:] == (g, f"<{NAMES[step.axis]}>")
        elif node.target is c10d.reduce_scatter_tensor.default:
            assert node.args[1:] == ("sum", g, f"<{NAMES[step.axis]}>")
        elif node.target is c10d.all_reduce.default:
            assert node.args[1:] == ("sum", f"<{NAMES[step.axis]}>")
        else:
            local = step.before.local_shape(MESH)
            chunk = local[step.dst_dim] // g
            assert node.args[1] == node.args[2] == [chunk] * g


def test_gradients_end_in_their_parameters_storage_layout() -> None:
    for gm in (_graph(), gpt_compiled(MESH, (0, 0, 0))[0].graph):
        sig = signature(gm)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        params = {
            info(n).param_name: n for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "param"
        }
        nu = sig.num_user_outputs
        grads = list(output.args[0])[nu:]
        assert len(grads) == len(sig.grad_of) == len(params)
        for name, value, want in zip(sig.grad_of, grads, info(output).layouts[nu:]):
            storage = info(params[name]).layout
            assert want == storage, name
            assert info(value).layouts[0] == storage, (name, value.name)


def test_every_consumer_reads_its_strategys_input_layouts() -> None:
    """After insert_comm no edge disagrees: each input's layout is what the strategy asks for."""
    gm = _graph()
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_comm(node) or info(node).strategy is None:
            continue
        inputs = [
            a
            for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs))
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
        ]
        for inp, want in zip(inputs, info(node).strategy.inputs):
            assert info(inp).layouts[0] == want, (node.name, inp.name)


def test_a_user_output_never_reuses_a_collective_made_in_backward() -> None:
    """A forward value a backward op wants whole first (the graph's order: backward before the
    output node), then the user output wants whole too: the output gets its own forward all-reduce.
    Reusing the backward one would hand forward a value it runs before (emit splits the graphs
    there: BertForSequenceClassification's multi-label logits stopped with a KeyError)."""
    shape = (4,)
    pending, whole = Layout((P,), shape, torch.float32), Layout((R,), shape, torch.float32)
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(shape)
    set_info(x, NodeInfo(role="input", phase="forward", layouts=(pending,), input_index=0))
    grad = graph.call_function(aten.mul.Tensor, (x, x))
    grad.meta["val"] = torch.empty(shape)
    both_whole = Strategy((whole, whole), (whole,))
    set_info(grad, NodeInfo(role="compute", phase="backward", strategy=both_whole, layouts=(whole,)))
    out = graph.output((x, grad))
    set_info(out, NodeInfo(role="output", phase="forward", layouts=(whole, whole)))
    gm = insert_comm(fx.GraphModule(torch.nn.Module(), graph), Mesh.from_shape((2,)), (0,))
    mul = next(iter(gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)))
    returned = next(iter(gm.graph.find_nodes(op="output"))).args[0][0]
    assert {info(n).phase for n in mul.args} == {"backward"} and mul.args[0] is mul.args[1]
    assert returned is not mul.args[0] and info(returned).phase == "forward" and _source(returned) is x
    reduces = [(info(n).phase, info(n).comm.kind) for n in collectives(gm)]
    assert reduces == [("backward", "all_reduce"), ("forward", "all_reduce")]


# ---- the lowered steps compute the redistribution (simulated on every rank) --------------------
def _redistribution_graphs(src: Layout, dst: Layout, mesh: tuple[int, ...]) -> dict:
    graphs = {}
    for coords in all_coords(mesh):
        graph = fx.Graph()
        x = graph.placeholder("x")
        x.meta["val"] = torch.empty(src.shape, dtype=src.dtype)
        set_info(x, NodeInfo(role="input", phase="forward", layouts=(src,), input_index=0))
        out = graph.output((x,))
        set_info(out, NodeInfo(role="output", phase="forward", layouts=(dst,)))
        graphs[coords] = insert_comm(fx.GraphModule(torch.nn.Module(), graph), Mesh.from_shape(mesh), coords)
    return graphs


def _check_redistribution(src: Layout, dst: Layout, mesh: tuple[int, ...], seed: int = 0) -> dict:
    full = torch.randn(src.shape, dtype=src.dtype, generator=torch.Generator().manual_seed(seed))
    graphs = _redistribution_graphs(src, dst, mesh)
    pieces = shard_tensor(full, src, mesh, torch.Generator().manual_seed(seed + 1))
    out = run_lockstep(graphs, {c: [pieces[c]] for c in graphs}, mesh)
    result = {c: o[0] for c, o in out.items()}
    for c, piece in result.items():
        assert tuple(piece.shape) == dst.local_shape(mesh, c), (c, src, dst)
    torch.testing.assert_close(assemble(result, dst, mesh, atol=1e-9, rtol=1e-9), full, atol=1e-9, rtol=1e-9)
    return graphs


@pytest.mark.parametrize(
    ("src", "dst", "kinds"),
    [
        ((P, R), (R, R), ["all_reduce"]),
        ((P, Shard(1)), (Shard(0), Shard(1)), ["reduce_scatter"]),
        # axis 0 must nest outside axis 1 on dim 1: gather both, slice again
        ((Shard(0), Shard(1)), (Shard(1), Shard(1)), ["all_gather", "all_gather"]),
        ((Shard(1), R), (Shard(0), R), ["all_to_all"]),
        ((Shard(0), Shard(0)), (R, R), ["all_gather", "all_gather"]),
        ((Shard(0), Shard(2)), (Shard(1), Shard(0)), ["all_to_all", "all_to_all"]),
        ((Shard(2), Shard(0)), (Shard(1), Shard(2)), ["all_gather", "all_to_all"]),
        ((R, R), (Shard(1), P), []),
        # a fused weight's part from storage (cut dim 0 whole) to heads on axis 0: exchanged on
        # the stored block, then gathered, the blocks swapped back; its gradient the other way
        ((Shard(1), Shard(1)), (Shard(0), R), ["all_to_all", "all_gather"]),
        ((Shard(0), P), (Shard(1), Shard(1)), ["reduce_scatter", "all_to_all"]),
    ],
)
def test_lowered_steps_on_a_2x3_mesh(src: tuple, dst: tuple, kinds: list[str]) -> None:
    mesh = (2, 3)
    shape = (6, 12, 6)
    graphs = _check_redistribution(Layout(src, shape, torch.float64), Layout(dst, shape, torch.float64), mesh)
    gm = graphs[(1, 2)]
    assert [info(n).comm.kind for n in collectives(gm)] == kinds
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert info(node).role == "comm" and info(node).phase == "forward"


@settings(max_examples=100, deadline=None)  # a loaded CI machine must not fail on wall time
@given(layout_pairs(max_axes=3), st.integers(0, 1000))
def test_lowered_redistribution_round_trips(case: tuple, seed: int) -> None:
    mesh, src, dst = case
    _check_redistribution(src, dst, mesh, seed)
