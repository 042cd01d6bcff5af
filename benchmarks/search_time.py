"""Search time against depth: the plan stage of compile_time.py (planner="search") at 4..32 layers.

Same models, mesh and batch as `compile_time.py` (GPT-2 small and the LLaMA-8B shape, rank 0 of a
(4, 4, 4) planning mesh, batch 8, built on the meta device), but only trace + the search are run,
each configuration in a fresh process, with Python's cyclic garbage collector paused as
`compile_for_rank` runs it. The search memoizes the dynamic program of chains that repeat (one per
transformer layer), so its time should grow much more slowly than the layer count; "final cost"
(modeled seconds per step on `--hardware`, or element counts with `--hardware none`) shows that
the faster search finds the same plan quality. "seeds" counts the seed plans it priced (the greedy
plan of each axis-role assignment and the fixed 1-D / 2-D / cube plans that lay out on the mesh).

    python benchmarks/search_time.py                         # both models, 4 8 16 32 layers
    python benchmarks/search_time.py --models gpt2-small --layers 4 32

Writes benchmarks/results/search_time.json.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Mesh, table, write_result  # noqa: E402
from compile_time import BATCH, MESH, build  # noqa: E402


def measure(name: str, layers: int, hardware: str | None) -> dict[str, Any]:
    """Trace, then the search, in this (fresh) process."""
    from autopar.passes.trace import trace
    from autopar.planning.search import TimeCost, search_layouts
    from autopar.rules.registry import default_registry

    out: dict[str, Any] = {"model": name, "layers": layers, "mesh": list(MESH), "hardware": hardware}
    try:
        model, inputs, facts = build(name, layers)
        out.update(facts)
        mesh = Mesh.from_shape(MESH)
        start = time.perf_counter()
        gm = trace(model, inputs, decompose=True)
        out["trace_s"] = time.perf_counter() - start
        cost = TimeCost(hardware, mesh.shape) if hardware else None
        gc.disable()  # as compile_for_rank does while it compiles
        start, cpu = time.perf_counter(), time.process_time()
        search_layouts(gm, mesh, default_registry(), cost=cost)
        out["search_s"] = time.perf_counter() - start
        out["search_cpu_s"] = time.process_time() - cpu
        gc.enable()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        out["traceback"] = traceback.format_exc(limit=8)
        return out
    report = gm.meta["autopar_search"]
    out.update(
        joint_nodes=len(gm.graph.nodes),
        variables=report.variables,
        chains=report.chains,
        distinct_chains=getattr(report, "distinct_chains", None),
        sweeps=report.sweeps,
        seed_cost=report.seed_cost,
        final_cost=report.final_cost,
        seeds=len(report.seeds),
        chosen_seed=getattr(report, "chosen_seed", ""),
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="*", default=["gpt2-small", "llama-8b"])
    parser.add_argument("--layers", type=int, nargs="*", default=[4, 8, 16, 32])
    parser.add_argument(
        "--hardware", default="h100-nvlink-ib", help='a hardware table, or "none" (element counts)'
    )
    parser.add_argument("--name", default="search_time", help="result file name under benchmarks/results")
    args = parser.parse_args()
    hardware = None if args.hardware == "none" else args.hardware
    started = time.perf_counter()
    load_before = os.getloadavg()
    ctx = multiprocessing.get_context("spawn")
    runs = []
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as pool:
        for name in args.models:
            for layers in args.layers:
                run = pool.submit(measure, name, layers, hardware).result()
                runs.append(run)
                status = (
                    run.get("error") or f"search {run['search_s']:.2f} s ({run['search_cpu_s']:.2f} s CPU)"
                )
                print(f"  {name:<10} L={layers:<3} {status}", flush=True)
    rows = []
    for r in runs:
        if "error" in r:
            rows.append([r["model"], r["layers"], "ERROR", "", "", "", "", "", "", r["error"][:80]])
            continue
        rows.append(
            [
                r["model"],
                r["layers"],
                f"{r['search_s']:.2f}",
                f"{r['search_cpu_s']:.2f}",
                f"{r['trace_s']:.2f}",
                r["variables"],
                f"{r['chains']} / {r['distinct_chains']}",
                r["sweeps"],
                r.get("seeds", ""),
                f"{r['final_cost']:.4g}",
            ]
        )
    print(f"\nSearch time for rank 0 of a {'x'.join(map(str, MESH))} planning mesh, batch {BATCH} (seconds)")
    print(
        table(
            [
                "model",
                "layers",
                "search s",
                "search CPU s",
                "trace s",
                "variables",
                "chains / distinct",
                "sweeps",
                "seeds",
                "final cost",
            ],
            rows,
        )
    )
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    print(f"\n{len(runs)} runs in {elapsed:.0f} s; load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    path = write_result(
        args.name,
        {
            "mesh": list(MESH),
            "batch": BATCH,
            "hardware": hardware,
            "load_average_before_after": [load_before, load_after],
            "runs": runs,
            "wall_seconds": elapsed,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
