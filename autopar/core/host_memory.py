"""What a CPU rank's share of its machine's memory leaves for a plan's tensors.

A CPU rank is a process of a machine whose memory its local ranks share (gloo ranks forked or
started by torchrun on one host). Before autopar runs, every such process already holds torch,
gloo's state and the interpreter, memory no plan's tensors can have. The default `memory_limit`
on CPU (`parallelize`, and `autopar.plan` through the cpu-gloo table) leaves it out.

It is a constant, not each process's own reading: `autopar.plan` in one process and `parallelize`
on the job's ranks must plan under the same limit, and a process's reading differs between a
planning process and a rank, and from run to run (subtracting it made the two plan under
different limits, docs/pipeline.md#a-pipelined-ranks-memory).
"""

from __future__ import annotations

import ctypes
import gc

MiB = 1024**2

# The runtime's fixed memory per CPU rank: 286 MiB of RSS on every rank of a 4-rank gloo job after
# `init_process_group` and `init_device_mesh`, before any model exists (torch 2.13 CPU, Python 3.11;
# 123 MiB of it malloc's, the rest torch's and gloo's shared libraries), measured by
# `benchmarks/pipeline_rank_memory.py`, row "joined (torch, gloo)" of
# `benchmarks/results/pipeline_rank_memory.json`. Counted once per rank as the ranks' RSS counts it
# (the libraries' pages are shared between ranks, so this errs on the safe side by up to ~160 MiB a
# rank beyond the first).
RUNTIME_RESERVE = 286 * MiB


def cpu_rank_memory(machine: float, ranks: int) -> float:
    """Bytes a plan's tensors may take on one of `ranks` CPU ranks of a machine of `machine` bytes:
    its share of the machine less `RUNTIME_RESERVE` (0 where the share does not cover it)."""
    return max(0.0, machine / max(1, ranks) - RUNTIME_RESERVE)


def return_freed_memory() -> None:
    """Collect the cyclic garbage and hand the C library's free heap pages back to the system
    (glibc's `malloc_trim(0)`; where the C library has none, the collection alone).

    `parallelize` calls it before it returns. Planning and compiling run with the collector off
    (`compiler.driver.compile_conditions`) and free most of what they allocated only when they
    finish: the mesh choice's searches, each lowered copy of the graph. glibc keeps the freed
    pages resident for later allocations, so without this a rank would carry them through training:
    on benchmarks/peers.py's GPT, rank 0 of 8 (which chooses the mesh) kept ~90 MiB of RSS its
    program does not use (`benchmarks/setup_memory.py`). The peak while planning is not lowered.
    """
    gc.collect()
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)  # the symbols already loaded into this process, the C library's among them
    except OSError:  # pragma: no cover - a platform without dlopen(NULL)
        return None
