"""Plain functions a rank runs where its local op differs from the global one.

Localize hooks return these as `LocalCall.target`; emitted GraphModules call them directly, so
they take only local tensors and plain Python values computed at plan time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

aten = torch.ops.aten


def sum_over_count(
    x: torch.Tensor,
    dims: Sequence[int],
    keepdim: bool,
    dtype: torch.dtype | None,
    count: int,
) -> torch.Tensor:
    """`mean` whose reduced dims may be split: local sum divided by the GLOBAL element count.

    Summing the ranks' results (the output is Partial over the split axes) gives the mean.
    """
    total = aten.sum.dim_IntList(x, list(dims), keepdim, dtype=dtype)
    return total / count


def squared_error_over_count(x: torch.Tensor, target: torch.Tensor, count: int) -> torch.Tensor:
    """`mse_loss(reduction="mean")` on a block: local squared-error sum over the GLOBAL count."""
    return (x - target).pow(2).sum() / count


def mse_grad_over_count(
    grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, count: int
) -> torch.Tensor:
    """`mse_loss_backward(reduction="mean")` on a block, scaled by the GLOBAL element count."""
    return grad * 2.0 * (x - target) / count


def eye_block(
    offsets: list[int], lengths: list[int], dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    """Rows `[offsets[0], +lengths[0])` and columns `[offsets[1], +lengths[1])` of the identity."""
    rows = torch.arange(offsets[0], offsets[0] + lengths[0], device=device)
    cols = torch.arange(offsets[1], offsets[1] + lengths[1], device=device)
    return (rows[:, None] == cols[None, :]).to(dtype)


def arange_block(
    start: int | float,
    step: int | float,
    offset: int,
    length: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Elements `[offset, offset + length)` of `arange(start, ., step)`.

    The end is placed half a step past the last element and the result truncated, so float
    rounding can neither drop nor add an element.
    """
    if not dtype.is_floating_point:
        # integer aranges truncate start and step to the dtype before counting, as ATen does
        start, step = int(start), int(step)
    first = start + offset * step
    end = first + (length + 0.5) * step
    return torch.arange(first, end, step, dtype=dtype, device=device)[:length]


def arange_chunks(
    start: int | float,
    step: int | float,
    chunks: Sequence[tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The elements of `arange(start, ., step)` in each (offset, length) run of `chunks`, end to
    end: a rank's positions under the load-balanced sequence split."""
    return torch.cat([arange_block(start, step, offset, length, dtype, device) for offset, length in chunks])


def embedding_row_block(weight: torch.Tensor, indices: torch.Tensor, row_offset: int) -> torch.Tensor:
    """Lookup in a block of vocabulary rows: rows held elsewhere give zeros (output Partial)."""
    rows = weight.shape[0]
    local = indices - row_offset
    inside = (local >= 0) & (local < rows)
    out = aten.embedding.default(weight, torch.where(inside, local, torch.zeros_like(local)))
    return out * inside.unsqueeze(-1).to(out.dtype)


def embedding_backward_row_block(
    grad: torch.Tensor,
    indices: torch.Tensor,
    num_weights: int,
    row_offset: int,
    rows: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> torch.Tensor:
    """This rank's rows `[row_offset, row_offset + rows)` of `embedding_dense_backward`.

    Indices of other rows go to one extra scratch row that is dropped; counts for
    `scale_grad_by_freq` stay global because every rank sees all indices.
    """
    local = indices - row_offset
    inside = (local >= 0) & (local < rows)
    local = torch.where(inside, local, torch.full_like(local, rows))
    if 0 <= padding_idx < num_weights and row_offset <= padding_idx < row_offset + rows:
        local_padding = padding_idx - row_offset
    else:
        local_padding = -1
    out = aten.embedding_dense_backward.default(grad, local, rows + 1, local_padding, scale_grad_by_freq)
    return out[:rows]


def dropout_block(
    x: torch.Tensor,
    p: float,
    train: bool | None,
    global_shape: list[int],
    offsets: list[int],
    memory_order: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """native_dropout on this rank's block, with the serial model's numbers.

    Draws the global mask from the generator's current state (every rank seeds alike and runs the
    random ops in the serial order) and keeps this rank's block: bit-identical to the serial op.
    The draw fills the mask in the serial input's memory order (`memory_order`, outermost dim
    first), as the serial op fills a mask laid out like its input (a transposed view, say).
    It costs one global-size draw per rank; a counter-based generator would avoid that.
    """
    if train is False:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = 1.0 - p
    scale = 0.0 if keep == 0 else 1.0 / keep
    order = memory_order if memory_order is not None else list(range(len(global_shape)))
    laid_out = torch.empty([global_shape[d] for d in order], dtype=x.dtype, device=x.device).bernoulli_(keep)
    mask = laid_out.permute([order.index(d) for d in range(len(order))])
    for d, (offset, size) in enumerate(zip(offsets, x.shape)):
        mask = mask.narrow(d, offset, size)
    return x.mul(mask).mul_(scale), mask.to(torch.bool)


def random_block(
    like: torch.Tensor | None,
    kind: str,
    global_shape: list[int],
    offsets: list[int],
    lengths: list[int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    memory_order: list[int] | None = None,
    p: float = 0.5,
    high: float = 1.0,
) -> torch.Tensor:
    """This rank's block of `torch.rand`/`randn(global_shape)`, of `bernoulli(x, p)`, of
    `exponential(x, p)` (p the rate) or of `uniform(x, p, high)`, with the serial numbers.

    Like `dropout_block`: the global tensor is drawn from the generator's current state and cut.
    It is laid out as the serial one (`randn_like` of a transposed view, say) and filled in
    place as the serial op fills it (normal_ fills contiguous and strided tensors differently).
    """
    if device is None and like is not None:
        device = like.device
    order = memory_order if memory_order is not None else list(range(len(global_shape)))
    laid_out = torch.empty([global_shape[d] for d in order], dtype=dtype, device=device)
    block = laid_out.permute([order.index(d) for d in range(len(order))])
    if kind == "randn":
        block.normal_()
    elif kind == "bernoulli":
        block.bernoulli_(p)
    elif kind == "exponential":
        block.exponential_(p)
    elif kind == "uniform":
        block.uniform_(p, high)
    else:
        block.uniform_()
    for d, (offset, size) in enumerate(zip(offsets, lengths)):
        block = block.narrow(d, offset, size)
    return block.clone()


def group_norm_block(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    channels: int,
    hxw: int,
    groups: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`native_group_norm` on a rank's block, whatever its strides.

    The CPU kernel requires `x` contiguous in the memory format its strides suggest ("Expected
    X.is_contiguous(memory_format)"); `F.group_norm` makes it so before calling it, and a serial
    trace drops that call where it was a no-op. A rank's block may arrive with other strides (a
    redistribution's copy, a transposed or sliced view, a batch block of a channels-last tensor
    whose size-1 batch dim keeps a stride the kernel does not expect), so it is made dense first."""
    x = _canonical(x)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    return aten.native_group_norm.default(x, weight, bias, n, channels, hxw, groups, eps)


def group_norm_backward_block(
    grad: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    n: int,
    channels: int,
    hxw: int,
    groups: int,
    mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`native_group_norm_backward` on a rank's block, whatever the strides of its tensors.

    The CPU kernel reads `grad`, `x`, `mean` and `rstd` as raw memory in the layout `x`'s strides
    suggest, and checks none of it: given a contiguous `grad` and a channels-last `x` it returns
    wrong gradients without an error. Autograd's formula (derivatives.yaml) calls
    `.contiguous(x.suggest_memory_format())` on `grad` and `x`, which the serial trace drops where
    the serial strides already agreed; a rank's blocks need not agree (a redistribution hands over
    a contiguous copy of a channels-last activation), so they are made to agree here again."""
    x = _canonical(x)
    if grad.stride() != x.stride():
        grad = torch.empty_like(x).copy_(grad)  # x is dense: empty_like keeps its strides
    mean, rstd = mean.contiguous(), rstd.contiguous()
    weight = weight.contiguous() if weight is not None else None
    return aten.native_group_norm_backward.default(grad, x, mean, rstd, weight, n, channels, hxw, groups, mask)


def _canonical(x: torch.Tensor) -> torch.Tensor:
    """`x` itself if its strides are exactly those of a contiguous or channels-last tensor of its
    shape (no copy: a channels-last activation stays so), else a contiguous copy. Exact, not
    `is_contiguous`: that ignores the strides of size-1 dims, which the kernels' memory-format
    guess does not."""
    if x.stride() == _strides(x.shape, list(range(x.ndim))):
        return x
    if x.ndim in (4, 5) and x.stride() == _strides(x.shape, [0, *range(2, x.ndim), 1]):  # channels-last (3d)
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """The strides of a dense tensor of `shape` whose dims lie in memory in `order`, outermost first."""
    strides = [0] * len(shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= shape[d]
    return tuple(strides)


def _expert_rows(offs: torch.Tensor, first_expert: int, experts: int) -> list[tuple[int, int, int]]:
    """(local expert index, first row, end row) of each of this rank's experts that has rows:
    `offs` holds the cumulative row counts of ALL experts (one host read, as the serial op)."""
    ends = offs.tolist()
    rows = []
    for j in range(experts):
        e = first_expert + j
        start, end = (ends[e - 1] if e > 0 else 0), ends[e]
        if end > start:
            rows.append((j, int(start), int(end)))
    return rows


# Custom ops (with fake kernels), not plain functions: the routing in `offs` is read on the host,
# which the fake tensors of emit's shape check cannot do.
@torch.library.custom_op("autopar::grouped_mm_experts", mutates_args=())
def _grouped_mm_experts(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first_expert: int) -> torch.Tensor:
    out = input.new_zeros(input.shape[0], weight.shape[2])
    for j, start, end in _expert_rows(offs, first_expert, weight.shape[0]):
        out[start:end] = torch.mm(input[start:end], weight[j])
    return out


@_grouped_mm_experts.register_fake
def _grouped_mm_experts_fake(
    input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first_expert: int
) -> torch.Tensor:
    return input.new_empty(input.shape[0], weight.shape[2])


@torch.library.custom_op("autopar::grouped_mm_experts_backward", mutates_args=())
def _grouped_mm_experts_backward(
    input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, grad_output: torch.Tensor, first_expert: int
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_input = torch.zeros_like(input, memory_format=torch.contiguous_format)
    grad_weight = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    for j, start, end in _expert_rows(offs, first_expert, weight.shape[0]):
        grad_input[start:end] = torch.mm(grad_output[start:end], weight[j].T)
        grad_weight[j] = torch.mm(input[start:end].T, grad_output[start:end])
    return grad_input, grad_weight


@_grouped_mm_experts_backward.register_fake
def _grouped_mm_experts_backward_fake(
    input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, grad_output: torch.Tensor, first_expert: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(input, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
    )


@torch.library.custom_op("autopar::grouped_mm_experts_weight", mutates_args=())
def _grouped_mm_experts_weight(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, first_expert: int, experts: int
) -> torch.Tensor:
    out = a.new_zeros(experts, a.shape[0], b.shape[1])
    for j, start, end in _expert_rows(offs, first_expert, experts):
        out[j] = torch.mm(a[:, start:end], b[start:end])
    return out


@_grouped_mm_experts_weight.register_fake
def _grouped_mm_experts_weight_fake(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, first_expert: int, experts: int
) -> torch.Tensor:
    return a.new_empty(experts, a.shape[0], b.shape[1])


# Grouped matmul on a block of experts (`weight` holds experts first_expert.. of them): the rows of
# those experts get their products, every other row zeros (output Partial over the expert split;
# each row's product lives on exactly one rank).
grouped_mm_experts = torch.ops.autopar.grouped_mm_experts.default
# Its backward: the input's gradient on this rank's experts' rows (zeros elsewhere: Partial) and
# the whole gradient of this rank's block of experts.
grouped_mm_experts_backward = torch.ops.autopar.grouped_mm_experts_backward.default
# `torch._grouped_mm(a (K, S), b (S, N), offs)` for `experts` experts starting at `first_expert`:
# expert j's (K, N) sums a's columns times b's rows of that expert (the experts' gradient of a
# block of them; the rows of other experts are not read).
grouped_mm_experts_weight = torch.ops.autopar.grouped_mm_experts_weight.default
