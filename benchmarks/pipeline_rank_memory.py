"""Where a pipelined rank's memory goes, phase by phase, against what its stage's plan models
(docs/pipeline.md#a-pipelined-ranks-memory).

The GPT of benchmarks/large_model.py, smaller, built on meta and pipelined on gloo ranks
(pp=2 x `--mesh`, 1F1B over 2 microbatches), loads a safetensors checkpoint and trains two
SGD-with-momentum steps. Each rank records, after building the meta model, after `parallelize`,
after loading and during and after each step:

- its RSS (and the peak so far), malloc's bytes in use (`mallinfo2`: torch's CPU tensors live
  there; tracemalloc sees none of them) and the RSS left after `gc.collect()` and `malloc_trim(0)`
  (what the allocator kept without using it);
- the bytes of every live CPU tensor storage the garbage collector can find, split into the
  module's parameters, `.grad`s, the optimizer's state and the rest, and the fx GraphModules alive;
- at the step's peak (a 2 ms sampler of malloc's bytes in use) and after it.

Beside them, the stage's plan as the compiler modeled it (`SearchReport.memory`: stored
parameters, gradients, optimizer state counted as AdamW's two states, saved activations times the
microbatches in flight) and `planning.memory.plan_memory`'s parts.

    python benchmarks/pipeline_rank_memory.py                          # 4 ranks, ~3 minutes
    python benchmarks/pipeline_rank_memory.py --n-layer 4 --n-embd 1536 --mesh 2 --name x

Writes benchmarks/results/<name>.json and a table per stage (its first rank) on stdout.
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
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from _common import RESULTS, ROOT, environment
from pipeline_step_memory import _Sampler, in_use
from safetensors.torch import save_model

sys.path.insert(0, str(ROOT / "tests"))
from multirank import run_ranks  # noqa: E402

import autopar  # noqa: E402
import autopar.compiler.build as build  # noqa: E402
from examples.models import GPT, GPTConfig, gpt_batch  # noqa: E402

MiB = 1024**2
M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
_libc = ctypes.CDLL("libc.so.6")


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _local(t: Any) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to_local() if hasattr(t, "to_local") else t


def _storages(tensors: Any) -> dict[int, int]:
    """data_ptr -> bytes of each distinct CPU storage under `tensors`."""
    out: dict[int, int] = {}
    for t in tensors:
        t = _local(t)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def _live(pmodel: Any, opt: Any) -> dict[str, Any]:
    """Every CPU tensor storage the collector reaches, by what holds it, and the GraphModules alive."""
    found: dict[int, int] = {}
    modules = 0
    with warnings.catch_warnings():  # isinstance on torch's deprecated aliases warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    found.update(_storages([obj]))
                elif isinstance(obj, fx.GraphModule):
                    modules += 1
            except Exception:  # a fake or meta tensor's storage, a tensor subclass without one
                continue
    params = _storages(pmodel.parameters()) if pmodel is not None else {}
    grads = _storages(p.grad for p in pmodel.parameters()) if pmodel is not None else {}
    state = _storages(v for s in opt.state.values() for v in s.values()) if opt is not None else {}
    named = set(params) | set(grads) | set(state)
    return {
        "tensors": sum(found.values()),
        "params": sum(params.values()),
        "grads": sum(grads.values()),
        "optimizer": sum(state.values()),
        "other_tensors": sum(b for p, b in found.items() if p not in named),
        "graph_modules": modules,
    }


def _phase(label: str, pmodel: Any = None, opt: Any = None, peak_in_use: int | None = None) -> dict[str, Any]:
    row = {"phase": label, "rss": _rss(), "peak_rss": _peak(), "in_use": in_use()}
    if peak_in_use is not None:
        row["peak_in_use"] = peak_in_use
    row.update(_live(pmodel, opt))
    gc.collect()
    _libc.malloc_trim(0)
    row["rss_trimmed"] = _rss()
    row["in_use_trimmed"] = in_use()
    return row


def _rank(rank: int, world_size: int, config: GPTConfig, batch: tuple[torch.Tensor, ...], shape: tuple[int, ...],
          directory: str, memory_limit: float | None, mmap_threshold: int | None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    if mmap_threshold is not None:  # a fixed threshold: every block above it is mmapped and unmapped when freed
        _libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
    reports: list[Any] = []
    compile_for_rank = build.compile_for_rank

    def recording(*args: Any, **kwargs: Any) -> Any:  # the stage's search report: its modeled memory
        compiled = compile_for_rank(*args, **kwargs)
        reports.append(compiled.graph.meta.get("autopar_search"))
        return compiled

    build.compile_for_rank = recording  # type: ignore[assignment]
    names = ("pp", *(f"t{i}" for i in range(len(shape))))
    mesh = init_device_mesh("cpu", (2, *shape), mesh_dim_names=names)
    phases = [_phase("joined (torch, gloo)")]
    with torch.device("meta"):
        model = GPT(config)
    phases.append(_phase("model built on meta"))
    torch.manual_seed(0)
    pipeline = autopar.PipelineOptions(microbatches=2, schedule="1f1b")
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch, pipeline=pipeline, memory_limit=memory_limit)
    build.compile_for_rank = compile_for_rank  # type: ignore[assignment]
    phases.append(_phase("parallelize", pmodel))
    autopar.load_checkpoint(pmodel, directory)
    phases.append(_phase("load_checkpoint", pmodel))
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.01, momentum=0.9)
    sampler = _Sampler()
    losses = []
    seconds = []
    for step in range(2):
        sampler.reset()
        start = time.perf_counter()
        opt.zero_grad()
        loss = pmodel(*batch)
        loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        phases.append(_phase(f"step {step + 1}", pmodel, opt, peak_in_use=sampler.peak))
        del loss
    sampler.stop()
    modeled = [
        {"memory": r.memory, "regathered": len(r.regathered), "recomputed": len(r.recomputed)}
        for r in reports if r is not None
    ]  # fmt: skip
    return {"rank": rank, "stages": list(pmodel.stages), "losses": losses, "phases": phases, "modeled": modeled,
            "step_s": seconds}  # fmt: skip


def _serial(rank: int, world_size: int, config: GPTConfig, directory: str) -> int:
    torch.manual_seed(0)
    model = GPT(config)
    save_model(model, str(Path(directory) / "model.safetensors"))
    return sum(p.numel() for p in model.parameters())


def table(result: dict[str, Any], rank: int) -> str:
    r = result["ranks"][rank]
    modeled = ", ".join(f"{m['memory'] / MiB:.0f} MiB ({m['regathered']} regathered)" for m in r["modeled"])
    lines = [
        f"rank {rank} (stage {r['stages']}); modeled by its stage's plan: {modeled}; steps "
        f"{', '.join(f'{s:.1f}' for s in r['step_s'])} s; MiB",
        "",
        "| phase | RSS | peak RSS | malloc in use (peak) | RSS after gc + malloc_trim | live tensors | params | "
        ".grad | optimizer | other tensors | GraphModules |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in r["phases"]:
        peak = f" ({p['peak_in_use'] / MiB:.0f})" if "peak_in_use" in p else ""
        lines.append(
            f"| {p['phase']} | {p['rss'] / MiB:.0f} | {p['peak_rss'] / MiB:.0f} | {p['in_use'] / MiB:.0f}{peak} | "
            f"{p['rss_trimmed'] / MiB:.0f} | {p['tensors'] / MiB:.0f} | {p['params'] / MiB:.0f} | "
            f"{p['grads'] / MiB:.0f} | {p['optimizer'] / MiB:.0f} | {p['other_tensors'] / MiB:.0f} | "
            f"{p['graph_modules']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--mesh", default="2", help="the tensor axes beside pp=2")
    parser.add_argument("--memory-limit-mib", type=float, default=None, help="parallelize's memory_limit")
    parser.add_argument("--mmap-threshold-kib", type=int, default=None, help="fix malloc's mmap threshold (mallopt)")
    parser.add_argument("--name", default="pipeline_rank_memory")
    args = parser.parse_args()
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    shape = tuple(int(s) for s in args.mesh.split(","))
    batch = gpt_batch(config, args.batch, torch.Generator().manual_seed(1))
    limit = None if args.memory_limit_mib is None else args.memory_limit_mib * MiB
    threshold = None if args.mmap_threshold_kib is None else args.mmap_threshold_kib * 1024
    with tempfile.TemporaryDirectory() as directory:
        (params,) = run_ranks(1, _serial, config, directory, timeout=600)
        ranks = run_ranks(2 * int(torch.tensor(shape).prod()), _rank, config, batch, shape, directory, limit, threshold,
                          timeout=3600)  # fmt: skip
    result = {"config": vars(args), "params": params, "ranks": ranks, "environment": environment()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    print(f"GPT of {params / 1e6:.1f} M parameters; losses {ranks[0]['losses']}")
    for rank in (0, len(ranks) // 2):  # each stage's first rank: it plans the stage
        print()
        print(table(result, rank))


if __name__ == "__main__":
    main()
