"""Neural-network ops: embedding, attention, convolution, softmax, layer norm, losses, gather/scatter,
activations.

Each rule says which dims are independent "rows" of the computation (they may be split on every
tensor consistently) and which are mixed (softmax dim, normalized dims, attention sequence and
head_dim), and where a result is a sum over a split dim (Partial).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from autopar.core.layout import P, Placement, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall, TensorSpec
from autopar.rules import context_parallel, local_ops, ring_attention
from autopar.rules.base import LocalCall, LocalContext, RuleRegistry, normalize_dim, with_replicated
from autopar.rules.pointwise import (
    FIRST,
    NONE,
    Linearity,
    broadcast_shard,
    partial_ok,
    pointwise_rule,
    pointwise_strategies,
)
from autopar.rules.views import passthrough_partial

aten = torch.ops.aten

FAMILY = "nn"

# ---------------------------------------------------------------- embedding


def embedding_rule(call: OpCall) -> list[AxisStrategy]:
    """Column split -> last dim split; index split -> same dim; vocab (row) split -> Partial."""
    weight, indices = call.inputs[0], call.inputs[1]
    out_nd = call.outputs[0].ndim
    result = [AxisStrategy((Shard(1), R), (Shard(out_nd - 1),))]
    result += [AxisStrategy((R, Shard(d)), (Shard(d),)) for d in range(indices.ndim)]
    if partial_ok([weight], call.outputs):
        result.append(AxisStrategy((P, R), (P,)))
        result.append(AxisStrategy((Shard(0), R), (P,)))
    return with_replicated(call, result)


def localize_embedding(ctx: LocalContext) -> LocalCall:
    """A rank holding a block of vocabulary rows looks up only those rows (zeros elsewhere)."""
    layout = ctx.strategy.inputs[0]
    if not layout.shard_axes(0):
        return LocalCall(ctx.call.op, ctx.args, ctx.kwargs)
    offset = layout.local_offsets(ctx.mesh_shape, ctx.coords)[0]
    return LocalCall(local_ops.embedding_row_block, (ctx.args[0], ctx.args[1], offset), {})


def embedding_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """Tokens split on grad and indices alike -> Partial weight grad; embed dim split -> dim 1."""
    grad, indices = call.inputs[0], call.inputs[1]
    result = [AxisStrategy((Shard(grad.ndim - 1), R), (Shard(1),)), AxisStrategy((R, R), (Shard(0),))]
    summable = partial_ok([grad], call.outputs)
    # scale_grad_by_freq divides by counts over ALL tokens: a rank with some tokens cannot.
    if summable and not call.arg(4, "scale_grad_by_freq", False):
        result += [AxisStrategy((Shard(d), Shard(d)), (P,)) for d in range(indices.ndim)]
    if summable:
        result.append(AxisStrategy((P, R), (P,)))
    return with_replicated(call, result)


def localize_embedding_backward(ctx: LocalContext) -> LocalCall:
    layout = ctx.strategy.outputs[0]
    if not layout.shard_axes(0):
        return LocalCall(ctx.call.op, ctx.args, ctx.kwargs)
    call = ctx.call
    offset = layout.local_offsets(ctx.mesh_shape, ctx.coords)[0]
    rows = layout.local_shape(ctx.mesh_shape, ctx.coords)[0]
    args = (
        ctx.args[0],
        ctx.args[1],
        int(call.arg(2, "num_weights")),
        offset,
        rows,
        int(call.arg(3, "padding_idx")),
        bool(call.arg(4, "scale_grad_by_freq")),
    )
    return LocalCall(local_ops.embedding_backward_row_block, args, {})


# ---------------------------------------------------------------- attention


def _attention_strategies(call: OpCall, n_main: int, grad_linear: bool) -> list[AxisStrategy]:
    """Batch (0) and heads (1) split on every tensor; an optional trailing attn_mask follows by
    broadcasting against the (B, H, L, S) scores. And the query-sequence split of
    `context_parallel` (keys and values whole, their gradients partial sums)."""
    q = call.inputs[1 if grad_linear else 0]
    k = call.inputs[2 if grad_linear else 1]
    main = call.inputs[:n_main]
    scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    masks = call.inputs[n_main:]
    result: list[AxisStrategy] = []
    for d in (0, 1):
        if any(t.shape[d] != q.shape[d] for t in main):
            continue
        mask_p = [broadcast_shard([m.shape], scores, d)[0] for m in masks]
        ins: tuple[Placement, ...] = (Shard(d),) * n_main + tuple(mask_p)
        result.append(AxisStrategy(ins, (Shard(d),) * len(call.outputs)))
    # Backward is linear in grad_out with q, k, v, out and logsumexp fixed.
    if grad_linear and partial_ok(call.inputs[:1], call.outputs):
        ins = (P,) + (R,) * (len(call.inputs) - 1)
        result.append(AxisStrategy(ins, (P,) * len(call.outputs)))
    # Queries split along the sequence, keys and values whole or passed around a ring
    # (context parallelism).
    result += context_parallel.sequence_strategies(call)
    return with_replicated(call, result)


def sdpa_rule(call: OpCall) -> list[AxisStrategy]:
    """(query, key, value[, attn_mask]) -> (output, logsumexp)."""
    return _attention_strategies(call, 3, grad_linear=False)


def sdpa_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """(grad_out, query, key, value, out, logsumexp[, attn_mask]) -> (dq, dk, dv)."""
    return _attention_strategies(call, 6, grad_linear=True)


# ---------------------------------------------------------------- softmax / layer norm


def _rows_rule(call: OpCall, mixed: set[int], linear_first: bool) -> list[AxisStrategy]:
    """Inputs and outputs of one shape; any dim outside `mixed` may be split on all of them."""
    ndim = call.inputs[0].ndim
    n_in, n_out = len(call.inputs), len(call.outputs)
    result = [AxisStrategy((Shard(d),) * n_in, (Shard(d),) * n_out) for d in range(ndim) if d not in mixed]
    if linear_first:
        result += passthrough_partial(call, [0])
    return with_replicated(call, result)


def softmax_rule(call: OpCall) -> list[AxisStrategy]:
    ndim = call.inputs[0].ndim
    return _rows_rule(call, {normalize_dim(call.arg(1, "dim"), ndim)}, linear_first=False)


def softmax_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """Linear in grad_output given the forward output."""
    ndim = call.inputs[0].ndim
    return _rows_rule(call, {normalize_dim(call.arg(2, "dim"), ndim)}, linear_first=True)


def layer_norm_rule(call: OpCall) -> list[AxisStrategy]:
    """(input, weight?, bias?) -> (out, mean, rstd); leading dims split, weight/bias whole."""
    x = call.inputs[0]
    axis = x.ndim - len(call.arg(1, "normalized_shape"))
    extra = (R,) * (len(call.inputs) - 1)
    result = [AxisStrategy((Shard(d),) + extra, (Shard(d),) * 3) for d in range(axis)]
    return with_replicated(call, result)


def layer_norm_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """(grad_out, input, mean, rstd, weight?, bias?) -> masked (grad_input, grad_weight, grad_bias).

    A split leading dim gives each rank part of the sum over rows that makes grad_weight and
    grad_bias: those are Partial. Everything is linear in grad_out.
    """
    x = call.inputs[1]
    axis = x.ndim - len(call.arg(2, "normalized_shape"))
    mask = list(call.arg(7, "output_mask"))
    n_in, n_out = len(call.inputs), len(call.outputs)
    extra = (R,) * (n_in - 4)
    result = []
    for d in range(axis):
        outs: tuple[Placement, ...] = ((Shard(d),) if mask[0] else ()) + (P,) * (n_out - int(mask[0]))
        result.append(AxisStrategy((Shard(d),) * 4 + extra, outs))
    if partial_ok(call.inputs[:1], call.outputs):
        result.append(AxisStrategy((P,) + (R,) * (n_in - 1), (P,) * n_out))
    return with_replicated(call, result)


# ---------------------------------------------------------------- losses


def replicated_only(call: OpCall) -> list[AxisStrategy]:
    """Ops the compiler decomposes before propagation; all-Replicate keeps them runnable."""
    return with_replicated(call, [])


def mse_loss_rule(call: OpCall) -> list[AxisStrategy]:
    """reduction none: pointwise; sum/mean: any split dim gives a Partial scalar."""
    if int(call.arg(2, "reduction", 1)) == 0:
        return pointwise_strategies(call, NONE)
    out_shape = tuple(max(a, b) for a, b in zip(call.inputs[0].shape, call.inputs[1].shape))
    if call.inputs[0].ndim != call.inputs[1].ndim:
        return with_replicated(call, [])
    shapes = [i.shape for i in call.inputs]
    result = [
        AxisStrategy(tuple(broadcast_shard(shapes, out_shape, d)), (P,))
        for d in range(len(out_shape))
        if out_shape[d] > 1
    ]
    return with_replicated(call, result)


def localize_mse_loss(ctx: LocalContext) -> LocalCall:
    call = ctx.call
    if int(call.arg(2, "reduction", 1)) != 1:
        return LocalCall(call.op, ctx.args, ctx.kwargs)
    count = math.prod(max(a, b) for a, b in zip(call.inputs[0].shape, call.inputs[1].shape))
    return LocalCall(local_ops.squared_error_over_count, (ctx.args[0], ctx.args[1], count), {})


def mse_loss_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """(grad, self, target): elementwise (a reduced loss's scalar grad broadcasts, so stays whole);
    linear in grad, and in (self, target) together."""
    return pointwise_strategies(call, ((0,), (1, 2)))


def localize_mse_loss_backward(ctx: LocalContext) -> LocalCall:
    """reduction=mean divides by the element count: the GLOBAL one, not the block's."""
    call = ctx.call
    if int(call.arg(3, "reduction")) != 1:
        return LocalCall(call.op, ctx.args, ctx.kwargs)
    count = math.prod(call.outputs[0].shape)
    return LocalCall(local_ops.mse_grad_over_count, (*ctx.args[:3], count), {})


# ---------------------------------------------------------------- gather / scatter


def gather_rule(call: OpCall) -> list[AxisStrategy]:
    """Dims other than `dim` split on self, index and output alike; the gather dim of the index
    may be split with self whole (each position looks up the full self)."""
    src, index = call.inputs[0], call.inputs[1]
    at = normalize_dim(call.arg(1, "dim"), max(src.ndim, 1))
    result = [
        AxisStrategy((Shard(d), Shard(d)), (Shard(d),))
        for d in range(index.ndim)
        if d != at and src.shape[d] == index.shape[d]
    ]
    if index.ndim:
        result.append(AxisStrategy((R, Shard(at)), (Shard(at),)))
    result += passthrough_partial(call, [0])
    return with_replicated(call, result)


def index_select_rule(call: OpCall) -> list[AxisStrategy]:
    """index_select(self, dim, index): dims other than `dim` split on self and output alike (every
    rank picks the same rows of its block); a split index with self whole splits the output's
    `dim` (each rank picks its own rows: a sinusoidal position table read at the positions);
    linear in self."""
    src, index = call.inputs[0], call.inputs[1]
    at = normalize_dim(call.arg(1, "dim"), max(src.ndim, 1))
    result = [AxisStrategy((Shard(d), R), (Shard(d),)) for d in range(src.ndim) if d != at]
    if index.ndim == 1 and src.ndim:
        result.append(AxisStrategy((R, Shard(0)), (Shard(at),)))
    result += passthrough_partial(call, [0])
    return with_replicated(call, result)


def _split_beside_dim(call: OpCall) -> list[AxisStrategy]:
    """A scatter's strategies that split one dim other than its `dim` on every tensor alike, where
    every tensor has that dim at one length: each rank scatters within its own columns."""
    at = normalize_dim(call.arg(1, "dim"), max(call.inputs[0].ndim, 1))
    tensors = call.inputs
    return [
        AxisStrategy((Shard(d),) * len(tensors), (Shard(d),))
        for d in range(tensors[0].ndim)
        if d != at and all(t.ndim == tensors[0].ndim and t.shape[d] == tensors[0].shape[d] for t in tensors)
    ]


def scatter_rule(call: OpCall) -> list[AxisStrategy]:
    """scatter.src / scatter.value / scatter_add: dims other than `dim` split on all tensors when
    they agree; linear in (self, src) together."""
    result = _split_beside_dim(call)
    if call.op in (aten.scatter.src, aten.scatter_add.default):
        result += passthrough_partial(call, [0, 2])
    elif float(call.arg(3, "value")) == 0.0:
        result += passthrough_partial(call, [0])
    return with_replicated(call, result)


def scatter_reduce_rule(call: OpCall) -> list[AxisStrategy]:
    """scatter_reduce.two(self, dim, index, src, reduce, include_self): each position of self
    reduces the src values its index sends there along `dim` (TAPAS's segment sums, means and
    maxima): dims other than `dim` split on all three alike, each rank reducing its own columns;
    for "sum" linear in (self, src) together."""
    result = _split_beside_dim(call)
    if call.arg(4, "reduce") == "sum":
        result += passthrough_partial(call, [0, 2])
    return with_replicated(call, result)


def index_add_rule(call: OpCall) -> list[AxisStrategy]:
    """index_add(self, dim, index, source): rows of source added into self at index along `dim`
    (mixture-of-experts combine). Other dims split on self and source alike, the 1-D index whole;
    linear in (self, source) together."""
    self_, _, source = call.inputs
    at = normalize_dim(call.arg(1, "dim"), max(self_.ndim, 1))
    result = [
        AxisStrategy((Shard(d), R, Shard(d)), (Shard(d),))
        for d in range(self_.ndim)
        if d != at and source.ndim == self_.ndim and source.shape[d] == self_.shape[d]
    ]
    result += passthrough_partial(call, [0, 2])
    return with_replicated(call, result)


def batch_norm_rule(call: OpCall) -> list[AxisStrategy]:
    """The fused batch-norm ops, forward (training or not) and backward, as traced on one rank:
    everything is per channel, so the channel dim may be split (dim 1 of (N, C, ...) tensors, dim 0
    of the per-channel vectors; empty placeholder outputs stay whole). With more ranks they are
    decomposed into sums first (`autopar.rules.decompositions`), where the batch may be split."""

    def channel(spec: TensorSpec) -> Placement:
        if spec.ndim >= 2:
            return Shard(1)
        return Shard(0) if spec.ndim == 1 and spec.shape[0] > 0 else R

    result = [AxisStrategy(tuple(map(channel, call.inputs)), tuple(map(channel, call.outputs)))]
    return with_replicated(call, result)


def group_norm_rule(call: OpCall) -> list[AxisStrategy]:
    """native_group_norm(x, w, b, N, C, HxW, groups, eps) -> (out, mean, rstd) and its backward
    (grad, x, mean, rstd, w, N, C, HxW, groups, mask) -> (grad_x, grad_w, grad_b): each sample is
    normalized alone, so the batch dim splits (per-sample statistics with it, per-channel weight
    gradients as pending sums); the channels of a group are normalized together and stay whole."""
    if call.inputs[0].shape[0] < 2:
        return with_replicated(call, [])
    ins = tuple(Shard(0) if spec.ndim >= 2 else R for spec in call.inputs)
    backward = call.op == aten.native_group_norm_backward.default
    if backward and not partial_ok(call.inputs, call.outputs):
        return with_replicated(call, [])
    outs = tuple(Shard(0) if spec.ndim >= 2 else P for spec in call.outputs)
    return with_replicated(call, [AxisStrategy(ins, outs)])


def localize_group_norm(ctx: LocalContext) -> LocalCall:
    """The op takes the batch size N as a number: a rank with a block of the batch passes its own.
    Its CPU kernels read their tensors in the input's memory format (the backward without checking
    that the gradient is laid out alike), which a rank's blocks need not share with the serial
    trace's: the local call makes them contiguous in it first, as eager autograd does."""
    backward = ctx.call.op == aten.native_group_norm_backward.default
    at = 5 if backward else 3
    args = list(ctx.args)
    args[at] = ctx.strategy.inputs[0].local_shape(ctx.mesh_shape, ctx.coords)[0]  # x, or grad (x's shape)
    target = local_ops.group_norm_backward_block if backward else local_ops.group_norm_block
    return LocalCall(target, tuple(args), ctx.kwargs)


# ---------------------------------------------------------------- convolution


def _weight_dims(transposed: bool) -> tuple[int, int]:
    """(out-channel dim, in-channel dim) of the weight: (out, in/g, k...) or, transposed, (in, out/g, k...)."""
    return (1, 0) if transposed else (0, 1)


def convolution_rule(call: OpCall) -> list[AxisStrategy]:
    """(input, weight, bias?) -> out, N C_out spatial... Batch split: weight whole. Out-channel
    split: weight (and bias) split on their out-channel dim, output on dim 1. In-channel split:
    input dim 1 and the weight's in-channel dim, each rank a partial sum (bias Partial). Spatial
    dims need halos and are not split. Linear in input and in weight separately."""
    has_bias = len(call.inputs) == 3
    out_d, in_d = _weight_dims(bool(call.arg(6, "transposed")))
    summable = partial_ok(call.inputs, call.outputs)

    def strategy(x: Placement, w: Placement, b: Placement, out: Placement) -> AxisStrategy:
        return AxisStrategy((x, w, b) if has_bias else (x, w), (out,))

    result = [strategy(Shard(0), R, R, Shard(0))]
    if int(call.arg(8, "groups")) == 1:
        result.append(strategy(R, Shard(out_d), Shard(0), Shard(1)))
        if summable:
            result.append(strategy(Shard(1), Shard(in_d), P, P))
    if summable:
        result += [strategy(P, R, P, P), strategy(R, P, P, P)]
    return with_replicated(call, result)


def convolution_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """(grad_out, input, weight) -> (grad_input, grad_weight, grad_bias), the masked-out ones absent.

    The splits of the forward, seen from the gradients: batch -> weight and bias grads are sums
    over the batch (Partial); out channels -> grad_input sums over them (Partial), weight/bias
    grads split; in channels -> grad_input and grad_weight split, grad_bias whole. Linear in
    grad_out with input and weight fixed.
    """
    mask = [bool(m) for m in call.arg(10, "output_mask")]
    out_d, in_d = _weight_dims(bool(call.arg(7, "transposed")))
    summable = partial_ok(call.inputs, call.outputs)

    def strategy(ins: tuple[Placement, ...], outs: tuple[Placement, ...]) -> AxisStrategy:
        return AxisStrategy(ins, tuple(o for o, m in zip(outs, mask) if m))

    options: list[tuple[tuple[Placement, ...], tuple[Placement, ...]]] = [
        ((Shard(0), Shard(0), R), (Shard(0), P, P))
    ]
    if int(call.arg(9, "groups")) == 1:
        options.append(((Shard(1), R, Shard(out_d)), (P, Shard(out_d), Shard(0))))
        options.append(((R, Shard(1), Shard(in_d)), (Shard(1), Shard(in_d), R)))
    options.append(((P, R, R), (P, P, P)))
    result = [
        strategy(ins, outs) for ins, outs in options if summable or not any(o == P for o in (*ins, *outs))
    ]
    return with_replicated(call, result)


def localize_convolution_backward(ctx: LocalContext) -> LocalCall:
    """`bias_sizes` is the global channel count; a rank with split out channels has fewer."""
    args = list(ctx.args)
    if ctx.call.arg(3, "bias_sizes") is not None:
        args[3] = [ctx.strategy.inputs[0].local_shape(ctx.mesh_shape, ctx.coords)[1]]
    return LocalCall(ctx.call.op, tuple(args), dict(ctx.kwargs))


# ---------------------------------------------------------------- registration

ACTIVATIONS: dict[object, Linearity] = {
    aten.gelu.default: NONE,
    aten.relu.default: NONE,
    aten.tanh.default: NONE,
    aten.gelu_backward.default: FIRST,
    aten.threshold_backward.default: FIRST,
}

RULES: dict[object, Callable[[OpCall], list[AxisStrategy]]] = {
    aten._softmax.default: softmax_rule,
    aten._safe_softmax.default: softmax_rule,  # rows all -inf give 0 (masked attention)
    aten._log_softmax.default: softmax_rule,
    aten._softmax_backward_data.default: softmax_backward_rule,
    aten._log_softmax_backward_data.default: softmax_backward_rule,
    aten.native_layer_norm.default: layer_norm_rule,
    aten.native_layer_norm_backward.default: layer_norm_backward_rule,
    aten.nll_loss_forward.default: replicated_only,
    aten.nll_loss_backward.default: replicated_only,
    aten.gather.default: gather_rule,
    aten.index_select.default: index_select_rule,
    aten.scatter.src: scatter_rule,
    aten.scatter.value: scatter_rule,
    aten.scatter_add.default: scatter_rule,
    aten.scatter_reduce.two: scatter_reduce_rule,
    aten.index_add.default: index_add_rule,
    aten._native_batch_norm_legit_functional.default: batch_norm_rule,
    aten._native_batch_norm_legit_no_training.default: batch_norm_rule,
    aten._native_batch_norm_legit.no_stats: batch_norm_rule,
    aten.native_batch_norm_backward.default: batch_norm_rule,
}

ANCHORS: dict[object, Callable[[OpCall], list[AxisStrategy]]] = {
    aten.convolution.default: convolution_rule,
}

ATTENTION: dict[object, Callable[[OpCall], list[AxisStrategy]]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: sdpa_rule,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: sdpa_backward_rule,
}


def register(registry: RuleRegistry) -> None:
    rules = registry.family(FAMILY, uneven=True)
    for op, linear in ACTIVATIONS.items():
        rules.register(op, pointwise_rule(linear))
    for op, rule in RULES.items():
        rules.register(op, rule)
    for op, rule in ANCHORS.items():
        rules.register(op, rule, anchor=True)
    for op, rule in ATTENTION.items():  # causal with a split sequence: the rows' own mask
        rules.register(
            op, rule, localize=context_parallel.localize_attention, anchor=True, admits=ring_attention.without_ring
        )
    rules.register(
        aten.convolution_backward.default,
        convolution_backward_rule,
        localize=localize_convolution_backward,
        anchor=True,
    )
    for op in (aten.native_group_norm.default, aten.native_group_norm_backward.default):
        rules.register(op, group_norm_rule, localize=localize_group_norm)
    rules.register(aten.mse_loss.default, mse_loss_rule, localize=localize_mse_loss)
    rules.register(
        aten.mse_loss_backward.default,
        mse_loss_backward_rule,
        localize=localize_mse_loss_backward,
    )
    rules.register(
        aten.embedding.default,
        embedding_rule,
        localize=localize_embedding,
        anchor=True,
    )
    rules.register(
        aten.embedding_dense_backward.default,
        embedding_backward_rule,
        localize=localize_embedding_backward,
        anchor=True,
    )
