"""What `benchmarks/published.py` and `benchmarks/published_auto.py` both build for a published row
(`published_rows.Row`): its configuration in the library step model's terms (`config`), its model
on the meta device in bfloat16 (`build_model`), and its stage parts (`components`: one microbatch of
one data-parallel replica traced and cut into the row's stages, before the fitted constants)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from _common import on_meta
from published_rows import Row

from autopar.cost.hardware import Hardware, load_hardware
from autopar.cost.work import AttentionKernel
from autopar.planning.step_accounting import MIXED_ADAMW
from autopar.planning.step_model import StageParts, StepConfig, stage_parts

RECOMPUTE = {"full": "full", "selective-op": "selective", "none": "none"}


def config(row: Row) -> StepConfig:
    """The row's configuration in the library step model's terms."""
    return StepConfig(
        tensor=row.t, pipeline=row.p, data=row.d, microbatches=row.microbatches, v=row.v, schedule=row.schedule,
        tp_elements=row.microbatch * row.seq * row.hidden, tp_overlap=row.overlap_tp,
        recompute=RECOMPUTE[row.recompute], reduction=row.dp, reduction_overlap=row.overlap_dp,
        framework=row.framework, attention=row.attention,
        weight_state=replace(MIXED_ADAMW, grad=float(row.grad_bytes)),
    )  # fmt: skip


@dataclass(frozen=True)
class Components:
    """What the trace and the cut give for a row, before the constants."""

    row: Row
    stages: tuple[StageParts, ...]
    hw: Hardware
    trace_s: float
    cut_s: float


def build_model(row: Row) -> torch.nn.Module:
    if row.arch == "gpt":
        from examples.models import GPT, GPTConfig

        cfg = GPTConfig(vocab_size=row.vocab, block_size=row.seq, n_layer=row.layers, n_head=row.heads,
                        n_embd=row.hidden)  # fmt: skip
        model = on_meta(lambda: GPT(cfg))
        if not row.tied:
            with torch.device("meta"):
                model.lm_head.weight = torch.nn.Parameter(torch.empty(row.vocab, row.hidden))
        return model.to(torch.bfloat16)
    from examples.zoo import Llama, LlamaConfig

    lcfg = LlamaConfig(vocab_size=row.vocab, seq_len=row.seq, dim=row.hidden, n_layer=row.layers,
                       n_head=row.heads, n_kv_head=row.kv_heads, hidden=row.ffn, rope_base=500000.0)  # fmt: skip
    return on_meta(lambda: Llama(lcfg)).to(torch.bfloat16)


def components(row: Row, attention: AttentionKernel | None = None, framework: str | None = None) -> Components:
    """Trace one microbatch of one replica and split it into the row's stages (`stage_parts`),
    its causal attention priced as the row's kernel did it, or as `attention` and `framework`
    say (`--auto` prices the expert's configuration with autopar's own kernels too: flash
    attention by torch's SDPA, `framework="autopar"`)."""
    from autopar.passes.trace import trace

    hw = load_hardware(row.gpu)
    idx = torch.zeros(row.microbatch, row.seq, dtype=torch.long)
    start = time.process_time()
    gm = trace(build_model(row), (idx, idx), decompose=True)
    trace_s = time.process_time() - start
    start = time.process_time()
    cfg = config(row) if attention is None else replace(config(row), attention=attention)
    cfg = cfg if framework is None else replace(cfg, framework=framework)
    parts = stage_parts(gm, hw, cfg)
    return Components(row, parts, hw, trace_s, time.process_time() - start)
