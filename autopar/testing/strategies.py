"""Hypothesis strategies for testing sharding rules against the in-process oracle.

Typical property test for a rule of your own::

    @given(data=st.data(), mesh=mesh_shapes())
    def test_my_op(data, mesh):
        shape = data.draw(tensor_shapes(mesh, ndim=2))
        x = random_tensor(shape, generator=torch.Generator().manual_seed(data.draw(seeds())))
        check_random_strategies(data, torch.ops.aten.my_op.default, (x,), {}, mesh, registry)

Tensor dims are drawn as products of mesh axis sizes, so that sharded strategies (including
several axes nested on one dim) survive the evenness filter of `expand` often enough to matter,
and one in five is one larger, so that rules registered `uneven=True` meet `torch.chunk` blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

from autopar.core.layout import BalancedShard, Layout, Partial, Placement, Replicate, Shard, is_balanced
from autopar.core.strategy import Strategy
from autopar.rules.base import RuleRegistry, expand, make_call
from autopar.testing import check_strategy


def mesh_shapes(
    max_axes: int = 4, max_size: int = 3, max_pieces: int = 24
) -> st.SearchStrategy[tuple[int, ...]]:
    """Meshes of 1..max_axes axes with sizes 1..max_size and at most `max_pieces` ranks."""
    return (
        # size-1 axes only ever replicate: keep them rare
        st.lists(st.sampled_from([*range(2, max_size + 1)] * 2 + [1]), min_size=1, max_size=max_axes)
        .map(lambda sizes: _cap_pieces(sizes, max_pieces))
        .map(tuple)
    )


def _cap_pieces(sizes: list[int], max_pieces: int) -> list[int]:
    sizes = list(sizes)
    while math.prod(sizes) > max_pieces:
        biggest = max(range(len(sizes)), key=lambda i: sizes[i])
        sizes[biggest] -= 1
    return sizes


@st.composite
def dim_sizes(draw: st.DrawFn, mesh_shape: Sequence[int], cap: int = 24, allow_one: bool = True) -> int:
    """A dim size: the product of a random subset of mesh axis sizes (kept <= cap), times 1 or 2,
    sometimes plus 1 (uneven blocks), or sometimes 1 (size-1 dims are where broadcasting and view
    bugs live)."""
    if allow_one and draw(st.sampled_from([False] * 7 + [True])):
        return 1
    count = draw(st.sampled_from([*range(len(mesh_shape), 0, -1)] * 2 + [0]))
    axes = draw(st.permutations(range(len(mesh_shape))))[:count]
    size = 1
    for a in axes:
        if size * mesh_shape[a] <= cap:
            size *= mesh_shape[a]
    factor = draw(st.sampled_from([1, 2]))
    size = size * factor if size * factor <= cap else size
    if size > 1 and draw(st.sampled_from([False] * 4 + [True])):
        size += 1
    return max(size, 2 if not allow_one else 1)


@st.composite
def tensor_shapes(
    draw: st.DrawFn,
    mesh_shape: Sequence[int],
    ndim: int | None = None,
    min_dims: int = 1,
    max_dims: int = 3,
    max_numel: int = 4096,
    allow_one: bool = True,
) -> tuple[int, ...]:
    """A shape whose dims are products of mesh sizes, with at most about `max_numel` elements."""
    n = ndim if ndim is not None else draw(st.sampled_from(range(max_dims, min_dims - 1, -1)))
    cap = max(int(max_numel ** (1.0 / max(n, 1))), max(mesh_shape, default=1), 2)
    return tuple(draw(dim_sizes(mesh_shape, cap=cap, allow_one=allow_one)) for _ in range(n))


@st.composite
def placements(draw: st.DrawFn, ndim: int, allow_partial: bool = True) -> Placement:
    options: list[Placement] = [Replicate(), *(Shard(d) for d in range(ndim))]
    if allow_partial:
        options.append(Partial())
    return draw(st.sampled_from(options))


@st.composite
def layouts(
    draw: st.DrawFn,
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    allow_partial: bool = True,
    even: bool = True,
) -> Layout:
    """A random layout of `shape` on the mesh (evenly divisible unless `even=False`; then uneven
    dims are still `Layout.fits`: one axis each, no empty block)."""
    chosen = tuple(draw(placements(len(shape), allow_partial)) for _ in mesh_shape)
    layout = Layout(chosen, tuple(shape), dtype)
    if (even and not layout.is_even(mesh_shape)) or not layout.fits(mesh_shape):
        fixed = tuple(
            Replicate() if isinstance(p, Shard) and p.dim in layout.uneven_dims(mesh_shape) else p
            for p in chosen
        )
        layout = Layout(fixed, tuple(shape), dtype)
    return layout


@st.composite
def layout_pairs(
    draw: st.DrawFn,
    max_axes: int = 4,
    max_ndim: int = 3,
    dtype: torch.dtype = torch.float64,
    uneven: bool = True,
    balanced: bool = False,
) -> tuple[tuple[int, ...], Layout, Layout]:
    """(mesh shape, src, dst): any placements on 1..max_axes axes of size 1..3, with a global
    shape that both layouts split evenly, or with `uneven`, sometimes one more than that where
    both layouts still fit (`torch.chunk` blocks); what a redistribution test needs. With
    `balanced`, load-balanced splits (`BalancedShard`) too, each the last axis on its dim."""
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=max_axes)))
    ndim = draw(st.integers(1 if balanced else 0, max_ndim))
    choices: list[Placement] = [Replicate(), Partial(), *(Shard(d) for d in range(ndim))]
    if balanced:
        choices += [BalancedShard(d) for d in range(ndim)] * 2
    src = _balanced_alone(tuple(draw(st.sampled_from(choices)) for _ in mesh))
    dst = _balanced_alone(tuple(draw(st.sampled_from(choices)) for _ in mesh))
    shape = []
    for d in range(ndim):
        f_src = math.prod(g for g, p in zip(mesh, src) if isinstance(p, Shard) and p.dim == d)
        f_dst = math.prod(g for g, p in zip(mesh, dst) if isinstance(p, Shard) and p.dim == d)
        # a balanced split cuts each block of the axes outside it into 2g chunks
        chunks = [2 * f for f, layout in ((f_src, src), (f_dst, dst)) if BalancedShard(d) in layout]
        shape.append(math.lcm(f_src, f_dst, *chunks) * draw(st.integers(1, 2)))
    for d in range(ndim):
        if not uneven or not draw(st.booleans()):
            continue
        grown = [*shape[:d], shape[d] + 1, *shape[d + 1 :]]
        if Layout(src, tuple(grown), dtype).fits(mesh) and Layout(dst, tuple(grown), dtype).fits(mesh):
            shape = grown
    return mesh, Layout(src, tuple(shape), dtype), Layout(dst, tuple(shape), dtype)


def _balanced_alone(chosen: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """A load-balanced split kept only where it is the last axis on its dim, nested inside the
    contiguous splits of the earlier axes (else contiguous)."""
    last = {p.dim: a for a, p in enumerate(chosen) if isinstance(p, Shard)}
    return tuple(
        Shard(p.dim) if isinstance(p, Shard) and is_balanced(p) and last[p.dim] != a else p
        for a, p in enumerate(chosen)
    )


def seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**31 - 1)


def random_tensor(
    shape: Sequence[int],
    dtype: torch.dtype = torch.float64,
    generator: torch.Generator | None = None,
    low: int = 0,
    high: int = 4,
) -> torch.Tensor:
    """Normal floats, or integers in [low, high), or random bools."""
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), generator=generator, dtype=dtype)
    return torch.randint(low, high, tuple(shape), generator=generator, dtype=dtype)


def candidate_strategies(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mesh_shape: Sequence[int], registry: RuleRegistry
) -> list[Strategy]:
    """Every even full-mesh strategy the registered rule offers for this concrete call."""
    rule = registry.get(op)
    if rule is None:
        raise AssertionError(f"no rule registered for {op}")
    call = make_call(op, args, kwargs, op(*args, **kwargs))
    found = expand(call, rule.strategies(call), mesh_shape, rule.uneven)
    if rule.admits is not None:
        found = [s for s in found if rule.admits(call, s, tuple(mesh_shape))]
    return found


def check_random_strategies(
    data: st.DataObject,
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mesh_shape: Sequence[int],
    registry: RuleRegistry,
    *,
    count: int = 4,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    memory_layouts: Sequence[str] = ("contiguous",),
) -> list[Strategy]:
    """Check `count` of the rule's non-trivial strategies for this call (all when there are no
    more than that) against the full op; returns the strategies checked.

    Each tensor input's local pieces come in a memory layout drawn from `memory_layouts` (pass
    `MEMORY_LAYOUTS`: contiguous, channels-last, reversed dims, not dense), as a compiled program
    may hand them over: a rule whose local call depends on its inputs' strides fails then. Opt-in
    for now: the CPU flash-attention kernel also misreads inputs whose last dim is not dense, and
    not every rule has been made stride-proof yet (docs/layouts-and-rules.md)."""
    options = candidate_strategies(op, args, kwargs, mesh_shape, registry)
    if not options:
        raise AssertionError(f"{op}: no strategy at all on mesh {tuple(mesh_shape)}")
    trivial = [s for s in options if all(lay.is_replicated for lay in (*s.inputs, *s.outputs))]
    if not trivial:
        raise AssertionError(f"{op}: the all-replicated fallback is missing")
    # The replicated fallback is just the op itself: draw from the interesting ones when any.
    pool = [s for s in options if s not in trivial] or trivial
    seed = data.draw(seeds(), label="noise seed")
    tensors = sum(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args, kwargs)))
    memory = [data.draw(st.sampled_from(list(memory_layouts)), label="memory layout") for _ in range(tensors)]
    if len(pool) <= count:
        chosen = list(pool)
    else:
        chosen = [data.draw(st.sampled_from(pool), label="strategy") for _ in range(count)]
    for strategy in chosen:
        generator = torch.Generator().manual_seed(seed)
        check_strategy(
            op, args, kwargs, strategy, mesh_shape, registry, atol=atol, rtol=rtol, generator=generator,
            memory_layouts=memory,
        )
    return chosen


def expert_routings(data: st.DataObject, experts: int) -> list[int]:
    """Rows per expert of a grouped matmul's routing (its `offs` are their cumsum): random, or skewed (one expert given most rows, another none), or every row
    to one expert."""
    kind = data.draw(st.sampled_from(["random", "skewed", "one_expert"]), label="routing")
    counts = [data.draw(st.integers(0, 3)) for _ in range(experts)]
    if kind == "one_expert":
        chosen = data.draw(st.integers(0, experts - 1))
        return [data.draw(st.integers(1, 12)) if e == chosen else 0 for e in range(experts)]
    if kind == "skewed" and experts > 1:
        busy, idle = data.draw(st.permutations(range(experts)))[:2]
        counts[busy] = data.draw(st.integers(8, 16))
        counts[idle] = 0
    return counts
