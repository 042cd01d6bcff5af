"""autopar's calibrated step model held against published GPU training runs (issue 29, items 1-2).

Each row of `published_rows.ROWS` (Megatron-LM's PTD-P weak scaling on up to 3072 A100s,
Megatron-Core r0.8's weak scaling on up to 6144 H100s, torchtitan's Llama 3.1 8B on 8 and 128
H100s; BF16 only) is priced with the same configuration (t, p, d, microbatch, schedule,
recomputation, data-parallel reduction) on the calibrated tables (`a100-calibrated`,
`h100-calibrated`), and printed beside the published figure. The step model, in order:

1. the model is built on the meta device in bfloat16 (`examples.models.GPT`, or `examples.zoo.Llama`)
   and traced for ONE microbatch of one data-parallel replica, so every kernel is priced at the size
   it runs at (`autopar.cost.formulas.compute_time`: matmuls at the table's fraction of peak for
   their flops, element-wise ops at its fraction of HBM bandwidth for their bytes, a launch floor),
   work divided by the tensor-parallel size t (`stage_graph(gm, hw, tensor_size=t)`);
2. `cut_graph(..., pp=p, v=v)` cuts it into pipeline stages; each stage's forward and backward are
   split into matmul time and element-wise time (a second stage graph on a table whose element-wise
   ops are free);
3. per microbatch a stage pays: matmul / eta + phi x element-wise (eta, phi: the fitted constants
   below), the tensor-parallel collectives of its layers (two all-reduces of b s h bf16 in forward,
   two in backward, over the node's NVLink; zero when the run overlapped them), and recomputation
   (full: the forward again, with its collectives, inside backward; torchtitan's "op" policy: every
   second matmul and the element-wise ops of the forward);
4. `stage_durations` + `simulate` run the pipeline schedule over the row's m microbatches (the
   bubble and the point-to-point sends included);
5. once per step: the data-parallel reduction of the largest stage's gradients over the d replicas
   (all-reduce after the flush; or reduce-scatter + all-gather of the distributed optimizer with the
   part longer than the last microbatch's backward / first forward exposed; or FSDP's gathers and
   reduce-scatter overlapped with the step), on `span_link` (NVLink in a node; k rings on k NICs
   when a group has k members per node); and AdamW over the rank's fp32 master weights at the
   table's HBM rate (30 bytes per parameter: fp32 weight, both moments, read and written, the
   gradient read, the bf16 copy written).

Two constants per family are fitted on the fit half only (rows chosen by alternating size before any
error was seen): eta per GPU (sustained fraction of the microbenchmarked matmul rate: clocks under
a full node's power, kernels between the measured shapes) and phi per framework (what is left of the
unfused element-wise time after the framework's fused kernels). torchtitan (eager, unfused) takes
phi = 1 and the H100's eta: none of its constants come from its own rows.

    python benchmarks/published.py            # 21 rows: 36 min wall on 2 cores shared at load 15-20
                                              # (tracing, the two stage graphs, the 1T cut, the fit's simulations)
    python benchmarks/published.py --quick    # 9 rows up to 32B, 4 min wall at the same load; its fit
                                              # has 2 rows per family, so its constants differ from the full run's

Writes benchmarks/results/published.json (`--name` to change).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import RunClock, on_meta, table, write_result  # noqa: E402
from published_rows import QUICK, ROWS, Row, figure, published_step  # noqa: E402

from autopar.core.pipeline_schedule import Schedule, schedule_by_name  # noqa: E402
from autopar.core.pipeline_simulate import simulate  # noqa: E402
from autopar.cost.formulas import collective_time  # noqa: E402
from autopar.cost.hardware import Hardware, load_hardware, span_link  # noqa: E402
from autopar.planning.stage_cut import Stage, cut_graph, stage_durations  # noqa: E402
from autopar.planning.stage_units import stage_graph  # noqa: E402

ADAM_BYTES = 30.0  # per parameter: fp32 weight, exp_avg, exp_avg_sq read + written, grad read, bf16 written
LAYER_PREFIXES = ("blocks.",)


@dataclass(frozen=True)
class Constants:
    """The fitted constants: eta per hardware table, phi per framework."""

    eta: dict[str, float]
    phi: dict[str, float]

    def of(self, row: Row) -> tuple[float, float]:
        return self.eta.get(row.gpu, 1.0), self.phi.get(row.framework, 1.0)


UNFITTED = Constants(eta={}, phi={})


@dataclass(frozen=True)
class StageParts:
    """One stage's compute per microbatch, split into matmul and element-wise seconds."""

    stage: Stage
    mm_f: float
    mm_b: float
    mm_bi: float
    el_f: float
    el_b: float
    el_bi: float
    layers: int
    params: float  # parameters (elements) per tensor rank


@dataclass(frozen=True)
class Components:
    """What the trace and the cut give for a row, before the constants: per stage parts."""

    row: Row
    stages: tuple[StageParts, ...]
    hw: Hardware
    trace_s: float
    cut_s: float


def build_model(row: Row) -> torch.nn.Module:
    if row.arch == "gpt":
        from examples.models import GPT, GPTConfig

        cfg = GPTConfig(vocab_size=row.vocab, block_size=row.seq, n_layer=row.layers, n_head=row.heads,
                        n_embd=row.hidden)  # fmt: skip
        model = on_meta(lambda: GPT(cfg))
        if not row.tied:
            with torch.device("meta"):
                model.lm_head.weight = torch.nn.Parameter(torch.empty(row.vocab, row.hidden))
        return model.to(torch.bfloat16)
    from examples.zoo import Llama, LlamaConfig

    lcfg = LlamaConfig(vocab_size=row.vocab, seq_len=row.seq, dim=row.hidden, n_layer=row.layers,
                       n_head=row.heads, n_kv_head=row.kv_heads, hidden=row.ffn, rope_base=500000.0)  # fmt: skip
    return on_meta(lambda: Llama(lcfg)).to(torch.bfloat16)


def matmul_only(hw: Hardware) -> Hardware:
    """`hw` with element-wise ops free (infinite bandwidth, no launch floor): its stage graph's
    times are the matmul (and attention) part alone."""
    assert hw.kernels is not None, "the calibrated step model needs a table with kernel rates"
    return replace(hw, memory_bandwidth=1e30, kernels=replace(hw.kernels, launch=0.0))


def components(row: Row) -> Components:
    """Trace one microbatch, cut it into the row's stages, split each stage's time."""
    from autopar.passes.trace import trace

    hw = load_hardware(row.gpu)
    model = build_model(row)
    idx = torch.zeros(row.microbatch, row.seq, dtype=torch.long)
    start = time.process_time()
    gm = trace(model, (idx, idx), decompose=True)
    trace_s = time.process_time() - start
    start = time.process_time()
    full = stage_graph(gm, hw, row.t)
    mm = stage_graph(gm, matmul_only(hw), row.t)
    cut = cut_graph(full, pp=row.p, microbatches=1, v=row.v, schedule=row.schedule, memory_limit=math.inf)
    index = {u.name: i for i, u in enumerate(full.units)}
    parts = []
    for st in cut.stages:
        ids = [index[name] for name in st.units]
        f = sum(full.units[i].forward for i in ids)
        b = sum(full.units[i].backward for i in ids)
        bi = sum(full.units[i].backward_input for i in ids)
        mf = sum(mm.units[i].forward for i in ids)
        mb = sum(mm.units[i].backward for i in ids)
        mbi = sum(mm.units[i].backward_input for i in ids)
        layers = sum(1 for name in st.units if name.startswith(LAYER_PREFIXES))
        parts.append(StageParts(st, mf, mb, mbi, f - mf, b - mb, bi - mbi, layers, st.param_bytes / 2.0))
    return Components(row, tuple(parts), hw, trace_s, time.process_time() - start)


@dataclass(frozen=True)
class Priced:
    """A row's modeled step and its parts (seconds)."""

    step: float
    pipeline: float
    dp_exposed: float
    optimizer: float
    tp_per_microbatch: float
    bubble: float
    states_gb: float  # per rank: bf16 weights + fp32 grads, master weights and AdamW moments


def tp_layer_time(row: Row, hw: Hardware) -> float:
    """One all-reduce of a microbatch's b s h bf16 activations over the tensor group (or, with
    sequence parallelism, its reduce-scatter + all-gather pair: the same bytes)."""
    link = span_link(hw, row.t, 1)
    return collective_time("all_reduce", row.microbatch * row.seq * row.hidden, 2, row.t, link)


@functools.lru_cache(maxsize=64)
def _schedule(name: str, pp: int, v: int, microbatches: int) -> Schedule:
    return schedule_by_name(name, pp, v, microbatches)


def price(comp: Components, consts: Constants = UNFITTED) -> Priced:
    """The step model of the module docstring for one row under `consts`."""
    row, hw = comp.row, comp.hw
    eta, phi = consts.of(row)
    tp = 0.0 if row.overlap_tp else tp_layer_time(row, hw)
    stages = []
    for sp in comp.stages:
        fwd = sp.mm_f / eta + phi * sp.el_f
        bwd = sp.mm_b / eta + phi * sp.el_b
        bwd_in = sp.mm_bi / eta + phi * sp.el_bi
        tp_f = tp_b = 2 * sp.layers * tp
        if row.recompute == "full":
            bwd, bwd_in, tp_b = bwd + fwd + tp_f, bwd_in + fwd + tp_f, tp_b + tp_f
        elif row.recompute == "selective-op":
            again = 0.5 * sp.mm_f / eta + phi * sp.el_f
            bwd, bwd_in = bwd + again, bwd_in + again
        stages.append(replace(sp.stage, forward=fwd + tp_f, backward=bwd + tp_b, backward_input=bwd_in + tp_b))
    durations = stage_durations(stages, row.p, 1, row.t, hw)
    timeline = simulate(_schedule(row.schedule, row.p, row.v, row.microbatches), durations)
    pipeline = timeline.makespan
    busy = max(timeline.busy(r) for r in range(row.p))

    params = max(sum(sp.params for sp in comp.stages[r :: row.p]) for r in range(row.p))
    dp_link = span_link(hw, row.d, row.t)
    last_bwd = max(s.backward for s in stages)
    first_fwd = max(s.forward for s in stages)
    if row.dp == "allreduce":
        exposed = collective_time("all_reduce", params, 2, row.d, dp_link)
    elif row.dp == "distopt":
        rs = collective_time("reduce_scatter", params, 4, row.d, dp_link)
        ag = collective_time("all_gather", params, 2, row.d, dp_link)
        exposed = max(0.0, rs - last_bwd) + max(0.0, ag - first_fwd) if row.overlap_dp else rs + ag
    else:  # fsdp: two bf16 all-gathers (forward, backward) and an fp32 reduce-scatter per step
        comm = 2 * collective_time("all_gather", params, 2, row.d, dp_link)
        comm += collective_time("reduce_scatter", params, 4, row.d, dp_link)
        exposed = max(0.0, comm - busy) if row.overlap_dp else comm
    sharded = row.d if row.dp in ("distopt", "fsdp") else 1
    moved = ADAM_BYTES * params / sharded
    assert hw.kernels is not None
    optimizer = moved / (hw.memory_bandwidth * hw.kernels.memory_fraction(moved))
    states = params * (2 + (4 + 4 + 4 + 4) / sharded) if row.dp != "fsdp" else params * 18 / sharded
    return Priced(
        step=pipeline + exposed + optimizer,
        pipeline=pipeline,
        dp_exposed=exposed,
        optimizer=optimizer,
        tp_per_microbatch=tp * 4 * max(sp.layers for sp in comp.stages),
        bubble=1.0 - busy / pipeline if pipeline > 0 else 0.0,
        states_gb=states / 1e9,
    )


def ratio(comp: Components, consts: Constants) -> float:
    """Modeled over published throughput (> 1: the model is optimistic)."""
    return published_step(comp.row) / price(comp, consts).step


def fit(comps: list[Components]) -> Constants:
    """eta per GPU and phi per framework from the fit rows only: for each phi in 0, 0.05, ..., 1,
    eta by four fixed-point steps on the median ratio (a step's time goes nearly as 1/eta); the
    pair with the least mean |log ratio| wins."""
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
            "published": r.published, "published_step_s": published_step(r),
            "modeled_unfitted": figure(r, raw.step), "modeled": figure(r, cal.step), "modeled_step_s": cal.step,
            "ratio": published_step(r) / cal.step, "ratio_unfitted": published_step(r) / raw.step,
            "pipeline_s": cal.pipeline, "dp_exposed_s": cal.dp_exposed, "optimizer_s": cal.optimizer,
            "bubble": cal.bubble, "states_gb": cal.states_gb, "trace_cpu_s": c.trace_s, "cut_cpu_s": c.cut_s,
        })  # fmt: skip
    summary: dict[str, Any] = {"eta": consts.eta, "phi": consts.phi}
    for split in ("fit", "held-out"):
        errs = [abs(x["ratio"] - 1) for x in rows if x["split"] == split]
        summary[split] = {
            "rows": len(errs),
            "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None,
            "within_20pct": sum(e <= 0.2 for e in errs),
        }
    return rows, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--rows", nargs="*", default=None, help="row keys (default: all)")
    parser.add_argument("--name", default="published", help="result file name under benchmarks/results")
    args = parser.parse_args()
    keys = args.rows or (list(QUICK) if args.quick else [r.key for r in ROWS])
    clock = RunClock()
    comps = []
    for row in ROWS:
        if row.key in keys:
            comps.append(components(row))
            print(f"  {row.key}: traced {comps[-1].trace_s:.0f} s, cut {comps[-1].cut_s:.0f} s CPU", flush=True)
    consts = fit(comps)
    rows, summary = report(comps, consts)
    headers = ["row", "GPUs", "t", "p", "d", "m", "published", "unit", "modeled (unfitted)", "modeled", "ratio",
               "bubble", "DP exp. s", "split"]  # fmt: skip
    body = [[x["key"], str(x["gpus"]), str(x["t"]), str(x["p"]), str(x["d"]), str(x["microbatches"]),
             f"{x['published']:g}", x["unit"], f"{x['modeled_unfitted']:.0f}", f"{x['modeled']:.0f}",
             f"{x['ratio']:.2f}", f"{x['bubble']:.3f}", f"{x['dp_exposed_s']:.3f}", x["split"]]
            for x in rows]  # fmt: skip
    print()
    print(table(headers, body))
    print()
    print(f"fitted: eta {consts.eta}, phi {consts.phi}")
    for split in ("fit", "held-out"):
        s = summary[split]
        if s["rows"]:
            print(f"{split}: {s['rows']} rows, median |error| {100 * s['median_abs_error']:.1f} %, "
                  f"max {100 * s['max_abs_error']:.1f} %, {s['within_20pct']} within +-20 %")  # fmt: skip
    path = write_result(args.name, {"quick": args.quick, **clock.record(), "summary": summary, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
