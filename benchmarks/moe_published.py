"""Issue 35 item 5(b): the plan `mesh_shape="auto"` picks against the published EP/TP/PP
configuration of two MoE models, both priced by the same step model on the H100 table.

The published configurations (cited in docs/expert-parallel.md, "Against published configurations"):

- **Mixtral 8x7B** (Megatron-Core's MoE README, "Reference Best Parallel Mapping", MCore v0.8, 8xH100
  nodes): 64 GPUs, TP 1, EP 8, PP 4 (virtual 8), micro-batch 1 of 4096 tokens, all-to-all
  dispatcher, dropless, BF16.
- **DeepSeek-V3** (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.2): 2048 H800 GPUs,
  16-way pipeline (DualPipe), 64-way expert parallelism over 8 nodes, ZeRO-1 data parallelism, no
  tensor parallelism.

Both keep their pipeline depth here: what is compared is one pipeline stage's sub-mesh, 64/4 = 16
ranks for Mixtral and 2048/16 = 128 for DeepSeek-V3, for one micro-batch (one 4096-token sequence
per rank). The published sub-mesh is (dp, ep) = (2, 8) and (2, 64): the experts over "ep" (the
inner axis, inside a node for Mixtral, over 8 nodes for DeepSeek-V3) with the all-to-all dispatcher,
tokens over both axes, forced on the routed-experts ops; every other op is placed by the search on
that mesh (the published runs are data parallel there, TP 1, which the search may pick or beat).
"auto" is `autopar.plan(mesh_shape="auto", world_size=<the stage's ranks>)` with
`token_dispatch="auto"`, the same batch, memory limit (90% of an H100's 80 GB) and table.

Scaled down, said in the output: LAYERS transformer layers per stage instead of 8 (Mixtral) or
~4 (DeepSeek-V3, 61 over 16 stages), every one an MoE layer, with the embedding and the LM head of
the whole model on both sides alike (a middle stage has neither): per-layer costs are the same, the
embedding and head add the same work to both. DeepSeek-V3's attention is transformers'
`DeepseekV3Attention` (multi-head latent attention with its low-rank projections, q_lora_rank 1536,
kv_lora_rank 512) at the published sizes; its multi-token prediction module and FP8 GEMMs are not
modeled (bf16 everywhere). The models are built on the meta device: `plan` allocates no weights.

    python benchmarks/moe_published.py                       # both models (a few CPU minutes)
    python benchmarks/moe_published.py --models mixtral-8x7b

Writes benchmarks/results/moe_published.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import table, write_result  # noqa: E402

import autopar  # noqa: E402
from autopar.core.strategy import OpCall, Strategy  # noqa: E402
from autopar.rules import routed_experts  # noqa: E402
from autopar.rules.base import Requirement, RuleRegistry  # noqa: E402
from autopar.rules.registry import default_registry  # noqa: E402

HARDWARE = "h100-nvlink-ib"
LAYERS = 2
SEQ = 4096
MEMORY_LIMIT = 0.9 * 80e9


def mixtral_8x7b(layers: int = LAYERS) -> torch.nn.Module:
    """Mixtral 8x7B at its published sizes with `layers` transformer layers (32 in the model)."""
    config = transformers.MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=SEQ, attention_dropout=0.0,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config).to(torch.bfloat16)


def deepseek_v3(layers: int = LAYERS) -> torch.nn.Module:
    """DeepSeek-V3 at its published sizes with `layers` layers, every one MoE (61 in the model, the
    first 3 dense), without multi-token prediction."""
    config = transformers.DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=layers, first_k_dense_replace=0, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=SEQ, attention_dropout=0.0,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)


@dataclass(frozen=True)
class Published:
    """One published configuration, as the stage sub-mesh it runs each pipeline stage on."""

    make: Callable[[], torch.nn.Module]
    source: str
    cluster: str  # the whole published job
    stage_shape: tuple[int, ...]  # (dp, ep) of one pipeline stage
    vocab: int


PUBLISHED = {
    "mixtral-8x7b": Published(
        mixtral_8x7b,
        "Megatron-Core MoE README, Reference Best Parallel Mapping (MCore v0.8)",
        "64 H100: TP1 EP8 PP4 (VP8), MBS 1 x 4096, all-to-all",
        (2, 8),
        32000,
    ),
    "deepseek-v3": Published(
        deepseek_v3,
        "DeepSeek-V3 technical report (arXiv 2412.19437), 3.2",
        "2048 H800: PP16 (DualPipe), EP64 over 8 nodes, ZeRO-1 DP, TP1",
        (2, 64),
        129280,
    ),
}
NAMES = ("dp", "ep")


def experts_on(*axes: int) -> RuleRegistry:
    """The default rules with every routed-experts op's experts over exactly the mesh axes `axes`
    (one, or two: an expert group spanning both) and the tokens exchanged by all-to-all over them
    (the published placement)."""
    registry = default_registry().copy()

    def admits(call: OpCall, strategy: Strategy) -> bool:
        return routed_experts.expert_axes(call.op, strategy) == axes and (
            routed_experts.all_to_all_axes(call.op, strategy) == axes
        )

    for op in routed_experts.ROUTED_OPS:
        registry.require(op, Requirement(admits, f"the published placement: experts over mesh axes {axes}"))
    return registry


def _row(name: str, which: str, result: autopar.PlanResult, cpu: float) -> dict[str, Any]:
    experts = result.compiled.report.experts
    axes = ",".join(experts.axes) if experts is not None and experts.axes else "none (whole)"
    return {
        "model": name,
        "plan": which,
        "mesh": "x".join(map(str, result.mesh.shape)) + " (" + ",".join(result.mesh.axis_names) + ")",
        "experts_on": axes,
        "dispatcher": experts.dispatcher if experts is not None and experts.axes else "-",
        "step_ms": 1e3 * result.step_time,
        "comm_ms": 1e3 * result.comm_time,
        "compute_ms": 1e3 * result.compute_time,
        "memory_GB": result.memory.total / 1e9,
        "plan_cpu_s": cpu,
    }


def compare(name: str) -> list[dict[str, Any]]:
    """The published stage sub-mesh with its experts placement forced, and `auto` on as many ranks."""
    spec = PUBLISHED[name]
    ranks = spec.stage_shape[0] * spec.stage_shape[1]
    ids = torch.randint(spec.vocab, (ranks, SEQ), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids}
    rows = []
    start = time.process_time()
    torch.manual_seed(0)
    published = autopar.plan(
        spec.make(), spec.stage_shape, (), example_kwargs=kwargs, mesh_names=NAMES, memory_limit=MEMORY_LIMIT,
        planning=autopar.PlanOptions(hardware=HARDWARE, token_dispatch="auto", registry=experts_on(1)),
    )  # fmt: skip
    rows.append(_row(name, "published", published, time.process_time() - start))
    print(rows[-1], flush=True)
    start = time.process_time()
    torch.manual_seed(0)
    auto = autopar.plan(
        spec.make(), "auto", (), example_kwargs=kwargs, world_size=ranks, memory_limit=MEMORY_LIMIT,
        planning=autopar.PlanOptions(hardware=HARDWARE, token_dispatch="auto"),
    )  # fmt: skip
    rows.append(_row(name, "auto", auto, time.process_time() - start))
    rows[-1]["ratio_to_published"] = auto.step_time / published.step_time
    print(rows[-1], flush=True)
    if auto.mesh_choice is not None:
        print(auto.mesh_choice.table(), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(PUBLISHED), choices=list(PUBLISHED))
    args = parser.parse_args()
    rows = [row for name in args.models for row in compare(name)]
    columns = ["model", "plan", "mesh", "experts_on", "dispatcher", "step_ms", "comm_ms", "compute_ms", "memory_GB"]
    print(f"{LAYERS} MoE layers per stage, one micro-batch of {SEQ} tokens per rank, {HARDWARE}, bf16:")
    print(table(columns, [[f"{r[c]:.3f}" if isinstance(r[c], float) else r[c] for c in columns] for r in rows]))
    for name in args.models:
        pub, auto = (r for r in rows if r["model"] == name)
        print(f"{name}: auto / published modeled step = {auto['ratio_to_published']:.3f}")
    write_result(
        "moe_published",
        {
            "hardware": HARDWARE,
            "layers_per_stage": LAYERS,
            "seq": SEQ,
            "memory_limit": MEMORY_LIMIT,
            "published": {n: {"source": p.source, "cluster": p.cluster, "stage": p.stage_shape} for n, p in PUBLISHED.items()},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
