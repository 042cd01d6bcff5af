"""Issue 35: whole pipelined MoE jobs, the published layout against the one `auto` picks, both priced
by the library's pipeline-depth accounting (`autopar.compiler.pipeline_mesh.choose_pipeline_mesh`:
the stage sub-mesh's plan per microbatch, the schedule simulated with its bubble, recomputation,
the data axis's gradient reduction once per step, the weight state and the optimizer step).

- **Mixtral 8x7B** (Megatron-Core's MoE README, "Reference Best Parallel Mapping", MCore v0.8):
  64 H100, TP 1, EP 8, PP 4 with VP 8 (interleaved 1F1B, one layer per virtual stage), micro-batch
  1 x 4096 tokens, global batch 256, all-to-all dispatcher, BF16. Each stage runs on 16 ranks,
  (dp, ep) = (2, 8); 256 / 16 = 16 microbatches.
- **DeepSeek-V3** (technical report, arXiv 2412.19437, 3.2 and 4.2): 2048 H800, PP 16 (DualPipe),
  EP 64 over 8 nodes, ZeRO-1 data parallelism, TP 1, batch 15360 sequences of 4096 tokens. Each
  stage runs on 128 ranks, (dp, ep) = (2, 64). The micro-batch is not published: one sequence per
  rank is taken (128 sequences per microbatch, 120 microbatches). DualPipe is not modeled: the
  published side gets the fastest of 1F1B and zero-bubble (1 and 2 stages per rank).
- **DeepSeek-V3 on 256 GPUs** ("deepseek-v3-256"): two of the report's stages, PP 2 x (dp 2, ep 64),
  with its 120 microbatches of 128 sequences; at `--layers 8` a stage holds 4 layers, as the
  report's 61 over 16 stages (3.8). What the depth cut changes: the bubble's share (1 stage of 2
  idle at the ends instead of 15 of 16) and the data axis's ranks (2 per stage either way).
- **Megatron-Bridge's DeepSeek-V3 recipe on 32 nodes** ("deepseek-v3-bridge",
  `deepseek_v3_pretrain_config_32nodes`): 256 H100, TP 2, PP 8, EP 32 with expert TP 1 (the expert
  group spans each stage's 16 data and 2 tensor ranks), sequence parallel, micro-batch 1 x 4096 per
  data rank, global batch 4096 (256 microbatches of 16 sequences), all-to-all dispatcher, 1F1B (no
  virtual stages); the recipe recomputes fully (both sides here take the fastest mode that fits).
  Each stage runs on (dp, tp) = (16, 2) with the experts over both axes (`experts_on(0, 1)`).

The published side is `choose_pipeline_mesh` restricted to its depth, its stage sub-mesh with the
experts over its expert axes ("ep"; both axes for the Bridge recipe) by the all-to-all dispatcher (`moe_published.experts_on`: every other op placed
by the search on that mesh) and its schedule(s), no tensor-only candidate. "auto" is the same call
over the depths of `--depths` (and the tensor-only mesh choice unless `--no-tensor-only`), every
stage sub-mesh, every schedule of `AUTO_CANDIDATES`, `token_dispatch="auto"`. Same model, batch,
microbatches, memory limit (90 % of 80 GB) and table ("h100-nvlink-ib"); recomputation "auto" on
both sides (none, selective or full, the fastest that fits).

Scaled down for CPU time, said in the output: `--layers` transformer layers (every one MoE), the
embedding and the LM head whole; the memory limit is not scaled. `--microbatches` overrides the
published count (and the global batch with it).

    python benchmarks/moe_pipelined.py --models mixtral-8x7b --layers 32 --depths 4 8  # 280 CPU s
    python benchmarks/moe_pipelined.py --models deepseek-v3-256 --layers 8 --depths 2 4 --no-tensor-only  # 252 CPU s
    python benchmarks/moe_pipelined.py --models deepseek-v3-bridge --layers 16 --depths 4 8 --no-tensor-only
    python benchmarks/moe_pipelined.py --models deepseek-v3 --layers 16 --depths 8 16 --no-tensor-only  # 576 CPU s

Writes benchmarks/results/moe_pipelined.json ("runs": the last run of each model and layer count).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, table, write_result  # noqa: E402
from moe_published import HARDWARE, MEMORY_LIMIT, NAMES, SEQ, deepseek_v3, experts_on, mixtral_8x7b  # noqa: E402

from autopar.compiler.pipeline_mesh import PipelineCandidate, choose_pipeline_mesh  # noqa: E402


@dataclass(frozen=True)
class Job:
    """A published pipelined job: its ranks, depth, stage sub-mesh (dp, ep), schedules and batch."""

    make: Callable[[int], torch.nn.Module]
    source: str
    layers: int  # the model's
    world: int
    pp: int
    stage: tuple[int, int]
    schedules: tuple[tuple[str, int], ...]  # (name, virtual stages); v = 0: one layer per virtual stage
    microbatches: int
    vocab: int
    names: tuple[str, str] = NAMES  # the stage sub-mesh's axes
    experts: tuple[int, ...] = (1,)  # the stage axes holding the experts (tokens exchanged by all-to-all)
    sequences: int = 0  # sequences per microbatch (0: one per stage rank)


JOBS = {
    "mixtral-8x7b": Job(
        mixtral_8x7b, "Megatron-Core MoE README, Reference Best Parallel Mapping (MCore v0.8): "
        "64 H100, TP1 EP8 PP4 VP8, MBS 1, GBS 256, all-to-all", 32, 64, 4, (2, 8),
        (("interleaved-1f1b", 0),), 16, 32000,
    ),  # fmt: skip
    "deepseek-v3": Job(
        deepseek_v3, "DeepSeek-V3 report (arXiv 2412.19437) 3.2/4.2: 2048 H800, PP16 DualPipe, EP64, "
        "ZeRO-1 DP, TP1, batch 15360 x 4096", 61, 2048, 16, (2, 64),
        (("1f1b", 1), ("zero-bubble", 1), ("zero-bubble", 2)), 120, 129280,
    ),  # fmt: skip
    # 256 of the 2048 GPUs: two of the report's 128-rank stages (dp 2 x ep 64) and its 120 microbatches;
    # at 8 layers a stage holds 4, as the report's 61 over 16 stages (3.8)
    "deepseek-v3-256": Job(
        deepseek_v3, "DeepSeek-V3 report (arXiv 2412.19437) 3.2/4.2, depth cut 16 -> 2: 256 GPUs, PP2, "
        "stage dp 2 x EP64, ZeRO-1 DP, TP1, 120 microbatches of 128 x 4096", 61, 256, 2, (2, 64),
        (("1f1b", 1), ("zero-bubble", 1), ("zero-bubble", 2)), 120, 129280,
    ),  # fmt: skip
    # Megatron-Bridge's 32-node recipe: TP 2 x DP 16 per stage, the 32-way expert group spanning both
    # (ETP 1), micro-batch 1 per data rank (16 sequences per microbatch), 4096 / 16 = 256 microbatches
    "deepseek-v3-bridge": Job(
        deepseek_v3, "Megatron-Bridge recipe deepseek_v3_pretrain_config_32nodes: 256 H100, TP2 PP8 EP32 "
        "(ETP1: experts over DP x TP), SP, MBS 1, GBS 4096 x 4096, all-to-all, 1F1B, full recompute", 61, 256, 8,
        (16, 2), (("1f1b", 1),), 256, 129280, names=("dp", "tp"), experts=(0, 1), sequences=16,
    ),  # fmt: skip
}


def _schedules(job: Job, layers: int) -> list[tuple[str, int]]:
    """The job's schedules, v = 0 resolved to one layer per virtual stage (VP8 of 32 layers on PP4)."""
    return [(name, v if v else max(1, layers // job.pp)) for name, v in job.schedules]


def _row(name: str, which: str, c: PipelineCandidate, cpu: float, tokens: int) -> dict[str, Any]:
    return {
        "model": name,
        "plan": which,
        "pp": c.pp,
        "stage_mesh": c.stage_mesh,
        "experts_on": c.experts_on,
        "schedule": f"{c.schedule} v{c.v}",
        "recompute": c.recompute,
        "step_s": c.step_time,
        "bubble": c.bubble,
        "factor": c.factor,
        "memory_GB": c.memory / 1e9,
        "fits": c.fits,
        "error": c.error,
        "tokens_per_s_per_gpu": tokens / c.step_time if c.step_time > 0 else 0.0,
        "plan_cpu_s": cpu,
    }


def compare(
    name: str, layers: int, microbatches: int | None, depths: Sequence[int], tensor_only: bool, searched: int
) -> tuple[list[dict[str, Any]], str]:
    """The published job, then `auto` over `depths`, on the same model and batch."""
    job = JOBS[name]
    m = microbatches or job.microbatches
    per_micro = job.sequences or job.stage[0] * job.stage[1]  # default: one sequence per stage rank
    batch = m * per_micro
    # every sequence reads the same ids (a stride-0 view): the plan depends on shapes only
    ids = torch.randint(job.vocab, (1, SEQ), generator=torch.Generator().manual_seed(1)).expand(batch, SEQ)
    kwargs = {"input_ids": ids, "labels": ids}
    common: dict[str, Any] = {
        "example_kwargs": kwargs, "microbatches": m, "hardware": HARDWARE, "memory_limit": MEMORY_LIMIT,
        "token_dispatch": "auto", "searched_candidates": searched,
    }  # fmt: skip
    tokens = batch * SEQ // job.world
    start = time.process_time()
    torch.manual_seed(0)
    published = choose_pipeline_mesh(
        job.make(layers), job.world, (), depths=[job.pp], stage_meshes=[(job.stage, job.names)],
        schedules=_schedules(job, layers), with_tensor_only=False, registry=experts_on(*job.experts), **common,
    )  # fmt: skip
    rows = [_row(name, "published", published.chosen, time.process_time() - start, tokens)]
    print(published.table(), flush=True)
    start = time.process_time()
    torch.manual_seed(0)
    auto = choose_pipeline_mesh(job.make(layers), job.world, (), depths=list(depths), with_tensor_only=tensor_only, **common)
    rows.append(_row(name, "auto", auto.chosen, time.process_time() - start, tokens))
    rows[-1]["ratio_to_published"] = rows[-1]["step_s"] / rows[0]["step_s"]
    print(auto.table(), flush=True)
    return rows, auto.table()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--layers", type=int, default=8, help="transformer layers of the model (a multiple of pp)")
    parser.add_argument("--microbatches", type=int, default=None, help="default: the published count")
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8], help="pipeline depths auto ranks")
    parser.add_argument("--no-tensor-only", action="store_true", help="auto leaves out the tensor-only mesh choice")
    parser.add_argument("--searched", type=int, default=2, help="meshes searched per stage sub-mesh choice")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    tables: dict[str, str] = {}
    for name in args.models:
        got, tables[name] = compare(name, args.layers, args.microbatches, args.depths, not args.no_tensor_only, args.searched)
        rows += got
        print(got, flush=True)
    columns = ["model", "plan", "pp", "stage_mesh", "experts_on", "schedule", "recompute", "step_s", "bubble", "factor", "memory_GB"]
    print(f"{args.layers} layers, {HARDWARE}, bf16, memory limit {MEMORY_LIMIT / 1e9:.0f} GB, auto depths {args.depths}"
          f"{'' if not args.no_tensor_only else ' (no tensor-only candidate)'}:")  # fmt: skip
    print(table(columns, [[f"{r[c]:.3f}" if isinstance(r[c], float) else r[c] for c in columns] for r in rows]))
    for r in rows:
        if "ratio_to_published" in r:
            print(f"{r['model']}: auto / published modeled step = {r['ratio_to_published']:.3f}")
    # one run per model and depth is what fits the CPU: keep the others' last runs in the file
    path = RESULTS / "moe_pipelined.json"
    runs = json.loads(path.read_text()).get("runs", {}) if path.exists() else {}
    for name in args.models:
        runs[f"{name}, {args.layers} layers"] = {
            "layers": args.layers, "auto_depths": args.depths, "tensor_only": not args.no_tensor_only,
            "searched": args.searched, "rows": [r for r in rows if r["model"] == name], "auto_table": tables[name],
        }  # fmt: skip
    write_result(
        "moe_pipelined",
        {
            "hardware": HARDWARE, "seq": SEQ, "memory_limit": MEMORY_LIMIT,
            "jobs": {n: {**asdict(j), "make": j.make.__name__} for n, j in JOBS.items()}, "runs": runs,
        },
    )  # fmt: skip

if __name__ == "__main__":
    main()
