"""Local batches (`parallelize(..., inputs="local")`): every rank passes only its own shard of the
batch, as a `DistributedSampler` yields it, and the module runs on the batch those shards make
together in rank order (rank 0's rows first). Every tensor argument is split along dim 0.

No rank assembles the global batch: each shard goes to the block the program wants through a
DTensor redistribution (an all-gather only over the mesh axes along which the program does not
split the batch). The per-call checks that must agree across ranks (the shards' sizes, index
ranges) cost one small all-gather or all-reduce.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard
from torch.utils import _pytree as pytree

from autopar.core.errors import InputMismatchError
from autopar.core.meta import IndexCheck
from autopar.runtime.agreement import collective_device

LOCAL = "local"
GLOBAL = "global"
INPUT_MODES = (GLOBAL, LOCAL)


def shard_rows(
    tensors: Sequence[torch.Tensor], names: Sequence[str], group: dist.ProcessGroup | None, calls: int = 0
) -> list[int]:
    """Every tensor's dim-0 size on this rank, checked equal on every rank (one all-gather): a
    shard of another size would make the ranks' programs disagree. The count of this rank's calls
    of the module (`calls`) goes in the same all-gather: a rank a call out of step is named."""
    scalars = [name for name, x in zip(names, tensors) if x.dim() == 0]
    if scalars:
        raise InputMismatchError(
            f"{scalars[0]} is a 0-d tensor, but with inputs=\"local\" every tensor argument is a shard of the batch along dim 0",
            hint='pass it with a batch dim, or use parallelize(..., inputs="global") with the whole batch on every rank',
        )
    rows = [int(x.shape[0]) for x in tensors]
    mine = torch.tensor([calls, *rows], dtype=torch.int64, device=collective_device(group))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    counts = [int(theirs[0]) for theirs in everyone]
    if len(set(counts)) > 1:
        ahead = max(counts)
        behind = [f"rank {r} is {ahead - c} call(s) behind" for r, c in enumerate(counts) if c < ahead]
        raise InputMismatchError(
            f"{', '.join(behind)} the others: this is call {ahead} of the module on the ranks ahead, "
            "so the ranks would train on different steps' batches",
            hint="every rank must call the module the same number of times: a rank whose call "
            "failed alone must be brought back in step",
        )
    everyone = [theirs[1:] for theirs in everyone]
    for rank, theirs in enumerate(everyone):
        if not torch.equal(theirs, everyone[0]):
            index = int((theirs != everyone[0]).nonzero()[0])
            raise InputMismatchError(
                f"{names[index]} has {int(everyone[0][index])} rows on rank 0 but {int(theirs[index])} on "
                f"rank {rank}: with inputs=\"local\" every rank passes a shard of the same size",
                hint="use a DistributedSampler (it pads to equal shards) or drop the last, uneven batch",
            )
    return rows


def global_stand_ins(args: Any, world: int) -> Any:
    """The call's arguments with every tensor replaced by an empty one the global batch's size
    (dim 0 times the number of ranks): what a program for this call is traced with."""
    return pytree.tree_map_only(
        torch.Tensor, lambda x: x.new_empty((x.shape[0] * world, *x.shape[1:])).requires_grad_(x.requires_grad), args
    )


def batch_tensor(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's shard as a block of the global batch, split along dim 0 over every mesh axis in
    rank order (a differentiable view: a gradient comes back as this shard's block)."""
    shape = (local.shape[0] * mesh.size(), *local.shape[1:])
    stride = tuple(torch.empty(shape, device="meta").stride())
    return DTensor.from_local(local, mesh, [DShard(0)] * mesh.ndim, run_check=False, shape=torch.Size(shape), stride=stride)


def index_extremes(
    checks: Sequence[IndexCheck],
    tensors: Sequence[torch.Tensor],
    across_ranks: bool = False,
    group: dist.ProcessGroup | None = None,
) -> list[tuple[int, int] | None]:
    """For each check, the lowest and highest value its input holds (outside the ignored values),
    `across_ranks`: on all ranks together (one all-reduce); None where none is held."""
    extremes: list[int] = []
    for check in checks:
        values = tensors[check.input_index]
        if check.ignored and values.numel():  # an ignored value reads as 0, which every op takes
            skipped = functools.reduce(torch.logical_or, [values == v for v in check.ignored])
            if bool(skipped.all()):
                values = values[:0]
            else:
                values = values.masked_fill(skipped, 0)
        if values.numel() == 0:
            extremes += [torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).min]
        else:
            lowest, highest = torch.aminmax(values)
            extremes += [-int(lowest), int(highest)]
    if across_ranks:
        reduced = torch.tensor(extremes, dtype=torch.int64, device=collective_device(group))
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        extremes = reduced.tolist()
    found: list[tuple[int, int] | None] = []
    for k in range(len(checks)):
        negative_low, high = extremes[2 * k], extremes[2 * k + 1]
        found.append(None if high == torch.iinfo(torch.int64).min else (-int(negative_low), int(high)))
    return found
