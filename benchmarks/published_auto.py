"""`auto` against the experts' configurations under the calibrated step model (issue 29, item 3).

For each published row (`published_rows.ROWS`), the automatic choice with pipeline depths,
`autopar.compiler.pipeline_mesh.choose_pipeline_mesh` (what `plan(model, mesh_shape="auto",
world_size=N, pipeline=PipelineOptions(microbatches=M))` runs), on the row's model, global batch,
sequence, microbatch count, cluster table and memory limit, beside the row's own configuration
priced by `autopar.planning.step_model.price_step` on the same table. `benchmarks/published.py
--auto` runs it; docs/benchmarks.md ("auto against the published configurations") has the table.

How the two sides are made comparable (`auto_call` is the mapping, tested in tests/test_published.py):

- the same model (built on the meta device in bfloat16 by `published_model.build_model`), the
  whole global batch of `row.batch` sequences of `row.seq` tokens as the example, and M =
  `row.microbatches` microbatches: the expert's m = B / (d b) per pipeline replica; in autopar a
  microbatch of B / M sequences is split over the stage sub-mesh's data axis, so with the
  expert's d it is the expert's b;
- the same calibrated table (`row.gpu`: its eta applies to both), `memory_limit` = its
  `memory_capacity` (80 GB A100 and H100 SXM; torchtitan's 500 W H100s have 96 GB);
- the same weight state (`MIXED_ADAMW`: bf16 weights, fp32 gradients, master and AdamW, what
  `PlanOptions(weight_state=None)` gives a bf16 model) for every candidate, the tensor-only one
  too, with its optimizer step; recomputation is the planner's choice (`recompute="auto"`: none,
  selective or full, the fastest that fits; the tensor-only candidate what its search recomputes
  to fit), the expert's is the run's;
- the same kernels: autopar's runtime pays the table's element-wise time unscaled (phi = 1) and
  runs causal attention on torch's flash kernel (`cost.work.PLANNED_ATTENTION`: the masked blocks
  skipped, at the table's default attention rates, FlashAttention-2's), so the expert is priced
  with phi = 1 and that kernel too (`expert_step_s`);
  `expert_framework_step_s` is the row's own framework constant (`kernels.elementwise_factor`)
  and attention kernel (Megatron-LM 2021's full scores: `Row.attention`), which autopar's
  runtime does not have.

"auto" is what `choose_pipeline_mesh` ranks first, what plan() compiles, over the depths plan()
ranks (every divisor of the world from 2) up to `MAX_DEPTH`, with the library's branch and bound.
What still differs: auto's tensor collectives come from its searched plan (its layouts, no
overlap), the expert's from `price_step`'s two activation all-reduces per block per pass (none
where the run overlaps them, Megatron-Core's rows); the expert's data-parallel reduction is the
run's (fp32 all-reduce, distributed optimizer or FSDP), auto's is its plan's gradient
redistributions, once per step.
"""

from __future__ import annotations

import multiprocessing
import resource
import signal
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from published_model import build_model, components, config
from published_rows import Row

from autopar.compiler.pipeline_mesh import choose_pipeline_mesh
from autopar.cost.hardware import load_hardware
from autopar.cost.work import PLANNED_ATTENTION
from autopar.planning.mesh_choice import MeshChoice
from autopar.planning.step_accounting import MIXED_ADAMW, WeightState
from autopar.planning.step_model import price_step

MAX_DEPTH = 8  # every depth priced costs one stage sub-mesh choice: bounded to keep a row in minutes
MEMORY_LIMIT = "the row's table's memory_capacity"  # 80 GB A100 / H100 SXM, 96 GB for torchtitan's H100s


@dataclass(frozen=True)
class AutoCall:
    """The arguments `choose_pipeline_mesh` gets for one row (besides the model it builds)."""

    world_size: int
    batch: int  # sequences in the example: the global batch
    seq: int
    microbatches: int
    hardware: str
    memory_limit: float
    weight_state: WeightState
    recompute: str

    def depths(self) -> list[int]:
        """The divisors of the world size from 2 up to `MAX_DEPTH`: the pipeline depths `plan()`
        ranks beside the tensor-only mesh choice (pp 1, the whole batch in one step), bounded to keep
        a row in minutes."""
        return [p for p in range(2, min(self.world_size, MAX_DEPTH) + 1) if self.world_size % p == 0]

    def example(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets) of the whole global batch; the trace is on the meta device's shapes."""
        idx = torch.zeros(self.batch, self.seq, dtype=torch.long)
        return idx, idx


def auto_call(row: Row) -> AutoCall:
    """The row's model, batch, sequence, microbatch count, cluster and memory, as the planner takes them."""
    return AutoCall(
        world_size=row.gpus, batch=row.batch, seq=row.seq, microbatches=row.microbatches, hardware=row.gpu,
        memory_limit=load_hardware(row.gpu).memory_capacity, weight_state=MIXED_ADAMW, recompute="auto",
    )  # fmt: skip


def why(expert: dict[str, Any], candidates: list[dict[str, Any]], speedup: float) -> str:
    """Where auto does not win by 10 %: what it picked and what it found at the expert's depth
    (pp 1: the tensor-only mesh choice, the whole batch in one step)."""
    if speedup >= 1.1:
        return ""
    fitting = [c for c in candidates if not c["error"] and c["fits"]]
    if not fitting:
        return "no candidate fits: " + "; ".join(sorted({c["error"] for c in candidates if c["error"]}))[:300]
    chosen = fitting[0]
    parts = [
        f"auto picks pp {chosen['pp']} {chosen['stage_mesh']} {chosen['schedule']} v{chosen['v']} "
        f"(recompute {chosen['recompute']}, bubble {chosen['bubble']:.2f}, sub-mesh factor {chosen['factor']:.2f})"
    ]
    at_depth = [c for c in candidates if c["pp"] == expert["p"]]
    if at_depth:
        best = at_depth[0]
        if best["error"]:
            parts.append(f"at the expert's depth pp {expert['p']}: {best['error']}")
        else:
            parts.append(
                f"at the expert's depth pp {expert['p']}: {best['stage_mesh']} {best['schedule']} "
                f"{best['step_s']:.3f} s (recompute {best['recompute']}, sub-mesh factor {best['factor']:.2f}, "
                f"{best['memory_gb']:.1f} GB, fits {best['fits']})"
            )
    else:
        parts.append(f"the expert's depth pp {expert['p']} is not among the depths priced")
    return "; ".join(parts)


def run_row(row: Row) -> dict[str, Any]:
    """Plan `row` with `auto` and price its expert configuration on the same table (in this process)."""
    call = auto_call(row)
    start = time.process_time()
    comp = components(row)
    ours = components(row, PLANNED_ATTENTION, framework="autopar")  # torch SDPA's kernel, as autopar runs
    same = price_step(ours.stages, replace(config(row), attention=PLANNED_ATTENTION), comp.hw, phi=1.0)
    own = price_step(comp.stages, config(row), comp.hw)
    expert_cpu = time.process_time() - start
    start = time.process_time()
    choice = choose_pipeline_mesh(
        build_model(row), call.world_size, call.example(), microbatches=call.microbatches, hardware=call.hardware,
        memory_limit=call.memory_limit, weight_state=call.weight_state, recompute=call.recompute,
        depths=call.depths(),
    )  # fmt: skip
    auto_cpu = time.process_time() - start
    candidates = [
        {"pp": c.pp, "stage_mesh": c.stage_mesh, "schedule": c.schedule, "v": c.v, "recompute": c.recompute,
         "step_s": c.step_time, "memory_gb": c.memory / 1e9, "fits": c.fits, "bubble": c.bubble, "factor": c.factor,
         "error": c.error}
        for c in choice.candidates
    ]  # fmt: skip
    best = choice.chosen
    expert = {"t": row.t, "p": row.p, "d": row.d, "schedule": row.schedule, "recompute": row.recompute, "dp": row.dp}
    auto_ok = not best.error and best.fits
    speedup = same.step / best.step_time if auto_ok else 0.0
    return {
        "key": row.key, "gpu": row.gpu, "gpus": row.gpus, "batch": row.batch, "seq": row.seq,
        "microbatches": row.microbatches, "memory_limit": call.memory_limit, "recompute_planned": call.recompute,
        "expert": expert, "expert_step_s": same.step, "expert_framework_step_s": own.step,
        "expert_states_gb": same.state_bytes / 1e9,
        "auto_step_s": best.step_time if auto_ok else None,
        "auto_mesh": f"pp {best.pp} x {best.stage_mesh}" if best.pp > 1 else best.stage_mesh,
        "auto_schedule": best.schedule, "auto_v": best.v, "auto_recompute": best.recompute,
        "auto_memory_gb": best.memory / 1e9 if auto_ok else None,
        "speedup": speedup, "why": why(expert, candidates, speedup),
        "expert_cpu_s": expert_cpu, "auto_cpu_s": auto_cpu, "candidates": candidates,
        "tensor_only": tensor_only_breakdown(choice.tensor_only), "table": choice.table(),
    }  # fmt: skip


def tensor_only_breakdown(choice: MeshChoice | None) -> dict[str, Any] | None:
    """The tensor-only choice's pick as its search left it: how it stores the weights, its memory
    (the row's weight state counted), its step's parts (s; `reduce_s`: its gradient reduction)."""
    if choice is None:
        return None
    c = choice.chosen
    return {"mesh": c.label, "storage": c.storage, "fits": c.fits, "memory_gb": c.memory / 1e9,
            "param_gb": c.param_bytes / 1e9, "comm_s": c.comm_time, "compute_s": c.compute_time,
            "reduce_s": c.reduce_time, "scheduled_s": c.scheduled_time}  # fmt: skip


def _child(row: Row, cpu_limit: int, conn: Any) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, cpu_limit + 10))
    try:
        conn.send(run_row(row))
    except Exception as exc:  # reported as the row's result: the benchmark goes on to the next row
        conn.send(
            {
                "key": row.key,
                "failed": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            }
        )
    conn.close()


def run_limited(row: Row, cpu_limit: int) -> dict[str, Any]:
    """`run_row` in a child process killed after `cpu_limit` CPU seconds (RLIMIT_CPU)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(row, cpu_limit, child))
    start = time.monotonic()
    before = _children_cpu()
    proc.start()
    child.close()
    try:
        result: dict[str, Any] = parent.recv()
        proc.join()
    except EOFError:
        proc.join()
        result = {"key": row.key, "not_finished": not_finished(proc.exitcode, cpu_limit, _children_cpu() - before)}
    result["wall_s"] = time.monotonic() - start
    result["cpu_s"] = _children_cpu() - before
    return result


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def not_finished(exitcode: int | None, cpu_limit: int, cpu_s: float) -> str:
    """Why a row's child sent no result: its CPU limit (SIGXCPU, or SIGKILL at the hard limit),
    or ended otherwise (stopped by hand, out of memory) after `cpu_s` of CPU."""
    if exitcode is not None and -exitcode in (signal.SIGXCPU, signal.SIGKILL) and cpu_s >= cpu_limit:
        return f"not finished in {cpu_limit} s CPU"
    return f"stopped after {cpu_s:.0f} s CPU of its {cpu_limit} (exit {exitcode})"


def report(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], dict[str, Any]]:
    """The printed table (headers, body) and the summary over the rows that finished: "auto" is
    what `choose_pipeline_mesh` picks (what plan() compiles), every candidate under one accounting."""
    headers = ["row", "GPUs", "expert t/p/d", "expert step", "(own phi)", "auto", "schedule", "recompute", "step",
               "GB", "speedup", "why (where < 1.1x)"]  # fmt: skip
    body = []
    for r in results:
        if "speedup" not in r:
            body.append([r["key"], "", "", "", "", r.get("not_finished") or r.get("failed", "")] + [""] * 6)
            continue
        e = r["expert"]
        ok = r["auto_step_s"] is not None
        body.append([r["key"], str(r["gpus"]), f"{e['t']}/{e['p']}/{e['d']}", f"{r['expert_step_s']:.3f} s",
                     f"{r['expert_framework_step_s']:.3f} s", r["auto_mesh"] if ok else "none fits",
                     f"{r['auto_schedule']} v{r['auto_v']}" if ok and r["auto_schedule"] != "-" else "-",
                     r["auto_recompute"] if ok else "", f"{r['auto_step_s']:.3f} s" if ok else "-",
                     f"{r['auto_memory_gb']:.1f}" if ok else "-", f"{r['speedup']:.2f}x", r["why"]])  # fmt: skip
    done = [r for r in results if "speedup" in r]
    summary = {
        "rows": len(results),
        "finished": len(done),
        "no_fitting_candidate": sum(r["auto_step_s"] is None for r in done),
        "slower": sum(r["auto_step_s"] is not None and r["speedup"] < 1.0 for r in done),
        "at_least_1.1x": sum(r["speedup"] >= 1.1 for r in done),
    }
    return headers, body, summary
