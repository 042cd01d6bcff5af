"""Planning time of `autopar.plan(model, "auto", world_size=N)` at scale: the LLaMA-7B shape.

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

Writes benchmarks/results/plan_scale.json (`--name` to change).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RunClock, import_lazy_modules, on_meta, table, write_result  # noqa: E402

BATCH, SEQ = 16, 2048


def measure(ranks: int, layers: int, hardware: str, searched: int | None) -> dict[str, Any]:
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
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return chosen_mesh(*args, **kwargs)
        finally:
            spent["choice_s"], spent["choice_cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu

    api.choose_mesh = timed_choice  # type: ignore[assignment]  # (as plan() calls it)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        result = autopar.plan(model, "auto", (idx, idx), world_size=ranks, planning=autopar.PlanOptions(hardware=hardware))
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
    parser.add_argument("--layers", type=int, nargs="*", default=[32])
    parser.add_argument("--hardware", default="h100-nvlink-ib")
    parser.add_argument(
        "--searched",
        type=int,
        default=None,
        help="candidates searched at most (default: the library's; 0: all)",
    )
    parser.add_argument("--name", default="plan_scale", help="result file name under benchmarks/results")
    parser.add_argument("--notes", default="")
    args = parser.parse_args()
    clock = RunClock()
    ctx = multiprocessing.get_context("spawn")
    runs = []
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as pool:
        for layers in args.layers:
            for ranks in args.ranks:
                run = pool.submit(measure, ranks, layers, args.hardware, args.searched).result()
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


if __name__ == "__main__":
    main()
