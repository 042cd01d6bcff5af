"""Placements and layouts.

A `Layout` is one placement per mesh axis plus the global shape and dtype. When several mesh axes
shard the same tensor dim, they nest in mesh-axis order: the earlier axis splits the dim into
outer blocks, the later one splits each block (DTensor's default order).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, order=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, order=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, order=True)
class Partial:
    """Each rank holds a summand; the value is the sum over the axis."""

    def __str__(self) -> str:
        return "P"


Placement = Shard | Replicate | Partial

R = Replicate()
P = Partial()

_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "b8",
    torch.uint8: "u8",
}


@dataclass(frozen=True)
class Layout:
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for p in self.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < len(self.shape):
                raise ValueError(f"{p} out of range for shape {self.shape}")

    @staticmethod
    def replicated(shape: Sequence[int], ndim_mesh: int, dtype: torch.dtype = torch.float32) -> Layout:
        return Layout((R,) * ndim_mesh, tuple(shape), dtype)

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes splitting `dim`, outermost first."""
        return _axes_by_dim(self.placements, len(self.shape))[dim]

    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial))

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def split_factor(self, dim: int, mesh_shape: Sequence[int]) -> int:
        return math.prod(mesh_shape[a] for a in self.shard_axes(dim))

    def is_even(self, mesh_shape: Sequence[int]) -> bool:
        return all(self.shape[d] % self.split_factor(d, mesh_shape) == 0 for d in range(len(self.shape)))

    def uneven_dims(self, mesh_shape: Sequence[int]) -> list[int]:
        return [d for d in range(len(self.shape)) if self.shape[d] % self.split_factor(d, mesh_shape)]

    def local_shape(self, mesh_shape: Sequence[int]) -> tuple[int, ...]:
        factors = _split_factors(self.placements, len(self.shape), tuple(mesh_shape))
        return tuple(size // f for size, f in zip(self.shape, factors))

    def local_numel(self, mesh_shape: Sequence[int]) -> int:
        return math.prod(self.local_shape(mesh_shape))

    def local_bytes(self, mesh_shape: Sequence[int]) -> int:
        return self.local_numel(mesh_shape) * _itemsize(self.dtype)

    def block_index(self, dim: int, mesh_shape: Sequence[int], coords: Sequence[int]) -> int:
        """Which of the dim's `split_factor` blocks this rank holds."""
        index = 0
        for a in self.shard_axes(dim):
            index = index * mesh_shape[a] + coords[a]
        return index

    def local_offsets(self, mesh_shape: Sequence[int], coords: Sequence[int]) -> tuple[int, ...]:
        local = self.local_shape(mesh_shape)
        return tuple(self.block_index(d, mesh_shape, coords) * local[d] for d in range(len(self.shape)))

    def with_placement(self, axis: int, placement: Placement) -> Layout:
        placements = list(self.placements)
        placements[axis] = placement
        return Layout(tuple(placements), self.shape, self.dtype)

    def per_axis_str(self) -> str:
        """`[S(0), S(1), P]`: one entry per mesh axis."""
        return "[" + ", ".join(str(p) for p in self.placements) + "]"

    def per_dim_str(self, axis_names: Sequence[str]) -> str:
        """`f32[8/x, 32/yz] +z`: each dim with the axes splitting it, then pending-sum axes."""
        dims = []
        for d, size in enumerate(self.shape):
            axes = "".join(axis_names[a] for a in self.shard_axes(d))
            dims.append(f"{size}/{axes}" if axes else str(size))
        text = f"{_DTYPE_SHORT.get(self.dtype, str(self.dtype).replace('torch.', ''))}[{', '.join(dims)}]"
        partial = "".join(axis_names[a] for a in self.partial_axes())
        return text + (f" +{partial}" if partial else "")

    def __str__(self) -> str:
        return self.per_axis_str()


@functools.lru_cache(maxsize=65536)
def _axes_by_dim(placements: tuple[Placement, ...], ndim: int) -> tuple[tuple[int, ...], ...]:
    by_dim: list[list[int]] = [[] for _ in range(ndim)]
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            by_dim[p.dim].append(a)
    return tuple(tuple(axes) for axes in by_dim)


@functools.lru_cache(maxsize=65536)
def _split_factors(
    placements: tuple[Placement, ...], ndim: int, mesh_shape: tuple[int, ...]
) -> tuple[int, ...]:
    return tuple(math.prod(mesh_shape[a] for a in axes) for axes in _axes_by_dim(placements, ndim))


@functools.lru_cache(maxsize=64)
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def itemsize(dtype: torch.dtype) -> int:
    return _itemsize(dtype)
