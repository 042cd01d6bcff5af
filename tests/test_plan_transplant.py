"""The screen's first estimate (`plan_transplant`) and its two stages (`mesh_screen.screen`).

- A greedy plan's `PlanPattern` priced on the plan's own mesh is its `plan_cost`; priced on another
  mesh with as many axes it is the `plan_cost` of the same strategies with the parameters stored as
  that mesh's sizes store them, or None where those sizes do not admit the plan.
- With the two stages forced on a space small enough to screen every mesh (32 ranks, 15 meshes:
  2 representatives per number of axes, 2 meshes estimated after the first stage), the screen
  keeps the whole screen's 4 best, which the search then ranks as before, on fixed GPTs and on
  random small ones (hypothesis). With 1 representative and 1 second-stage mesh it does not
  always (a 4th best, once the best, was left with its first estimate): the constants in use
  (`REPRESENTATIVES` 4, `SECOND_STAGE` 16) leave the first stage to spaces of hundreds of meshes.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar.planning.mesh_screen as mesh_screen
from autopar.core.layout import Partial, Replicate
from autopar.core.mesh import Mesh
from autopar.core.meta import info, signature
from autopar.core.plan import Plan
from autopar.passes.trace import trace
from autopar.planning.greedy import SMALL_PARAM_FRACTION, axis_roles, greedy_plan
from autopar.planning.mesh_choice import mesh_candidates
from autopar.planning.plan_cost import GraphFacts, plan_cost
from autopar.planning.plan_transplant import PlanPattern
from autopar.planning.search_cost import TimeCost
from autopar.planning.search_steps import StepCache
from autopar.planning.storage import part_dims, part_storage, storage_layout
from autopar.rules.registry import default_registry
from examples.models import GPT, GPTConfig


def _graph(n_embd: int, n_head: int, batch: int, seq: int, n_layer: int = 2) -> torch.fx.GraphModule:
    cfg = GPTConfig(vocab_size=256, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(batch, seq, dtype=torch.long)
    return trace(model, (idx, idx), decompose=True, split_fused=True)


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


@pytest.mark.parametrize(("world", "hardware"), [(16, "h100-nvlink-ib"), (32, "a100-cluster")])
def test_a_pattern_prices_a_plan_on_any_mesh_with_as_many_axes(world: int, hardware: str) -> None:
    gm = _graph(128, 4, world, 64, n_layer=1)
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
    gm = _graph(64, 4, 8, 8, n_layer=1)
    registry, facts, steps = default_registry(), GraphFacts.of(gm), StepCache()
    a, b = Mesh.from_shape((4, 2, 2), ("x", "y", "z")), Mesh.from_shape((8, 2, 1), ("x", "y", "z"))
    plan = greedy_plan(gm, a, registry, roles=axis_roles(a))
    pattern = PlanPattern.of(gm, plan, registry, facts)
    assert pattern is not None
    assert pattern.price(gm, b, TimeCost("h100-nvlink-ib", b.shape, steps=steps)) is None
    assert pattern.price(gm, a, TimeCost("h100-nvlink-ib", a.shape, steps=steps)) is not None


def _same_screen(gm: torch.fx.GraphModule, world: int, hardware: str) -> None:
    """The two stages (2 representatives per number of axes, 2 meshes estimated after the first
    stage) keep the whole screen's 4 best meshes, in its order, with the same estimates; the
    meshes left with a first estimate only are ranked after them."""
    steps, registry = StepCache(), default_registry()
    meshes = [Mesh.from_shape(s, n) for s, n in mesh_candidates(world)]
    costs = [TimeCost(hardware, m.shape, steps=steps) for m in meshes]
    whole_order, whole = mesh_screen.screen(gm, meshes, registry, costs, 4, bound=False)
    order, found = mesh_screen.screen(gm, meshes, registry, costs, 4, representatives=2, second_stage=2)
    first_only = [i for i, e in enumerate(found) if not e.screened and not math.isnan(e.first)]
    assert first_only  # the two stages ran
    assert order[:4] == whole_order[:4]
    assert [found[i].value for i in order[:4]] == [whole[i].value for i in whole_order[:4]]
    assert set(order[4:]) >= set(first_only)


@pytest.mark.parametrize(
    ("shape", "hardware"),
    [((128, 4, 32, 64), "h100-nvlink-ib"), ((256, 8, 32, 64), "a100-cluster"), ((64, 2, 32, 16), "a100-cluster")],
)
def test_the_two_stage_screen_keeps_the_whole_screens_best(shape: tuple[int, int, int, int], hardware: str) -> None:
    _same_screen(_graph(*shape, n_layer=1), 32, hardware)


@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_head=st.sampled_from([2, 4, 8]),
    head_dim=st.sampled_from([8, 16, 32]),
    seq=st.sampled_from([16, 64]),
    hardware=st.sampled_from(["a100-cluster", "h100-nvlink-ib"]),
)
def test_the_two_stage_screen_keeps_the_whole_screens_best_on_random_small_gpts(
    n_head: int, head_dim: int, seq: int, hardware: str
) -> None:
    _same_screen(_graph(n_head * head_dim, n_head, 32, seq, n_layer=1), 32, hardware)
