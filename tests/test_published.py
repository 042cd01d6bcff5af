"""benchmarks/published.py: the table of published runs is well-formed and sourced, the calibrated
links and tables say where every number comes from, and one small configuration is priced end to
end with numbers checked by hand."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.cost.formulas import compute_time
from autopar.cost.hardware import TABLES_DIR, load_hardware, span_link
from autopar.cost.work import (
    PLANNED_ATTENTION,
    AttentionKernel,
    compute_rate,
    global_work,
    is_causal_attention,
)
from autopar.passes.trace import trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _common import on_meta  # noqa: E402
from published import config  # noqa: E402
from published_rows import PTDP, ROWS, published_step  # noqa: E402
from test_step_accounting import STAGE0, STAGE1, gpt_bf16  # noqa: E402

from autopar.planning.stage_cut import Stage  # noqa: E402
from autopar.planning.stage_units import stage_graph  # noqa: E402
from autopar.planning.step_model import StageParts, StepConfig, price_step, stage_parts, unscaled  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402


def test_each_row_says_how_its_kernel_did_causal_attention() -> None:
    """Megatron-LM of 2021 computed every score and masked them (no flash attention): its rows
    are priced at full attention; Megatron-Core and torchtitan skip the masked blocks, as the
    planner assumes autopar's own runs do; every row names why."""
    for r in ROWS:
        assert r.attention == ("full" if r.framework == "megatron-2021" else "flash"), r.key
        assert config(r).attention == r.attention and r.attention_source, r.key
    assert StepConfig(tensor=1, pipeline=1, data=1, microbatches=1).attention == PLANNED_ATTENTION == "flash"


def test_a_causal_attention_is_priced_as_the_runs_kernel_does_it() -> None:
    """One GPT block at sequence 4096 (attention well above the launch floor): under "full" its
    forward and backward matmul time grows by exactly what its two attention calls cost at all
    the scores rather than their triangle, (s + 1) / (2 s) of the flops; element-wise time and
    the rest of the graph do not move."""
    model = on_meta(lambda: GPT(GPTConfig(vocab_size=256, block_size=4096, n_layer=1, n_head=4, n_embd=256)))
    idx = torch.zeros(1, 4096, dtype=torch.long)
    gm = trace(model.to(torch.bfloat16), (idx, idx), decompose=True)
    hw = load_hardware("a100-calibrated")
    cfg = StepConfig(tensor=1, pipeline=1, data=1, microbatches=1)
    (flash,) = stage_parts(gm, hw, cfg)
    (full,) = stage_parts(gm, hw, replace(cfg, attention="full"))
    calls = [n for n in gm.graph.nodes if is_causal_attention(n)]
    assert len(calls) == 2  # the forward call and its backward
    for n in calls:
        assert global_work(n, "flash") == pytest.approx(global_work(n, "full") * 4097 / 8192)
        assert global_work(n) == global_work(n, "flash")  # the planner's default

    def seconds(n: fx.Node, kernel: AttentionKernel) -> float:
        return compute_time(global_work(n, kernel), 0.0, compute_rate(n, kernel), unscaled(hw))

    fwd, bwd = calls
    assert full.mm_f - flash.mm_f == pytest.approx(seconds(fwd, "full") - seconds(fwd, "flash"))
    assert full.mm_b - flash.mm_b == pytest.approx(seconds(bwd, "full") - seconds(bwd, "flash"))
    assert full.mm_f - flash.mm_f > 0.15 * flash.mm_f  # the masked half is a fifth of the forward here
    assert (full.el_f, full.el_b) == pytest.approx((flash.el_f, flash.el_b))
    assert price_step((full,), replace(cfg, attention="full"), hw).step > price_step((flash,), cfg, hw).step
    with pytest.raises(AutoparError, match="attention"):
        StepConfig(tensor=1, pipeline=1, data=1, microbatches=1, attention="math")  # type: ignore[arg-type]


def test_rows_are_well_formed_and_sourced() -> None:
    assert len(ROWS) >= 10
    assert {r.gpu for r in ROWS} == {"a100-calibrated", "h100-calibrated", "h100-500w-calibrated"}
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


@pytest.mark.parametrize("name", ["a100-calibrated", "h100-calibrated", "h100-500w-calibrated", "h200-calibrated"])
def test_calibrated_tables_say_where_each_number_comes_from(name: str) -> None:
    data = json.loads((TABLES_DIR / f"{name}.json").read_text())
    needed = {"peak_flops", "memory_bandwidth", "memory_capacity", "intra_node.bandwidth", "intra_node.alpha",
              "inter_node.bandwidth", "inter_node.alpha", "kernels.matmul", "kernels.memory", "kernels.launch",
              "kernels.attention.fa2", "kernels.attention.default", "kernels.attention.by_framework"}  # fmt: skip
    assert needed <= set(data["source"])
    assert "2407.08608" in data["source"]["kernels.attention.fa2"]  # the FlashAttention-3 paper's figures
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


def _parts(params: float) -> StageParts:
    """One stage per microbatch, by hand: 1 / 2 ms of matmul forward / backward (1 ms of it on the
    input-gradient path), 0.4 / 0.8 ms element-wise; its 2 blocks' forward 0.8 ms matmul + 0.2 ms."""
    stage = Stage(index=0, rank=0, units=("wte", "blocks.0", "blocks.1", "head"), forward=0.0, backward=0.0,
                  backward_input=0.0, param_bytes=0.0, state_bytes=0.0, activation_bytes=0.0,
                  fixed_activation_bytes=0.0, in_flight=1, send=(), send_bytes=0.0, shared=())  # fmt: skip
    return StageParts(stage, 1e-3, 2e-3, 1e-3, 4e-4, 8e-4, 4e-4, 8e-4, 2e-4, 2, 4, params)


def test_the_library_step_model_by_hand() -> None:
    hw = load_hardware("a100-calibrated")
    assert hw.kernels is not None
    sp = _parts(1e6)
    eta, phi = 0.5, 0.25
    tp = 2 * 0.5 * 1024 * 2 / 235e9 + 2 * 1.5e-6  # one all-reduce of 1024 bf16 over t=2 on NVLink
    base = StepConfig(tensor=2, pipeline=1, data=2, microbatches=2, tp_elements=1024)
    fwd = 1e-3 / eta + phi * 4e-4 + 2 * 2 * tp  # two blocks, two all-reduces each
    bwd = 2e-3 / eta + phi * 8e-4 + 2 * 2 * tp
    reduce = 2 * 0.5 * 1e6 * 4 / 235e9 + 2 * 1.5e-6  # fp32 gradients over d=2 in a node
    adam = 30e6 / (2.039e12 * hw.kernels.memory_fraction(30e6))
    plain = price_step((sp,), base, hw, eta=eta, phi=phi)
    assert plain.pipeline == pytest.approx(2 * (fwd + bwd))
    assert plain.step == pytest.approx(2 * (fwd + bwd) + reduce + adam)  # not overlapped: all exposed
    assert plain.state_bytes == 18e6
    # full recomputation: the blocks' forward and its collectives again in backward
    full = price_step((sp,), replace(base, recompute="full"), hw, eta=eta, phi=phi)
    assert full.pipeline == pytest.approx(2 * (fwd + bwd + 8e-4 / eta + phi * 2e-4 + 2 * 2 * tp))
    # selective: every second matmul and the element-wise ops of the blocks' forward
    sel = price_step((sp,), replace(base, recompute="selective"), hw, eta=eta, phi=phi)
    assert sel.pipeline == pytest.approx(2 * (fwd + bwd + 0.5 * 8e-4 / eta + phi * 2e-4))
    # distributed optimizer, overlapped: RS of fp32 grads against the last backward in 4 buckets,
    # AG of bf16 weights against the first forward; master + AdamW and the step split over d
    dist = price_step((sp,), replace(base, reduction="distopt", reduction_overlap=True), hw, eta=eta, phi=phi)
    rs = 0.5 * 1e6 * 4 / 235e9 + 1.5e-6
    ag = 0.5 * 1e6 * 2 / 235e9 + 1.5e-6
    exposed = max(rs - bwd + bwd / 4, rs / 4) + max(ag - fwd + fwd / 4, ag / 4)
    adam_half = 15e6 / (2.039e12 * hw.kernels.memory_fraction(15e6))
    assert dist.exposed == pytest.approx(exposed)
    assert dist.step == pytest.approx(2 * (fwd + bwd) + exposed + adam_half)
    assert dist.state_bytes == 1e6 * (2 + 4 + 12 / 2)
    # FSDP overlapped: hidden behind the busy step; all 18 bytes split over d
    fsdp = price_step((sp,), replace(base, reduction="fsdp", reduction_overlap=True), hw, eta=eta, phi=phi)
    assert fsdp.exposed == 0.0 and fsdp.state_bytes == 9e6
    # the table's constants by default; a framework without a factor pays 1
    assert price_step((sp,), base, hw).step == pytest.approx(
        price_step((sp,), base, hw, eta=hw.kernels.sustained_matmul, phi=1.0).step
    )


def test_auto_gets_each_rows_model_batch_microbatches_cluster_and_memory() -> None:
    """`--auto`'s mapping of a row onto `choose_pipeline_mesh`'s arguments (benchmarks/published_auto.py)."""
    from published_auto import auto_call, why

    from autopar.planning.step_accounting import MIXED_ADAMW

    by_key = {r.key: r for r in ROWS}
    ptdp = auto_call(by_key["PTD-P 1.7B"])  # 32 A100s, batch 512, t=1 p=1 d=32, full recomputation
    assert (ptdp.world_size, ptdp.batch, ptdp.seq, ptdp.microbatches) == (32, 512, 2048, 16)
    assert ptdp.hardware == "a100-calibrated" and ptdp.memory_limit == 80e9  # the table's memory
    # the same weight state as the expert's; every recomputation the planner has, the fastest that fits
    assert ptdp.weight_state == MIXED_ADAMW and ptdp.recompute == "auto"
    assert ptdp.depths() == [2, 4, 8]  # beside the tensor-only choice (pp 1), as plan() ranks, up to 8
    tokens, targets = ptdp.example()
    assert tokens.shape == targets.shape == (512, 2048)
    mcore = auto_call(by_key["Mcore 70B"])  # 768 H100s, batch 384, t=8 p=2 d=48: 8 microbatches
    assert (mcore.world_size, mcore.microbatches, mcore.hardware) == (768, 8, "h100-calibrated")
    titan = auto_call(by_key["torchtitan 8B x8"])  # selective recomputation: in the planner's space too
    assert (titan.batch, titan.seq, titan.microbatches, titan.recompute) == (16, 8192, 1, "auto")
    assert (titan.hardware, titan.memory_limit) == ("h100-500w-calibrated", 96e9)  # 96 GB HBM2e at 500 W
    # where auto does not win by 10 %, the reason names its pick and the candidate at the expert's depth
    expert = {"p": 2}
    cands = [
        {"pp": 1, "stage_mesh": "8x4 (x,y)", "schedule": "-", "v": 1, "error": "", "fits": True, "recompute": "search",
         "bubble": 0.0, "factor": 1.0},
        {"pp": 2, "stage_mesh": "16 ranks", "schedule": "-", "v": 1, "error": "not priced: ideal cut 2 s > best 1 s"},
    ]
    assert why(expert, cands, 1.5) == ""
    assert why(expert, cands, 1.0) == (
        "auto picks pp 1 8x4 (x,y) - v1 (recompute search, bubble 0.00, sub-mesh factor 1.00); "
        "at the expert's depth pp 2: not priced: ideal cut 2 s > best 1 s"
    )
    assert "not among the depths priced" in why({"p": 4}, cands, 0.9)
    assert why(expert, [cands[1]], 0.0) == "no candidate fits: not priced: ideal cut 2 s > best 1 s"


def test_a_plan_over_the_memory_limit_is_never_reported_as_the_winner() -> None:
    """`run_row` hands `report` no step where the chosen candidate does not fit (`auto_step_s` None):
    the table says so, with no speedup, and the summary counts it apart from the rows auto wins or
    loses."""
    from published_auto import report

    row = {"key": "r", "gpus": 32, "expert": {"t": 1, "p": 1, "d": 32}, "expert_step_s": 3.0,
           "expert_framework_step_s": 3.1, "auto_mesh": "4x8 (x,y)", "auto_schedule": "-", "auto_v": 1,
           "auto_recompute": "search", "auto_step_s": None, "auto_memory_gb": None, "speedup": 0.0,
           "why": "no candidate fits: over the memory limit"}  # fmt: skip
    _, body, summary = report([row])
    assert body[0][5] == "none fits" and body[0][8] == "-" and body[0][9] == "-"
    assert summary["no_fitting_candidate"] == 1 and summary["slower"] == summary["at_least_1.1x"] == 0


def test_a_row_without_a_result_says_whether_its_cpu_limit_ended_it() -> None:
    """A child killed by its CPU limit (SIGXCPU at the soft limit, SIGKILL at the hard one) is
    "not finished in" the limit; one ended otherwise (by hand, out of memory) says after how much
    CPU, so a row stopped early is never reported as having used its whole limit."""
    import signal

    from published_auto import not_finished

    assert not_finished(-signal.SIGXCPU, 600, 600.4) == "not finished in 600 s CPU"
    assert not_finished(-signal.SIGKILL, 600, 610.0) == "not finished in 600 s CPU"
    assert not_finished(-signal.SIGTERM, 600, 172.0) == "stopped after 172 s CPU of its 600 (exit -15)"
    assert not_finished(-signal.SIGKILL, 600, 90.0) == "stopped after 90 s CPU of its 600 (exit -9)"


def test_attention_is_priced_at_its_kernels_published_rates() -> None:
    """A flash attention call runs at the published rate of the kernel its framework uses (the
    FlashAttention-3 paper's H100 figures), far below a matmul of the same flops: FA2 (torch's
    SDPA) by default, cuDNN under Megatron-Core's Transformer Engine; between two measured head
    dims the rate is interpolated; the 500 W H100 runs the same fractions of its lower peak; a
    table without curves, and Megatron-LM 2021's full scores, price it as a matmul."""
    from autopar.cost.hardware import Attention

    h100 = unscaled(load_hardware("h100-calibrated"))
    flops = 4.0 * 2 * 32 * 4096 * 4096 * 128 * 4097 / 8192  # one causal forward, b=2, h=32, s=4096, d=128
    fwd = Attention(torch.bfloat16, 128, 4096, backward=False, causal=True)
    assert compute_time(flops, 0.0, fwd, h100) == pytest.approx(flops / 319e12, rel=1e-3)  # FA2's bar: 319 TFLOP/s
    mcore = unscaled(load_hardware("h100-calibrated"), "mcore-r0.8")
    assert compute_time(flops, 0.0, fwd, mcore) == pytest.approx(flops / 518e12, rel=1e-3)  # cuDNN's bar: 518
    matmul = compute_time(flops, 0.0, torch.bfloat16, h100)
    assert compute_time(flops, 0.0, fwd, h100) > 1.8 * matmul  # FA2 reaches a third of the peak
    # non-causal backward at 8k, head dim 64 (FA2: 287); the causal one derived below it
    bwd = Attention(torch.bfloat16, 64, 8192, backward=True, causal=False)
    assert compute_time(1e12, 0.0, bwd, h100) == pytest.approx(1e12 / 287e12, rel=1e-3)
    assert compute_time(1e12, 0.0, replace(bwd, causal=True), h100) > compute_time(1e12, 0.0, bwd, h100)
    # the fractions are the bars' labels over 989, to 4 digits
    # head dim 96 lies between 64 (321) and 128 (368) at 4k, non-causal forward, linear in log(d)
    rate = h100.kernels.attention_fraction(Attention(torch.bfloat16, 96, 4096)) * 989  # type: ignore[union-attr]
    assert rate == pytest.approx(321 + (368 - 321) * 0.5849625, rel=1e-3)  # log2(96/64) = 0.585
    # the power-capped H100: the same fractions of its own 912 TFLOP/s
    capped = unscaled(load_hardware("h100-500w-calibrated"))
    assert compute_time(flops, 0.0, fwd, capped) == pytest.approx(flops / (319e12 * 912 / 989), rel=1e-3)
    # no curves (a spec-sheet table): the peak, as for a matmul
    sheet = load_hardware("h100-nvlink-ib")
    assert compute_time(flops, 0.0, fwd, sheet) == compute_time(flops, 0.0, torch.bfloat16, sheet)
    # the traced call: flash -> its Attention key; Megatron-LM 2021's full scores -> the matmul rate
    model = on_meta(lambda: GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=1, n_head=4, n_embd=256)))
    idx = torch.zeros(1, 256, dtype=torch.long)
    gm = trace(model.to(torch.bfloat16), (idx, idx), decompose=True)
    f, b = [n for n in gm.graph.nodes if is_causal_attention(n)]
    assert compute_rate(f) == Attention(torch.bfloat16, 64, 256, backward=False, causal=True)
    assert compute_rate(b) == Attention(torch.bfloat16, 64, 256, backward=True, causal=True)
    assert compute_rate(f, "full") == torch.bfloat16
