"""Views and data movement: reshapes, dim permutations, splits/concatenation, slicing (and its
backward), padding, integer indexing, copies.

Partial passes through all of them (they are linear); shards follow the dim they are on.

Reshape (`view`, `_unsafe_view`, `reshape`): ignoring size-1 dims (never evenly split), input and
output dims fall into runs with equal products, and within a run the flat row-major order is
shared. Splitting the OUTERMOST input dim of a run hands each rank a contiguous 1/g of the run,
which is a shard of the outermost output dim of the run exactly when that dim divides by g (the
evenness check of `expand` enforces that, also for nested splits from several mesh axes). A split
of an inner dim of a merged or split run is strided in the other shape, so it is not offered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from autopar.core.layout import P, Placement, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall, TensorSpec
from autopar.rules.base import LocalCall, LocalContext, RuleRegistry, normalize_dim, with_replicated
from autopar.rules.pointwise import broadcast_shard, partial_ok

aten = torch.ops.aten

FAMILY = "views"


def passthrough_partial(call: OpCall, partial_inputs: Sequence[int] | None = None) -> list[AxisStrategy]:
    """Partial on `partial_inputs` (default: all inputs), others R -> all outputs Partial."""
    members = list(range(len(call.inputs))) if partial_inputs is None else list(partial_inputs)
    if not members or not partial_ok([call.inputs[i] for i in members], call.outputs):
        return []
    ins = tuple(P if i in members else R for i in range(len(call.inputs)))
    return [AxisStrategy(ins, (P,) * len(call.outputs))]


def _dim_map_strategies(call: OpCall, mapping: dict[int, int]) -> list[AxisStrategy]:
    """Single-input view: input dim d split <-> output dim mapping[d] split; plus Partial."""
    out: list[AxisStrategy] = [
        AxisStrategy((Shard(d),), (Shard(o),) * len(call.outputs)) for d, o in sorted(mapping.items())
    ]
    return with_replicated(call, out + passthrough_partial(call))


def reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Runs of non-1 dims (src dims, dst dims) with equal products, in order."""
    a = [d for d, s in enumerate(src) if s != 1]
    b = [d for d, s in enumerate(dst) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        ga, gb = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ga.append(a[i])
                pa *= src[a[i]]
                i += 1
            elif pb < pa and j < len(b):
                gb.append(b[j])
                pb *= dst[b[j]]
                j += 1
            else:
                raise ValueError(f"cannot reshape {tuple(src)} to {tuple(dst)}")
        groups.append((ga, gb))
    if i != len(a) or j != len(b):
        raise ValueError(f"cannot reshape {tuple(src)} to {tuple(dst)}")
    return groups


def reshape_rule(call: OpCall) -> list[AxisStrategy]:
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    if 0 in src:
        return with_replicated(call, [])
    mapping = {ga[0]: gb[0] for ga, gb in reshape_groups(src, dst)}
    return _dim_map_strategies(call, mapping)


def localize_shape_arg(ctx: LocalContext) -> LocalCall:
    """`reshape(x, shape)`: the shape argument (not named `size`) becomes the local shape."""
    local = list(ctx.strategy.outputs[0].local_shape(ctx.mesh_shape, ctx.coords))
    return LocalCall(ctx.call.op, (ctx.args[0], local), {})


def permute_rule(call: OpCall) -> list[AxisStrategy]:
    ndim = call.inputs[0].ndim
    order = [normalize_dim(d, ndim) for d in call.arg(1, "dims")]
    return _dim_map_strategies(call, {d: o for o, d in enumerate(order)})


def transpose_rule(call: OpCall) -> list[AxisStrategy]:
    ndim = call.inputs[0].ndim
    if call.op == aten.t.default:
        d0, d1 = 0, max(ndim - 1, 0)
    else:
        d0, d1 = (normalize_dim(call.arg(i, n), ndim) for i, n in ((1, "dim0"), (2, "dim1")))
    swap = {d0: d1, d1: d0}
    return _dim_map_strategies(call, {d: swap.get(d, d) for d in range(ndim)})


def unsqueeze_rule(call: OpCall) -> list[AxisStrategy]:
    ndim = call.inputs[0].ndim
    at = normalize_dim(call.arg(1, "dim"), ndim + 1)
    return _dim_map_strategies(call, {d: d if d < at else d + 1 for d in range(ndim)})


def squeezed_dims(call: OpCall) -> list[int]:
    """The dims this squeeze removes: asked-for dims of GLOBAL size 1."""
    shape = call.inputs[0].shape
    ndim = len(shape)
    if call.op == aten.squeeze.default:
        asked = list(range(ndim))
    else:
        dims = call.arg(1, "dim")
        asked = [dims] if isinstance(dims, int) else list(dims)
        asked = [normalize_dim(d, ndim) for d in asked]
    return sorted({d for d in asked if shape[d] == 1})


def squeeze_rule(call: OpCall) -> list[AxisStrategy]:
    removed = squeezed_dims(call)
    kept = [d for d in range(call.inputs[0].ndim) if d not in removed]
    return _dim_map_strategies(call, {d: o for o, d in enumerate(kept)})


def localize_squeeze(ctx: LocalContext) -> LocalCall:
    """A split dim can be 1 locally but not globally; name exactly the globally removed dims."""
    return LocalCall(aten.squeeze.dims, (ctx.args[0], squeezed_dims(ctx.call)), {})


def expand_rule(call: OpCall) -> list[AxisStrategy]:
    """Kept dims follow; a broadcast (new or size-1) dim can be split from a replicated input."""
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    lead = len(dst) - len(src)
    result: list[AxisStrategy] = []
    for o in range(len(dst)):
        d = o - lead
        if d >= 0 and src[d] == dst[o]:
            result.append(AxisStrategy((Shard(d),), (Shard(o),)))
        elif dst[o] > 1:
            result.append(AxisStrategy((R,), (Shard(o),)))
    return with_replicated(call, result + passthrough_partial(call))


def identity_rule(call: OpCall) -> list[AxisStrategy]:
    """clone/detach/alias/_to_copy: same layout in and out (Partial if the dtype keeps sums)."""
    return _dim_map_strategies(call, {d: d for d in range(call.inputs[0].ndim)})


def split_rule(call: OpCall) -> list[AxisStrategy]:
    """Every piece keeps a shard of another dim; the split dim itself must be whole."""
    ndim = call.inputs[0].ndim
    at = normalize_dim(call.arg(2, "dim", 0), ndim)
    return _dim_map_strategies(call, {d: d for d in range(ndim) if d != at})


def _slice_dim_rule(call: OpCall, drop: bool) -> list[AxisStrategy]:
    ndim = call.inputs[0].ndim
    at = normalize_dim(call.arg(1, "dim", 0), ndim)
    others = [d for d in range(ndim) if d != at]
    mapping = {d: (d if not drop or d < at else d - 1) for d in others}
    return _dim_map_strategies(call, mapping)


def slice_rule(call: OpCall) -> list[AxisStrategy]:
    """A slice that keeps the whole dim (`x[:, :T]` with T the full length: common in traced
    graphs) is a no-op, so even a split dim may pass; the local slice clamps to the block."""
    if call.outputs[0].shape == call.inputs[0].shape:
        return identity_rule(call)
    return _slice_dim_rule(call, drop=False)


def select_rule(call: OpCall) -> list[AxisStrategy]:
    return _slice_dim_rule(call, drop=True)


def _tensor_list(call: OpCall) -> list[TensorSpec]:
    return [t for t in call.args[0] if isinstance(t, TensorSpec)]


def cat_rule(call: OpCall) -> list[AxisStrategy]:
    """All inputs split on the same non-cat dim; all Partial -> Partial. `torch.cat` skips empty
    1-D inputs (a transformers cache starts from `torch.tensor([])`): they stay whole."""
    specs = _tensor_list(call)
    ndim = call.outputs[0].ndim
    skipped = [s.shape == (0,) and ndim != 1 for s in specs]
    if any(s.ndim != ndim and not skip for s, skip in zip(specs, skipped)):
        return with_replicated(call, [])
    at = normalize_dim(call.arg(1, "dim", 0), ndim)
    result = [
        AxisStrategy(tuple(R if skip else Shard(d) for skip in skipped), (Shard(d),))
        for d in range(ndim)
        if d != at
    ]
    return with_replicated(call, result + passthrough_partial(call))


def stack_rule(call: OpCall) -> list[AxisStrategy]:
    specs = _tensor_list(call)
    ndim = call.outputs[0].ndim
    at = normalize_dim(call.arg(1, "dim", 0), ndim)
    result = [
        AxisStrategy((Shard(d),) * len(specs), (Shard(d if d < at else d + 1),)) for d in range(ndim - 1)
    ]
    return with_replicated(call, result + passthrough_partial(call))


def repeat_rule(call: OpCall) -> list[AxisStrategy]:
    """`repeat(x, repeats)` tiles x. A dim repeated once keeps its shard; a new leading dim, or a dim
    of size 1, may be split from a whole input (each rank makes its share of the copies). A tiled
    dim longer than 1 stays whole: its blocks would interleave across ranks. Linear."""
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    repeats = list(call.arg(1, "repeats"))
    lead = len(repeats) - len(src)
    result: list[AxisStrategy] = []
    for o, r in enumerate(repeats):
        d = o - lead
        if d >= 0 and r == 1:
            result.append(AxisStrategy((Shard(d),), (Shard(o),)))
        elif (d < 0 or src[d] == 1) and dst[o] > 1:
            result.append(AxisStrategy((R,), (Shard(o),)))
    return with_replicated(call, result + passthrough_partial(call))


def localize_repeat(ctx: LocalContext) -> LocalCall:
    """The repeats that make this rank's block: its output block over its input block, per dim."""
    out = ctx.strategy.outputs[0].local_shape(ctx.mesh_shape, ctx.coords)
    inp = ctx.strategy.inputs[0].local_shape(ctx.mesh_shape, ctx.coords)
    given = list(ctx.call.arg(1, "repeats"))
    lead = len(out) - len(inp)
    local = [
        out[o] if o < lead else (out[o] // inp[o - lead] if inp[o - lead] else given[o]) for o in range(len(out))
    ]
    return LocalCall(ctx.call.op, (ctx.args[0], local), {})


def select_scatter_rule(call: OpCall) -> list[AxisStrategy]:
    """`select_scatter(self, src, dim, index)` writes src into one index of `dim`: the other dims
    split on self and src alike (src lacks `dim`); `dim` stays whole. Linear in (self, src)."""
    ndim = call.inputs[0].ndim
    at = normalize_dim(call.arg(2, "dim"), ndim)
    result = [AxisStrategy((Shard(d), Shard(d if d < at else d - 1)), (Shard(d),)) for d in range(ndim) if d != at]
    return with_replicated(call, result + passthrough_partial(call))


def slice_scatter_rule(call: OpCall) -> list[AxisStrategy]:
    """`slice_scatter(self, src, dim, start, end, step)` writes src into a slice of `dim`: the other
    dims split on self and src alike, `dim` whole unless the slice is all of it. Linear."""
    ndim = call.inputs[0].ndim
    at = normalize_dim(call.arg(2, "dim", 0), ndim)
    whole = call.inputs[1].shape == call.inputs[0].shape
    result = [AxisStrategy((Shard(d), Shard(d)), (Shard(d),)) for d in range(ndim) if d != at or whole]
    return with_replicated(call, result + passthrough_partial(call))


def triangle_rule(call: OpCall) -> list[AxisStrategy]:
    """tril / triu keep or zero an element by its row and column in the last two dims: leading
    (batch) dims may be split, the last two stay whole. Linear."""
    ndim = call.inputs[0].ndim
    return _dim_map_strategies(call, {d: d for d in range(ndim - 2)})


def copy_rule(call: OpCall) -> list[AxisStrategy]:
    """`copy(self, src)`: result has self's layout; src broadcasts into it and carries the values."""
    dst, src = call.inputs[0].shape, call.inputs[1].shape
    result: list[AxisStrategy] = []
    for o in range(len(dst)):
        if dst[o] > 1:
            src_p = broadcast_shard([src], dst, o)[0]
            result.append(AxisStrategy((Shard(o), src_p), (Shard(o),)))
    if partial_ok(call.inputs[1:], call.outputs):
        ins: tuple[Placement, ...] = (R, P)
        result.append(AxisStrategy(ins, (P,)))
    return with_replicated(call, result)


def flip_rule(call: OpCall) -> list[AxisStrategy]:
    """Dims that are not flipped may be split; a flipped dim's blocks would trade places across
    ranks, so it stays whole. Linear: pending sums pass through (cumsum's backward flips grads)."""
    ndim = call.inputs[0].ndim
    flipped = {normalize_dim(d, ndim) for d in call.arg(1, "dims")}
    result = [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(ndim) if d not in flipped]
    return with_replicated(call, result + passthrough_partial(call))


def roll_rule(call: OpCall) -> list[AxisStrategy]:
    """`roll(x, shifts, dims)` moves elements along the rolled dims, across block boundaries, so
    those dims stay whole and the others may be split (Swin's shifted windows roll H and W of a
    batch-split tensor). With no dims, roll shifts the flattened tensor: every dim stays whole.
    Linear: pending sums pass through (its backward is the opposite roll)."""
    ndim = call.inputs[0].ndim
    dims = list(call.arg(2, "dims", []) or [])
    if not dims:
        return with_replicated(call, passthrough_partial(call))
    rolled = {normalize_dim(d, ndim) for d in dims}
    result = [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(ndim) if d not in rolled]
    return with_replicated(call, result + passthrough_partial(call))


def unbind_rule(call: OpCall) -> list[AxisStrategy]:
    """Every slice keeps the shards of the other dims (renumbered); the unbound dim stays whole."""
    return _slice_dim_rule(call, drop=True)


def slice_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """`slice_backward(grad, input_sizes, dim, ...)` scatters grad into zeros: the inverse of
    `slice`, so the same dims may be split (all of them when the slice was the whole dim)."""
    if call.outputs[0].shape == call.inputs[0].shape:
        return identity_rule(call)
    ndim = call.inputs[0].ndim
    at = normalize_dim(call.arg(2, "dim"), ndim)
    return _dim_map_strategies(call, {d: d for d in range(ndim) if d != at})


def select_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """`select_backward(grad, input_sizes, dim, index)`: grad dims map to the others of the output."""
    ndim = call.outputs[0].ndim
    at = normalize_dim(call.arg(2, "dim"), ndim)
    mapping = {d: d if d < at else d + 1 for d in range(ndim - 1)}
    return _dim_map_strategies(call, mapping)


def localize_input_sizes(ctx: LocalContext) -> LocalCall:
    """The `input_sizes` argument of slice/select_backward is the output's shape: make it local."""
    local = list(ctx.strategy.outputs[0].local_shape(ctx.mesh_shape, ctx.coords))
    return LocalCall(ctx.call.op, (ctx.args[0], local, *ctx.args[2:]), dict(ctx.kwargs))


def constant_pad_rule(call: OpCall) -> list[AxisStrategy]:
    """Unpadded dims follow; padded ones stay whole. Padding with 0 is linear (Partial passes)."""
    ndim = call.inputs[0].ndim
    pad = list(call.arg(1, "pad"))
    padded = {ndim - 1 - i // 2 for i, amount in enumerate(pad) if amount != 0}
    result = [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(ndim) if d not in padded]
    if float(call.arg(2, "value", 0)) == 0.0:
        result += passthrough_partial(call)
    return with_replicated(call, result)


def index_rule(call: OpCall) -> list[AxisStrategy]:
    """`self[indices]` with integer index tensors (None = a whole dim).

    The result holds the broadcast index dims (at the first indexed dim when the indexed dims are
    adjacent, else first) and the unindexed dims of self. An unindexed dim may be split on self
    and result alike; a broadcast dim may be split on the indices that span it (self whole); self
    may be Partial (indexing is linear in it). Boolean masks give data-dependent shapes: whole.
    """
    self_spec, index_specs = call.inputs[0], call.inputs[1:]
    indices = list(call.arg(1, "indices"))
    if any(s.dtype == torch.bool for s in index_specs) or len(indices) > self_spec.ndim:
        return with_replicated(call, [])
    positions = [i for i, x in enumerate(indices) if x is not None]
    out_shape = call.outputs[0].shape
    n_b = len(out_shape) - (self_spec.ndim - len(positions))
    adjacent = positions == list(range(positions[0], positions[-1] + 1)) if positions else True
    first = positions[0] if adjacent and positions else 0
    unindexed = [d for d in range(self_spec.ndim) if d not in positions]
    result: list[AxisStrategy] = []
    for k, d in enumerate(unindexed):
        o = k if (adjacent and d < first) else k + n_b
        result.append(AxisStrategy((Shard(d),) + (R,) * len(index_specs), (Shard(o),)))
    b_shape = out_shape[first : first + n_b]
    for b in range(n_b):
        if b_shape[b] > 1:
            ins = broadcast_shard([s.shape for s in index_specs], b_shape, b)
            result.append(AxisStrategy((R, *ins), (Shard(first + b),)))
    result += passthrough_partial(call, [0])
    return with_replicated(call, result)


def index_put_rule(call: OpCall) -> list[AxisStrategy]:
    """`self[indices] = values` (`+=` with accumulate): the backward of `index.Tensor`, and the
    last-token pooling of decoder sequence classifiers.

    An unindexed dim of self may be split on self, output and the values dim it broadcasts to
    (indices whole). With accumulate the op is linear in (self, values) together, so both may be
    Partial, and the indices' broadcast dims may be split with the values that follow them, self
    Partial: each rank adds its own rows and the sum over ranks holds all of them. A boolean mask
    with one value splits along any dim of self it covers, like a pointwise op.
    """
    self_spec, values = call.inputs[0], call.inputs[-1]
    index_specs = call.inputs[1:-1]
    indices = list(call.arg(1, "indices"))
    accumulate = bool(call.arg(3, "accumulate", False))
    values_at = len(call.inputs) - 1
    result: list[AxisStrategy] = []
    if any(s.dtype == torch.bool for s in index_specs):
        if len(index_specs) == 1 and len(indices) == 1 and values.ndim == 0:
            mask_ndim = index_specs[0].ndim
            for d in range(self_spec.ndim):
                mask = Shard(d) if d < mask_ndim else R
                result.append(AxisStrategy((Shard(d), mask, R), (Shard(d),)))
        return with_replicated(call, result)
    if len(indices) > self_spec.ndim:
        return with_replicated(call, [])
    positions = [i for i, x in enumerate(indices) if x is not None]
    index_shape = tuple(torch.broadcast_shapes(*(s.shape for s in index_specs)))
    n_b = len(index_shape)
    adjacent = positions == list(range(positions[0], positions[-1] + 1)) if positions else True
    first = positions[0] if adjacent and positions else 0
    unindexed = [d for d in range(self_spec.ndim) if d not in positions]
    indexed_ndim = len(unindexed) + n_b

    def values_dim(o: int, size: int) -> Placement:
        vd = o - (indexed_ndim - values.ndim)
        return Shard(vd) if vd >= 0 and values.shape[vd] == size and size != 1 else R

    index_whole = (R,) * len(index_specs)
    for k, d in enumerate(unindexed):
        o = k if (adjacent and d < first) else k + n_b
        result.append(
            AxisStrategy((Shard(d), *index_whole, values_dim(o, self_spec.shape[d])), (Shard(d),))
        )
    if accumulate:
        result += passthrough_partial(call, [0, values_at])
        if partial_ok([self_spec, values], call.outputs):
            b_first = first if adjacent else 0
            for b in range(n_b):
                if index_shape[b] > 1:
                    ins = broadcast_shard([s.shape for s in index_specs], index_shape, b)
                    along = values_dim(b_first + b, index_shape[b])
                    result.append(AxisStrategy((P, *ins, along), (P,)))
    return with_replicated(call, result)


def assert_metadata_rule(call: OpCall) -> list[AxisStrategy]:
    """`_assert_tensor_metadata` (export's dtype checks) computes nothing: any layout is fine."""
    ndim = call.inputs[0].ndim
    result = [AxisStrategy((Shard(d),), ()) for d in range(ndim)] + [AxisStrategy((P,), ())]
    return with_replicated(call, result)


def localize_assert_metadata(ctx: LocalContext) -> LocalCall:
    """Sizes and strides, when given, are global: check only dtype, device and layout locally."""
    kwargs = {k: v for k, v in ctx.kwargs.items() if k not in ("size", "stride")}
    return LocalCall(ctx.call.op, (ctx.args[0], None, None, *ctx.args[3:]), kwargs)


def complex_view_rule(call: OpCall) -> list[AxisStrategy]:
    """view_as_complex ((..., 2) real -> (...) complex) and view_as_real (back): every dim but the
    pair of real and imaginary parts keeps its place and may be split; complex values carry no
    pending sums (no Partial for complex dtypes)."""
    dims = min(call.inputs[0].ndim, call.outputs[0].ndim)
    strategies = [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(dims)]
    return with_replicated(call, strategies)


RULES: dict[object, Callable[[OpCall], list[AxisStrategy]]] = {
    aten.view_as_complex.default: complex_view_rule,
    aten.view_as_real.default: complex_view_rule,
    aten.view.default: reshape_rule,
    aten._unsafe_view.default: reshape_rule,
    aten.t.default: transpose_rule,
    aten.transpose.int: transpose_rule,
    aten.permute.default: permute_rule,
    aten.unsqueeze.default: unsqueeze_rule,
    aten.expand.default: expand_rule,
    aten.split.Tensor: split_rule,
    aten.split_with_sizes.default: split_rule,
    aten.cat.default: cat_rule,
    aten.stack.default: stack_rule,
    aten.slice.Tensor: slice_rule,
    aten.select.int: select_rule,
    aten.clone.default: identity_rule,
    aten.detach.default: identity_rule,
    aten.alias.default: identity_rule,
    aten.lift_fresh_copy.default: identity_rule,
    aten._to_copy.default: identity_rule,
    aten.copy.default: copy_rule,
    aten.unbind.int: unbind_rule,
    aten.flip.default: flip_rule,
    aten.roll.default: roll_rule,
    aten.constant_pad_nd.default: constant_pad_rule,
    aten.index.Tensor: index_rule,
    aten.index_put.default: index_put_rule,
    aten._unsafe_index.Tensor: index_rule,  # upsampling (MobileViT, PVT)
    aten._unsafe_index_put.default: index_put_rule,
}


def register(registry: RuleRegistry) -> None:
    rules = registry.family(FAMILY, uneven=True)
    for op, rule in RULES.items():
        rules.register(op, rule)
    rules.register(aten.reshape.default, reshape_rule, localize=localize_shape_arg)
    rules.register(
        aten.slice_backward.default,
        slice_backward_rule,
        localize=localize_input_sizes,
    )
    rules.register(
        aten.select_backward.default,
        select_backward_rule,
        localize=localize_input_sizes,
    )
    rules.register(
        aten._assert_tensor_metadata.default,
        assert_metadata_rule,
        localize=localize_assert_metadata,
    )
    for op in (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims):
        rules.register(op, squeeze_rule, localize=localize_squeeze)
    rules.register(aten.repeat.default, repeat_rule, localize=localize_repeat)
    for op in (aten.tril.default, aten.triu.default):
        rules.register(op, triangle_rule)
    rules.register(aten.select_scatter.default, select_scatter_rule)
    rules.register(aten.slice_scatter.default, slice_scatter_rule)
