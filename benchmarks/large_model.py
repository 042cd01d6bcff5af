"""A GPT too large for every rank to hold a copy, started on 8 gloo ranks without ever materializing it.

One process first builds the GPT (examples/models.GPT) serially, writes its weights as a
safetensors checkpoint (`model.safetensors`, as `save_pretrained` would) and trains it two steps
(SGD with momentum) on a fixed batch: the reference losses. It then exits, and an 8-rank job
(tests/multirank.py, forked, one torch thread each) builds the same GPT on the meta device,
parallelizes it on the mesh, and either loads the checkpoint (`autopar.load_checkpoint`, each
rank reading only its slices) or initializes it in place (`parallelize` on the meta model, seeded
as the serial build), then trains the same two steps.

With `--pp 2 --mesh 2,2` the job is pipelined: the mesh is ("pp", "x", "y") of shape (2, 2, 2),
each rank materializes (or loads) only its stage's blocks, and the step runs 1F1B over
`--microbatches` microbatches (docs/pipeline.md#a-model-built-on-meta).

Per rank it reports the peak RSS against the modeled share: parameters + gradients + optimizer
state (momentum) of the rank's blocks + the activations its program saves for backward (pipelined:
its stage's saved activations per microbatch times the microbatches the schedule keeps in flight
on that rank), beside
the RSS of a rank that has only imported torch and joined the job (the runtime's fixed overhead),
and the time to parallelize, to load and per step. The losses must equal the serial ones.

The ranks fix glibc's mmap threshold (`--mmap-threshold-kib`, default 128, its starting value):
left to itself glibc raises the threshold to the size of each large block freed (up to 32 MiB), so
a step's weight-sized tensors come from the heap, and what they free there stays in the RSS (100-150
MiB a rank at 60-120 MiB of weights, docs/pipeline.md#a-pipelined-ranks-memory); fixed, every
block above it is returned when freed. `MALLOC_MMAP_THRESHOLD_=131072` in the environment does the
same for any job.

    python benchmarks/large_model.py                          # ~1 B parameters (4 GB in fp32)
    python benchmarks/large_model.py --n-layer 2 --n-embd 256 --name large_model_small   # a minute
    python benchmarks/large_model.py --pp 2 --mesh 2,2 --n-layer 18 --name large_model_pipelined_1b  # 0.92 B, pp=2 x (2,2), alone
    python benchmarks/large_model.py --pp 2 --mesh 2,2 --n-layer 2 --n-embd 128 --n-head 4 --vocab 512 --name x  # a minute

Writes benchmarks/results/large_model.json (or <name>.json) and a table on stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS, ROOT, environment
from safetensors.torch import save_model

sys.path.insert(0, str(ROOT / "tests"))
from multirank import run_ranks  # noqa: E402

import autopar  # noqa: E402
from autopar.core.pipeline_simulate import simulate  # noqa: E402
from examples.models import GPT, GPTConfig, gpt_batch  # noqa: E402

GiB = 1024**3
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
GLIBC_TRIM_THRESHOLD = 128 * 1024  # its default


def _two_timed_steps(module: Any, batch: tuple[Any, ...], lr: float) -> tuple[list[float], list[float]]:
    """Two SGD-with-momentum steps: each loss and each step's seconds (serial and parallel alike)."""
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    losses, steps = [], []
    for _ in range(2):
        start = time.perf_counter()
        opt.zero_grad()
        loss = module(*batch)
        loss.backward()
        opt.step()
        steps.append(time.perf_counter() - start)
        losses.append(float(loss))
    return losses, steps


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rss_now() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def serial_reference(config: GPTConfig, batch: tuple[torch.Tensor, ...], directory: Path, lr: float) -> dict[str, Any]:
    """Build, save and train the serial model: the checkpoint and the losses to match."""
    start = time.perf_counter()
    torch.manual_seed(0)
    model = GPT(config)
    built = time.perf_counter() - start
    save_model(model, str(directory / "model.safetensors"))  # tied weights written once
    losses, steps = _two_timed_steps(model, batch, lr)
    params = sum(p.numel() for p in model.parameters())
    return {"losses": losses, "params": params, "build_s": built, "step_s": steps, "peak_rss": _rss_peak()}


def _saved_bytes(program: Any) -> int:
    """The bytes of the activations a parallel module's program saves for its backward."""
    out = next(n for n in program.forward.graph.nodes if n.op == "output")
    saved = list(out.args[0])[len(program.output_layouts) :]
    return sum(
        n.meta["val"].numel() * n.meta["val"].element_size()
        for n in saved
        if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)
    )


def _rank(rank: int, world_size: int, config: GPTConfig, batch: tuple[torch.Tensor, ...], shape: tuple[int, ...],
          directory: str, load: bool, lr: float, pp: int = 0, microbatches: int = 2,
          mmap_threshold: int = 0) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    if mmap_threshold:  # a fixed threshold: glibc then unmaps every freed block above it (module doc)
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, mmap_threshold)
    if pp:
        names = ("pp", *(f"t{i}" for i in range(len(shape))))
        mesh = init_device_mesh("cpu", (pp, *shape), mesh_dim_names=names)
    else:
        mesh = init_device_mesh("cpu", shape)
    baseline = _rss_now()  # torch imported, the job joined: the runtime's fixed overhead
    with torch.device("meta"):
        model = GPT(config)
    torch.manual_seed(0)
    start = time.perf_counter()
    pipeline = autopar.PipelineOptions(microbatches=microbatches, schedule="1f1b") if pp else None
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch, pipeline=pipeline)
    parallelize_s = time.perf_counter() - start
    if mmap_threshold:  # parallelize keeps CPU ranks' freed blocks (core.host_memory.keep_step_heap): this run's choice stands
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
        libc.mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD)
    parallelize_peak = _rss_peak()  # the peak so far: planning, compiling, initializing
    load_s = 0.0
    if load:
        start = time.perf_counter()
        autopar.load_checkpoint(pmodel, directory)
        load_s = time.perf_counter() - start
    after_load = _rss_now()
    losses, steps = _two_timed_steps(pmodel, batch, lr)
    local = sum(p.to_local().numel() * p.element_size() for p in pmodel.parameters())
    if pp:  # its stages' saved activations per microbatch, times the microbatches kept in flight
        in_flight = simulate(pmodel.schedule).peak_in_flight[pmodel.rank]
        parallel = pmodel.__dict__["stage_parallel"]
        activations = in_flight * sum(_saved_bytes(parallel[s].program) for s in pmodel.stages)
    else:
        activations = _saved_bytes(pmodel.program)
    gc.collect()
    return {
        "rank": rank,
        "stages": list(pmodel.stages) if pp else [],
        "losses": losses,
        "parallelize_s": parallelize_s,
        "load_s": load_s,
        "step_s": steps,
        "baseline_rss": baseline,
        "after_load_rss": after_load,
        "parallelize_peak_rss": parallelize_peak,
        "peak_rss": _rss_peak(),
        "modeled": {"params": local, "grads": local, "momentum": local, "activations": activations},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=20)
    parser.add_argument("--n-embd", type=int, default=2048)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--mesh", default="2,2,2")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--name", default="large_model")
    parser.add_argument("--pp", type=int, default=0, help="pipeline stages: the mesh becomes (pp, *mesh)")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--starts", default="checkpoint,init", help="which starts to run: checkpoint, init")
    parser.add_argument("--mmap-threshold-kib", type=int, default=128,
                        help="fix glibc's mmap threshold in the ranks (0: glibc's own, rising with what is freed)")
    args = parser.parse_args()
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    shape = tuple(int(s) for s in args.mesh.split(","))
    batch = gpt_batch(config, args.batch, torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as directory:
        # the serial reference runs in its own process, so its memory is gone before the job starts
        (serial,) = run_ranks(1, _serial_job, config, batch, directory, args.lr, timeout=3600)
        runs = {}
        for mode in args.starts.split(","):
            ranks = run_ranks(
                max(args.pp, 1) * int(torch.tensor(shape).prod()), _rank, config, batch, shape, directory,
                mode == "checkpoint", args.lr, args.pp, args.microbatches, args.mmap_threshold_kib * 1024, timeout=3600,
            )  # fmt: skip
            runs[mode] = ranks
    result = {"config": vars(args), "serial": serial, "runs": runs, "environment": environment()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    print(table(result))


def _serial_job(rank: int, world_size: int, config: GPTConfig, batch: tuple[torch.Tensor, ...], directory: str,
                lr: float) -> dict[str, Any]:
    torch.set_num_threads(2)
    return serial_reference(config, batch, Path(directory), lr)


def table(result: dict[str, Any]) -> str:
    serial = result["serial"]
    config = result["config"]
    mesh = f"pp={config['pp']} x ({config['mesh']}), {config['microbatches']} microbatches" if config.get("pp") else config["mesh"]
    lines = [
        f"GPT of {serial['params'] / 1e9:.2f} B parameters ({serial['params'] * 4 / GiB:.1f} GiB fp32), "
        f"mesh {mesh}; serial losses {serial['losses']}, serial peak RSS "
        f"{serial['peak_rss'] / GiB:.1f} GiB, serial step {max(serial['step_s']):.1f} s",
        "",
        "| start | rank | modeled share GiB (params+grads+momentum+activations) | fixed GiB | peak RSS GiB | "
        "peak / (1.5 x share + fixed) | parallelize s | load s | steps s | losses equal serial |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, ranks in result["runs"].items():
        for r in ranks:
            share = sum(r["modeled"].values())
            bound = 1.5 * share + r["baseline_rss"]
            equal = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(r["losses"], serial["losses"]))
            rank = f"{r['rank']} (stage {', '.join(map(str, r['stages']))})" if r.get("stages") else str(r["rank"])
            lines.append(
                f"| {mode} | {rank} | {share / GiB:.2f} | {r['baseline_rss'] / GiB:.2f} | {r['peak_rss'] / GiB:.2f} | "
                f"{r['peak_rss'] / bound:.2f} | {r['parallelize_s']:.0f} | {r['load_s']:.1f} | "
                f"{', '.join(f'{s:.1f}' for s in r['step_s'])} | {equal} ({', '.join(f'{x:.6f}' for x in r['losses'])}) |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
