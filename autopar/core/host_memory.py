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
import os

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


# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# What a CPU rank's heap is set to after `parallelize` (`return_freed_memory(cpu_ranks=True)`).
# Blocks up to 32 MiB (glibc's own ceiling for its sliding mmap threshold on 64-bit) come from the
# heap; free memory at the heap's top is given back only beyond 1 GiB (or by `malloc_trim`).
STEP_MMAP_THRESHOLD = 32 * MiB
STEP_TRIM_THRESHOLD = 1024 * MiB
# The environment variables that set the same (glibc reads them at start): a user's own wins.
MALLOC_ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def return_freed_memory(cpu_ranks: bool = False) -> None:
    """Collect the cyclic garbage and hand the C library's free heap pages back to the system
    (glibc's `malloc_trim(0)`; where the C library has none, the collection alone); on CPU ranks
    then keep the step's buffers resident from there on (`keep_step_heap`).

    `parallelize` calls it before it returns. Planning and compiling run with the collector off
    (`compiler.driver.compile_conditions`) and free most of what they allocated only when they
    finish: the mesh choice's searches, each lowered copy of the graph. glibc keeps the freed
    pages resident for later allocations, so without this a rank would carry them through training:
    on benchmarks/peers.py's GPT, rank 0 of 8 (which chooses the mesh) kept ~90 MiB of RSS its
    program does not use (`benchmarks/setup_memory.py`). The peak while planning is not lowered.
    """
    gc.collect()
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
    if cpu_ranks:
        keep_step_heap(libc)


def keep_step_heap(libc: ctypes.CDLL | None) -> bool:
    """Fix glibc's thresholds so that a training step's freed buffers stay in the heap for the next
    step instead of going back to the system and being faulted in again (True where set).

    Left to itself glibc slides its mmap threshold up to the largest block freed so far and gives
    the heap's free top back whenever it exceeds twice that. A step that allocates its largest
    buffers last then moves the heap's top up and back down every step: on benchmarks/peers.py's
    GPT under `auto` (DDP's plan), the gradient bucket's two 12.6 MiB flat buffers and ~8 MiB
    more, ~8200 minor page faults a step, which took rank 0's backward from 29 to 42 ms of CPU
    (`benchmarks/runtime_overhead.py`, "page faults per step"; with or without the trim above:
    it is the heap's state after planning that decides). Plain eager PyTorch on the same rank
    allocates less at the top and faults none. Fixed thresholds also stop the sliding, so the
    step's blocks up to `STEP_MMAP_THRESHOLD` reuse the heap's pages (as a caching allocator
    would), and larger ones are mapped and unmapped as before. The peak RSS is the step's, as
    before; between steps the RSS stays at it. Not set where the user set any of
    `MALLOC_ENVIRONMENT` (their choice stands) or the C library has no `mallopt`; a
    `mallopt` call after `parallelize` overrides it. CPU ranks only: an accelerator's step
    allocates its buffers on the device.
    """
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or any(name in os.environ for name in MALLOC_ENVIRONMENT):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD))


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)  # the symbols already loaded into this process, the C library's among them
    except OSError:  # pragma: no cover - a platform without dlopen(NULL)
        return None
