"""Attention kernels for programs that run on another device than the trace.

The trace runs on CPU fake tensors, so `F.scaled_dot_product_attention` is recorded as the CPU
flash kernel pair `aten._scaled_dot_product_flash_attention_for_cpu(_backward)`, which exists for
the CPU alone: a program emitted for a CUDA mesh must call something else. These two functions
keep that pair's contract (forward returns `(output, logsumexp)`, output laid out like the query,
logsumexp `(B, H, L)` in the accumulation dtype; backward takes them back) on every device, so the
layouts, saved tensors and collectives planned around the CPU pair stay valid unchanged:

- on the CPU they are the CPU kernels themselves;
- on CUDA, where a fused kernel fits (half precision, no mask, no dropout, equal head dims that
  are a multiple of 8 up to 256, a square causal mask), they are the fused kernels torch's own
  `scaled_dot_product_attention` would pick for the same arguments (`fused_kernel`): cuDNN's where
  torch prefers it (Hopper), whose logsumexp carries a trailing dim of 1 that is dropped here and
  put back for its backward, else the flash kernels, whose logsumexp has the CPU pair's shape and
  dtype. On one H200, cuDNN's pair ran a 0.85 B LLaMA step's attention in 9.6 ms where flash's
  took 16.5 (docs/benchmarks.md);
- elsewhere they compute attention from its definition (scores, logsumexp, softmax) and its
  backward from the saved logsumexp: exact, with the memory of the scores.

Attention with dropout is traced as its math decomposition (`native_dropout` between the softmax
and the product), which runs anywhere: the CPU pair is only ever recorded with `dropout_p=0`.
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention import SDPBackend

aten = torch.ops.aten
CPU_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def flash_fits(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
) -> bool:
    """Whether the CUDA flash kernels take these arguments (forward and backward decide alike)."""
    head_dim = q.shape[-1]
    return (
        q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16)
        and attn_mask is None
        and dropout_p == 0.0
        and q.dim() == 4
        and k.shape[1] == q.shape[1]
        and head_dim == k.shape[-1] == v.shape[-1]
        and head_dim % 8 == 0
        and head_dim <= 256
        and not (is_causal and q.shape[2] != k.shape[2])
    )


def fused_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> str:
    """The kernel pair attention runs on a CUDA device: "cudnn" or "flash" where torch's own
    SDPA would pick that fused kernel for these arguments (under the user's `sdpa_kernel`
    settings too), "flash" where flash fits but torch would take another path, else "math".
    Forward and backward ask with the same tensors, so they always agree; under `compile=True`
    (where both graphs are compiled) both take flash."""
    if not flash_fits(q, k, v, dropout_p, is_causal, attn_mask):
        return "math"
    if torch.compiler.is_compiling():  # dynamo cannot trace torch's choice (an int): flash compiles
        return "flash"
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale)
    return "cudnn" if choice == SDPBackend.CUDNN_ATTENTION.value else "flash"


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    row_offset: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_scaled_dot_product_flash_attention_for_cpu` on the device of `q`: (output, logsumexp).

    With `row_offset`, the queries are the block of a causal attention that starts at that
    position of the sequence (a rank's block under context parallelism), against all the keys: see
    `_causal_rows`."""
    if row_offset is not None:
        if _flag_fits(q, k, row_offset, attn_mask):
            return _causal_rows_by_flag(q, k, v, row_offset, dropout_p, scale)
        k, v, attn_mask = _causal_rows(q, k, v, row_offset, attn_mask)
        is_causal = False
    if q.device.type == "cpu":
        return CPU_FORWARD(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    kernel = fused_kernel(q, k, v, dropout_p, is_causal, attn_mask, scale)
    if kernel == "cudnn":
        results = aten._scaled_dot_product_cudnn_attention.default(
            q, k, v, None, True, 0.0, is_causal, False, scale=scale
        )
        return results[0], results[1].squeeze(-1)  # (B, H, L, 1) -> the pair's (B, H, L)
    if kernel == "flash":
        results = aten._scaled_dot_product_flash_attention.default(
            q, k, v, 0.0, is_causal, False, scale=scale
        )
        return results[0], results[1]
    return math_forward(q, k, v, is_causal, attn_mask=attn_mask, scale=scale)


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    row_offset: int | None = None,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_scaled_dot_product_flash_attention_for_cpu_backward` on the device of `q`.

    With `row_offset`, the backward of the causal block of `attention_forward`: the block's query
    gradient and its share of every key's and value's gradient (zero for the keys after the block,
    which it never saw), summed in place into `into` (the whole keys' and values' gradients, made
    zero if not given) and returned as them: each kernel call's gradients of the keys it saw are
    added where they belong and dropped, so no more than one call's exist beside the results.
    Padding each call's with zeros and concatenating them (and summing two runs' of a balanced
    split) held two more whole key/value gradients at the step's peak, which the memory model
    did not count: a gathered-keys plan's live peak on 4 gloo ranks was 18 % over the model."""
    if row_offset is not None:
        grad_k, grad_v = into if into is not None else (k.new_zeros(k.shape), v.new_zeros(v.shape))
        if _flag_fits(q, k, row_offset, attn_mask):
            grad_q = _causal_rows_by_flag_backward(
                grad_out, q, k, v, out, logsumexp, row_offset, dropout_p, scale, (grad_k, grad_v)
            )
            return grad_q, grad_k, grad_v
        keys, values, mask = _causal_rows(q, k, v, row_offset, attn_mask)
        grad_q, dk, dv = attention_backward(
            grad_out, q, keys, values, out, logsumexp, dropout_p, False, attn_mask=mask, scale=scale
        )
        grad_k.narrow(-2, 0, dk.shape[-2]).add_(dk)
        grad_v.narrow(-2, 0, dv.shape[-2]).add_(dv)
        return grad_q, grad_k, grad_v
    if q.device.type == "cpu":
        return CPU_BACKWARD(
            grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
    kernel = fused_kernel(q, k, v, dropout_p, is_causal, attn_mask, scale)
    if kernel == "cudnn":
        # cuDNN reads the output's gradient in the output's layout; without dropout it never
        # reads the random state, and dense attention has no bias or sequence offsets.
        if grad_out.stride() != out.stride():
            grad_out = torch.empty_like(out).copy_(grad_out)
        seed = torch.empty((), dtype=torch.long, device=q.device)
        offset = torch.empty((), dtype=torch.long, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward.default(
            grad_out, q, k, v, out, logsumexp.unsqueeze(-1), seed, offset, None, None, None,
            q.shape[2], k.shape[2], 0.0, is_causal, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    if kernel == "flash":
        # Dense attention has no cumulative sequence lengths, and without dropout the kernel never
        # reads the random state: empty placeholders of the types the forward would have returned.
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward.default(
            grad_out.contiguous(), q, k, v, out, logsumexp, None, None, q.shape[2], k.shape[2], 0.0, is_causal,
            seed, offset, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    return math_backward(grad_out, q, k, v, out, logsumexp, is_causal, attn_mask=attn_mask, scale=scale)


def _row_chunks(x: torch.Tensor | None, rows: int, parts: int) -> list[torch.Tensor | None]:
    """`x` (a mask, or a per-row tensor) cut into `parts` equal runs of its query rows (dim -2,
    or -1 for the (B, H, L) logsumexp via `dim`); a mask that broadcasts along the queries, or
    none, goes whole to every run."""
    if x is None or x.dim() < 2 or x.shape[-2] != rows or rows == 1:
        return [x] * parts
    return list(x.chunk(parts, -2))


def attention_forward_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    row_offsets: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a rank's queries made of equal runs of rows that start at
    `row_offsets` of the sequence (the two chunks of a load-balanced split), against all the
    keys: each run is a causal block of `attention_forward` at its own offset; output and
    logsumexp are put back together along the rows."""
    parts = len(row_offsets)
    rows = q.shape[-2]
    outs, lses = [], []
    for q_run, mask, offset in zip(q.chunk(parts, -2), _row_chunks(attn_mask, rows, parts), row_offsets):
        out, lse = attention_forward(q_run, k, v, dropout_p, True, attn_mask=mask, scale=scale, row_offset=offset)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, -2), torch.cat(lses, -1)


def attention_backward_chunks(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    row_offsets: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of `attention_forward_chunks`: each run's query gradient, put back together,
    and the sum of the runs' shares of every key's and value's gradient."""
    parts = len(row_offsets)
    rows = q.shape[-2]
    runs = zip(
        grad_out.chunk(parts, -2),
        q.chunk(parts, -2),
        out.chunk(parts, -2),
        logsumexp.chunk(parts, -1),
        _row_chunks(attn_mask, rows, parts),
        row_offsets,
    )
    grad_q = q.new_empty(q.shape)
    grads = (k.new_zeros(k.shape), v.new_zeros(v.shape))  # every run's shares summed in place
    at = 0
    for g_run, q_run, o_run, lse_run, mask, offset in runs:
        dq, _, _ = attention_backward(
            g_run, q_run, k, v, o_run, lse_run, dropout_p, True, attn_mask=mask, scale=scale, row_offset=offset,
            into=grads,
        )  # fmt: skip
        grad_q.narrow(-2, at, dq.shape[-2]).copy_(dq)
        at += dq.shape[-2]
        del dq
    return grad_q, grads[0], grads[1]


def _flag_fits(q: torch.Tensor, k: torch.Tensor, row_offset: int, attn_mask: torch.Tensor | None) -> bool:
    """Whether a causal block of queries at `row_offset` can run on the kernel's own causal flag
    (`_causal_rows_by_flag`): no mask of the model's to add, and its diagonal block of keys
    (`row_offset` .. `row_offset + rows`) all there (self-attention)."""
    return attn_mask is None and row_offset + q.shape[-2] <= k.shape[-2]


def _causal_rows_by_flag(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_offset: int, dropout_p: float, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal block of queries at `row_offset` as two kernel calls with no mask: the keys before
    the block (every query sees all of them) without the causal flag, and the diagonal block (a
    square whose causal mask is the flag's, top-left aligned) with it, merged by their
    log-sum-exps. So the kernel skips the tiles above the diagonal as the serial call does, where
    an additive mask would make it compute and mask every score of the diagonal block (1.8x
    slower for the last of 8 ranks at 4096 tokens on the CPU kernel, docs/attention-strategies.md),
    and on CUDA the fused kernels take both calls (they take no mask)."""
    rows = q.shape[-2]
    diagonal = attention_forward(
        q, k.narrow(-2, row_offset, rows), v.narrow(-2, row_offset, rows), dropout_p, True, scale=scale
    )
    if row_offset == 0:
        return diagonal
    before = attention_forward(
        q, k.narrow(-2, 0, row_offset), v.narrow(-2, 0, row_offset), dropout_p, False, scale=scale
    )
    (out_a, lse_a), (out_b, lse_b) = before, diagonal
    acc = torch.promote_types(lse_a.dtype, torch.float32)
    lse = torch.logaddexp(lse_a.to(acc), lse_b.to(acc))  # every row sees its own key: finite
    out = out_a.to(acc) * torch.exp(lse_a - lse).unsqueeze(-1) + out_b.to(acc) * torch.exp(lse_b - lse).unsqueeze(-1)
    return torch.empty_like(out_b).copy_(out), lse.to(lse_a.dtype)  # laid out as the kernel lays it out


def _causal_rows_by_flag_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    row_offset: int,
    dropout_p: float,
    scale: float | None,
    into: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """The backward of `_causal_rows_by_flag`: each of its two calls' backward against the whole
    rows' output and logsumexp gives that call's exact share of the query gradient (summed, and
    returned) and of its keys' and values' gradients (added in place into `into`, the whole keys'
    and values' gradients, where those keys are)."""
    rows = q.shape[-2]
    grad_k, grad_v = into
    dq, dk, dv = attention_backward(
        grad_out, q, k.narrow(-2, row_offset, rows), v.narrow(-2, row_offset, rows), out, logsumexp,
        dropout_p, True, scale=scale,
    )  # fmt: skip
    grad_k.narrow(-2, row_offset, rows).add_(dk)
    grad_v.narrow(-2, row_offset, rows).add_(dv)
    del dk, dv
    if row_offset:
        dq_before, dk, dv = attention_backward(
            grad_out, q, k.narrow(-2, 0, row_offset), v.narrow(-2, 0, row_offset), out, logsumexp,
            dropout_p, False, scale=scale,
        )  # fmt: skip
        dq.add_(dq_before)
        grad_k.narrow(-2, 0, row_offset).add_(dk)
        grad_v.narrow(-2, 0, row_offset).add_(dv)
    return dq


def _causal_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_offset: int, attn_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys and values a block of causal queries starting at `row_offset` can see (0 up to its
    last query's position), and the mask that hides, for each query, the keys after its own.

    The kernels' causal flag aligns the mask to the top left of the local scores (query i sees keys
    0..i), which is right only for the first block; the block's query i must see keys
    0..row_offset+i. So the kernel runs without the flag, on the keys up to the block's last
    position (the others are hidden from every query of the block), with that mask added."""
    rows = q.shape[-2]
    keys = min(k.shape[-2], row_offset + rows)
    i = torch.arange(rows, device=q.device).unsqueeze(1) + row_offset
    j = torch.arange(keys, device=q.device).unsqueeze(0)
    mask = torch.zeros(rows, keys, dtype=q.dtype, device=q.device).masked_fill(j > i, float("-inf"))
    if attn_mask is not None:
        if attn_mask.shape[-1] != 1:
            attn_mask = attn_mask.narrow(-1, 0, keys)
        mask = mask + attn_mask.to(q.dtype)
    return k.narrow(-2, 0, keys), v.narrow(-2, 0, keys), mask


def _scores(
    q: torch.Tensor, k: torch.Tensor, is_causal: bool, attn_mask: torch.Tensor | None, scale: float | None
) -> tuple[torch.Tensor, float]:
    """Scaled, masked scores in the accumulation dtype, and the scale used."""
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    factor = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * factor
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (
            scores.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else scores + attn_mask
        )
    return scores, factor


def _laid_out_like(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The output in the query's memory layout, as the flash kernels return it."""
    if not q.is_contiguous() and q.transpose(1, 2).is_contiguous():
        return out.transpose(1, 2).contiguous().transpose(1, 2)
    return out.contiguous()


def math_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention from its definition: (output, logsumexp) with the flash pair's shapes and dtypes.
    A row whose every key is masked gets a zero output, as the CPU kernel gives."""
    scores, _ = _scores(q, k, is_causal, attn_mask, scale)
    logsumexp = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - logsumexp.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.matmul(probs, v.to(probs.dtype)).to(q.dtype)
    return _laid_out_like(out, q), logsumexp


def math_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `math_forward` from the saved logsumexp (the softmax is recomputed)."""
    scores, factor = _scores(q, k, is_causal, attn_mask, scale)
    acc = scores.dtype
    probs = torch.exp(scores - logsumexp.to(acc).unsqueeze(-1)).nan_to_num(0.0)
    grad = grad_out.to(acc)
    grad_v = torch.matmul(probs.transpose(-2, -1), grad)
    grad_probs = torch.matmul(grad, v.to(acc).transpose(-2, -1))
    row = (grad * out.to(acc)).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - row) * factor
    grad_q = torch.matmul(grad_scores, k.to(acc))
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q.to(acc))
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


# The CPU pair, by what a program on another device calls instead.
ON_DEVICE = {CPU_FORWARD: attention_forward, CPU_BACKWARD: attention_backward}
