"""The search falls back to other axis roles when the default ones cannot split the model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.fx as fx
from pass_fixtures import assert_matches_serial, gpt_case, run_programs

import autopar
from autopar.passes.emit import emit
from autopar.passes.insert_comm import insert_comm
from autopar.passes.propagate import propagate
from autopar.passes.schedule import schedule
from autopar.passes.trace import trace
from autopar.planning.greedy import choose_layouts, greedy_plan
from autopar.planning.search import role_assignments, search_layouts
from autopar.rules.registry import default_registry
from autopar.testing import all_coords
from examples.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=8, n_embd=256)


@pytest.fixture(scope="module")
def gm() -> fx.GraphModule:
    with torch.device("meta"):
        model = GPT(CFG)
    idx = torch.zeros(8, 64, dtype=torch.long)  # batch 8
    return trace(model, (idx, idx), decompose=True)


def test_token_axis_larger_than_the_batch_uses_other_roles(gm: fx.GraphModule) -> None:
    mesh = autopar.Mesh.from_shape((2, 2, 16))  # default roles: z (16 ranks) splits the batch of 8
    with pytest.raises(autopar.ShardingError, match="batch dim of input 0"):
        choose_layouts(gm, mesh, default_registry())
    plan = search_layouts(gm, mesh, default_registry())
    report = gm.meta["autopar_search"]
    assert plan.roles[2] == "tensor"  # z had to become a tensor axis
    assert "tensor/tensor/token" in report.failed_roles
    assert "batch dim of input 0 (8" in report.failed_roles["tensor/tensor/token"]
    # every assignment with a token axis of 16 or more ranks fails; the others were all planned
    tried = {"/".join(r) for r in role_assignments(mesh)}
    seeds = {name.removeprefix("replicated:") for name in report.seeds}  # (each seed stored both ways)
    # (three unequal axes: the 3-D grid seeds too, their tokens on x or y, which divide the batch)
    grids = {name for name in seeds if name.startswith("fixed:3-D grid")}
    assert grids and all("z=16: T" not in name for name in grids)
    assert set(report.failed_roles) | (seeds - grids) == tried
    assert set(report.failed_roles) == {
        "tensor/tensor/token",
        "tensor/token/token",
        "token/tensor/token",
        "token/token/token",
    }
    assert report.seeds and min(report.seeds.values()) == report.seed_cost


def test_no_role_assignment_works_raises_the_furthest_error(gm: fx.GraphModule) -> None:
    mesh = autopar.Mesh.from_shape((1, 1, 512))  # batch 8 and 64 positions: no role can split 512 ways
    with pytest.raises(autopar.ShardingError) as caught:
        search_layouts(gm, mesh, default_registry())
    error = caught.value
    # the error of the attempt past the batch check (z as a tensor axis), naming the tried roles
    assert error.op != "input" and "512" in error.message
    assert "every assignment of axis roles failed (tensor/tensor/token, tensor/tensor/tensor)" in (
        error.hint or ""
    )


def test_an_all_token_plan_computes_the_serial_model() -> None:
    """The all-token roles the search now tries (every axis splits the batch; weights stored split
    on every axis and gathered where used, ZeRO-3-like), through every stage for every rank of
    (2, 2, 2), in lockstep: the loss and every gradient equal the serial model's."""
    model, inputs = gpt_case()
    shape = (2, 2, 2)
    mesh = autopar.Mesh.from_shape(shape)
    registry = default_registry()
    gm = trace(model, inputs, decompose=True)
    plan = greedy_plan(gm, mesh, registry, roles=("token", "token", "token"))
    gm = propagate(gm, plan, mesh.shape)
    programs = {}
    for c in all_coords(shape):
        lowered = schedule(insert_comm(copy.deepcopy(gm), mesh, c), mesh)
        programs[c] = emit(lowered, mesh, registry, c)
    first = programs[(0, 0, 0)]
    # every weight matrix is stored split on all three axes (1/8 of it per rank)
    assert all(
        len(lay.shape) < 2 or lay.local_numel(shape) * 8 == math.prod(lay.shape)
        for lay in first.param_layouts
    )
    fwd, bwd = run_programs(programs, model, inputs, shape)
    tol = (1e-5, 1e-5)
    assert_matches_serial(first, fwd, bwd, model, inputs, shape, loss_tol=tol, grad_tol=tol, replica_tol=tol)
