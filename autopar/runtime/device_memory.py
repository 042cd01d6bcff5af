"""How much memory one rank of this job has: what `parallelize`'s default memory limit is made of.

A CUDA rank has its device's memory. A CPU rank is a process of a machine whose memory all its
local ranks share (gloo ranks forked or started by torchrun on one host), so it has the machine's
physical memory over the ranks on it: torchrun's LOCAL_WORLD_SIZE, else every rank of the job (the
conservative guess for a CPU job started some other way), less what the process already holds
beside its model's tensors (`process_footprint`): torch, gloo and Python take 0.15-0.3 GB of every
CPU rank, memory a plan's tensors cannot have (docs/pipeline.md#a-pipelined-ranks-memory).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# Where Linux reports a process's anonymous memory: its proportional share (pages a forked rank
# still shares with its parent or siblings count once over all of them), else all of it.
_FOOTPRINT_SOURCES = (("/proc/self/smaps_rollup", "Pss_Anon:"), ("/proc/self/status", "RssAnon:"))


def rank_memory(device_type: str, model_tensors: Iterable[torch.Tensor] = ()) -> float | None:
    """Bytes of memory one rank of this job has on `device_type` for a plan's tensors; None where
    it is not known (a device type other than CPU and CUDA: then there is no default limit).

    On CPU, the rank's share of the machine less `process_footprint(model_tensors)`: what this
    process holds beside `model_tensors` (the model's own, which the plan's count replaces)."""
    if device_type == "cuda" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    if device_type != "cpu":
        return None
    machine = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return max(0.0, machine / local_ranks() - process_footprint(model_tensors))


def process_footprint(model_tensors: Iterable[torch.Tensor] = ()) -> float:
    """Bytes of anonymous memory this process holds now, less the CPU storages of `model_tensors`
    (each counted once): the runtime's own memory (torch's and gloo's state, the interpreter, what
    the job keeps beside the model), which no plan counts. 0 where Linux's /proc is not there."""
    held = 0
    for path, key in _FOOTPRINT_SOURCES:
        try:
            with open(path) as report:
                lines = [line for line in report if line.startswith(key)]
        except OSError:
            continue
        if lines:
            held = int(lines[0].split()[1]) * 1024  # reported in kB
            break
    storages: dict[int, int] = {}
    for tensor in model_tensors:
        if tensor.device.type == "cpu" and not isinstance(tensor, DTensor):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return float(max(0, held - sum(storages.values())))


def local_ranks() -> int:
    """Ranks of this job on this machine: LOCAL_WORLD_SIZE (torchrun), else the job's world size."""
    found = os.environ.get("LOCAL_WORLD_SIZE", "")
    if found.isdigit() and int(found) > 0:
        return int(found)
    return dist.get_world_size() if dist.is_initialized() else 1
