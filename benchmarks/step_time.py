"""Step time with and without the schedule stage, measured on 8 real gloo ranks of this machine.

Each 8-rank job (forked by tests/multirank.py, one torch thread per rank, as examples/train_gpt.py
runs) builds the example GPT (examples/models.make_gpt, the model and batch of train_gpt.py) and
parallelizes it twice from the same weights: `PlanOptions(overlap=True)` (the schedule stage: small collectives
bucketed, collectives issued early and waited on late) and `overlap=False` (insert_comm's order:
every collective waited on right after it is issued). `--reorder-only` adds a variant, the
schedule stage with bucketing off, to tell the two effects apart; `--chunks K` adds one with the
batch over-decomposed into K chunks (`PlanOptions(over_decompose=K)`, scheduled), whose collectives can overlap
the other chunks' compute; `--decompose on|off` adds one compiled with `decompose_matmuls` "on"
(every all-gather -> matmul and matmul -> reduce-scatter pair cut into pieces) or "off" beside the
default "auto". After warm-up, repetitions time
`--steps` forward+backward steps of each variant, the order rotating from one repetition to the
next, so that drifts in machine load hit all alike. A block's time is the slowest rank's; we report
the median step time per variant and the median over repetitions of the ratio variant / scheduled
(same repetition, adjacent blocks). The variants compute the same numbers: bit for bit on 2-rank
groups (tests/test_schedule_option.py), to float rounding where a bucketed reduction spans more
ranks (passes/bucket.py) or chunks add the batch's sums in another order; the last column compares
the last warm-up losses ("equal", or the largest relative difference to the scheduled variant).

Two regimes per mesh:

- `plain`: the emitted graphs as `parallelize` runs them. On this machine 8 ranks share 2 cores,
  so compute and gloo's worker threads compete for the same cores: overlap can hide only the time
  a rank spends *blocked* (latency, waiting for a slower peer), never communication work itself.
- `stretch k`: models a separate compute device (a GPU), where a kernel occupies the device and not
  the host's cores, and compute is a larger share of the step than on these tiny shapes. Every local
  op (everything but collectives and waits) is run by an fx.Interpreter that measures the op's CPU
  time t (thread CPU time, so preemption does not inflate it) and owes (k - 1) t of sleep; the debt
  is slept off before the next collective is issued or waited on (a device runs compute in order,
  and a collective's input must be computed before it is sent; compute queued before a wait runs
  while the collective is in flight) and at the end of the graph. Sleeping releases the core, so
  gloo's threads and other ranks progress meanwhile, as they would while a GPU computes. All
  variants run under the same interpreter, so its Python overhead is common to them.

What the CPU cannot show: real device/interconnect speeds (gloo over loopback, 8 processes on 2
shared cores: an unscheduled step costs ~2.6 ms per collective on 2-rank groups and ~25 ms on one
8-rank group, against tens of microseconds on NVLink), NCCL's own use of device cores, or the
memory cost of collectives in flight. The stretch factor sets the compute : communication ratio,
so the gain under stretch is a function of k, not a prediction for a given GPU.

    python benchmarks/step_time.py                  # ~4 min on 2 busy cores: (2,2,2) and (8,)
    python benchmarks/step_time.py --mesh 2,2,2 --reps 3 --stretch 0   # quick, plain only
    python benchmarks/step_time.py --mesh 2,2,2 --reorder-only --reps 6 --name step_time_reorder_only
    python benchmarks/step_time.py --mesh 2,2,2 --chunks 2 --name step_time_chunks   # ~4 min
    python benchmarks/step_time.py --mesh 2,4 --decompose on --decompose off --name step_time_decomposed

Writes benchmarks/results/step_time.json (or <name>.json).
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, table, write_result  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.fx as fx  # noqa: E402
from multirank import run_ranks  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import autopar  # noqa: E402
import autopar.compiler.driver  # noqa: E402
from autopar.core.collectives import COLLECTIVES  # noqa: E402
from autopar.core.mesh import default_axis_names  # noqa: E402
from autopar.passes.schedule import schedule as schedule_stage  # noqa: E402
from autopar.runtime.module import ParallelModule  # noqa: E402
from examples.models import make_gpt  # noqa: E402

WAIT = torch.ops._c10d_functional.wait_tensor.default
VARIANTS = ("scheduled", "unscheduled")


class StretchedGraph(fx.Interpreter):
    """Runs a graph with every local op's duration dilated k-fold, the extra part asleep (off-CPU)."""

    def __init__(self, gm: fx.GraphModule, factor: float) -> None:
        super().__init__(gm)
        self.meta = gm.meta  # the runtime reads the forward graph's meta
        self.factor = factor
        self.debt = 0.0
        self.slept = 0.0

    def __call__(self, *args: Any) -> Any:
        self.debt = 0.0
        out = self.run(*args)
        self._pay()
        return out

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        if n.target in COLLECTIVES or n.target is WAIT:
            self._pay()  # the device must have produced the input / reached this point in order
            return super().run_node(n)
        start = time.thread_time()
        out = super().run_node(n)
        self.debt += (self.factor - 1.0) * (time.thread_time() - start)
        return out

    def _pay(self) -> None:
        if self.debt > 0:
            time.sleep(self.debt)
            self.slept += self.debt
            self.debt = 0.0


def stretched(pmodel: ParallelModule, factor: float) -> ParallelModule:
    """A copy of `pmodel` sharing its parameters, whose graphs run under StretchedGraph."""
    # Shallow: same parameters and mesh, own _program slot. Not `copy.copy`, which goes through
    # `__reduce_ex__`, which a ParallelModule refuses (a user's pickle of it could not run anywhere).
    clone = type(pmodel).__new__(type(pmodel))
    clone.__dict__.update(pmodel.__dict__)
    program = pmodel.program
    clone._program = replace(  # a benchmark-only swap of the runtime's program
        program,
        forward=StretchedGraph(program.forward, factor),  # type: ignore[arg-type]
        backward=StretchedGraph(program.backward, factor),  # type: ignore[arg-type]
    )
    return clone


def _step(pmodel: ParallelModule, batch: tuple[torch.Tensor, ...]) -> float:
    for p in pmodel.parameters():
        p.grad = None
    loss = pmodel(*batch)
    loss.backward()
    return float(loss.detach())


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _alternate(
    models: dict[str, ParallelModule], batch: tuple[torch.Tensor, ...], warmup: int, steps: int, reps: int
) -> dict[str, Any]:
    """Warm each variant up, then `reps` rounds of one timed block per variant, the order rotating."""
    losses = {name: [_step(m, batch) for _ in range(warmup)][-1] for name, m in models.items()}
    names = list(models)
    per_step: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        if rep % 2:
            order.reverse()
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                _step(models[name], batch)
            per_step[name].append(_slowest(time.perf_counter() - start) / steps)
    return {"losses": losses, "step_s": per_step}


def _compile(model: torch.nn.Module, mesh: Any, batch: Any, variant: str) -> ParallelModule:
    if variant.startswith("decompose "):  # scheduled, collective matmuls decomposed "on" / "off"
        mode = variant.split()[1]
        return autopar.parallelize(model, mesh, example_inputs=batch, planning=autopar.PlanOptions(decompose_matmuls=mode))
    if variant.endswith(" chunks"):  # scheduled, the batch over-decomposed into k chunks
        k = int(variant.split()[0])
        return autopar.parallelize(model, mesh, example_inputs=batch, planning=autopar.PlanOptions(over_decompose=k))
    if variant != "reorder-only":
        overlap = autopar.PlanOptions(overlap=variant == "scheduled")
        return autopar.parallelize(model, mesh, example_inputs=batch, planning=overlap)
    # the schedule stage without its bucketing (bucket_bytes=0), to tell the two apart; opt-in
    no_buckets = functools.partial(schedule_stage, bucket_bytes=0)
    with mock.patch.object(autopar.compiler.driver, "schedule_pass", no_buckets):
        return autopar.parallelize(model, mesh, example_inputs=batch)


def _issued(pmodel: ParallelModule) -> int:
    """Collectives issued per step: emitted ones, less those bucketing folded into a bucket."""
    emitted = len(pmodel.report.collectives)
    report = pmodel.report.schedule
    return emitted - (report.bucketed - report.buckets) if hasattr(report, "bucketed") else emitted


def _job(
    rank: int,
    world_size: int,
    mesh_shape: tuple[int, ...],
    cfg: dict[str, int],
    batch_size: int,
    warmup: int,
    steps: int,
    reps: int,
    stretches: tuple[float, ...],
    variants: tuple[str, ...],
) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=default_axis_names(len(mesh_shape)))
    model, batch = make_gpt(0, batch_size, **cfg)
    models: dict[str, ParallelModule] = {}
    compile_s = {}
    for name in variants:
        start = time.perf_counter()
        models[name] = _compile(copy.deepcopy(model), mesh, batch, name)
        compile_s[name] = time.perf_counter() - start
    out: dict[str, Any] = {"compile_s": compile_s, "regimes": {}}
    out["collectives"] = {name: _issued(m) for name, m in models.items()}
    out["regimes"]["plain"] = _alternate(models, batch, warmup, steps, reps)
    for k in stretches:
        slow = {name: stretched(m, k) for name, m in models.items()}
        regime = _alternate(slow, batch, 1, steps, reps)  # the graphs are warm already
        program = slow["scheduled"].program
        slept = program.forward.slept + program.backward.slept  # type: ignore[attr-defined]
        # this rank's dilated compute per step (k t, t the ops' CPU time): what the stretch models
        regime["compute_s_per_step"] = slept * k / (k - 1) / (1 + reps * steps)
        out["regimes"][f"stretch {k:g}"] = regime
    return out


def summarize(results: list[dict[str, Any]], regime: str) -> dict[str, Any]:
    """Rank 0's view (block times are already the max over ranks, so every rank holds the same)."""
    r = results[0]["regimes"][regime]
    times = r["step_s"]
    ratios = {
        name: [u / s for u, s in zip(times[name], times["scheduled"])]
        for name in times
        if name != "scheduled"
    }
    losses = [res["regimes"][regime]["losses"] for res in results]
    spread = max(
        abs(loss - per_variant["scheduled"]) / max(abs(per_variant["scheduled"]), 1e-30)
        for per_variant in losses
        for loss in per_variant.values()
    )
    return {
        "median_step_ms": {name: 1e3 * statistics.median(v) for name, v in times.items()},
        "median_ratio_to_scheduled": {name: statistics.median(v) for name, v in ratios.items()},
        "ratios_to_scheduled": ratios,
        "step_ms": {name: [1e3 * x for x in v] for name, v in times.items()},
        "losses_equal": all(len(set(per_variant.values())) == 1 for per_variant in losses),
        "loss_max_rel_diff": spread,  # chunks add the batch's sums in another order: rounding only
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mesh", action="append", help="mesh shape, e.g. 2,2,2 (repeatable)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before timing")
    parser.add_argument("--reps", type=int, default=4, help="repetitions (each times every variant)")
    parser.add_argument("--stretch", type=float, action="append", help="compute stretch factors (0: none)")
    parser.add_argument(
        "--reorder-only", action="store_true", help="also time the schedule stage without bucketing"
    )
    parser.add_argument(
        "--chunks", type=int, action="append", default=[], help="also time over_decompose=K (repeatable)"
    )
    parser.add_argument(
        "--decompose", action="append", default=[], choices=["on", "off"],
        help='also time decompose_matmuls="on" / "off" (the scheduled default is "auto"; repeatable)',
    )  # fmt: skip
    parser.add_argument("--name", default="step_time", help="writes benchmarks/results/<name>.json")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--n-layer", type=int, default=2)
    args = parser.parse_args()
    meshes = [tuple(int(s) for s in m.split(",")) for m in (args.mesh or ["2,2,2", "8"])]
    stretches = tuple(k for k in (args.stretch or [20.0]) if k > 1)
    variants = (
        *VARIANTS,
        *(("reorder-only",) if args.reorder_only else ()),
        *(f"{k} chunks" for k in args.chunks),
        *(f"decompose {mode}" for mode in args.decompose),
    )
    cfg = {"n_embd": args.n_embd, "block_size": args.block_size, "n_layer": args.n_layer}

    rows = []
    payload: dict[str, Any] = {
        "model": {"factory": "examples.models.make_gpt", "batch": args.batch, **cfg},
        "warmup": args.warmup,
        "steps": args.steps,
        "reps": args.reps,
        "threads_per_rank": 1,
        "variants": list(variants),
        "runs": [],
    }
    for shape in meshes:
        start = time.perf_counter()
        load_before = os.getloadavg()[0]
        results = run_ranks(
            8,
            _job,
            shape,
            cfg,
            args.batch,
            args.warmup,
            args.steps,
            args.reps,
            stretches,
            variants,
            timeout=900,
        )
        wall = time.perf_counter() - start
        run: dict[str, Any] = {
            "mesh": list(shape),
            "wall_s": wall,
            "load_average_1min": [load_before, os.getloadavg()[0]],
            "collectives_per_step": results[0]["collectives"],
            "compile_s_rank0": results[0]["compile_s"],
            "regimes": {},
        }
        for regime in results[0]["regimes"]:
            s = summarize(results, regime)
            compute = "-"
            if regime != "plain":
                per_rank = [r["regimes"][regime]["compute_s_per_step"] * 1e3 for r in results]
                s["compute_ms_per_step_per_rank"] = per_rank
                compute = f"{statistics.median(per_rank):.0f}"
            run["regimes"][regime] = s
            for name in variants[1:]:
                ratios = s["ratios_to_scheduled"][name]
                rows.append(
                    [
                        "x".join(map(str, shape)),
                        regime,
                        name,
                        f"{run['collectives_per_step']['scheduled']} / {run['collectives_per_step'][name]}",
                        compute,
                        f"{s['median_step_ms']['scheduled']:.0f}",
                        f"{s['median_step_ms'][name]:.0f}",
                        f"{s['median_ratio_to_scheduled'][name]:.2f}",
                        f"{min(ratios):.2f}-{max(ratios):.2f}",
                        "equal" if s["losses_equal"] else f"{s['loss_max_rel_diff']:.1e}",
                    ]
                )
        payload["runs"].append(run)
        print(f"mesh {shape}: {wall:.0f} s", flush=True)
    headers = [
        "mesh", "regime", "vs", "collectives sch / vs", "stretched compute ms", "scheduled ms", "vs ms",
        "median ratio vs/sch", "ratio range", "losses (max rel diff)",
    ]  # fmt: skip
    print(table(headers, rows))
    print(f"wrote {write_result(args.name, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
