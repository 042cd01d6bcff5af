"""How one call hands a program its parameter inputs: the module's stored DTensors, each given to
the program's autograd node as it is, unwrapped inside it, and their gradients wrapped back there.

Why not `DTensor.to_local()` per parameter, as a user would: each `to_local` is an autograd
Function of its own (and a fused parameter's parts a chunk view each), and each one's backward
builds its DTensor gradient through `DTensor.from_local`, another autograd Function. For a GPT of 4
blocks (68 program parameters) that cost about 6 ms of a rank's CPU time in forward and 15 ms in
backward per call, next to a 14 ms forward graph (benchmarks/runtime_overhead.py). Here the
program's one node (`RunProgram`) takes the stored tensors directly: its forward reads each local
block, its backward builds each stored tensor's gradient (a fused parameter's parts concatenated)
and wraps it as a DTensor with the stored tensor's own spec, so that autograd accumulates it into
`.grad` exactly as `to_local`'s backward would have.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_global_tensor_info
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate
from torch.distributed.tensor.placement_types import Shard as DShard

from autopar.core.errors import ShardingError
from autopar.core.layout import Layout, Shard, is_balanced
from autopar.core.layout import Partial as LayoutPartial
from autopar.core.meta import ParamPart
from autopar.runtime.program import EmittedProgram


@dataclass(frozen=True)
class ParamFeed:
    """For each program parameter (placeholder order): the index of the source it reads (a stored
    tensor, given once however many parts the program reads of it) and the part of it, or None for
    the whole block. `num_sources` is how many source tensors a call passes."""

    reads: tuple[tuple[int, ParamPart | None], ...]
    num_sources: int

    @staticmethod
    def one_to_one(count: int) -> ParamFeed:
        """Each program parameter is its own source, passed as the local tensor the program reads
        (the calls that keep per-parameter views: deferred weight gradients, accumulation)."""
        return ParamFeed(tuple((i, None) for i in range(count)), count)

    def program_params(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The program's parameter inputs from the call's sources: a DTensor's local block (its
        placements are the ones the program reads: the module checked), or the local tensor given."""
        blocks = [s._local_tensor if isinstance(s, DTensor) else s for s in sources]
        return [part.of(blocks[i]) if part is not None else blocks[i] for i, part in self.reads]

    def source_grads(
        self, param_grads: Sequence[torch.Tensor | None], sources: Sequence[SourceMeta]
    ) -> list[torch.Tensor | None]:
        """Each source's gradient from the program parameters' (local blocks): parts concatenated
        (a part without a gradient counts as zeros, as chunk's backward does), a DTensor source's
        wrapped in its spec."""
        whole: list[torch.Tensor | None] = [None] * self.num_sources
        parts: dict[int, dict[int, torch.Tensor]] = {}
        cut: dict[int, ParamPart] = {}
        for (index, part), grad in zip(self.reads, param_grads, strict=True):
            if grad is None:
                continue
            if part is None:
                before = whole[index]
                whole[index] = grad if before is None else before + grad
            else:
                parts.setdefault(index, {})[part.index] = grad
                cut[index] = part
        for index, found in parts.items():
            part = cut[index]
            meta = sources[index]
            pieces = torch.empty(meta.local_shape, device="meta").chunk(part.count, part.dim)
            joined = torch.cat(
                [
                    found[i] if i in found else torch.zeros(p.shape, dtype=meta.dtype, device=meta.device)
                    for i, p in enumerate(pieces)
                ],
                dim=part.dim,
            )
            before = whole[index]
            whole[index] = joined if before is None else before + joined
        return [
            _dtensor_grad(g, meta.spec) if g is not None and meta.spec is not None else g
            for g, meta in zip(whole, sources, strict=True)
        ]


@dataclass(frozen=True)
class SourceMeta:
    """What building a source's gradient needs after its forward: the DTensor's spec (None for a
    plain tensor), its local block's shape, dtype and device (for the zeros of a part without a
    gradient)."""

    spec: DTensorSpec | None
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(source: torch.Tensor) -> SourceMeta:
        block = source._local_tensor if isinstance(source, DTensor) else source
        spec = source._spec if isinstance(source, DTensor) else None
        return SourceMeta(spec, tuple(block.shape), block.dtype, block.device)


def _dtensor_grad(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """The DTensor gradient `to_local`'s backward would give for `local`: the stored tensor's spec
    (a Partial placement read as Replicate), with the strides the local gradient has."""
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    meta = spec.tensor_meta
    assert meta is not None
    if placements == spec.placements and local.is_contiguous() and meta.stride == contiguous_strides(meta.shape):
        grad_spec = copy.copy(spec)  # a spec of its own: sharding propagation may change it
    else:
        _, stride = compute_global_tensor_info(local, spec.mesh, placements)
        grad_spec = DTensorSpec(
            spec.mesh, placements, tensor_meta=TensorMeta(shape=meta.shape, stride=tuple(stride), dtype=meta.dtype)
        )
    return DTensor(local, grad_spec, requires_grad=False)  # type: ignore[call-arg]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`."""
    strides = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class FeedPlan:
    """A program's sources, computed once per program: for each, the stored tensor's name and the
    placements the program reads it in, or the program's own constant; and the `ParamFeed`."""

    names: tuple[str, ...]  # "" for a constant
    layouts: tuple[Layout | None, ...]
    placements: tuple[tuple[Placement, ...], ...]
    constants: tuple[torch.Tensor | None, ...]
    feed: ParamFeed


def plan_feed(
    program: EmittedProgram, constants: Mapping[str, torch.Tensor], source_layouts: Mapping[str, Layout]
) -> FeedPlan:
    """Each stored tensor `program` reads becomes one source, however many parts it reads of it."""
    names: list[str] = []
    layouts: list[Layout | None] = []
    values: list[torch.Tensor | None] = []
    index_of: dict[str, int] = {}
    reads: list[tuple[int, ParamPart | None]] = []
    for name in program.param_names:
        constant = constants.get(name)
        if constant is not None:
            reads.append((len(names), None))
            names.append("")
            layouts.append(None)
            values.append(constant)
            continue
        part = program.param_parts.get(name)
        source = part.source if part is not None else name
        if source not in index_of:
            index_of[source] = len(names)
            names.append(source)
            layouts.append(source_layouts[source])
            values.append(None)
        reads.append((index_of[source], part))
    placements = tuple(
        tuple(to_dtensor_placements(layout)) if layout is not None else () for layout in layouts
    )
    feed = ParamFeed(tuple(reads), len(names))
    return FeedPlan(tuple(names), tuple(layouts), placements, tuple(values), feed)


def to_dtensor_placements(layout: Layout) -> list[Placement]:
    """A layout's placements as DTensor's. DTensor has no load-balanced split (`BalancedShard`):
    a value handed over as a DTensor (an output, a stored tensor, a local input) in that layout
    is refused by name rather than labelled as a contiguous split it is not."""
    result: list[Placement] = []
    for p in layout.placements:
        if is_balanced(p):
            raise ShardingError(
                f"a value laid out {layout} (the load-balanced sequence split Sb) is handed over as a "
                "DTensor, which has no such placement",
                op="DTensor",
                hint="the plan must turn it into a contiguous split first; report this plan "
                '(PlanOptions(context_parallel="balanced")) as a bug, or use context_parallel="allgather"',
            )
        if isinstance(p, Shard):
            result.append(DShard(p.dim))
        elif isinstance(p, LayoutPartial):
            result.append(Partial())
        else:
            result.append(Replicate())
    return result
