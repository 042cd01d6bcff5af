"""benchmarks/published.py: the table of published runs is well-formed and sourced, the calibrated
links and tables say where every number comes from, and one small configuration is priced end to
end with numbers checked by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from autopar.cost.hardware import TABLES_DIR, load_hardware, span_link

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from published import config  # noqa: E402
from published_rows import PTDP, ROWS, published_step  # noqa: E402
from test_step_accounting import STAGE0, STAGE1, gpt_bf16  # noqa: E402

from autopar.planning.stage_units import stage_graph  # noqa: E402
from autopar.planning.step_model import StepConfig, price_step, stage_parts, unscaled  # noqa: E402


def test_rows_are_well_formed_and_sourced() -> None:
    assert len(ROWS) >= 10
    assert {r.gpu for r in ROWS} == {"a100-calibrated", "h100-calibrated"}
    assert min(r.gpus for r in ROWS) == 8 and max(r.gpus for r in ROWS) >= 1000
    keys = [r.key for r in ROWS]
    assert len(set(keys)) == len(keys)
    for r in ROWS:
        assert r.t * r.p * r.d == r.gpus, r.key
        assert r.batch % (r.d * r.microbatch) == 0 and r.microbatches >= 1, r.key
        assert "https://" in r.source and r.convention and r.published > 0, r.key
        assert r.unit in ("TFLOP/s/GPU", "tokens/s/GPU") and r.split in ("fit", "held-out"), r.key
    for framework in {r.framework for r in ROWS if r.split == "fit"}:
        assert any(r.framework == framework and r.split == "held-out" for r in ROWS)


def test_published_step_of_the_trillion_row_by_hand() -> None:
    # 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) FLOPs at 163 TFLOP/s on each of 3072 GPUs
    one_t = next(r for r in PTDP if r.key == "PTD-P 1T")
    s, L, h, V, B = 2048, 128, 25600, 51200, 3072
    flops = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert published_step(one_t) == pytest.approx(flops / (163e12 * 3072))
    assert published_step(one_t) == pytest.approx(102.63, abs=0.01)


def test_span_link_by_group_span() -> None:
    a100 = load_hardware("a100-calibrated")
    assert span_link(a100, 8, 1) == a100.intra_node  # one node
    assert span_link(a100, 16, 8).bandwidth == a100.inter_node.bandwidth  # rail-aligned: one NIC each
    four = span_link(a100, 8, 2)  # two nodes, four members in each: four rings on four NICs
    assert four.bandwidth == 4 * a100.inter_node.bandwidth and four.alpha == a100.inter_node.alpha
    assert span_link(a100, 64, 1).bandwidth == min(a100.intra_node.bandwidth, 8 * a100.inter_node.bandwidth)


@pytest.mark.parametrize("name", ["a100-calibrated", "h100-calibrated"])
def test_calibrated_tables_say_where_each_number_comes_from(name: str) -> None:
    data = json.loads((TABLES_DIR / f"{name}.json").read_text())
    needed = {"peak_flops", "memory_bandwidth", "memory_capacity", "intra_node.bandwidth", "intra_node.alpha",
              "inter_node.bandwidth", "inter_node.alpha", "kernels.matmul", "kernels.memory", "kernels.launch"}  # fmt: skip
    assert needed <= set(data["source"])
    hw = load_hardware(name)
    assert hw.kernels is not None and hw.intra_node.bandwidth < 450e9  # bus bandwidth, not line rate


def test_the_constants_are_in_the_tables_and_the_planner_sees_eta() -> None:
    a100 = load_hardware("a100-calibrated")
    assert a100.kernels is not None and 0.5 < a100.kernels.sustained_matmul <= 1.0
    assert a100.kernels.elementwise("autopar") == 1.0  # autopar's unfused runtime pays it all
    assert "fitted on published rows" in a100.source["kernels.sustained_matmul"]
    # a matmul on the table runs at the measured curve times eta: what stage_graph prices with
    flops = 1e12
    base = unscaled(a100).kernels
    assert base is not None and base.sustained_matmul == 1.0
    assert a100.kernels.matmul_fraction("bfloat16", flops) == pytest.approx(
        base.matmul_fraction("bfloat16", flops) * a100.kernels.sustained_matmul
    )


def test_a_row_maps_onto_the_library_step_model() -> None:
    one_t = next(r for r in PTDP if r.key == "PTD-P 1T")
    cfg = config(one_t)
    assert (cfg.tensor, cfg.pipeline, cfg.data, cfg.microbatches) == (8, 64, 6, 512)
    assert cfg.tp_elements == 2048 * 25600 and cfg.recompute == "full" and cfg.reduction == "allreduce"
    assert cfg.framework == "megatron-2021"


def test_a_small_row_priced_end_to_end_by_hand() -> None:
    # the 2-layer GPT of test_step_accounting (traced once, shared) as one replica's microbatch of
    # 8 sequences of 16 on 4 A100s: t=2, p=1, d=2, two microbatches, all-reduce after the flush
    gm = gpt_bf16()
    hw = load_hardware("a100-calibrated")
    cfg = StepConfig(tensor=2, pipeline=1, data=2, microbatches=2, tp_elements=8 * 16 * 32, framework="megatron-2021")
    (stage,) = stage_parts(gm, hw, cfg)
    # the split adds up to the stage graph at the measured rates; every parameter is on the stage
    whole = stage_graph(gm, unscaled(hw), 2)
    assert stage.mm_f + stage.el_f == pytest.approx(sum(u.forward for u in whole.units))
    assert stage.mm_b + stage.el_b == pytest.approx(sum(u.backward for u in whole.units))
    assert stage.mm_f > 0 and stage.el_f > 0 and stage.layers == 2
    assert stage.params == (STAGE0 + STAGE1 - 2048) / 2  # the tied head counted once, split over t
    priced = price_step((stage,), cfg, hw)
    assert hw.kernels is not None
    eta, phi = hw.kernels.sustained_matmul, hw.kernels.elementwise("megatron-2021")
    tp = 2 * 0.5 * 8 * 16 * 32 * 2 / 235e9 + 2 * 1.5e-6  # 2(g-1)/g N b / bw + 2(g-1) alpha
    per_mb = (stage.mm_f + stage.mm_b) / eta + phi * (stage.el_f + stage.el_b) + 2 * 4 * tp
    assert priced.pipeline == pytest.approx(2 * per_mb)
    reduce = 2 * 0.5 * stage.params * 4 / 235e9 + 2 * 1.5e-6  # fp32 gradients, d=2 in a node
    optimizer = 30 * stage.params / (2.039e12 * hw.kernels.memory_fraction(30 * stage.params))
    assert priced.exposed == pytest.approx(reduce) and priced.optimizer == pytest.approx(optimizer)
    assert priced.step == pytest.approx(2 * per_mb + reduce + optimizer)
