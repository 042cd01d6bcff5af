"""The mesh choice's scheduled copy of the chosen plan (`compiler.lowering.ScheduledCopy`): the
compile of that plan takes it instead of scheduling the lowered graph again, and emits the very
program it emits when it schedules the graph itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx

import autopar
import autopar.compiler.decompose_choice as decompose_choice
import autopar.compiler.driver as driver
from autopar.compiler.auto_mesh import choose_mesh
from autopar.compiler.driver import Compiled, compile_for_rank
from autopar.compiler.lowering import ScheduledCopy, scheduled_copy, scheduled_step_time
from autopar.core.graph_copy import graph_copy
from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.planning.mesh_choice import ChosenPlan
from autopar.rules.registry import default_registry
from examples.models import GPT, GPTConfig

HW = "h100-nvlink-ib"
CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=8, n_embd=256)


@pytest.fixture(scope="module")
def model_and_batch() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    with torch.device("meta"):
        model = GPT(CFG)
    g = torch.Generator().manual_seed(0)
    return model, (torch.randint(0, 256, (8, 64), generator=g), torch.randint(0, 256, (8, 64), generator=g))


# a few candidates: a tensor mesh (collective-matmul pairs), a token mesh, a mixed one
CANDIDATES = [((8,), ("x",)), ((2, 4), ("x", "y")), ((4, 2), ("x", "y"))]


@pytest.fixture(scope="module")
def choice(model_and_batch: tuple[GPT, Any]) -> tuple[ChosenPlan, Mesh, fx.GraphModule]:
    model, batch = model_and_batch
    found = choose_mesh(model, 8, batch, hardware=HW, keep_plan=True, candidates=CANDIDATES)
    kept = found.chosen_plan
    assert kept is not None and kept.scheduled is not None and kept.scheduled.graph is not None
    return kept, Mesh.from_shape(found.chosen.shape, found.chosen.names), graph_copy(kept.scheduled.graph)


def _chosen(choice: tuple[ChosenPlan, Mesh, fx.GraphModule]) -> tuple[ChosenPlan, Mesh]:
    """The choice's kept plan with a fresh copy of its scheduled graph (a compile takes it)."""
    kept, mesh, pristine = choice
    assert kept.scheduled is not None
    kept.scheduled = dataclasses.replace(kept.scheduled, graph=graph_copy(pristine))
    return kept, mesh


def _compile(
    model: GPT, batch: Any, kept: ChosenPlan, mesh: Mesh, scheduled: ScheduledCopy | None, mode: str
) -> Compiled:
    def agree(gm: fx.GraphModule, make_plan: Callable[[], Plan]) -> Plan:
        gm.meta["autopar_search"] = kept.report
        return kept.plan  # (as `autopar.plan` hands the choice's plan)

    return compile_for_rank(
        model, mesh, batch, coords=(0,) * mesh.ndim, hardware=HW, table=HW, agree=agree, traced=kept.graph,
        scheduled=scheduled, decompose_matmuls=mode, priced=True,
    )  # fmt: skip


def _schedules(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the schedule stage's runs in the compile (the driver's and the decomposition's)."""
    calls: list[int] = []
    for module in (driver, decompose_choice):
        inner = module.schedule_pass

        def counted(*args: Any, _inner: Any = inner, **kwargs: Any) -> fx.GraphModule:
            calls.append(1)
            return _inner(*args, **kwargs)

        monkeypatch.setattr(module, "schedule_pass", counted)
    return calls


def _same_program(a: Compiled, b: Compiled) -> None:
    assert a.program.forward.code == b.program.forward.code
    assert a.program.backward.code == b.program.backward.code
    for f in ("param_names", "param_layouts", "input_layouts", "output_layouts", "num_saved"):
        assert getattr(a.program, f) == getattr(b.program, f), f
    assert [dataclasses.astuple(c) for c in a.report.collectives] == [dataclasses.astuple(c) for c in b.report.collectives]
    assert a.report.decomposed == b.report.decomposed and a.report.decomposed_steps == b.report.decomposed_steps
    assert a.timelines is not None and b.timelines is not None
    assert [t.step_time for t in a.timelines] == [t.step_time for t in b.timelines]
    assert a.working == b.working
    assert a.graph.meta.keys() == b.graph.meta.keys()


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_the_compile_takes_the_choices_copy_and_emits_the_same_program(
    model_and_batch: tuple[GPT, Any], choice: Any, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    model, batch = model_and_batch
    kept, mesh = _chosen(choice)
    copy = kept.scheduled
    assert copy is not None and copy.source is kept.plan and copy.mesh == mesh
    calls = _schedules(monkeypatch)
    itself = _compile(model, batch, kept, mesh, None, mode)
    scheduled_itself = len(calls)
    assert scheduled_itself >= 1
    taken = _compile(model, batch, kept, mesh, copy, mode)
    # one schedule fewer: the whole graph's ("auto" may still schedule the pairs it decomposes)
    assert len(calls) - scheduled_itself == scheduled_itself - 1
    assert copy.graph is None  # handed once
    _same_program(itself, taken)


def test_the_choices_step_is_the_copys_timeline(choice: Any) -> None:
    kept, mesh = _chosen(choice)
    assert kept.scheduled is not None and kept.graph is not None
    step = scheduled_step_time(kept.graph, kept.plan, mesh, default_registry(), HW)
    assert kept.scheduled.timeline.step_time == step
    again = scheduled_copy(kept.graph, kept.plan, mesh, default_registry(), HW)
    assert again.timeline.step_time == step


def test_a_copy_made_for_other_conditions_is_not_taken(
    model_and_batch: tuple[GPT, Any], choice: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, batch = model_and_batch
    kept, mesh = _chosen(choice)
    copy = kept.scheduled
    assert copy is not None
    calls = _schedules(monkeypatch)
    itself = _compile(model, batch, kept, mesh, None, "off")
    assert len(calls) == 1
    for other in (
        dataclasses.replace(copy, source=dataclasses.replace(kept.plan)),  # an equal plan, not this one
        dataclasses.replace(copy, in_flight_bytes=copy.in_flight_bytes + 1),
        dataclasses.replace(copy, table="a100-cluster"),
    ):
        again = _compile(model, batch, kept, mesh, other, "off")
        assert other.graph is not None  # not taken: the compile scheduled its own graph
        _same_program(itself, again)
    assert len(calls) == 4


def test_plan_auto_compiles_from_the_copy(model_and_batch: tuple[GPT, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`autopar.plan(..., "auto")` hands the copy over: the program it prices is the one a compile
    that schedules the chosen plan itself emits."""
    model, batch = model_and_batch
    taken: list[ScheduledCopy] = []
    inner = ScheduledCopy.take

    def take(self: ScheduledCopy, lowered: fx.GraphModule) -> Any:
        taken.append(self)
        return inner(self, lowered)

    monkeypatch.setattr(ScheduledCopy, "take", take)
    result = autopar.plan(model, "auto", batch, world_size=8, planning=autopar.PlanOptions(hardware=HW))
    assert len(taken) == 1
    assert result.mesh_choice is not None
    assert taken[0].mesh.shape == result.mesh_choice.chosen.shape
    assert taken[0].timeline.step_time == result.mesh_choice.chosen.scheduled_time
    kept = result.mesh_choice.chosen_plan
    assert kept is not None and kept.scheduled is None  # (no scheduled graph kept in the result)
