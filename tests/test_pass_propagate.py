"""Stage 2, propagate: layouts on every node, 3-D matmuls on (2,2,2), Megatron on a 1-D mesh."""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.fx as fx
from pass_fixtures import gpt_case, gpt_compiled, gpt_propagated

from autopar.compiler.driver import compile_for_rank
from autopar.core.layout import Layout, Partial, Replicate, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import info, signature
from autopar.planning.greedy_roles import axis_roles
from autopar.planning.storage import storage_layout

MESHES = [(8,), (2, 4), (2, 2, 2), (2, 2, 2, 1)]
LINEAR_SUFFIXES = (".attn.qkv", ".attn.proj", ".mlp.fc", ".mlp.proj")


def _forward_linears(gm: fx.GraphModule) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target is torch.ops.aten.addmm.default
        and info(n).phase == "forward"
        and info(n).module_path.endswith(LINEAR_SUFFIXES)
    ]


@pytest.mark.parametrize("shape", MESHES)
def test_every_node_gets_layouts_matching_its_value(shape: tuple[int, ...]) -> None:
    gm = gpt_propagated(shape)
    for node in gm.graph.nodes:
        layouts = info(node).layouts
        assert layouts, node.name
        for lay in layouts:
            assert len(lay.placements) == len(shape), node.name
            assert lay.is_even(shape), (node.name, lay)
        if node.op == "output":
            continue
        vals = [v for v in torch.utils._pytree.tree_leaves(node.meta["val"]) if isinstance(v, torch.Tensor)]
        assert [tuple(v.shape) for v in vals] == [lay.shape for lay in layouts], node.name
        assert [v.dtype for v in vals] == [lay.dtype for lay in layouts], node.name
        if node.op == "call_function" and node.target is not operator.getitem:
            strategy = info(node).strategy
            assert strategy is not None, node.name
            assert tuple(strategy.outputs) == tuple(layouts), node.name
    assert gm.meta["autopar_roles"] == axis_roles(Mesh.from_shape(shape))


@pytest.mark.parametrize("shape", MESHES)
def test_user_inputs_arrive_replicated_and_the_loss_is_whole(shape: tuple[int, ...]) -> None:
    gm = gpt_propagated(shape)
    for node in gm.graph.nodes:
        if node.op == "placeholder" and info(node).role == "input":
            assert info(node).layout.is_replicated
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss_layout = info(output).layouts[0]
    assert loss_layout.shape == () and loss_layout.is_replicated
    # gradient outputs are required in their parameter's storage layout
    params = {
        info(n).param_name: n for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "param"
    }
    sig = signature(gm)
    for name, lay in zip(sig.grad_of, info(output).layouts[sig.num_user_outputs :]):
        assert lay == info(params[name]).layout, name


def _axes_where(layout: Layout, placement: object) -> set[int]:
    return {a for a, p in enumerate(layout.placements) if p == placement}


def test_forward_linears_on_2x2x2_are_genuine_3d_matmuls() -> None:
    shape = (2, 2, 2)
    gm = gpt_propagated(shape)
    linears = _forward_linears(gm)
    assert {info(n).module_path for n in linears} == {
        f"blocks.{i}{s}" for i in range(2) for s in LINEAR_SUFFIXES
    }
    contraction_axes = {}
    for node in linears:
        strategy = info(node).strategy
        _, act, weight = strategy.inputs  # addmm(bias, x [T, k], w^T [k, n])
        (out,) = strategy.outputs
        rows = _axes_where(act, Shard(0))
        contraction = _axes_where(act, Shard(1)) & _axes_where(weight, Shard(0))
        columns = _axes_where(weight, Shard(1))
        assert len(rows) == len(contraction) == len(columns) == 1, (node.name, act, weight)
        assert rows | contraction | columns == {0, 1, 2}, (node.name, act, weight)
        # the split contraction leaves a pending sum on exactly that axis
        assert _axes_where(out, Partial()) == contraction
        assert _axes_where(out, Shard(0)) == rows and _axes_where(out, Shard(1)) == columns
        # tokens ride the token axis (z); x and y split the weight
        assert rows == {2}
        assert not _axes_where(weight, Replicate()) - {2}
        contraction_axes[info(node).module_path] = contraction.pop()
    # the second linear of each pair swaps x and y (AxoNN), so no redistribution is needed between
    for i in range(2):
        for first, second in (("mlp.fc", "mlp.proj"), ("attn.qkv", "attn.proj")):
            a, b = contraction_axes[f"blocks.{i}.{first}"], contraction_axes[f"blocks.{i}.{second}"]
            assert {a, b} == {0, 1}, (i, first, second, contraction_axes)


@pytest.mark.parametrize("shape", [(2, 4), (2, 2, 2, 1)])
def test_forward_linears_split_the_weight_on_every_tensor_axis(shape: tuple[int, ...]) -> None:
    gm = gpt_propagated(shape)
    roles = gm.meta["autopar_roles"]
    for node in _forward_linears(gm):
        _, act, weight = info(node).strategy.inputs
        for a, role in enumerate(roles):
            if shape[a] == 1:
                continue
            if role == "tensor":
                assert isinstance(weight.placements[a], Shard), (node.name, a, weight)
            else:
                assert act.placements[a] == Shard(0), (node.name, a, act)
        tensor_dims = {
            weight.placements[a].dim for a, r in enumerate(roles) if r == "tensor" and shape[a] > 1
        }
        assert tensor_dims == {0, 1}, (node.name, weight)  # contraction on one axis, columns on the other


@pytest.mark.parametrize("shape", [(8,), (2, 2, 2), (2, 2, 2, 1)])
def test_parameters_are_stored_split_over_every_axis(shape: tuple[int, ...]) -> None:
    gm = gpt_propagated(shape)
    total = 0
    local = 0
    replicated = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or info(node).role != "param":
            continue
        lay = info(node).layout
        total += math.prod(lay.shape) * 4
        local += lay.local_bytes(shape)
        assert not lay.partial_axes()
        if any(isinstance(p, Replicate) and shape[a] > 1 for a, p in enumerate(lay.placements)):
            replicated.append(info(node).param_name)
        # storage is the compute layout split further: storing again changes nothing
        assert storage_layout(lay, shape) == lay
    # the GPT's sizes are all divisible by 8: nothing, not even a LayerNorm vector, stays replicated
    assert replicated == []
    assert local * math.prod(shape) == total


def test_report_param_bytes_are_one_eighth_on_2x2x2() -> None:
    compiled, _ = gpt_compiled((2, 2, 2), (0, 0, 0))
    report = compiled.report
    model_bytes = sum(p.numel() * 4 for p in gpt_case()[0].parameters())
    assert report.param_bytes_total == model_bytes
    # parts of the fused qkv keep their cut dim whole: its bias parts (1-D) stay whole on every rank
    bias = sum(p.numel() * 4 for n, p in gpt_case()[0].named_parameters() if n.endswith("attn.qkv.bias"))
    assert report.param_bytes_local == pytest.approx((report.param_bytes_total - bias) / 8 + bias, rel=0.02)
    parts = {f"blocks.{i}.attn.qkv.bias__part{k}" for i in range(2) for k in range(3)}
    assert set(report.replicated_params) == set(report.replicated_parts) == parts
    assert "keeps its cut dim whole" in str(report) and "too small to split" not in str(report)


class _ScalesByAConstant(torch.nn.Module):
    """A forward that makes a tensor from Python data: export lifts it to `_tensor_constant0`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) * torch.tensor([2.0, 3.0]).repeat(8)).sum()


def test_report_counts_the_models_state_not_the_graphs_constants() -> None:
    """A constant the forward made is the program's, whole on every rank and stored by no one: the
    summary neither lists it among replicated parameters nor counts its bytes."""
    compiled = compile_for_rank(_ScalesByAConstant(), Mesh.from_shape((2,)), (torch.randn(4, 16),), coords=(0,))
    assert list(compiled.program.constants) == ["_tensor_constant0"]  # the case this test is about
    report = compiled.report
    assert report.param_bytes_total == (16 * 16 + 16) * 4
    assert "_tensor_constant0" not in report.replicated_params
    assert "_tensor_constant0" not in str(report)


def test_megatron_column_then_row_on_a_1d_mesh() -> None:
    gm = gpt_propagated((8,))
    by_path = {info(n).module_path: n for n in _forward_linears(gm)}
    for i in range(2):
        fc, proj = by_path[f"blocks.{i}.mlp.fc"], by_path[f"blocks.{i}.mlp.proj"]
        fc_bias, fc_act, fc_w = info(fc).strategy.inputs
        # column parallel: whole input, weight columns (and bias) split, output split by columns
        assert (fc_act.placements, fc_w.placements, fc_bias.placements) == (
            (Replicate(),),
            (Shard(1),),
            (Shard(0),),
        )
        assert info(fc).layout.placements == (Shard(1),)
        pr_bias, pr_act, pr_w = info(proj).strategy.inputs
        # row parallel: input split by columns, weight rows split, output a pending sum
        assert (pr_act.placements, pr_w.placements) == ((Shard(1),), (Shard(0),))
        assert pr_bias.placements == (Partial(),)  # the bias is added once, on one rank
        assert info(proj).layout.placements == (Partial(),)
        # between them (gelu, views) the hidden activation stays split: no communication
        node = proj.args[1]
        while node is not fc:
            assert info(node).layout.placements == (Shard(len(info(node).layout.shape) - 1),), node.name
            node = node.args[0]
