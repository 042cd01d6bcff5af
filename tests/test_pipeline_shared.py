"""A weight several pipeline stages read, its gradient summed over the pp group without making it
whole (`compiler/pipeline_shared`, docs/pipeline.md#a-pipelined-ranks-memory).

On real gloo ranks, copies of one weight on the first and the last stage's tensor sub-mesh (a
middle stage holding none) get the serial gradient, the sum of the stages' whole gradients, as
DTensors of their own placements: placed alike (summed in their blocks, uneven ones included),
placed differently (GPT's embedding split on columns and its head on rows, a replicated axis of a
2-D sub-mesh; summed in chunks of rows), and a gradient whose placement the sum does not take
(summed whole, as before, by every rank alike). The sum of a split weight never holds memory
near the whole gradient: malloc's bytes in use, read at each of its all-reduces, stay within a
chunk of where the sum started, where making it whole held the whole gradient twice."""

from __future__ import annotations

import ctypes
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from autopar.compiler import pipeline_shared
from autopar.compiler.pipeline_batch import sum_shared_copies


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _in_use() -> int:
    """Bytes glibc's malloc has handed out (torch's CPU tensors live there)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


# (shape, first stage's placements, last stage's, last stage's gradient placements or None: as its copy)
Weight = tuple[tuple[int, ...], tuple[Placement, ...], tuple[Placement, ...], tuple[Placement, ...] | None]


def _whole_gradient(shape: tuple[int, ...], stage: int, index: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * stage + index))


def _sum(rank: int, world: int, mesh_shape: tuple[int, ...], weights: list[Weight], chunk_bytes: int) -> dict[str, Any]:
    names = ("pp", *(f"t{i}" for i in range(len(mesh_shape) - 1)))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    sub = mesh[names[1:]]
    pp = mesh_shape[0]
    stage = mesh.get_local_rank("pp")
    holds = stage in (0, pp - 1)
    shared, grads = [], {}
    for i, (shape, first, last, last_grad) in enumerate(weights):
        user = nn.Parameter(torch.empty(shape, device="meta"))
        copies = []
        if holds:
            placements = first if stage == 0 else last
            copy = nn.Parameter(distribute_tensor(torch.zeros(shape), sub, placements, src_data_rank=None))
            given = last_grad if stage == pp - 1 and last_grad is not None else placements
            whole = _whole_gradient(shape, stage, i)
            if any(isinstance(p, Partial) for p in given):  # each rank of the sub-mesh one share
                grad = DTensor.from_local(whole / sub.size(), sub, given, run_check=False)
            else:
                grad = distribute_tensor(whole, sub, given, src_data_rank=None)
            copies.append(copy)
            grads[id(copy)] = grad
        shared.append((f"w{i}", user, copies))
    reduced: list[tuple[int, int]] = []  # (bytes all-reduced, malloc's rise) at each sum's all-reduce
    original = dist.all_reduce

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.is_floating_point():  # (the agreement's integer codes aside)
            reduced.append((tensor.numel() * tensor.element_size(), _in_use() - start))
        return original(tensor, *args, **kwargs)

    pipeline_shared.CHUNK_BYTES = chunk_bytes  # this rank's process only
    dist.all_reduce = recording
    try:
        start = _in_use()
        sum_shared_copies(shared, grads, mesh.get_group("pp"), "cpu", mesh_axes=len(mesh_shape) - 1, chunks=sub.size())
    finally:
        dist.all_reduce = original
    for i, (name, user, copies) in enumerate(shared):
        expected = _whole_gradient(user.shape, 0, i) + _whole_gradient(user.shape, pp - 1, i)
        for copy in copies:
            g = grads[id(copy)]
            assert isinstance(g, DTensor) and g.placements == copy.placements, (name, g)
            torch.testing.assert_close(g.full_tensor(), expected, rtol=1e-6, atol=1e-6, msg=name)
    return {"reduced": reduced, "stage": stage}


@pytest.mark.multirank
def test_shared_weight_gradients_summed_over_pp_in_blocks_and_in_chunks() -> None:
    """pp=3 x (2,): the first and last stages hold copies, the middle one none."""
    weights: list[Weight] = [
        ((7, 6), (Shard(1),), (Shard(0),), None),  # placed differently: chunks of 2 rows, uneven
        ((5,), (Replicate(),), (Replicate(),), None),  # alike: blocks
        ((7, 3), (Shard(0),), (Shard(0),), None),  # alike, uneven blocks (4 and 3 rows)
        ((4, 4), (Shard(0),), (Shard(0),), (Partial(),)),  # a partial gradient: whole, on every rank
    ]
    row = 6 * 4  # bytes of a row of the first weight
    for r in run_ranks(6, _sum, (3, 2), weights, 2 * row):
        sizes = [size for size, _ in r["reduced"]]
        assert max(sizes) <= 4 * 4 * 4, r  # nothing larger than the whole 4x4 weight's sum went
        assert 2 * row in sizes, r  # the first weight went in chunks of 2 rows


@pytest.mark.multirank
def test_shared_weight_placed_differently_on_a_2d_sub_mesh() -> None:
    """pp=2 x (2, 2): a weight split on its rows and replicated on the second axis by one stage,
    replicated and split on its columns by the other; and one placed alike on both."""
    weights: list[Weight] = [
        ((9, 4), (Shard(0), Replicate()), (Replicate(), Shard(1)), None),
        ((6, 4), (Shard(0), Shard(1)), (Shard(0), Shard(1)), None),
    ]
    run_ranks(8, _sum, (2, 2, 2), weights, 3 * 4 * 4)


@pytest.mark.multirank
def test_a_split_shared_weight_is_never_made_whole() -> None:
    """An embedding-sized weight (8 MiB), split on columns by one stage and on rows by the other,
    summed in 256 KiB chunks: at every all-reduce of the sum, malloc holds well under a quarter of
    the whole gradient more than when it started (a chunk, and the collectives' own few hundred KiB
    of bookkeeping); making it whole held 16 MiB, the gather and its concatenation."""
    shape = (4096, 512)
    whole = math.prod(shape) * 4
    weights: list[Weight] = [(shape, (Shard(1),), (Shard(0),), None)]
    for r in run_ranks(4, _sum, (2, 2), weights, 256 * 1024):
        rises = [rise for _, rise in r["reduced"]]
        assert rises and max(rises) < whole // 4, (r["stage"], max(rises), whole)
