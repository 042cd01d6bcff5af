"""Measure this machine and write the `cpu-gloo` hardware table (`python -m autopar calibrate`).

A "device" here is one gloo rank running with `threads` intra-op threads (1 by default, as in the
multi-rank tests, where several ranks share the cores). Measured: the fp32 (and bf16) matmul rate,
best over a few sizes and repeats; memory bandwidth from a large copy (read + write bytes); and
gloo all_reduce / all_gather times between forked local ranks over a range of message sizes, to
which alpha (s per ring step) and bandwidth are fitted by least squares on relative error.

Ranks are forked from this process, which has imported torch and torch.distributed already, so
that starting them costs well under a second instead of an import of torch per rank.

Timed back to back on idle ranks, a collective costs what the wire and gloo cost. In a training
job each rank computes between its collectives, and with more ranks than cores a rank that reaches
a collective waits until its peers are scheduled again: on 2 shared cores this put ~1.7 ms on every
2-rank collective of an 8-rank job, ~5x the idle alpha. `groups` (e.g. 2, 4, 8 on 8 ranks) measures
that regime: every rank of the job is busy, each in a subgroup of each size as a mesh axis is
(consecutive ranks), and each call follows `busy_s` of compute; the compute's own time, measured
alone under the same load, is taken off.
"""

from __future__ import annotations

import datetime
import functools
import json
import multiprocessing as mp
import os
import pickle
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from autopar.cost.formulas import LATENCY_STEPS, VOLUME_FACTOR, collective_time
from autopar.cost.hardware import TABLES_DIR, Hardware, Link, hardware_from_dict

DEFAULT_SIZES = tuple(4**k for k in range(12))  # 1 to 4 Mi elements (16 MiB fp32)
QUICK_SIZES = (1, 64, 4096, 2**18, 2**20)  # a few sizes up to 4 MiB fp32: a clear bandwidth term
JOB_SIZES = (1, 256, 4096, 2**16, 2**18, 2**20)  # in-job mode: 3 group sizes, every call after compute


@dataclass(frozen=True)
class Sample:
    """One timed collective: N sized as in `formulas.collective_time`, median seconds."""

    kind: str
    elements: int
    group_size: int
    seconds: float


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: allocation, first-call dispatch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_flops(
    dtype: torch.dtype = torch.float32, sizes: Sequence[int] = (256, 512, 1024), repeats: int = 5
) -> float:
    """Best FLOP/s of an n x n x n matmul over `sizes` (best of `repeats` each)."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        seconds = _best_seconds(functools.partial(torch.mm, a, b), repeats)
        best = max(best, 2.0 * n**3 / seconds)
    return best


def measure_memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a large copy, counting the bytes read and the bytes written."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _best_seconds(lambda: dst.copy_(src), repeats)


def _all_gather(out: torch.Tensor, x: torch.Tensor) -> None:
    # all_gather_single is the newer name of all_gather_into_tensor (which now warns).
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    gather(out, x)


def _iters_for(elements: int) -> int:
    """Back-to-back calls per timed trial: many for small messages, whose single-call time is
    dominated by process wake-ups on shared cores; one for large ones."""
    return max(1, min(20, 2_000_000 // max(elements, 1)))


def _all_gather_on(group: Any, out: torch.Tensor, x: torch.Tensor) -> None:
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    gather(out, x, group=group)


def _busy_work(seconds: float) -> Callable[[], None]:
    """A compute burst of about `seconds` on an idle core (repeated small matmuls)."""
    if seconds <= 0:
        return lambda: None
    a = torch.randn(96, 96)
    one = _best_seconds(functools.partial(torch.mm, a, a), 5)
    reps = max(1, round(seconds / max(one, 1e-7)))

    def work() -> None:
        for _ in range(reps):
            torch.mm(a, a)

    return work


def _my_group(rank: int, world: int, g: int) -> Any:
    """This rank's subgroup of `g` consecutive ranks (every rank creates every subgroup, as
    torch requires); the default group when g is the world."""
    if g == world:
        return None
    mine = None
    for start in range(0, world, g):
        group = dist.new_group(list(range(start, start + g)))
        if start <= rank < start + g:
            mine = group
    return mine


def _timed(op: Callable[[], Any], work: Callable[[], None], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        work()
        op()
    return (time.perf_counter() - t0) / iters


def _rank_main(
    rank: int,
    world: int,
    tmp: str,
    sizes: Sequence[int],
    repeats: int,
    conn: Connection,
    timeout: float,
    groups: Sequence[int] = (),
    busy_s: float = 0.0,
) -> None:
    """One forked rank: time each collective at each size (and group size, in the in-job mode);
    send [(kind, n_local, g, [seconds...])]."""
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
        work = _busy_work(busy_s)
        out: list[tuple[str, int, int, list[float]]] = []
        for g in groups or (world,):
            group = _my_group(rank, world, g)
            for n in sizes:
                x = torch.ones(n)
                gathered = torch.empty(n * g)
                ops: dict[str, Callable[[], Any]] = {
                    "all_reduce": functools.partial(dist.all_reduce, x, group=group),
                    "all_gather": functools.partial(_all_gather_on, group, gathered, x),
                }
                for kind, op in ops.items():
                    op()  # warm-up (connection and buffer set-up)
                    times = []
                    iters = _iters_for(n)
                    for _ in range(repeats):
                        dist.barrier()
                        alone = _timed(lambda: None, work, iters) if groups else 0.0
                        dist.barrier()
                        times.append(max(0.0, _timed(op, work, iters) - alone))
                    out.append((kind, n, g, times))
        dist.barrier()
        conn.send_bytes(pickle.dumps(("ok", out)))
    except BaseException as e:  # report, never hang the parent
        conn.send_bytes(pickle.dumps(("error", f"rank {rank}: {type(e).__name__}: {e}")))
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def measure_collectives(
    ranks: int = 4,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    timeout: float = 120.0,
    groups: Sequence[int] = (),
    busy_s: float = 0.0,
) -> list[Sample]:
    """Time gloo all_reduce / all_gather on `ranks` forked local ranks.

    A trial times up to 20 calls (averaged) after a barrier; per trial the slowest rank's time
    counts (a collective ends when its last rank ends), and the sample is the median over
    `repeats` trials (the cores are shared, so the best would flatter). With `groups`, every rank
    runs each call on its subgroup of each of those sizes after `busy_s` of compute (the in-job
    regime; see the module), less that compute's time alone.
    """
    bad = [g for g in groups if g < 2 or ranks % g]
    if bad:
        raise ValueError(f"group sizes {bad} do not divide {ranks} ranks into groups of 2 or more")
    ctx = mp.get_context("fork")
    procs = []
    results: dict[int, tuple[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="autopar-calibrate-") as tmp:
        readers: dict[Connection, int] = {}
        try:
            for rank in range(ranks):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(rank, ranks, tmp, tuple(sizes), repeats, writer, timeout, tuple(groups), busy_s),
                )
                proc.start()
                writer.close()
                procs.append(proc)
                readers[reader] = rank
            deadline = time.monotonic() + timeout
            while readers and (left := deadline - time.monotonic()) > 0:
                for conn in wait(list(readers), timeout=left):
                    assert isinstance(conn, Connection)
                    rank = readers.pop(conn)
                    try:
                        results[rank] = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        results[rank] = ("error", f"rank {rank} died")
                    conn.close()
                    if results[rank][0] != "ok":  # the others are stuck waiting for it
                        deadline = min(deadline, time.monotonic() + 2.0)
        finally:
            for proc in procs:
                proc.join(timeout=5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    errors = [r[1] for r in results.values() if r[0] != "ok"]
    if errors or len(results) < ranks:
        raise RuntimeError("calibration ranks failed: " + ("; ".join(errors) or "timed out"))
    samples = []
    for i, (kind, n, g, _) in enumerate(results[0][1]):
        slowest = [max(results[r][1][i][3][k] for r in range(ranks)) for k in range(repeats)]
        full = n * g if kind == "all_gather" else n
        samples.append(Sample(kind, full, g, statistics.median(slowest)))
    return samples


def fit_alpha_beta(samples: Sequence[Sample], itemsize: int = 4) -> tuple[float, float]:
    """(alpha s, bandwidth bytes/s) minimizing the relative error of the alpha-beta ring model.

    Each sample gives t = steps * alpha + bytes_sent * beta with steps and bytes_sent from the
    collective's ring formula; rows are divided by t so that small messages (alpha) weigh as much
    as large ones (beta). A negative coefficient is clamped to 0 and the other refitted alone.
    """
    rows, rhs = [], []
    for s in samples:
        g = s.group_size
        steps = LATENCY_STEPS[s.kind] * (g - 1)
        sent = VOLUME_FACTOR[s.kind] * (g - 1) / g * s.elements * itemsize
        rows.append([steps / s.seconds, sent / s.seconds])
        rhs.append(1.0)
    a, y = np.asarray(rows), np.asarray(rhs)
    (alpha, beta), *_ = np.linalg.lstsq(a, y, rcond=None)
    if alpha < 0 or beta <= 0:
        col = 1 if alpha < 0 else 0
        only = float(a[:, col] @ y / (a[:, col] @ a[:, col]))
        alpha, beta = (0.0, only) if col == 1 else (only, 0.0)
    if beta <= 0:
        raise RuntimeError("calibration: message time does not grow with size; measure larger messages")
    return float(alpha), float(1.0 / beta)


def fit_error(samples: Sequence[Sample], alpha: float, bandwidth: float, itemsize: int = 4) -> float:
    """Median |model - measured| / measured over the samples."""
    link = Link(alpha, bandwidth)
    return statistics.median(
        abs(collective_time(s.kind, s.elements, itemsize, s.group_size, link) - s.seconds) / s.seconds
        for s in samples
    )


def calibrate(
    ranks: int = 4,
    out: str | Path | None = None,
    quick: bool = False,
    threads: int = 1,
    log: Callable[[str], None] = print,
    groups: Sequence[int] = (),
    busy_s: float = 0.0,
) -> Hardware:
    """Measure, fit, write the `cpu-gloo` table to `out` (default: the checked-in one), return it.

    `groups` and `busy_s` time the collectives as a job of `ranks` ranks meets them (see the
    module): the table then prices a step of such a job, not an idle link."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sizes_mm = (128, 256) if quick else (256, 512, 1024)
        repeats = 3 if quick else 5
        fp32 = measure_matmul_flops(torch.float32, sizes_mm, repeats)
        bf16 = measure_matmul_flops(torch.bfloat16, sizes_mm[:2], repeats)
        log(f"matmul: fp32 {fp32 / 1e9:.1f} GFLOP/s, bf16 {bf16 / 1e9:.1f} GFLOP/s ({threads} thread(s))")
        mem_bw = measure_memory_bandwidth((32 if quick else 256) * 2**20, repeats)
        log(f"memory: {mem_bw / 1e9:.2f} GB/s (copy, read + write)")
    finally:
        torch.set_num_threads(old_threads)
    sizes = QUICK_SIZES if quick else (JOB_SIZES if groups else DEFAULT_SIZES)
    timeout = 120.0 * max(1, len(groups))  # each group size is a whole sweep
    samples = measure_collectives(ranks, sizes, repeats, timeout, groups=groups, busy_s=busy_s)
    alpha, bandwidth = fit_alpha_beta(samples)
    error = fit_error(samples, alpha, bandwidth)
    log(
        f"gloo, {ranks} ranks: alpha {alpha * 1e6:.1f} us per step, bandwidth {bandwidth / 1e9:.3f} GB/s "
        f"(median relative error of the fit {error:.0%})"
    )
    if groups:
        how = (
            f"gloo over loopback, all {ranks} forked ranks busy, each call on a subgroup of "
            f"{', '.join(map(str, groups))} consecutive ranks after {busy_s * 1e3:g} ms of compute "
            "(its time alone taken off): all_reduce and all_gather"
        )
        command = f"--ranks {ranks} --groups {','.join(map(str, groups))} --busy-ms {busy_s * 1e3:g}"
    else:
        how = f"gloo over loopback between {ranks} forked ranks: all_reduce and all_gather"
        command = f"--ranks {ranks}"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    stamp = (
        f"{datetime.date.today().isoformat()} on {platform.node() or 'this machine'} (load average {load})"
    )
    cpu = _cpu_name()
    link: dict[str, float] = {"alpha": _sig(alpha), "bandwidth": _sig(bandwidth)}
    kept = _kept_call(Path(out) if out is not None else TABLES_DIR / "cpu-gloo.json")
    table = {
        "name": "cpu-gloo",
        "description": (
            f"This machine ({cpu}, {os.cpu_count()} cores): one device = one gloo rank with "
            f"{threads} thread(s); all local ranks share the machine's memory and cores."
        ),
        "devices_per_node": 1024,
        "peak_flops": {"float32": _sig(fp32), "bfloat16": _sig(bf16)},
        "memory_bandwidth": _sig(mem_bw),
        "memory_capacity": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "memory_shared": True,
        "intra_node": link,
        "inter_node": dict(link),
        "source": {
            "all": f"measured by `python -m autopar calibrate {command}` {stamp}, torch {torch.__version__}",
            "peak_flops": f"best n x n matmul rate, n in {sizes_mm}, best of {repeats}, {threads} thread(s)",
            "memory_bandwidth": "torch copy_ of a large fp32 tensor, bytes read + written, best of repeats",
            "memory_capacity": "physical RAM of the machine (shared by all local ranks)",
            "intra_node": (
                f"{how}, {len(samples) // 2} sizes x groups, slowest rank, median of {repeats} trials of up to 20 calls; "
                f"alpha-beta least-squares fit on relative error, median fit error {error:.0%}"
            ),
            "inter_node": "not measured (one machine): a copy of intra_node",
            "devices_per_node": "all ranks of a local job run on this one machine",
        },
        "calibration": [[s.kind, s.elements, s.group_size, _sig(s.seconds)] for s in samples],
    }
    if kept is not None:  # a collective's own time on its rank: not measured here (see `_kept_call`)
        for key in ("intra_node", "inter_node"):
            table[key]["call"] = kept[0]  # type: ignore[index]
        table["source"]["call"] = kept[1]  # type: ignore[index]
    path = Path(out) if out is not None else TABLES_DIR / "cpu-gloo.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_to_json(table))
    log(f"wrote {path}")
    return hardware_from_dict(table)


def _kept_call(path: Path) -> tuple[float, str] | None:
    """The `call` time per collective of the table being replaced, and its source note: it was
    read off a profile of a whole job (the collective ops' own CPU time on the issuing rank), which
    the timings here, taken between calls, do not see."""
    try:
        old = json.loads(path.read_text())
        return float(old["intra_node"]["call"]), str(old["source"]["call"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _to_json(table: dict[str, Any]) -> str:
    """Indented JSON with one line per calibration sample."""
    rows = table.pop("calibration")
    text = json.dumps(table, indent=2)
    body = ",\n".join("    " + json.dumps(row) for row in rows)
    table["calibration"] = rows
    return text[:-2] + ',\n  "calibration": [\n' + body + "\n  ]\n}\n"


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _binned(points: Sequence[tuple[float, float]]) -> list[list[float]]:
    """Median fraction per factor-of-two bin of sizes, at the bin's geometric-mean size: a curve
    by size that no single odd shape bends."""
    bins: dict[int, list[tuple[float, float]]] = {}
    for size, fraction in points:
        if size > 0 and fraction > 0:
            bins.setdefault(int(np.floor(np.log2(size))), []).append((size, fraction))
    curve = []
    for _, members in sorted(bins.items()):
        size = float(np.exp(np.mean([np.log(s) for s, _ in members])))
        curve.append([_sig(size), _sig(min(1.0, statistics.median(f for _, f in members)))])
    return curve


def kernel_rates(measured: dict[str, Any]) -> dict[str, Any]:
    """The `kernels` entry of a hardware table from `benchmarks/gpu_kernels.py`'s report: per
    dtype, the fraction of peak matmuls reach by flops; the fraction of bandwidth element-wise
    ops reach by bytes moved; the launch floor."""
    matmul: dict[str, list[tuple[float, float]]] = {}
    for row in measured["matmul"]:
        flops = 2.0 * row["m"] * row["k"] * row["n"]
        matmul.setdefault(row["dtype"], []).append((flops, row["of_peak"]))
    memory = [(row["bytes_per_s"] * row["seconds"], row["of_bandwidth"]) for row in measured["elementwise"]]
    return {
        "matmul": {dtype: _binned(points) for dtype, points in sorted(matmul.items())},
        "memory": _binned(memory),
        "launch": _sig(measured["launch_s"]),
    }


def calibrated_table(base: Hardware, measured: dict[str, Any], name: str, when: str) -> dict[str, Any]:
    """`base` (a spec-sheet table) with the measured kernel rates, named `name`; sources say
    where the new numbers came from."""
    table = base.to_json()
    table["name"] = name
    table["description"] = f"{base.description} Kernel rates measured on {measured['device']}."
    table["kernels"] = kernel_rates(measured)
    origin = f"benchmarks/gpu_kernels.py on one {measured['device']} (torch {measured['torch']}), {when}"
    table["source"] = {
        **table["source"],
        "kernels.matmul": f"{origin}: torch.mm at transformer-layer shapes and squares, median fraction of peak_flops per factor-of-two bin of flops",
        "kernels.memory": f"{origin}: copy, add, mul and SiLU on bf16 tensors of 2^18 to 2^28 elements, median fraction of memory_bandwidth per factor-of-two bin of bytes moved",
        "kernels.launch": f"{origin}: 1000 one-element adds issued back to back, seconds per op",
    }
    return table
