"""autopar's calibrated step model held against published GPU training runs (issue 29, items 1-2).

Each row of `published_rows.ROWS` (Megatron-LM's PTD-P weak scaling on up to 3072 A100s,
Megatron-Core r0.8's weak scaling on up to 6144 H100s, torchtitan's Llama 3.1 8B on 8 and 128
H100s; BF16 only) is priced by the library's step model, `autopar.planning.step_model` (the one
the planner's pipeline cut ends its step with; docs/planning.md, "The step model"), with the
row's configuration (`config`: t, p, d, microbatches, schedule, recomputation, data-parallel
reduction; `attention`: how its kernel did a causal mask, all the scores for Megatron-LM 2021,
the triangle for the rest), on the calibrated tables (`a100-calibrated`, `h100-calibrated`), and
printed beside the published figure. This file only builds each row's model on the meta device in bfloat16
(`examples.models.GPT` or `examples.zoo.Llama`), traces one microbatch of one data-parallel
replica, and hands it to `stage_parts` / `price_step`.

The fitted constants live in the hardware tables: `kernels.sustained_matmul` (eta, per GPU) and
`kernels.elementwise_factor` (phi, per framework). `--fit` refits them on the fit half of the rows
it runs (rows chosen by alternating size before any error was seen; the held-out half never enters
the fit) and prices with them; `--write-tables` then writes them, with where they came from, into
the tables. torchtitan has no fit rows: it pays phi = 1 and the H100's eta.

    python benchmarks/published.py --fit --write-tables   # 21 rows: 24 min wall on 2 cores shared
                                              # at load 17 falling to 5 (tracing, the two stage graphs, the 1T
                                              # cut, the fit's simulations)
    python benchmarks/published.py --quick    # 9 rows up to 32B, 81 s wall at load 10, priced with the
                                              # tables' constants (it prints what its own 4 fit rows
                                              # would give, which differs from the 10-row fit's)

    python benchmarks/published.py --auto --cpu-limit 400 --rows "PTD-P 1.7B" --name published_auto_p17
                                              # item 3: auto's choice against each row's configuration
                                              # (benchmarks/published_auto.py), one child per row under
                                              # a CPU limit; published_auto.json without --name
    python benchmarks/published.py --auto --merge published_auto_p17 published_auto_tt8
                                              # rows run apart (in parallel), in published_auto.json

Writes benchmarks/results/published.json (`--name` to change).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import RunClock, table, write_result  # noqa: E402
from published_auto import MEMORY_LIMIT, run_limited  # noqa: E402
from published_auto import report as auto_report  # noqa: E402
from published_model import Components, components, config  # noqa: E402
from published_rows import QUICK, ROWS, Row, figure, published_step  # noqa: E402

from autopar.cost.hardware import TABLES_DIR  # noqa: E402
from autopar.planning.step_model import StepPrice, price_step  # noqa: E402


@dataclass(frozen=True)
class Constants:
    """Trial constants for the fit: eta per hardware table, phi per framework (None: the table's)."""

    eta: dict[str, float]
    phi: dict[str, float]

    def of(self, row: Row) -> tuple[float | None, float | None]:
        return self.eta.get(SAME_SILICON.get(row.gpu, row.gpu)), self.phi.get(row.framework)


# a table whose eta is another's fit: the same chip at a lower power limit (its own peak, bandwidth
# and memory; the share of the microbenchmarked rates a step sustains is the silicon's)
SAME_SILICON = {"h100-500w-calibrated": "h100-calibrated"}


TABLE = Constants(eta={}, phi={})  # the constants the hardware tables hold
UNFITTED = Constants(eta={"a100-calibrated": 1.0, "h100-calibrated": 1.0},  # h100-500w: as h100's
                     phi={"megatron-2021": 1.0, "mcore-r0.8": 1.0, "torchtitan-eager": 1.0})  # fmt: skip


def price(comp: Components, consts: Constants = TABLE) -> StepPrice:
    """The library step model (`autopar.planning.step_model.price_step`) for one row."""
    eta, phi = consts.of(comp.row)
    return price_step(comp.stages, config(comp.row), comp.hw, eta=eta, phi=phi)


def ratio(comp: Components, consts: Constants) -> float:
    """Modeled over published throughput (> 1: the model is optimistic)."""
    return published_step(comp.row) / price(comp, consts).step


def fit(comps: list[Components]) -> Constants:
    """eta per GPU and phi per framework from the fit rows only: for each phi in 0, 0.05, ..., 1,
    eta by four fixed-point steps on the median ratio (a step's time goes nearly as 1/eta); the
    pair with the least mean |log ratio| wins. torchtitan has no fit rows: it keeps phi = 1."""
    eta: dict[str, float] = {}
    phi: dict[str, float] = {}
    fit_rows = [c for c in comps if c.row.split == "fit"]
    for framework in sorted({c.row.framework for c in fit_rows}):
        group = [c for c in fit_rows if c.row.framework == framework]
        gpu = group[0].row.gpu
        best: tuple[float, float, float] | None = None
        for f in [x / 20 for x in range(0, 21)]:
            e = 1.0
            for _ in range(4):
                trial = Constants({gpu: e}, {framework: f})
                e /= statistics.median(ratio(c, trial) for c in group)
            trial = Constants({gpu: e}, {framework: f})
            err = statistics.fmean(abs(math.log(ratio(c, trial))) for c in group)
            if best is None or err < best[0]:
                best = (err, e, f)
        assert best is not None
        eta[gpu], phi[framework] = best[1], best[2]
    return Constants(eta, phi)


def write_tables(consts: Constants, comps: list[Components], note: str) -> None:
    """Write fitted constants into the hardware tables (`kernels.sustained_matmul`,
    `kernels.elementwise_factor`), each with where it came from."""
    gpu_of = {c.row.framework: c.row.gpu for c in comps}
    fit_keys = ", ".join(c.row.key for c in comps if c.row.split == "fit")
    for gpu, eta in consts.eta.items():
        path = TABLES_DIR / f"{gpu}.json"
        text = path.read_text()
        data = json.loads(text)
        indent = 1 if text.startswith("{\n \"") else 2
        data["kernels"]["sustained_matmul"] = round(eta, 4)
        factors = {fw: round(f, 2) for fw, f in consts.phi.items() if gpu_of[fw] == gpu}
        data["kernels"]["elementwise_factor"] = factors
        where = f"fitted on published rows by benchmarks/published.py --fit ({note}; fit half only: {fit_keys})"
        data["source"]["kernels.sustained_matmul"] = where
        data["source"]["kernels.elementwise_factor"] = where + "; a framework without an entry pays 1"
        path.write_text(json.dumps(data, indent=indent) + "\n")
        print(f"wrote {path}: sustained_matmul {eta:.4f}, elementwise_factor {factors}")
        for twin in (t for t, of in SAME_SILICON.items() if of == gpu):
            path = TABLES_DIR / f"{twin}.json"
            data = json.loads(path.read_text())
            data["kernels"]["sustained_matmul"] = round(eta, 4)
            data["source"]["kernels.sustained_matmul"] = f"the fitted value of {gpu}.json (same silicon; no fit rows of its own): {where}"
            path.write_text(json.dumps(data, indent=2) + "\n")
            print(f"wrote {path}: sustained_matmul {eta:.4f} (of {gpu})")


def report(comps: list[Components], consts: Constants) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = []
    for c in comps:
        r = c.row
        raw, cal = price(c, UNFITTED), price(c, consts)
        rows.append({
            "key": r.key, "gpu": r.gpu, "framework": r.framework, "gpus": r.gpus, "batch": r.batch,
            "microbatch": r.microbatch, "microbatches": r.microbatches, "t": r.t, "p": r.p, "d": r.d, "v": r.v,
            "schedule": r.schedule, "recompute": r.recompute, "dp": r.dp, "seq": r.seq, "unit": r.unit,
            "convention": r.convention, "source": r.source, "assumed": list(r.assumed), "split": r.split,
            "attention": r.attention, "attention_source": r.attention_source,
            "published": r.published, "published_step_s": published_step(r),
            "modeled_unfitted": figure(r, raw.step), "modeled": figure(r, cal.step), "modeled_step_s": cal.step,
            "ratio": published_step(r) / cal.step, "ratio_unfitted": published_step(r) / raw.step,
            "pipeline_s": cal.pipeline, "dp_exposed_s": cal.exposed, "optimizer_s": cal.optimizer,
            "bubble": cal.bubble, "states_gb": cal.state_bytes / 1e9, "trace_cpu_s": c.trace_s, "cut_cpu_s": c.cut_s,
        })  # fmt: skip
    summary: dict[str, Any] = {
        "eta": {c.row.gpu: c.hw.kernels.sustained_matmul if consts.of(c.row)[0] is None else consts.of(c.row)[0]
                for c in comps if c.hw.kernels is not None},
        "phi": {c.row.framework: c.hw.kernels.elementwise(c.row.framework) if consts.of(c.row)[1] is None
                else consts.of(c.row)[1] for c in comps if c.hw.kernels is not None},
        "constants": "fitted by this run" if consts is not TABLE else "the hardware tables'",
    }  # fmt: skip
    for split in ("fit", "held-out"):
        errs = [abs(x["ratio"] - 1) for x in rows if x["split"] == split]
        summary[split] = {
            "rows": len(errs),
            "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None,
            "within_20pct": sum(e <= 0.2 for e in errs),
        }
    return rows, summary


def run_auto(rows: list[Row], cpu_limit: int, name: str, clock: RunClock, merge: list[str] | None = None) -> None:
    """`--auto`: each row planned by `auto` in a child process under `cpu_limit` CPU seconds;
    `merge`: instead, the rows of earlier runs' result files (rows run apart, in parallel) in one."""
    results: list[dict[str, Any]] = []
    for earlier in merge or []:
        results += json.loads((Path(__file__).resolve().parent / "results" / f"{earlier}.json").read_text())["rows"]
    for row in rows if merge is None else []:
        results.append(run_limited(row, cpu_limit))
        r = results[-1]
        outcome = r.get("not_finished") or r.get("failed") or f"speedup {r['speedup']:.2f}x, auto {r['auto_mesh']}"
        print(f"  {row.key}: {outcome} ({r['wall_s']:.0f} s wall)", flush=True)
        write_result(name, {**clock.record(), "cpu_limit_s": cpu_limit, "memory_limit": MEMORY_LIMIT, "rows": results})
    headers, body, summary = auto_report(results)
    print()
    print(table(headers, body))
    print(f"\n{summary}")
    path = write_result(name, {**clock.record(), "cpu_limit_s": cpu_limit, "memory_limit": MEMORY_LIMIT,
                               "summary": summary, "rows": results})  # fmt: skip
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--rows", nargs="*", default=None, help="row keys (default: all)")
    parser.add_argument("--name", default="published", help="result file name under benchmarks/results")
    parser.add_argument("--fit", action="store_true", help="fit the constants on this run's fit rows and price with them")
    parser.add_argument("--write-tables", action="store_true", help="with --fit: write them into the hardware tables")
    parser.add_argument("--auto", action="store_true", help="auto's choice against each row's configuration "
                        "(benchmarks/published_auto.py); writes published_auto.json unless --name")  # fmt: skip
    parser.add_argument("--cpu-limit", type=int, default=600, help="with --auto: CPU seconds per row")
    parser.add_argument("--merge", nargs="*", default=None, help="with --auto: merge these earlier result files' rows")
    args = parser.parse_args()
    keys = args.rows or (list(QUICK) if args.quick else [r.key for r in ROWS])
    clock = RunClock()
    if args.auto:
        run_auto([r for r in ROWS if r.key in keys], args.cpu_limit,
                 "published_auto" if args.name == "published" else args.name, clock, args.merge)  # fmt: skip
        return
    comps = []
    for row in ROWS:
        if row.key in keys:
            comps.append(components(row))
            print(f"  {row.key}: traced {comps[-1].trace_s:.0f} s, cut {comps[-1].cut_s:.0f} s CPU", flush=True)
    refit = fit(comps)  # what this run's fit rows give (pricing only: cheap)
    print(f"this run's fit rows give: eta {refit.eta}, phi {refit.phi}")
    consts = refit if args.fit else TABLE
    if args.fit and args.write_tables:
        write_tables(consts, comps, f"{len(comps)} rows, {time.strftime('%Y-%m-%d')}, "
                     "causal attention priced as each row's kernel ran it")
    rows, summary = report(comps, consts)
    headers = ["row", "GPUs", "t", "p", "d", "m", "attention", "published", "unit", "modeled (unfitted)", "modeled",
               "ratio", "bubble", "DP exp. s", "split"]  # fmt: skip
    body = [[x["key"], str(x["gpus"]), str(x["t"]), str(x["p"]), str(x["d"]), str(x["microbatches"]), x["attention"],
             f"{x['published']:g}", x["unit"], f"{x['modeled_unfitted']:.0f}", f"{x['modeled']:.0f}",
             f"{x['ratio']:.2f}", f"{x['bubble']:.3f}", f"{x['dp_exposed_s']:.3f}", x["split"]]
            for x in rows]  # fmt: skip
    print()
    print(table(headers, body))
    print()
    print(f"constants ({summary['constants']}): eta {summary['eta']}, phi {summary['phi']}")
    for split in ("fit", "held-out"):
        s = summary[split]
        if s["rows"]:
            print(f"{split}: {s['rows']} rows, median |error| {100 * s['median_abs_error']:.1f} %, "
                  f"max {100 * s['max_abs_error']:.1f} %, {s['within_20pct']} within +-20 %")  # fmt: skip
    path = write_result(args.name, {"quick": args.quick, "fit": args.fit, **clock.record(), "summary": summary, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
