"""How much memory one rank of this job has: what `parallelize`'s default memory limit is made of.

A CUDA rank has its device's memory. A CPU rank is a process of a machine whose memory all its
local ranks share (gloo ranks forked or started by torchrun on one host), so it has the machine's
physical memory over the ranks on it: torchrun's LOCAL_WORLD_SIZE, else every rank of the job (the
conservative guess for a CPU job started some other way), less the runtime's fixed memory
(`core.host_memory.RUNTIME_RESERVE`: torch, gloo and the interpreter). `autopar.plan` with
`device_type="cpu"` takes the same number for its mesh's ranks, and the cpu-gloo table's
`HardwareTable.rank_memory` subtracts the same reserve, so plans made in one process and on the
ranks count one limit.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from autopar.core.host_memory import cpu_rank_memory


def rank_memory(device_type: str, ranks: int | None = None) -> float | None:
    """Bytes of memory one rank of this job has for a plan's tensors on `device_type`; None where
    it is not known (a device type other than CPU and CUDA: then there is no default limit). On
    CPU, the share of one of `ranks` ranks on this machine (default `local_ranks()`) less the
    runtime's reserve (`cpu_rank_memory`)."""
    if device_type == "cuda" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    if device_type != "cpu":
        return None
    return cpu_rank_memory(machine_memory(), local_ranks() if ranks is None else ranks)


def machine_memory() -> float:
    """Bytes of physical memory of this machine."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def local_ranks() -> int:
    """Ranks of this job on this machine: LOCAL_WORLD_SIZE (torchrun), else the job's world size."""
    found = os.environ.get("LOCAL_WORLD_SIZE", "")
    if found.isdigit() and int(found) > 0:
        return int(found)
    return dist.get_world_size() if dist.is_initialized() else 1
