"""Property tests: reshapes, permutations, splits/cat, slicing and copies against the oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.core.layout import Shard
from autopar.rules.registry import default_registry
from autopar.testing.strategies import (
    candidate_strategies,
    check_random_strategies,
    mesh_shapes,
    random_tensor,
    seeds,
    tensor_shapes,
)

# Each op of a family gets its own examples (sampling the op would leave some untested).
PER_OP = settings(max_examples=8, deadline=None)

aten = torch.ops.aten
REGISTRY = default_registry()
SETTINGS = settings(max_examples=40, deadline=None)

RESHAPES = [aten.view.default, aten._unsafe_view.default, aten.reshape.default]
IDENTITIES = [aten.clone.default, aten.detach.default, aten.alias.default, aten.lift_fresh_copy.default]
PERMUTES = [aten.t.default, aten.transpose.int, aten.permute.default]
SQUEEZES = [aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims]
SPLITS = [aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default, aten.stack.default]
SLICES = [aten.slice.Tensor, aten.select.int]
BACKWARDS = [aten.slice_backward.default, aten.select_backward.default]
SCATTERS = [aten.select_scatter.default, aten.slice_scatter.default]

COMPLEX_VIEWS = [aten.view_as_complex.default, aten.view_as_real.default]
COVERED_OPS = [
    *COMPLEX_VIEWS,
    *RESHAPES,
    *IDENTITIES,
    *PERMUTES,
    *SQUEEZES,
    *SPLITS,
    *SLICES,
    aten.expand.default,
    aten._to_copy.default,
    aten.copy.default,
    *BACKWARDS,
    aten.unbind.int,
    aten.flip.default,
    aten.roll.default,
    aten.constant_pad_nd.default,
    aten.index.Tensor,
    aten.index_put.default,
    aten._unsafe_index.Tensor,
    aten._unsafe_index_put.default,
    aten._assert_tensor_metadata.default,
    aten.repeat.default,
    aten.tril.default,
    aten.triu.default,
    *SCATTERS,
]


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@st.composite
def reshape_target(draw: st.DrawFn, shape: tuple[int, ...]) -> list[int]:
    """Same numel: regroup the dims' prime factors in order (splits/merges), or shuffled (runs
    that neither split nor merge cleanly); size-1 dims sprinkled in; maybe one -1."""
    factors = [p for s in shape for p in _primes(s)]
    if draw(st.booleans()):
        factors = draw(st.permutations(factors))
    dims: list[int] = []
    for p in factors:
        if dims and draw(st.booleans()):
            dims[-1] *= p
        else:
            dims.append(p)
    for _ in range(draw(st.integers(0, 2))):
        dims.insert(draw(st.integers(0, len(dims))), 1)
    if dims and draw(st.booleans()):
        dims[draw(st.integers(0, len(dims) - 1))] = -1
    return dims


@pytest.mark.parametrize("op", RESHAPES, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_reshape(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    x = random_tensor(data.draw(tensor_shapes(mesh, max_dims=4)), generator=torch.Generator().manual_seed(1))
    target = data.draw(reshape_target(tuple(x.shape)))
    if op == aten._unsafe_view.default and -1 in target:
        target[target.index(-1)] = math.prod(x.shape) // math.prod(s for s in target if s != -1)
    check_random_strategies(data, op, (x, target), {}, mesh, REGISTRY, count=3)


@pytest.mark.parametrize("op", PERMUTES + SQUEEZES + IDENTITIES, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_dim_moves(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    max_dims = 2 if op == aten.t.default else 4
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=max_dims))
    if op in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        ones = data.draw(st.lists(st.integers(0, len(shape)), max_size=2))
        for at in sorted(ones, reverse=True):
            shape = shape[:at] + (1,) + shape[at:]
    x = random_tensor(shape, generator=g)
    n = x.ndim
    dim = st.integers(-n, n - 1)
    if op == aten.transpose.int:
        args: tuple = (x, data.draw(dim), data.draw(dim))
    elif op == aten.permute.default:
        args = (x, [d - n if data.draw(st.booleans()) else d for d in data.draw(st.permutations(range(n)))])
    elif op == aten.unsqueeze.default:
        args = (x, data.draw(st.integers(-n - 1, n)))
    elif op == aten.squeeze.dim:
        args = (x, data.draw(dim))
    elif op == aten.squeeze.dims:
        args = (x, data.draw(st.lists(st.integers(0, n - 1), unique=True)))
    else:
        args = (x,)
    check_random_strategies(data, op, args, {}, mesh, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_expand(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    out = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=4))
    lead = data.draw(st.integers(0, len(out)))
    src = tuple(1 if data.draw(st.booleans()) else s for s in out[lead:])
    size = [
        -1 if i >= lead and src[i - lead] == s and data.draw(st.booleans()) else s for i, s in enumerate(out)
    ]
    x = random_tensor(src, generator=g)
    check_random_strategies(data, aten.expand.default, (x, size), {}, mesh, REGISTRY)


@pytest.mark.parametrize("op", SPLITS + SLICES, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_split_cat_slice(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    n = len(shape)
    dim = data.draw(st.integers(-n, n - 1))
    size = shape[dim]
    if op == aten.split.Tensor:
        args: tuple = (random_tensor(shape, generator=g), data.draw(st.integers(1, size)), dim)
    elif op == aten.split_with_sizes.default:
        cut = sorted(data.draw(st.lists(st.integers(0, size), max_size=3)))
        bounds = [0, *cut, size]
        args = (random_tensor(shape, generator=g), [b - a for a, b in zip(bounds, bounds[1:])], dim)
    elif op == aten.cat.default:
        parts = []
        for _ in range(data.draw(st.integers(1, 3))):
            part = list(shape)
            part[dim] = data.draw(st.integers(1, 4))
            parts.append(random_tensor(part, generator=g))
        args = (parts, dim)
    elif op == aten.stack.default:
        count = data.draw(st.integers(1, 3))
        args = ([random_tensor(shape, generator=g) for _ in range(count)], data.draw(st.integers(-n - 1, n)))
    elif op == aten.slice.Tensor:
        start = data.draw(st.sampled_from([None, 0, 1, -2]))
        end = data.draw(st.sampled_from([None, size, -1, 2**63 - 1]))
        args = (random_tensor(shape, generator=g), dim, start, end, data.draw(st.integers(1, 2)))
    else:
        args = (random_tensor(shape, generator=g), dim, data.draw(st.integers(-size, size - 1)))
    check_random_strategies(data, op, args, {}, mesh, REGISTRY)


CASTS = [
    (torch.float64, torch.float32),
    (torch.float32, torch.float64),
    (torch.int64, torch.float64),
    (torch.float64, torch.int64),
    (torch.int64, torch.bool),
    (torch.int64, torch.int32),
]


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(), cast=st.sampled_from(CASTS), copy=st.booleans())
def test_casts_and_copy(
    data: st.DataObject, mesh: tuple[int, ...], cast: tuple[torch.dtype, torch.dtype], copy: bool
) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    src_dtype, dst_dtype = cast
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    if not copy:
        x = random_tensor(shape, src_dtype, generator=g) * 3
        check_random_strategies(data, aten._to_copy.default, (x,), {"dtype": dst_dtype}, mesh, REGISTRY)
        return
    lead = data.draw(st.integers(0, len(shape)))
    src_shape = tuple(1 if data.draw(st.booleans()) else s for s in shape[lead:])
    dst = random_tensor(shape, dst_dtype, generator=g)
    src = random_tensor(src_shape, src_dtype, generator=g) * 3
    check_random_strategies(data, aten.copy.default, (dst, src), {}, mesh, REGISTRY)


@pytest.mark.parametrize("op", [*BACKWARDS, aten.unbind.int], ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_slice_select_backward_and_unbind(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    n = len(shape)
    dim = data.draw(st.integers(-n, n - 1))
    size = shape[dim]
    if op == aten.unbind.int:
        args: tuple = (random_tensor(shape, generator=g), dim)
    elif op == aten.slice_backward.default:
        # the same slices as x[..., start:end:step] in the forward (whole-dim ones included)
        start = data.draw(st.sampled_from([0, 1, -2, 0]))
        end = data.draw(st.sampled_from([2**63 - 1, size, -1]))
        step = data.draw(st.integers(1, 2))
        piece = aten.slice.Tensor(torch.empty(shape), dim, start, end, step)
        args = (random_tensor(piece.shape, generator=g), list(shape), dim, start, end, step)
    else:
        index = data.draw(st.integers(-size, size - 1))
        piece = aten.select.int(torch.empty(shape), dim, index)
        args = (random_tensor(piece.shape, generator=g), list(shape), dim, index)
    check_random_strategies(data, op, args, {}, mesh, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(), value=st.sampled_from([0.0, -100.0]))
def test_constant_pad(data: st.DataObject, mesh: tuple[int, ...], value: float) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    # (left, right) pairs from the last dim backwards; zeros leave a dim alone, negatives crop
    pairs = data.draw(st.integers(1, len(shape)))
    pad = [data.draw(st.sampled_from([0, 0, 1, 2, -1])) for _ in range(2 * pairs)]
    for i in range(pairs):  # never crop a dim to nothing
        if shape[-1 - i] + pad[2 * i] + pad[2 * i + 1] <= 0:
            pad[2 * i] = pad[2 * i + 1] = 0
    dtype = data.draw(st.sampled_from([torch.float64, torch.int64]))
    x = random_tensor(shape, dtype, generator=g)
    check_random_strategies(data, aten.constant_pad_nd.default, (x, pad, value), {}, mesh, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_flip(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    dims = data.draw(
        st.lists(
            st.integers(-len(shape), len(shape) - 1),
            min_size=1,
            max_size=2,
            unique_by=lambda d: d % len(shape),
        )
    )
    x = random_tensor(shape, torch.float64, generator=g)
    checked = check_random_strategies(data, aten.flip.default, (x, dims), {}, mesh, REGISTRY)
    flipped = {d % len(shape) for d in dims}
    assert all(p.dim not in flipped for s in checked for p in s.inputs[0].placements if isinstance(p, Shard))


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_roll(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """Swin's shifted windows: rolled dims stay whole (their elements cross block boundaries),
    the others may be split; with no dims (a roll of the flattened tensor) nothing is split."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    dims = data.draw(
        st.lists(st.integers(-len(shape), len(shape) - 1), min_size=0, max_size=2, unique_by=lambda d: d % len(shape))
    )
    shifts = [data.draw(st.integers(-5, 5)) for _ in dims] if dims else [data.draw(st.integers(-5, 5))]
    x = random_tensor(shape, torch.float64, generator=g)
    checked = check_random_strategies(data, aten.roll.default, (x, shifts, dims), {}, mesh, REGISTRY)
    rolled = {d % len(shape) for d in dims} if dims else set(range(len(shape)))
    assert all(p.dim not in rolled for s in checked for p in s.inputs[0].placements if isinstance(p, Shard))
    offered = candidate_strategies(aten.roll.default, (x, shifts, dims), {}, mesh, REGISTRY)
    assert all(p.dim not in rolled for s in offered for p in s.inputs[0].placements if isinstance(p, Shard))
    splittable = [d for d in range(len(shape)) if d not in rolled and any(1 < m <= shape[d] for m in mesh)]
    if splittable:  # the dims it does not roll may be split (the rule is not all-replicated)
        assert any(isinstance(p, Shard) for s in offered for p in s.inputs[0].placements)


@st.composite
def _broadcasting_to(draw: st.DrawFn, out: tuple[int, ...]) -> tuple[int, ...]:
    drop = draw(st.integers(0, len(out)))
    return tuple(1 if draw(st.integers(0, 3)) == 0 else s for s in out[drop:])


@pytest.mark.parametrize("op", [aten.index.Tensor, aten._unsafe_index.Tensor], ids=str)
@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_index_with_integer_tensors(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    """`x[i, :, j]`-style indexing: adjacent and separated index tensors, broadcasting between them."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3, max_numel=512))
    broadcast = data.draw(tensor_shapes(mesh, min_dims=0, max_dims=2, max_numel=64))
    used = data.draw(
        st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)).filter(lambda u: any(u))
    )
    indices: list[torch.Tensor | None] = [
        random_tensor(data.draw(_broadcasting_to(broadcast)), torch.int64, generator=g, high=size)
        if use
        else None
        for use, size in zip(used, shape)
    ]
    while indices[-1] is None:  # x[i] leaves the trailing dims whole, like x[i, :]
        indices.pop()
    dtype = data.draw(st.sampled_from([torch.float64, torch.int64]))
    x = random_tensor(shape, dtype, generator=g)
    check_random_strategies(data, op, (x, indices), {}, mesh, REGISTRY)


@pytest.mark.parametrize("op", [aten.index_put.default, aten._unsafe_index_put.default], ids=str)
@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(), accumulate=st.booleans())
def test_index_put_with_integer_tensors(
    data: st.DataObject, mesh: tuple[int, ...], accumulate: bool, op: object
) -> None:
    """`x[i, :, j] = v` and `+=` (index's backward, last-token pooling): values of the indexed
    shape or broadcasting to it. Without accumulate the indices are distinct, as the op's result is
    otherwise unspecified."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3, max_numel=512))
    used = data.draw(
        st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)).filter(lambda u: any(u))
    )
    positions = [d for d, u in enumerate(used) if u]
    count = data.draw(st.integers(1, min(shape[d] for d in positions)))
    indices: list[torch.Tensor | None] = []
    for d, size in enumerate(shape):
        if not used[d]:
            indices.append(None)
        elif accumulate:
            indices.append(random_tensor((count,), torch.int64, generator=g, high=size))
        else:
            indices.append(torch.randperm(size, generator=g)[:count])
    while indices[-1] is None:
        indices.pop()
    x = random_tensor(shape, torch.float64, generator=g)
    indexed = aten.index.Tensor(x, indices).shape
    drop = data.draw(st.integers(0, len(indexed)))
    values_shape = tuple(1 if data.draw(st.integers(0, 3)) == 0 else s for s in indexed[drop:])
    values = random_tensor(values_shape, torch.float64, generator=g)
    check_random_strategies(data, op, (x, indices, values, accumulate), {}, mesh, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_index_put_with_a_mask(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """`x[mask] = value` (masked_fill written as assignment)."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3, max_numel=512))
    mask_ndim = data.draw(st.integers(1, len(shape)))
    mask = random_tensor(shape[:mask_ndim], torch.int64, generator=g, high=2).bool()
    x = random_tensor(shape, torch.float64, generator=g)
    value = random_tensor((), torch.float64, generator=g)
    check_random_strategies(data, aten.index_put.default, (x, [mask], value), {}, mesh, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(), sizes=st.booleans())
def test_assert_tensor_metadata(data: st.DataObject, mesh: tuple[int, ...], sizes: bool) -> None:
    """Passes on every rank's block, also when the global size and stride are given."""
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    x = random_tensor(shape, generator=torch.Generator().manual_seed(data.draw(seeds())))
    args: tuple = (x, list(x.shape), list(x.stride()), x.dtype) if sizes else (x, None, None, x.dtype)
    strategies = check_random_strategies(
        data, aten._assert_tensor_metadata.default, args, {"device": x.device}, mesh, REGISTRY
    )
    assert all(len(s.outputs) == 0 for s in strategies)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes())
def test_repeat(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """Tiles, new leading dims and size-1 dims repeated (ALiBi slopes, expanded k/v heads)."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    lead = data.draw(st.integers(0, 2))
    repeats = [data.draw(st.integers(1, 4)) for _ in range(lead + len(shape))]
    x = random_tensor(shape, generator=g)
    assert check_random_strategies(data, aten.repeat.default, (x, repeats), {}, mesh, REGISTRY)


@pytest.mark.parametrize("op", [aten.tril.default, aten.triu.default], ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_triangles(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=2, max_dims=4))
    diagonal = data.draw(st.integers(-2, 2))
    x = random_tensor(shape, generator=g)
    assert check_random_strategies(data, op, (x, diagonal), {}, mesh, REGISTRY)


@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_cat_skips_an_empty_vector_as_torch_does(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """A transformers cache concatenates `torch.tensor([])` with the first keys."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=2, max_dims=4))
    dim = data.draw(st.integers(0, len(shape) - 1))
    parts = [torch.empty(0), random_tensor(shape, generator=g)]
    checked = check_random_strategies(data, aten.cat.default, (parts, dim), {}, mesh, REGISTRY)
    assert checked and all(not s.inputs[0].shard_axes(0) for s in checked)  # never split


@pytest.mark.parametrize("op", SCATTERS, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_select_and_slice_scatter(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    """Writing into one index or a slice of a dim (T5's shifted labels, rotary halves)."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    n = len(shape)
    dim = data.draw(st.integers(-n, n - 1))
    size = shape[dim]
    x = random_tensor(shape, generator=g)
    if op == aten.select_scatter.default:
        index = data.draw(st.integers(-size, size - 1))
        src = random_tensor(aten.select.int(x, dim, index).shape, generator=g)
        args: tuple = (x, src, dim, index)
    else:
        start = data.draw(st.sampled_from([0, 1, None]))
        end = data.draw(st.sampled_from([None, size, -1]))
        step = data.draw(st.integers(1, 2))
        src = random_tensor(aten.slice.Tensor(x, dim, start, end, step).shape, generator=g)
        args = (x, src, dim, start, end, step)
    assert check_random_strategies(data, op, args, {}, mesh, REGISTRY)


@pytest.mark.parametrize("op", COMPLEX_VIEWS, ids=str)
@settings(max_examples=15, deadline=None)
@given(data=st.data(), mesh=mesh_shapes())
def test_complex_views(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    pairs = random_tensor((*shape, 2), generator=g)
    arg = pairs if op == aten.view_as_complex.default else torch.view_as_complex(pairs)
    assert check_random_strategies(data, op, (arg,), {}, mesh, REGISTRY)
