"""Memory and step time of the LLaMA-7B shape on 64 H100s, with and without activation recomputation.

The model of the issue: `examples.zoo.Llama` at LLaMA-7B's shape (dim 4096, 32 layers, 32 heads,
hidden 11008, vocabulary 32000), batch 16 x 2048 tokens, built on the meta device and planned by
`autopar.plan` (the search planner) for 64 ranks of the H100 table, in this process. For each mesh
and memory limit the table gives the modeled memory per rank (parameters, gradients and AdamW states
are the same for every row; saved activations are what recomputation changes), what was recomputed
(blocks: whole layers run again in backward; ops: single cheap ops), and the modeled step time
without overlap and with the schedule stage's overlap (`PlanResult.overlap()`), beside the planning
time. "none" is the default limit (90% of the table's 80 GB), under which nothing needs recomputing.

    python benchmarks/recompute_memory.py                     # ~4 min: meshes 4x4x4 and 2x4x8, 4 limits
    python benchmarks/recompute_memory.py --meshes 4,4,4 --limits none 8

Writes benchmarks/results/recompute_memory.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import on_meta, table, write_result  # noqa: E402

import autopar  # noqa: E402
from examples.zoo import Llama, LlamaConfig  # noqa: E402

CONFIG = LlamaConfig(vocab_size=32000, seq_len=2048, dim=4096, n_layer=32, n_head=32, n_kv_head=32, hidden=11008)
BATCH = 16
HARDWARE = "h100-nvlink-ib"
GB = 1e9


def measure(mesh: tuple[int, ...], limit_gb: float | None) -> dict[str, Any]:
    model = on_meta(lambda: Llama(CONFIG))
    idx = torch.zeros(BATCH, CONFIG.seq_len, dtype=torch.long)
    wall, cpu = time.perf_counter(), time.process_time()
    result = autopar.plan(
        model, mesh, (idx, idx), planning=autopar.PlanOptions(hardware=HARDWARE), memory_limit=None if limit_gb is None else limit_gb * GB
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    saved = result.compiled.report.activations
    assert saved is not None
    units = saved.recomputed
    overlap = result.overlap()
    return {
        "mesh": list(mesh),
        "limit_gb": limit_gb,
        "memory_gb": result.memory.total / GB,
        "weight_state_gb": (result.memory.params + result.memory.grads + result.memory.optimizer) / GB,
        "activations_before_gb": (saved.before if saved.before is not None else saved.after) / GB,
        "activations_gb": saved.after / GB,
        "recomputed_blocks": sum(u.startswith("block:") for u in units),
        "recomputed_ops": sum(u.startswith("op:") for u in units),
        "ops_copied_into_backward": saved.copied_ops,
        "step_ms_no_overlap": result.step_time * 1e3,
        "step_ms_scheduled": overlap["scheduled"]["step_time"] * 1e3 if overlap else None,
        "plan_wall_s": wall,
        "plan_cpu_s": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=["4,4,4", "2,4,8"])
    parser.add_argument("--limits", nargs="+", default=["none", "16", "12", "8"], help="GB per rank, or none")
    args = parser.parse_args()
    rows = []
    for text in args.meshes:
        mesh = tuple(int(x) for x in text.split(","))
        for limit in args.limits:
            row = measure(mesh, None if limit == "none" else float(limit))
            rows.append(row)
            print(row, flush=True)
    print(
        table(
            ["mesh", "limit GB", "memory GB/rank", "weights+grads+AdamW GB", "saved activations GB", "recomputed",
             "step ms (no overlap)", "step ms (scheduled)", "plan s (CPU)"],
            [
                (
                    "x".join(map(str, r["mesh"])),
                    "none (72)" if r["limit_gb"] is None else f"{r['limit_gb']:g}",
                    f"{r['memory_gb']:.2f}",
                    f"{r['weight_state_gb']:.2f}",
                    f"{r['activations_before_gb']:.2f} -> {r['activations_gb']:.2f}",
                    f"{r['recomputed_blocks']} blocks, {r['recomputed_ops']} ops ({r['ops_copied_into_backward']} copied)",
                    f"{r['step_ms_no_overlap']:.1f}",
                    f"{r['step_ms_scheduled']:.1f}" if r["step_ms_scheduled"] is not None else "-",
                    f"{r['plan_cpu_s']:.0f}",
                )
                for r in rows
            ],
        )
    )
    path = write_result(
        "recompute_memory",
        {"model": "LLaMA-7B shape (examples.zoo.Llama)", "batch": [BATCH, CONFIG.seq_len], "hardware": HARDWARE, "rows": rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
