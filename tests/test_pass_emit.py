"""Stage 5, emit: per-rank forward/backward graphs on local shapes, which compute the model.

The end-to-end checks run every rank's emitted programs in one process, in step, with the
collectives simulated (pass_fixtures.run_lockstep), and compare with eager autograd.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from pass_fixtures import gpt_compiled, is_comm, model_case, propagated, rank_programs, simulate_step
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autopar.core.errors import ShardingError
from autopar.core.layout import Layout, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import info, update_info
from autopar.passes.emit import check_local_shapes, emit
from autopar.passes.insert_comm import insert_comm
from autopar.passes.schedule import schedule
from autopar.rules.registry import default_registry
from autopar.runtime.program import EmittedProgram, local_value
from autopar.testing import all_coords, assemble

MESH = (2, 2, 2)
COORDS = [(0, 0, 0), (1, 0, 1)]
aten = torch.ops.aten
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _program(coords: tuple[int, ...]) -> EmittedProgram:
    return gpt_compiled(MESH, coords)[0].program


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _shapes(node: fx.Node) -> list[tuple[int, ...]]:
    leaves = torch.utils._pytree.tree_leaves(node.meta.get("val"))
    return [tuple(v.shape) for v in leaves if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("coords", COORDS)
def test_forward_placeholders_have_storage_local_shapes(coords: tuple[int, ...]) -> None:
    prog = _program(coords)
    assert prog.coords == coords
    placeholders = [n for n in prog.forward.graph.nodes if n.op == "placeholder"]
    layouts = [*prog.param_layouts, *prog.input_layouts]
    assert len(placeholders) == len(layouts) == len(prog.param_names) + 2
    for node, lay in zip(placeholders, layouts):
        assert _shape(node) == lay.local_shape(MESH), node.name
    # parameters in placeholder order, stored split 8 ways; the tied weight once
    assert [info(n).param_name for n in placeholders[: len(prog.param_names)]] == prog.param_names
    assert "wte.weight" in prog.param_names and "lm_head.weight" not in prog.param_names
    model, _ = model_case("gpt")
    params = dict(model.named_parameters())
    for name, lay in zip(prog.param_names, prog.param_layouts):
        value = prog.param_value(name, params)  # q, k and v are parts of the fused qkv weight
        assert lay.shape == tuple(value.shape)
        if name in prog.param_parts and value.dim() == 1:  # a part keeps its cut dim whole
            assert lay.is_replicated, name
        else:
            assert lay.local_numel(MESH) * 8 == value.numel(), name
    # the search planner (the default) cuts the fused qkv into q, k and v parts
    assert {p.source for p in prog.param_parts.values()} == {
        f"blocks.{i}.attn.qkv.{w}" for i in range(2) for w in ("weight", "bias")
    }
    # inputs arrive whole; the loss leaves whole
    assert all(lay.is_replicated for lay in prog.input_layouts)
    assert [lay.shape for lay in prog.output_layouts] == [()] and prog.output_layouts[0].is_replicated


@pytest.mark.parametrize("coords", COORDS)
def test_backward_returns_one_gradient_per_parameter_in_storage_shape(coords: tuple[int, ...]) -> None:
    prog = _program(coords)
    fwd_out = next(n for n in prog.forward.graph.nodes if n.op == "output")
    assert len(fwd_out.args[0]) == len(prog.output_layouts) + prog.num_saved
    assert _shape(fwd_out.args[0][0]) == ()
    bwd_placeholders = [n for n in prog.backward.graph.nodes if n.op == "placeholder"]
    assert len(bwd_placeholders) == prog.num_saved + len(prog.tangent_outputs)
    assert prog.tangent_outputs == [0]
    # saved values enter backward with the shapes forward produced
    for saved, ph in zip(fwd_out.args[0][len(prog.output_layouts) :], bwd_placeholders):
        assert ph.name == f"saved_{saved.name}" and _shape(ph) == _shape(saved)
    grads = next(n for n in prog.backward.graph.nodes if n.op == "output").args[0]
    assert len(grads) == len(prog.param_layouts)
    for grad, lay, name in zip(grads, prog.param_layouts, prog.param_names):
        assert grad is not None, name
        assert _shape(grad) == lay.local_shape(MESH), name
    # the backward graph holds backward work only, the forward graph forward work only
    for gm, phase in ((prog.forward, "forward"), (prog.backward, "backward")):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                assert info(node).phase == phase, (phase, node.name)


@pytest.mark.parametrize("coords", COORDS)
def test_views_carry_local_sizes(coords: tuple[int, ...]) -> None:
    prog = _program(coords)
    localized = 0
    for gm in (prog.forward, prog.backward):
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target not in VIEWS or is_comm(node):
                continue
            lay = info(node).layout
            assert list(node.args[1]) == list(lay.local_shape(MESH)), node.name
            assert _shape(node) == lay.local_shape(MESH)
            localized += lay.local_shape(MESH) != lay.shape
    assert localized > 10
    # global views became reshapes: a redistributed input may not have the producer's strides
    targets = {n.target for n in prog.forward.graph.nodes if n.op == "call_function" and not is_comm(n)}
    assert aten.view.default not in targets and aten.reshape.default in targets


@pytest.mark.parametrize("coords", COORDS)
def test_every_laid_out_node_has_its_layouts_local_shape(coords: tuple[int, ...]) -> None:
    prog = _program(coords)
    checked = 0
    for gm in (prog.forward, prog.backward):
        for node in gm.graph.nodes:
            if node.op in ("output", "placeholder") or not info(node).layouts:
                continue
            vals = [
                v for v in torch.utils._pytree.tree_leaves(node.meta["val"]) if isinstance(v, torch.Tensor)
            ]
            if len(vals) != len(info(node).layouts):
                continue
            for val, lay in zip(vals, info(node).layouts):
                assert tuple(val.shape) == lay.local_shape(MESH), node.name
                checked += 1
    assert checked > 500


def test_ranks_differ_only_in_their_slices_and_zeroed_summands() -> None:
    a, b = _program(COORDS[0]), _program(COORDS[1])
    starts_b = []
    for ga, gb in ((a.forward, b.forward), (a.backward, b.backward)):
        na, nb = list(ga.graph.nodes), list(gb.graph.nodes)
        assert len(na) == len(nb)
        for x, y in zip(na, nb):
            assert x.op == y.op
            if x.op != "call_function":
                assert _shapes(x) == _shapes(y)
            elif x.target is aten.slice.Tensor and is_comm(x):
                assert y.target is aten.slice.Tensor
                assert x.args[2] == 0  # rank (0, 0, 0) always takes the first block
                assert x.args[3] - x.args[2] == y.args[3] - y.args[2]  # same block size
                starts_b.append(y.args[2])
            elif x.target != y.target:
                # zero_partial: the first rank of the axis keeps the value, the others hold zeros
                assert (x.target, y.target) == (aten.clone.default, aten.zeros_like.default)
            else:
                assert _shapes(x) == _shapes(y)
    # rank (1, 0, 1) reads some non-first blocks
    assert starts_b and any(s > 0 for s in starts_b)


def test_local_value_takes_the_ranks_block() -> None:
    full = torch.arange(8 * 6).reshape(8, 6)
    lay = Layout((Shard(0), Shard(1), Shard(0)), (8, 6))
    assert torch.equal(local_value(full, lay, MESH, (1, 1, 0)), full[4:6, 3:6])
    assert torch.equal(local_value(full, lay, MESH, (0, 0, 1)), full[2:4, 0:3])
    blocks = [local_value(full, lay, MESH, c) for c in all_coords(MESH)]
    assert sum(int(b.sum()) for b in blocks) == int(full.sum())


# ---- corrupting a layout is caught --------------------------------------------------------------
def _fresh_program(coords: tuple[int, ...] = (0, 0, 0)) -> EmittedProgram:
    mesh = Mesh.from_shape(MESH)
    gm = insert_comm(copy.deepcopy(propagated("two_linear", MESH)), mesh, coords)
    return emit(schedule(gm), mesh, default_registry(), coords)


def test_check_local_shapes_accepts_the_emitted_program() -> None:
    prog = _fresh_program()
    check_local_shapes(prog, MESH)  # emit already ran it; it must hold again
    mm = next(n for n in prog.forward.graph.nodes if n.target is aten.mm.default)
    assert _shape(mm) == info(mm).layout.local_shape(MESH) != info(mm).layout.shape


@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_check_local_shapes_raises_on_a_corrupted_layout(graph: str) -> None:
    prog = _fresh_program()
    gm = getattr(prog, graph)
    node = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    good = info(node).layout
    wrong = Layout.replicated(good.shape, len(MESH), good.dtype)
    assert wrong.local_shape(MESH) != good.local_shape(MESH)
    update_info(node, layouts=(wrong,))
    with pytest.raises(ShardingError, match=node.name) as err:
        check_local_shapes(prog, MESH)
    assert "promises" in str(err.value) and str(list(wrong.local_shape(MESH))) in str(err.value)
    assert err.value.where is not None and err.value.hint


# ---- repeated blocks: the shape check runs each distinct call once, and still catches every error -
def _gpt_program(coords: tuple[int, ...] = (0, 0, 0)) -> EmittedProgram:
    """A fresh program of the two-block GPT: block 1 repeats block 0's op calls."""
    mesh = Mesh.from_shape(MESH)
    gm = insert_comm(copy.deepcopy(propagated("gpt", MESH)), mesh, coords)
    return emit(schedule(gm), mesh, default_registry(), coords)


def _metadata(gm: fx.GraphModule) -> dict[str, list[tuple]]:
    out = {}
    for node in gm.graph.nodes:
        leaves = torch.utils._pytree.tree_leaves(node.meta.get("val"))
        out[node.name] = [
            (tuple(v.shape), v.stride(), v.dtype) for v in leaves if isinstance(v, torch.Tensor)
        ]
    return out


def test_shape_check_reuses_repeated_calls_and_agrees_with_plain_fake_propagation(monkeypatch) -> None:
    prog = _gpt_program()
    runs = []
    plain_run_node = FakeTensorProp.run_node

    def counting(self: FakeTensorProp, n: fx.Node) -> object:
        runs.append(n.op)
        return plain_run_node(self, n)

    monkeypatch.setattr(FakeTensorProp, "run_node", counting)
    check_local_shapes(prog, MESH)
    monkeypatch.undo()
    calls = sum(1 for gm in (prog.forward, prog.backward) for n in gm.graph.nodes if n.op == "call_function")
    ran = runs.count("call_function")
    assert 0 < ran < 0.75 * calls  # block 1 (and many repeats within a block) came from the memo
    got = {"forward": _metadata(prog.forward), "backward": _metadata(prog.backward)}
    # plain FakeTensorProp over every node gives every node the same shape, strides and dtype
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = [
            torch.empty(lay.local_shape(MESH, prog.coords), dtype=lay.dtype)
            for lay in [*prog.param_layouts, *prog.input_layouts]
        ]
    FakeTensorProp(prog.forward, mode).propagate(*args)
    out = next(n for n in prog.forward.graph.nodes if n.op == "output")
    saved = [n.meta["val"] for n in list(out.args[0])[len(prog.output_layouts) :]]
    with mode:
        tangents = [torch.empty((), dtype=prog.output_layouts[0].dtype)]
    FakeTensorProp(prog.backward, mode).propagate(*saved, *tangents)
    assert _metadata(prog.forward) == got["forward"]
    assert _metadata(prog.backward) == got["backward"]


def _repeated_reshape(gm: fx.GraphModule) -> fx.Node:
    """A reshape in block 1 whose call (input shape and sizes) block 0 makes too."""
    reshapes = [n for n in gm.graph.nodes if n.target is aten.reshape.default and not is_comm(n)]

    def call(n: fx.Node) -> tuple:
        return (tuple(n.args[0].meta["val"].shape), tuple(n.args[1]))

    block0 = {call(n) for n in reshapes if info(n).module_path.startswith("blocks.0.")}
    for node in reshapes:
        sizes = list(node.args[1])
        if info(node).module_path.startswith("blocks.1.") and call(node) in block0 and sizes[::-1] != sizes:
            return node
    raise AssertionError("no repeated reshape in block 1")


@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_a_wrong_local_size_in_a_repeated_block_is_caught(graph: str) -> None:
    prog = _gpt_program()
    gm = getattr(prog, graph)
    node = _repeated_reshape(gm)
    good = _shape(node)
    wrong = list(node.args[1])[::-1]  # same number of elements: the reshape itself still runs
    node.args = (node.args[0], wrong)
    with pytest.raises(ShardingError, match=node.name) as err:
        check_local_shapes(prog, MESH)
    assert f"local shape {tuple(wrong)}" in str(err.value) and str(list(good)) in str(err.value)
    assert info(node).module_path in err.value.where


@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_a_wrong_layout_on_a_repeated_call_is_caught(graph: str) -> None:
    prog = _gpt_program()
    gm = getattr(prog, graph)
    matmuls = (aten.mm.default, aten.addmm.default, aten.bmm.default)
    mms = [n for n in gm.graph.nodes if n.target in matmuls and not is_comm(n)]

    def call(n: fx.Node) -> tuple:
        return (n.target, *(tuple(a.meta["val"].shape) for a in n.args))

    # the last matmul whose local call an earlier matmul (in the other block) already made
    node = next(n for n in reversed(mms) if any(call(m) == call(n) for m in mms[: mms.index(n)]))
    assert info(node).module_path.startswith("blocks.")
    good = info(node).layout
    wrong = Layout.replicated(good.shape, len(MESH), good.dtype)
    assert wrong.local_shape(MESH) != good.local_shape(MESH)
    update_info(node, layouts=(wrong,))
    with pytest.raises(ShardingError, match=node.name):
        check_local_shapes(prog, MESH)


def test_a_kernel_rejecting_local_shapes_names_the_emitted_node() -> None:
    prog = _gpt_program()
    node = next(n for n in prog.forward.graph.nodes if n.target is aten.reshape.default and not is_comm(n))
    node.args = (node.args[0], [v + 1 for v in node.args[1]])  # wrong number of elements
    with pytest.raises(ShardingError, match=f"emitted {node.name} fails on its local inputs"):
        check_local_shapes(prog, MESH)


# ---- end to end: the emitted programs of all ranks compute eager's loss and gradients -----------
@pytest.mark.parametrize(
    ("key", "shape"), [("two_linear", MESH), ("mlp", MESH), ("mlp", (8,)), ("gpt1", MESH)]
)
def test_all_ranks_together_compute_eager_loss_and_gradients(key: str, shape: tuple[int, ...]) -> None:
    model, inputs = model_case(key)
    fwd, bwd = simulate_step(key, shape)
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    for c in all_coords(shape):
        torch.testing.assert_close(fwd[c][0], loss.detach(), atol=1e-5, rtol=1e-5)
    prog = rank_programs(key, shape)[(0,) * len(shape)][1]
    params = dict(model.named_parameters())
    assert sorted(
        {prog.param_parts[n].source if n in prog.param_parts else n for n in prog.param_names}
    ) == sorted(params)
    grads = {name: p.grad for name, p in params.items()}
    for i, (name, lay) in enumerate(zip(prog.param_names, prog.param_layouts)):
        grad = assemble({c: bwd[c][i] for c in bwd}, lay, shape, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(grad, prog.param_value(name, grads), atol=2e-5, rtol=1e-4, msg=name)
    model.zero_grad(set_to_none=True)
