"""The recomputation choice's incremental bookkeeping equals the plain sums it replaces.

`choose_savings` checks the peak (kept bytes plus the largest recomputed group made again) once
per option it weighs; `RemadeBytes` keeps each group's bytes up to date as the choice grows and
shrinks its sets instead of summing every recomputed op again. Here random sequences of changes
(ops recomputed and dropped, values regathered and dropped, in any mix) are checked against
`RecomputeModel.rematerialized` at every step, and the cached `kept_bytes` against a fresh model's.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.passes.trace import trace
from autopar.planning.greedy import choose_layouts
from autopar.planning.memory import plan_memory
from autopar.planning.recompute import RecomputeModel, RemadeBytes, choose_savings, compute_seconds
from autopar.planning.search_cost import ElementCost
from autopar.rules.registry import default_registry
from examples.models import make_gpt

SHAPE = (2, 2)


@pytest.fixture(scope="module")
def recompute_model() -> tuple[RecomputeModel, object]:
    model, batch = make_gpt(0)
    gm = trace(model, batch, decompose=True)
    plan = choose_layouts(gm, autopar.Mesh.from_shape(SHAPE), default_registry())
    cost = ElementCost(SHAPE)

    def build() -> RecomputeModel:
        return RecomputeModel(gm, plan, SHAPE, compute_seconds(cost, SHAPE, plan), cost.redistribute)

    return build(), build


def test_remade_bytes_follow_every_change(recompute_model: tuple[RecomputeModel, object]) -> None:
    model, _ = recompute_model
    names = sorted(model.values)
    unit_nodes = [sorted(u.nodes) for u in model.units]
    assert any(len(n) > 1 for n in unit_nodes), "blocks: groups of many ops"

    change = st.tuples(
        st.sampled_from(["recompute", "regather"]),
        st.booleans(),  # add or drop
        st.one_of(st.sampled_from(unit_nodes), st.lists(st.sampled_from(names), max_size=6)),
    )

    @settings(max_examples=60, deadline=None)
    @given(st.lists(change, max_size=25), st.lists(st.sampled_from(names), max_size=8))
    def check(changes: list[tuple[str, bool, list[str]]], without: list[str]) -> None:
        recompute: set[str] = set()
        regather: set[str] = set()
        remade = RemadeBytes(model, recompute, regather)
        for which, add, nodes in changes:
            remade.change(recompute if which == "recompute" else regather, frozenset(nodes), add=add)
            assert remade.largest() == model.rematerialized(set(recompute), regather)
        assert remade.largest(without) == model.rematerialized(recompute - set(without), regather)
        # started on sets that are not empty: the same
        assert RemadeBytes(model, recompute, regather).largest() == remade.largest()

    check()


def test_cached_kept_bytes_equal_a_fresh_models(recompute_model: tuple[RecomputeModel, object]) -> None:
    warm, build = recompute_model
    names = sorted(warm.values)
    candidates = sorted(warm.inputs)

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.sampled_from(candidates), max_size=20), st.lists(st.sampled_from(names), max_size=4))
    def check(recompute: list[str], regather: list[str]) -> None:
        fresh = build()  # type: ignore[operator]
        for name in names:  # the warm model answers from its cache where no reader is recomputed
            assert warm.kept_bytes(name, set(recompute), set(regather)) == fresh.kept_bytes(
                name, set(recompute), set(regather)
            )

    check()


def test_identical_blocks_price_the_same_and_the_choice_fits() -> None:
    """Identical blocks free the same bytes for the same seconds to the bit (their redistributions
    are summed exactly rounded, whatever order their sets give them in), so equal options tie and
    the choice takes them by name; under a limit a quarter of the activations below the plan's, the
    choice fits, and a model built afresh makes the same one. Three layers: the first block reads
    the embedding's layout and the greedy pass may plan it otherwise; the later two are planned
    alike, op for op."""
    gpt, batch = make_gpt(0, n_layer=3)
    gm = trace(gpt, batch, decompose=True)
    plan = choose_layouts(gm, autopar.Mesh.from_shape(SHAPE), default_registry())
    cost = ElementCost(SHAPE)

    def build() -> RecomputeModel:
        return RecomputeModel(gm, plan, SHAPE, compute_seconds(cost, SHAPE, plan), cost.redistribute)

    model = build()
    blocks = [u for u in model.units if u.name.startswith("block:")]
    assert len(blocks) == 3
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    later = [sorted(b.nodes, key=order.__getitem__) for b in blocks[1:]]
    assert [str(plan.strategies.get(n)) for n in later[0]] == [str(plan.strategies.get(n)) for n in later[1]]
    assert model.marginal(blocks[1].nodes, set(), ()) == model.marginal(blocks[2].nodes, set(), ())
    memory = plan_memory(gm, plan, SHAPE)
    limit = memory.breakdown().total - 0.25 * memory.activation_bytes()
    choices = [
        choose_savings(m, lambda a: memory.with_activations(a).total, limit, [], lambda s: 0.0)
        for m in (model, build())
    ]
    assert choices[0] is not None and choices[0] == choices[1]
    assert choices[0].recompute and memory.with_activations(choices[0].activation_bytes).total <= limit
    assert math.isfinite(choices[0].seconds) and choices[0].seconds > 0
