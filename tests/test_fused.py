"""split_fused: a fused linear split into equal pieces becomes one linear per piece (passes/fused.py)."""

from __future__ import annotations

import pytest
import torch
from pass_fixtures import assert_matches_serial, compile_every_rank, gpt_case, model_case, run_programs

from autopar.api import compile_for_rank
from autopar.core.layout import Layout, Partial, Replicate, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info, signature
from autopar.core.redistribute import plan_redistribute, redistribute_cost
from autopar.passes.trace import trace
from autopar.planning.search import ElementCost, plan_cost_parts, search_layouts
from autopar.planning.search_cost import CALL_ELEMENTS
from autopar.planning.storage import part_dim_at, part_dims
from autopar.rules.registry import default_registry

aten = torch.ops.aten


def test_trace_cuts_the_fused_qkv_into_three_linears() -> None:
    model, inputs = gpt_case()
    gm = trace(model, inputs, decompose=True, split_fused=True)
    sig = signature(gm)
    qkv = {n: p for n, p in sig.param_parts.items() if n.startswith("blocks.0.attn.qkv.")}
    assert sorted(qkv) == sorted(
        f"blocks.0.attn.qkv.{w}__part{i}" for w in ("weight", "bias") for i in range(3)
    )
    assert {(p.source, p.dim, p.count) for p in qkv.values()} == {
        ("blocks.0.attn.qkv.weight", 0, 3),
        ("blocks.0.attn.qkv.bias", 0, 3),
    }
    # the user's fused parameter is gone from the graph; every part has a gradient
    assert "blocks.0.attn.qkv.weight" not in sig.param_names
    assert set(sig.param_parts) <= set(sig.grad_of)
    # no split of a qkv output is left in the forward: q, k and v come from their own products
    splits = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target in (aten.split.Tensor, aten.split_with_sizes.default)
        and info(n).module_path.endswith("attn")
        and info(n).phase == "forward"
    ]
    assert splits == []
    h = model.blocks[0].attn.qkv.in_features
    part = next(
        n
        for n in gm.graph.nodes
        if n.op == "placeholder" and info(n).param_name == "blocks.0.attn.qkv.weight__part1"
    )
    assert tuple(part.meta["val"].shape) == (h, h)
    # without the option the graph keeps the fused linear
    assert signature(trace(model, inputs, decompose=True)).param_parts == {}


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2)])
def test_split_programs_equal_serial_and_store_parts_with_the_cut_dim_whole(shape: tuple[int, ...]) -> None:
    model, inputs = gpt_case()
    # the ranks as a job compiles them: one trace and search, rank 0's plan for every rank
    compiled = compile_every_rank(model, shape, inputs, planner="search", split_fused=True)
    programs = {c: comp.program for c, comp in compiled.items()}
    first = next(iter(programs.values()))
    assert len(first.param_parts) == 12
    for name, part in first.param_parts.items():  # stored so that the parts make one plain shard
        layout = first.param_layouts[first.param_names.index(name)]
        assert not layout.shard_axes(part.dim), (name, layout)
    sources = first.source_layouts()
    assert sources["blocks.0.attn.qkv.weight"].shape == tuple(model.blocks[0].attn.qkv.weight.shape)
    fwd, bwd = run_programs(programs, model, inputs, shape)
    assert_matches_serial(first, fwd, bwd, model, inputs, shape)


def test_partial_sum_reduce_scatters_before_moving_the_outer_axis() -> None:
    """[S(0) on y, P on z] -> [S(1) on y, S(1) on z] (a part's gradient into its storage):
    reduce-scatter z into dim 1 with its blocks in (z, y) order, then all-to-all y on the reduced
    block, instead of all-to-all y on the summands then reduce-scatter z (4 times the exchange's
    volume here), or all-reduce z then all-to-all y."""
    mesh = (1, 4, 4)
    src = Layout((Replicate(), Shard(0), Partial()), (64, 64))
    dst = Layout((Replicate(), Shard(1), Shard(1)), (64, 64))
    steps = plan_redistribute(src, dst, mesh)
    assert [(s.kind, s.axis, s.swap) for s in steps] == [("reduce_scatter", 2, (4, 4)), ("all_to_all", 1, None)]
    assert steps[-1].after == dst
    n = 64 * 64 / 4
    assert redistribute_cost(src, dst, mesh) == pytest.approx(3 / 4 * n + 3 / 4 * n / 4)
    assert sum(s.elements_sent(mesh) for s in steps) == redistribute_cost(src, dst, mesh)
    # and the gather of the part from that storage to heads on y: exchanged before it is gathered
    back = plan_redistribute(dst, Layout((Replicate(), Shard(0), Replicate()), (64, 64)), mesh)
    assert [(s.kind, s.axis, s.swap) for s in back] == [("all_to_all", 1, None), ("all_gather", 2, (4, 4))]
    assert sum(s.elements_sent(mesh) for s in back) == pytest.approx(3 / 4 * n / 4 + 3 * n / 4)


def test_programs_that_exchange_before_gathering_equal_serial() -> None:
    """On (4, 2) the search's GPT plan has a value split on one dim by both axes whose outer axis
    moves to another dim: the emitted program exchanges the small block first, then gathers and
    swaps the blocks back (`CommStep.swap`), and every rank's program still equals serial."""
    model, inputs = model_case("gpt1")
    shape = (4, 2)
    compiled = compile_every_rank(model, shape, inputs, planner="search")  # one search, as a job runs it
    steps = [info(n).comm for n in compiled[(1, 1)].graph.graph.nodes if has_info(n) and info(n).comm is not None]
    swapped = [s for s in steps if s.swap is not None]
    assert swapped and all(s.kind == "all_gather" and s.swap == (2, 4) for s in swapped)
    for gather in swapped:  # the exchange before it ran on the block the gather starts from
        exchange = next(s for s in steps if s.kind == "all_to_all" and s.after == gather.before)
        assert exchange.before.local_numel(shape) == gather.before.local_numel(shape)
    programs = {c: comp.program for c, comp in compiled.items()}
    fwd, bwd = run_programs(programs, model, inputs, shape)
    assert_matches_serial(programs[(0, 0)], fwd, bwd, model, inputs, shape)


def test_the_search_prices_parts_in_the_storage_they_get() -> None:
    # a part is stored with its cut dim whole: the planner lays it out so, and the search prices
    # its gathers and gradient reductions from and into that storage, as insert_comm emits them
    model, inputs = gpt_case()
    mesh = Mesh.from_shape((2, 2, 2))
    gm = trace(model, inputs, decompose=True, split_fused=True)
    dims = part_dims(gm)
    assert len(dims) == 12 and set(dims.values()) == {0}
    nodes = {n.name: n for n in gm.graph.nodes}
    weights = [n for n in gm.graph.nodes if n.target is aten.t.default and n.args[0].name in dims]
    assert weights and all(part_dim_at(n, dims) == 1 for n in weights)  # the matmul reads W^T
    assert all(part_dim_at(nodes[name], dims) == 0 for name in dims)
    plan = search_layouts(gm, mesh, default_registry())
    for name, dim in dims.items():
        assert not plan.layouts[name][0].shard_axes(dim), name
    comm, _ = plan_cost_parts(gm, plan, mesh, ElementCost(mesh.shape), once=True)
    compiled = compile_for_rank(model, mesh, inputs, coords=(0, 0, 0), planner="search")
    assert signature(compiled.graph).param_parts  # split by default with the search
    emitted = compiled.report.collectives  # each one's elements, plus element counts' term per call
    assert comm == pytest.approx(sum(c.elements for c in emitted) + CALL_ELEMENTS * len(emitted), rel=1e-6)
