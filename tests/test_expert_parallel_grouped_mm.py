"""Expert parallelism of a hand-written mixture of experts: `examples/torch_models.GroupedMoE`
(torchtitan-style: router top-k, the (token, expert) pairs sorted by expert, the experts' SwiGLU
by `torch._grouped_mm` with `offs`, `index_add` back), bfloat16, trained 2 steps of SGD with
momentum, every rank's program in lockstep in one process against serial: loss, every gradient and
every parameter after the steps. With the search's plan at the defaults, and with the experts
forced split over every mesh axis (each rank multiplies only its experts' rows, forward, the
input's gradient and the experts' gradient). A loop over `nn.ModuleList` experts is refused with
what to do (`tests/test_torch_models.py`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pass_fixtures import train_in_lockstep

from autopar.core.strategy import OpCall, Strategy
from autopar.rules import expert_parallel
from autopar.rules.base import Requirement
from autopar.rules.registry import default_registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import torch_models  # noqa: E402

GROUPED_MM = torch.ops.aten._grouped_mm.default
# bfloat16 keeps 8 bits of mantissa: a gradient's worst entry may differ from serial's by a few
# of its units in the last place where the ranks' pending sums add in another order
TOLERANCE = 2e-2


# router logits COLD * (u . h) for one direction u: a token picks experts 0 and 1 (u . h > 0) or 6
# and 5 (u . h < 0), so experts 2, 3, 4 and 7 get no row
COLD = torch.tensor([5.0, 4.0, -1.0, -2.0, -3.0, -4.0, -5.0, 0.0])


def _steer_router(model: torch_models.GroupedMoE) -> torch_models.GroupedMoE:
    with torch.no_grad():
        direction = torch.randn(model.router.weight.shape[1], generator=torch.Generator().manual_seed(3))
        model.router.weight.copy_(torch.outer(COLD, direction))
    return model


def _train(shape: tuple[int, ...], cold: bool = False, experts: int = 8, **options: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch_models.GroupedMoE(experts=experts)
    if cold:
        _steer_router(model)
    result = train_in_lockstep(
        model,
        shape,
        [torch_models.batch(step) for step in range(2)],
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        **options,
    )
    assert result["loss_err"] < TOLERANCE, result["losses"]
    assert result["grad_err"] < TOLERANCE, result["grad_err"]
    assert result["param_err"] < TOLERANCE, result["param_err"]
    return result


def _expert_layouts(result: dict[str, Any]) -> dict[str, str]:
    program = next(iter(result["compiled"].values())).program
    return {n: str(lay) for n, lay in zip(program.param_names, program.param_layouts) if n in ("w1", "w2", "w3")}


def _experts_split_registry(shape: tuple[int, ...]) -> Any:
    """The default rules, but every `torch._grouped_mm` with `offs` splits its experts over every
    mesh axis (the weights, or the experts' gradient, Shard(0) on all of them)."""
    registry = default_registry()
    every_axis = tuple(range(len(shape)))

    def admits(call: OpCall, strategy: Strategy) -> bool:
        experts = expert_parallel.experts_layout(GROUPED_MM, strategy)
        return experts is None or experts.shard_axes(expert_parallel.EXPERT_DIM) == every_axis

    registry.require(GROUPED_MM, Requirement(admits, "a test's expert split"))
    return registry


def test_search_plan_of_a_grouped_mm_moe_trains_like_serial() -> None:
    """At the defaults the search prices the expert split against splits inside the experts (on
    (4,) in element counts it keeps them whole and splits inside) and says so in the plan summary."""
    result = _train((4,))
    report = str(next(iter(result["compiled"].values())).report)
    line = next(text for text in report.splitlines() if text.startswith("experts"))
    assert "8 experts of 1 MoE layers" in line and "with the split" in line, line


@pytest.mark.parametrize(
    ("shape", "cold"), [((4,), False), ((2, 2), False), ((2, 2, 2), True)], ids=["4", "2x2", "2x2x2-cold"]
)
def test_grouped_mm_experts_split_over_the_ranks_train_like_serial(shape: tuple[int, ...], cold: bool) -> None:
    """Each rank holds 2 of the 8 experts (w1, w3, w2 Shard(0) on every axis; on (2, 2, 2) one
    expert per rank, rank (i, j, l) expert 4i + 2j + l) and multiplies only their rows; the ranks'
    row-disjoint sums add up to serial, the experts' gradients stay split. `cold`: the router is
    steered so that experts 2, 3, 4 and 7 get no token (half the ranks multiply nothing)."""
    if cold:
        model = _steer_router(torch_models.GroupedMoE())
        idx, _ = torch_models.batch(0)
        chosen = model.router(model.emb(idx).reshape(-1, model.w1.shape[1])).softmax(-1).topk(model.k, -1).indices
        assert set(chosen.unique().tolist()) == {0, 1, 5, 6}, chosen.unique()
    result = _train(shape, cold=cold, registry=_experts_split_registry(shape))
    placements = "[" + ", ".join(["S(0)"] * len(shape)) + "]"
    layouts = _expert_layouts(result)
    assert layouts and all(lay == placements for lay in layouts.values()), layouts


@pytest.mark.parametrize(
    ("shape", "experts", "axis"), [((2, 4), 8, "x"), ((2, 2, 2), 4, "z")], ids=["2x4", "2x2x2"]
)
def test_search_splits_the_experts_over_one_axis_and_trains_like_serial(
    shape: tuple[int, ...], experts: int, axis: str
) -> None:
    """At the defaults (element counts) the search holds the experts over one axis of size 2 (half
    of them per rank; on (2, 4) 2.750e4 elements against 3.004e4 whole and 3.979e4 over both axes)
    and uses the other axes for the rest; it trains like serial, and the summary says where the
    experts are and why. On (2, 2, 2) the toy has 4 experts, where the split wins by 4 % (3.146e4
    over z against 3.284e4 whole): with 8 the whole experts won or lost by under 0.1 % (3.308e4
    whole against 3.311e4 over x), the search's ties (`search_cost.CALL_ELEMENTS`) decided it."""
    result = _train(shape, experts=experts)
    report = next(iter(result["compiled"].values())).report.experts
    assert report is not None and report.axes == (axis,), report
    assert report.axes_costs[0][0] == (axis,) and dict(report.axes_costs)[()] > report.axes_costs[0][1]
    index = "xyz".index(axis)
    for name, layout in _expert_layouts(result).items():
        placements = layout.strip("[]").split(", ")
        assert [i for i, p in enumerate(placements) if p == "S(0)"] == [index], (name, layout)
    held = f"each rank holds {experts // 2} of the {experts} experts"
    assert str(report).startswith(f"experts split over mesh axis {axis} (2): {held}")
