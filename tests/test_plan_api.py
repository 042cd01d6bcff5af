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
    return {p: autopar.plan(model, (2, 2, 2), batch, planning=autopar.PlanOptions(planner=p)) for p in ("greedy", "search")}


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
    with pytest.raises(KeyError) as missing:  # and an AutoparError that says which names there are
        result.explain("no_such_node")
    assert isinstance(missing.value, autopar.AutoparError) and "result.layouts()" in str(missing.value)


@pytest.fixture(scope="module")
def compared(batch: tuple[torch.Tensor, torch.Tensor]) -> autopar.PlanResult:
    with torch.device("meta"):
        model = GPT(CFG)
    return autopar.plan(
        model, (2, 2, 2), batch, planning=autopar.PlanOptions(hardware="v100-cluster"), compare=True
    )


def test_compare_prices_the_fixed_plans_of_the_same_graph(compared: autopar.PlanResult) -> None:
    rows = compared.comparison
    assert [c.name for c in rows] == ["chosen (search)", "1-D Megatron", "2-D SUMMA", "3-D cube"]
    assert rows[0].result is compared
    shapes = {c.name: c.mesh_shape for c in rows}
    assert shapes["1-D Megatron"] == (8,) and shapes["3-D cube"] == (2, 2, 2)
    assert shapes["2-D SUMMA"] is not None and sorted(shapes["2-D SUMMA"]) == [2, 4]
    for c in rows:
        r = c.result
        assert r is not None and r.mesh.size == 8 and r.hardware == "v100-cluster"
        assert 0 < r.comm_elements <= r.comm_bytes <= 8 * r.comm_elements  # f32 mostly; masks, indices
        assert r.step_time == pytest.approx(r.comm_time + r.compute_time)
        assert r.memory.total > r.memory.params > 0
    # every plan does the same model's work: compute differs only by what some plans replicate
    computes = [c.result.compute_time for c in rows if c.result is not None]
    assert max(computes) < 3 * min(computes)
    # 1-D Megatron stores each linear weight 1/8 per rank with no weight collectives
    megatron = rows[1].result
    assert megatron is not None
    assert not any(c.kind == "all_gather" and "weight" in c.node for c in megatron.compiled.report.collectives)


def test_compare_report_text_and_json(compared: autopar.PlanResult) -> None:
    text = compared.compare_text()
    assert "step / chosen" in text and "1.00x" in text and "2-D SUMMA" in text
    assert "3-D cube (" in text  # the scheme's axes and letters
    assert "comparison on v100-cluster" in str(compared)
    data = json.loads(json.dumps(compared.to_json()))["comparison"]
    assert [d["name"] for d in data] == [c.name for c in compared.comparison]
    for d, c in zip(data, compared.comparison):
        assert c.result is not None
        assert d["feasible"] and d["step_seconds"] == pytest.approx(c.result.step_time)
        assert d["step_time_over_chosen"] == pytest.approx(c.result.step_time / compared.step_time)
        assert d["comm_elements_per_rank"] == pytest.approx(c.result.comm_elements)
        assert d["memory_bytes_per_rank"] == pytest.approx(c.result.memory.total)


def test_compare_reports_an_infeasible_scheme(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    with torch.device("meta"):
        model = GPT(CFG)  # 8 heads: no 1-D Megatron over 16 ranks; 16 is not a cube
    result = autopar.plan(model, (2, 8), batch, planning=autopar.PlanOptions(planner="greedy"), compare=True)
    rows = {c.name: c for c in result.comparison}
    assert rows["1-D Megatron"].result is None and "heads 8 % 16 != 0" in rows["1-D Megatron"].note
    assert rows["3-D cube"].result is None and "q^3" in rows["3-D cube"].note
    assert rows["2-D SUMMA"].result is not None
    data = result.to_json()["comparison"]
    assert {d["name"]: d["feasible"] for d in data}["1-D Megatron"] is False
    assert "infeasible" in result.compare_text()


def test_auto_with_microbatches_ranks_pipeline_depths() -> None:
    """plan(model, "auto", world_size=N, microbatches=M): the tensor-only meshes and every
    pipeline depth with every schedule in one ranking; the plan compiled is the winner's (its
    stage sub-mesh's for one microbatch when a pipeline wins) and the report prints the ranking."""
    from examples.models import make_gpt

    model, batch = make_gpt(0, batch_size=8, n_layer=2)
    result = autopar.plan(model, "auto", batch, world_size=2, pipeline=autopar.PipelineOptions(microbatches=4))
    choice = result.pipeline_choice
    assert choice is not None and choice.microbatches == 4
    priced = [c for c in choice.candidates if not c.error]
    assert {c.pp for c in priced} == {1, 2}
    assert {c.schedule for c in priced if c.pp == 2} >= {"1f1b", "zero-bubble", "gpipe"}
    best = choice.chosen
    assert best.step_time == min(c.step_time for c in priced if c.fits)
    assert result.mesh.shape == best.stage_shape
    assert (result.mesh_choice is not None) == (best.pp == 1)
    # the tensor-only choice keeps its trace and searched plan: where pp = 1 wins, the plan compiled
    # is the one ranked (searched with the weight state's ratios), not a search of its own again
    assert choice.tensor_only is not None and choice.tensor_only.chosen_plan is not None
    assert choice.table() in str(result)
