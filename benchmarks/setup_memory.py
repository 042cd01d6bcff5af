"""Where `parallelize(model, 8, mesh_shape="auto")` leaves rank 0's memory, in one process: the
largest rank of benchmarks/peers.py's `autopar auto` row, which chooses the mesh for every rank.

The process is rank 0 of 8 on torch's fake process group (`torch.testing._internal.distributed.
fake_pg`, as benchmarks/runtime_overhead.py), one torch thread; the model and batch are peers.py's
(examples.models.make_gpt at width 256, 4 layers, vocabulary 512, 8 x 64 tokens). Phase by phase
it records the RSS, the kernel's peak RSS so far (VmHWM, what peers.py's `ru_maxrss` reads),
glibc's bytes in use (`mallinfo2`: arena and mmapped blocks in use), the entries held by
autopar's `functools.lru_cache`s, and, after the last phase, the RSS left after `gc.collect()` +
`malloc_trim(0)` (what the allocator keeps beyond what is alive). The end of the mesh choice
(rank 0's `choose_mesh`, before the compile of the chosen mesh) is a phase of its own.
`--tracemalloc` also lists the allocation sites of the Python objects still alive after
`parallelize` returns that were allocated inside it (slow: the choice takes ~3x longer).

    python benchmarks/setup_memory.py                  # ~1-2 min
    python benchmarks/setup_memory.py --tracemalloc

Writes benchmarks/results/setup_memory.json (or <name>.json).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import sys
import tempfile
import threading
import traceback
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import git_state, table, write_result  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import autopar  # noqa: E402
import autopar.compiler.auto_mesh as auto_mesh  # noqa: E402
import autopar.planning.mesh_choice as mesh_choice  # noqa: E402
from examples.models import make_gpt  # noqa: E402

WORLD = 8
MODEL = {"n_embd": 256, "n_layer": 4, "n_head": 8, "block_size": 64, "vocab_size": 512}
MIB = 1 << 20
_libc = ctypes.CDLL("libc.so.6")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


_libc.mallinfo2.restype = _Mallinfo2


def in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back (heap blocks in use + mmapped blocks)."""
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match is not None, field
    return int(match.group(1)) / 1024


def pymalloc_mib() -> dict[str, float]:
    """Python's small-object allocator (`sys._debugmallocstats`, read back from fd 2): the arenas
    it holds mapped and the bytes of live objects in them; malloc's count does not see these."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    found = {}
    for key, pattern in (
        ("arenas_mib", r"# arenas allocated current\s*=\s*([\d,]+)"),
        ("arenas_peak_mib", r"# arenas highwater mark\s*=\s*([\d,]+)"),
        ("live_blocks_mib", r"# bytes in allocated blocks\s*=\s*([\d,]+)"),
        ("free_blocks_mib", r"# bytes in available blocks\s*=\s*([\d,]+)"),
        ("unused_pools_mib", r"\d+ unused pools \* \d+ bytes\s*=\s*([\d,]+)"),
    ):
        match = re.search(pattern, text)
        if match:
            found[key] = int(match.group(1).replace(",", "")) / MIB
    for key in ("arenas_mib", "arenas_peak_mib"):  # counts of arenas, 1 MiB each (Python 3.10+ on 64 bits)
        if key in found:
            found[key] *= MIB
    return found


def cached_entries() -> dict[str, int]:
    """Entries held by every `functools.lru_cache` of autopar's imported modules, by function."""
    return {f"{f.__module__}.{f.__name__}": f.cache_info().currsize for f in _cached_functions()}


def _cached_functions() -> list[Any]:
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("autopar") or module is None:
            continue
        for value in vars(module).values():
            if callable(getattr(value, "cache_info", None)) and getattr(value, "__module__", None) == name:
                found.append(value)
    return found


class PeakSampler:
    """The most bytes malloc had in use, sampled every few milliseconds on a thread (between two
    phases: `take()` returns the peak since the last call and starts a new one)."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.peak = 0
        self.where = ""  # the main thread's innermost frames when the peak was sampled
        # (read only while set: reading another thread's frames during torch.export's trace breaks it)
        self.read_frames = False
        self._main = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            now = in_use()
            if now > self.peak:
                self.peak = now
                frame = sys._current_frames().get(self._main) if self.read_frames else None
                stack = traceback.extract_stack(frame)[-6:] if frame is not None else []
                self.where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack))

    def take(self) -> tuple[int, str]:
        """(peak bytes, where) since the last call."""
        peak, where = max(self.peak, in_use()), self.where
        self.peak, self.where = in_use(), ""
        return peak, where

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


SAMPLER: PeakSampler | None = None


def _peak_since_last() -> dict[str, Any]:
    if SAMPLER is None:
        return {"malloc_peak_in_use_mib": None}
    peak, where = SAMPLER.take()
    return {"malloc_peak_in_use_mib": peak / MIB, "malloc_peak_at": where}


def phase(label: str) -> dict[str, Any]:
    entries = cached_entries()
    return {
        "phase": label,
        "rss_mib": _status("VmRSS"),
        "peak_rss_mib": _status("VmHWM"),
        "malloc_in_use_mib": in_use() / MIB,
        **_peak_since_last(),
        "lru_entries": sum(entries.values()),
        "pymalloc": pymalloc_mib(),
        "lru_by_function": {k: v for k, v in sorted(entries.items(), key=lambda kv: -kv[1]) if v},
        # Python's own allocations (pymalloc arenas are mmapped: malloc's count does not see them)
        "python_traced_mib": [n / MIB for n in tracemalloc.get_traced_memory()] if tracemalloc.is_tracing() else None,
    }


def _watch_stages(rows: list[dict[str, Any]]) -> list[tuple[Any, str, Any]]:
    """Wrap the mesh choice's stages (trace, each candidate's search, each lowering for the
    scheduled step) so that each records the malloc peak it reached; returns what to restore."""
    wrapped = [
        (auto_mesh, "trace_for_choice"), (auto_mesh, "scheduled_step_time"), (mesh_choice, "_evaluate"),
        (mesh_choice, "screen"),
    ]  # fmt: skip
    restore = []
    for owner, attr in wrapped:
        original = getattr(owner, attr)

        def watched(*args: Any, _original: Any = original, _attr: str = attr, **kwargs: Any) -> Any:
            assert SAMPLER is not None
            SAMPLER.take()
            SAMPLER.read_frames = _attr == "_evaluate"  # the searches (no tracing inside)
            try:
                return _original(*args, **kwargs)
            finally:
                SAMPLER.read_frames = False
                rows.append(phase(f"  in choice: {_attr}"))

        setattr(owner, attr, watched)
        restore.append((owner, attr, original))
    return restore


def measure(trace_python: bool, steps: int, clear_caches: bool = False) -> dict[str, Any]:
    global SAMPLER
    SAMPLER = PeakSampler()
    rows = [phase("start (torch, autopar imported)")]
    model, batch = make_gpt(0, WORLD, **MODEL)
    rows.append(phase("model built"))
    choose = auto_mesh.choose_mesh

    def recorded(*args: Any, **kwargs: Any) -> Any:
        choice = choose(*args, **kwargs)
        rows.append(phase("mesh chosen (rank 0)"))
        if clear_caches:
            for function in _cached_functions():
                function.cache_clear()
            gc.collect()
            rows.append(phase("lru_caches cleared + gc.collect()"))
        return choice

    auto_mesh.choose_mesh = recorded  # type: ignore[assignment]
    stages = _watch_stages(rows)
    if trace_python:
        tracemalloc.start(8)
        before = tracemalloc.take_snapshot()
    pmodel = autopar.parallelize(model, WORLD, example_inputs=batch, mesh_shape="auto")
    auto_mesh.choose_mesh = choose  # type: ignore[assignment]
    for owner, attr, original in stages:
        setattr(owner, attr, original)
    rows.append(phase("parallelize returned"))
    sites: list[str] = []
    if trace_python:
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        stats = after.compare_to(before, "traceback")
        total = sum(s.size_diff for s in stats)
        sites.append(f"python objects allocated inside parallelize and alive after it: {total / MIB:.1f} MiB")
        for stat in stats[:12]:
            frames = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in list(stat.traceback)[:4])
            sites.append(f"{stat.size_diff / MIB:7.2f} MiB {stat.count_diff:7d} blocks  {frames}")
    del model
    gc.collect()
    rows.append(phase("gc.collect()"))
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        pmodel(*batch).backward()
        opt.step()
    rows.append(phase(f"after {steps} steps"))
    _libc.malloc_trim(0)
    rows.append(phase("malloc_trim(0)"))
    SAMPLER.stop()
    return {"phases": rows, "sites": sites, "mesh": str(pmodel.mesh_choice.chosen.label)}  # type: ignore[union-attr]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracemalloc", action="store_true", help="list what parallelize leaves alive, by site")
    parser.add_argument("--clear-caches", action="store_true", help="clear autopar's lru_caches after the mesh choice")
    parser.add_argument("--steps", type=int, default=3, help="training steps after parallelize (default 3)")
    parser.add_argument("--name", default="setup_memory", help="writes benchmarks/results/<name>.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each rank of peers.py
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    load = [os.getloadavg()[0]]
    result = measure(args.tracemalloc, args.steps, args.clear_caches)
    load.append(os.getloadavg()[0])
    dist.destroy_process_group()
    headers = [
        "rank 0 of 8, MiB", "RSS", "peak RSS so far", "malloc in use (peak since last)", "pymalloc arenas (peak)",
        "live Python blocks", "lru_cache entries",
    ]  # fmt: skip
    rows = [
        [
            r["phase"], f"{r['rss_mib']:.0f}", f"{r['peak_rss_mib']:.0f}", f"{r['malloc_in_use_mib']:.0f} ({r['malloc_peak_in_use_mib']:.0f})",
            f"{r['pymalloc'].get('arenas_mib', 0):.0f} ({r['pymalloc'].get('arenas_peak_mib', 0):.0f})",
            f"{r['pymalloc'].get('live_blocks_mib', 0):.0f}", str(r["lru_entries"]),
        ]  # fmt: skip
        for r in result["phases"]
    ]
    text = table(headers, rows)
    print(text)
    print(f"mesh chosen: {result['mesh']}; load average (1 min) {load[0]:.1f} -> {load[1]:.1f}")
    for r in result["phases"]:
        if r.get("malloc_peak_in_use_mib", 0) - r["malloc_in_use_mib"] > 32:  # a transient worth naming
            print(f"{r['phase'].strip()}: malloc peak {r['malloc_peak_in_use_mib']:.0f} MiB at {r['malloc_peak_at']}")
    for line in result["sites"]:
        print(line)
    payload = {"model": MODEL, **result, "load_average_1min": load, "git": git_state(), "table": text}
    print(f"wrote {write_result(args.name, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
