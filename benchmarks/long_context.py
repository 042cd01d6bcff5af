"""Long sequences (issue 36, item 5): (a) measured on gloo ranks, (b) modeled on H100s.

(a) `--ranks 8`: a LLaMA-style model (`examples.zoo.Llama`, small: 2 layers, width 256, batch 1) at
a long sequence on 8 forked gloo ranks of this machine, each rank running every plan below in one
job, alternated round by round: the best plan without context parallelism (the search with the
attention rules' sequence split ruled out, `rules.context_parallel.without_sequence_split`), the
search's own choice at its defaults, each strategy forced on a `("cp",)` mesh, and (with
`--memory-limit-mib`) the search's choice under that `memory_limit`. Per plan: the step's wall time
(slowest rank, forward + backward + SGD-with-momentum), each rank's peak RSS during its steps (the
kernel's high-water mark, reset before each step after `malloc_trim`) and its rise over the RSS
before the step, every step's loss (equal across plans: each starts from the same weights on the
same batch), and the plan as `autopar.plan` models it. After the timed rounds, one more step per
plan with malloc's bytes in use sampled after every ATen op (`_live_step`): the step's live peak
over the bytes in use before it, which the tensors occupy, against the RSS rise, which adds what
the allocator keeps. Writes benchmarks/results/<name>.json:

    python benchmarks/long_context.py --ranks 8 --seq 4096 --name long_context_ranks

(b) `auto` against published context-parallel configurations on H100s, modeled: same model, same
batch, same memory limit.

Each row is a LLaMA-3 shape (`examples.zoo.Llama` on the meta device in bfloat16: 8B is 32 layers,
width 4096, 32 query heads, 8 key/value heads, FFN 14336, vocabulary 128256; 70B is 80 layers, width
8192, 64 heads, 8 key/value heads, FFN 28672) with a batch of one sequence per data-parallel replica
of the published configuration (the published runs accumulate more microbatches per step; one
microbatch is priced here on both sides). Both sides are planned by `autopar.plan` on the
`h100-nvlink-ib` table with `memory_limit` = 80 GB per rank:

- *auto*: `mesh_shape="auto"` over the row's GPUs: every factorization of the world searched, the
  fastest that fits kept (context parallelism is one more attention strategy there, never asked);
- *published*: the published degrees as a named mesh, the "cp" axis asking for context
  parallelism with keys and values all-gathered (`PlanOptions(context_parallel="allgather")`,
  Llama 3's and Megatron's all-gather CP), the other axes searched.

The published configurations (NeMo's "Long Sequence Performance" table; the rows name the page)
ran FP8 with Transformer Engine; the comparison here is of layouts under the same model, not of
those runs' throughput. Modeled step and memory per rank are `PlanResult`'s (the emitted program
priced; memory as the planner counts it). Run one row at a time, it takes minutes of CPU each:

    python benchmarks/long_context.py --rows "8B 32K x8"
    python benchmarks/long_context.py            # every row

Writes benchmarks/results/long_context.json (`--name` to change).
"""

from __future__ import annotations

import argparse
import copy
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import RunClock, git_state, on_meta, table, write_result  # noqa: E402
from multirank import run_ranks  # noqa: E402

import autopar  # noqa: E402
from autopar.core.meta import info  # noqa: E402
from autopar.rules.context_parallel import BACKWARD, FORWARD, without_sequence_split  # noqa: E402
from autopar.rules.registry import default_registry  # noqa: E402
from autopar.testing.live_heap import LivePeak, malloc_in_use, settle  # noqa: E402

NEMO_URL = "https://docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_long_sequence.html"
NEMO_B200_URL = "https://huggingface.co/Respair/NeMo_Canary/blob/main/docs/source/performance/performance_long_sequence.md"
MEMORY_LIMIT = 80e9  # bytes per rank: H100 80GB SXM
TABLE = "h100-nvlink-ib"
SHAPES = {  # layers, width, heads, k/v heads, FFN
    "8B": (32, 4096, 32, 8, 14336),
    "70B": (80, 8192, 64, 8, 28672),
}


@dataclass(frozen=True)
class Row:
    key: str
    model: str
    seq: int
    gpus: int
    tp: int
    cp: int
    dp: int
    source: str


ROWS = [
    Row("8B 32K x8", "8B", 32768, 8, 1, 2, 4, f"{NEMO_B200_URL}, LLAMA3-8B row SeqLen 32K: TP1 PP1 DP4 CP2 (on 32 GPUs; 8 here)"),
    Row("8B 128K x16", "8B", 131072, 16, 2, 4, 2, f"{NEMO_B200_URL}, LLAMA3-8B row SeqLen 128K: TP2 PP1 DP4 CP4 (on 128 GPUs; DP2 here)"),
    Row("8B 128K x64", "8B", 131072, 64, 4, 4, 4, f"{NEMO_URL}, LLAMA2-7B row SeqLen 128K: TP4 PP1 DP8 CP4 (on 128 GPUs; DP4 here)"),
    Row("70B 128K x64", "70B", 131072, 64, 8, 8, 1, "Llama 3 paper (arXiv 2407.21783), Table 4, 405B at 128K: TP8 CP16 PP16 on 16K H100s; 70B, TP8 CP8 on 64 here"),
]


def build(row: Row) -> torch.nn.Module:
    from examples.zoo import Llama, LlamaConfig

    layers, width, heads, kv, ffn = SHAPES[row.model]
    cfg = LlamaConfig(vocab_size=128256, seq_len=row.seq, dim=width, n_layer=layers, n_head=heads,
                      n_kv_head=kv, hidden=ffn, rope_base=500000.0)  # fmt: skip
    return on_meta(lambda: Llama(cfg)).to(torch.bfloat16)


def _attention(result: autopar.PlanResult) -> str:
    node = next(n for n in result.compiled.graph.graph.nodes if n.target in (FORWARD, BACKWARD))
    strategy = info(node).strategy
    return str(strategy).split(" ->")[0] if strategy is not None else "?"


def _priced(result: autopar.PlanResult) -> dict[str, Any]:
    return {"mesh": str(result.mesh), "step_s": result.step_time, "memory_gb": result.memory.total / 1e9,
            "attention_inputs": _attention(result)}  # fmt: skip


def _restricted(
    model: torch.nn.Module,
    batch: tuple,
    meshes: list[tuple[int, ...]],
    tried: list[dict[str, Any]],
    saved: Callable[[], None],
) -> autopar.PlanResult:
    """`auto` over the listed meshes only (axes unnamed: the search gives each its role, context
    parallelism included): the fastest plan that fits, where `mesh_shape="auto"` over every
    factorization takes too long to plan on the shared machine. Each mesh's outcome is appended to
    `tried`, and `saved()` called, as it is known."""
    best: autopar.PlanResult | None = None
    for shape in meshes:
        start = time.process_time()
        try:
            result = autopar.plan(model, shape, batch, memory_limit=MEMORY_LIMIT,
                                  planning=autopar.PlanOptions(hardware=TABLE))  # fmt: skip
        except autopar.AutoparError as error:
            print(shape, "refused:", str(error).splitlines()[0][:200], flush=True)
            tried.append({"mesh": list(shape), "error": str(error).splitlines()[0][:300]})
            saved()
            continue
        print(shape, result.step_time, result.memory.total / 1e9, flush=True)
        tried.append({**_priced(result), "cpu_s": time.process_time() - start})
        saved()
        if best is None or result.step_time < best.step_time:
            best = result
    if best is None:
        raise autopar.AutoparError(f"no plan fits on any of the meshes {meshes}")
    return best


def run_row(
    row: Row, meshes: list[tuple[int, ...]] | None = None, save: Callable[[dict[str, Any]], None] = lambda out: None
) -> dict[str, Any]:
    """Both sides of `row`; `save(out)` after each side and each mesh tried, so that a run stopped
    part way (the machine's memory, its time) keeps what it priced."""
    model = build(row)
    ids = torch.zeros(row.dp, row.seq, dtype=torch.long, device="meta")
    batch = (ids, ids)
    out: dict[str, Any] = {"row": asdict(row)}
    for side in ("published", "auto"):
        start = time.process_time()
        try:
            if side == "auto" and meshes:
                out["auto_meshes"] = [list(m) for m in meshes]
                out["auto_tried"] = []
                result = _restricted(model, batch, meshes, out["auto_tried"], lambda: save(out))
            elif side == "auto":
                result = autopar.plan(model, "auto", batch, world_size=row.gpus, memory_limit=MEMORY_LIMIT,
                                      planning=autopar.PlanOptions(hardware=TABLE))  # fmt: skip
            else:
                shape = tuple(s for s in (row.dp, row.tp, row.cp) if s > 1) or (1,)
                names = tuple(n for n, s in (("dp", row.dp), ("tp", row.tp), ("cp", row.cp)) if s > 1) or ("dp",)
                result = autopar.plan(model, shape, batch, mesh_names=names, memory_limit=MEMORY_LIMIT,
                                      planning=autopar.PlanOptions(hardware=TABLE, context_parallel="allgather"))  # fmt: skip
            out[side] = _priced(result)
        except autopar.AutoparError as error:
            out[side] = {"error": str(error).splitlines()[0][:300]}
        out[side]["cpu_s"] = time.process_time() - start
        print(row.key, side, out[side], flush=True)
        save(out)
    return out


def report(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        row, pub, auto = r["row"], r["published"], r["auto"]

        def cell(side: dict[str, Any]) -> list[str]:
            if "error" in side:
                return [side["error"][:80], "-", "-", "-"]
            return [side["mesh"], f"{side['step_s'] * 1e3:.0f}", f"{side['memory_gb']:.1f}", f"`{side['attention_inputs']}`"]

        if "auto_meshes" in r and "mesh" in auto:  # auto restricted to listed meshes (--meshes)
            auto = {**auto, "mesh": f"{auto['mesh']} (of {', '.join('x'.join(map(str, m)) for m in r['auto_meshes'])})"}
        speed = pub.get("step_s", math.nan) / auto["step_s"] if "step_s" in auto and "step_s" in pub else math.nan
        rows.append([row["key"], f"TP{row['tp']} CP{row['cp']} DP{row['dp']}", *cell(pub), *cell(auto),
                     f"{speed:.2f}", row["source"]])  # fmt: skip
    return table(
        ["row", "published", "mesh", "step ms", "GB/rank", "attention q, k, v", "auto mesh", "step ms", "GB/rank",
         "attention q, k, v", "published / auto", "source"],
        rows,
    )  # fmt: skip

# ------------------------------------------------------------------ (a) measured on gloo ranks

MiB = 2**20
_live_bytes = malloc_in_use()  # glibc's mallinfo2 (this benchmark runs on glibc machines)


def _live_step(pmodel: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> dict[str, float]:
    """One more step (not timed) with malloc's bytes in use sampled after every op: the step's live
    peak over the bytes in use before it, beside its RSS rise, to tell what the tensors hold from
    what the allocator keeps (the modeled memory counts the former)."""
    assert _live_bytes is not None, "needs glibc's mallinfo2"
    settle()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before, rss_before = _live_bytes(), _kib("VmRSS")
    dist.barrier()
    with LivePeak(_live_bytes) as mode:
        opt.zero_grad(set_to_none=True)
        pmodel(*batch).backward()
        opt.step()
    return {"live_rise_mib": (mode.peak - before) / MiB, "rss_rise_mib": (_kib("VmHWM") - rss_before) / 1024}
NO_CP, AUTO, LIMITED = "no CP", "auto", "auto, memory_limit"
FORCED = ("allgather", "balanced", "ring", "ring_balanced", "ulysses")


@dataclass(frozen=True)
class Small:
    """Part (a)'s LLaMA-style model and its one-sequence batch."""

    seq: int
    width: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 1
    hidden: int = 688
    vocab: int = 256  # small, so that the logits (whole on some plans) do not hide the activations

    def build(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        from examples.zoo import make_llama

        return make_llama(0, batch_size=1, vocab_size=self.vocab, seq_len=self.seq, dim=self.width,
                          n_layer=self.layers, n_head=self.heads, n_kv_head=self.kv_heads, hidden=self.hidden)  # fmt: skip


def plan_args(variant: str, limit: float | None) -> tuple[tuple[str], autopar.PlanOptions, float | None]:
    """Mesh axis name, planning options and memory limit of one of part (a)'s plans: `NO_CP`,
    `AUTO`, `LIMITED` (the search's choice under `limit` bytes), or "cp <strategy>" (forced; "cp auto":
    a "cp" axis at its defaults)."""
    if variant == NO_CP:
        return ("x",), autopar.PlanOptions(registry=without_sequence_split(default_registry())), None
    if variant in (AUTO, LIMITED):
        return ("x",), autopar.PlanOptions(), limit if variant == LIMITED else None
    strategy = variant.removeprefix("cp ")
    if strategy not in (*FORCED, "auto"):  # "cp auto": a "cp" axis, the search choosing among all
        raise ValueError(f"unknown plan {variant!r}: {NO_CP!r}, {AUTO!r}, {LIMITED!r} or 'cp <strategy>', one of "
                         f"{(*FORCED, 'auto')}")
    return ("cp",), autopar.PlanOptions(context_parallel=strategy), None


def _kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def _measured_step(pmodel: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> dict[str, float]:
    """One SGD-with-momentum step: its loss, its wall time on the slowest rank, this rank's RSS
    before it and its peak RSS during it (the high-water mark reset after returning what malloc
    keeps free, so the peak is this step's)."""
    settle()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current RSS
    before = _kib("VmRSS")
    dist.barrier()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = pmodel(*batch)
    loss.backward()
    opt.step()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    peak = _kib("VmHWM")
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return {"loss": float(loss.detach()), "step_s": float(seconds), "rss_before_mib": before / 1024, "peak_rss_mib": peak / 1024}


def _rank_job(rank: int, world_size: int, small: Small, variants: list[str], limit: float | None, rounds: int) -> dict[str, Any]:
    """Every plan compiled on this rank, then `rounds` rounds of one step each, the order rotating
    (round 0 warms up: the runtime's first call)."""
    torch.manual_seed(0)
    model, batch = small.build()
    pmodels: dict[str, torch.nn.Module] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    out: dict[str, Any] = {"compile_s": {}, "report": {}, "steps": {v: [] for v in variants}}
    for variant in variants:
        names, planning, memory_limit = plan_args(variant, limit)
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=names)
        start = time.perf_counter()
        pmodel = autopar.parallelize(copy.deepcopy(model), mesh, example_inputs=batch, planning=planning,
                                     memory_limit=memory_limit)  # fmt: skip
        out["compile_s"][variant] = time.perf_counter() - start
        report = pmodel.report
        saved = report.activations
        out["report"][variant] = {
            "saved_activations_mib": saved.after / MiB if saved is not None else None,
            "recomputed": len(saved.recomputed) if saved is not None else 0,
            "collectives": len(report.collectives),
            "sent_mb": report.bytes_per_step() / 1e6,
        }
        pmodels[variant], opts[variant] = pmodel, torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    del model
    for round_ in range(rounds):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        for variant in reversed(order) if round_ % 2 else order:
            out["steps"][variant].append(_measured_step(pmodels[variant], opts[variant], batch))
    out["live"] = {variant: _live_step(pmodels[variant], opts[variant], batch) for variant in variants}
    out["ru_maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _modeled(small: Small, variant: str, limit: float | None, ranks: int) -> dict[str, Any]:
    """The plan as `autopar.plan` makes it for a CPU mesh (what `parallelize` compiles)."""
    model, batch = small.build()
    names, planning, memory_limit = plan_args(variant, limit)
    result = autopar.plan(model, (ranks,), batch, mesh_names=names, memory_limit=memory_limit, planning=planning,
                          device_type="cpu")  # fmt: skip
    return {"attention_inputs": _attention(result), "modeled_step_ms": result.step_time * 1e3,
            "modeled_memory_mib": result.memory.total / MiB, "modeled_working_mib": result.memory.working / MiB,
            "modeled_activations_mib": result.memory.activations / MiB}  # fmt: skip


def measure(small: Small, variants: list[str], limit: float | None, ranks: int, rounds: int) -> dict[str, Any]:
    """Part (a): each plan modeled here, then measured on `ranks` gloo ranks; the serial model's
    first loss beside the plans' (every plan's losses are compared with the first plan's)."""
    clock = RunClock()
    model, batch = small.build()
    with torch.no_grad():
        serial_loss = float(model(*batch))
    modeled = {v: _modeled(small, v, limit, ranks) for v in variants}
    print("modeled", modeled, flush=True)
    results = run_ranks(ranks, _rank_job, small, variants, limit, rounds, timeout=4 * 3600)
    summary: dict[str, Any] = {}
    for v in variants:
        timed = [[r["steps"][v][i] for r in results] for i in range(1, rounds)]  # per round, per rank
        summary[v] = {
            **modeled[v],
            **results[0]["report"][v],
            "compile_s": max(r["compile_s"][v] for r in results),
            "step_ms": [1e3 * steps[0]["step_s"] for steps in timed],
            "median_step_ms": 1e3 * statistics.median(steps[0]["step_s"] for steps in timed),
            "peak_rss_mib_per_rank": [max(steps[k]["peak_rss_mib"] for steps in timed) for k in range(ranks)],
            "rise_mib_per_rank": [max(s[k]["peak_rss_mib"] - s[k]["rss_before_mib"] for s in timed) for k in range(ranks)],
            "live_rise_mib_per_rank": [r["live"][v]["live_rise_mib"] for r in results],
            "live_step_rss_rise_mib_per_rank": [r["live"][v]["rss_rise_mib"] for r in results],
            "losses": [results[0]["steps"][v][i]["loss"] for i in range(rounds)],
            "losses_agree_across_ranks": all(
                r["steps"][v][i]["loss"] == results[0]["steps"][v][i]["loss"] for r in results for i in range(rounds)
            ),
        }
    reference = summary[variants[0]]["losses"]
    spread = max(abs(a - b) / abs(b) for v in variants for a, b in zip(summary[v]["losses"], reference))
    return {"model": asdict(small), "ranks": ranks, "rounds": rounds, "memory_limit_bytes": limit,
            "serial_loss_step0": serial_loss, "loss_max_rel_diff_across_plans": spread, "plans": summary,
            "ru_maxrss_mib_per_rank": [r["ru_maxrss_mib"] for r in results], **clock.record(), "git": git_state()}  # fmt: skip


def measured_table(result: dict[str, Any]) -> str:
    rows = []
    for variant, p in result["plans"].items():
        rows.append([
            variant, f"`{p['attention_inputs']}`", f"{p['modeled_memory_mib']:.1f}", f"{p['saved_activations_mib']:.1f}",
            f"{p['modeled_working_mib']:.1f}", p["recomputed"], f"{max(p['peak_rss_mib_per_rank']):.0f}",
            f"{max(p['rise_mib_per_rank']):.0f}", f"{max(p['live_rise_mib_per_rank']):.1f}",
            f"{p['median_step_ms']:.0f}", f"{p['losses'][0]:.6f}",
        ])  # fmt: skip
    return table(
        ["plan", "first attention q, k, v", "modeled MiB/rank", "saved activations MiB", "working MiB (modeled)", "recomputed",
         "peak RSS MiB (max rank)", "step's rise MiB (max rank)", "live heap rise MiB (max rank)", "step ms (median)",
         "loss, step 0"],
        rows,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="*", default=None)
    parser.add_argument("--name", default="long_context")
    parser.add_argument("--meshes", nargs="*", default=None, help='restrict auto to these shapes ("8x8 2x4x8")')
    parser.add_argument("--ranks", type=int, default=None, help="part (a): measure on this many gloo ranks")
    parser.add_argument("--seq", type=int, default=4096, help="part (a): the sequence length")
    parser.add_argument("--layers", type=int, default=4, help="part (a): the model's layers")
    parser.add_argument("--vocab", type=int, default=256, help="part (a): the vocabulary")
    parser.add_argument("--plans", nargs="*", default=[NO_CP, AUTO, "cp balanced", "cp ring_balanced"],
                        help=f"part (a): {NO_CP!r}, {AUTO!r}, 'cp <strategy>' ({LIMITED!r} with --memory-limit-mib)")
    parser.add_argument("--memory-limit-mib", type=float, default=None, help=f"part (a): adds {LIMITED!r}")
    parser.add_argument("--rounds", type=int, default=4, help="part (a): steps per plan, the first a warm-up")
    args = parser.parse_args()
    if args.ranks is not None:
        limit = args.memory_limit_mib * MiB if args.memory_limit_mib is not None else None
        plans = [*args.plans, *([LIMITED] if limit is not None else [])]
        result = measure(Small(args.seq, layers=args.layers, vocab=args.vocab), plans, limit, args.ranks, args.rounds)
        print(measured_table(result))
        write_result(args.name, result)
        return
    chosen = [r for r in ROWS if args.rows is None or r.key in args.rows]
    meshes = [tuple(int(n) for n in m.split("x")) for m in args.meshes] if args.meshes else None
    results: list[dict[str, Any]] = []

    def save(partial: dict[str, Any]) -> None:
        write_result(args.name, {"rows": [*results, partial], "memory_limit": MEMORY_LIMIT, "table": TABLE})

    for r in chosen:
        results.append(run_row(r, meshes, save))
    print(report(results))
    write_result(args.name, {"rows": results, "memory_limit": MEMORY_LIMIT, "table": TABLE})


if __name__ == "__main__":
    main()
