"""benchmarks/published.py: the table of published runs is well-formed and sourced, the calibrated
links and tables say where every number comes from, and one small configuration is priced end to
end with numbers checked by hand."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autopar.cost.formulas import collective_time
from autopar.cost.hardware import TABLES_DIR, load_hardware, span_link

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from published import UNFITTED, Constants, components, price, tp_layer_time  # noqa: E402
from published_rows import PTDP, ROWS, published_step  # noqa: E402


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


def test_a_small_row_priced_end_to_end_by_hand() -> None:
    # a 2-layer GPT on 4 A100s: t=2, p=1, d=2, two microbatches of one sequence, gradients
    # all-reduced after the flush, no recomputation
    row = replace(
        PTDP[0], key="tiny", layers=2, hidden=64, heads=4, vocab=128, seq=16, gpus=4, batch=4, microbatch=1,
        t=2, p=1, recompute="none", dp="allreduce", overlap_dp=False, overlap_tp=False,
    )  # fmt: skip
    hw = load_hardware("a100-calibrated")
    # one all-reduce of b s h = 1024 bf16 elements over 2 NVLink ranks: 2(g-1)/g N b / bw + 2(g-1) alpha
    tp = 2 * 0.5 * 1024 * 2 / 235e9 + 2 * 1.5e-6
    assert tp_layer_time(row, hw) == pytest.approx(tp)
    comp = components(row)
    (stage,) = comp.stages
    assert stage.layers == 2 and stage.mm_f > 0 and stage.el_f > 0
    priced = price(comp)
    # p = 1: the step runs m = 2 microbatches back to back, each with 4 all-reduces per layer
    per_mb = stage.mm_f + stage.el_f + stage.mm_b + stage.el_b + 2 * 4 * tp
    assert priced.pipeline == pytest.approx(2 * per_mb)
    params = stage.params  # elements per tensor rank
    dp = collective_time("all_reduce", params, 2, 2, hw.intra_node)  # d=2, ranks 2 apart: in a node
    assert dp == pytest.approx(2 * 0.5 * params * 2 / 235e9 + 2 * 1.5e-6)
    assert priced.dp_exposed == pytest.approx(dp)
    moved = 30 * params
    assert hw.kernels is not None
    assert priced.optimizer == pytest.approx(moved / (2.039e12 * hw.kernels.memory_fraction(moved)))
    assert priced.step == pytest.approx(priced.pipeline + dp + priced.optimizer)
    # the constants: eta scales matmuls, phi element-wise ops
    slow = price(comp, Constants({"a100-calibrated": 0.5}, {"megatron-2021": 0.0}))
    per_mb = 2 * (stage.mm_f + stage.mm_b) + 2 * 4 * tp
    assert slow.pipeline == pytest.approx(2 * per_mb)
    assert math.isfinite(price(comp, UNFITTED).states_gb)
