"""Pipeline schedules on 8 gloo ranks (issue 19): the step time of pp=2 x (2,2) under 1F1B, interleaved
1F1B (v=2) and zero-bubble (ZB-H1, v=1; ZB-V, v=2), measured side by side in one job, beside each
module's modeled timeline (`pmodel.timeline_report`).

Mesh `init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "x", "y"))`: two pipeline ranks, each
stage planned by the tensor search on its (2, 2) sub-mesh. The model is examples/models.make_gpt at
width 256, 4 layers, 8 heads, 64 tokens, vocabulary 512 (the GPT of benchmarks/peers.py), one batch
of 8 sequences, M microbatches (default 4 and 8). The stage boundaries are forced, so that only the schedule
differs: v=1 schedules cut at `blocks.2` (two stages of two blocks), v=2 schedules at `blocks.1`,
`blocks.2`, `blocks.3` (four stages of one block; rank 0 holds two of them, so every rank computes two
blocks under every schedule). The forced cut is priced by the stage cut's cost model too (on
parallelize's default pipeline hardware, h100-nvlink-ib), so `timeline_report` is in seconds; were
`stage_cut` None, it would be the schedule at unit durations (the JSON's `modeled.source` says which).

What it measures:

- losses: every variant starts from a copy of the same weights and trains on the same batch with SGD
  with momentum; its loss at each of the `--check-steps` warm-up steps (the first compiles the
  stages' programs) must equal the serial model's (rtol 1e-4) on every rank, or the benchmark stops
  before timing anything and reports nothing.
- step time: one training step `loss = pmodel(*batch); loss.backward(); opt.step(); opt.zero_grad()`,
  after a barrier, the slowest rank's wall time (all-reduced max). `--rounds` rounds (default 7),
  each timing `--steps` steps (default 1) of every variant, the order rotating and reversed every
  other round, so that drifts in machine load hit all alike. Per variant: the median over rounds,
  the min-max spread, and the median over rounds of the ratio to 1F1B's time in the same round.
- messages: the pipeline's point-to-point sends (`dist.isend`) each rank issues in one more step,
  and the elements they carry; in another step, the collectives each rank dispatches (c10d and
  functional, not waits; benchmarks/peers.py's counter), sends and receives apart.
- modeled: each module's `timeline_report` (modeled step, bubble share of the step, idle/busy
  against (p-1)/(v*m)), and beside it the schedule simulated at equal work per rank with free sends
  (a v=2 stage's F, B, I, W are half a v=1 stage's), in units of one rank's forward of one
  microbatch: what the schedule is designed to gain.

    python benchmarks/pipeline_schedules.py            # ~4 min on 2 busy cores: M = 4 and 8, 7 rounds
    python benchmarks/pipeline_schedules.py --quick    # ~1.5 min: M = 4, 3 rounds

Writes benchmarks/results/pipeline_schedules.json (or <name>.json).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, git_state, table, write_result  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from multirank import run_ranks  # noqa: E402
from peers import CollectiveCounter  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import autopar  # noqa: E402
from autopar.compiler.pipeline import PipelinedModule  # noqa: E402
from autopar.core.pipeline_simulate import Durations, bubble_ratio, simulate  # noqa: E402
from examples.models import make_gpt  # noqa: E402

WORLD = 8
MESH = (2, 2, 2)
AXES = ("pp", "x", "y")
SEED = 0
BATCH = 8
MODEL = {"n_embd": 256, "n_layer": 4, "n_head": 8, "block_size": 64, "vocab_size": 512}
LR, MOMENTUM = 0.1, 0.9
RTOL = 1e-4


@dataclass(frozen=True)
class Variant:
    """One pipelined module: the schedule name `parallelize` takes, its virtual stages, M."""

    label: str
    schedule: str
    v: int
    boundaries: tuple[str, ...]


ONE_STAGE = ("blocks.2",)  # v=1: stage 0 = embedding, blocks 0-1; stage 1 = blocks 2-3, head
TWO_STAGES = ("blocks.1", "blocks.2", "blocks.3")  # v=2: one block per stage
VARIANTS = {
    "1f1b": Variant("1F1B", "1f1b", 1, ONE_STAGE),
    "interleaved": Variant("interleaved 1F1B v=2", "interleaved-1f1b", 2, TWO_STAGES),
    "zb-h1": Variant("zero-bubble ZB-H1 v=1", "zero-bubble", 1, ONE_STAGE),
    "zb-v": Variant("zero-bubble ZB-V v=2", "zero-bubble", 2, TWO_STAGES),
}
REFERENCE = "1f1b"


def _key(name: str, m: int) -> str:
    return f"{name} M={m}"


def _step(module: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]) -> float:
    loss = module(*batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rotation(names: list[str], index: int) -> list[str]:
    order = names[index % len(names) :] + names[: index % len(names)]
    return order[::-1] if index % 2 else order


def _equal_work(schedule: Any) -> dict[str, float]:
    """The schedule simulated with the same work per rank for every v and free sends: each of a
    rank's v stages takes 1/v of a v=1 stage's F (1), B (2), I and W (1 each). Its step in units of
    one rank's forward of one microbatch, and idle over busy time."""
    v = schedule.v
    durations = Durations(forward=1.0 / v, backward=2.0 / v, backward_input=1.0 / v, backward_weight=1.0 / v)
    timeline = simulate(schedule, durations)
    return {"step": timeline.makespan, "idle_over_busy": bubble_ratio(timeline)}


def _count_sends(
    module: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]
) -> dict[str, int]:
    """The point-to-point sends this rank issues in one training step, and their elements."""
    sizes: list[int] = []
    isend = dist.isend

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(tensor.numel())
        return isend(tensor, *args, **kwargs)

    dist.isend = counting  # type: ignore[assignment]  # this rank's process only
    try:
        _step(module, optimizer, batch)
    finally:
        dist.isend = isend  # type: ignore[assignment]
    return {"sends": len(sizes), "elements": sum(sizes)}


def _count_collectives(
    module: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]
) -> dict[str, Any]:
    """The collectives (c10d and functional, not waits) this rank dispatches in one training step,
    point-to-point sends and receives apart, by op and group size (benchmarks/peers.py's counter)."""
    counter = CollectiveCounter()
    with counter:
        _step(module, optimizer, batch)
    p2p = {k: n for k, n in counter.counts.items() if k.startswith(("send", "recv"))}
    other = {k: n for k, n in counter.counts.items() if k not in p2p}
    return {"collectives": sum(other.values()), "p2p": sum(p2p.values()), "counts": dict(counter.counts)}


def _job(
    rank: int,
    world_size: int,
    names: list[str],
    microbatches: list[int],
    check_steps: int,
    rounds: int,
    steps: int,
) -> dict[str, Any]:
    """Build every variant, check its losses against serial, then time them in alternated rounds."""
    model, batch = make_gpt(SEED, BATCH, **MODEL)
    serial = copy.deepcopy(model)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=LR, momentum=MOMENTUM)
    serial_losses = [_step(serial, serial_opt, batch) for _ in range(check_steps)]

    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=AXES)
    built: dict[str, tuple[PipelinedModule, torch.optim.Optimizer]] = {}
    setup_s: dict[str, float] = {}
    keys: list[str] = []
    for m in microbatches:
        for name in names:
            variant = VARIANTS[name]
            key = _key(name, m)
            dist.barrier()
            t0 = time.perf_counter()
            pmodel = autopar.parallelize(
                copy.deepcopy(model),
                mesh,
                example_inputs=batch,
                pipeline=autopar.PipelineOptions(
                    microbatches=m,
                    schedule=variant.schedule,
                    virtual_stages=variant.v,
                    stage_boundaries=list(variant.boundaries),
                ),
            )
            setup_s[key] = time.perf_counter() - t0
            assert isinstance(pmodel, PipelinedModule), type(pmodel)
            built[key] = (pmodel, torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=MOMENTUM))
            keys.append(key)

    # warm-up: the first step compiles; every loss must be serial's before anything is timed
    losses: dict[str, list[float]] = {key: [] for key in keys}
    warm_s: dict[str, list[float]] = {key: [] for key in keys}
    for _ in range(check_steps):
        for key in keys:
            dist.barrier()
            t0 = time.perf_counter()
            losses[key].append(_step(*built[key], batch))
            warm_s[key].append(_slowest(time.perf_counter() - t0))
    bad = {
        key: got
        for key, got in losses.items()
        if any(abs(a - b) > RTOL * abs(b) for a, b in zip(got, serial_losses))
    }
    flag = torch.tensor([0.0 if bad else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() < 1.0:
        return {"refused": True, "serial_losses": serial_losses, "losses": losses, "bad": bad}

    messages = {key: _count_sends(*built[key], batch) for key in keys}
    collectives = {key: _count_collectives(*built[key], batch) for key in keys}
    per_step: dict[str, list[float]] = {key: [] for key in keys}
    own: dict[str, list[float]] = {key: [] for key in keys}
    for index in range(rounds):
        for key in _rotation(keys, index):
            total = 0.0
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                _step(*built[key], batch)
                total += time.perf_counter() - t0
            own[key].append(total / steps)
            per_step[key].append(_slowest(total) / steps)

    modeled: dict[str, Any] = {}
    for key in keys:
        pmodel = built[key][0]
        report = pmodel.timeline_report
        cut = pmodel.stage_cut
        modeled[key] = {
            "source": "unit durations" if cut is None else "the stage cut's cost model",
            "report": asdict(report),
            "text": str(report),
            "equal_work": _equal_work(pmodel.schedule),
            "stages": list(pmodel.stages),
            "boundaries": list(pmodel.boundaries),
        }
    return {
        "refused": False,
        "serial_losses": serial_losses,
        "losses": losses,
        "setup_s": setup_s,
        "warmup_step_s": warm_s,
        "messages": messages,
        "collectives": collectives,
        "step_s": per_step,
        "own_step_s": own,
        "modeled": modeled,
    }


# ---------------------------------------------------------------------------------------------
# the report


def _max_rel(got: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def summarize(results: list[dict[str, Any]], microbatches: list[int]) -> dict[str, Any]:
    first = results[0]
    serial = first["serial_losses"]
    rows: dict[str, dict[str, Any]] = {}
    for key, times in first["step_s"].items():
        name, m = key.rsplit(" M=", 1)
        ref = first["step_s"].get(_key(REFERENCE, int(m)))
        ratios = [a / b for a, b in zip(times, ref)] if ref is not None else []
        model = first["modeled"][key]
        report = model["report"]
        rows[key] = {
            "variant": VARIANTS[name].label,
            "schedule": VARIANTS[name].schedule,
            "virtual_stages": VARIANTS[name].v,
            "microbatches": int(m),
            "boundaries": model["boundaries"],
            "stages_rank0": model["stages"],
            "step_ms": [1e3 * t for t in times],
            "median_ms": 1e3 * statistics.median(times),
            "min_ms": 1e3 * min(times),
            "max_ms": 1e3 * max(times),
            "ratio_to_1f1b_per_round": ratios,
            "median_ratio_to_1f1b": statistics.median(ratios) if ratios else None,
            "rank0_step_ms_median": 1e3 * statistics.median(first["own_step_s"][key]),
            "warmup_step_ms": [1e3 * t for t in first["warmup_step_s"][key]],
            "setup_s_max": max(r["setup_s"][key] for r in results),
            "sends_rank0": first["messages"][key],
            "sends_per_rank": [r["messages"][key]["sends"] for r in results],
            "collectives_rank0": first["collectives"][key],
            "collectives_per_rank": [r["collectives"][key]["collectives"] for r in results],
            "losses": first["losses"][key],
            "loss_max_rel_diff": max(_max_rel(r["losses"][key], serial) for r in results),
            "modeled": {
                "source": model["source"],
                "step": report["step_time"],
                "unit": report["time_unit"],
                "bubble_fraction": report["bubble_fraction"],
                "ideal_fraction": report["ideal_fraction"],
                "bubble_ratio": report["bubble_ratio"],
                "ideal_ratio": report["ideal_ratio"],
                "report": report,
            },
            "equal_work": model["equal_work"],
            "timeline_report": model["text"],
        }
    for m in microbatches:
        ref_key = _key(REFERENCE, m)
        if ref_key not in rows:
            continue
        for row in rows.values():
            if row["microbatches"] == m:
                row["modeled"]["ratio_to_1f1b"] = row["modeled"]["step"] / rows[ref_key]["modeled"]["step"]
                row["equal_work"]["ratio_to_1f1b"] = (
                    row["equal_work"]["step"] / rows[ref_key]["equal_work"]["step"]
                )
    return {"serial_losses": serial, "rows": rows}


def _modeled_step(modeled: dict[str, Any]) -> str:
    step = modeled["step"]
    text = f"{step * 1e6:.1f} us" if modeled["unit"] == "s" else f"{step:.4g} {modeled['unit']}"
    ratio = modeled.get("ratio_to_1f1b")
    return text + (f" ({ratio:.2f})" if ratio is not None else "")


def _sends(counts: list[int]) -> str:
    return str(counts[0]) if len(set(counts)) == 1 else "-".join(map(str, (min(counts), max(counts))))


def print_table(summary: dict[str, Any]) -> str:
    headers = [
        "schedule",
        "M",
        "step ms median",
        "min-max",
        "/ 1F1B per round, median (range)",
        "per step: p2p sends per rank; collectives, ranks 0 / 4",
        "modeled step (/ 1F1B)",
        "modeled bubble share",
        "modeled idle/busy vs (p-1)/(v*m)",
        "equal work, free sends: step (/ 1F1B), idle/busy",
        f"losses = serial (rtol {RTOL:g})",
    ]
    rows = []
    for r in summary["rows"].values():
        ratios = r["ratio_to_1f1b_per_round"]
        ratio = f"{r['median_ratio_to_1f1b']:.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else ""
        modeled, equal = r["modeled"], r["equal_work"]
        equal_ratio = f" ({equal['ratio_to_1f1b']:.2f})" if "ratio_to_1f1b" in equal else ""
        rows.append(
            [
                r["variant"],
                r["microbatches"],
                f"{r['median_ms']:.0f}",
                f"{r['min_ms']:.0f}-{r['max_ms']:.0f}",
                ratio,
                f"{_sends(r['sends_per_rank'])}; {r['collectives_per_rank'][0]} / {r['collectives_per_rank'][4]}",
                _modeled_step(modeled),
                f"{modeled['bubble_fraction']:.3f}",
                f"{modeled['bubble_ratio']:.3f} vs {modeled['ideal_ratio']:.3f}",
                f"{equal['step']:.1f}{equal_ratio}, {equal['idle_over_busy']:.3f}",
                f"yes ({r['loss_max_rel_diff']:.1e})",
            ]
        )
    return table(headers, rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds (default 7)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 7; --quick 3)")
    parser.add_argument("--steps", type=int, default=1, help="steps per variant per round (default 1)")
    parser.add_argument("--check-steps", type=int, default=2, help="warm-up steps whose losses are checked")
    parser.add_argument("--microbatches", help="comma-separated M (default 4,8; --quick 4)")
    parser.add_argument("--only", help=f"comma-separated variants (default all: {','.join(VARIANTS)})")
    parser.add_argument("--name", default="pipeline_schedules", help="writes benchmarks/results/<name>.json")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    microbatches = [int(m) for m in (args.microbatches or ("4" if args.quick else "4,8")).split(",")]

    start = time.perf_counter()
    load = [os.getloadavg()[0]]
    results = run_ranks(WORLD, _job, names, microbatches, args.check_steps, rounds, args.steps, timeout=1800)
    load.append(os.getloadavg()[0])
    if any(r["refused"] for r in results):
        print("REFUSED: a pipelined module's loss differs from the serial model's; nothing is reported.")
        for rank, r in enumerate(results):
            if r["refused"]:
                print(f"  rank {rank}: serial {r['serial_losses']}; differing {r['bad']}")
        return 1
    summary = summarize(results, microbatches)
    text = print_table(summary)
    print(text)
    for row in summary["rows"].values():
        print(f"\n{row['timeline_report']}")
    wall = time.perf_counter() - start
    print(f"\nwall {wall:.0f} s, load average {load[0]:.1f} -> {load[1]:.1f}")
    payload = {
        "model": {"factory": "examples.models.make_gpt", "batch": BATCH, "seed": SEED, **MODEL},
        "mesh": {"shape": list(MESH), "names": list(AXES)},
        "optimizer": {"SGD": {"lr": LR, "momentum": MOMENTUM}},
        "microbatches": microbatches,
        "check_steps": args.check_steps,
        "rounds": rounds,
        "steps_per_round": args.steps,
        "threads_per_rank": 1,
        "quick": args.quick,
        "git": git_state(),
        "wall_s": wall,
        "load_average_1min": load,
        **summary,
        "table": text,
    }
    print(f"wrote {write_result(args.name, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
