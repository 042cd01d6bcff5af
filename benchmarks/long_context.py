"""Long sequences on H100s, modeled (issue 36, item 5b): `auto` against published context-parallel
configurations, same model, same batch, same memory limit.

Each row is a LLaMA-3 shape (`examples.zoo.Llama` on the meta device in bfloat16: 8B is 32 layers,
width 4096, 32 query heads, 8 key/value heads, FFN 14336, vocabulary 128256; 70B is 80 layers, width
8192, 64 heads, 8 key/value heads, FFN 28672) with a batch of one sequence per data-parallel replica
of the published configuration (the published runs accumulate more microbatches per step; one
microbatch is priced here on both sides). Both sides are planned by `autopar.plan` on the
`h100-nvlink-ib` table with `memory_limit` = 80 GB per rank:

- *auto*: `mesh_shape="auto"` over the row's GPUs: every factorization of the world searched, the
  fastest that fits kept (context parallelism is one more attention strategy there, never asked);
- *published*: the published degrees as a named mesh, the "cp" axis asking for context
  parallelism with keys and values all-gathered (`PlanOptions(context_parallel="allgather")`,
  Llama 3's and Megatron's all-gather CP), the other axes searched.

The published configurations (NeMo's "Long Sequence Performance" table; the rows name the page)
ran FP8 with Transformer Engine; the comparison here is of layouts under the same model, not of
those runs' throughput. Modeled step and memory per rank are `PlanResult`'s (the emitted program
priced; memory as the planner counts it). Run one row at a time, it takes minutes of CPU each:

    python benchmarks/long_context.py --rows "8B 32K x8"
    python benchmarks/long_context.py            # every row

Writes benchmarks/results/long_context.json (`--name` to change).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import on_meta, table, write_result  # noqa: E402

import autopar  # noqa: E402
from autopar.core.meta import info  # noqa: E402
from autopar.rules.context_parallel import BACKWARD, FORWARD  # noqa: E402

NEMO_URL = "https://docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_long_sequence.html"
NEMO_B200_URL = "https://huggingface.co/Respair/NeMo_Canary/blob/main/docs/source/performance/performance_long_sequence.md"
MEMORY_LIMIT = 80e9  # bytes per rank: H100 80GB SXM
TABLE = "h100-nvlink-ib"
SHAPES = {  # layers, width, heads, k/v heads, FFN
    "8B": (32, 4096, 32, 8, 14336),
    "70B": (80, 8192, 64, 8, 28672),
}


@dataclass(frozen=True)
class Row:
    key: str
    model: str
    seq: int
    gpus: int
    tp: int
    cp: int
    dp: int
    source: str


ROWS = [
    Row("8B 32K x8", "8B", 32768, 8, 1, 2, 4, f"{NEMO_B200_URL}, LLAMA3-8B row SeqLen 32K: TP1 PP1 DP4 CP2 (on 32 GPUs; 8 here)"),
    Row("8B 128K x16", "8B", 131072, 16, 2, 4, 2, f"{NEMO_B200_URL}, LLAMA3-8B row SeqLen 128K: TP2 PP1 DP4 CP4 (on 128 GPUs; DP2 here)"),
    Row("8B 128K x64", "8B", 131072, 64, 4, 4, 4, f"{NEMO_URL}, LLAMA2-7B row SeqLen 128K: TP4 PP1 DP8 CP4 (on 128 GPUs; DP4 here)"),
    Row("70B 128K x64", "70B", 131072, 64, 8, 8, 1, "Llama 3 paper (arXiv 2407.21783), Table 4, 405B at 128K: TP8 CP16 PP16 on 16K H100s; 70B, TP8 CP8 on 64 here"),
]


def build(row: Row) -> torch.nn.Module:
    from examples.zoo import Llama, LlamaConfig

    layers, width, heads, kv, ffn = SHAPES[row.model]
    cfg = LlamaConfig(vocab_size=128256, seq_len=row.seq, dim=width, n_layer=layers, n_head=heads,
                      n_kv_head=kv, hidden=ffn, rope_base=500000.0)  # fmt: skip
    return on_meta(lambda: Llama(cfg)).to(torch.bfloat16)


def _attention(result: autopar.PlanResult) -> str:
    node = next(n for n in result.compiled.graph.graph.nodes if n.target in (FORWARD, BACKWARD))
    strategy = info(node).strategy
    return str(strategy).split(" ->")[0] if strategy is not None else "?"


def _priced(result: autopar.PlanResult) -> dict[str, Any]:
    return {"mesh": str(result.mesh), "step_s": result.step_time, "memory_gb": result.memory.total / 1e9,
            "attention_inputs": _attention(result)}  # fmt: skip


def _restricted(
    model: torch.nn.Module,
    batch: tuple,
    meshes: list[tuple[int, ...]],
    tried: list[dict[str, Any]],
    saved: Callable[[], None],
) -> autopar.PlanResult:
    """`auto` over the listed meshes only (axes unnamed: the search gives each its role, context
    parallelism included): the fastest plan that fits, where `mesh_shape="auto"` over every
    factorization takes too long to plan on the shared machine. Each mesh's outcome is appended to
    `tried`, and `saved()` called, as it is known."""
    best: autopar.PlanResult | None = None
    for shape in meshes:
        start = time.process_time()
        try:
            result = autopar.plan(model, shape, batch, memory_limit=MEMORY_LIMIT,
                                  planning=autopar.PlanOptions(hardware=TABLE))  # fmt: skip
        except autopar.AutoparError as error:
            print(shape, "refused:", str(error).splitlines()[0][:200], flush=True)
            tried.append({"mesh": list(shape), "error": str(error).splitlines()[0][:300]})
            saved()
            continue
        print(shape, result.step_time, result.memory.total / 1e9, flush=True)
        tried.append({**_priced(result), "cpu_s": time.process_time() - start})
        saved()
        if best is None or result.step_time < best.step_time:
            best = result
    if best is None:
        raise autopar.AutoparError(f"no plan fits on any of the meshes {meshes}")
    return best


def run_row(
    row: Row, meshes: list[tuple[int, ...]] | None = None, save: Callable[[dict[str, Any]], None] = lambda out: None
) -> dict[str, Any]:
    """Both sides of `row`; `save(out)` after each side and each mesh tried, so that a run stopped
    part way (the machine's memory, its time) keeps what it priced."""
    model = build(row)
    ids = torch.zeros(row.dp, row.seq, dtype=torch.long, device="meta")
    batch = (ids, ids)
    out: dict[str, Any] = {"row": asdict(row)}
    for side in ("published", "auto"):
        start = time.process_time()
        try:
            if side == "auto" and meshes:
                out["auto_meshes"] = [list(m) for m in meshes]
                out["auto_tried"] = []
                result = _restricted(model, batch, meshes, out["auto_tried"], lambda: save(out))
            elif side == "auto":
                result = autopar.plan(model, "auto", batch, world_size=row.gpus, memory_limit=MEMORY_LIMIT,
                                      planning=autopar.PlanOptions(hardware=TABLE))  # fmt: skip
            else:
                shape = tuple(s for s in (row.dp, row.tp, row.cp) if s > 1) or (1,)
                names = tuple(n for n, s in (("dp", row.dp), ("tp", row.tp), ("cp", row.cp)) if s > 1) or ("dp",)
                result = autopar.plan(model, shape, batch, mesh_names=names, memory_limit=MEMORY_LIMIT,
                                      planning=autopar.PlanOptions(hardware=TABLE, context_parallel="allgather"))  # fmt: skip
            out[side] = _priced(result)
        except autopar.AutoparError as error:
            out[side] = {"error": str(error).splitlines()[0][:300]}
        out[side]["cpu_s"] = time.process_time() - start
        print(row.key, side, out[side], flush=True)
        save(out)
    return out


def report(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        row, pub, auto = r["row"], r["published"], r["auto"]

        def cell(side: dict[str, Any]) -> list[str]:
            if "error" in side:
                return [side["error"][:80], "-", "-", "-"]
            return [side["mesh"], f"{side['step_s'] * 1e3:.0f}", f"{side['memory_gb']:.1f}", f"`{side['attention_inputs']}`"]

        if "auto_meshes" in r and "mesh" in auto:  # auto restricted to listed meshes (--meshes)
            auto = {**auto, "mesh": f"{auto['mesh']} (of {', '.join('x'.join(map(str, m)) for m in r['auto_meshes'])})"}
        speed = pub.get("step_s", math.nan) / auto["step_s"] if "step_s" in auto and "step_s" in pub else math.nan
        rows.append([row["key"], f"TP{row['tp']} CP{row['cp']} DP{row['dp']}", *cell(pub), *cell(auto),
                     f"{speed:.2f}", row["source"]])  # fmt: skip
    return table(
        ["row", "published", "mesh", "step ms", "GB/rank", "attention q, k, v", "auto mesh", "step ms", "GB/rank",
         "attention q, k, v", "published / auto", "source"],
        rows,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="*", default=None)
    parser.add_argument("--name", default="long_context")
    parser.add_argument("--meshes", nargs="*", default=None, help='restrict auto to these shapes ("8x8 2x4x8")')
    args = parser.parse_args()
    chosen = [r for r in ROWS if args.rows is None or r.key in args.rows]
    meshes = [tuple(int(n) for n in m.split("x")) for m in args.meshes] if args.meshes else None
    results: list[dict[str, Any]] = []

    def save(partial: dict[str, Any]) -> None:
        write_result(args.name, {"rows": [*results, partial], "memory_limit": MEMORY_LIMIT, "table": TABLE})

    for r in chosen:
        results.append(run_row(r, meshes, save))
    print(report(results))
    write_result(args.name, {"rows": results, "memory_limit": MEMORY_LIMIT, "table": TABLE})


if __name__ == "__main__":
    main()
