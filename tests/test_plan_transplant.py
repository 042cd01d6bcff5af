"""The screen's first estimate (`plan_transplant`) and its two stages (`mesh_screen.screen`).

- A greedy plan's `PlanPattern` priced on the plan's own mesh is its `plan_cost`; priced on another
  mesh with as many axes it is the `plan_cost` of the same strategies with the parameters stored as
  that mesh's sizes store them, or None where those sizes do not admit the plan.
- With the two stages forced on by small constants on a space small enough to rank exhaustively
  (16 ranks, 8 meshes), `choose_mesh` at its defaults picks the plan of searching every mesh, on
  a GPT (a grouped-query LLaMA on h100-nvlink-ib passed too; left out for the suite's time). The
  constants in use (`REPRESENTATIVES` 4, `SECOND_STAGE` 16) leave the first stage to spaces of
  hundreds of meshes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from pass_fixtures import gpt_meta_graph

import autopar.planning.mesh_screen as mesh_screen
from autopar.compiler.auto_mesh import choose_mesh, trace_for_choice
from autopar.core.layout import Partial, Replicate
from autopar.core.mesh import Mesh
from autopar.core.meta import info, signature
from autopar.core.plan import Plan
from autopar.planning import search_seeds
from autopar.planning.greedy import SMALL_PARAM_FRACTION, greedy_plan
from autopar.planning.greedy_roles import axis_roles
from autopar.planning.mesh_choice import MeshChoice, mesh_candidates
from autopar.planning.plan_cost import GraphFacts, plan_cost
from autopar.planning.plan_transplant import PlanPattern
from autopar.planning.search_cost import TimeCost
from autopar.planning.search_steps import StepCache
from autopar.planning.storage import part_dims, part_storage, storage_layout
from autopar.rules.registry import default_registry
from examples.models import GPT, GPTConfig


def _moved(gm: torch.fx.GraphModule, plan: Plan, mesh: Mesh) -> Plan:
    """`plan` on `mesh`, written out node by node: the same strategies and values' layouts, each
    parameter stored as `mesh`'s sizes store the layout it computes with, and each parameter's
    gradient returned where the parameter is stored."""
    shape, dims = tuple(mesh.shape), part_dims(gm)
    layouts = dict(plan.layouts)
    for name, computes in plan.stored_from.items():
        dim = dims.get(name)
        layouts[name] = (storage_layout(computes, shape) if dim is None else part_storage(computes, dim, shape),)
    sig = signature(gm)
    params = {info(n).param_name: n.name for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "param"}
    outputs = list(plan.output_layouts)
    for i in range(sig.num_user_outputs, sig.num_param_grads_end):
        outputs[i] = layouts[params[sig.grad_of[i - sig.num_user_outputs]]][0]
    return Plan(strategies=plan.strategies, layouts=layouts, output_layouts=outputs, roles=plan.roles)


@pytest.mark.parametrize(("world", "hardware"), [(16, "h100-nvlink-ib")])
def test_a_pattern_prices_a_plan_on_any_mesh_with_as_many_axes(world: int, hardware: str) -> None:
    gm = gpt_meta_graph(128, 4, world, 64, n_layer=1)
    registry, facts, steps = default_registry(), GraphFacts.of(gm), StepCache()
    meshes = [Mesh.from_shape(s, n) for s, n in mesh_candidates(world)]
    priced = refused = 0
    for a in [m for m in meshes if m.ndim >= 3][:3]:
        plan = greedy_plan(gm, a, registry, roles=axis_roles(a))
        pattern = PlanPattern.of(gm, plan, registry, facts)
        assert pattern is not None
        own = TimeCost(hardware, a.shape, steps=steps)
        assert pattern.price(gm, a, own) == pytest.approx(plan_cost(gm, plan, a, own, facts), rel=1e-12)
        for b in (m for m in meshes if m.ndim == a.ndim and m is not a):
            cost = TimeCost(hardware, b.shape, steps=steps)
            found = pattern.price(gm, b, cost)
            moved = _moved(gm, plan, b)
            if found is None:
                refused += 1
                continue
            priced += 1
            assert found == pytest.approx(plan_cost(gm, moved, b, cost, facts), rel=1e-12)
            # every weight of 2 or more dims is stored split on every axis there, as the greedy pass asks
            total = sum(math.prod(moved.layouts[name][0].shape) for name in plan.stored_from)
            for name in plan.stored_from:
                layout = moved.layouts[name][0]
                if len(layout.shape) >= 2 and math.prod(layout.shape) > SMALL_PARAM_FRACTION * total:
                    assert not any(isinstance(p, (Replicate, Partial)) and g > 1 for p, g in zip(layout.placements, b.shape))
    assert priced > 0


def test_a_pattern_refuses_a_mesh_whose_sizes_do_not_admit_its_plan() -> None:
    """A plan splitting 4 heads 4 ways on one axis cannot be moved to a mesh whose axis there has
    8 ranks (32 rows of 8 tokens split 8 ways is fine; 4 heads are not)."""
    gm = gpt_meta_graph(64, 4, 8, 8, n_layer=1)
    registry, facts, steps = default_registry(), GraphFacts.of(gm), StepCache()
    a, b = Mesh.from_shape((4, 2, 2), ("x", "y", "z")), Mesh.from_shape((8, 2, 1), ("x", "y", "z"))
    plan = greedy_plan(gm, a, registry, roles=axis_roles(a))
    pattern = PlanPattern.of(gm, plan, registry, facts)
    assert pattern is not None
    assert pattern.price(gm, b, TimeCost("h100-nvlink-ib", b.shape, steps=steps)) is None
    assert pattern.price(gm, a, TimeCost("h100-nvlink-ib", a.shape, steps=steps)) is not None


def _chosen(choice: MeshChoice) -> tuple[tuple[int, ...], tuple[str, ...], float, float, float]:
    c = choice.chosen
    return c.shape, c.roles, c.step_time, c.scheduled_time, c.memory


@pytest.mark.parametrize(
    ("build", "hardware"),
    [
        (lambda: _gpt(256, 8, 16, 32), "a100-cluster"),
    ],
    ids=["gpt-a100"],
)
def test_the_two_stage_screen_picks_the_exhaustive_rankings_plan(
    build: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]], hardware: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 item 4: on 16 ranks (8 meshes, 3 of them with three axes and alike roles), with the
    two stages forced on by small constants (1 representative, 1 mesh estimated after the first
    stage), `choose_mesh` at its defaults picks the plan of searching every mesh
    (`searched_candidates=0`): the same mesh, roles, modeled sum, scheduled step and memory.

    The mesh chosen, (2, 2, 4), is not the best by first estimate: the (4, 2, 2) representative's
    plan priced on (2, 4, 2) is cheaper than on (2, 2, 4), whose own 3-D grid seed is cheaper
    still (mesh_screen's module doc). It is estimated in full because its first estimate is below
    the `keep`-th estimate found (a plan known there beats a mesh that would be searched)."""
    model, example = build()
    gm = trace_for_choice(model, 16, example)
    # the grid's orders seed with their linears alone: with attention and the residual stream forced
    # too (`search_seeds._grid_attention_seed`), (2, 2, 4) comes first by first estimate on a100 and
    # the path under test is not taken
    monkeypatch.setattr(search_seeds, "GRID_SCHEMES", ())
    exhaustive = choose_mesh(model, 16, example, hardware=hardware, traced=gm, searched_candidates=0)
    monkeypatch.setattr(mesh_screen, "REPRESENTATIVES", 1)
    monkeypatch.setattr(mesh_screen, "SECOND_STAGE", 1)
    screened: list[list[mesh_screen.Estimate]] = []
    two_stages = mesh_screen._two_stages

    def recorded(*args: Any, **kwargs: Any) -> tuple[list[int], list[mesh_screen.Estimate]]:
        order, estimates = two_stages(*args, **kwargs)
        screened.append(estimates)
        return order, estimates

    monkeypatch.setattr(mesh_screen, "_two_stages", recorded)
    fast = choose_mesh(model, 16, example, hardware=hardware, traced=gm)
    assert _chosen(fast) == _chosen(exhaustive)
    assert fast.chosen.fits and not fast.chosen.error
    assert all(c.searched for c in exhaustive.candidates) and len(exhaustive.candidates) == 8
    # the two stages ran: two three-axis meshes were first priced by the representative's plans;
    # the chosen one came second by that price and was estimated in full all the same
    (estimates,) = screened
    firsts = sorted((e.first, e.value) for e in estimates if not math.isnan(e.first))
    assert len(firsts) == 2 and firsts[1][1] == fast.chosen.estimate < firsts[0][1]


def _gpt(n_embd: int, n_head: int, batch: int, seq: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=seq, n_layer=1, n_head=n_head, n_embd=n_embd))
    idx = torch.zeros(batch, seq, dtype=torch.long)
    return model, (idx, idx)

