"""autopar's per-rank runtime cost against the plain model's, in one process: the CPU time one rank
spends in forward, backward and the optimizer step, apart from communication and from the other
ranks' load.

The process is rank 0 of 8 on torch's fake process group (`torch.testing._internal.distributed.
fake_pg`: every collective returns at once, moving no data), so what is timed is this rank's own
work: the emitted graphs, the runtime around them (input checks, the autograd node, the
parameters' DTensors) and the optimizer over them. The model and plan are benchmarks/peers.py's:
examples.models.make_gpt at width 256, 4 layers, 8 heads, 64 tokens, vocabulary 512, `parallelize(
model, 8, mesh_shape="auto")` on the `cpu-gloo` table (which plans DDP's pattern there: replicated
weights, the batch split, gradients all-reduced in buckets). The reference is the same model in
plain eager PyTorch on this rank's 1/8 of the batch (what a DDP rank computes, less DDP's hooks
and all-reduce). SGD with momentum on both. The two are built in one process and their steps
alternated (order reversed every other step), so machine load hits both alike; each phase is
`time.process_time`, the median over `--steps` steps. The losses are not compared (the fake group
moves no data): tests and benchmarks/peers.py check them.

    python benchmarks/runtime_overhead.py               # ~1 min
    python benchmarks/runtime_overhead.py --steps 60
    python benchmarks/runtime_overhead.py --decomposed-norms   # also: auto with its layer norms as traced

`--decomposed-norms` adds a third variant, alternated with the two: the same plan with emit's
`whole_norms` step skipped (each layer norm left as the trace's sums and pointwise ops), to
measure what that step saves in one run.

Writes benchmarks/results/runtime_overhead.json (or <name>.json), with the ATen calls of the
program's forward and backward graphs.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import git_state, table, write_result  # noqa: E402
from torch import nn  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import autopar  # noqa: E402
import autopar.passes.emit as emit_stage  # noqa: E402
from autopar.runtime.module import ParallelModule  # noqa: E402
from examples.models import make_gpt  # noqa: E402

WORLD = 8
MODEL = {"n_embd": 256, "n_layer": 4, "n_head": 8, "block_size": 64, "vocab_size": 512}
PHASES = ("forward", "backward", "optimizer")
DECOMPOSED = "autopar auto, layer norms decomposed"
FAULTS = "page faults"  # minor page faults per step (`ru_minflt`): pages the allocator handed back and touched again


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.optim.Optimizer]:
    model, batch = make_gpt(0, WORLD, **MODEL)
    if name == "plain eager (1/8 batch)":
        module: nn.Module = model
        batch = tuple(t.chunk(WORLD)[0].contiguous() for t in batch)
    elif name == DECOMPOSED:
        whole = emit_stage.whole_layer_norms
        emit_stage.whole_layer_norms = lambda gm: 0  # (this build only)
        try:
            module = autopar.parallelize(model, WORLD, example_inputs=batch, mesh_shape="auto")
        finally:
            emit_stage.whole_layer_norms = whole
    else:
        module = autopar.parallelize(model, WORLD, example_inputs=batch, mesh_shape="auto")
    return module, batch, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def measure(steps: int, decomposed: bool = False) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, int]]]:
    names = ["plain eager (1/8 batch)", *([DECOMPOSED] if decomposed else []), "autopar auto"]
    built = {name: build(name) for name in names}
    for module, batch, opt in built.values():  # warm-up: momentum buffers, first-call paths
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            module(*batch).backward()
            opt.step()
    times: dict[str, dict[str, list[float]]] = {n: {p: [] for p in (*PHASES, FAULTS)} for n in names}
    for step in range(steps):
        for name in names if step % 2 else names[::-1]:
            module, batch, opt = built[name]
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.process_time()
            opt.zero_grad(set_to_none=True)
            loss = module(*batch)
            t1 = time.process_time()
            loss.backward()
            t2 = time.process_time()
            opt.step()
            t3 = time.process_time()
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
                times[name][phase].append(seconds)
            times[name][FAULTS].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 1e3)
    return {n: {p: 1e3 * statistics.median(v) for p, v in times[n].items()} for n in names}, {
        n: aten_calls(module) for n, (module, _, _) in built.items() if isinstance(module, ParallelModule)
    }


def aten_calls(module: ParallelModule) -> dict[str, int]:
    """The ATen calls one step of the module's program makes, by graph (collectives included)."""
    program = module.program
    return {
        name: sum(1 for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))
        for name, gm in (("forward", program.forward), ("backward", program.backward))
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each (default 30)")
    parser.add_argument("--decomposed-norms", action="store_true", help="also time auto with its layer norms decomposed")
    parser.add_argument("--name", default="runtime_overhead", help="writes benchmarks/results/<name>.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each rank of peers.py
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    load = [os.getloadavg()[0]]
    result, calls = measure(args.steps, args.decomposed_norms)
    load.append(os.getloadavg()[0])
    dist.destroy_process_group()
    base = result["plain eager (1/8 batch)"]
    rows: list[list[Any]] = []
    for name, phases in result.items():
        total = sum(phases[p] for p in PHASES)
        rows.append(
            [
                name,
                *(f"{phases[p]:.1f}" for p in PHASES),
                f"{total:.1f}",
                f"{total / sum(base[p] for p in PHASES):.2f}",
                f"{phases[FAULTS]:.0f}",
            ]
        )
    text = table(["rank 0 of 8, CPU ms", *PHASES, "step", "x plain", f"{FAULTS} per step"], rows)
    print(text)
    print(f"load average (1 min) {load[0]:.1f} -> {load[1]:.1f}")
    for name, counts in calls.items():
        print(f"{name}: ATen calls in the forward graph {counts['forward']}, backward {counts['backward']}")
    payload = {
        "model": MODEL,
        "steps": args.steps,
        "ms": result,
        "aten_calls": calls,
        "load_average_1min": load,
        "git": git_state(),
    }
    print(f"wrote {write_result(args.name, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
