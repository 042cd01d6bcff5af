"""Step time of Inductor-compiled programs (`parallelize(..., compile=True)`) against the eager
programs, measured on real gloo ranks of this machine.

Each job (forked by tests/multirank.py, one torch thread per rank) builds the example GPT twice
from the same seed and parallelizes it twice: eager and `compile=True`. Both train one warm-up step
(the compiled one pays Inductor's compile there, timed as "first step"), then `--reps` rounds each
time `--steps` forward+backward+SGD steps of each variant, the order alternating from one round to
the next so that drifts in machine load hit both alike. A round's time is the slowest rank's. We
report the median step of each variant and the median over rounds of the ratio compiled / eager
(adjacent blocks of the same round), with its range, and check that the losses agree.

What 2 shared CPU cores can show: Inductor fuses the element-wise chains between matmuls and
collectives into C++ loops; with 8 ranks on 2 cores the step is dominated by gloo and by the
cores' contention, which compiling does not change. A GPU, where launch overhead and memory
traffic of thousands of small kernels dominate an eager step, is where fusion pays most; no GPU
was lent when this was written.

    python benchmarks/compiled_step.py                 # 1 and 8 ranks, ~10 min on 2 busy cores
    python benchmarks/compiled_step.py --ranks 1 --reps 3

Writes benchmarks/results/compiled_step.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import table, write_result  # noqa: E402
from multirank import run_ranks  # noqa: E402

import autopar  # noqa: E402
from examples.models import make_gpt  # noqa: E402

MESHES = {1: (1,), 2: (2,), 4: (2, 2), 8: (2, 2, 2)}
MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64, "vocab_size": 256}


def _job(rank: int, world_size: int, reps: int, steps: int, batch_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", MESHES[world_size])
    variants: dict[str, Any] = {}
    batch: tuple[torch.Tensor, ...] = ()
    for name, compiled in (("eager", False), ("compiled", True)):
        model, batch = make_gpt(0, batch_size=batch_size, **MODEL)
        pmodel = autopar.parallelize(model, mesh, example_inputs=batch, compile=compiled)
        variants[name] = (pmodel, torch.optim.SGD(pmodel.parameters(), lr=0.01, momentum=0.9))

    def block(name: str, n: int) -> tuple[float, float]:
        pmodel, opt = variants[name]
        dist.barrier()
        start = time.perf_counter()
        loss = torch.zeros(())
        for _ in range(n):
            opt.zero_grad()
            loss = pmodel(*batch)
            loss.backward()
            opt.step()
        dist.barrier()
        return (time.perf_counter() - start) / n, float(loss.detach())

    first = {name: block(name, 1) for name in variants}  # compiled: Inductor's compile
    rounds = []
    for rep in range(reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        rounds.append({name: block(name, steps)[0] for name in order})
    losses = {name: block(name, 1)[1] for name in variants}  # the same step count on both
    return {"first": {k: v[0] for k, v in first.items()}, "rounds": rounds, "losses": losses}


def measure(world_size: int, reps: int, steps: int, batch_size: int) -> dict[str, Any]:
    results = run_ranks(world_size, _job, reps, steps, batch_size, timeout=3000)
    rounds = [
        {name: max(r["rounds"][i][name] for r in results) for name in ("eager", "compiled")}
        for i in range(reps)
    ]
    ratios = [r["compiled"] / r["eager"] for r in rounds]
    losses = results[0]["losses"]
    return {
        "ranks": world_size,
        "mesh": MESHES[world_size],
        "first_step_s": {name: max(r["first"][name] for r in results) for name in ("eager", "compiled")},
        "eager_ms": 1e3 * statistics.median(r["eager"] for r in rounds),
        "compiled_ms": 1e3 * statistics.median(r["compiled"] for r in rounds),
        "ratio_median": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
        "losses": losses,
        "loss_rel_diff": abs(losses["compiled"] - losses["eager"]) / abs(losses["eager"]),
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", nargs="*", type=int, default=[1, 8], choices=sorted(MESHES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    rows = [measure(n, args.reps, args.steps, args.batch) for n in args.ranks]
    print(
        table(
            ["ranks", "mesh", "eager ms", "compiled ms", "compiled / eager (median, range)", "first step eager / compiled s", "loss rel. diff"],
            [
                [
                    r["ranks"],
                    "x".join(map(str, r["mesh"])),
                    f"{r['eager_ms']:.1f}",
                    f"{r['compiled_ms']:.1f}",
                    f"{r['ratio_median']:.2f} ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})",
                    f"{r['first_step_s']['eager']:.1f} / {r['first_step_s']['compiled']:.1f}",
                    f"{r['loss_rel_diff']:.1e}",
                ]
                for r in rows
            ],
        )
    )
    config = {"model": MODEL, "batch": args.batch, "reps": args.reps, "steps": args.steps}
    print(write_result("compiled_step", {"config": config, "rows": rows}))


if __name__ == "__main__":
    main()
