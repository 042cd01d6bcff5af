"""The fixed schemes seed the search: it is never worse than any of them on its own mesh.

A small GPT (2 layers, h = 64, 8 heads, s = 32, batch 8, vocabulary 64). On each mesh every
variant of 1-D / 2-D / cube (and of the cube's letters on three unequal axes, the 3-D grid) that
lays out on that mesh (unit axes aside) is a seed, named
"fixed:<scheme>" in the search report beside the role seeds; the search's final modeled cost is at
most each seed's and at most the cost of the scheme's own best plan (`plan_fixed`, which also tries
other mesh shapes) whenever that plan is on the search's mesh.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.fx as fx

from autopar.core.layout import R, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import info
from autopar.core.plan import Plan
from autopar.passes.trace import trace
from autopar.planning import search_seeds
from autopar.planning.fixed import (
    GRID_3D,
    SCHEMES,
    TITLES,
    InfeasibleScheme,
    plan_fixed,
    scheme_variants,
    variants_on,
)
from autopar.planning.search import ElementCost, SearchReport, TimeCost, plan_cost, search_layouts
from autopar.planning.search_seeds import ATTENTION, PREFIX
from autopar.rules import context_parallel
from autopar.rules.registry import default_registry
from examples.models import GPT, GPTConfig

REGISTRY = default_registry()
CFG = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=8, n_embd=64)
HARDWARE = [None, "h100-nvlink-ib"]


@functools.cache
def _traced() -> fx.GraphModule:
    with torch.device("meta"):
        model = GPT(CFG)
    idx = torch.zeros(8, CFG.block_size, dtype=torch.long)
    return trace(model, (idx, idx), decompose=True)


def _cost(hardware: str | None, shape: tuple[int, ...]) -> ElementCost:
    return TimeCost(hardware, shape) if hardware is not None else ElementCost(shape)


@functools.cache
def _searched(shape: tuple[int, ...], hardware: str | None) -> tuple[float, SearchReport]:
    gm = _traced()
    # (the seeds under sharded storage; replicated storage starts from the same seeds)
    plan = search_layouts(
        gm, Mesh.from_shape(shape), REGISTRY, cost=_cost(hardware, shape), memory_limit=math.inf, storage="sharded"
    )
    report: SearchReport = gm.meta["autopar_search"]
    assert plan_cost(gm, plan, Mesh.from_shape(shape), _cost(hardware, shape)) == pytest.approx(report.final_cost)
    return report.final_cost, report


@pytest.mark.parametrize("hardware", HARDWARE)
@pytest.mark.parametrize(
    ("shape", "key", "variants"),
    [((2, 2, 2), "cube_3d", 12), ((2, 4), "summa_2d", 2), ((4, 2), "summa_2d", 2), ((8,), "megatron_1d", 1)],
)
def test_search_is_at_most_every_fixed_seed(
    shape: tuple[int, ...], key: str, variants: int, hardware: str | None
) -> None:
    final, report = _searched(shape, hardware)
    fixed = {name: cost for name, cost in report.seeds.items() if name.startswith(PREFIX + TITLES[key])}
    assert len(fixed) == variants, report.seeds
    assert all(final <= cost * (1 + 1e-12) for cost in report.seeds.values())
    assert report.seed_cost == min(report.seeds.values())
    # the role seeds are there too, and no fixed seed failed on these meshes
    assert any(not name.startswith(PREFIX) for name in report.seeds)
    assert not report.failed_fixed
    assert report.chosen_seed in report.seeds


@pytest.mark.parametrize("hardware", HARDWARE)
@pytest.mark.parametrize("p", [8])
def test_search_is_at_most_each_fixed_plan_on_its_mesh(p: int, hardware: str | None) -> None:
    gm = _traced()
    compared = 0
    for key in SCHEMES:
        fixed = plan_fixed(gm, key, p, REGISTRY, hardware, require_heads=False)
        assert fixed.plan is not None and fixed.scheme is not None, fixed.infeasible
        shape = fixed.scheme.mesh_shape
        value = plan_cost(gm, fixed.plan, Mesh.from_shape(shape), _cost(hardware, shape))
        final, report = _searched(shape, hardware)
        assert final <= value * (1 + 1e-12), (key, shape)
        # the scheme's best plan on this mesh is one of the seeds, at the same cost
        assert any(cost == pytest.approx(value) for name, cost in report.seeds.items() if name.startswith(PREFIX))
        compared += 1
    assert compared == len(SCHEMES)


def test_unit_axes_take_the_schemes_of_the_other_axes() -> None:
    final, report = _searched((1, 2, 4), "h100-nvlink-ib")
    names = [name for name in report.seeds if name.startswith(PREFIX)]
    assert names == [
        "fixed:2-D SUMMA (x=1: -, y=2: T, z=4: n; grid 2x4)",
        "fixed:2-D SUMMA (x=1: -, y=2: n, z=4: T; grid 4x2)",
    ]
    flat, flat_report = _searched((2, 4), "h100-nvlink-ib")
    # the same plans on (2, 4): the unit axis changes no cost
    assert sorted(report.seeds[n] for n in names) == pytest.approx(
        sorted(c for n, c in flat_report.seeds.items() if n.startswith(PREFIX))
    )
    assert final == pytest.approx(flat)


def test_without_fixed_seeds_only_roles_seed() -> None:
    gm = _traced()
    mesh = Mesh.from_shape((2, 4))
    search_layouts(gm, mesh, REGISTRY, cost=TimeCost("h100-nvlink-ib", (2, 4)), fixed_seeds=False, storage="sharded")
    report: SearchReport = gm.meta["autopar_search"]
    assert report.seeds and not any(name.startswith(PREFIX) for name in report.seeds)
    final, seeded = _searched((2, 4), "h100-nvlink-ib")
    # here SUMMA (tokens on y, outputs on x) is the cheapest seed, and the chain moves from it
    # end below the search from the role seeds alone
    assert seeded.chosen_seed == "fixed:2-D SUMMA (x=2: n, y=4: T; grid 4x2)"
    assert seeded.seeds[seeded.chosen_seed] < min(report.seeds.values())
    assert final < report.final_cost * (1 - 1e-3)


def test_three_unequal_axes_take_the_cube_letters_as_a_grid_seed() -> None:
    """AxoNN's / Tensor3D's grid: the cube's letters (k, n, T in a pair's first linear, n, k, T in
    its second) on three axes of any sizes. Every order whose token axis divides the batch seeds the
    search; the cube's own equal sizes stay the cube's, so p = 8 has no grid."""
    gm = _traced()
    with pytest.raises(InfeasibleScheme, match="3-D grid of unequal axes"):
        scheme_variants(GRID_3D, 8, gm)
    grids = scheme_variants(GRID_3D, 16, gm)  # (2, 2, 4), (2, 4, 2), (4, 2, 2), six orders each
    assert len(grids) == 18 and all(sorted(v.first) == ["T", "k", "n"] for v in grids)
    assert variants_on(GRID_3D, (1, 2, 8), gm) == []  # two sized axes: 2-D's, not the grid's
    final, report = _searched((2, 2, 4), None)
    names = [name for name in report.seeds if name.startswith(PREFIX + TITLES[GRID_3D])]
    assert len(names) == 12 and not report.failed_fixed  # each order, and with attention forced too
    assert "fixed:3-D grid (x=2: k/n, y=2: n/k, z=4: T)" in names
    assert final <= min(report.seeds[name] for name in names) * (1 + 1e-12)


def test_the_grid_seed_ends_below_the_other_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """On (2, 4, 2) on the H100 table (the graph cut as the search plans it, `split_fused`), the
    search from the 3-D grid ends 7 % below the search from every other seed: no role assignment's
    greedy pass lays the linears out so. It starts from the grid's order with attention and the
    residual stream forced too (tokens on z), and ends below the search from the grid's linears alone
    (whose best order puts tokens on y)."""
    with torch.device("meta"):
        model = GPT(CFG)
    idx = torch.zeros(8, CFG.block_size, dtype=torch.long)
    gm = trace(model, (idx, idx), decompose=True, split_fused=True)
    shape = (2, 4, 2)

    def searched() -> SearchReport:
        cost = TimeCost("h100-nvlink-ib", shape)
        search_layouts(gm, Mesh.from_shape(shape), REGISTRY, cost=cost, memory_limit=math.inf, storage="sharded")
        return gm.meta["autopar_search"]

    with_grid = searched()
    assert with_grid.chosen_seed == f"fixed:3-D grid (x=2: k/n, y=4: n/k, z=2: T){ATTENTION}"
    monkeypatch.setattr(search_seeds, "GRID_SCHEMES", ())  # the grid's orders without attention forced
    linears_only = searched()
    assert linears_only.chosen_seed == "fixed:3-D grid (x=2: k/n, y=4: T, z=2: n/k)"
    assert with_grid.final_cost < linears_only.final_cost
    monkeypatch.setattr(search_seeds, "SEED_SCHEMES", SCHEMES)
    without = searched()
    assert not any(name.startswith(PREFIX + TITLES[GRID_3D]) for name in without.seeds)
    assert with_grid.final_cost < without.final_cost * 0.95


def test_the_grid_seed_with_attention_and_the_residual_stream_forced() -> None:
    """Beside each 3-D grid order, a seed with attention and the residual stream laid out as the
    closed form has them: attention's batch on the token axis, heads on the first linear's n axis,
    and on its k axis the sequence where k is the earlier mesh axis (x=2: k/n, y=2: n/k) or the
    heads again where it nests inside n (x=2: n/k, y=2: k/n); the residual adds split as the first
    linear's input (tokens on T, features on k, whole on n). On (2, 2, 4) both are cheaper than the
    grid's plan without them."""
    gm = _traced()
    shape = (2, 2, 4)
    mesh = Mesh.from_shape(shape)
    seeds = dict(search_seeds.fixed_seeds(gm, mesh, REGISTRY, {}))
    attention = next(n for n in gm.graph.nodes if n.target == context_parallel.FORWARD)
    adds = [
        n for n in gm.graph.nodes if n.target == torch.ops.aten.add.Tensor and info(n).module_path == "blocks.0"
    ]
    assert len(adds) == 2  # the two residual adds of the first block
    for order, query, stream in [
        ("x=2: k/n, y=2: n/k, z=4: T", (Shard(2), Shard(1), Shard(0)), (Shard(2), R, Shard(0))),
        ("x=2: n/k, y=2: k/n, z=4: T", (Shard(1), Shard(1), Shard(0)), (R, Shard(2), Shard(0))),
    ]:
        plain, forced = seeds[f"fixed:3-D grid ({order})"], seeds[f"fixed:3-D grid ({order}){ATTENTION}"]
        assert isinstance(plain, Plan) and isinstance(forced, Plan)
        assert forced.strategies[attention.name].inputs[0].placements == query
        assert all(forced.strategies[a.name].outputs[0].placements == stream for a in adds)
        assert plain.strategies[attention.name].inputs[0].placements != query or any(
            plain.strategies[a.name].outputs[0].placements != stream for a in adds
        )
        assert plan_cost(gm, forced, mesh, ElementCost(shape)) < plan_cost(gm, plain, mesh, ElementCost(shape))
