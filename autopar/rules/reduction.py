"""Reductions over a set of dims, and ops that sort or pick along one (sort, topk).

Dims that are not reduced keep their shard (renumbered unless keepdim). Reducing a split dim
leaves each rank the reduction of its block: for `sum` that is a summand of the result, so the
output is Partial; `mean` becomes a local sum over the GLOBAL count (see `local_ops`) for the same
reason. Max/min/arg-reductions and variances of a split dim have no such combine and are not
offered. Partial inputs pass through the linear reductions (sum, mean) and the scan (cumsum).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from autopar.core.layout import P, Placement, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall
from autopar.rules import local_ops
from autopar.rules.base import LocalCall, LocalContext, RuleRegistry, normalize_dim, with_replicated
from autopar.rules.pointwise import partial_ok

aten = torch.ops.aten

FAMILY = "reduction"


@dataclass(frozen=True)
class Reduce:
    """Where a reduction op keeps its dims, keepdim flag, and how split dims may combine."""

    dim_arg: tuple[int, str] | None  # (position, name); None: always all dims
    keepdim_arg: tuple[int, str] | None
    linear: bool  # sum-like: a split reduced dim gives Partial, Partial passes through
    none_flattens: bool = False  # argmax(dim=None) indexes the flattened tensor


def reduced_dims(call: OpCall, how: Reduce) -> tuple[list[int], bool, bool]:
    """(reduced dims, keepdim, flattens) of this call."""
    ndim = call.inputs[0].ndim
    keepdim = bool(call.arg(*how.keepdim_arg, default=False)) if how.keepdim_arg else False
    dims = call.arg(*how.dim_arg) if how.dim_arg else None
    if dims is None and how.none_flattens:
        return list(range(ndim)), keepdim, True
    if isinstance(dims, int):
        dims = [dims]
    if not dims:
        return list(range(ndim)), keepdim, False
    return sorted({normalize_dim(d, ndim) for d in dims}), keepdim, False


def reduction_strategies(call: OpCall, how: Reduce) -> list[AxisStrategy]:
    ndim = call.inputs[0].ndim
    dims, keepdim, flattens = reduced_dims(call, how)
    n_out = len(call.outputs)
    extra_in = len(call.inputs) - 1
    if ndim == 0 or flattens:
        return with_replicated(call, [])
    summable = how.linear and partial_ok(call.inputs[:1], call.outputs)
    result: list[AxisStrategy] = []
    for d in range(ndim):
        ins: tuple[Placement, ...] = (Shard(d),) + (R,) * extra_in
        if d not in dims:
            out_dim = d if keepdim else d - sum(r < d for r in dims)
            result.append(AxisStrategy(ins, (Shard(out_dim),) * n_out))
        elif summable:
            result.append(AxisStrategy(ins, (P,) * n_out))
    if summable:
        result.append(AxisStrategy((P,) + (R,) * extra_in, (P,) * n_out))
    return with_replicated(call, result)


def reduction_rule(how: Reduce) -> Callable[[OpCall], list[AxisStrategy]]:
    def rule(call: OpCall) -> list[AxisStrategy]:
        return reduction_strategies(call, how)

    return rule


def localize_mean(how: Reduce) -> Callable[[LocalContext], LocalCall]:
    """mean -> local sum / global count of reduced elements (exact whether or not they are split)."""

    def localize(ctx: LocalContext) -> LocalCall:
        call = ctx.call
        dims, keepdim, _ = reduced_dims(call, how)
        count = math.prod(call.inputs[0].shape[d] for d in dims)
        dtype = call.kwargs.get("dtype") or call.outputs[0].dtype
        return LocalCall(local_ops.sum_over_count, (ctx.args[0], dims, keepdim, dtype, count), {})

    return localize


def scan_rule(call: OpCall) -> list[AxisStrategy]:
    """`cumsum(x, dim)`: each position depends on all before it along `dim`, which stays whole;
    other dims split freely. Linear, so a Partial input gives a Partial result."""
    ndim = call.inputs[0].ndim
    at = normalize_dim(call.arg(1, "dim"), ndim)
    result = [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(ndim) if d != at]
    if partial_ok(call.inputs, call.outputs):
        result.append(AxisStrategy((P,), (P,)))
    return with_replicated(call, result)


SUM_ALL = Reduce(None, None, linear=True)
SUM_DIMS = Reduce((1, "dim"), (2, "keepdim"), linear=True)
LIST_DIMS = Reduce((1, "dim"), (2, "keepdim"), linear=False)
ARG_DIM = Reduce((1, "dim"), (2, "keepdim"), linear=False, none_flattens=True)
STAT_DIMS = Reduce((1, "dim"), (2, "keepdim"), linear=False)  # var/std: keepdim is kw-only

REDUCTIONS: dict[object, Reduce] = {
    aten.sum.default: SUM_ALL,
    aten.sum.dim_IntList: SUM_DIMS,
    aten.amax.default: LIST_DIMS,
    aten.amin.default: LIST_DIMS,
    aten.logsumexp.default: LIST_DIMS,
    aten.argmax.default: ARG_DIM,
    aten.argmin.default: ARG_DIM,
    aten.max.dim: LIST_DIMS,
    aten.min.dim: LIST_DIMS,
    aten.any.dim: LIST_DIMS,
    aten.var_mean.correction: STAT_DIMS,
    aten.var.correction: STAT_DIMS,
    aten.std.correction: STAT_DIMS,
    # p-norms (ConvNeXt-V2's global response norm, Swin-V2's cosine attention): a split reduced
    # dim would need a pending sum of |x|^p, which no layout says, so it stays whole
    aten.linalg_vector_norm.default: Reduce((2, "dim"), (3, "keepdim"), linear=False),
}

MEANS: dict[object, Reduce] = {
    aten.mean.default: SUM_ALL,
    aten.mean.dim: SUM_DIMS,
}


def along_dim_rule(call: OpCall) -> list[AxisStrategy]:
    """sort / topk reorder or pick along one dim -> (values, indices): the other dims keep their
    shards (an index along `dim` does not depend on them); `dim` stays whole. Not linear."""
    ndim = call.inputs[0].ndim
    position = 2 if call.op == aten.topk.default else 1
    at = normalize_dim(call.arg(position, "dim", -1), max(ndim, 1))
    result = [AxisStrategy((Shard(d),), (Shard(d), Shard(d))) for d in range(ndim) if d != at]
    return with_replicated(call, result)


def histogram_rule(call: OpCall) -> list[AxisStrategy]:
    """`histc(x, bins, min, max)` counts over all elements (the token count per expert of a
    mixture of experts): the counts of the blocks add up, so any split gives a pending sum."""
    x = call.inputs[0]
    summable = partial_ok(call.inputs, call.outputs)
    result = [AxisStrategy((Shard(d),), (P,)) for d in range(x.ndim) if summable]
    return with_replicated(call, result)


def nonzero_static_rule(call: OpCall) -> list[AxisStrategy]:
    """`nonzero_static(mask, size=n)`: the coordinates of the first n nonzero elements, in
    row-major order over the whole mask (the trace makes a mask's count static where the inputs
    decide it, `autopar.passes.value_guards`). Coordinates are global and the order spans every
    block, so it runs on the whole mask."""
    return with_replicated(call, [])


def fft_rule(call: OpCall) -> list[AxisStrategy]:
    """_fft_c2c / _fft_r2c / _fft_c2r(self, dim, ...): every output element mixes the whole of the
    transformed dims, so those stay whole and the others split alike (FNet mixes tokens and hidden
    features by a 2-D FFT). Linear, but complex values carry no pending sums."""
    x = call.inputs[0]
    transformed = {normalize_dim(d, x.ndim) for d in call.arg(1, "dim")}
    strategies = [
        AxisStrategy((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d not in transformed and x.shape[d] > 1
    ]
    return with_replicated(call, strategies)


def register(registry: RuleRegistry) -> None:
    rules = registry.family(FAMILY, uneven=True)
    for op, how in REDUCTIONS.items():
        rules.register(op, reduction_rule(how))
    rules.register(aten.cumsum.default, scan_rule)
    rules.register(aten.histc.default, histogram_rule)
    rules.register(aten.nonzero_static.default, nonzero_static_rule)
    for op in (aten._fft_c2c.default, aten._fft_r2c.default, aten._fft_c2r.default):
        rules.register(op, fft_rule)
    for op in (aten.sort.default, aten.sort.stable, aten.topk.default):
        rules.register(op, along_dim_rule)
    for op, how in MEANS.items():
        rules.register(op, reduction_rule(how), localize=localize_mean(how))
