"""Modeled speed-up of the searched plan over fixed 1-D Megatron, 2-D SUMMA and the 3-D cube.

The GPT stack of plan_quality.py (examples/models.GPT, h = 4096, 32 heads, s = 2048, b = 8,
vocabulary 512) with **2 layers** instead of 3 to keep the run short (the ratios are per step and
a layer dominates it; embedding and head are tiny at this vocabulary). For each hardware table
(h100-nvlink-ib, v100-cluster) and p (64, 512):

- the fixed plans of `autopar.planning.fixed` on the same traced graph and the same table: 1-D
  Megatron on (p,), 2-D SUMMA on its best grid and axis order, 3-D cube on (q, q, q); linears forced
  to the scheme, everything else laid out by the greedy planner, compiled and priced the same way;
- "search": `autopar.plan(..., planning=PlanOptions(planner="search", hardware=table))` on a few 3-axis meshes (the best
  of plan_quality.py's meshes per p) and on the mesh of every fixed plan not already among them
  (a unit axis aside: 1x8x8 is the 8x8 grid), so the search sees every mesh a fixed plan uses. On
  each mesh the search is seeded by the fixed schemes' plans that lay out on it (as well as the
  greedy plans of every axis-role assignment), so its modeled cost is never above theirs; the mesh
  with the lowest modeled step time is the chosen plan ("seed" names where its chain moves began);
- "auto" (`--auto P`): `autopar.plan(model, "auto", world_size=P)`, the search on every
  factorization of P ranked by `autopar.planning.mesh_choice` and the fastest compiled and priced.

"layer M" is the elements sent per rank by the collectives whose module path lies in `blocks.1` (the
last layer; collectives the compiler attributes to `<root>` are missed, as in plan_quality.py), for
the fixed plans beside the scheme's closed form of comm_volumes.md in parentheses (2-D: the grid
used, operands kept, i.e. 2/3 of SUMMA's nothing-saved form).

Step time = modeled communication (alpha-beta per collective, no overlap) + compute (fp32 roofline),
per rank per step, as `autopar.plan` reports it. 1-D Megatron splits heads p ways: with 32 heads it
cannot run on 64 or 512 ranks. The table says so and shows "1-D linears" in its place: the same 1-D
column/row linears with attention laid out by the planner (not Megatron; an upper bound for 1-D).

The paper figures (task text, the seeds: Bian et al. 2021, cube algorithm on 64 V100s) are 2.32x over
1-D and 1.57x over 2-D; they are measured step times of their implementation and model, ours are
modeled on the tables.

    python benchmarks/speedup.py               # ~1 min on 2 idle cores (2 worker processes)
    python benchmarks/speedup.py --auto 64     # ~4 min: also mesh_shape="auto" at p = 64 (26 meshes)
    python benchmarks/speedup.py --p 64 --hardware v100-cluster

Writes benchmarks/results/speedup.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import on_meta, table, write_result  # noqa: E402
from plan_quality import BATCH, HEADS, SEQ, VOCAB, H, in_layer  # noqa: E402

from autopar.cost import symbolic  # noqa: E402

LAYERS = 2
HARDWARE = ("h100-nvlink-ib", "v100-cluster")
MESHES: dict[int, list[tuple[int, ...]]] = {
    64: [(1, 8, 8), (2, 8, 4), (4, 4, 4)],
    512: [(4, 16, 8), (8, 8, 8), (8, 16, 4)],
}
PAPER = {"source": "task text (seeds: Bian et al. 2021), 64 V100s, 3-D cube", "cube_over_1d": 2.32, "cube_over_2d": 1.57}


def _priced(result: Any) -> dict[str, Any]:
    overlap = result.overlap()
    layer = [c for c in result.compiled.report.collectives if in_layer(c.module_path, LAYERS - 1)]
    return {
        "layer_elements": sum(c.elements for c in layer),
        "mesh": list(result.mesh.shape),
        "step_s": result.step_time,
        "comm_s": result.comm_time,
        "compute_s": result.compute_time,
        "comm_elements": result.comm_elements,
        "memory_bytes": result.memory.total,
        "overlapped_step_s": overlap["scheduled"]["step_time"] if overlap else None,
    }


def _closed_form(key: str, p: int, shape: tuple[int, ...], letters: tuple[str, ...]) -> float:
    """comm_volumes.md's elements per rank per layer for the scheme as laid out (2-D: its grid,
    kept operands, i.e. 2/3 of SUMMA's nothing-saved form; the cube keeps them already)."""
    tokens = BATCH * SEQ
    if key == "megatron_1d":
        return float(symbolic.megatron_1d(tokens, H, p))
    if key == "summa_2d":
        grid = (shape[letters.index("T")], shape[letters.index("n")])
        return 2 / 3 * float(symbolic.summa_2d(tokens, H, grid))
    return float(symbolic.cube_3d(tokens, H, p))


def _unit_free(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(g for g in shape if g > 1)


def measure(hardware: str, p: int, meshes: list[tuple[int, ...]], auto: bool = False) -> dict[str, Any]:
    """The fixed plans, then the search on each mesh (and on the fixed plans' meshes), and with
    `auto` on the mesh `autopar.plan(..., "auto")` chooses among every factorization of p, in
    this (worker) process; plain data out."""
    import torch

    import autopar
    from autopar.compiler.driver import graph_fingerprint
    from autopar.compiler.fixed import compile_fixed
    from autopar.compiler.pricing import price
    from autopar.passes.trace import trace
    from autopar.planning.fixed import SCHEMES, plan_fixed, scheme_variants
    from autopar.rules.registry import default_registry
    from examples.models import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=H)
    model = on_meta(lambda: GPT(cfg))
    idx = torch.zeros(BATCH, SEQ, dtype=torch.long)
    out: dict[str, Any] = {"hardware": hardware, "p": p, "search": [], "fixed": {}}
    start = time.perf_counter()
    registry = default_registry()
    traced = trace(model, (idx, idx), decompose=True)
    try:
        scheme_variants("megatron_1d", p, traced)
        out["megatron_1d_strict"] = None
    except autopar.AutoparError as exc:
        out["megatron_1d_strict"] = exc.message
    fingerprint = graph_fingerprint(traced)
    searched = list(meshes)
    for key in SCHEMES:
        fixed = plan_fixed(traced, key, p, registry, hardware, require_heads=False)
        entry: dict[str, Any] = {"name": fixed.title, "note": f"infeasible: {fixed.infeasible}"}
        out["fixed"][key] = entry
        if fixed.scheme is None:
            continue
        entry["note"] = f"{fixed.scheme.describe()}; best of {fixed.variants} layouts"
        entry["closed_form_layer"] = _closed_form(key, p, fixed.scheme.mesh_shape, fixed.scheme.first)
        if _unit_free(fixed.scheme.mesh_shape) not in {_unit_free(m) for m in searched}:
            searched.append(fixed.scheme.mesh_shape)
        try:
            compiled = compile_fixed(
                model, (idx, idx), fixed, traced_fingerprint=fingerprint, registry=registry, hardware=hardware
            )
            entry.update(_priced(price(compiled, fixed.scheme.mesh(), hardware, key)))
        except Exception:
            entry["error"] = traceback.format_exc(limit=6)
    for shape in searched:
        t0 = time.perf_counter()
        try:
            result = autopar.plan(
                model, shape, (idx, idx), planning=autopar.PlanOptions(hardware=hardware, planner="search")
            )
            report = result.compiled.graph.meta.get("autopar_search")
            seed = {"seed": report.chosen_seed, "seeds": report.seeds} if report is not None else {}
            out["search"].append({**_priced(result), **seed, "seconds": time.perf_counter() - t0})
        except Exception as exc:  # report, do not stop the sweep
            out["search"].append({"mesh": list(shape), "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
    if auto:
        t0 = time.perf_counter()
        result = autopar.plan(
            model, "auto", (idx, idx), world_size=p, planning=autopar.PlanOptions(hardware=hardware, planner="search")
        )
        assert result.mesh_choice is not None
        ranked = [
            {"mesh": list(c.shape), "modeled_step_s": c.step_time if c.fits else None, "error": c.error}
            for c in result.mesh_choice.candidates
        ]
        out["auto"] = {**_priced(result), "candidates": ranked, "seconds": time.perf_counter() - t0}
    out["seconds"] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--p", type=int, nargs="*", default=[64, 512])
    parser.add_argument("--hardware", nargs="*", default=list(HARDWARE))
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument(
        "--auto", type=int, nargs="*", default=[], help='p for which also to plan mesh_shape="auto" (slow: every mesh)'
    )
    args = parser.parse_args()
    started = time.perf_counter()
    configs = [(hw, p) for hw in args.hardware for p in args.p]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        futures = [pool.submit(measure, hw, p, MESHES[p], p in args.auto) for hw, p in configs]
        runs = []
        for (hw, p), fut in zip(configs, futures):
            runs.append(fut.result())
            print(f"  {hw:<15} p={p:<4} {runs[-1]['seconds']:.0f} s", flush=True)

    detail, summary = [], []
    for run in runs:
        ok = [s for s in run["search"] if "error" not in s]
        chosen = min(ok, key=lambda s: s["step_s"]) if ok else None
        run["chosen"] = chosen
        plans = [("search " + "x".join(map(str, s["mesh"])), s) for s in run["search"]]
        plans += [("search auto", run["auto"])] if "auto" in run else []
        plans += [(f["name"], f) for f in run["fixed"].values()]
        for name, rec in plans:
            if "step_s" not in rec:
                detail.append([run["hardware"], run["p"], name, rec.get("error") or rec.get("note", "")] + [""] * 8)
                continue
            detail.append(
                [
                    run["hardware"],
                    run["p"],
                    name,
                    "x".join(map(str, rec["mesh"])),
                    f"{rec['comm_elements'] / 1e6:.0f}",
                    f"{rec['layer_elements'] / 1e6:.0f}"
                    + (f" ({rec['closed_form_layer'] / 1e6:.0f})" if "closed_form_layer" in rec else ""),
                    f"{rec['comm_s'] * 1e3:.1f}",
                    f"{rec['compute_s'] * 1e3:.1f}",
                    f"{rec['step_s'] * 1e3:.1f}",
                    f"{rec['memory_bytes'] / 2**30:.2f}",
                    f"{rec['step_s'] / chosen['step_s']:.2f}x" if chosen else "",
                    rec.get("seed", ""),
                ]
            )
        fixed = run["fixed"]

        def step(key: str, fixed: dict[str, Any] = fixed) -> float | None:
            return fixed.get(key, {}).get("step_s")

        t1, t2, t3 = step("megatron_1d"), step("summa_2d"), step("cube_3d")
        c = chosen["step_s"] if chosen else None
        ratio = {
            "search_over_1d": t1 / c if t1 and c else None,
            "search_over_2d": t2 / c if t2 and c else None,
            "search_over_cube": t3 / c if t3 and c else None,
            "cube_over_1d": t1 / t3 if t1 and t3 else None,
            "cube_over_2d": t2 / t3 if t2 and t3 else None,
        }
        run["ratios"] = ratio
        strict = run.get("megatron_1d_strict")
        paper = run["hardware"] == "v100-cluster" and run["p"] == 64
        auto = run.get("auto")
        summary.append(
            [
                run["hardware"],
                run["p"],
                f"{c * 1e3:.1f} ({'x'.join(map(str, chosen['mesh']))})" if chosen else "none",
                f"{auto['step_s'] * 1e3:.1f} ({'x'.join(map(str, auto['mesh']))})" if auto else "-",
                (f"{t1 * 1e3:.1f}" if t1 else "-") + (" (linears only: heads)" if strict else ""),
                f"{t2 * 1e3:.1f}" if t2 else "-",
                f"{t3 * 1e3:.1f}" if t3 else "-",
                *[f"{v:.2f}x" if v else "-" for v in ratio.values()],
                f"{PAPER['cube_over_1d']}x / {PAPER['cube_over_2d']}x" if paper else "",
            ]
        )
    print(f"\nModeled step time per rank (ms), {LAYERS}-layer GPT h={H} s={SEQ} b={BATCH} heads={HEADS}, no overlap")
    print(
        table(
            ["hardware", "p", "plan", "mesh", "comm M el", "layer M (closed form)", "comm ms", "compute ms",
             "step ms", "mem GiB", "step / chosen", "search seed"],
            detail,
        )
    )
    print("\nSpeed-up of the chosen (search) plan, and of the cube, over the fixed schemes")
    print(
        table(
            ["hardware", "p", "search ms (mesh)", "auto ms (mesh)", "1-D ms", "2-D ms", "cube ms", "search/1-D", "search/2-D",
             "search/cube", "cube/1-D", "cube/2-D", "paper cube/1-D, /2-D"],
            summary,
        )
    )
    for run in runs:
        if run.get("megatron_1d_strict"):
            print(f"{run['hardware']} p={run['p']}: 1-D Megatron infeasible: {run['megatron_1d_strict']}")
        for key, f in run["fixed"].items():
            print(f"{run['hardware']} p={run['p']} {key}: {f['note']}")
    elapsed = time.perf_counter() - started
    print(f"\n{len(runs)} jobs in {elapsed:.0f} s")
    path = write_result(
        "speedup",
        {
            "model": {"n_layer": LAYERS, "h": H, "heads": HEADS, "seq": SEQ, "batch": BATCH, "vocab": VOCAB},
            "units": "seconds per step per rank, modeled (communication without overlap + fp32 roofline compute)",
            "paper": PAPER,
            "runs": runs,
            "wall_seconds": elapsed,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
