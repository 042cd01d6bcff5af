"""Where a pipelined training step's memory goes, action by action (docs/large-models.md#pipelined-pp2-x-22).

The GPT of benchmarks/large_model.py, built on meta and pipelined on gloo ranks (pp=2 x `--mesh`,
default (2,2): 8 ranks; 1F1B), trains two SGD-with-momentum steps. Each rank records the bytes glibc's malloc has handed
out and not taken back (`mallinfo2`: torch's CPU tensors live there, so this is the live tensor
bytes plus the interpreter's, without the freed-but-kept pages an RSS counts) before and after
every schedule action of the second step, and the most it reached during the action (a sampler
thread, every 2 ms; torch releases the GIL in its kernels). Beside it: the bytes of the step's
accumulated unreduced gradients, of the sends not yet waited, of the parameters' `.grad`s and of
the optimizer's momentum. Tracemalloc sees none of torch's allocations, hence malloc's own count.

    python benchmarks/pipeline_step_memory.py                         # n_embd 1024: ~4 minutes
    python benchmarks/pipeline_step_memory.py --n-embd 2048 --name pipeline_step_memory_032b
    python benchmarks/pipeline_step_memory.py --n-layer 4 --mesh 2 --memory-limit-mib 335 --name pipeline_step_memory_proxy

Writes benchmarks/results/<name>.json and one table per stage (its first rank) on stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import threading
import time
import weakref
from typing import Any

import torch
from _common import RESULTS, ROOT, environment

sys.path.insert(0, str(ROOT / "tests"))
from multirank import run_ranks  # noqa: E402

import autopar  # noqa: E402
import autopar.runtime.defer_reduction as defer_reduction  # noqa: E402
import autopar.runtime.pipeline_runtime as pipeline_runtime  # noqa: E402
from examples.models import GPT, GPTConfig, gpt_batch  # noqa: E402

MiB = 1024**2


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def in_use() -> int:
    """Bytes malloc has handed out and not taken back: its arenas' chunks in use plus mmapped ones."""
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _Sampler:
    """The most `in_use()` reached since the last `reset`, sampled every 2 ms on a thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, in_use())
            time.sleep(0.002)

    def reset(self) -> int:
        self.peak = in_use()
        return self.peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _rank(rank: int, world_size: int, config: GPTConfig, batch: tuple[torch.Tensor, ...], microbatches: int,
          shape: tuple[int, ...] = (2, 2), memory_limit: float | None = None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    names = ("pp", *(f"t{i}" for i in range(len(shape))))
    mesh = init_device_mesh("cpu", (2, *shape), mesh_dim_names=names)
    with torch.device("meta"):
        model = GPT(config)
    torch.manual_seed(0)
    pipeline = autopar.PipelineOptions(microbatches=microbatches, schedule="1f1b")
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch, pipeline=pipeline, memory_limit=memory_limit)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.01, momentum=0.9)
    params = list(pmodel.parameters())
    sampler = _Sampler()
    # the step's accumulations and its schedule, held weakly: a strong reference would keep the
    # step's gradients alive beside `.grad`, so autograd would copy them at `loss.backward()` (it
    # takes a gradient as `.grad` only where nothing else holds it) and the table would show a copy
    # that a user's step never makes
    sums: list[weakref.ref[Any]] = []
    steps: list[list[dict[str, Any]]] = []
    record: list[dict[str, Any]] | None = None
    step_state: dict[str, Any] = {}

    def snapshot(label: str, before: int) -> None:
        if record is None:
            return
        step = step_state["step"]() if "step" in step_state else None
        accumulations = [acc for acc in (ref() for ref in sums) if acc is not None]
        record.append({
            "action": label,
            "before": before,
            "peak": max(sampler.peak, in_use()),
            "after": in_use(),
            "accumulated": sum(_bytes(a.sums) for acc in accumulations for a in acc.by_program.values()),
            "sends": _bytes(d for _, d in step.sends) if step is not None else 0,
            "kept": len(step.kept) if step is not None else 0,
            "grads": _bytes(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None),
            "momentum": _bytes(s["momentum_buffer"].to_local() for s in opt.state.values() if "momentum_buffer" in s),
        })  # fmt: skip

    original_do = pipeline_runtime._Step.do
    original_init = pipeline_runtime._Step.__init__
    original_add = defer_reduction.GradAccumulation.add

    def do(self: Any, action: Any) -> None:
        before = sampler.reset()
        original_do(self, action)
        snapshot(str(action), before)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        step_state["step"] = weakref.ref(self)

    def add(self: Any, *args: Any, **kwargs: Any) -> None:
        if not any(ref() is self for ref in sums):
            sums.append(weakref.ref(self))
        original_add(self, *args, **kwargs)

    pipeline_runtime._Step.do = do  # type: ignore[method-assign]
    pipeline_runtime._Step.__init__ = init  # type: ignore[method-assign]
    defer_reduction.GradAccumulation.add = add  # type: ignore[method-assign]
    losses = []
    for _ in range(2):
        record = []
        steps.append(record)
        before = sampler.reset()
        snapshot("start", before)
        opt.zero_grad()
        before = sampler.reset()
        loss = pmodel(*batch)  # the whole schedule, then the reduction and the shared sums
        snapshot("call returned", before)
        before = sampler.reset()
        loss.backward()  # hands the gradients to the parameters
        snapshot("loss.backward", before)
        before = sampler.reset()
        opt.step()
        snapshot("opt.step", before)
        losses.append(float(loss.detach()))
        sums.clear()
        step_state.clear()
    sampler.stop()
    return {"rank": rank, "stages": list(pmodel.stages), "losses": losses, "steps": steps,
            "params": _bytes(p.to_local() for p in params)}  # fmt: skip


def table(result: dict[str, Any], rank: int) -> str:
    r = result["ranks"][rank]
    lines = [
        f"rank {rank} (stage {r['stages']}), second step; params {r['params'] / MiB:.0f} MiB; MiB of malloc's live bytes",
        "",
        "| action | before | peak during | after | accumulated grads | sends pending | kept microbatches | .grad | momentum |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for a in r["steps"][1]:
        lines.append(
            f"| {a['action']} | {a['before'] / MiB:.0f} | {a['peak'] / MiB:.0f} | {a['after'] / MiB:.0f} | "
            f"{a['accumulated'] / MiB:.0f} | {a['sends'] / MiB:.1f} | {a['kept']} | {a['grads'] / MiB:.0f} | "
            f"{a['momentum'] / MiB:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--mesh", default="2,2", help="the tensor axes beside pp=2")
    parser.add_argument("--memory-limit-mib", type=float, default=None, help="parallelize's memory_limit")
    parser.add_argument("--name", default="pipeline_step_memory")
    args = parser.parse_args()
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    batch = gpt_batch(config, args.batch, torch.Generator().manual_seed(1))
    shape = tuple(int(s) for s in args.mesh.split(","))
    limit = None if args.memory_limit_mib is None else args.memory_limit_mib * MiB
    ranks = run_ranks(2 * math.prod(shape), _rank, config, batch, args.microbatches, shape, limit, timeout=3600)
    result = {"config": vars(args), "ranks": ranks, "environment": environment()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    print(f"losses {ranks[0]['losses']}")
    print(table(result, 0))
    print()
    print(table(result, len(ranks) // 2))


if __name__ == "__main__":
    main()
