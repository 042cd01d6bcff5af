"""A weight several pipeline stages read (a tied embedding and head) summed over the pp group
without making its gradient whole (docs/pipeline.md#a-pipelined-ranks-memory).

With tensor axes beside `pp`, each stage that reads the weight trains its own DTensor copy on its
stage's tensor sub-mesh. Every stage's sub-mesh has the same shape, and the ranks of one pp group
sit at the same coordinates on theirs. Making the gradient whole (`full_tensor`, an all-reduce of
the whole tensor over pp, then cut again) held the whole gradient twice at once, the gather and
its concatenation: 64 MiB at width 1024 on the proxies, the step's malloc peak, above where the
step ends and beyond what the plan counts. Instead:

- **blocks**: where every copy has the same placements, the whole gradients' sum cut by them at one
  coordinate is the sum of the copies' blocks there, so one all-reduce of the blocks over the pp
  group gives every copy its block of the serial gradient;
- **row chunks**: where the copies are placed differently (GPT's embedding split on its columns,
  the head on its rows), the sum goes one chunk of rows at a time, each chunk no larger than a
  rank's block: every holder writes its blocks' part of the chunk into zeros, a sum over its stage's
  sub-mesh makes its copy's chunk whole (a replicated axis adds from its coordinate 0 only), a sum
  over the pp group adds the copies, and each copy takes back its part;
- **whole**, as before, for other placements (a partial sum, a strided split) or a 0-d weight.

Which way each weight goes is found with one all-reduce (max) of small integer codes, so that
every rank of the group takes the same way; a rank holding no copy adds zeros.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

_ABSENT = -(2**62)  # a rank holding no copy: below any code under the all-reduce's max
_UNSUPPORTED = -1  # a placement (or a mix of them) the block sum does not take: the whole way
# The most a chunk of rows holds (and no more than a rank's block): the sum's working memory, two
# chunks at once (the chunk and one more of its size while it is all-reduced), against the whole
# gradient twice
CHUNK_BYTES = 8 * 2**20


def placement_codes(grads: Sequence[torch.Tensor], copies: Sequence[torch.Tensor]) -> list[int] | None:
    """Per axis of the tensor sub-mesh, one code for the placements that every one of this rank's
    `copies` and their gradients share (0: replicated, 1 + d: split on dim d); None where they
    differ, are not DTensors, or are placed otherwise (a strided or balanced split, a partial sum)."""
    placements = {
        tuple(t.placements) for t in (*grads, *copies) if isinstance(t, DTensor)
    }
    if len(placements) != 1 or not all(isinstance(t, DTensor) for t in (*grads, *copies)):
        return None
    codes = []
    for p in next(iter(placements)):
        if type(p) is Replicate:
            codes.append(0)
        elif type(p) is Shard:
            codes.append(1 + p.dim)
        else:
            return None
    return codes


BLOCKS, CHUNKS, WHOLE = "blocks", "chunks", "whole"


def _chunkable(grads: Sequence[torch.Tensor | None], copies: Sequence[torch.Tensor]) -> bool:
    """Whether the chunked sum takes these copies: DTensors of at least one dim split or replicated,
    each gradient (`grads[i]`, copy i's, or None) placed as its copy."""
    placed = all(
        isinstance(c, DTensor) and c.dim() > 0 and all(type(p) in (Shard, Replicate) for p in c.placements)
        for c in copies
    )
    return placed and all(
        g is None or (isinstance(g, DTensor) and isinstance(c, DTensor) and g.placements == c.placements)
        for g, c in zip(grads, copies, strict=True)
    )


def agreed_ways(
    holders: Sequence[tuple[Sequence[torch.Tensor | None], Sequence[torch.Tensor]]],
    shapes: Sequence[torch.Size],
    mesh_axes: int,
    group: dist.ProcessGroup,
    device: torch.device | str,
) -> list[tuple[str, tuple[int, ...]]]:
    """For each shared weight (`holders[i]`: this rank's copies' gradients, None for one without,
    and the copies, empty where it holds none; `shapes[i]`: its global shape), how the ranks of `group` sum it
    (module doc) and, for BLOCKS, the block's shape. Every rank gets the same answer: one all-reduce
    (max) of codes, each beside its negation so that the max gives the least too."""
    rows = []
    for (grads, copies), shape in zip(holders, shapes, strict=True):
        width = 2 * mesh_axes + 2 * len(shape) + 1
        if not copies:
            rows.append([_ABSENT] * width)
            continue
        codes = placement_codes([g for g in grads if g is not None], copies)
        block = list(copies[0].to_local().shape) if isinstance(copies[0], DTensor) else list(shape)
        if codes is None or any(tuple(c.to_local().shape) != tuple(block) for c in copies if isinstance(c, DTensor)):
            codes = [_UNSUPPORTED] * mesh_axes
        unchunkable = int(not _chunkable(grads, copies))
        rows.append([*codes, *(-c for c in codes), *block, *(-b for b in block), unchunkable])
    flat = torch.tensor([v for row in rows for v in row], dtype=torch.int64, device=device)
    if flat.numel():
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    values = flat.tolist()
    out: list[tuple[str, tuple[int, ...]]] = []
    start = 0
    for shape in shapes:
        codes_max = values[start : start + mesh_axes]
        codes_min = [-v for v in values[start + mesh_axes : start + 2 * mesh_axes]]
        start += 2 * mesh_axes
        block_max = values[start : start + len(shape)]
        block_min = [-v for v in values[start + len(shape) : start + 2 * len(shape)]]
        start += 2 * len(shape)
        unchunkable = values[start]
        start += 1
        if codes_max == codes_min and block_max == block_min and all(c >= 0 for c in codes_min):
            out.append((BLOCKS, tuple(block_max)))
        elif unchunkable == 0 and len(shape) > 0:
            out.append((CHUNKS, ()))
        else:
            out.append((WHOLE, ()))
    return out


def held_alone(t: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    """Whether `t` (a gradient's local tensor) may be summed into in place: contiguous, and no
    storage shared with one of `others` (the step's other gradients: an add's backward hands one
    tensor to two parameters)."""
    storage = t.untyped_storage().data_ptr()
    return t.is_contiguous() and not any(
        (o.to_local() if isinstance(o, DTensor) else o).untyped_storage().data_ptr() == storage for o in others
    )


def _own_block(grads: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> torch.Tensor:
    """The first gradient's local block to sum into in place, or a copy of it (`held_alone`)."""
    first = grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0]
    return first if held_alone(first, others) else first.clone(memory_format=torch.contiguous_format)


def _as_copy_grads(blocks: Sequence[torch.Tensor], copies: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for local, copy in zip(blocks, copies, strict=True):
        assert isinstance(copy, DTensor)
        out.append(
            DTensor.from_local(
                local, copy.device_mesh, copy.placements, run_check=False, shape=copy.shape, stride=copy.stride()
            )
        )
    return out


def sum_blocks(
    grads: Sequence[torch.Tensor],
    copies: Sequence[torch.Tensor],
    block: tuple[int, ...],
    dtype: torch.dtype,
    others: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """BLOCKS: the summed gradient of every copy this rank holds (`grads`: those of its copies
    that got one; all one placement), each a DTensor of its copy's placements; a rank holding
    none adds zeros of the agreed `block`. The first gradient's block is summed into in place
    (`_own_block`)."""
    buf = _own_block(grads, others) if grads else torch.zeros(block, dtype=dtype, device=device)
    for g in grads[1:]:
        buf.add_(g.to_local() if isinstance(g, DTensor) else g)
    dist.all_reduce(buf, group=group)
    return _as_copy_grads([buf if i == 0 else buf.clone() for i in range(len(copies))], copies)  # each its own


def sum_in_row_chunks(
    grads: dict[int, torch.Tensor],
    copies: Sequence[torch.Tensor],
    shape: torch.Size,
    dtype: torch.dtype,
    chunks: int,
    others: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """CHUNKS: every copy's gradient (`grads`, by the copy's id; a copy without one adds none) of
    the sum over the pp `group`, `chunks` chunks of rows at a time (every rank of the group passes
    the same number: the stage sub-mesh's size, so a chunk is no larger than a block), and no
    chunk above `CHUNK_BYTES` (from the global shape: every rank cuts alike)."""
    rows = shape[0]
    row_bytes = max(1, math.prod(shape[1:]) * dtype.itemsize)
    step = max(1, min(-(-rows // chunks), CHUNK_BYTES // row_bytes))
    held = []  # per copy: the block its sum goes into, its offset, whether it adds its gradient
    for copy in copies:
        assert isinstance(copy, DTensor)
        g = grads.get(id(copy))
        local_shape, offset = compute_local_shape_and_global_offset(shape, copy.device_mesh, copy.placements)
        # the gradient's block itself (or a copy: `_own_block`); chunk k's rows are read before
        # they are written, and no other chunk reads them
        target = _own_block([g], others) if g is not None else torch.zeros(local_shape, dtype=dtype, device=device)
        coords: Sequence[int] = copy.device_mesh.get_coordinate() or ()
        first = all(coords[a] == 0 for a, p in enumerate(copy.placements) if type(p) is Replicate)
        held.append((target, offset, g is not None and first))
    mesh = copies[0].device_mesh if copies and isinstance(copies[0], DTensor) else None
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        buf = torch.zeros((r1 - r0, *shape[1:]), dtype=dtype, device=device)
        for target, offset, adds in held:
            part = _overlap(r0, r1, offset, target.shape)
            if adds and part is not None:
                buf[part[0]].add_(target[part[1]])
        if mesh is not None:  # each copy's chunk whole: a sum over its stage's sub-mesh
            for axis in range(mesh.ndim):
                dist.all_reduce(buf, group=mesh.get_group(axis))
        dist.all_reduce(buf, group=group)  # the copies added
        for target, offset, _ in held:
            part = _overlap(r0, r1, offset, target.shape)
            if part is not None:
                target[part[1]] = buf[part[0]]
    return _as_copy_grads([t for t, _, _ in held], copies)


def _overlap(
    r0: int, r1: int, offset: Sequence[int], block: Sequence[int]
) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where a block at `offset` meets rows [r0, r1) of the whole tensor: (its index in the chunk,
    its index in the block), or None."""
    lo, hi = max(r0, offset[0]), min(r1, offset[0] + block[0])
    if lo >= hi:
        return None
    rest_chunk = tuple(slice(o, o + b) for o, b in zip(offset[1:], block[1:], strict=True))
    rest_block = tuple(slice(0, b) for b in block[1:])
    return (slice(lo - r0, hi - r0), *rest_chunk), (slice(lo - offset[0], hi - offset[0]), *rest_block)
