"""Compile time: wall seconds of each compiler stage for one rank, at real model sizes.

Models, built on the meta device (no weights are allocated; the tracer clones them onto fake
tensors), batch 8, compiled for rank (0, 0, 0) of a (4, 4, 4) planning mesh (64 ranks, no process
group), with the greedy planner and the search:

- GPT-2 small (examples/models.GPT): 12 layers, h = 768, 12 heads, sequence 1024, tied head.
  The vocabulary is 50304, not GPT-2's 50257: a multiple of 64 (every split even), as in the
  earlier runs of this benchmark (50257 compiles too, in uneven blocks, in about the same time).
- LLaMA-3-8B-shaped decoder (examples/zoo.Llama): 32 layers, h = 4096, 32 heads, 8 k/v heads,
  SwiGLU width 14336, vocabulary 128256, sequence 2048.

Each compile runs in a fresh process (what one rank pays once, imports excluded: the modules
torch imports lazily on the first trace, torch.export's dynamo among them, are imported first and
timed apart as `imports`). Stages are the functions `autopar.api.compile_for_rank` calls, timed
inside it: trace, plan (the planner), propagate (records the plan), insert_comm, schedule, emit,
report; `other` is the rest of compile_for_rank. The emitted graphs' Python code is generated on
their first call (`autopar.plan` never runs them), so it is timed after the compile, apart
("first-call codegen"), and not in the total. Wall and CPU seconds are both recorded (the
machine is shared: CPU seconds are what the compile itself spent). The growth table repeats the
greedy compile with 4, 8, 16 and 32 layers.

    python benchmarks/compile_time.py                 # targets (both planners) + growth (greedy), ~3 min
    python benchmarks/compile_time.py --full          # both planners, 4..32 layers, ~5 min
    python benchmarks/compile_time.py --models gpt2-small --layers 12
    python benchmarks/compile_time.py --planners greedy --layers 4 8
    python benchmarks/compile_time.py --layers 12 --models gpt2-small --repeat 5 --name compile_time_targets

`--repeat N` compiles every config N times, alternating, and shows each config's median run.
Writes benchmarks/results/compile_time.json (or <name>.json). Timings are from a shared machine; the load average
at the start and end is recorded beside them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import STAGES, Mesh, import_lazy_modules, on_meta, staged_compile, table, write_result  # noqa: E402

MESH = (4, 4, 4)
BATCH = 8
MODELS: dict[str, dict[str, Any]] = {
    "gpt2-small": {"layers": 12, "target_s": 5.0, "growth": [4, 8, 16, 32]},
    "llama-8b": {"layers": 32, "target_s": 20.0, "growth": [4, 8, 16, 32]},
}


def build(name: str, layers: int) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    import torch

    if name == "gpt2-small":
        from examples.models import GPT, GPTConfig

        cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=layers, n_head=12, n_embd=768)
        model = on_meta(lambda: GPT(cfg))
        seq = cfg.block_size
    elif name == "llama-8b":
        from examples.zoo import Llama, LlamaConfig

        lcfg = LlamaConfig(
            vocab_size=128256, seq_len=2048, dim=4096, n_layer=layers, n_head=32, n_kv_head=8, hidden=14336
        )
        model = on_meta(lambda: Llama(lcfg))
        seq = lcfg.seq_len
    else:
        raise ValueError(name)
    params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    idx = torch.zeros(BATCH, seq, dtype=torch.long)
    return model, (idx, idx), {"parameters": params, "seq": seq}


def measure(name: str, layers: int, planner: str) -> dict[str, Any]:
    """One compile in this (fresh) process."""
    import resource

    from torch.fx._lazy_graph_module import _LazyGraphModule

    out: dict[str, Any] = {"model": name, "layers": layers, "planner": planner, "mesh": list(MESH)}
    out["imports_s"], out["imports_cpu_s"] = import_lazy_modules()
    try:
        model, inputs, facts = build(name, layers)
        out.update(facts)
        compiled, times = staged_compile(model, Mesh.from_shape(MESH), inputs, planner)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        out["traceback"] = traceback.format_exc(limit=8)
        return out
    # the emitted graphs' Python code is generated on their first call, not in compile_for_rank
    # (`autopar.plan` never runs them): timed here, apart from the compile
    started = time.perf_counter()
    for gm in (compiled.program.forward, compiled.program.backward):
        _LazyGraphModule.force_recompile(gm)
    out["first_call_codegen_s"] = time.perf_counter() - started
    out.update(
        times=times,
        joint_nodes=len(compiled.graph.graph.nodes),
        collectives=len(compiled.report.collectives),
        forward_nodes=len(compiled.program.forward.graph.nodes),
        backward_nodes=len(compiled.program.backward.graph.nodes),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    return out


def _config(run: dict[str, Any]) -> tuple[str, int, str]:
    return (run["model"], run["layers"], run["planner"])


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median total (the lower middle one for an even count); errors win."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r["times"]["total"])
    return ordered[(len(ordered) - 1) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--planners", nargs="*", default=["greedy", "search"])
    parser.add_argument("--layers", type=int, nargs="*", help="layer counts (with --models / --planners)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="compile every config N times, configs alternating, and report each config's median run",
    )
    parser.add_argument("--name", default="compile_time", help="writes benchmarks/results/<name>.json")
    parser.add_argument(
        "--full", action="store_true", help="every model's growth list with every planner (~12 min)"
    )
    args = parser.parse_args()

    started = time.perf_counter()
    load_before = os.getloadavg()
    if args.full or args.layers:
        configs = [
            (name, layers, planner)
            for name in args.models
            for layers in (args.layers or MODELS[name]["growth"])
            for planner in args.planners
        ]
    else:  # the two targets with both planners, the growth with the greedy planner
        configs = [(name, MODELS[name]["layers"], pl) for name in args.models for pl in args.planners]
        configs += [(name, n, "greedy") for name in args.models for n in MODELS[name]["growth"]]
        configs = sorted(set(configs), key=lambda c: (list(MODELS).index(c[0]), c[1], c[2]))
    ctx = multiprocessing.get_context("spawn")
    runs = []
    # --repeat: every config once per round, the order reversed every other round, so that drifts
    # in machine load hit all configs alike; each config is then shown by its median run
    configs = [c for rep in range(args.repeat) for c in (configs if rep % 2 == 0 else configs[::-1])]
    # one compile at a time, each in a fresh process: the timings do not share a core or a cache
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as pool:
        for config in configs:
            run = pool.submit(measure, *config).result()
            runs.append(run)
            status = run.get("error") or f"{run['times']['total']:.1f} s"
            print(f"  {config[0]:<10} L={config[1]:<3} {config[2]:<7} {status}", flush=True)

    every_run = runs
    if args.repeat > 1:
        runs = [
            _median_run([r for r in every_run if _config(r) == config])
            for config in dict.fromkeys(map(_config, every_run))
        ]
    stage_cols = [s for s in STAGES if s not in ("propagate", "report")]
    rows = []
    for r in runs:
        head = [r["model"], r["layers"], r["planner"]]
        if "error" in r:
            rows.append(head + ["ERROR"] + [""] * (len(stage_cols) + 6) + [r["error"][:80]])
            continue
        t = r["times"]
        target = MODELS[r["model"]]["target_s"] if r["layers"] == MODELS[r["model"]]["layers"] else None
        verdict = "" if target is None else ("ok" if t["total"] <= target else f"MISS (> {target:.0f} s)")
        rows.append(
            head
            + [f"{t['total']:.1f}", f"{t['cpu_total']:.1f}"]
            + [f"{t[s]:.2f}" for s in stage_cols]
            + [
                f"{r['first_call_codegen_s']:.2f}",
                f"{r['imports_s']:.1f}",
                r["joint_nodes"],
                r["collectives"],
                f"{r['peak_rss_mb']:.0f}",
                verdict,
            ]
        )
    print(f"\nCompile time for rank 0 of a {'x'.join(map(str, MESH))} planning mesh (seconds; stages wall)")
    print(
        table(
            ["model", "layers", "planner", "total", "CPU"]
            + stage_cols
            + ["first-call codegen", "imports", "joint nodes", "collectives", "RSS MB", "target"],
            rows,
        )
    )
    # growth: the total at each depth and its ratio to the previous depth (x2.0 per doubling = linear)
    depths = sorted({r["layers"] for r in runs if "error" not in r})
    growth = []
    for name in args.models:
        for planner in args.planners:
            ok = sorted(
                (r for r in runs if r["model"] == name and r["planner"] == planner and "error" not in r),
                key=lambda r: r["layers"],
            )
            if len(ok) < 2:
                continue
            cells = {ok[0]["layers"]: f"{ok[0]['times']['total']:.1f}"}
            for lo, hi in zip(ok, ok[1:]):
                ratio = hi["times"]["total"] / max(lo["times"]["total"], 1e-9)
                cells[hi["layers"]] = f"{hi['times']['total']:.1f} (x{ratio:.2f})"
            span = ok[-1]["layers"] - ok[0]["layers"]
            per_layer = (ok[-1]["times"]["total"] - ok[0]["times"]["total"]) / span
            cpu_per_layer = (ok[-1]["times"]["cpu_total"] - ok[0]["times"]["cpu_total"]) / span
            growth.append(
                [name, planner]
                + [cells.get(d, "") for d in depths]
                + [f"{per_layer:.2f}", f"{cpu_per_layer:.2f}"]
            )
    if growth:
        print("\nGrowth with depth: total wall seconds per layer count (ratio to the previous count)")
        headers = (
            ["model", "planner"] + [f"L={d}" for d in depths] + ["s per extra layer", "CPU s per extra layer"]
        )
        print(table(headers, growth))
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    print(
        f"\n{len(runs)} compiles in {elapsed:.0f} s; load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
    )
    path = write_result(
        args.name,
        {
            "mesh": list(MESH),
            "batch": BATCH,
            "targets_s": {name: MODELS[name]["target_s"] for name in MODELS},
            "notes": "gpt2-small uses vocab 50304 (a multiple of 64); models built on the meta device; "
            "stage times are wall seconds inside compile_for_rank, cpu_* CPU seconds; lazy torch imports "
            "timed apart (imports_s)",
            "mode": "full" if args.full else "custom" if args.layers else "default",
            "load_average_before_after": [load_before, load_after],
            "runs": runs,
            "repeat": args.repeat,
            "every_run_total_s": {
                " ".join(map(str, c)): [
                    r["times"]["total"] for r in every_run if _config(r) == c and "times" in r
                ]
                for c in dict.fromkeys(map(_config, every_run))
            },
            "wall_seconds": elapsed,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
