"""A measured timeline: a few steps of the 8-rank gloo GPT under torch.profiler, on every rank.

The job of benchmarks/step_time.py (examples/models.make_gpt, one torch thread per rank, forked by
tests/multirank.py) compiles the GPT with and without the schedule pass, warms both up, then
profiles `--steps` forward+backward steps of each. Ranks in `--trace-ranks` (default 0 and 1) export Chrome
traces of the last profiled step (~1.5 MB each), openable in ui.perfetto.dev or chrome://tracing:

    benchmarks/results/profile/rank<r>.json              scheduled
    benchmarks/results/profile/rank<r>_unscheduled.json  unscheduled

and every rank's profiler events are summarized per step (milliseconds, main thread unless said):

- step: the step's wall time;
- compute: outermost aten ops, outside any collective (the local work);
- issue: inside the functional collectives' own calls (buffer set-up, handing work to gloo);
- wait: blocked in `wait_tensor` (communication not hidden behind compute);
- other: the rest of the step (Python, autograd, the runtime's bookkeeping);
- gloo: summed durations of gloo's collective events (`gloo:*`, the time each collective was in
  flight, on gloo's threads; collectives of different process groups may overlap each other);
- hidden: 1 - wait / gloo, the share of in-flight collective time the rank did not wait for.

    python benchmarks/profile_timeline.py               # ~2 min on 2 cores, mesh (2,2,2)
    python benchmarks/profile_timeline.py --mesh 8 --steps 3 --trace-ranks 0

Writes benchmarks/results/profile_timeline.json (the table) and the traces above.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, table, write_result  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from multirank import run_ranks  # noqa: E402
from torch.autograd.profiler import record_function  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import autopar  # noqa: E402
from autopar.core.mesh import default_axis_names  # noqa: E402
from autopar.runtime.module import ParallelModule  # noqa: E402
from examples.models import make_gpt  # noqa: E402

PROFILE_DIR = RESULTS / "profile"
VARIANTS = ("scheduled", "unscheduled")
STEP = "autopar_step"


def _step(pmodel: ParallelModule, batch: tuple[torch.Tensor, ...]) -> None:
    for p in pmodel.parameters():
        p.grad = None
    pmodel(*batch).backward()


def _ancestors(event: Any) -> list[str]:
    names = []
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def trim_trace(path: Path) -> None:
    """Keep only the last profiled step and drop per-event args: ~1.5 MB instead of ~2.5 MB a step."""
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    last = max((e for e in events if e.get("name") == STEP), key=lambda e: e["ts"])
    start, end = last["ts"], last["ts"] + last["dur"]
    kept = []
    for e in events:
        if "ts" in e and not start <= e["ts"] <= end:
            continue
        if e.get("ph") == "X":
            e.pop("args", None)
        kept.append(e)
    trace["traceEvents"] = kept
    path.write_text(json.dumps(trace, separators=(",", ":")))


def summarize_events(events: Any) -> dict[str, float]:
    """Per-step milliseconds of compute / collective issue / wait / gloo from one rank's events."""
    steps = [e for e in events if e.name == STEP]
    if not steps:
        raise ValueError("no step events recorded")
    main = steps[0].thread
    total = {"step": 0.0, "compute": 0.0, "issue": 0.0, "wait": 0.0, "gloo": 0.0}
    collectives = 0
    for e in events:
        duration = (e.time_range.end - e.time_range.start) / 1e3  # us -> ms
        if e.name == STEP:
            total["step"] += duration
        elif e.name.startswith("gloo:"):
            total["gloo"] += duration
            collectives += 1
        elif e.thread == main:
            up = _ancestors(e)
            if STEP not in up:
                continue
            inside_comm = any(n.startswith(("_c10d_functional::", "c10d::")) for n in up)
            if e.name == "_c10d_functional::wait_tensor" and not inside_comm:
                total["wait"] += duration
            elif e.name.startswith("_c10d_functional::") and not inside_comm:
                total["issue"] += duration
            elif (
                e.name.startswith("aten::")
                and not inside_comm
                and not any(n.startswith("aten::") for n in up)
            ):
                total["compute"] += duration
    n = len(steps)
    out = {k: v / n for k, v in total.items()}
    out["other"] = out["step"] - out["compute"] - out["issue"] - out["wait"]
    out["hidden"] = max(0.0, 1.0 - out["wait"] / out["gloo"]) if out["gloo"] > 0 else 0.0
    out["gloo_collectives"] = collectives / n
    return out


def _job(
    rank: int,
    world_size: int,
    mesh_shape: tuple[int, ...],
    cfg: dict[str, int],
    batch_size: int,
    steps: int,
    trace_ranks: tuple[int, ...],
    out_dir: str,
) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=default_axis_names(len(mesh_shape)))
    model, batch = make_gpt(0, batch_size, **cfg)
    models = {
        name: autopar.parallelize(
            copy.deepcopy(model), mesh, example_inputs=batch,
            planning=autopar.PlanOptions(overlap=name == "scheduled"),
        )
        for name in VARIANTS
    }
    summaries: dict[str, Any] = {}
    for name, pmodel in models.items():
        for _ in range(2):  # warm-up: first-call allocations and lazy initialization
            _step(pmodel, batch)
        torch.distributed.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                with record_function(STEP):
                    _step(pmodel, batch)
        if rank in trace_ranks:
            suffix = "" if name == "scheduled" else f"_{name}"
            path = Path(out_dir) / f"rank{rank}{suffix}.json"
            prof.export_chrome_trace(str(path))
            trim_trace(path)
        summaries[name] = summarize_events(prof.events())
    return summaries


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mesh", default="2,2,2", help="mesh shape of 8 ranks")
    parser.add_argument(
        "--steps", type=int, default=3, help="profiled steps per variant (traces keep the last)"
    )
    parser.add_argument("--trace-ranks", default="0,1", help="ranks that write Chrome traces ('' for none)")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.mesh.split(","))
    trace_ranks = tuple(int(r) for r in args.trace_ranks.split(",") if r)
    PROFILE_DIR.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = run_ranks(
        8, _job, shape, {}, args.batch, args.steps, trace_ranks, str(PROFILE_DIR), timeout=900
    )
    wall = time.perf_counter() - start

    keys = ("step", "compute", "issue", "wait", "other", "gloo")
    rows = []
    for rank, per_variant in enumerate(results):
        for name in VARIANTS:
            s = per_variant[name]
            rows.append([rank, name, *(f"{s[k]:.1f}" for k in keys), f"{100 * s['hidden']:.0f}%"])
    for name in VARIANTS:
        med = {k: statistics.median(r[name][k] for r in results) for k in (*keys, "hidden")}
        rows.append(["median", name, *(f"{med[k]:.1f}" for k in keys), f"{100 * med['hidden']:.0f}%"])
    print(f"mesh {shape}, {args.steps} profiled steps per variant, ms per step ({wall:.0f} s)")
    print(table(["rank", "variant", *(f"{k} ms" for k in keys), "hidden"], rows))
    traces = sorted(str(p.relative_to(ROOT)) for p in PROFILE_DIR.glob("rank*.json"))
    print("traces: " + ", ".join(traces))
    payload = {
        "mesh": list(shape),
        "steps": args.steps,
        "batch": args.batch,
        "per_rank": results,
        "traces": traces,
    }
    print(f"wrote {write_result('profile_timeline', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
