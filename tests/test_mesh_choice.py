"""Automatic mesh choice: every factorization of the world size planned, priced and ranked."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
from multirank import run_ranks
from torch.distributed.tensor import DTensor

import autopar
from autopar.compiler.auto_mesh import choose_mesh
from autopar.compiler.lowering import prefer_scheduled, scheduled_step_time
from autopar.passes.trace import trace
from autopar.planning.fixed import SCHEMES, plan_fixed
from autopar.planning.mesh_choice import OVERLAP_CANDIDATES, MeshChoice, mesh_candidates
from autopar.planning.search import TimeCost, plan_cost_parts, search_layouts
from autopar.rules.registry import default_registry
from examples.models import GPT, GPTConfig, make_gpt

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=8, n_embd=256)
HW = "h100-nvlink-ib"


@pytest.fixture(scope="module")
def model_and_batch() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    with torch.device("meta"):
        model = GPT(CFG)
    g = torch.Generator().manual_seed(0)
    return model, (torch.randint(0, 256, (8, 64), generator=g), torch.randint(0, 256, (8, 64), generator=g))


@pytest.fixture(scope="module")
def choice(model_and_batch: tuple[GPT, tuple[torch.Tensor, torch.Tensor]]) -> MeshChoice:
    model, batch = model_and_batch
    return choose_mesh(model, 8, batch, hardware=HW)


def test_candidates_are_the_ordered_factorizations() -> None:
    assert mesh_candidates(8) == [
        ((8,), ("x",)),
        ((2, 4), ("x", "y")),
        ((4, 2), ("x", "y")),
        ((2, 2, 2), ("x", "y", "z")),
    ]
    assert mesh_candidates(1) == [((1,), ("x",))]
    assert mesh_candidates(6) == [((6,), ("x",)), ((2, 3), ("x", "y")), ((3, 2), ("x", "y"))]
    sixteen = mesh_candidates(16)
    assert ((2, 2, 2, 2), ("dp", "x", "y", "z")) in sixteen and len(sixteen) == 8  # compositions of 4
    assert len(mesh_candidates(64)) == 26 and len(mesh_candidates(512)) == 93  # of 6 and 9, <= 4 parts
    assert all(math.prod(shape) == 512 and min(shape) > 1 for shape, _ in mesh_candidates(512))


def test_every_candidate_is_planned_and_the_fastest_wins(choice: MeshChoice) -> None:
    assert sorted(c.shape for c in choice.candidates) == sorted(s for s, _ in mesh_candidates(8))
    assert all(c.fits and c.error == "" for c in choice.candidates)
    # those modeled with overlap come first, by scheduled step; the rest by the no-overlap sum, and
    # each of those was ruled out by its compute alone (or the cap on candidates modeled)
    modeled = [c for c in choice.candidates if math.isfinite(c.scheduled_time)]
    rest = choice.candidates[len(modeled) :]
    assert modeled and choice.candidates[: len(modeled)] == modeled
    assert [c.scheduled_time for c in modeled] == sorted(c.scheduled_time for c in modeled)
    assert [c.step_time for c in rest] == sorted(c.step_time for c in rest)
    best = modeled[0].scheduled_time
    assert len(modeled) == OVERLAP_CANDIDATES or all(c.compute_time >= best for c in rest)
    assert all(c.compute_time <= c.scheduled_time for c in modeled)  # the bound the walk relies on
    assert choice.chosen.rank_time == min(c.rank_time for c in modeled)
    assert all(c.memory <= choice.memory_limit for c in choice.candidates)
    assert choice.memory_limit == pytest.approx(0.9 * 80e9)
    table = choice.table()
    assert table.splitlines()[2].split()[:2] == ["1", "x".join(map(str, choice.chosen.shape))]
    assert len(table.splitlines()) == 2 + len(choice.candidates)
    assert str(choice) == table, "print(pmodel.mesh_choice) shows the table"


def test_candidate_numbers_are_the_search_plans_modeled_time(
    model_and_batch: tuple[GPT, tuple[torch.Tensor, torch.Tensor]], choice: MeshChoice
) -> None:
    model, batch = model_and_batch
    gm = trace(model, batch, decompose=True, split_fused=True)  # as the search plans it
    for candidate in (choice.chosen, choice.candidates[-1]):
        mesh = autopar.Mesh.from_shape(candidate.shape, candidate.names)
        cost = TimeCost(HW, mesh.shape)
        plan = search_layouts(gm, mesh, default_registry(), cost=cost)
        if math.isfinite(candidate.scheduled_time):  # the schedule stage may keep the search's start
            plan = prefer_scheduled(gm, plan, mesh, default_registry(), HW)
        comm, compute = plan_cost_parts(gm, plan, mesh, cost, once=True)
        assert candidate.comm_time == pytest.approx(comm) and candidate.compute_time == pytest.approx(compute)
        every_edge, _ = plan_cost_parts(gm, plan, mesh, cost)  # the search's objective
        assert comm <= every_edge
        assert plan.memory is not None and candidate.memory == pytest.approx(plan.memory.total)
        assert candidate.roles == plan.roles
        if math.isfinite(candidate.scheduled_time):  # the program compile_for_rank would run
            assert candidate.scheduled_time == pytest.approx(
                scheduled_step_time(gm, plan, mesh, default_registry(), HW)
            )


def test_chosen_mesh_is_never_slower_than_a_fixed_scheme(
    model_and_batch: tuple[GPT, tuple[torch.Tensor, torch.Tensor]], choice: MeshChoice
) -> None:
    # each fixed scheme's best plan (1-D on (8,), 2-D on its grid, cube on (2, 2, 2)) lies on a
    # candidate mesh and seeds the search there: the choice is modeled no slower than any of them
    # (candidates count each redistribution once, which is at most the search's every-edge sum)
    model, batch = model_and_batch
    gm = trace(model, batch, decompose=True, split_fused=True)  # as the search plans it
    by_shape = {c.shape: c for c in choice.candidates}
    for key in SCHEMES:
        fixed = plan_fixed(gm, key, 8, default_registry(), HW, require_heads=False)
        assert fixed.plan is not None and fixed.scheme is not None, fixed.infeasible
        shape = fixed.scheme.mesh_shape
        mesh = autopar.Mesh.from_shape(shape)
        comm, compute = plan_cost_parts(gm, fixed.plan, mesh, TimeCost(HW, shape))
        assert by_shape[shape].step_time <= (comm + compute) * (1 + 1e-9), key
        assert choice.chosen.step_time <= (comm + compute) * (1 + 1e-9), key


def test_the_mesh_that_hides_its_communication_wins_over_the_smaller_sum() -> None:
    """At 8 ranks on H100 (one node), the GPT layer of the benchmarks (h = 4096, s = 2048, b = 8):
    tensor-parallel 2x4 sends the least, but its activation collectives sit on the critical path;
    all-token (8,) gathers weights, which the schedule prefetches behind compute. The sum ranks 2x4
    first, the scheduled step ranks (8,) first, and the choice follows the scheduled step."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, block_size=2048, n_layer=1, n_head=32, n_embd=4096))
    idx = torch.zeros(8, 2048, dtype=torch.long)
    choice = choose_mesh(model, 8, (idx, idx), hardware=HW, candidates=[((2, 4), ("x", "y")), ((8,), ("x",))])
    tp, zero = sorted(choice.candidates, key=lambda c: len(c.shape), reverse=True)
    assert tp.roles == ("tensor", "token") and zero.roles == ("token",)
    assert tp.step_time < zero.step_time and tp.comm_time < zero.comm_time
    assert zero.scheduled_time < tp.scheduled_time
    assert choice.chosen is zero
    summed = choose_mesh(
        model,
        8,
        (idx, idx),
        hardware=HW,
        candidates=[((2, 4), ("x", "y")), ((8,), ("x",))],
        overlap_candidates=0,
    )
    assert summed.chosen.shape == (2, 4) and not math.isfinite(summed.chosen.scheduled_time)


def test_choice_is_deterministic(
    model_and_batch: tuple[GPT, tuple[torch.Tensor, torch.Tensor]], choice: MeshChoice
) -> None:
    model, batch = model_and_batch
    again = choose_mesh(model, 8, batch, hardware=HW)
    assert again.candidates == choice.candidates


def test_a_limit_no_mesh_fits_raises_with_the_table(
    model_and_batch: tuple[GPT, tuple[torch.Tensor, torch.Tensor]], choice: MeshChoice
) -> None:
    model, batch = model_and_batch
    # (a candidate whose plan stores its weights replicated could store 1/8 of them instead)
    limit = 0.3 * min(c.memory / (8 if c.storage == "replicated" else 1) for c in choice.candidates)
    with pytest.raises(autopar.MemoryLimitError) as caught:
        choose_mesh(
            model,
            8,
            batch,
            hardware=HW,
            memory_limit=limit,
            candidates=[((8,), ("x",)), ((2, 4), ("x", "y"))],
        )
    assert caught.value.limit == limit and caught.value.memory > limit
    assert "does not fit in memory" in str(caught.value) and "mesh choice for 8 ranks" in str(caught.value)


def test_plan_auto_compiles_the_chosen_mesh(
    model_and_batch: tuple[GPT, tuple[torch.Tensor, torch.Tensor]], choice: MeshChoice
) -> None:
    model, batch = model_and_batch
    # under warnings as errors (a user's pytest -W error): torch 2.13's GraphModule deepcopy warns
    # about its own LeafSpec, and the choice prices copies of the traced graph
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        result = autopar.plan(model, "auto", batch, world_size=8, planning=autopar.PlanOptions(hardware=HW))
    assert result.mesh_choice is not None and result.mesh_choice.candidates == choice.candidates
    assert result.mesh.shape == choice.chosen.shape and result.mesh.axis_names == choice.chosen.names
    assert "mesh choice for 8 ranks" in str(result)
    with pytest.raises(autopar.AutoparError):
        autopar.plan(model, "auto", batch)  # no world size


def _auto_job(rank: int, world_size: int) -> dict[str, Any]:
    model, batch = make_gpt(0)
    serial = copy.deepcopy(model)
    pmodel = autopar.parallelize(model, world_size, example_inputs=batch, mesh_shape="auto")
    loss, serial_loss = pmodel(*batch), serial(*batch)
    loss.backward()
    serial_loss.backward()
    serial_params = dict(serial.named_parameters())
    grad_err = max(
        float(((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - serial_params[n].grad).abs().max())
        for n, p in pmodel.named_parameters()
    )
    chosen = pmodel.mesh_choice.chosen
    return {
        "shape": chosen.shape,
        "names": chosen.names,
        "hardware": pmodel.mesh_choice.hardware,
        "loss": (float(loss), float(serial_loss)),
        "grad_err": grad_err,
    }


@pytest.mark.multirank
def test_parallelize_auto_mesh_agrees_on_every_rank() -> None:
    """The runtime path of `mesh_shape="auto"` (the mesh built from the world size, every rank
    agreeing on the choice) on 4 gloo ranks; the choice among 8's factorizations is priced in
    process above."""
    results = run_ranks(4, _auto_job, timeout=600)
    assert len({(r["shape"], r["names"]) for r in results}) == 1
    assert math.prod(results[0]["shape"]) == 4 and results[0]["hardware"] == "cpu-gloo"
    for r in results:
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-5) and r["grad_err"] < 1e-4, r


def test_the_schedule_stage_keeps_the_searchs_start_where_it_runs_faster() -> None:
    """On `cpu-gloo` a collective costs its rank ~1 ms of its own time, so bucketing, which the
    search's per-edge objective cannot see, decides: on one axis, with weights sharded, the
    all-token start (FSDP's pattern: weights gathered and gradients reduce-scattered in a few
    buckets) schedules faster than the plan the chain moves found from it, and `prefer_scheduled`
    keeps it. With replicated storage in the plan space (the weights fit), the all-token plan stored
    replicated (DDP's pattern: nothing gathered, gradients all-reduced in buckets during backward)
    schedules faster still, and the mesh choice and `plan` run it."""
    model, batch = make_gpt(0, 8, n_layer=2, n_head=8, n_embd=128, block_size=32, vocab_size=256)
    gm = trace(model, batch, decompose=True, split_fused=True)
    mesh = autopar.Mesh.from_shape((8,))
    cost = TimeCost("cpu-gloo", mesh.shape)
    searched = search_layouts(gm, mesh, default_registry(), cost=cost, storage="sharded")
    assert searched.start is not None and searched.start.roles == ("token",)
    times = [scheduled_step_time(gm, p, mesh, default_registry(), "cpu-gloo") for p in (searched, searched.start)]
    kept = prefer_scheduled(gm, searched, mesh, default_registry(), "cpu-gloo")
    assert times[1] < times[0] and kept.strategies == searched.start.strategies
    assert "kept its start" in kept.notes["__search__"]
    both = prefer_scheduled(gm, search_layouts(gm, mesh, default_registry(), cost=cost), mesh, default_registry(), "cpu-gloo")
    assert both.storage == "replicated" and both.roles == ("token",)
    fastest = scheduled_step_time(gm, both, mesh, default_registry(), "cpu-gloo")
    assert fastest < times[1]
    choice = choose_mesh(model, 8, batch, hardware="cpu-gloo", keep_plan=True)
    assert choice.chosen.shape == (8,) and choice.chosen.storage == "replicated"
    assert choice.chosen.scheduled_time == pytest.approx(fastest)
    assert choice.chosen_plan is not None and choice.chosen_plan.plan.strategies == both.strategies
    planned = autopar.plan(model, (8,), batch, planning=autopar.PlanOptions(hardware="cpu-gloo"))
    assert planned.compiled.timelines is not None
    assert planned.compiled.timelines[1].step_time == pytest.approx(fastest)
