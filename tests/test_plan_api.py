"""autopar.plan: the whole compiler on a mesh shape, in process, on a meta-device model, priced."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.cost import load_hardware
from examples.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=8, n_embd=256)


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (8, 64), generator=g), torch.randint(0, 256, (8, 64), generator=g)


@pytest.fixture(scope="module")
def plans(batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, autopar.PlanResult]:
    with torch.device("meta"):
        model = GPT(CFG)  # no weights anywhere: planning needs shapes only
    return {p: autopar.plan(model, (2, 2, 2), batch, planner=p) for p in ("greedy", "search")}


def test_search_is_never_modeled_slower_than_the_greedy_plan(plans: dict[str, autopar.PlanResult]) -> None:
    assert plans["search"].comm_time <= plans["greedy"].comm_time + 1e-12
    assert plans["search"].compute_time == pytest.approx(plans["greedy"].compute_time, rel=0.5)


def test_modeled_times_match_the_hardware_table(plans: dict[str, autopar.PlanResult]) -> None:
    result = plans["greedy"]
    hw = load_hardware("h100-nvlink-ib")
    # every collective costs at least its bandwidth term on the fastest link
    fastest = max(hw.intra_node.bandwidth, hw.inter_node.bandwidth)
    total_bytes = sum(c.bytes for c in result.compiled.report.collectives)
    assert result.comm_time >= total_bytes / fastest
    assert result.step_time == pytest.approx(result.comm_time + result.compute_time)


def test_memory_counts_stored_params_grads_and_adamw_states(plans: dict[str, autopar.PlanResult]) -> None:
    result = plans["greedy"]
    total_params = sum(p.numel() for p in GPT(CFG).parameters()) * 4
    assert result.memory.params == pytest.approx(total_params / 8, rel=0.02)
    assert result.memory.grads == result.memory.params
    assert result.memory.optimizer == pytest.approx(2 * result.memory.params)
    assert result.memory.activations > 0


def test_report_json_and_explain(plans: dict[str, autopar.PlanResult]) -> None:
    result = plans["search"]
    data = json.loads(json.dumps(result.to_json()))
    assert data["mesh"] == {"x": 2, "y": 2, "z": 2}
    assert len(data["collectives"]) == len(result.compiled.report.collectives) > 0
    assert data["layouts"]["addmm"].startswith("f32[")
    text = result.explain("addmm")
    assert "blocks.0.attn.qkv" in text and "reason:" in text and "inputs wanted:" in text
    with pytest.raises(KeyError):
        result.explain("no_such_node")
