"""Overlap: modeled exposed communication before and after the schedule stage, on the H100 table.

The GPT layer stack of benchmarks/plan_quality.py (examples/models.GPT, h = 4096, 32 heads,
s = 2048, b = 8, 3 layers, vocabulary 512, fp32, built on the meta device) is planned with the
search planner priced on `h100-nvlink-ib` for rank 0 of planning meshes of 64 and 512 ranks (the
best mesh of plan_quality and the AxoNN grid), and of 8 ranks (one node) for contrast. The timeline
model (`autopar.cost.timeline`) runs one step with a compute stream and one communication stream:

- "before": insert_comm's order, every wait right after its collective (nothing overlaps);
- "after": the schedule stage (bucketing, issue early, wait late, lookahead, one collective in
  flight per process group), exactly as `autopar.plan` compiles it;
- "floor": max(0, comm - compute) / comm, the least exposure any order can reach on one stream;
- "links": one communication stream per link (NVLink, network), as NCCL's per-group streams on
  different links would run, in the schedule stage's clock (`schedule(..., streams="link")`) and in
  the model;
- ablations of the schedule on the same graph: no bucketing, no lookahead, two in flight per group;
- "over-decomposed (auto)": `over_decompose="auto"`, the batch cut into 1, 2 or 4 chunks per rank
  (those that divide it), each lowered, scheduled and modeled; the fastest step is kept;
- "mesh auto" (`--auto`, default p = 8): `autopar.plan(model, "auto", world_size=p)`, every
  factorization of p planned and the best few by the no-overlap sum lowered, scheduled and ranked
  by their modeled step with overlap (`autopar.planning.mesh_choice`); the chosen mesh's exposure.

    python benchmarks/overlap.py              # ~1.5 min on 2 cores (2 worker processes)
    python benchmarks/overlap.py --auto 8 64  # ~4 min: also the mesh choice at 64 ranks (26 meshes)
    python benchmarks/overlap.py --p 64
    python benchmarks/overlap.py --decomposed 8 64 512  # ~6 min: decomposed collective matmuls only

Writes benchmarks/results/overlap.json (`--decomposed`: overlap_decomposed.json): the same plan
compiled with `decompose_matmuls` "off", "auto" and "on" (all-gather -> matmul and matmul ->
reduce-scatter pairs cut into overlapping pieces, docs/scheduling.md), each one's modeled exposed
share and step, and how many pairs qualified and were decomposed.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Mesh, on_meta, table, write_result  # noqa: E402
from plan_quality import BATCH, HEADS, LAYERS, SEQ, VOCAB, H  # noqa: E402

HARDWARE = "h100-nvlink-ib"
MESHES: dict[int, list[tuple[int, int, int]]] = {
    8: [(1, 2, 4)],  # plan_quality's best at p = 8: one node, compute-bound
    64: [(1, 8, 8), (2, 8, 4)],  # best search mesh, AxoNN grid
    512: [(4, 16, 8)],  # best search mesh = AxoNN grid
}
ABLATIONS: dict[str, dict[str, int]] = {
    "no_bucketing": {"bucket_bytes": 0},
    "no_lookahead": {"lookahead": 0},
    "two_in_flight": {"max_in_flight": 2},
}


def measure(mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """Plan one mesh in this (worker) process; everything returned is plain data."""
    import torch

    import autopar
    from autopar.api import compile_for_rank
    from autopar.cost.timeline import Timeline, simulate
    from autopar.passes.schedule import schedule
    from examples.models import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=H)
    model = on_meta(lambda: GPT(cfg))
    idx = torch.zeros(BATCH, SEQ, dtype=torch.long)
    start = time.perf_counter()
    # pairs not decomposed ("auto" is plan's default): this table is the schedule stage's, and the
    # graphs it schedules again below are compiled without the decomposition; --decomposed has its own
    options = autopar.PlanOptions(hardware=HARDWARE, decompose_matmuls="off")
    result = autopar.plan(model, mesh_shape, (idx, idx), planning=options)
    assert result.compiled.timelines is not None
    before, after = result.compiled.timelines
    mesh = result.mesh

    # the same compile without the schedule stage, to schedule its graph in other ways
    base = compile_for_rank(
        model, mesh, (idx, idx), coords=(0,) * mesh.ndim, planner="search", hardware=HARDWARE, schedule=False
    ).graph
    variants: dict[str, Timeline] = {}
    for name, settings in {"default": {}, **ABLATIONS}.items():
        scheduled = schedule(copy.deepcopy(base), mesh, hardware=HARDWARE, **settings)  # type: ignore[arg-type]
        variants[name] = simulate(scheduled, mesh, HARDWARE)
    # scheduling that graph here is what autopar.plan does: same step, to rounding
    assert abs(variants["default"].step_time - after.step_time) <= 1e-9 * after.step_time
    # one communication stream per link, in the schedule stage's clock and in the model
    by_link = schedule(copy.deepcopy(base), mesh, hardware=HARDWARE, streams="link")
    links = simulate(by_link, mesh, HARDWARE, streams="link")

    def totals(t: Timeline) -> dict[str, float]:
        return t.totals()

    # over-decomposition: the cost model picks 1, 2 or 4 batch chunks per rank by modeled step
    chunked = compile_for_rank(
        model, mesh, (idx, idx), coords=(0,) * mesh.ndim, planner="search", hardware=HARDWARE,
        over_decompose="auto",
    )
    assert chunked.timelines is not None and chunked.chunk_step_times is not None

    floor = max(0.0, after.comm_time - after.compute_time) / after.comm_time if after.comm_time else 0.0
    report = result.compiled.report.schedule
    exposed_by = _exposure_by_cause(after)
    return {
        "mesh": list(mesh_shape),
        "before": totals(before),
        "after": totals(after),
        "after_link_streams": totals(links),
        "ablations": {name: totals(t) for name, t in variants.items() if name != "default"},
        "floor_exposed_fraction": floor,
        "collectives_planned": len(result.compiled.report.collectives),
        "buckets": report.buckets,
        "bucketed": report.bucketed,
        "filled": report.filled,
        "cap_delays": report.cap_delays,
        "exposed_by_cause_s": exposed_by,
        "plan_overlap": result.overlap(),
        "over_decompose": {
            "chosen_chunks": chunked.chunks,
            "step_time_by_chunks": {str(k): v for k, v in chunked.chunk_step_times.items()},
            "after": totals(chunked.timelines[1]),
        },
        "seconds": time.perf_counter() - start,
    }


def measure_decomposed(mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """One mesh's plan compiled with each `decompose_matmuls` mode (the search's plan made once and
    shared); plain data out."""
    import torch
    import torch.fx as fx

    from autopar.api import compile_for_rank
    from autopar.core.plan import Plan
    from examples.models import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=H)
    model = on_meta(lambda: GPT(cfg))
    idx = torch.zeros(BATCH, SEQ, dtype=torch.long)
    mesh = Mesh.from_shape(mesh_shape)
    start = time.perf_counter()
    plans: list[Plan] = []

    def once(gm: fx.GraphModule, make_plan: Any) -> Plan:
        if not plans:
            plans.append(make_plan())
        return plans[0]

    out: dict[str, Any] = {"mesh": list(mesh_shape)}
    for mode in ("off", "auto", "on"):
        compiled = compile_for_rank(
            model, mesh, (idx, idx), coords=(0,) * mesh.ndim, planner="search", hardware=HARDWARE,
            agree=once, decompose_matmuls=mode,
        )  # fmt: skip
        assert compiled.timelines is not None
        after = compiled.timelines[1]
        pairs = compiled.report.decomposed
        out[mode] = {
            **after.totals(),
            "pairs": len(pairs),
            "decomposed": sum(d.kept for d in pairs),
            "decomposed_by_kind": {k: sum(d.kept and d.kind == k for d in pairs) for k in ("all_gather", "reduce_scatter")},
            "decomposed_contracted": sum(d.kept and "K" in d.dims for d in pairs),
            "steps_compared_s": dict(compiled.report.decomposed_steps),
        }
    off = out["off"]
    out["floor_exposed_fraction"] = max(0.0, off["comm_time"] - off["compute_time"]) / off["comm_time"] if off["comm_time"] else 0.0
    out["seconds"] = time.perf_counter() - start
    return out


def decomposed_main(ps: list[int], jobs: int) -> None:
    """`--decomposed`: the exposed share and step with decompose_matmuls off, auto and on."""
    started = time.perf_counter()
    shapes = [shape for p in ps for shape in MESHES[p]]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        runs = list(pool.map(measure_decomposed, shapes))
    ms = 1e3
    rows = []
    for r in runs:
        cells = []
        for mode in ("off", "auto", "on"):
            m = r[mode]
            cells.append(f"{100 * m['exposed_fraction']:.1f}%, {m['step_time'] * ms:.2f} ms")
        rows.append(
            [
                Mesh.from_shape(tuple(r["mesh"])).size,
                "x".join(map(str, r["mesh"])),
                *cells,
                f"{100 * r['floor_exposed_fraction']:.1f}%",
                f"{r['on']['pairs']} ({r['on']['decomposed_by_kind']['all_gather']} AG, "
                f"{r['on']['decomposed_contracted']} of them K; {r['on']['decomposed_by_kind']['reduce_scatter']} RS)",
                f"{r['auto']['decomposed']} ({r['auto']['decomposed_contracted']} K)",
            ]
        )
    print(f"Modeled on {HARDWARE}: GPT h={H} s={SEQ} b={BATCH} {LAYERS} layers, rank 0, search planner")
    print(
        table(
            ["p", "mesh", "off: exposed, step", "auto", "on (every pair)", "floor", "pairs that qualify",
             "decomposed by auto"],
            rows,
        )
    )
    elapsed = time.perf_counter() - started
    print(f"\n{len(runs)} plans in {elapsed:.0f} s")
    path = write_result(
        "overlap_decomposed",
        {
            "model": {"n_layer": LAYERS, "h": H, "heads": HEADS, "seq": SEQ, "batch": BATCH, "vocab": VOCAB},
            "hardware": HARDWARE,
            "units": "seconds per step for rank 0; fractions of the step's communication time",
            "runs": runs,
            "wall_seconds": elapsed,
        },
    )
    print(f"wrote {path}")


def measure_auto(p: int) -> dict[str, Any]:
    """The mesh `autopar.plan(..., "auto", world_size=p)` chooses (ranked by scheduled step), and
    its modeled step before and after scheduling; plain data out."""
    import torch

    import autopar
    from examples.models import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=H)
    model = on_meta(lambda: GPT(cfg))
    idx = torch.zeros(BATCH, SEQ, dtype=torch.long)
    start = time.perf_counter()
    result = autopar.plan(
        model, "auto", (idx, idx), world_size=p, planning=autopar.PlanOptions(hardware=HARDWARE, planner="search")
    )
    assert result.compiled.timelines is not None and result.mesh_choice is not None
    before, after = result.compiled.timelines
    floor = max(0.0, after.comm_time - after.compute_time) / after.comm_time if after.comm_time else 0.0
    by_sum = min((c for c in result.mesh_choice.candidates if c.fits), key=lambda c: c.step_time)
    return {
        "p": p,
        "mesh": list(result.mesh.shape),
        "roles": list(result.mesh_choice.chosen.roles),
        "before": before.totals(),
        "after": after.totals(),
        "floor_exposed_fraction": floor,
        "best_by_sum": {
            "mesh": list(by_sum.shape),
            "roles": list(by_sum.roles),
            "step_s": by_sum.step_time,
            "scheduled_step_s": by_sum.scheduled_time if by_sum.scheduled_time == by_sum.scheduled_time else None,
        },
        "candidates": result.mesh_choice.to_json(),
        "seconds": time.perf_counter() - start,
    }


def _chunk_cell(od: dict[str, Any]) -> str:
    """Chunks chosen, their exposed fraction and step, and each candidate's modeled step."""
    tried = ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in od["step_time_by_chunks"].items())
    after = od["after"]
    return f"{od['chosen_chunks']} chunks, {100 * after['exposed_fraction']:.1f}%, {after['step_time'] * 1e3:.2f} ms ({tried})"


def _exposure_by_cause(t: Any) -> dict[str, float]:
    """Exposed seconds, split by phase and by why: "queued" if the collective started after its
    issue (the communication stream was busy), "dependent" if it started at once and its result
    was needed before it could finish (too little independent compute between issue and wait)."""
    out: dict[str, float] = {}
    for c in t.collectives:
        if c.exposed <= 0:
            continue
        why = "queued" if c.start > c.issue + 1e-12 else "dependent"
        key = f"{c.phase}/{why}"
        out[key] = out.get(key, 0.0) + c.exposed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--p", type=int, nargs="*", default=[8, 64, 512])
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument(
        "--auto", type=int, nargs="*", default=[8], help='p for which to plan mesh_shape="auto" (64: ~3 min)'
    )
    parser.add_argument(
        "--decomposed", type=int, nargs="*", default=None,
        help="p for which to compare decompose_matmuls off / auto / on (only that table)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.decomposed is not None:
        decomposed_main(args.decomposed or [8, 64], args.jobs)
        return
    started = time.perf_counter()
    shapes = [shape for p in args.p for shape in MESHES[p]]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        autos = [pool.submit(measure_auto, p) for p in args.auto]  # the longest first
        runs = list(pool.map(measure, shapes))
        auto_runs = [f.result() for f in autos]
    ms = 1e3
    rows = []
    for r in runs:
        b, a, lk = r["before"], r["after"], r["after_link_streams"]
        rows.append(
            [
                Mesh.from_shape(tuple(r["mesh"])).size,
                "x".join(map(str, r["mesh"])),
                f"{int(b['collectives'])} -> {int(a['collectives'])}",
                f"{a['comm_time'] * ms:.2f}",
                f"{a['compute_time'] * ms:.2f}",
                f"{100 * b['exposed_fraction']:.0f}%",
                f"{100 * a['exposed_fraction']:.1f}%",
                f"{100 * r['floor_exposed_fraction']:.1f}%",
                f"{100 * lk['exposed_fraction']:.1f}%",
                f"{b['step_time'] * ms:.2f} -> {a['step_time'] * ms:.2f}",
                f"{b['step_time'] / a['step_time']:.3f}",
                _chunk_cell(r["over_decompose"]),
            ]
        )
    print(f"Modeled on {HARDWARE}: GPT h={H} s={SEQ} b={BATCH} {LAYERS} layers, rank 0, search planner")
    print(
        table(
            ["p", "mesh", "collectives", "comm ms", "compute ms", "exposed before", "exposed after", "floor",
             "after, link streams", "step ms", "speedup", "over-decomposed (auto)"],
            rows,
        )
    )
    print()
    print("Exposed communication after scheduling, by cause (ms) and with the schedule changed:")
    ab_rows = []
    for r in runs:
        causes = r["exposed_by_cause_s"]
        ab_rows.append(
            [
                "x".join(map(str, r["mesh"])),
                *(f"{causes.get(k, 0.0) * ms:.2f}" for k in ("forward/dependent", "forward/queued",
                                                             "backward/dependent", "backward/queued")),
                f"{100 * r['after']['exposed_fraction']:.1f}%",
                *(f"{100 * r['ablations'][name]['exposed_fraction']:.1f}%" for name in ABLATIONS),
            ]
        )
    print(
        table(
            ["mesh", "fwd dependent", "fwd queued", "bwd dependent", "bwd queued", "schedule",
             *(name.replace("_", " ") for name in ABLATIONS)],
            ab_rows,
        )
    )
    if auto_runs:
        print()
        print('Mesh chosen by autopar.plan(model, "auto", world_size=p), ranked by the scheduled step:')
        auto_rows = []
        for r in auto_runs:
            a, best = r["after"], r["best_by_sum"]
            sched = best["scheduled_step_s"]
            auto_rows.append(
                [
                    r["p"],
                    "x".join(map(str, r["mesh"])) + " (" + "/".join(r["roles"]) + ")",
                    f"{a['comm_time'] * ms:.2f}",
                    f"{a['compute_time'] * ms:.2f}",
                    f"{100 * a['exposed_fraction']:.1f}%",
                    f"{100 * r['floor_exposed_fraction']:.1f}%",
                    f"{r['before']['step_time'] * ms:.2f} -> {a['step_time'] * ms:.2f}",
                    "x".join(map(str, best["mesh"])) + " (" + "/".join(best["roles"]) + ")",
                    f"{best['step_s'] * ms:.2f}",
                    f"{sched * ms:.2f}" if sched is not None and sched == sched else "-",
                ]
            )
        print(
            table(
                ["p", "chosen mesh (roles)", "comm ms", "compute ms", "exposed after", "floor", "step ms",
                 "lowest no-overlap sum", "its sum ms", "its scheduled ms"],
                auto_rows,
            )
        )
    elapsed = time.perf_counter() - started
    print(f"\n{len(runs) + len(auto_runs)} plans in {elapsed:.0f} s")
    path = write_result(
        "overlap",
        {
            "model": {"n_layer": LAYERS, "h": H, "heads": HEADS, "seq": SEQ, "batch": BATCH, "vocab": VOCAB},
            "hardware": HARDWARE,
            "units": "seconds per step for rank 0; fractions of the step's communication time",
            "runs": runs,
            "mesh_auto": auto_runs,
            "wall_seconds": elapsed,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
