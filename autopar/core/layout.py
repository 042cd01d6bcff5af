"""Placements and layouts.

A `Layout` is one placement per mesh axis plus the global shape and dtype. When several mesh axes
shard the same tensor dim, they nest in mesh-axis order: the earlier axis splits the dim into
outer blocks, the later one splits each block (DTensor's default order).

A dim that its axes do not divide is split like `torch.chunk` (and DTensor): blocks of
`ceil(n / f)`, the last one shorter. Such an uneven dim may be split by one mesh axis only and the
last block may not be empty (`Layout.fits`); then every block but the last has the same size, so
collectives pad the last block to that size and cut the padding off again.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autopar.core.errors import ShardingError


class _Placement:
    """Immutable, interned placement: equal placements are the same object, so the tuples of
    them that layouts compare millions of times during planning compare by identity."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    _kind = 0  # sort order between kinds: Replicate, Partial, Shard (by dim)

    def __lt__(self, other: _Placement) -> bool:
        return (self._kind, getattr(self, "dim", 0)) < (other._kind, getattr(other, "dim", 0))


class Shard(_Placement):
    __slots__ = ("dim", "_hash")
    _kind = 2
    dim: int
    _instances: dict[int, Shard] = {}  # intern table of immutable values

    def __new__(cls, dim: int) -> Shard:
        instance = cls._instances.get(dim)
        if instance is None:
            instance = super().__new__(cls)
            object.__setattr__(instance, "dim", int(dim))
            object.__setattr__(instance, "_hash", hash(("Shard", int(dim))))  # placements key dicts
            cls._instances[dim] = instance
        return instance

    def __reduce__(self) -> tuple[type, tuple[int]]:
        return (Shard, (self.dim,))

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is type(self) and other.dim == self.dim)  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined, no-any-return]

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


class BalancedShard(Shard):
    """A split of `dim` in the load-balanced order of causal context parallelism: the dim is cut
    into `2p` equal chunks on an axis of `p` ranks and rank `i` holds chunk `i` followed by chunk
    `2p-1-i` (torchtitan's and Megatron's CP layout). With a causal mask every rank then has the
    same work, `(2p+1)/(4p)` of a full block of rows, where a contiguous split gives the last rank
    `(2p-1)/p` times the average.

    Nested inside contiguous splits of the same dim by earlier mesh axes, it cuts each of their
    blocks so: where the linears flatten (batch, sequence) into tokens and the batch is split
    down to one sample per rank, `[S(0), Sb(0)]` on the tokens is each sample's sequence
    balanced, the layout `[S(0), Sb(1)]` has on (batch, sequence).

    It is a `Shard` for everything that reads sizes (local shapes, volumes, memory); what differs
    is where a rank's rows lie in the whole dim: `Layout.local_offsets` refuses such a layout
    (`BalancedShardError`), and the code that handles it reads `Layout.local_chunks`. It is only
    ever the innermost axis splitting its dim, into equal chunks of every outer block
    (`Layout.balanced_fits`), and never equal to the contiguous `Shard` of the same dim:
    redistributions between the two reorder."""

    __slots__ = ()
    _kind = 3
    _instances: dict[int, Shard] = {}  # type: ignore[misc]  # its own intern table

    def __new__(cls, dim: int) -> BalancedShard:
        instance = cls._instances.get(dim)
        if instance is None:
            instance = object.__new__(cls)
            object.__setattr__(instance, "dim", int(dim))
            object.__setattr__(instance, "_hash", hash(("BalancedShard", int(dim))))
            cls._instances[dim] = instance
        return instance  # type: ignore[return-value]

    def __reduce__(self) -> tuple[type, tuple[int]]:
        return (BalancedShard, (self.dim,))

    def __repr__(self) -> str:
        return f"BalancedShard(dim={self.dim})"

    def __str__(self) -> str:
        return f"Sb({self.dim})"


def is_balanced(placement: object) -> bool:
    """Whether `placement` is the load-balanced sequence split (`BalancedShard`)."""
    return type(placement) is BalancedShard


def is_balanced_sequence(layout: Layout) -> bool:
    """Whether any dim of `layout` is split in the load-balanced causal order: the planner's
    causal-imbalance factor of a contiguous sequence split does not apply to such a layout."""
    return any(type(p) is BalancedShard for p in layout.placements)


class BalancedShardError(ShardingError):
    """Code that reads a rank's contiguous offsets met a load-balanced split (`BalancedShard`),
    whose rows are two chunks of the dim: it must read `Layout.local_chunks` instead."""


def balanced_order(parts: int) -> tuple[int, ...]:
    """The natural chunk indices (of `2 * parts`) in the order a balanced split lays them out
    end to end: 0, 2p-1, 1, 2p-2, ...; rank i holds positions 2i and 2i+1."""
    order: list[int] = []
    for i in range(parts):
        order += [i, 2 * parts - 1 - i]
    return tuple(order)


def to_balanced(whole: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """`whole`'s dim reordered into the balanced order (its chunks as `balanced_order` lists them),
    so that a contiguous cut into `parts` blocks gives each rank its two chunks."""
    chunks = whole.chunk(2 * parts, dim)
    return torch.cat([chunks[j] for j in balanced_order(parts)], dim)


def from_balanced(ordered: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """The inverse of `to_balanced`: the natural order back from the balanced one."""
    chunks = ordered.chunk(2 * parts, dim)
    position = {j: k for k, j in enumerate(balanced_order(parts))}
    return torch.cat([chunks[position[j]] for j in range(2 * parts)], dim)


def swap_blocks(whole: torch.Tensor, dim: int, outer: int, inner: int) -> torch.Tensor:
    """`whole`'s dim seen as `outer` x `inner` equal blocks, transposed to `inner` x `outer`.

    A redistribution that exchanges a dim's outer axis before gathering its inner ones gathers
    the blocks in (inner, outer) order and puts them back so (`CommStep.swap`); one that
    reduce-scatters an inner axis before exchanging an outer one into the dim puts the blocks in
    that order first."""
    shape = list(whole.shape)
    blocks = whole.reshape(*shape[:dim], outer, inner, shape[dim] // (outer * inner), *shape[dim + 1 :])
    return blocks.transpose(dim, dim + 1).reshape(shape)


class Replicate(_Placement):
    __slots__ = ()
    _instance: Replicate | None = None

    def __new__(cls) -> Replicate:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (Replicate, ())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Replicate)

    def __hash__(self) -> int:
        return hash("Replicate")

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


class Partial(_Placement):
    """Each rank holds a summand; the value is the sum over the axis."""

    __slots__ = ()
    _kind = 1
    _instance: Partial | None = None

    def __new__(cls) -> Partial:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (Partial, ())

    def __eq__(self, other: object) -> bool:
        return other is self or type(other) is Partial

    def __hash__(self) -> int:
        return hash("Partial")

    def __repr__(self) -> str:
        return "Partial()"

    def __str__(self) -> str:
        return "P"


class RowDisjoint(Partial):
    """A pending sum whose summands are row-disjoint: along dim 0 each row is nonzero on at most
    one rank of the axis, the rank whose experts computed it (`autopar.rules.expert_parallel`).

    It is a Partial (every reduction treats it as one, and it becomes a plain Partial for free),
    but unlike a Partial it survives ops that are not linear, as long as they keep a zero row zero
    (SiLU, a product of two such values with the same row owners): on every row, the one nonzero
    summand is the whole value. Which rank owns which row is not in the placement; it follows the
    routing (`offs`) and the expert split of the grouped matmul that made the value, and
    `autopar.passes.propagate` checks that the values an op combines have the same owners. Nothing
    turns another placement into this one: only a grouped matmul over split experts makes it."""

    __slots__ = ()
    _kind = 1
    _instance: RowDisjoint | None = None  # type: ignore[assignment]

    def __new__(cls) -> RowDisjoint:
        if cls._instance is None:
            cls._instance = object.__new__(cls)
        return cls._instance

    def __reduce__(self) -> tuple[type, tuple[()]]:  # type: ignore[override]
        return (RowDisjoint, ())

    def __eq__(self, other: object) -> bool:
        return other is self or type(other) is RowDisjoint

    def __hash__(self) -> int:
        return hash("RowDisjoint")

    def __repr__(self) -> str:
        return "RowDisjoint()"

    def __str__(self) -> str:
        return "D"


Placement = Shard | Replicate | Partial  # a BalancedShard is a Shard

R = Replicate()
P = Partial()
D = RowDisjoint()

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


@dataclass(frozen=True, eq=False)
class Layout:
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for p in self.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < len(self.shape):
                raise ValueError(f"{p} out of range for shape {self.shape}")
        # layouts are dictionary keys everywhere in planning: hash once, index axes once
        key = (self.placements, self.shape, self.dtype)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))
        by_dim: list[list[int]] = [[] for _ in self.shape]
        for a, p in enumerate(self.placements):
            if isinstance(p, Shard):
                by_dim[p.dim].append(a)
        object.__setattr__(self, "_axes", tuple(tuple(axes) for axes in by_dim))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined, no-any-return]

    def __reduce__(self) -> tuple[type, tuple[tuple[Placement, ...], tuple[int, ...], torch.dtype]]:
        # Rebuild from the fields: the cached hash is per process (string hashing is salted), and
        # plans travel between ranks pickled (runtime.wire, read by its allow-listed unpickler).
        return (Layout, (self.placements, self.shape, self.dtype))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Layout):
            return NotImplemented
        return self._hash == other._hash and self._key == other._key  # type: ignore[attr-defined, no-any-return]

    @staticmethod
    def replicated(shape: Sequence[int], ndim_mesh: int, dtype: torch.dtype = torch.float32) -> Layout:
        return Layout((R,) * ndim_mesh, tuple(shape), dtype)

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes splitting `dim`, outermost first."""
        return self._axes[dim]  # type: ignore[attr-defined, no-any-return]

    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial))

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def split_factor(self, dim: int, mesh_shape: Sequence[int]) -> int:
        return math.prod(mesh_shape[a] for a in self.shard_axes(dim))

    def is_even(self, mesh_shape: Sequence[int]) -> bool:
        key = ("even", *mesh_shape)  # planning asks about the same layouts on one mesh millions of times
        memo = self._memo()
        found = memo.get(key)
        if found is None:
            found = memo[key] = all(
                self.shape[d] % self.split_factor(d, mesh_shape) == 0 for d in range(len(self.shape))
            ) and self.balanced_fits(mesh_shape)
        return found  # type: ignore[no-any-return]

    def balanced_dims(self) -> tuple[tuple[int, int], ...]:
        """(dim, mesh axis) of every dim split in the load-balanced order (`BalancedShard`)."""
        return tuple((p.dim, a) for a, p in enumerate(self.placements) if type(p) is BalancedShard)

    def balanced_fits(self, mesh_shape: Sequence[int]) -> bool:
        """Every balanced dim is split by its axis last (innermost), each block of the axes
        before it evenly into `2p` equal chunks."""
        for d, a in self.balanced_dims():
            axes = self.shard_axes(d)
            if axes[-1] != a or self.shape[d] % (self.split_factor(d, mesh_shape) * 2):
                return False
        return True

    def _memo(self) -> dict[tuple[Any, ...], Any]:
        """Per layout: answers that depend only on it and the mesh's sizes (not pickled, not compared)."""
        memo = self.__dict__.get("_answers")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_answers", memo)
        return memo

    def uneven_dims(self, mesh_shape: Sequence[int]) -> list[int]:
        return [d for d in range(len(self.shape)) if self.shape[d] % self.split_factor(d, mesh_shape)]

    def fits(self, mesh_shape: Sequence[int]) -> bool:
        """Even, or every uneven dim split by one axis into non-empty `torch.chunk` blocks."""
        if not self.balanced_fits(mesh_shape):
            return False
        for d in self.uneven_dims(mesh_shape):
            if len(self.shard_axes(d)) != 1 or not chunks_nonempty(self.shape[d], self.split_factor(d, mesh_shape)):
                return False
        return True

    def local_shape(self, mesh_shape: Sequence[int], coords: Sequence[int] | None = None) -> tuple[int, ...]:
        """This rank's block shape; without `coords`, the largest block (what pricing uses).

        The two agree on even layouts; on uneven ones only the last block along a dim is shorter.
        """
        factors = _split_factors(self.placements, len(self.shape), tuple(mesh_shape))
        full = tuple(-(-size // f) for size, f in zip(self.shape, factors))
        if coords is None or all(size % f == 0 for size, f in zip(self.shape, factors)):
            return full
        return tuple(
            min(c, size - self.block_index(d, mesh_shape, coords) * c)
            for d, (size, c) in enumerate(zip(self.shape, full))
        )

    def local_numel(self, mesh_shape: Sequence[int]) -> int:
        key = ("numel", *mesh_shape)
        memo = self._memo()
        found = memo.get(key)
        if found is None:
            found = memo[key] = math.prod(self.local_shape(mesh_shape))
        return found  # type: ignore[no-any-return]

    def local_bytes(self, mesh_shape: Sequence[int]) -> int:
        return self.local_numel(mesh_shape) * _itemsize(self.dtype)

    def block_index(self, dim: int, mesh_shape: Sequence[int], coords: Sequence[int]) -> int:
        """Which of the dim's `split_factor` blocks this rank holds."""
        index = 0
        for a in self.shard_axes(dim):
            index = index * mesh_shape[a] + coords[a]
        return index

    def local_offsets(self, mesh_shape: Sequence[int], coords: Sequence[int]) -> tuple[int, ...]:
        """Where this rank's block starts along each dim. A load-balanced dim (`BalancedShard`)
        has no one start: refused (`BalancedShardError`), so that no caller computes with a
        contiguous offset there; `local_chunks` gives its two chunks."""
        if self.balanced_dims():
            raise BalancedShardError(
                f"layout {self} splits dim(s) {[d for d, _ in self.balanced_dims()]} in the load-balanced "
                "order (two chunks per rank): its rows have no single offset",
                hint='this op cannot take the load-balanced sequence layout; use PlanOptions(context_parallel='
                '"allgather") (a contiguous split) or report the op',
            )
        block = self.local_shape(mesh_shape)  # full blocks: block i starts at i * block, even or not
        return tuple(self.block_index(d, mesh_shape, coords) * block[d] for d in range(len(self.shape)))

    def local_chunks(self, mesh_shape: Sequence[int], coords: Sequence[int], dim: int) -> tuple[tuple[int, int], ...]:
        """(start, length) of each run of the whole dim this rank holds along `dim`, in local
        order: one run for a contiguous split (or none), two for a load-balanced one (chunk i
        and chunk 2p-1-i of the 2p chunks of its block of the outer axes, on an axis of p ranks,
        rank i)."""
        for d, a in self.balanced_dims():
            if d == dim:
                g = mesh_shape[a]
                outer = self.shard_axes(d)[:-1]
                block = self.shape[d] // math.prod(mesh_shape[b] for b in outer)
                start = 0
                for b in outer:
                    start = start * mesh_shape[b] + coords[b]
                start *= block
                c = block // (2 * g)
                i = coords[a]
                return ((start + i * c, c), (start + (2 * g - 1 - i) * c, c))
        block = self.local_shape(mesh_shape)[dim]
        start = self.block_index(dim, mesh_shape, coords) * block
        return ((start, self.local_shape(mesh_shape, coords)[dim]),)

    def local_indices(self, mesh_shape: Sequence[int], coords: Sequence[int], dim: int) -> torch.Tensor:
        """The whole dim's indices this rank holds along `dim`, in local order."""
        return torch.cat(
            [torch.arange(start, start + n, dtype=torch.long) for start, n in self.local_chunks(mesh_shape, coords, dim)]
        )

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


def summed(layout: Layout) -> Layout:
    """`layout` with its pending sums done, its splits kept (a load-balanced one in its order):
    what a stored weight is gathered to for a reader that wants it with pending sums (a bias
    added before a split contraction is read whole)."""
    return Layout(
        tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements), layout.shape, layout.dtype
    )


def settled(layout: Layout) -> Layout:
    """`layout` with its pending sums done and a load-balanced split in the natural order (what
    a user output is handed over as, and what a weight is stored in: a DTensor, which knows only
    contiguous splits)."""
    if len(layout.shape) == 0:
        return Layout.replicated((), len(layout.placements), layout.dtype)
    return Layout(
        tuple(
            Replicate() if isinstance(p, Partial) else Shard(p.dim) if isinstance(p, Shard) else p
            for p in layout.placements
        ),
        layout.shape,
        layout.dtype,
    )


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


def chunks_nonempty(size: int, parts: int) -> bool:
    """Whether `torch.chunk(size, parts)` gives exactly `parts` non-empty blocks."""
    return (parts - 1) * -(-size // parts) < size
