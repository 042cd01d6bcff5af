"""Shared helpers of the probes: a user's view of autopar beside the serial model.

Run under torchrun (gloo, CPU). Each probe builds a serial model and a parallel one from the same
seed, feeds both the same batches and compares loss, every gradient, parameters and buffers.
timm needs torchvision at import time, and PyPI has only its CUDA build, whose extension cannot
load on a CPU-only torch: install both into a folder of their own (`pip install --no-deps --target
DIR timm torchvision==0.28.0`; in site-packages transformers then finds torchvision and fails to
import), put DIR on PYTHONPATH and set TV_SHIM=1 (probe/tv_shim.py).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor


def setup(shape: tuple[int, ...] | None = None) -> DeviceMesh:
    """Initialize gloo and a mesh of all ranks (default: 1-D of the world size, or MESH=2,2)."""
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if shape is None and os.environ.get("MESH"):
        shape = tuple(int(n) for n in os.environ["MESH"].split(","))
    shape = shape or (world,)
    names = ("x", "y", "z", "w")[: len(shape)]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def say(*args: object) -> None:
    if rank() == 0:
        print(*args, flush=True)


def full(t: object) -> torch.Tensor | None:
    if t is None:
        return None
    if isinstance(t, DTensor):
        return t.full_tensor()
    assert isinstance(t, torch.Tensor)
    return t


def maxdiff(a: object, b: object) -> float:
    fa, fb = full(a), full(b)
    if fa is None or fb is None:
        return 0.0 if fa is None and fb is None else float("inf")
    if fa.shape != fb.shape:
        return float("inf")
    return (fa.double() - fb.double()).abs().max().item() if fa.numel() else 0.0


def compare(serial: torch.nn.Module, pmodel: torch.nn.Module, tag: str, tol: float,
            grads: bool = True) -> float:
    """Max abs difference over parameters (and gradients, and buffers); prints the worst."""
    pp = dict(pmodel.named_parameters())
    sp = dict(serial.named_parameters())
    worst, where = 0.0, ""
    missing = sorted(set(sp) ^ set(pp))
    if missing:
        say(f"[{tag}] parameter names differ: {missing[:6]}")
        worst = float("inf")
    for name, p in sp.items():
        if name not in pp:
            continue
        d = maxdiff(p, pp[name])
        if d > worst:
            worst, where = d, f"param {name}"
        if grads:
            d = maxdiff(p.grad, pp[name].grad)
            if d > worst:
                worst, where = d, f"grad {name}"
    pb = dict(pmodel.named_buffers())
    for name, b in serial.named_buffers():
        if name in pb and b.is_floating_point():
            d = maxdiff(b, pb[name])
            if d > worst:
                worst, where = d, f"buffer {name}"
    status = "OK" if worst <= tol else "MISMATCH"
    say(f"[{tag}] max abs diff {worst:.3e} at {where or '-'} (tol {tol:g}) {status}")
    return worst


class Timer:
    def __enter__(self) -> Timer:
        self.cpu, self.wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu = time.process_time() - self.cpu
        self.wall = time.perf_counter() - self.wall


def batches(n: int, make) -> Iterator:
    g = torch.Generator().manual_seed(1234)
    for _ in range(n):
        yield make(g)


def finish(ok: bool) -> None:
    say("PROBE RESULT:", "PASS" if ok else "FAIL")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
