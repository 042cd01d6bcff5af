"""Shared helpers for the benchmarks: a staged `compile_for_rank` with per-stage wall times, meshes,
meta-device model construction, and result writing. Benchmarks are measurements, not tests."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import product
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autopar.api import Compiled
from autopar.mesh import Mesh
from autopar.passes.emit import emit
from autopar.passes.insert_comm import insert_comm
from autopar.passes.propagate import propagate
from autopar.passes.schedule import schedule
from autopar.passes.trace import trace
from autopar.planner import choose_layouts
from autopar.report import build_report
from autopar.rules.registry import default_registry
from autopar.search import search_layouts

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
if str(ROOT) not in sys.path:  # `examples` is a plain directory at the repository root
    sys.path.insert(0, str(ROOT))

STAGES = ("trace", "plan", "propagate", "insert_comm", "schedule", "emit", "report")
PLANNERS: dict[str, Callable[..., Any]] = {"greedy": choose_layouts, "search": search_layouts}


def staged_compile(
    model: nn.Module, mesh: Mesh, example_inputs: Sequence[Any], planner: str = "greedy"
) -> tuple[Compiled, dict[str, float]]:
    """`autopar.api.compile_for_rank` for the rank at coords (0, ...), stage by stage, timed.

    Same calls in the same order as compile_for_rank (without dumps); "plan" is the planner
    (`choose_layouts` or `search_layouts`), "propagate" only records its plan in node metadata.
    """
    times: dict[str, float] = {}
    coords = (0,) * mesh.ndim
    registry = default_registry()

    def timed(stage: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        times[stage] = time.perf_counter() - start
        return out

    gm = timed("trace", lambda: trace(model, example_inputs, decompose=mesh.size > 1))
    plan = timed("plan", lambda: PLANNERS[planner](gm, mesh, registry))
    gm = timed("propagate", lambda: propagate(gm, mesh, registry, choose=lambda *_: plan))
    gm = timed("insert_comm", lambda: insert_comm(gm, mesh, coords))
    gm = timed("schedule", lambda: schedule(gm))
    program = timed("emit", lambda: emit(gm, mesh, registry, coords))
    report = timed("report", lambda: build_report(program, mesh, gm.meta.get("autopar_schedule")))
    times["total"] = sum(times.values())
    return Compiled(gm, program, report), times


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
