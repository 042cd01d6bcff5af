"""The default memory limit of a CPU rank (autopar/core/host_memory.py): its share of the machine
less the runtime's fixed reserve, one number in `parallelize` (`api.default_memory_limit`) and in
`autopar.plan` (the cpu-gloo table's `rank_memory`, which the in-flight budget, the search and the
pipeline cut read), so both plan under one limit."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import autopar
from autopar.api import default_memory_limit
from autopar.core import host_memory
from autopar.core.host_memory import RUNTIME_RESERVE, cpu_rank_memory, return_freed_memory
from autopar.cost.hardware import load_hardware
from autopar.passes.trace import trace
from autopar.planning.memory import MEMORY_HEADROOM
from autopar.planning.search_cost import TimeCost
from autopar.planning.search_fit import default_memory_limit as search_default_limit
from autopar.planning.stage_cut import cut_graph
from autopar.planning.stage_units import stage_graph
from autopar.runtime.device_memory import machine_memory, rank_memory
from examples.models import make_gpt

MiB = 1024**2
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_parallelize_and_plan_default_to_one_cpu_limit_without_the_runtime_reserve(
    ranks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    machine = machine_memory()
    # the reserve (the runtime: torch, gloo, the interpreter) is subtracted from each rank's share
    assert rank_memory("cpu") == machine / ranks - RUNTIME_RESERVE
    parallelize_limit = default_memory_limit("cpu")
    assert parallelize_limit == MEMORY_HEADROOM * (machine / ranks - RUNTIME_RESERVE)
    # what autopar.plan(device_type="cpu") plans under: the cpu-gloo table, for this machine
    table = dataclasses.replace(load_hardware("cpu-gloo"), memory_capacity=machine)
    assert MEMORY_HEADROOM * table.rank_memory(ranks) == parallelize_limit
    assert search_default_limit(TimeCost(table, (ranks,))) == parallelize_limit
    # a table of a device's own memory keeps all of it: the reserve is the CPU processes'
    h100 = load_hardware("h100-nvlink-ib")
    assert h100.rank_memory(ranks) == h100.memory_capacity


@pytest.mark.parametrize(
    "how", [{"device_type": "cpu"}, {"planning": autopar.PlanOptions(hardware="cpu-gloo")}], ids=["cpu", "cpu-table"]
)
def test_plan_on_cpu_searches_under_the_limit_parallelize_gives_its_ranks(
    how: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`autopar.plan` for CPU ranks (the device type, or a CPU table on the default "cuda") counts
    this machine's memory as `parallelize` on its ranks does, not the table's recorded figure."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # a planning process: one rank of its own
    model, batch = make_gpt(0, n_layer=1)
    planned = autopar.plan(model, (2,), batch, mesh_names=("x",), **how)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # a rank of the 2-rank job parallelize runs on
    assert planned.compiled.graph.meta["autopar_search"].memory_limit == default_memory_limit("cpu")


def test_the_reserve_is_what_a_joined_rank_holds_in_the_benchmark_it_cites() -> None:
    """`RUNTIME_RESERVE` against its source: the RSS of every rank of
    `benchmarks/pipeline_rank_memory.py` once it has joined the job, before any model exists."""
    result = json.loads((RESULTS / "pipeline_rank_memory.json").read_text())
    joined = [r["phases"][0] for r in result["ranks"]]
    assert {p["phase"] for p in joined} == {"joined (torch, gloo)"}
    rss = sorted(p["rss"] for p in joined)
    assert rss[0] * 0.97 <= RUNTIME_RESERVE <= rss[-1] * 1.03, [round(b / MiB) for b in rss]


def test_a_share_smaller_than_the_reserve_leaves_nothing() -> None:
    assert cpu_rank_memory(4 * RUNTIME_RESERVE, 8) == 0.0
    assert cpu_rank_memory(4 * RUNTIME_RESERVE, 2) == RUNTIME_RESERVE
    assert cpu_rank_memory(4 * RUNTIME_RESERVE, 0) == 3 * RUNTIME_RESERVE  # no ranks known: the machine's


def test_a_pipeline_cut_on_the_cpu_table_defaults_to_a_ranks_share_less_the_reserve() -> None:
    """`autopar.plan`'s pipeline depths (`cut_graph` without a limit) count a CPU rank's share of
    the machine, as `parallelize` passes it, not the whole machine."""
    model, batch = make_gpt(0, n_layer=2)
    graph = stage_graph(trace(model, batch, decompose=True), "cpu-gloo", 2)
    cut = cut_graph(graph, pp=2, microbatches=2)
    table = load_hardware("cpu-gloo")
    assert cut.memory_limit == MEMORY_HEADROOM * (table.memory_capacity / 4 - RUNTIME_RESERVE)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        match = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match is not None
    return int(match.group(1)) / 1024


@pytest.mark.skipif(
    not Path("/proc/self/status").exists() or not hasattr(ctypes.CDLL(None), "malloc_trim"),
    reason="glibc on Linux: malloc_trim and /proc/self/status",
)
def test_what_a_compile_frees_goes_back_to_the_system_not_kept_resident() -> None:
    # 64 MiB in blocks below malloc's mmap threshold come from its heap; a block allocated after
    # them keeps the freed run away from the heap's top, where free() alone would give it back
    blocks = [bytearray(64 * 1024) for _ in range(1024)]
    pin = bytearray(64 * 1024)
    del blocks
    resident = _rss_mib()
    return_freed_memory()  # what parallelize calls before it returns
    assert resident - _rss_mib() > 32
    del pin


# A step in a fresh process: a freed 12 MiB block slides glibc's mmap threshold to 12 MiB (and its
# trim threshold to 24), then each step allocates three 11 MiB buffers at the heap's top and frees
# them; prints the minor page faults of the last of 4 steps. host_memory is loaded from its file
# (it imports only the standard library), not through autopar, which would import torch.
_STEPS = """
import importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("host_memory", sys.argv[1])
host_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_memory)
big = bytearray(12 << 20)
del big
if sys.argv[2] == "cpu":
    host_memory.return_freed_memory(cpu_ranks=True)
for _ in range(4):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step = [bytearray(11 << 20) for _ in range(3)]
    del step
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
"""


def _faults_per_step(ranks: str, **env: str) -> int:
    environment = {k: v for k, v in os.environ.items() if k not in host_memory.MALLOC_ENVIRONMENT} | env
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, host_memory.__file__, ranks],
        env=environment, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="glibc's mallopt")
def test_a_cpu_ranks_step_keeps_its_freed_buffers_instead_of_faulting_them_in_every_step() -> None:
    """The heap's top given back and faulted in again every step (33 MiB: ~8400 pages) unless
    `parallelize` fixed the thresholds for CPU ranks; a user's MALLOC_* environment stands."""
    pages = 3 * (11 << 20) // 4096
    assert _faults_per_step("default") > pages // 2
    assert _faults_per_step("cpu") < pages // 50
    assert _faults_per_step("cpu", MALLOC_TRIM_THRESHOLD_="131072") > pages // 2
