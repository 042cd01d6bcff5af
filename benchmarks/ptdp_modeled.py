"""Modeled: PTD-P's GPT configurations (Narayanan et al., SC'21) on the A100 table, and what `auto` picks.

Issue 19. The GPT-3 175B shape (96 layers, hidden 12288, 96 heads) and the 1T shape (128 layers,
hidden 25600, 160 heads), sequence 2048, vocabulary 51200, are built as `examples.models.GPT` on the
meta device in bfloat16 (the paper trains in half precision; bfloat16 weights make the cost model
price matmuls at the table's 312 TFLOP/s tensor peak) and priced, never run:

- `choose_pipeline_mesh(model, N, (idx, idx), microbatches=M, hardware="a100-cluster",
  memory_limit=80e9, depths=[...])`: the tensor-only mesh choice on N ranks beside each pipeline
  depth of `depths` (one tensor mesh choice on N / pp ranks per depth, for one microbatch), every
  schedule of `AUTO_CANDIDATES` cut and simulated; the best that fits is `auto`'s choice;
- the paper's own configuration (t, p, d, microbatch size 1) priced by the same cut
  (`cut_stages(..., pp=p, tensor_size=t*d, data_parallel=d, weight_state=MIXED_ADAMW,
  recompute=True)`: work divided ideally over the t*d ranks of a stage, no tensor-parallel
  collective priced; the weight state of mixed precision, 18 bytes per parameter split over t;
  the data axis's all-reduce of the fp32 gradients once per step, where it runs past a rank's last
  backward; the optimizer step; full recomputation of every layer, as the paper ran) and, from the
  same run, the candidate at the paper's depth with autopar's own stage sub-mesh (its collectives
  counted per microbatch, its gradient reduction once per step).

Every step time is `StageCut.step_time` (docs/planning.md, "The pipelined step"): the simulated
schedule, then each rank's exposed gradient reduction and optimizer step.

The microbatch count: in the paper each of the d pipeline replicas runs m = B / (d * b) microbatches
of b sequences; in autopar the data axis lives inside the stage sub-mesh, so M microbatches of
B / M sequences are each split over the sub-mesh's data axis. M = B / (d * b) with the paper's d and
b = 1 gives the paper's m and, when the sub-mesh's data axis is d, the paper's b.

Throughput per GPU = model FLOPs per step / modeled step / N, with the model FLOPs of a step without
recomputation, 72 B s l h^2 (1 + s / (6h) + V / (12 l h)) (forward 24 B s l h^2 + 4 B s^2 l h + 2 B s h V,
backward twice that); the paper's 163 TFLOP/s counts 96 B s l h^2 (1 + s / (6h) + V / (16 l h)) (its
activation recomputation runs the layers' forward twice), so it is also given in model FLOPs.

    python benchmarks/ptdp_modeled.py --max-axes 2 --sub-axes --jobs 2   # ~23 min wall here (~10 CPU-min each)
    python benchmarks/ptdp_modeled.py --quick    # 175B only, depths 12 and 16, meshes of <= 2 axes
    python benchmarks/ptdp_modeled.py --cut-only # the paper's configurations through the cut only

Without `--max-axes` every mesh choice ranks every factorization into up to 4 axes (463 meshes at
1536 ranks, 636 at 3072): the 1536-rank tensor-only choice alone did not finish in 15 minutes here.

Writes benchmarks/results/ptdp_modeled.json (`--name` to change).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RunClock, import_lazy_modules, on_meta, table, write_result  # noqa: E402
from published_rows import ParallelShape  # noqa: E402

HARDWARE = "a100-cluster"
PEAK = 312e12  # the table's bfloat16 peak, the A100's dense tensor-core half-precision peak
MEMORY_LIMIT = 80e9  # the A100 80GB's capacity (the cut's default would be 90 % of it)
SEQ, VOCAB = 2048, 51200
TIMEOUT_S = 900  # per configuration


@dataclass(frozen=True)
class Config(ParallelShape):
    """One row of the paper: model shape, GPUs, global batch, its t, p, d, microbatch size and
    throughput (achieved TFLOP/s per GPU as the paper counts them; None where not reported)."""

    name: str
    layers: int
    hidden: int
    heads: int
    gpus: int
    batch: int
    t: int
    p: int
    microbatch: int
    paper_tflops: float | None
    source: str
    depths: tuple[int, ...]


CONFIGS = {
    "175B": Config(
        "GPT-3 175B",
        96,
        12288,
        96,
        1536,
        1536,
        8,
        12,
        1,
        None,
        "paper Sec. 5.2 / Table 2 (PTD-P beside ZeRO-3): 174.6B, batch 1536, t=8, p=12, b=1",
        (12, 16, 24),
    ),
    "1T": Config(
        "1T",
        128,
        25600,
        160,
        3072,
        3072,
        8,
        64,
        1,
        163.0,
        "paper Table 1, last row: 1008B, t=8, p=64, 3072 GPUs, batch 3072, 163 TFLOP/s (52 %)",
        (32, 64),
    ),
}


def model_flops(layers: int, hidden: int, batch: int, seq: int = SEQ, vocab: int = VOCAB) -> float:
    """Training FLOPs of one step without recomputation (forward + backward = 3 x forward)."""
    return 72.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def paper_flops(layers: int, hidden: int, batch: int, seq: int = SEQ, vocab: int = VOCAB) -> float:
    """The paper's count (with recomputation of the layers' forward): 96 B s l h^2 (...)."""
    return 96.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def measure(
    key: str,
    depths: tuple[int, ...],
    max_axes: int | None = None,
    sub_axes_too: bool = False,
    cut_only: bool = False,
) -> dict[str, Any]:
    """Build the model, run the mesh choice with `depths`, price the paper's configuration.
    `max_axes`: the tensor-only choice on all the GPUs considers meshes of at most that many axes
    (its candidates are every factorization into up to 4 axes: 463 at 1536 ranks, 636 at 3072);
    `sub_axes_too`: the stage sub-meshes' choices as well; `cut_only`: no mesh choice."""
    import torch

    from autopar.core.errors import AutoparError
    from autopar.passes.trace import trace
    from autopar.planning.stage_cut import cut_stages
    from autopar.planning.step_accounting import MIXED_ADAMW
    from examples.models import GPT, GPTConfig

    cfg = CONFIGS[key]
    gpt = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=cfg.layers, n_head=cfg.heads, n_embd=cfg.hidden)
    model = on_meta(lambda: GPT(gpt)).to(torch.bfloat16)
    idx = torch.zeros(cfg.batch, SEQ, dtype=torch.long)
    params = sum(p.numel() for p in model.parameters())
    m = cfg.microbatches
    out: dict[str, Any] = {
        "config": key,
        "name": cfg.name,
        "parameters": params,
        "gpus": cfg.gpus,
        "batch": cfg.batch,
        "microbatches": m,
        "depths": list(depths),
        "tensor_only_max_axes": max_axes,
        "sub_mesh_max_axes": max_axes if sub_axes_too else None,
        "paper": {"t": cfg.t, "p": cfg.p, "d": cfg.d, "b": cfg.microbatch, "m": m, "tflops": cfg.paper_tflops,
                  "source": cfg.source},
    }  # fmt: skip
    import_lazy_modules()  # import time is not planning time
    flops, pflops = (
        model_flops(cfg.layers, cfg.hidden, cfg.batch),
        paper_flops(cfg.layers, cfg.hidden, cfg.batch),
    )
    out["model_flops"], out["paper_formula_flops"] = flops, pflops
    if not cut_only:
        planned = _plan(out, key, model, idx, depths, max_axes, sub_axes_too, flops)
        if planned is not None:
            return planned

    # The paper's configuration through the cut alone: p stages of t*d ranks each, work divided
    # ideally over them (no tensor-parallel collective priced), the data axis's reduction once per
    # step, mixed precision's states, full recomputation; 1F1B and interleaved with v = 2.
    wall, cpu = time.perf_counter(), time.process_time()
    gm = trace(model, (idx, idx), decompose=True)
    trace_cpu = time.process_time() - cpu
    ideal_rows = []
    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        try:
            cut = cut_stages(gm, pp=cfg.p, microbatches=m, v=v, schedule=schedule, hardware=HARDWARE,
                             tensor_size=cfg.t * cfg.d, memory_limit=MEMORY_LIMIT, data_parallel=cfg.d,
                             weight_state=MIXED_ADAMW, recompute=True)  # fmt: skip
        except AutoparError as exc:
            ideal_rows.append({"schedule": schedule, "v": v, "error": str(exc).splitlines()[0]})
            continue
        tflops = flops / cut.step_time / cfg.gpus / 1e12
        ideal_rows.append({
            "pp": cfg.p, "stage_mesh": f"{cfg.t * cfg.d} ranks, ideal (t={cfg.t} x d={cfg.d})",
            "schedule": schedule, "v": v, "step_s": cut.step_time, "schedule_s": cut.makespan,
            "grad_reduce_s": max(cut.reduce_time), "optimizer_s": max(cut.optimizer_time),
            "memory_gb": max(cut.rank_memory) / 1e9,
            "fits": cut.fits, "bubble": cut.bubble, "idle_over_busy": cut.bubble_ratio,
            "megatron_bubble": (cfg.p - 1) / (v * m), "factor": 1.0, "error": "",
            "tflops_per_gpu": tflops, "fraction_of_peak": tflops * 1e12 / PEAK,
            "stage_modules": [s.modules for s in cut.stages][:3] + ["..."],
        })  # fmt: skip
        print(cut, flush=True)
    out["paper_config_ideal"] = ideal_rows
    out["paper_cut_wall_s"], out["paper_cut_cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
    out["paper_trace_cpu_s"] = trace_cpu
    return out


def _plan(
    out: dict[str, Any],
    key: str,
    model: Any,
    idx: Any,
    depths: tuple[int, ...],
    max_axes: int | None,
    sub_axes_too: bool,
    flops: float,
) -> dict[str, Any] | None:
    """`choose_pipeline_mesh` into `out` (its rows and timings); `out` itself when it failed."""
    import autopar.compiler.pipeline_mesh as pm
    from autopar.planning.mesh_choice import mesh_candidates
    from autopar.planning.step_accounting import MIXED_ADAMW

    cfg = CONFIGS[key]
    m = cfg.microbatches
    calls: list[dict[str, Any]] = []
    original = pm.choose_mesh

    def timed(model_: Any, world: int, *args: Any, **kwargs: Any) -> Any:
        if max_axes is not None and (world == cfg.gpus or sub_axes_too):
            kwargs["candidates"] = [c for c in mesh_candidates(world) if len(c[0]) <= max_axes]
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return original(model_, world, *args, **kwargs)
        finally:
            calls.append(
                {"ranks": world, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
            )
            print(f"    [{key}] choose_mesh on {world} ranks: {calls[-1]['cpu_s']:.1f} s CPU", flush=True)

    pm.choose_mesh = timed  # type: ignore[assignment]
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        choice = pm.choose_pipeline_mesh(
            model, cfg.gpus, (idx, idx), microbatches=m, hardware=HARDWARE, memory_limit=MEMORY_LIMIT,
            depths=list(depths), weight_state=MIXED_ADAMW,
        )  # fmt: skip
        out["plan_wall_s"], out["plan_cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        out["traceback"] = traceback.format_exc(limit=8)[:4000]
        return out
    finally:
        pm.choose_mesh = original
    out["choose_mesh_calls"] = calls
    out["table"] = choice.table()
    print(choice.table(), flush=True)

    def row(c: Any) -> dict[str, Any]:
        ideal = (c.pp - 1) / (c.v * m) if c.pp > 1 else 0.0
        tflops = flops / c.step_time / cfg.gpus / 1e12 if math.isfinite(c.step_time) and not c.error else None
        return {
            "pp": c.pp, "stage_mesh": c.stage_mesh, "schedule": c.schedule, "v": c.v,
            "step_s": c.step_time if not c.error else None, "memory_gb": c.memory / 1e9 if not c.error else None,
            "fits": c.fits, "bubble": c.bubble, "idle_over_busy": c.bubble / (1 - c.bubble) if c.bubble < 1 else None,
            "megatron_bubble": ideal, "factor": c.factor, "error": c.error,
            "tflops_per_gpu": tflops, "fraction_of_peak": tflops * 1e12 / PEAK if tflops else None,
        }  # fmt: skip

    out["candidates"] = [row(c) for c in choice.candidates]
    out["chosen"] = row(choice.chosen)
    at_paper = [c for c in choice.candidates if c.pp == cfg.p and not c.error]
    if at_paper:
        out["autopar_at_paper_depth"] = row(at_paper[0])  # candidates are sorted: the best there

    return None


def _worker(
    key: str, depths: tuple[int, ...], max_axes: int | None, sub_too: bool, cut_only: bool, results: Any
) -> None:
    try:
        results.put(measure(key, depths, max_axes, sub_too, cut_only))
    except BaseException as exc:  # report, never hang the parent
        results.put({"config": key, "error": f"{type(exc).__name__}: {exc}"[:500],
                     "traceback": traceback.format_exc(limit=8)[:4000]})  # fmt: skip


def run_isolated(
    plan: list[tuple[str, tuple[int, ...]]],
    max_axes: int | None,
    sub_too: bool,
    timeout: float,
    jobs: int,
    cut_only: bool = False,
) -> list[dict[str, Any]]:
    """`measure` for each configuration in a fresh process, `jobs` at a time, each stopped after
    `timeout` seconds; results in `plan`'s order."""
    ctx = multiprocessing.get_context("spawn")
    out: list[dict[str, Any] | None] = [None] * len(plan)
    pending = list(range(len(plan)))
    running: list[tuple[int, Any, Any, float]] = []
    while pending or running:
        while pending and len(running) < jobs:
            i = pending.pop(0)
            key, depths = plan[i]
            print(f"{key}: depths {list(depths)}", flush=True)
            results = ctx.Queue()
            proc = ctx.Process(target=_worker, args=(key, depths, max_axes, sub_too, cut_only, results))
            proc.start()
            running.append((i, proc, results, time.perf_counter()))
        time.sleep(1.0)
        for item in list(running):
            i, proc, results, started = item
            try:
                got = results.get_nowait()
            except queue.Empty:
                if time.perf_counter() - started < timeout:
                    continue
                proc.terminate()
                key, depths = plan[i]
                got = {"config": key, "depths": list(depths), "error": f"stopped after {timeout:.0f} s"}
            proc.join(30)
            got["process_wall_s"] = time.perf_counter() - started
            print(
                f"  {got['config']}: {got.get('error') or 'done'} ({got['process_wall_s']:.0f} s wall)",
                flush=True,
            )
            out[i] = got
            running.remove(item)
    return [r for r in out if r is not None]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def rows_for(run: dict[str, Any]) -> list[list[str]]:
    """Markdown rows: auto's choice, autopar's best at the paper's depth, the paper's config ideal,
    and the paper's reported number."""
    cfg = CONFIGS[run["config"]]
    head = f"{cfg.name}, {cfg.gpus} GPUs, B={cfg.batch}"
    if "error" in run:
        return [[head, "ERROR", run["error"][:100], *[""] * 9]]
    m = run["microbatches"]
    out = []

    def line(what: str, r: dict[str, Any], planning: str) -> list[str]:
        return [
            head, what, f"{r['pp']} x {r['stage_mesh']}", f"{r['schedule']} v={r['v']}", str(m),
            _fmt(r["step_s"], ".2f"), _fmt(r["tflops_per_gpu"], ".0f"),
            _fmt(None if r["fraction_of_peak"] is None else 100 * r["fraction_of_peak"], ".1f"),
            f"{_fmt(r['idle_over_busy'], '.3f')} / {r['megatron_bubble']:.3f}",
            _fmt(r["memory_gb"], ".1f") + ("" if r["fits"] else " (over)"), planning,
        ]  # fmt: skip

    if "chosen" in run:
        out.append(
            line("auto's choice", run["chosen"], f"{run['plan_cpu_s']:.0f} ({run['plan_wall_s']:.0f})")
        )
    at = run.get("autopar_at_paper_depth")
    if at is not None and at["pp"] != run["chosen"]["pp"]:
        out.append(line(f"best at the paper's p={cfg.p}", at, "(same run)"))
    for r in run["paper_config_ideal"]:
        if r.get("error"):
            out.append([head, f"paper's t, p, d ({r['schedule']})", r["error"][:100], *[""] * 8])
        else:
            out.append(line("paper's t, p, d, cut only", r, f"{run['paper_cut_cpu_s']:.0f}"))
    if cfg.paper_tflops is not None:
        model_tf = (
            cfg.paper_tflops * model_flops(cfg.layers, cfg.hidden, 1) / paper_flops(cfg.layers, cfg.hidden, 1)
        )
        out.append([head, "paper, measured", f"{cfg.p} x {cfg.t}x{cfg.d} (t x d)", "interleaved?", str(m), "-",
                    f"{cfg.paper_tflops:.0f} ({model_tf:.0f} model)",
                    f"{100 * cfg.paper_tflops * 1e12 / PEAK:.0f} ({100 * model_tf * 1e12 / PEAK:.0f} model)",
                    f"- / {(cfg.p - 1) / m:.3f}", "-", "-"])  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="175B only, depths 12 and 16 (--max-axes 2 --sub-axes unless given)",
    )
    parser.add_argument(
        "--max-axes",
        type=int,
        default=None,
        help="tensor-only choice on all GPUs: meshes of at most this many axes",
    )
    parser.add_argument(
        "--sub-axes", action="store_true", help="apply --max-axes to the stage sub-meshes too"
    )
    parser.add_argument(
        "--cut-only", action="store_true", help="the paper's configurations through the cut, no mesh choice"
    )
    parser.add_argument("--jobs", type=int, default=1, help="configurations planned at once")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per configuration")
    parser.add_argument("--name", default="ptdp_modeled", help="result file name under benchmarks/results")
    args = parser.parse_args()
    plan = [("175B", (12, 16))] if args.quick else [(k, CONFIGS[k].depths) for k in args.configs]
    if args.quick and args.max_axes is None:
        args.max_axes, args.sub_axes = 2, True
    clock = RunClock()
    runs = run_isolated(plan, args.max_axes, args.sub_axes, args.timeout, args.jobs, args.cut_only)
    headers = ["configuration", "row", "pp x stage sub-mesh", "schedule", "M", "step s", "TFLOP/s/GPU",
               "% of 312", "idle/busy vs (p-1)/(v*m)", "GB/rank", "plan s CPU (wall)"]  # fmt: skip
    print()
    print(table(headers, [r for run in runs for r in rows_for(run)]))
    path = write_result(
        args.name,
        {
            "hardware": HARDWARE,
            "peak_flops": PEAK,
            "memory_limit": MEMORY_LIMIT,
            "seq": SEQ,
            "vocab": VOCAB,
            "quick": args.quick,
            "cut_only": args.cut_only,
            "tensor_only_max_axes": args.max_axes,
            "sub_mesh_max_axes": args.max_axes if args.sub_axes else None,
            **clock.record(),
            "runs": runs,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
