"""The search's memory side: a plan brought under the per-rank memory limit.

`search_layouts` (`autopar.planning.search`) finds layouts by their modeled cost; this module fits a
plan into `memory_limit`: the cheapest backward regathers and recomputations that make it fit
(`fit`), the price of saved bytes raised until the search's own optimum fits (`price_memory`),
whether replicated weights fit at all, and the error naming both numbers when nothing does.
`SearchPlan` is the plan with that decision on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.fx as fx

from autopar.core.errors import MemoryLimitError
from autopar.core.mesh import Mesh
from autopar.core.meta import info
from autopar.core.plan import Plan
from autopar.cost.formulas import MemoryBreakdown, format_bytes
from autopar.planning.memory import MEMORY_HEADROOM, PlanMemory, plan_memory, state_ratios
from autopar.planning.plan_cost import GraphFacts, plan_cost
from autopar.planning.recompute import (
    RecomputeModel,
    Savings,
    choose_savings,
    compute_seconds,
    has_checkpoint_regions,
)
from autopar.planning.search_cost import ElementCost
from autopar.planning.search_problem import Problem, regather_cost
from autopar.planning.storage import SHARDED

PRICE_STEPS = 24  # memory prices tried, each 4x the last, before giving up on fitting
PRICE_BISECTIONS = 4  # refinements between the last price that did not fit and the first that did
PRICE_STALL = 3  # stop raising the price once this many raises left the plan unchanged


@dataclass
class SearchPlan(Plan):
    """A Plan with the search's memory decision: forward values (gathered weights) that backward
    gathers again instead of keeping, forward ops backward computes again (`planning.recompute`),
    and the modeled memory per rank."""

    regather: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    savings: Savings | None = None
    memory: MemoryBreakdown | None = None
    # the cheapest start, fitted, when the chain moves left it: the search's objective prices
    # every edge as its own collective and sees neither buckets nor overlap, so the schedule stage
    # compares the two (`compiler.lowering.prefer_scheduled`, the mesh choice's schedule stage)
    start: SearchPlan | None = None
    storage: str = SHARDED  # how the plan stores its weights (`planning.storage`)


@dataclass
class Fitted:
    plan: Plan
    savings: Savings
    memory: PlanMemory | None  # None: not computed (no limit to check)
    cost: float
    storage: str = SHARDED

    @property
    def regather(self) -> tuple[str, ...]:
        return self.savings.regather

    @property
    def bytes(self) -> float:
        return self.memory.with_activations(self.savings.activation_bytes).total if self.memory is not None else 0.0

    def search_plan(self, gm: fx.GraphModule, mesh: Mesh) -> SearchPlan:
        memory = self.memory if self.memory is not None else plan_memory(gm, self.plan, mesh.shape)
        activations = self.savings.activation_bytes if self.memory is not None else memory.activation_bytes()
        # notes copied: the search writes its own note into the plan it returns, and the plan
        # fitted here may be a start shared with the screen (`Shared.role_plan`)
        return SearchPlan(
            **{f.name: getattr(self.plan, f.name) for f in fields(Plan) if f.name != "notes"},
            notes=dict(self.plan.notes),
            regather=self.savings.regather,
            recompute=self.savings.recompute,
            savings=self.savings,
            memory=memory.with_activations(activations),
            storage=self.storage,
        )


def fit_memory(
    gm: fx.GraphModule, plan: Plan, mesh: Mesh, cost: ElementCost, memory_limit: float | None = None
) -> SearchPlan:
    """A fixed plan (the greedy one) under a memory limit: its layouts, with the cheapest backward
    regathers and recomputations that make it fit (the user's checkpoint regions recomputed in any
    case); `MemoryLimitError` if all of them together are not enough."""
    limit = default_memory_limit(cost) if memory_limit is None else float(memory_limit)
    fitted = fit(gm, plan, mesh, cost, limit)
    if fitted is None:
        raise memory_error(plan_memory(gm, plan, mesh.shape), mesh, limit, "this plan")
    return fitted.search_plan(gm, mesh)


def default_memory_limit(cost: ElementCost) -> float:
    """`MEMORY_HEADROOM` of the device memory of the cost's hardware table; no limit without one."""
    capacity = cost.memory_capacity
    return MEMORY_HEADROOM * capacity if capacity else math.inf


def replicated_fits(gm: fx.GraphModule, limit: float) -> bool:
    """Whether every parameter whole on every rank, with its gradient and AdamW states (the
    weight state of "replicated" storage when no axis splits a weight), fits `limit` bytes: only
    then is replicated storage searched (a tensor-split plan stores less, and the search's memory
    check still applies to every plan it finds)."""
    return not math.isfinite(limit) or weight_state_bytes(gm) <= limit


def weight_state_bytes(gm: fx.GraphModule) -> float:
    """Bytes of every parameter whole, with its gradient and AdamW states (as the graph's plans are
    counted, `memory.state_ratios`): what each rank holds when weights are stored replicated and no
    axis splits them."""
    params = sum(
        n.meta["val"].numel() * n.meta["val"].element_size()
        for n in gm.graph.nodes
        if n.op == "placeholder" and info(n).role == "param" and isinstance(n.meta.get("val"), torch.Tensor)
    )
    return params * state_ratios(gm).total


def leanest_need(memory: PlanMemory) -> float:
    """Bytes per rank with every weight chain regathered (the least a plan's layouts can need)."""
    return memory.breakdown([s.name for s in memory.saved if s.regatherable]).total


def fit(
    gm: fx.GraphModule,
    plan: Plan,
    mesh: Mesh,
    cost: ElementCost,
    limit: float,
    memory: PlanMemory | None = None,
    facts: GraphFacts | None = None,
    known: float | None = None,
) -> Fitted | None:
    """`plan` with the cheapest regathers and recomputations that bring it under `limit` (the
    user's checkpoint regions always recomputed), or None if none do (`known`: the plan's
    `plan_cost`, if already worked out)."""
    value = known if known is not None else plan_cost(gm, plan, mesh, cost, facts)
    regions = has_checkpoint_regions(gm)
    if not math.isfinite(limit) and not regions:
        return Fitted(plan, Savings(), None, value)
    memory = memory if memory is not None else plan_memory(gm, plan, mesh.shape)
    if memory.breakdown().total <= limit and not regions:
        plain = memory.activation_bytes()
        return Fitted(plan, Savings(activation_bytes=plain, activation_bytes_before=plain), memory, value)
    seconds = compute_seconds(cost, mesh.shape, plan, facts)
    model = RecomputeModel(gm, plan, mesh.shape, seconds, cost.redistribute, facts)
    savings = choose_savings(
        model,
        lambda activations: memory.with_activations(activations).total,
        limit,
        [s for s in memory.saved if s.regatherable and s.bytes > 0],
        lambda s: regather_cost(s, cost),
    )
    if savings is None:
        return None
    return Fitted(plan, savings, memory, value + savings.seconds)


def recompute_note(savings: Savings) -> str:
    if not savings.recompute:
        return ""
    return (
        f"; {len(savings.recompute)} ops recomputed in backward ({len(savings.units)} units), saved "
        f"activations {format_bytes(savings.activation_bytes_before)} -> {format_bytes(savings.activation_bytes)}"
    )


def price_memory(
    gm: fx.GraphModule,
    mesh: Mesh,
    cost: ElementCost,
    facts: GraphFacts,
    limit: float,
    problem: Problem,
    max_sweeps: int,
    materialize: Any,
    prices: list[float],
) -> tuple[list[Fitted | None], PlanMemory | None]:
    """Raise the price of saved bytes (4x a step) until the plan fits, then bisect between the
    last two prices. Each priced optimum is measured exactly (the problem's memory model sees only
    each value's own layout, not forward redistributions that backward reuses). Returns the plans
    that fit, and the memory of the leanest plan seen (with every weight chain regathered)."""
    unpriced_cost, unpriced_bytes = problem.modeled(0.0)
    start = unpriced_cost / max(unpriced_bytes, 1.0) * 1e-3
    measured: dict[tuple[int, ...], tuple[Fitted | None, PlanMemory]] = {}
    fits: list[Fitted | None] = []
    lean: list[tuple[float, PlanMemory]] = []
    last: list[tuple[int, ...]] = []

    def attempt(price: float) -> bool:
        problem.set_price(price)
        problem.optimize(max_sweeps)
        prices.append(price)
        state = tuple(problem.snapshot())
        last.append(state)
        if state not in measured:
            plan = materialize()
            memory = plan_memory(gm, plan, mesh.shape)
            measured[state] = (fit(gm, plan, mesh, cost, limit, memory, facts), memory)
            fits.append(measured[state][0])
            lean.append((leanest_need(memory), memory))
        return measured[state][0] is not None

    low, high = 0.0, None
    price = start
    for _ in range(PRICE_STEPS):
        if attempt(price):
            high = price
            break
        if len(last) > PRICE_STALL and len(set(last[-PRICE_STALL - 1 :])) == 1:
            break  # memory dominates the objective already: higher prices change nothing
        low, price = price, price * 4
    for _ in range(PRICE_BISECTIONS if high is not None and low == 0 else 0):  # fit at once: cheaper?
        assert high is not None
        price = high / 4
        if not attempt(price):
            low = price
            break
        high = price
    if high is not None and low > 0:
        for _ in range(PRICE_BISECTIONS):
            middle = math.sqrt(low * high)
            if attempt(middle):
                high = middle
            else:
                low = middle
    problem.set_price(0.0)
    return fits, min(lean, key=lambda t: t[0])[1] if lean else None


def memory_error(memory: PlanMemory, mesh: Mesh, limit: float, which: str) -> MemoryLimitError:
    """`which` plan's memory with every weight chain regathered, against the limit."""
    need = memory.breakdown([s.name for s in memory.saved if s.regatherable])
    parts = (
        f"params {format_bytes(need.params)} + grads {format_bytes(need.grads)} + AdamW states "
        f"{format_bytes(need.optimizer)} + saved activations {format_bytes(need.activations)} + working memory "
        f"{format_bytes(need.working)}"
    )
    return MemoryLimitError(
        f"no plan fits the memory limit of {format_bytes(limit)} per rank on mesh {mesh}: {which} "
        f"needs {format_bytes(need.total)} ({parts}), even with every gathered weight gathered again "
        "in backward",
        memory=need.total,
        limit=limit,
        hint="use a bigger mesh (more ranks split the weights and activations), a smaller batch or "
        "sequence, or a larger memory_limit",
    )
