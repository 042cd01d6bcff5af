"""Shared helpers for the benchmarks: `compile_for_rank` with per-stage wall and CPU times, meshes,
meta-device model construction, and result writing. Benchmarks are measurements, not tests."""

from __future__ import annotations

import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import product
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import autopar.compiler.driver as driver
import autopar.compiler.lowering as lowering
from autopar.compiler.driver import Compiled
from autopar.core.mesh import Mesh

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
if str(ROOT) not in sys.path:  # `examples` is a plain directory at the repository root
    sys.path.insert(0, str(ROOT))

STAGES = ("trace", "plan", "propagate", "insert_comm", "schedule", "emit", "report")
# The functions compile_for_rank calls, by the stage they are timed under.
_STAGE_OF = {
    "trace": "trace",
    "choose_layouts": "plan",
    "search_layouts": "plan",
    "fit_memory": "plan",
    "propagate": "propagate",
    "insert_comm": "insert_comm",
    "regather": "insert_comm",
    "recompute": "insert_comm",
    "schedule_pass": "schedule",
    "emit": "emit",
    "build_report": "report",
}
# What torch imports on the first trace (torch.export pulls in dynamo): import time, not compile time.
LAZY_IMPORTS = ("torch.export._trace", "torch._functorch.aot_autograd")


def import_lazy_modules() -> tuple[float, float]:
    """Import what the first trace would import lazily; (wall, CPU) seconds it took."""
    wall, cpu = time.perf_counter(), time.process_time()
    for name in LAZY_IMPORTS:
        importlib.import_module(name)
    return time.perf_counter() - wall, time.process_time() - cpu


def staged_compile(
    model: nn.Module, mesh: Mesh, example_inputs: Sequence[Any], planner: str = "greedy", **options: Any
) -> tuple[Compiled, dict[str, float]]:
    """`autopar.compiler.driver.compile_for_rank` for the rank at coords (0, ...), timed stage by stage.

    The stage functions compile_for_rank calls are wrapped with timers for the duration of the
    call, so this measures compile_for_rank itself, whatever it does between the stages (`other`).
    `options` go to compile_for_rank (split_fused=...). Returns wall seconds per stage and `total`, and CPU seconds under `cpu_<stage>` and `cpu_total`
    (the machine is shared: CPU time is what the compile itself spent). No dumps are written.
    """
    wall = dict.fromkeys(STAGES, 0.0)
    cpu = dict.fromkeys(STAGES, 0.0)
    # (each where compile_for_rank calls it: the driver, or `compiler.lowering` for the passes
    # between the plan and the schedule)
    originals = {
        (module, name): getattr(module, name) for name in _STAGE_OF for module in (driver, lowering) if hasattr(module, name)
    }

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        stage = _STAGE_OF[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall[stage] += time.perf_counter() - w
                cpu[stage] += time.process_time() - c

        return wrapper

    dump = os.environ.pop("AUTOPAR_DUMP_DIR", None)
    for (module, name), fn in originals.items():
        setattr(module, name, timed(name, fn))
    try:
        w, c = time.perf_counter(), time.process_time()
        compiled = driver.compile_for_rank(
            model, mesh, example_inputs, coords=(0,) * mesh.ndim, planner=planner, **options
        )
        total_wall, total_cpu = time.perf_counter() - w, time.process_time() - c
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
        if dump is not None:
            os.environ["AUTOPAR_DUMP_DIR"] = dump
    times = dict(wall)
    times["other"] = total_wall - sum(wall.values())
    times["total"] = total_wall
    times.update({f"cpu_{s}": v for s, v in cpu.items()})
    times["cpu_total"] = total_cpu
    return compiled, times


def factorizations(p: int, ndim: int = 3) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of `ndim` positive ints whose product is p."""
    divisors = [d for d in range(1, p + 1) if p % d == 0]
    for head in product(divisors, repeat=ndim - 1):
        if p % math.prod(head) == 0:
            yield (*head, p // math.prod(head))


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """Build a model without allocating its weights (the tracer clones it onto fake tensors)."""
    with torch.device("meta"):
        return build()


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }


class RunClock:
    """When a benchmark run started and the machine's load then; `record()` is what the JSON keeps
    of both at the end (the machine is shared: the load says how much to trust wall times)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.load_before = os.getloadavg()

    def record(self) -> dict[str, Any]:
        return {
            "load_average_before_after": [self.load_before, os.getloadavg()],
            "elapsed_s": time.perf_counter() - self.started,
        }


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "environment": environment(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (also readable in a terminal)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def git_state() -> dict[str, Any]:
    """The commit measured and the autopar files that differed from it (read-only git calls)."""

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return run.stdout.rstrip("\n")

    return {
        "head": git("rev-parse", "HEAD"),
        "autopar_changed": git("status", "--porcelain", "autopar").splitlines(),
    }
