"""How fast does a rank's block of causal attention run, by how its causal mask is given? Under a
contiguous sequence split, rank r of p holds queries r*n..(r+1)*n of a causal call and must see the
keys up to its own positions. Two ways to run that on the CPU flash kernel, forward and backward,
timed side by side on one thread:

- *mask*: one kernel call on the keys 0..(r+1)*n with an additive -inf mask above the shifted
  diagonal (what `device_attention.attention_forward(row_offset=...)` did before: the kernel
  computes and masks every score of the diagonal block);
- *flag*: `device_attention.attention_forward(row_offset=...)` now: the keys before the block
  without a mask and the diagonal block with the kernel's causal flag (which skips the tiles above
  the diagonal), merged by their log-sum-exps.

The whole causal call (every rank's work with no context parallelism) and the load-balanced split's
rank (`attention_forward_chunks`) are timed with them. Run: `python benchmarks/causal_rows.py
[--seq 4096 --ranks 8 --heads 4 --kv-heads 1 --head-dim 64]` (writes
benchmarks/results/causal_rows.json)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from _common import table, write_result

from autopar.rules import device_attention as da


def _ms(run: Callable[[], object], reps: int) -> float:
    run()
    start = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - start) / reps * 1e3


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, grad: torch.Tensor) -> None:
    """The rank's rows as one kernel call with an additive causal mask at the block's offset."""
    rows = q.shape[-2]
    keys = offset + rows
    i = torch.arange(rows).unsqueeze(1) + offset
    j = torch.arange(keys).unsqueeze(0)
    mask = torch.zeros(rows, keys, dtype=q.dtype).masked_fill(j > i, float("-inf"))
    kk, vv = k.narrow(-2, 0, keys), v.narrow(-2, 0, keys)
    out, lse = da.CPU_FORWARD(q, kk, vv, 0.0, False, attn_mask=mask)[:2]
    da.CPU_BACKWARD(grad, q, kk, vv, out, lse, 0.0, False, attn_mask=mask)


def _flagged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, grad: torch.Tensor) -> None:
    out, lse = da.attention_forward(q, k, v, 0.0, True, row_offset=offset)
    da.attention_backward(grad, q, k, v, out, lse, 0.0, True, row_offset=offset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t, p, n = args.seq, args.ranks, args.seq // args.ranks
    q = torch.randn(1, args.heads, t, args.head_dim)
    k = torch.randn(1, args.kv_heads, t, args.head_dim)
    v = torch.randn(1, args.kv_heads, t, args.head_dim)
    grad = torch.randn_like(q)

    def whole() -> None:
        out, lse = da.CPU_FORWARD(q, k, v, 0.0, True)[:2]
        da.CPU_BACKWARD(grad, q, k, v, out, lse, 0.0, True)

    rows = [["whole causal call (no split)", "-", f"{_ms(whole, args.reps):.1f}", "-"]]
    for r in sorted({0, p // 2, p - 1}):
        block = slice(r * n, (r + 1) * n)
        qb, gb, at = q[:, :, block], grad[:, :, block], r * n
        mask = _ms(lambda qb=qb, gb=gb, at=at: _masked(qb, k, v, at, gb), args.reps)
        flag = _ms(lambda qb=qb, gb=gb, at=at: _flagged(qb, k, v, at, gb), args.reps)
        rows.append([f"contiguous, rank {r} of {p}", f"{mask:.1f}", f"{flag:.1f}", f"{mask / flag:.2f}"])
    c = n // 2
    chunks = (0, (2 * p - 1) * c)
    qb = torch.cat([q[:, :, :c], q[:, :, chunks[1] : chunks[1] + c]], 2)
    gb = torch.cat([grad[:, :, :c], grad[:, :, chunks[1] : chunks[1] + c]], 2)

    def balanced() -> None:
        out, lse = da.attention_forward_chunks(qb, k, v, 0.0, row_offsets=chunks)
        da.attention_backward_chunks(gb, qb, k, v, out, lse, 0.0, row_offsets=chunks)

    rows.append([f"balanced, rank 0 of {p}", "-", f"{_ms(balanced, args.reps):.1f}", "-"])
    headers = ["forward + backward, one thread", "mask (ms)", "flag (ms)", "mask / flag"]
    print(table(headers, rows))
    write_result("causal_rows", {"args": vars(args), "headers": headers, "rows": rows})


if __name__ == "__main__":
    main()
