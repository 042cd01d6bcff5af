"""Planning time of `autopar.plan(model, "auto", world_size=N)` at scale: LLaMA-7B, GPT-3 175B, 1T.

The model (vocab 32000, d = 4096, 32 heads, SwiGLU 11008, sequence 2048, batch 16) is built on the
meta device and `autopar.plan(model, "auto", (idx, idx), world_size=N)` is run on the H100 table:
trace, the mesh choice (`autopar.planning.mesh_choice`: a cheap plan per candidate mesh, the search
on the best few, the best of those lowered and scheduled), then the chosen mesh's plan compiled (from
the choice's trace and searched plan: neither is done again) and priced.
Each configuration runs in a fresh process, one at a time; wall and CPU seconds are both reported
(the machine may be shared: CPU seconds are what the planning itself spent). "scheduled ms" is the
chosen mesh's modeled step with overlap, "step ms" its no-overlap sum of the compiled plan.

    python benchmarks/plan_scale.py                           # 8, 64, 512 ranks at 32 layers
    python benchmarks/plan_scale.py --ranks 64 --layers 2 32
    python benchmarks/plan_scale.py --searched 0 --ranks 64   # search every candidate (slow)
    python benchmarks/plan_scale.py --ranks 64 --fold         # rank on the model cut to 4 and 5 blocks
    python benchmarks/plan_scale.py --model gpt3-175b --layers 4 --ranks 64 --microbatches 8
    python benchmarks/plan_scale.py --model gpt3-175b --ranks 1536 --microbatches 96 --cpu-limit 600
    python benchmarks/plan_scale.py --model gpt-1t --ranks 3072 --microbatches 512 --cpu-limit 600
    python benchmarks/plan_scale.py --model gpt3-175b --layers 96 --ranks 1536 --microbatches 96 --cuts-only
    python benchmarks/plan_scale.py --model gpt3-175b --layers 96 --ranks 1536 --screen-only 24
    python benchmarks/plan_scale.py --model gpt3-175b --layers 96 --ranks 1536 --bounds-only 54.94
    python benchmarks/plan_scale.py --model gpt3-175b --layers 96 --ranks 1536 --search-only 192x8

`--model gpt3-175b` / `gpt-1t` is the PTD-P shape of benchmarks/ptdp_modeled.py (GPT, hidden 12288 /
25600, 96 / 160 heads, sequence 2048, vocabulary 51200, bfloat16, batch = ranks; 96 / 128 layers
unless `--layers` says otherwise) on the A100 table with an 80 GB limit; `--microbatches M` makes pipeline depths compete
(`autopar.compiler.pipeline_mesh.choose_pipeline_mesh`, every factorization up to 4 axes for every
stage sub-mesh), `--no-bound` prices every depth (no branch and bound). `--cpu-limit S` stops a
run after S CPU seconds and records it as not finished, with what it measured so far. GPT runs
record the CPU seconds of each stage (`stages`: the traces, the tensor-only choice and the depths'
sub-mesh choices, inside them the screen, the searches of the meshes kept and the schedule stage,
and the depths' cuts; inclusive, so nested stages are also in their parent's time), the peak RSS
and, where it finished, every tensor-only mesh's row (`tensor_only_ranking`: estimate, bound). `--cuts-only` times the part of the pipeline
choice that prices every depth's ideal cuts (every schedule of `AUTO_CANDIDATES`, work divided
ideally by the stage sub-mesh) on the full-depth trace, without the sub-mesh choices.
`--screen-only K` times the tensor-only choice's screen (a cheap plan per mesh) on K of the
candidate meshes, evenly spaced in the candidates' order (CPU seconds per mesh, the estimates).
`--bounds-only S` computes every candidate's lower bound on its screen estimate
(`autopar.planning.mesh_bound`, what the screen's branch and bound orders meshes by) and counts
those above S seconds: given an estimate S known to be at or above the screen's 4th best, the
screen skips at least those. `--search-only SHAPE` times one kept mesh's search (`search_layouts`
on that mesh, as the mesh choice runs it) and records an md5 of the plan it finds, to compare
two versions of the code.

Writes benchmarks/results/plan_scale.json (`--name` to change).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RunClock, import_lazy_modules, on_meta, table, write_result  # noqa: E402

BATCH, SEQ = 16, 2048


MODELS = {"gpt3-175b": (12288, 96), "gpt-1t": (25600, 160)}  # hidden, heads (PTD-P, ptdp_modeled.py)
# the layers each shape has (without `--layers`): a GPT run is the whole model unless asked otherwise
DEPTHS = {"llama-7b": 32, "gpt3-175b": 96, "gpt-1t": 128}


def measure_gpt(
    name: str, ranks: int, layers: int, microbatches: int | None, bound: bool, cpu_limit: float
) -> dict[str, Any]:
    """The PTD-P shape planned with `autopar.plan(..., "auto", microbatches=M)` in this process."""
    import resource

    import torch

    import autopar
    import autopar.api as api
    from examples.models import GPT, GPTConfig

    hidden, heads = MODELS[name]
    out: dict[str, Any] = {"model": name, "ranks": ranks, "layers": layers, "microbatches": microbatches,
                           "hardware": "a100-cluster", "bound_depths": bound}  # fmt: skip
    cfg = GPTConfig(vocab_size=51200, block_size=SEQ, n_layer=layers, n_head=heads, n_embd=hidden)
    model = on_meta(lambda: GPT(cfg)).to(torch.bfloat16)
    idx = torch.zeros(ranks, SEQ, dtype=torch.long)
    import_lazy_modules()
    original = api.choose_pipeline_mesh
    if not bound:
        api.choose_pipeline_mesh = lambda *a, **k: original(*a, **k, bound_depths=False)  # type: ignore[assignment]
    stages = _time_stages()
    out["stages"] = stages  # filled as the run goes (a run stopped by the CPU limit reports them too)
    used = time.process_time()
    if cpu_limit > 0:
        signal.signal(signal.SIGXCPU, _out_of_cpu)  # stop with what was measured, not killed
        resource.setrlimit(resource.RLIMIT_CPU, (int(used + cpu_limit) + 1, resource.RLIM_INFINITY))
    out["load_average_start"] = os.getloadavg()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        result = autopar.plan(
            model, "auto", (idx, idx), world_size=ranks, memory_limit=80e9,
            planning=autopar.PlanOptions(hardware="a100-cluster"),
            pipeline=autopar.PipelineOptions(microbatches=microbatches) if microbatches else None,
        )  # fmt: skip
    except (Exception, OutOfCpu) as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        out["cpu_s"] = time.process_time() - cpu
        out["load_average_end"] = os.getloadavg()
        return out
    out["wall_s"], out["cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
    out["load_average_end"] = os.getloadavg()
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    depth = result.pipeline_choice
    if depth is not None and depth.tensor_only is not None:  # every tensor-only mesh's row (screen, bound)
        out["tensor_only_ranking"] = depth.tensor_only.to_json()
    if depth is not None:
        best = depth.chosen
        out.update(mesh=f"{best.pp} x {best.stage_mesh}" if best.pp > 1 else best.stage_mesh,
                   schedule=best.schedule, step_ms=best.step_time * 1e3, table=depth.table(),
                   depths_not_priced=sorted({c.pp for c in depth.candidates if c.error.startswith("not priced")}))  # fmt: skip
    else:
        assert result.mesh_choice is not None
        chosen = result.mesh_choice.chosen
        out.update(mesh=chosen.label, schedule="-", step_ms=chosen.rank_time * 1e3)
    return out


class OutOfCpu(BaseException):
    """The run's CPU limit (`--cpu-limit`) was reached (a BaseException: the planner's own
    `except Exception` around a seed must not swallow it)."""


def _out_of_cpu(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGXCPU, signal.SIG_IGN)  # (the soft limit signals again every second)
    raise OutOfCpu(f"not finished in the CPU limit ({time.process_time():.0f} s CPU in this process)")


def _time_stages() -> dict[str, list[float]]:
    """Wrap the parts of `plan(..., "auto", microbatches=M)` whose CPU time matters at scale, in
    place: name -> [calls, inclusive CPU s]. `choose_mesh` is the tensor-only choice (its world
    size is the job's) or a depth's sub-mesh choice; inside each, the screen, the searches of the
    meshes kept and the schedule stage; beside them the depths' cuts and the traces."""
    import autopar.compiler.pipeline_mesh as pipeline_mesh
    import autopar.planning.mesh_choice as mesh_choice

    stages: dict[str, list[float]] = {}

    def timed(module: Any, attr: str, label: Callable[..., str]) -> None:
        inner = getattr(module, attr)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            entry = stages.setdefault(label(*args, **kwargs), [0, 0.0])  # (named before the call runs)
            start = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                entry[0] += 1
                entry[1] += time.process_time() - start

        setattr(module, attr, wrapper)

    world: list[int] = []

    def choice_label(model: Any, world_size: int, *args: Any, **kwargs: Any) -> str:
        world.append(world_size)  # the first choice asked for is the tensor-only one
        return "tensor-only choice" if len(world) == 1 else "sub-mesh choices"

    def inner_label(what: str) -> Callable[..., str]:
        return lambda *a, **k: f"{what} ({'tensor-only' if len(world) == 1 else 'sub-meshes'})"

    timed(pipeline_mesh, "choose_mesh", choice_label)
    timed(mesh_choice, "screen", inner_label("  screen"))
    timed(mesh_choice, "complete", inner_label("  screen completed"))
    timed(mesh_choice, "_evaluate", inner_label("  search of the kept meshes"))
    timed(mesh_choice, "_scheduled", inner_label("  schedule stage"))
    timed(pipeline_mesh, "_cuts", lambda *a, **k: "depths' cuts")
    timed(pipeline_mesh, "trace", lambda *a, **k: "full-depth trace")
    timed(pipeline_mesh, "trace_for_choice", lambda *a, **k: "microbatch trace")
    return stages


def measure_cuts(name: str, ranks: int, layers: int, microbatches: int) -> dict[str, Any]:
    """Every depth's ideal cuts, as `choose_pipeline_mesh` prices them before any sub-mesh choice."""
    import math

    from autopar.compiler.pipeline_mesh import _cuts, _StageGraphs
    from autopar.cost.hardware import load_hardware
    from autopar.passes.trace import trace
    from autopar.planning.step_accounting import PLAIN

    model, idx = _gpt(name, ranks, layers)
    cpu = time.process_time()
    gm = trace(model, (idx, idx), decompose=True)
    traced = time.process_time() - cpu
    cpu = time.process_time()
    graphs = _StageGraphs(gm, load_hardware("a100-cluster"))
    depths = [p for p in range(2, ranks + 1) if ranks % p == 0]
    cuts = {
        pp: _cuts(graphs, pp, ranks // pp, microbatches=microbatches, limit=80e9, weight_state=PLAIN, modes=("none",))
        for pp in depths
    }
    spent = time.process_time() - cpu
    priced = sum(1 for found in cuts.values() for *_, c in found if not isinstance(c, Exception))
    best = min((c.step_time for found in cuts.values() for *_, c in found
                if not isinstance(c, Exception) and c.fits), default=math.inf)  # fmt: skip
    return {"model": name, "ranks": ranks, "layers": layers, "microbatches": microbatches, "trace_cpu_s": traced,
            "cuts_cpu_s": spent, "depths": len(depths), "cuts": len(depths) * len(next(iter(cuts.values()))),
            "priced": priced, "best_ideal_ms": best * 1e3}  # fmt: skip


def _choice_trace(name: str, ranks: int, layers: int) -> tuple[Any, float]:
    """The GPT shape's trace as the mesh choice makes it (`trace_for_choice`, batch = ranks), on
    meta, and the CPU seconds it took."""
    from autopar.compiler.auto_mesh import trace_for_choice

    model, idx = _gpt(name, ranks, layers)
    cpu = time.process_time()
    gm = trace_for_choice(model, ranks, (idx, idx))
    return gm, time.process_time() - cpu


def _gpt(name: str, ranks: int, layers: int) -> tuple[Any, Any]:
    """The GPT shape on meta in bfloat16 and its token batch (batch = ranks); lazy imports done."""
    import torch

    from examples.models import GPT, GPTConfig

    hidden, heads = MODELS[name]
    cfg = GPTConfig(vocab_size=51200, block_size=SEQ, n_layer=layers, n_head=heads, n_embd=hidden)
    model = on_meta(lambda: GPT(cfg)).to(torch.bfloat16)
    idx = torch.zeros(ranks, SEQ, dtype=torch.long)
    import_lazy_modules()
    return model, idx


def measure_screen(name: str, ranks: int, layers: int, meshes: int) -> dict[str, Any]:
    """The tensor-only mesh choice's screen (`mesh_screen.screen`) on `meshes` of the default
    candidates (every `len // meshes`-th, in `mesh_candidates`' order), CPU seconds per mesh."""
    import hashlib
    import math

    from autopar.core.mesh import Mesh
    from autopar.planning.mesh_choice import mesh_candidates
    from autopar.planning.mesh_screen import screen
    from autopar.planning.search_cost import TimeCost
    from autopar.planning.search_steps import StepCache
    from autopar.rules.registry import default_registry

    gm, traced = _choice_trace(name, ranks, layers)
    every = mesh_candidates(ranks)
    picked = every[:: max(1, len(every) // meshes)][:meshes]
    steps = StepCache()
    chosen = [Mesh.from_shape(shape, names) for shape, names in picked]
    costs = [TimeCost("a100-cluster", m.shape, steps=steps) for m in chosen]
    gc.disable()  # as the mesh choice runs
    cpu = time.process_time()
    order, estimates = screen(gm, chosen, default_registry(), costs, keep=4)
    spent = time.process_time() - cpu
    gc.enable()
    values = [(list(m.shape), e.value, e.seed) for m, e in zip(chosen, estimates)]
    estimated = sum(e.screened for e in estimates)
    first = sum(not e.screened and not math.isnan(e.first) for e in estimates)
    return {"model": name, "ranks": ranks, "layers": layers, "trace_cpu_s": traced, "candidates": len(every),
            "screened": len(chosen), "screen_cpu_s": spent, "per_mesh_cpu_s": spent / len(chosen),
            "estimated_in_full": estimated, "first_estimate_only": first,
            "skipped_by_bound": len(chosen) - estimated - first,
            "firsts": [(list(m.shape), e.first) for m, e in zip(chosen, estimates) if not math.isnan(e.first)],
            "best": [values[i] for i in order[:4]],
            "estimates_md5": hashlib.md5(repr(values).encode()).hexdigest(), "estimates": values}  # fmt: skip


def measure_bounds(name: str, ranks: int, layers: int, above: float) -> dict[str, Any]:
    """Every default candidate's `mesh_bound` lower bound on its screen estimate (what the screen's
    branch and bound orders the meshes by), and how many exceed `above` seconds: an estimate the
    screen's `keep`-th best is known to be under skips at least those."""

    from autopar.core.mesh import Mesh
    from autopar.planning.mesh_bound import Bounds
    from autopar.planning.mesh_choice import mesh_candidates
    from autopar.planning.plan_cost import GraphFacts
    from autopar.planning.search_cost import TimeCost
    from autopar.planning.search_steps import StepCache

    gm, traced = _choice_trace(name, ranks, layers)
    cpu = time.process_time()
    bounds, steps = Bounds(gm, GraphFacts.of(gm)), StepCache()
    every = mesh_candidates(ranks)
    found = []
    for shape, names in every:
        mesh = Mesh.from_shape(shape, names)
        found.append((bounds.bound(mesh, TimeCost("a100-cluster", mesh.shape, steps=steps)), list(shape)))
    spent = time.process_time() - cpu
    found.sort()
    return {"model": name, "ranks": ranks, "layers": layers, "trace_cpu_s": traced, "bounds_cpu_s": spent,
            "candidates": len(every), "above_s": above, "bounded_above": sum(b > above for b, _ in found),
            "lowest": found[:4], "highest": found[-4:], "bounds": found}  # fmt: skip


def measure_search(name: str, ranks: int, layers: int, shape: str) -> dict[str, Any]:
    """One kept mesh's search (`search.search_layouts`, as the mesh choice's `_evaluate` runs it:
    a100-cluster, 80 GB, gc off) on the `trace_for_choice` trace; CPU seconds and an md5 of the
    plan (every strategy, the regathers and recomputed ops, memory, cost and the prices tried)."""
    import hashlib

    from autopar.core.mesh import Mesh
    from autopar.planning.search import search_layouts
    from autopar.planning.search_cost import TimeCost
    from autopar.rules.registry import default_registry

    gm, traced = _choice_trace(name, ranks, layers)
    sizes = tuple(int(s) for s in shape.split("x"))
    mesh = Mesh.from_shape(sizes, tuple("xyzw"[: len(sizes)]))
    gc.disable()
    cpu = time.process_time()
    plan = search_layouts(gm, mesh, default_registry(), cost=TimeCost("a100-cluster", mesh.shape), memory_limit=80e9)
    spent = time.process_time() - cpu
    gc.enable()
    report = gm.meta["autopar_search"]
    seen = (sorted((k, repr(v)) for k, v in plan.strategies.items()), plan.regather, plan.recompute, plan.savings,
            plan.memory, report.final_cost, report.prices)  # fmt: skip
    return {"model": name, "ranks": ranks, "layers": layers, "mesh": shape, "trace_cpu_s": traced,
            "search_cpu_s": spent, "plan_md5": hashlib.md5(repr(seen).encode()).hexdigest(),
            "search": plan.notes["__search__"], "solves": report.solves, "memo_hits": report.memo_hits,
            "prices": len(report.prices), "load_average_end": os.getloadavg()}  # fmt: skip


def measure(ranks: int, layers: int, hardware: str, searched: int | None, fold: bool = False) -> dict[str, Any]:
    """Build, then `autopar.plan(..., "auto")`, in this (fresh) process."""
    import torch

    import autopar
    import autopar.api as api
    from examples.zoo import Llama, LlamaConfig

    out: dict[str, Any] = {
        "ranks": ranks,
        "layers": layers,
        "hardware": hardware,
        "searched_at_most": searched,
        "fold": fold,
    }
    cfg = LlamaConfig(
        vocab_size=32000, seq_len=SEQ, dim=4096, n_layer=layers, n_head=32, n_kv_head=32, hidden=11008
    )
    model = on_meta(lambda: Llama(cfg))
    idx = torch.zeros(BATCH, SEQ, dtype=torch.long)
    import_lazy_modules()  # import time is not planning time
    chosen_mesh = api.choose_mesh
    spent: dict[str, float] = {}

    def timed_choice(*args: Any, **kwargs: Any) -> Any:
        if searched is not None:
            kwargs["searched_candidates"] = searched
        kwargs["fold"] = fold
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return chosen_mesh(*args, **kwargs)
        finally:
            spent["choice_s"], spent["choice_cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu

    api.choose_mesh = timed_choice  # type: ignore[assignment]  # (as plan() calls it)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        result = autopar.plan(
            model, "auto", (idx, idx), world_size=ranks, planning=autopar.PlanOptions(hardware=hardware)
        )
        out["wall_s"], out["cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        out["traceback"] = traceback.format_exc(limit=8)[:4000]  # (an fx error prints the whole graph)
        return out
    finally:
        api.choose_mesh = chosen_mesh
        gc.collect()
    out.update(spent)
    choice = result.mesh_choice
    assert choice is not None
    chosen = choice.chosen
    out.update(
        parameters=sum(p.numel() for p in model.parameters()),
        mesh="x".join(map(str, chosen.shape)),
        roles="/".join(chosen.roles),
        scheduled_ms=chosen.scheduled_time * 1e3,
        sum_ms=chosen.step_time * 1e3,
        step_ms=result.step_time * 1e3,
        memory_gib=result.memory.total / 2**30,
        candidates=len(choice.candidates),
        searched=sum(c.searched for c in choice.candidates),
        ranking=choice.to_json(),
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="*", default=[8, 64, 512])
    parser.add_argument(
        "--layers", type=int, nargs="*", default=None, help="default: the model's own (32, 96 for 175B, 128 for 1T)"
    )
    parser.add_argument("--hardware", default="h100-nvlink-ib")
    parser.add_argument(
        "--searched",
        type=int,
        default=None,
        help="candidates searched at most (default: the library's; 0: all)",
    )
    parser.add_argument("--name", default="plan_scale", help="result file name under benchmarks/results")
    parser.add_argument("--notes", default="")
    parser.add_argument("--model", default="llama-7b", choices=["llama-7b", *MODELS])
    parser.add_argument("--microbatches", type=int, default=None, help="pipeline depths compete (GPT shapes)")
    parser.add_argument(
        "--no-bound", action="store_true", help="price every pipeline depth (no branch and bound)"
    )
    parser.add_argument(
        "--fold", action="store_true", help="rank on the graph cut to 4 and 5 blocks (`choose_mesh(fold=True)`)"
    )
    parser.add_argument("--cpu-limit", type=float, default=0.0, help="CPU seconds per run (0: none)")
    parser.add_argument("--cuts-only", action="store_true", help="time every depth's ideal cuts only")
    parser.add_argument(
        "--screen-only", type=int, default=0, metavar="K", help="time the screen on K of the candidate meshes"
    )
    parser.add_argument(
        "--bounds-only", type=float, default=None, metavar="S",
        help="every candidate's screen bound, and how many exceed S seconds",
    )  # fmt: skip
    parser.add_argument("--search-only", default="", metavar="SHAPE", help="time one mesh's search (e.g. 192x8)")
    args = parser.parse_args()
    if args.layers is None:
        args.layers = [DEPTHS[args.model]]
    clock = RunClock()
    ctx = multiprocessing.get_context("spawn")
    if args.search_only:
        _each_size(args, clock, ctx, measure_search, args.search_only, hidden=None)
        return
    if args.bounds_only is not None:
        _each_size(args, clock, ctx, measure_bounds, args.bounds_only, hidden="bounds")
        return
    if args.screen_only:
        _each_size(args, clock, ctx, measure_screen, args.screen_only, hidden="estimates")
        return
    if args.cuts_only:
        _each_size(args, clock, ctx, measure_cuts, args.microbatches or 1, hidden=None)
        return
    if args.model != "llama-7b":
        gpt_main(args, clock, ctx)
        return
    runs = []
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as pool:
        for layers in args.layers:
            for ranks in args.ranks:
                run = pool.submit(measure, ranks, layers, args.hardware, args.searched, args.fold).result()
                runs.append(run)
                status = run.get("error") or (
                    f"{run['wall_s']:.1f} s ({run['cpu_s']:.1f} s CPU), {run['mesh']}, "
                    f"{run['scheduled_ms']:.1f} ms scheduled"
                )
                print(f"  ranks={ranks:<4} layers={layers:<3} {status}", flush=True)
    rows = []
    for r in runs:
        if "error" in r:
            rows.append([r["ranks"], r["layers"], "ERROR", "", "", "", "", "", "", r["error"][:80]])
            continue
        rows.append(
            [
                r["ranks"],
                r["layers"],
                f"{r['wall_s']:.1f}",
                f"{r['cpu_s']:.1f}",
                f"{r['choice_cpu_s']:.1f}",
                f"{r['searched']} / {r['candidates']}",
                f"{r['mesh']} ({r['roles']})",
                f"{r['scheduled_ms']:.1f}",
                f"{r['step_ms']:.1f}",
                f"{r['memory_gib']:.2f}",
            ]
        )
    print(
        f'\nautopar.plan(model, "auto", world_size=N) for the LLaMA-7B shape, batch {BATCH} x {SEQ}, {args.hardware}'
    )
    print(
        table(
            [
                "ranks",
                "layers",
                "wall s",
                "CPU s",
                "mesh choice CPU s",
                "searched / candidates",
                "chosen mesh",
                "scheduled ms",
                "step ms",
                "memory GiB/rank",
            ],
            rows,
        )
    )
    path = write_result(
        args.name,
        {
            "notes": args.notes,
            "hardware": args.hardware,
            "batch": BATCH,
            "seq": SEQ,
            **clock.record(),
            "runs": runs,
        },
    )
    print(f"wrote {path}")


def gpt_main(args: argparse.Namespace, clock: RunClock, ctx: Any) -> None:
    """`--model gpt3-175b` / `gpt-1t`: each (layers, ranks) in a fresh process, CPU-limited."""
    runs = []
    for layers in args.layers:
        for ranks in args.ranks:
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as pool:
                job = pool.submit(
                    measure_gpt,
                    args.model,
                    ranks,
                    layers,
                    args.microbatches,
                    not args.no_bound,
                    args.cpu_limit,
                )
                try:
                    run = job.result()
                except BrokenProcessPool as exc:  # the CPU limit kills the worker
                    run = {"model": args.model, "ranks": ranks, "layers": layers, "microbatches": args.microbatches,
                           "bound_depths": not args.no_bound,
                           "error": f"not finished in {args.cpu_limit:.0f} s CPU ({type(exc).__name__})"}  # fmt: skip
            runs.append(run)
            done = run.get("error") or f"{run['cpu_s']:.1f} s CPU, {run['mesh']} {run['schedule']}"
            print(f"  {args.model} ranks={ranks} layers={layers}: {done}", flush=True)
            if "table" in run:
                print(run["table"], flush=True)
            for stage, (calls, spent) in run.get("stages", {}).items():
                print(f"    {stage}: {spent:.1f} s CPU in {calls} call(s)", flush=True)
    rows = [
        [r["model"], r["ranks"], r["layers"], r["microbatches"] or "-", "yes" if r["bound_depths"] else "no",
         r.get("error", "")[:60] or f"{r['cpu_s']:.1f}", r.get("mesh", ""), r.get("schedule", ""),
         f"{r['step_ms']:.1f}" if "step_ms" in r else "", ",".join(map(str, r.get("depths_not_priced", [])))]
        for r in runs
    ]  # fmt: skip
    print(table(["model", "ranks", "layers", "M", "bound", "CPU s", "chosen", "schedule", "step ms",
                 "depths not priced"], rows))  # fmt: skip
    path = write_result(args.name, {"notes": args.notes, **clock.record(), "runs": runs})
    print(f"wrote {path}")


def _each_size(
    args: argparse.Namespace,
    clock: RunClock,
    ctx: Any,
    measure: Callable[..., dict[str, Any]],
    extra: Any,
    hidden: str | None,
) -> None:
    """`measure(model, ranks, layers, extra)` in a fresh child process for every size asked for
    (one process each: no cache or import warms the next), printed without its `hidden` field,
    and written as one result file."""
    runs = []
    for layers in args.layers:
        for ranks in args.ranks:
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as pool:
                run = pool.submit(measure, args.model, ranks, layers, extra).result()
            runs.append(run)
            print(f"  { {k: v for k, v in run.items() if k != hidden} }", flush=True)
    path = write_result(args.name, {"notes": args.notes, **clock.record(), "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
