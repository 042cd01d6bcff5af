"""The plan search under a per-rank memory limit: gathered weights kept for backward or gathered again.

A small GPT on a (2, 2, 2) planning mesh priced on the H100 table. Without a limit the search keeps
every gathered weight from forward to backward; with a limit between the leanest and the fastest
plan it gathers some of them again in backward, the compiled program then saves less, and a limit
below what the parameters alone need raises MemoryLimitError with both numbers.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.fx as fx
from pass_fixtures import train_in_lockstep

import autopar
from autopar.compiler.pipeline_stage import StageBudget, stage_budget
from autopar.core.graph_copy import graph_copy
from autopar.core.meta import activation_copies, has_info, info, set_activation_copies, set_gradient_copies
from autopar.core.pipeline_schedule import schedule_by_name
from autopar.cost.formulas import ADAMW_STATE_FACTOR, memory_per_rank
from autopar.passes.trace import trace
from autopar.planning.greedy import choose_layouts
from autopar.planning.memory import (
    MEMORY_HEADROOM,
    plan_memory,
    saved_nodes,
    unreduced_grad_bytes,
    views_stored,
    weight_chain,
)
from autopar.planning.search import (
    ElementCost,
    SearchPlan,
    TimeCost,
    default_memory_limit,
    fit_memory,
    plan_cost,
    search_layouts,
)
from autopar.rules.registry import default_registry
from examples.models import GPT, GPTConfig, make_gpt

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=8, n_embd=256)
SHAPE = (2, 2, 2)
HW = "h100-nvlink-ib"


@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    with torch.device("meta"):
        model = GPT(CFG)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 256, (8, 64), generator=g), torch.randint(0, 256, (8, 64), generator=g))
    gm = trace(model, batch, decompose=True)
    mesh = autopar.Mesh.from_shape(SHAPE)
    cost = TimeCost(HW, SHAPE)
    # (sharded storage: replicated weights, which the search may pick where they fit, need more)
    free = search_layouts(gm, mesh, default_registry(), cost=cost, memory_limit=math.inf, storage="sharded")
    memory = plan_memory(gm, free, SHAPE).breakdown()
    # everything but the saved activations: the weight state and the working memory (`planning.working`)
    static = memory.params + memory.grads + memory.optimizer + memory.working
    return {
        "model": model,
        "batch": batch,
        "gm": gm,
        "mesh": mesh,
        "cost": cost,
        "free": free,
        "memory": memory,
        "static": static,
    }


def _limit(setup: dict[str, Any], share: float) -> float:
    """Parameters, gradients, AdamW states and working memory, plus `share` of the unlimited plan's activations."""
    return setup["static"] + share * setup["memory"].activations


def test_default_limit_is_device_memory_with_headroom() -> None:
    assert default_memory_limit(TimeCost(HW, SHAPE)) == pytest.approx(MEMORY_HEADROOM * 80e9)
    assert MEMORY_HEADROOM == 0.9
    assert default_memory_limit(ElementCost(SHAPE)) == math.inf


def test_without_a_limit_every_gathered_weight_is_kept(setup: dict[str, Any]) -> None:
    free: SearchPlan = setup["free"]
    assert free.regather == ()
    saved = plan_memory(setup["gm"], free, SHAPE).saved
    chains = [s for s in saved if s.regatherable]
    # one gathered weight per linear layer: qkv, proj, fc, proj in each of the 2 blocks
    assert len(chains) == 8
    nodes = {n.name: n for n in setup["gm"].graph.nodes}
    assert all(nodes[s.name].target is torch.ops.aten.t.default for s in chains)
    assert free.memory is not None and free.memory.total == pytest.approx(setup["memory"].total)


def test_limit_makes_backward_gather_weights_again(setup: dict[str, Any]) -> None:
    gm, mesh, cost = setup["gm"], setup["mesh"], setup["cost"]
    limit = _limit(setup, 0.8)
    assert setup["memory"].total > limit  # the unlimited plan does not fit
    plan = search_layouts(gm, mesh, default_registry(), cost=cost, memory_limit=limit)
    report = gm.meta["autopar_search"]
    assert plan.regather and report.regathered == plan.regather
    decided = set(plan.decided)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert all(weight_chain(nodes[name], decided) is not None for name in plan.regather)
    memory = plan_memory(gm, plan, SHAPE)
    kept = memory.breakdown()
    lean = memory.breakdown(plan.regather)
    assert plan.memory is not None and plan.memory.total == pytest.approx(lean.total)
    assert lean.total <= limit < kept.total
    freed = sum(s.bytes for s in memory.saved if s.name in plan.regather)
    assert kept.activations - lean.activations == pytest.approx(freed) and freed > 0
    # the trade is priced: the plan's modeled time includes each regather's all-gathers once more
    again = sum(cost.gather_from_storage(plan.layouts[name][0]) for name in plan.regather)
    layouts_only = fit_memory(gm, plan, mesh, cost, math.inf)  # same layouts, nothing regathered
    assert again > 0
    assert report.final_cost == pytest.approx(plan_cost(gm, plan, mesh, cost))
    assert report.final_cost == pytest.approx(plan_cost(gm, layouts_only, mesh, cost) + again)
    assert report.memory == pytest.approx(lean.total)


def test_each_microbatch_in_flight_counts_its_saved_activations(setup: dict[str, Any]) -> None:
    """A pipeline stage whose rank holds two microbatches' activations at once (1F1B's first stage
    of two) plans for both copies: a limit the one-copy plan fits makes the two-copy plan save less."""
    gm, mesh, cost = setup["gm"], setup["mesh"], setup["cost"]
    held = graph_copy(gm)
    set_activation_copies(held, 2)
    assert activation_copies(gm) == 1 and activation_copies(held) == 2
    one = plan_memory(gm, setup["free"], SHAPE).breakdown()
    two = plan_memory(held, setup["free"], SHAPE).breakdown()
    assert two.activations == pytest.approx(2 * one.activations) and two.params == one.params
    limit = _limit(setup, 1.4)  # the unlimited plan fits with one copy, not with two
    assert one.total <= limit < two.total
    alone = search_layouts(gm, mesh, default_registry(), cost=cost, memory_limit=limit, storage="sharded")
    assert not alone.regather and not alone.recompute
    both = search_layouts(held, mesh, default_registry(), cost=cost, memory_limit=limit, storage="sharded")
    assert both.regather or both.recompute
    assert both.memory is not None and both.memory.total <= limit
    assert both.memory.activations <= limit - setup["static"]


def test_a_stage_budget_is_the_schedule_in_flight_per_stage() -> None:
    one_f_one_b, interleaved = schedule_by_name("1f1b", 2, 1, 4), schedule_by_name("interleaved-1f1b", 2, 2, 4)
    assert stage_budget(one_f_one_b, 0, 1, loss_inside=True) == StageBudget(1.0, 2, True)  # pp microbatches
    assert stage_budget(one_f_one_b, 1, 1, loss_inside=True) == StageBudget(1.0, 1, True)
    assert stage_budget(one_f_one_b, 1, 1, loss_inside=False) == StageBudget(1.0, 4, True)  # every forward first
    first = stage_budget(interleaved, 0, 2, loss_inside=True)
    assert first.memory_share == 0.5 and 2 <= first.activation_copies <= 4 and first.accumulates
    # gradients are summed over microbatches where there are several and backwards run whole
    assert not stage_budget(schedule_by_name("1f1b", 2, 1, 1), 0, 1, loss_inside=True).accumulates
    assert not stage_budget(schedule_by_name("zero-bubble", 2, 1, 4), 0, 1, loss_inside=True).accumulates


def test_a_stage_summing_its_microbatches_gradients_counts_the_sums(setup: dict[str, Any]) -> None:
    """A stage that sums its microbatches' gradients holds them as the backward computes them,
    before any reduction, through the step (one copy: later backwards add each term into its sum
    as they make it, test_pipeline_grad_accumulation.py); the count takes copies, and the search
    fits a limit with them."""
    gm, mesh, cost, free = setup["gm"], setup["mesh"], setup["cost"], setup["free"]
    one = plan_memory(gm, free, SHAPE).breakdown()
    unreduced = unreduced_grad_bytes(gm, free, SHAPE)
    # each stored gradient is its computed value or a reduce-scatter of it
    assert unreduced >= one.grads == one.params > 0
    summed = graph_copy(gm)
    set_gradient_copies(summed, 1)
    assert plan_memory(summed, free, SHAPE).breakdown().grads == pytest.approx(max(one.grads, unreduced))
    set_gradient_copies(summed, 2)
    two = plan_memory(summed, free, SHAPE).breakdown()
    assert two.grads == pytest.approx(2 * unreduced)
    assert (two.params, two.optimizer, two.activations) == (one.params, one.optimizer, one.activations)
    # a limit the stored gradient fits, the two copies do not: the search saves activations instead
    limit = one.total + (two.grads - one.grads) / 2
    assert not free.regather and not free.recompute and one.total <= limit < two.total
    both = search_layouts(summed, mesh, default_registry(), cost=cost, memory_limit=limit, storage="sharded")
    assert both.memory is not None and both.memory.total <= limit
    assert both.memory.grads >= 2 * one.grads and both.memory.activations < one.activations


def _below_replicated(gm: fx.GraphModule) -> float:
    """A limit just under every weight whole with its gradient and AdamW states: no replicated plan fits."""
    params = sum(n.meta["val"].numel() * 4 for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "param")
    return 0.999 * memory_per_rank(params, params, ADAMW_STATE_FACTOR).total


def test_compiled_program_saves_less_and_gathers_in_backward(setup: dict[str, Any]) -> None:
    # a tight limit: recomputing both blocks is not enough (on the H100 table recomputation is the
    # cheaper per byte, so it goes first; a recomputed block's values exist again during its
    # backward), gathered weights must be gathered again as well
    limit = _limit(setup, 0.45)
    # the fastest plan with its weights sharded: a limit just under what replicated weights need
    free = autopar.plan(setup["model"], SHAPE, setup["batch"], planning=autopar.PlanOptions(hardware=HW), memory_limit=_below_replicated(setup["gm"]))
    lean = autopar.plan(setup["model"], SHAPE, setup["batch"], planning=autopar.PlanOptions(hardware=HW), memory_limit=limit)
    regathered = lean.compiled.graph.meta["autopar_search"].regathered
    assert regathered
    # the emitted program's own memory (what autopar.plan reports) is under the limit
    assert lean.memory.total <= limit < free.memory.total
    assert lean.memory.params == free.memory.params
    # the regathered weights are no longer handed from forward to backward
    assert set(regathered) <= _saved(free) and not set(regathered) & _saved(lean)
    # each is built again in backward from an all-gather in backward
    joint = lean.compiled.graph
    for name in regathered:
        original = next(n for n in joint.graph.nodes if n.name == name)
        copies = [
            n
            for n in joint.graph.nodes
            if n is not original
            and n.target is original.target
            and info(n).phase == "backward"
            and info(n).module_path == info(original).module_path
            and _gathered_in_backward(n)
        ]
        assert copies, name
    gathers = [
        c for c in lean.compiled.report.collectives if c.kind == "all_gather" and c.phase == "backward"
    ]
    assert gathers


def _saved(result: autopar.PlanResult) -> set[str]:
    program = result.compiled.program
    out = next(n for n in program.forward.graph.nodes if n.op == "output")
    return {n.name for n in list(out.args[0])[len(program.output_layouts) :] if isinstance(n, fx.Node)}


def _gathered_in_backward(node: fx.Node) -> bool:
    frontier = list(node.all_input_nodes)
    while frontier:
        current = frontier.pop()
        if not has_info(current) or info(current).phase != "backward":
            continue
        if current.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
            return True
        frontier.extend(current.all_input_nodes)
    return False


def test_impossible_limit_raises_with_both_numbers(setup: dict[str, Any]) -> None:
    limit = 0.5 * setup["static"]
    with pytest.raises(autopar.MemoryLimitError) as caught:
        search_layouts(setup["gm"], setup["mesh"], default_registry(), cost=setup["cost"], memory_limit=limit)
    error = caught.value
    assert error.limit == limit
    assert error.memory >= setup["static"] > limit
    assert error.memory < setup["memory"].total  # the leanest plan, every weight gathered again
    text = str(error)
    assert f"{limit / 2**20:.3f} MiB" in text and f"{error.memory / 2**20:.3f} MiB" in text
    assert "bigger mesh" in (error.hint or "") and "smaller batch" in (error.hint or "")


def test_greedy_plan_fits_a_limit_by_regathering(setup: dict[str, Any]) -> None:
    gm, mesh, cost = setup["gm"], setup["mesh"], setup["cost"]
    greedy = choose_layouts(gm, mesh, default_registry())
    kept = plan_memory(gm, greedy, SHAPE).breakdown()
    limit = kept.params + kept.grads + kept.optimizer + 0.9 * kept.activations
    fitted = fit_memory(gm, greedy, mesh, cost, limit)
    assert fitted.strategies == greedy.strategies  # same layouts, only regathers added
    assert fitted.regather and fitted.memory is not None and fitted.memory.total <= limit
    assert fit_memory(gm, greedy, mesh, cost, math.inf).regather == ()
    with pytest.raises(autopar.MemoryLimitError):
        fit_memory(gm, greedy, mesh, cost, 0.5 * setup["static"])


def test_a_plan_under_a_memory_limit_trains_like_the_serial_model() -> None:
    """Under 70% of the free plan's activations the search recomputes ops or gathers weights again
    in backward (on element counts here, recomputation is the cheaper); the 8 ranks' programs,
    compiled under that limit as `parallelize` compiles them, train with it in lockstep: two AdamW
    steps, every rank's loss, every gradient and every parameter after as serial's. (The runtime
    around the programs is the one tests/test_parallelize_multirank.py runs on gloo ranks.)"""
    model, batch = make_gpt(0)
    gm = trace(model, batch, decompose=True, split_fused=True)  # the graph parallelize's search plans
    mesh = autopar.Mesh.from_shape(SHAPE)
    free = plan_memory(
        gm, search_layouts(gm, mesh, default_registry(), memory_limit=math.inf, storage="sharded"), SHAPE
    ).breakdown()
    limit = free.params + free.grads + free.optimizer + 0.7 * free.activations
    lean = search_layouts(gm, mesh, default_registry(), memory_limit=limit)
    assert lean.regather or lean.recompute  # the job below runs a plan that saves less
    model, batch = make_gpt(0)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)
    r = train_in_lockstep(model, SHAPE, [batch, batch], adamw, memory_limit=limit)
    numbers = {k: r[k] for k in ("loss_err", "grad_err", "param_err")}
    assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["param_err"] < 1e-5, numbers


def test_a_stored_weights_transpose_saved_for_backward_costs_nothing(setup: dict[str, Any]) -> None:
    """On one axis the plan keeps weights as they are stored (column and row splits), and the
    backward saves their transposes: views of the stored blocks, which hold no memory of their own
    (a 4-rank proxy's step never allocated the 48 MiB per microbatch they were counted at,
    docs/pipeline.md#a-pipelined-ranks-memory). Gathered weights (the (2, 2, 2) plan) still count."""
    gm = setup["gm"]
    plan = search_layouts(gm, autopar.Mesh.from_shape((2,)), default_registry(), cost=ElementCost((2,)),
                          memory_limit=math.inf, storage="sharded")  # fmt: skip
    views = [n for n in saved_nodes(gm) if n.op != "placeholder" and views_stored(n, plan)]
    assert views and all(n.target is torch.ops.aten.t.default for n in views)
    counted = {s.name: s.bytes for s in plan_memory(gm, plan, (2,)).saved}
    # saved in their own layout only: nothing counted (a layout backward gathers to would be)
    assert all(counted.get(n.name, 0.0) == 0.0 for n in views)
    assert not any(views_stored(n, setup["free"]) for n in saved_nodes(gm) if n.target is torch.ops.aten.t.default)
