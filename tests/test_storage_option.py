"""`PlanOptions(storage=...)`: the user's way to force how the search stores weights.

"auto" (the default) prices sharded and replicated storage on a hardware table where replicated
weights fit and keeps the cheaper; "sharded" and "replicated" force one. The model here is small
enough that "auto" on the cpu-gloo table replicates it (tests/test_replicated_storage.py): forced
"sharded", every rank holds ~1/p of the weights and the step still equals serial's in lockstep;
forced "replicated" on element counts (where "auto" shards) gives the replicated plan. An unknown
value, a forced storage with the greedy planner, and "replicated" weights over the memory limit
are errors that say what to do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
from pass_fixtures import _compare_with_serial, lockstep_step

import autopar
from autopar.compiler.driver import Compiled, compile_for_rank, trace_for
from autopar.core.errors import AutoparError, UsageError
from autopar.planning.search import ElementCost, replicated_fits, search_layouts, weight_state_bytes
from autopar.planning.storage import REPLICATED, SHARDED
from autopar.rules.registry import default_registry
from autopar.testing import all_coords
from examples.models import make_gpt

SHAPE = (4,)
MODEL = {"n_embd": 64, "n_layer": 2, "n_head": 4, "block_size": 16, "vocab_size": 64}


def _case() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return make_gpt(0, 8, **MODEL)


def _every_rank(
    model: torch.nn.Module, batch: tuple[torch.Tensor, ...], storage: str, chosen: list[Any]
) -> dict[Any, Compiled]:
    """Every rank's program on SHAPE priced on the cpu-gloo table (as `parallelize` plans with
    `PlanOptions(hardware="cpu-gloo")`), the plan searched once and kept in `chosen`."""
    mesh = autopar.Mesh.from_shape(SHAPE)
    traced = trace_for(model, mesh, batch, None, "search", None)

    def plan_once(gm: fx.GraphModule, make_plan: Callable[[], Any]) -> Any:
        if not chosen:
            chosen.append(make_plan())
        return chosen[0]

    return {
        c: compile_for_rank(
            model, mesh, batch, coords=c, agree=plan_once, traced=traced, hardware="cpu-gloo", storage=storage
        )
        for c in all_coords(SHAPE)
    }


def test_forced_sharded_holds_a_pth_of_the_weights_and_trains_as_serial() -> None:
    model, batch = _case()
    auto: list[Any] = []
    _every_rank(model, batch, "auto", auto)
    assert auto[0].storage == REPLICATED, "the case must be one that auto replicates"
    chosen: list[Any] = []
    compiled = _every_rank(model, batch, SHARDED, chosen)
    assert chosen[0].storage == SHARDED
    first = next(iter(compiled.values()))
    report = first.report
    assert report.param_bytes_local * SHAPE[0] < 1.1 * report.param_bytes_total, str(report)
    assert report.storage == SHARDED and "replicated storage" not in str(report)
    fwd, bwd = lockstep_step(compiled, model, SHAPE, batch, {})
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    _compare_with_serial(model, first.program, fwd, bwd, [loss.detach()], SHAPE, 2e-5, 1e-4)


def test_forced_replicated_through_plan_options() -> None:
    """On a CPU mesh without a table the plan is priced in element counts, where "auto" shards:
    `PlanOptions(storage="replicated")` gives the replicated plan. Its weights are stored as they
    compute (here some tensor-split, the rest whole): each rank holds well over the ~1/p of the
    sharded plan above."""
    model, batch = _case()
    result = autopar.plan(
        model, SHAPE, batch, device_type="cpu", planning=autopar.PlanOptions(storage="replicated")
    )
    report = result.compiled.report
    assert result.compiled.graph.meta["autopar_search"].storage == REPLICATED
    assert report.param_bytes_local * SHAPE[0] > 1.5 * report.param_bytes_total, str(report)
    # the summary says why the weights are whole on some axis: the storage chosen, not their size
    assert "replicated storage, DDP's pattern" in str(report) and "too small to split" not in str(report)


def test_unknown_storage_names_the_choices() -> None:
    with pytest.raises(UsageError) as err:
        autopar.PlanOptions(storage="mirrored")  # type: ignore[arg-type]
    assert "'sharded'" in str(err.value) and "'replicated'" in str(err.value)


def test_forced_storage_needs_the_search_planner() -> None:
    with pytest.raises(UsageError, match='planner="search"'):
        autopar.PlanOptions(storage=SHARDED, planner="greedy")


def test_replicated_over_the_memory_limit_says_what_to_do() -> None:
    model, batch = _case()
    mesh = autopar.Mesh.from_shape(SHAPE)
    gm = trace_for(model, mesh, batch, None, "search", None)
    whole = weight_state_bytes(gm)
    assert not replicated_fits(gm, whole * 0.99) and math.isfinite(whole)
    with pytest.raises(AutoparError) as err:
        search_layouts(
            gm,
            mesh,
            default_registry(),
            cost=ElementCost(SHAPE),
            memory_limit=whole * 0.99,
            storage=REPLICATED,
        )
    assert "replicated" in str(err.value) and "sharded" in str(err.value)
