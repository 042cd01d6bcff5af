"""The screen's branch and bound (`mesh_bound`, `mesh_screen.screen`) never drops a mesh the whole
screen would keep: on spaces small enough to screen every mesh, each mesh's bound is at most its
full estimate, and the screen with the bound keeps the same meshes in the same order."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pass_fixtures import gpt_meta_graph

import autopar.planning.mesh_screen as mesh_screen
from autopar.compiler.auto_mesh import trace_for_choice
from autopar.compiler.lowering import scheduled_step_time
from autopar.core.errors import AutoparError, MemoryLimitError
from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.planning.greedy import greedy_plan
from autopar.planning.greedy_roles import axis_roles
from autopar.planning.mesh_bound import Bounds
from autopar.planning.mesh_choice import mesh_candidates, rank_meshes
from autopar.planning.mesh_screen import complete, screen
from autopar.planning.plan_cost import GraphFacts, plan_cost
from autopar.planning.search_cost import TimeCost
from autopar.planning.search_seeds import DATA, dispatcher_seeds, fixed_seeds
from autopar.planning.search_steps import StepCache
from autopar.rules import routed_experts
from autopar.rules.calls import ExpandCache
from autopar.rules.registry import default_registry


def _space(world: int, hardware: str) -> tuple[list[Mesh], list[TimeCost]]:
    steps = StepCache()
    meshes = [Mesh.from_shape(shape, names) for shape, names in mesh_candidates(world)]
    return meshes, [TimeCost(hardware, m.shape, steps=steps) for m in meshes]


def _check_against_whole_screen(gm: torch.fx.GraphModule, world: int, hardware: str, keep: int) -> None:
    meshes, costs = _space(world, hardware)
    registry = default_registry()
    whole_order, whole = screen(gm, meshes, registry, costs, keep, bound=False)
    bounds = Bounds(gm, GraphFacts.of(gm))
    for mesh, cost, found in zip(meshes, costs, whole):
        assert bounds.bound(mesh, cost) <= found.value * (1 + 1e-9), (mesh.shape, found.seed)
    order, estimates = screen(gm, meshes, registry, costs, keep, bound=True)
    assert order[:keep] == whole_order[:keep]
    for i in order[:keep]:
        assert estimates[i].value == whole[i].value and estimates[i].seed == whole[i].seed
        assert estimates[i].bound <= estimates[i].value * (1 + 1e-9)
    # what the bound skipped is no better than the kept ones, and completing the screen gives the
    # whole screen's order
    kth = max(estimates[i].value for i in order[:keep])
    assert all(e.bound > kth for e in estimates if not e.screened)
    assert complete(gm, meshes, registry, costs, estimates) == whole_order


@pytest.mark.parametrize(
    ("hardware", "world", "shape"),
    [("a100-cluster", 16, (32, 2, 64, 1024)), ("h100-nvlink-ib", 8, (256, 8, 8, 64))],
)
def test_the_bound_is_below_every_estimate_and_the_screen_keeps_the_same_meshes(
    hardware: str, world: int, shape: tuple[int, int, int, int]
) -> None:
    _check_against_whole_screen(gpt_meta_graph(*shape, n_layer=1), world, hardware, keep=2)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_head=st.sampled_from([2, 4]),
    head_dim=st.sampled_from([8, 16]),
    batch=st.sampled_from([4, 8]),
    seq=st.sampled_from([16, 64]),
    world=st.sampled_from([4, 8]),
    hardware=st.sampled_from(["a100-cluster", "h100-nvlink-ib"]),
)
def test_the_bound_never_exceeds_the_estimate_on_random_small_models(
    n_head: int, head_dim: int, batch: int, seq: int, world: int, hardware: str
) -> None:
    gm = gpt_meta_graph(n_head * head_dim, n_head, batch, seq, n_layer=1)
    _check_against_whole_screen(gm, world, hardware, keep=1)


def test_the_screen_stops_at_the_first_bound_above_the_kth_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the estimate itself as the bound (a bound that holds with equality) the screen visits
    meshes from the cheapest up and stops after the `keep` best: the skipping, not the bound."""
    gm = gpt_meta_graph(64, 4, 8, 64, n_layer=1)
    meshes, costs = _space(8, "h100-nvlink-ib")
    registry = default_registry()
    _, whole = screen(gm, meshes, registry, costs, 2, bound=False)
    exact = {id(c): e.value for c, e in zip(costs, whole)}
    monkeypatch.setattr(mesh_screen.Bounds, "bound", lambda self, mesh, cost: exact[id(cost)])
    order, estimates = screen(gm, meshes, registry, costs, 2, bound=True)
    values = sorted(e.value for e in whole)
    skipped = [e for e in estimates if not e.screened]
    assert len(skipped) == sum(v > values[1] for v in values) > 0
    assert all(math.isnan(e.value) and e.shared is None for e in skipped)
    assert [estimates[i].value for i in order[:2]] == values[:2]


def test_a_choice_that_fits_nowhere_screens_every_mesh_before_giving_up() -> None:
    """When none of the searched meshes fits, the choice goes on in the whole screen's order: the
    meshes the bound skipped are screened then, and every candidate is in the error's table."""
    gm = gpt_meta_graph(64, 4, 8, 64, n_layer=1)
    with pytest.raises(MemoryLimitError) as caught:
        rank_meshes(gm, 4, default_registry(), scheduled_step_time, hardware="h100-nvlink-ib",
                    memory_limit=1.0, overlap_candidates=0, searched=1)  # fmt: skip
    table = str(caught.value)
    assert "not screened" not in table
    assert all("x".join(map(str, shape)) in table for shape, _ in mesh_candidates(4))


def _meta_mixtral(world: int) -> torch.fx.GraphModule:
    """Mixtral (8 experts, top 2, hidden 1024, one layer) on the meta device, traced with
    routed-experts ops (`token_dispatch="auto"`), one 256-token sequence per rank."""
    config = transformers.MixtralConfig(
        vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1, num_attention_heads=16,
        num_key_value_heads=16, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(1024, (world, 256), generator=torch.Generator().manual_seed(0))
    return trace_for_choice(model, world, (), example_kwargs={"input_ids": ids, "labels": ids}, token_dispatch="auto")


def test_the_bound_holds_for_moe_layers_with_their_experts_on_a_data_axis() -> None:
    """MoE layers as routed-experts ops: the screen's dispatcher seeds include layouts with every
    axis a data axis (`search_seeds.dispatcher_seeds`, "...:data": experts and tokens over the
    ranks, no weight split), which on this model are the cheapest plan of the 1-D mesh (whose
    default role is tensor) and of every 2- and 3-axis mesh of 8 ranks (the experts over one or two
    of its axes, the tokens split on the others: (2, 4) "experts:alltoall:y:data", (4, 2)
    "x+y", (2, 2, 2) "y+z", at 3.375e-4 s against 4.197e-4 for the cheapest cube with attention
    and the residual stream forced). The data seeds pay
    none of the tensor-axis collectives the bound claims for the default roles, so the bound
    claims none for such a graph (`Bounds.tensor_axes`); it stays under every mesh's estimate and
    the screen with it keeps the whole screen's meshes.

    The one-axis data seed on (4, 2) splits the tokens over both axes (the experts' work once per
    rank), not only over the experts' axis."""
    gm = _meta_mixtral(8)
    meshes, costs = _space(8, "h100-nvlink-ib")
    _, whole = screen(gm, meshes, default_registry(), costs, 2, bound=False)
    seeds = {mesh.shape: found.seed for mesh, found in zip(meshes, whole)}
    assert seeds[(8,)] == "experts:alltoall:x:data", seeds
    assert seeds[(2, 2, 2)] == "experts:alltoall:y+z:data", seeds
    assert all(seed.startswith("experts:alltoall:") and seed.endswith(":data") for seed in seeds.values()), seeds
    mesh = next(m for m in meshes if m.shape == (4, 2))
    data = dict(dispatcher_seeds(gm, mesh, default_registry(), ExpandCache()))["experts:alltoall:x:data"]
    assert isinstance(data, Plan)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in routed_experts.ROUTED_OPS:
            tokens = data.strategies[node.name].inputs[routed_experts.tokens_index(node.target)]
            assert tokens.shard_axes(0) == (0, 1), (node.name, tokens)
    _check_against_whole_screen(gm, 8, "h100-nvlink-ib", keep=2)


def test_the_screen_skips_the_default_role_dispatcher_starts_only_where_they_cannot_rank_the_mesh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The screen prices the dispatchers' ":data" starts first and the default-role ones only where
    the mesh's weight-splitting plans (default-role greedy, fixed schemes) are no dearer than the
    cheapest ":data" start (`mesh_screen` module doc). On every mesh of 8 ranks of the toy Mixtral
    its estimate is still the cheapest of every start priced, and the default-role starts it skips
    (on most meshes here) are all dearer than it. "Every start" is every start the screen makes:
    its dispatcher starts put the experts over one or two axes (`SCREENED_EXPERT_AXES`), not over
    three as the search of a kept mesh also does."""
    gm = _meta_mixtral(8)
    meshes, costs = _space(8, "h100-nvlink-ib")
    registry, facts = default_registry(), GraphFacts.of(gm)
    asked: list[tuple[str, ...]] = []
    real = mesh_screen.dispatcher_seeds

    def recording(*args: object, suffixes: tuple[str, ...] = ("", DATA), **kwargs: object) -> object:
        asked.append(suffixes)
        return real(*args, suffixes=suffixes, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mesh_screen, "dispatcher_seeds", recording)
    skipped = 0
    for mesh, cost in zip(meshes, costs):
        asked.clear()
        found = mesh_screen.estimate(gm, mesh, registry, cost, facts)
        expand = ExpandCache()
        # the dispatcher starts the screen makes (experts over one or two axes, not three)
        screened = real(gm, mesh, registry, expand, widest=mesh_screen.SCREENED_EXPERT_AXES)
        every = [*fixed_seeds(gm, mesh, registry, expand), *screened]
        with contextlib.suppress(AutoparError):
            every.append(("default roles", greedy_plan(gm, mesh, registry, expand_cache=expand)))
        prices = {
            name: plan_cost(gm, plan, mesh, cost, facts) for name, plan in every if isinstance(plan, Plan)
        }
        assert found.value == min(prices.values()), (mesh.shape, found.seed, prices)
        if ("",) not in asked and axis_roles(mesh) != ("token",) * mesh.ndim:
            skipped += 1
            default_role_starts = [
                v for name, v in prices.items() if name.startswith("experts:") and not name.endswith(DATA)
            ]
            assert default_role_starts and min(default_role_starts) > found.value, (mesh.shape, prices)
    assert skipped >= len(meshes) // 2, skipped
