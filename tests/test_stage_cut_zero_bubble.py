"""Why zero-bubble (ZB-H1) at depth 16 reports a bubble of 0.52 on DeepSeek-V3 where 1F1B reports
0.29 (docs/moe-published.md, `benchmarks/moe_pipelined.py --models deepseek-v3`): not the schedule
but the cut its memory allows. ZB-H1 lets rank r defer r weight gradients, so every rank holds
`min(pp, M)` microbatches' activations until their W (1F1B's last rank holds one); the LM head's
activations (the logits, 4x a layer's) times 16 do not fit beside a layer, so the cut puts the head
alone and two layers on one stage, which then sets the pace. The published sizes, 16 layers,
traced on the meta device (about 5 CPU s)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from autopar.passes.trace import trace
from autopar.planning.stage_cut import cut_graph
from autopar.planning.stage_units import StageGraph, stage_graph
from autopar.planning.step_accounting import weight_state_for

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PP, M, RANKS = 16, 120, 128  # the report's depth and batch (120 microbatches of 128 sequences), a stage's ranks
LIMIT = 0.9 * 80e9


@functools.cache
def _deepseek_v3_16() -> tuple[StageGraph, object]:
    config = transformers.DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=16, first_k_dense_replace=0, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=4096, attention_dropout=0.0,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(1, 4096, dtype=torch.long).expand(M * RANKS, 4096)
    gm = trace(model, (), decompose=True, example_kwargs={"input_ids": ids, "labels": ids})
    return stage_graph(gm, "h100-nvlink-ib", RANKS), weight_state_for(gm, None)


def _cut(schedule: str, boundaries: tuple[str, ...] | None = None):  # type: ignore[no-untyped-def]
    graph, state = _deepseek_v3_16()
    return cut_graph(
        graph, pp=PP, microbatches=M, schedule=schedule, memory_limit=LIMIT, weight_state=state,
        recompute="selective", stage_boundaries=boundaries,
    )  # fmt: skip


def _layers(stage) -> int:  # type: ignore[no-untyped-def]
    return sum(u.startswith("model.layers.") for u in stage.units)


def test_zero_bubble_at_depth_16_is_slowed_by_its_cut_not_its_schedule() -> None:
    one, zb = _cut("1f1b"), _cut("zero-bubble")
    # 1F1B: one layer per stage, the head with the last (12.05 s against 9.28 s): bubble 0.294
    assert [_layers(s) for s in one.stages] == [1] * PP and one.stages[-1].units[-1] == "lm_head"
    assert [s.in_flight for s in one.stages] == list(range(PP, 0, -1))
    assert one.bubble == pytest.approx(0.294, abs=5e-3)
    # ZB-H1 holds 16 microbatches on every stage; with the head beside a layer the last rank would
    # need more than the limit, so ZB-H1 on 1F1B's cut does not fit
    assert [s.in_flight for s in zb.stages] == [PP] * PP
    on_ones = _cut("zero-bubble", one.boundaries)
    assert not on_ones.fits and on_ones.step_time < one.step_time  # (13.108 s against 13.382 s, were it to fit)
    # its own cut: the head alone (norm and head), so one stage holds two layers and sets the pace
    assert zb.fits and zb.stages[-1].units == ("model.norm", "lm_head")
    assert max(_layers(s) for s in zb.stages) == 2
    assert zb.max_stage_time == pytest.approx(2 * one.stages[1].time, rel=1e-6)
    # the bubble is that imbalance: at least 1 - mean / max of the stage times (the slowest stage
    # runs all M microbatches; the rest of the span is fill and drain), 0.491 of the 0.521
    sum_times = sum(s.time for s in zb.stages)
    floor = 1 - sum_times / PP / zb.max_stage_time
    assert floor == pytest.approx(0.491, abs=5e-3)
    assert floor <= zb.bubble == pytest.approx(0.521, abs=5e-3)
    assert zb.bubble == pytest.approx(1 - sum_times / (PP * zb.makespan), rel=1e-3)  # (transfers: posted, not busy)
    # the schedule is not the cause: on ZB's cut 1F1B is slower still
    assert _cut("1f1b", zb.boundaries).step_time > zb.step_time
