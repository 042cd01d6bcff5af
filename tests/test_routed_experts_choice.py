"""`PlanOptions.token_dispatch` in the mesh choice (`mesh_shape="auto"`) and in the pipeline depth
choice: every candidate mesh, and every depth's stage sub-mesh, is screened and searched with the
dispatchers asked for, so the mesh chosen is priced with the dispatcher its plan runs.

The toy Mixtral of `test_expert_parallel` (8 experts, top 2, batch 2 x 16) on the H100 table, in
process (`autopar.plan` allocates no weights)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from test_expert_parallel import _batch, _mixtral
from test_routed_experts import experts_placed

import autopar
from autopar import PlanOptions
from autopar.compiler.pipeline_mesh import PipelineMeshChoice, choose_pipeline_mesh
from autopar.core.meta import info
from autopar.rules import routed_experts

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _plan(token_dispatch: str) -> autopar.PlanResult:
    torch.manual_seed(0)
    return autopar.plan(
        _mixtral(), "auto", (), example_kwargs=_batch(1, False), world_size=4,
        planning=PlanOptions(token_dispatch=token_dispatch),
    )  # fmt: skip


def test_the_mesh_choice_plans_every_mesh_with_the_dispatcher_asked_for() -> None:
    """The chosen mesh's plan (the choice's own search, compiled as it was searched) is a plan of
    the routed-experts ops: "alltoall" keeps every layer's experts whole or exchanges its tokens
    inside the op where they are split (on this latency-bound toy shape the choice keeps them
    whole), and the ops are priced in the choice itself: its chosen step is the routed plan's,
    below the traced ops' plan under "allgather"; "auto": the chosen plan's experts line prices
    both dispatchers from the choice's search on that mesh."""
    gathered, exchanged, auto = _plan("allgather"), _plan("alltoall"), _plan("auto")
    assert not [n for n in gathered.compiled.graph.graph.nodes if n.target in routed_experts.ROUTED_OPS]
    for result in (exchanged, auto):
        nodes = [n for n in result.compiled.graph.graph.nodes if n.target in routed_experts.ROUTED_OPS]
        assert len(nodes) == 4, "two MoE layers, one forward and one backward op each"
    for node in nodes_of(exchanged):
        strategy = info(node).strategy
        assert strategy is not None
        split = routed_experts.expert_axes(node.target, strategy)
        assert not split or routed_experts.all_to_all_axis(node.target, strategy) in split, node.name
    assert exchanged.mesh_choice is not None and gathered.mesh_choice is not None
    assert exchanged.mesh_choice.chosen.rank_time < gathered.mesh_choice.chosen.rank_time, (
        exchanged.mesh_choice.table(), gathered.mesh_choice.table(),
    )  # fmt: skip
    line = auto.compiled.report.experts
    assert line is not None and set(dict(line.dispatcher_costs)) == {"all-to-all", "all-gather"}, line


def nodes_of(result: autopar.PlanResult) -> list:  # type: ignore[type-arg]
    return [n for n in result.compiled.graph.graph.nodes if n.target in routed_experts.ROUTED_OPS]


@pytest.fixture(scope="module")
def depth_two() -> dict[str, PipelineMeshChoice]:
    """Depth 2 of 4 ranks, every schedule, the stage sub-mesh left to the choice, priced with each
    dispatcher; read by the next two tests (the all-gather one is also the free choice that a
    given stage layout is priced against)."""
    choices = {}
    for token_dispatch in ("allgather", "alltoall"):
        torch.manual_seed(0)
        choices[token_dispatch] = choose_pipeline_mesh(
            _mixtral(), 4, (), example_kwargs=_batch(1, False), microbatches=2, depths=[2],
            recompute="none", bound_depths=False, token_dispatch=token_dispatch, with_tensor_only=False,
        )  # fmt: skip
    return choices


def test_pipeline_depths_price_their_stage_meshes_with_the_dispatcher_asked_for(
    depth_two: dict[str, PipelineMeshChoice],
) -> None:
    """Depth 2 of 4 ranks: each stage sub-mesh (2 ranks) is the mesh choice with the dispatcher
    asked for. Forced to the all-to-all, its plan is modeled differently from the all-gather one
    (each rank's stage mesh exchanging the routed rows): the depth's priced step changes with it,
    while the ideal cut (no sub-mesh plan) does not. The tensor-only candidate, which this test
    does not read, is left out (`with_tensor_only=False`: its mesh choice on 4 ranks was about
    half of the test's CPU time; `test_the_mesh_choice_plans_every_mesh_with_the_dispatcher_asked_for`
    checks the tensor-only choice with each dispatcher)."""
    rows = {
        token_dispatch: {c.schedule: c for c in choice.candidates if c.pp == 2 and not c.error}
        for token_dispatch, choice in depth_two.items()
    }
    assert rows["allgather"].keys() == rows["alltoall"].keys() and "1f1b" in rows["alltoall"]
    for schedule, exchanged in rows["alltoall"].items():
        gathered = rows["allgather"][schedule]
        assert exchanged.stage_shape == gathered.stage_shape == (2,)
        assert exchanged.factor != pytest.approx(gathered.factor, rel=1e-3), schedule


def test_pipeline_choice_prices_a_given_layout_when_its_space_is_restricted(
    depth_two: dict[str, PipelineMeshChoice],
) -> None:
    """A published pipelined job priced by the same accounting as the choice
    (`benchmarks/moe_pipelined.py`): one depth, one stage sub-mesh with its axis names, one
    schedule, no tensor-only candidate. The only candidate is that layout, priced as the choice
    prices the same depth, stage shape and schedule when the sub-mesh is left to it (the 1F1B row
    of `depth_two`'s all-gather choice, which prices every schedule of that depth)."""
    kwargs = {"example_kwargs": _batch(1, False), "microbatches": 2, "recompute": "none", "bound_depths": False}
    restricted = {"depths": [2], "schedules": [("1f1b", 1)], "with_tensor_only": False}
    torch.manual_seed(0)
    given = choose_pipeline_mesh(_mixtral(), 4, (), stage_meshes=[((2,), ("ep",))], **restricted, **kwargs)
    assert given.tensor_only is None and len(given.candidates) == 1, given.table()
    only = given.chosen
    assert (only.pp, only.schedule, only.v, only.mesh_names, only.mesh_shape) == (2, "1f1b", 1, ("pp", "ep"), (2, 2))
    assert only.fits and math.isfinite(only.step_time) and not only.error
    free = depth_two["allgather"]
    same = [c for c in free.candidates if (c.pp, c.schedule, c.v) == (2, "1f1b", 1)]
    assert [c.mesh_names for c in same] == [("pp", "x")], free.table()
    assert same[0].step_time == pytest.approx(only.step_time, rel=1e-9)


@pytest.mark.parametrize(("axes", "recorded", "shown"), [((0,), ("ep",), "ep (EP 2)"), ((), (), "whole")])
def test_pipeline_choice_rows_say_which_axes_hold_the_experts(
    axes: tuple[int, ...], recorded: tuple[str, ...], shown: str
) -> None:
    """Issue 35: each priced row of the pipeline depth choice records the stage sub-mesh axes its
    plan splits the experts over (`PipelineCandidate.experts`, from the sub-mesh choice's own
    search), and the table prints them in its last column: the experts held over "ep" read
    "ep (EP 2)", kept whole on every rank "whole". (The placement is the registry's own
    requirement, kept beside the one token_dispatch="alltoall" adds: `rules.base.both`.)"""
    kwargs = {"example_kwargs": _batch(1, False), "microbatches": 2, "recompute": "none", "bound_depths": False}
    torch.manual_seed(0)
    choice = choose_pipeline_mesh(
        _mixtral(), 4, (), stage_meshes=[((2,), ("ep",))], depths=[2], schedules=[("1f1b", 1)],
        with_tensor_only=False, registry=experts_placed(axes), token_dispatch="alltoall", **kwargs,
    )  # fmt: skip
    row = choice.chosen
    assert not row.error and row.experts == recorded, choice.table()
    header, line = choice.table().splitlines()[1:3]
    assert header.endswith("experts on") and line.endswith(f"  {shown}"), choice.table()
