"""What makes `autopar.plan(model, "auto")` fast at scale keeps the numbers and plans it had.

- Steps of pairs of placements are worked out once per number of mesh axes and shared by every
  mesh (`search_steps.StepCache`), and pairs whose dims renumber alike share one template: tables
  must be those of a private cache, bit for bit, on meshes with and without unit axes.
- Candidate lists pruned alike keep one key, so repeated layers on big meshes stay memoized.
- The mesh choice's screen (`mesh_screen`) searches only the best few candidates by a cheap plan;
  the cheap plan is one of the search's seeds, so it bounds the searched plan from above.
- `expand` walks the product of per-axis strategies pruning prefixes: the list is the filtered
  product's, in its order, on meshes with odd, unit and uneven axes.
- The screen's meshes share candidate lists where their sizes divide the same dims
  (`expand_signature`, `ExpandCache`) and a list's mesh-free facts (`ListShape`): every mesh
  gets the lists, facts and estimates it gets alone.
- `plan(model, "auto")` compiles the mesh choice's trace and plan of the chosen mesh instead of
  tracing and searching it again: the result is that of planning the chosen shape directly.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import autopar
import autopar.compiler.driver as driver
import autopar.planning.search_problem as search_problem
from autopar.compiler.lowering import scheduled_step_time
from autopar.core.layout import Layout, P, R, Shard
from autopar.core.mesh import Mesh
from autopar.core.redistribute import redistribute_cost
from autopar.passes.trace import trace
from autopar.planning.greedy import _strategy_facts
from autopar.planning.greedy_scores import ListFacts, ListShape
from autopar.planning.mesh_choice import MeshChoice, mesh_candidates, rank_meshes
from autopar.planning.mesh_screen import estimate, screen
from autopar.planning.plan_cost import GraphFacts
from autopar.planning.search import TimeCost, search_layouts
from autopar.planning.search_cost import CALL_ELEMENTS, ElementCost, collective_count
from autopar.planning.search_steps import REPLICATE, StepCache, canonical, coded_template
from autopar.rules.base import admissible, all_replicated, combine, expand
from autopar.rules.calls import ExpandCache, call_key, expand_cached, op_call
from autopar.rules.registry import default_registry
from examples.models import GPT, GPTConfig, make_gpt

HW = "h100-nvlink-ib"


def _layouts(ndim: int, shape: tuple[int, ...]) -> list[Layout]:
    options = [R, P, *(Shard(d) for d in range(len(shape)))]
    return [Layout(p, shape) for p in itertools.product(options, repeat=ndim)]


def test_a_shared_cache_gives_every_mesh_its_own_numbers() -> None:
    shared = StepCache()
    small, big = _layouts(3, (8, 16, 32)), _layouts(3, (64, 16, 32))
    for mesh in [(2, 4, 2), (4, 2, 2), (1, 8, 2), (2, 2, 1)]:  # unit axes drop their steps
        together = ElementCost(mesh, steps=shared)
        alone = ElementCost(mesh)
        for layouts in (small, big):
            table = together.redistribute_table(layouts, layouts)
            assert table.tolist() == alone.redistribute_table(layouts, layouts).tolist()
        # each pair's elements plus the per-collective term of element counts (`CALL_ELEMENTS`)
        direct = [
            [redistribute_cost(s, d, mesh) + CALL_ELEMENTS * collective_count(s, d, mesh) for d in small[:40]]
            for s in small[:40]
        ]
        assert together.redistribute_table(small[:40], small[:40]).tolist() == direct
    timed = TimeCost(HW, (8, 8), steps=shared)
    pair = _layouts(2, (64, 64))
    assert timed.redistribute_table(pair, pair).ravel().tolist() == pytest.approx(
        [timed.redistribute(s, d) for s in pair for d in pair], rel=1e-12
    )
    assert set(shared.by_ndim) == {2, 3}


def test_pairs_with_the_same_canonical_key_have_the_same_steps() -> None:
    codes = [REPLICATE, -1, 0, 1, 2, 3]
    pairs = np.array(list(itertools.product(codes, repeat=4)), dtype=np.int64)  # 2 axes: src, dst
    keys = canonical(pairs)
    by_key: dict[int, tuple[object, ...]] = {}
    for row, key in zip(pairs.tolist(), keys.tolist()):
        steps = coded_template(tuple(row[:2]), tuple(row[2:]))
        assert by_key.setdefault(key, steps) == steps
    assert len(by_key) < len(pairs) / 3  # renumbering dims shares most pairs


def test_lists_pruned_alike_share_their_key_and_stay_memoized(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = make_gpt(0, n_layer=2)
    gm = trace(model, inputs, decompose=True)
    pruned: list[str] = []
    prune = search_problem.Problem._prune

    def counted(self: search_problem.Problem, var: search_problem.Var) -> None:
        pruned.append(var.name)
        prune(self, var)

    monkeypatch.setattr(search_problem, "MAX_CANDIDATES", 12)
    monkeypatch.setattr(search_problem.Problem, "_prune", counted)
    search_layouts(gm, Mesh.from_shape((2, 2)), default_registry(), fixed_seeds=False)
    report = gm.meta["autopar_search"]
    assert len(pruned) > report.chains  # most ops pruned (each once per run)
    # repeated layers prune their lists alike: their chains share signatures and hit the memo
    assert report.distinct_chains < report.chains / 2 and report.memo_hits > report.solves / 4


CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=8, n_embd=256)


@pytest.fixture(scope="module")
def choices() -> tuple[MeshChoice, MeshChoice]:
    """(every candidate searched, 1 of 2 searched) on one traced GPT, by the no-overlap sum."""
    with torch.device("meta"):
        model = GPT(CFG)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 256, (8, 64), generator=g), torch.randint(0, 256, (8, 64), generator=g))
    gm = trace(model, batch, decompose=True, split_fused=True)
    registry = default_registry()
    every, screened = (
        rank_meshes(gm, 4, registry, scheduled_step_time, hardware=HW, overlap_candidates=0, searched=k)
        for k in (0, 1)
    )
    return every, screened


def test_the_screen_searches_the_best_few_and_bounds_them(choices: tuple[MeshChoice, MeshChoice]) -> None:
    _, screened = choices
    searched = [c for c in screened.candidates if c.searched]
    skipped = [c for c in screened.candidates if not c.searched]
    assert len(searched) == 1 and len(skipped) == 1 and screened.chosen.searched
    assert screened.chosen_plan is None  # kept only when asked (`choose_mesh(..., keep_plan=True)`)
    assert screened.candidates[-len(skipped) :] == skipped  # ranked after every searched one
    assert all(c.error.startswith("not searched") and not c.fits for c in skipped)
    # the screen's plan is one of the search's seeds, and the search never ends above a seed
    for c in searched:
        assert c.fits and c.step_time <= c.estimate * (1 + 1e-9)
    # the searched ones are the best by estimate
    assert max(c.estimate for c in searched) <= min(c.estimate for c in skipped)
    assert "not searched: screened 2 of 2" in screened.table()
    assert all("estimate_seconds" in row and "searched" in row for row in screened.to_json())


def test_searching_every_candidate_finds_no_better_mesh_here(choices: tuple[MeshChoice, MeshChoice]) -> None:
    every, screened = choices
    assert all(c.searched for c in every.candidates) and all(math.isnan(c.estimate) for c in every.candidates)
    assert screened.chosen.shape == every.chosen.shape
    assert screened.chosen.step_time == pytest.approx(every.chosen.step_time, rel=1e-12)


def test_expand_is_the_filtered_product_in_order() -> None:
    model, inputs = make_gpt(0, n_layer=1)
    gm = trace(model, inputs, decompose=True)
    registry = default_registry()
    calls = [op_call(n) for n in gm.graph.nodes if n.op == "call_function" and registry.get(n.target)]
    distinct = list({(call.op, call_key(call)): call for call in calls}.values())
    for shape in [(2, 3, 2), (3, 1, 4, 1), (4, 2, 2, 2), (5, 2), (1, 1)]:
        for call in distinct if len(shape) < 4 or 1 in shape else distinct[::4]:
            rule = registry.get(call.op)
            assert rule is not None
            options = rule.strategies(call)
            for uneven in (rule.uneven, False):
                axes = [[all_replicated(call)] if g == 1 else options for g in shape]
                every = [combine(call, c) for c in itertools.product(*axes)]
                want = [s for s in every if admissible(s, shape, uneven)]
                assert expand(call, options, shape, uneven) == want


def _same_facts(got: ListFacts, want: ListFacts) -> bool:
    return (
        got.candidates == want.candidates
        and got.uneven.tolist() == want.uneven.tolist()
        and got.split.tolist() == want.split.tolist()
        and got.pending.tolist() == want.pending.tolist()
        and [(w, i.tolist()) for w, i in got.wants] == [(w, i.tolist()) for w, i in want.wants]
    )


def test_meshes_that_divide_alike_share_lists_and_facts_as_alone() -> None:
    model, inputs = make_gpt(0, n_layer=1, n_embd=96, n_head=6, block_size=24)
    gm = trace(model, inputs, decompose=True)
    registry = default_registry()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and registry.get(n.target)]
    library: dict[object, list[object]] = {}
    shapes = [(2, 4), (4, 2), (2, 2), (8, 2), (3, 2), (6, 2), (5, 2), (2, 2, 2), (4, 2, 3), (1, 4), (2, 1)]
    keys = set()
    for shape in shapes:
        cache = ExpandCache(library)  # type: ignore[arg-type]
        for node in nodes:
            rule, call = registry.get(node.target), op_call(node)
            listed = expand_cached(node, rule, call, shape, cache)
            alone = expand_cached(node, rule, call, shape, {})
            assert listed == alone, (shape, node.name)
            keys.add((len(shape), node.target, call_key(call), rule.requirement))
            if listed:
                facts = ListFacts.of(alone, lambda s, shape=shape: _strategy_facts(s, shape))  # type: ignore[misc]
                assert _same_facts(ListShape.of(listed).facts(shape), facts), (shape, node.name)
    assert len(library) < len(shapes) * len(keys) / 2  # most meshes reuse a list


def test_the_screen_with_shared_lists_estimates_every_mesh_as_alone() -> None:
    model, inputs = make_gpt(0, n_layer=2, n_embd=96, n_head=6, block_size=24, batch_size=12)
    gm = trace(model, inputs, decompose=True)
    registry, steps = default_registry(), StepCache()
    meshes = [Mesh.from_shape(shape, names) for shape, names in mesh_candidates(12)]
    costs = [TimeCost(HW, m.shape, steps=steps) for m in meshes]
    _, together = screen(gm, meshes, registry, costs, keep=2)
    facts = GraphFacts.of(gm)
    for mesh, cost, found in zip(meshes, costs, together):
        alone = estimate(gm, mesh, registry, cost, facts)
        assert (found.value, found.seed) == (alone.value, alone.seed), mesh.shape
    assert sum(math.isfinite(e.value) for e in together) > len(meshes) // 2


def test_auto_compiles_the_chosen_plan_without_tracing_or_searching_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with torch.device("meta"):
        model = GPT(CFG)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 256, (8, 64), generator=g), torch.randint(0, 256, (8, 64), generator=g))
    direct = []
    for name in ("trace_for", "search_layouts"):
        original = getattr(driver, name)

        def counted(
            *args: object, _original: object = original, _name: str = name, **kwargs: object
        ) -> object:
            direct.append(_name)
            return _original(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(driver, name, counted)
    auto = autopar.plan(model, "auto", batch, world_size=4, planning=autopar.PlanOptions(hardware=HW))
    assert direct == []  # compiled from the choice's trace and plan
    choice = auto.mesh_choice
    assert choice is not None and choice.chosen_plan is not None and choice.chosen_plan.graph is not None
    chosen = choice.chosen
    again = autopar.plan(model, chosen.shape, batch, mesh_names=chosen.names, planning=autopar.PlanOptions(hardware=HW))
    assert direct == ["trace_for", "search_layouts"]
    assert auto.mesh.shape == again.mesh.shape
    assert auto.comm_time == again.comm_time and auto.compute_time == again.compute_time
    assert auto.memory.total == again.memory.total
    report, fresh = (r.compiled.graph.meta["autopar_search"] for r in (auto, again))
    assert (report.chosen_seed, report.final_cost, report.memory) == (
        fresh.chosen_seed,
        fresh.final_cost,
        fresh.memory,
    )
    assert [str(c) for c in auto.compiled.report.collectives] == [
        str(c) for c in again.compiled.report.collectives
    ]


def test_depths_bounded_by_their_ideal_cut_choose_as_pricing_every_depth() -> None:
    """Branch and bound over pipeline depths (`choose_pipeline_mesh(bound_depths=True)`): a depth
    whose fastest fitting ideal cut is slower than the best priced is not given a sub-mesh choice.
    Here pp = 4 is cut off (its ideal cut is over the tensor-only 2x4's step); the choice, and every
    row priced in both, is that of pricing every depth, and the depth cut off is slower there.

    Pricing every depth is the depth rows of a call without the tensor-only candidate
    (`with_tensor_only=False`) ranked beside the bounded call's tensor-only row, as the choice
    ranks its rows: that row is the 8-rank mesh choice, which the bound does not enter (it only
    bounds depths by it), so a second call would search the same meshes again for the same row."""
    from autopar.compiler.pipeline_mesh import choose_pipeline_mesh

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1024, block_size=256, n_layer=2, n_head=8, n_embd=512))
    idx = torch.zeros(8, 256, dtype=torch.long)
    bounded = choose_pipeline_mesh(model, 8, (idx, idx), microbatches=2, hardware=HW, depths=[2, 4])
    depth_rows = choose_pipeline_mesh(
        model, 8, (idx, idx), microbatches=2, hardware=HW, depths=[2, 4], bound_depths=False,
        with_tensor_only=False,
    )  # fmt: skip
    assert [c.pp for c in bounded.candidates if c.pp == 1] == [1]
    assert {c.pp for c in depth_rows.candidates} == {2, 4}
    every = sorted(
        [*(c for c in bounded.candidates if c.pp == 1), *depth_rows.candidates],
        key=lambda c: (bool(c.error), not c.fits, c.step_time),
    )
    assert (bounded.chosen.pp, bounded.chosen.mesh_shape, bounded.chosen.schedule) == (
        every[0].pp,
        every[0].mesh_shape,
        every[0].schedule,
    )
    assert bounded.chosen.step_time == every[0].step_time
    cut_off = [c for c in bounded.candidates if c.error.startswith("not priced")]
    assert [c.pp for c in cut_off] == [4]
    assert all(c.step_time > every[0].step_time for c in every if c.pp == 4 and not c.error)
    priced = {(c.pp, c.schedule, c.v): c.step_time for c in bounded.candidates if not c.error}
    assert priced and all(
        priced[(c.pp, c.schedule, c.v)] == c.step_time for c in every if (c.pp, c.schedule, c.v) in priced
    )


def test_the_fast_path_picks_the_exhaustive_rankings_plan() -> None:
    """Issue 29 item 4: on a space small enough to rank exhaustively (16 ranks: 8 tensor meshes,
    pipeline depths 2 and 4 with their sub-meshes), the default choice (the screen searches the
    best 4 meshes of each choice, depths bounded by their ideal cut, stage graphs analysed once
    per sub-mesh size) picks the plan of searching every mesh and pricing every depth.

    The exhaustive ranking is the fast path's depth rows beside a tensor-only choice searching
    every mesh (`depths=[]`, `searched_candidates=0`), not a second call pricing every depth: here
    the bound cuts off no depth (asserted) and each depth's stage sub-mesh choice (8 and 4 ranks:
    4 and 2 meshes, asserted) searches every mesh under the default of 4 as under 0, so that call
    ran the very same depth pricing again (55.3 against 46.7 CPU s for the exhaustive side, side by
    side under load: the 16-rank tensor-only searches are most of it). Where the fast path can go
    wrong is the same: the 4 of the 8 tensor meshes its screen leaves unsearched, and whether the
    bound would cut off a depth (the next test holds a depth it does cut off to pricing every one)."""
    from autopar.compiler.pipeline_mesh import choose_pipeline_mesh

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128))
    idx = torch.zeros(16, 64, dtype=torch.long)
    fast = choose_pipeline_mesh(model, 16, (idx, idx), microbatches=2, hardware=HW)
    searched = choose_pipeline_mesh(
        model, 16, (idx, idx), microbatches=2, hardware=HW, depths=[], searched_candidates=0
    )
    assert {c.pp for c in fast.candidates if not c.error} == {1, 2, 4}, fast.table()
    assert not [c for c in fast.candidates if c.error.startswith("not priced")], fast.table()
    assert [len(mesh_candidates(16 // pp)) for pp in (2, 4)] == [4, 2]  # each searched in full by default
    assert [c.pp for c in searched.candidates] == [1]
    ranked = [*searched.candidates, *(c for c in fast.candidates if c.pp > 1)]
    every = min(ranked, key=lambda c: (bool(c.error), not c.fits, c.step_time))
    chosen = fast.chosen
    assert not chosen.error and chosen.fits
    assert (chosen.pp, chosen.mesh_shape, chosen.schedule, chosen.v) == (
        every.pp,
        every.mesh_shape,
        every.schedule,
        every.v,
    )
    assert chosen.step_time == every.step_time and chosen.memory == every.memory
    # the fast path did skip work: meshes left unsearched by the screen
    assert fast.tensor_only is not None and searched.tensor_only is not None
    assert not all(c.searched for c in fast.tensor_only.candidates)
    assert all(c.searched for c in searched.tensor_only.candidates)
    assert len(searched.tensor_only.candidates) == 8
