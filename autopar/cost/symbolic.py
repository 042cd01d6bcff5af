"""The cost formulas as sympy expressions, and the closed-form volumes of ../shared/reference/comm_volumes.md.

Expressions explain a plan ("this axis costs 2(g-1)/g * N * beta") and let a mesh factorization
be picked analytically. The closed forms give elements SENT per rank for one transformer layer,
forward + backward, ring collectives; the benchmark prints them beside measured plans. They accept
plain numbers (float result) or sympy symbols (expression result), except where noted.

Layer: T = b*s tokens, hidden h, four linears (k inputs, n outputs): qkv (h, 3h), proj (h, h),
fc1 (h, 4h), fc2 (4h, h) (comm_volumes.md lines 9-10). Summed over them: sum(k) = 7h,
sum(n) = 9h, sum(k*n) = 12h^2.
"""

from __future__ import annotations

import math
from itertools import product
from typing import Any

import sympy

g, N, alpha, beta = sympy.symbols("g N alpha beta", positive=True)
F, B, peak, mem_bw = sympy.symbols("F B peak mem_bw", positive=True)

# (name, k / h, n / h) of the four linears of a GPT layer, in order; pairs (qkv, proj), (fc1, fc2).
GPT_LINEARS: tuple[tuple[str, int, int], ...] = (("qkv", 1, 3), ("proj", 1, 1), ("fc1", 1, 4), ("fc2", 4, 1))

Num = Any  # int / float, or a sympy expression


def collective_time_expr(kind: str) -> sympy.Expr:
    """Alpha-beta ring time in g (group size), N (BYTES, sized as in formulas.collective_time),
    alpha (s per message step) and beta (s per byte)."""
    ring = (g - 1) / g
    if kind == "all_reduce":
        return 2 * ring * N * beta + 2 * (g - 1) * alpha
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return ring * N * beta + (g - 1) * alpha
    raise ValueError(f"not a collective: {kind!r}")


def compute_time_expr() -> sympy.Expr:
    """Roofline: F flops at `peak` FLOP/s or B bytes at `mem_bw` bytes/s, whichever is slower."""
    return sympy.Max(F / peak, B / mem_bw)


def memory_expr() -> sympy.Expr:
    """Bytes per rank: params P + grads G + k states of s bytes per parameter element + activations A."""
    P, G, A, k, s, b = sympy.symbols("P G A k s b", positive=True)
    return P + G + k * (P / b) * s + A


# --- closed forms per scheme (elements sent per rank per layer) ---------------------------------


def megatron_1d(T: Num, h: Num, p: Num) -> Num:
    """1-D Megatron, t = p: `8 (t-1)/t * T*h` (comm_volumes.md line 14-15). Needs heads % p == 0."""
    return 8 * (p - 1) / p * T * h


def megatron_1d_sp(T: Num, h: Num, p: Num, regather: bool = True) -> Num:
    """1-D + sequence parallel: `10 (t-1)/t * T*h` regathering the input in backward, `8 (t-1)/t * T*h`
    if it is kept (comm_volumes.md lines 16-18)."""
    return (10 if regather else 8) * (p - 1) / p * T * h


def summa_2d_linear(T: Num, k: Num, n: Num, grid: tuple[Num, Num]) -> Num:
    """2-D SUMMA on a pr x pc grid, one linear: `3 * ((pc-1)*T*k + (pr-1)*k*n) / p` (line 19-20)."""
    pr, pc = grid
    return 3 * ((pc - 1) * T * k + (pr - 1) * k * n) / (pr * pc)


def summa_2d(T: Num, h: Num, grid: tuple[Num, Num]) -> Num:
    """2-D SUMMA per layer: the per-linear form summed over the four linears."""
    return sum(summa_2d_linear(T, k * h, n * h, grid) for _, k, n in GPT_LINEARS)


def cube_3d_linear(T: Num, k: Num, n: Num, p: Num) -> Num:
    """3-D cube (p = q^3), one linear: `2 (q-1)/q^3 * (T*k + T*n + k*n)` (lines 21-22)."""
    q = _cube_root(p)
    return 2 * (q - 1) / q**3 * (T * k + T * n + k * n)


def cube_3d(T: Num, h: Num, p: Num) -> Num:
    """3-D cube per layer: `2 (q-1)/q^3 * (16*T*h + 12*h^2)` (lines 22-23)."""
    q = _cube_root(p)
    return 2 * (q - 1) / q**3 * (16 * T * h + 12 * h**2)


def axonn_linear(
    T: Num, k: Num, n: Num, grid: tuple[Num, Num, Num], swapped: bool = False, keep_weights: bool = False
) -> Num:
    """AxoNN / Tensor3D grid (Gx, Gy, Gz), one linear (comm_volumes.md lines 25-29).

    Weight all-gather on z forward and backward plus gradient reduce-scatter:
    `3 (Gz-1)/Gz * k*n/(Gx*Gy)` (2 if the gathered weight is kept); output all-reduce on the inner
    (contraction) axis gi: `2 (gi-1)/gi * T*n/(Gz*go)`; input-gradient all-reduce on the outer axis
    go: `2 (go-1)/go * T*k/(Gz*gi)`. Unswapped, k is split on x (gi = Gx, go = Gy); the second
    linear of each pair is `swapped` (gi = Gy, go = Gx).
    """
    gx, gy, gz = grid
    gi, go = (gy, gx) if swapped else (gx, gy)
    weight = (2 if keep_weights else 3) * (gz - 1) / gz * k * n / (gx * gy)
    out = 2 * (gi - 1) / gi * T * n / (gz * go)
    inp = 2 * (go - 1) / go * T * k / (gz * gi)
    return weight + out + inp


def axonn(T: Num, h: Num, grid: tuple[Num, Num, Num], keep_weights: bool = False) -> Num:
    """AxoNN per layer: qkv and fc1 unswapped, proj and fc2 swapped."""
    return sum(
        axonn_linear(T, k * h, n * h, grid, swapped=i % 2 == 1, keep_weights=keep_weights)
        for i, (_, k, n) in enumerate(GPT_LINEARS)
    )


def best_summa(T: float, h: float, p: int) -> tuple[float, tuple[int, int]]:
    """The pr x pc grid (pr * pc = p) with the least SUMMA volume; numbers only."""
    return min((float(summa_2d(T, h, (pr, p // pr))), (pr, p // pr)) for pr in _divisors(p))


def best_axonn(T: float, h: float, p: int, keep_weights: bool = False) -> tuple[float, tuple[int, int, int]]:
    """The (Gx, Gy, Gz) grid (product p) with the least AxoNN volume; numbers only."""
    grids = [(gx, gy, p // (gx * gy)) for gx, gy in product(_divisors(p), repeat=2) if p % (gx * gy) == 0]
    return min((float(axonn(T, h, grid, keep_weights)), grid) for grid in grids)


# --- the floor (comm_volumes.md lines 42-53; Al Daas, Ballard et al. 2022) ------------------------


def matmul_floor(d1: float, d2: float, d3: float, P: int) -> float:
    """Words a processor must send for one product with dims d1, d2, d3 on P processors (any
    order; sorted here), memory-independent bound, three regimes (lines 46-48); numbers only."""
    d1, d2, d3 = sorted((float(d1), float(d2), float(d3)), reverse=True)
    if d1 / d2 >= P:
        return d2 * d3 * (1 - 1 / P)
    if d1 * d2 / d3**2 >= P:
        return 2 * math.sqrt(d1 * d2 * d3**2 / P) - (d1 * d3 + d2 * d3) / P
    return 3 * (d1 * d2 * d3 / P) ** (2 / 3) - (d1 * d2 + d1 * d3 + d2 * d3) / P


def floor_layer(T: float, h: float, p: int) -> float:
    """The bound summed over the three products (forward, input grad, weight grad: all three have
    dims {T, k, n}) of each linear (lines 50-51); numbers only."""
    return sum(3 * matmul_floor(T, k * h, n * h, p) for _, k, n in GPT_LINEARS)


def practical_floor(T: float, h: float, p: int) -> float:
    """Two thirds of `floor_layer`: what keeping gathered operands and chaining layouts can reach
    (lines 52-53)."""
    return 2 / 3 * floor_layer(T, h, p)


# --- sizes beside the volumes ---------------------------------------------------------------------


def weights_per_rank(h: Num, p: Num) -> Num:
    """Weight elements per rank of one layer's linears: 12 h^2 / p."""
    return 12 * h**2 / p


def layer_flops(T: Num, h: Num, s: Num) -> Num:
    """Forward + backward FLOPs of a layer: linears 3 * 2*T*12h^2, attention scores and values
    3 * 4*T*s*h (line 39: 21.4 TFLOP at h = 4096, s = 2048, b = 8)."""
    return 72 * T * h**2 + 12 * T * s * h


def megatron_1d_infeasible(heads: int, p: int) -> str | None:
    """Why 1-D Megatron cannot run on p ranks (heads must split evenly), or None."""
    return None if heads % p == 0 else f"heads {heads} % {p} != 0"


def cube_3d_infeasible(b: int, h: int, p: int) -> str | None:
    """Why the cube cannot run: p must be q^3; q^2 must divide the batch (whole sequences per rank,
    so attention stays local) and the hidden size (comm_volumes.md lines 23-24); or None."""
    q = round(p ** (1 / 3))
    if q**3 != p:
        return f"p = {p} is not a cube"
    if b % q**2:
        return f"needs b % {q * q} == 0 (b = {b})"
    if h % q**2:
        return f"needs h % {q * q} == 0 (h = {h})"
    return None


def comm_volume_table(b: int, s: int, h: int, heads: int, p: int) -> dict[str, Any]:
    """One row of the comm_volumes.md worked-numbers table, in elements per rank per layer."""
    T = b * s
    summa, summa_grid = best_summa(T, h, p)
    ax, ax_grid = best_axonn(T, h, p)
    q = round(p ** (1 / 3))
    return {
        "p": p,
        "megatron_1d": megatron_1d(T, h, p),
        "megatron_1d_note": megatron_1d_infeasible(heads, p),
        "megatron_1d_sp_regather": megatron_1d_sp(T, h, p, regather=True),
        "megatron_1d_sp_kept": megatron_1d_sp(T, h, p, regather=False),
        "summa_2d": summa,
        "summa_2d_grid": summa_grid,
        "cube_3d": cube_3d(T, h, p) if q**3 == p else None,
        "cube_3d_note": cube_3d_infeasible(b, h, p),
        "axonn": ax,
        "axonn_grid": ax_grid,
        "floor": floor_layer(T, h, p),
        "practical_floor": practical_floor(T, h, p),
        "weights_per_rank": weights_per_rank(h, p),
        "layer_flops": layer_flops(T, h, s),
    }


def _cube_root(p: Num) -> Num:
    if isinstance(p, sympy.Basic):
        return p ** sympy.Rational(1, 3)
    q = round(p ** (1 / 3))
    if q**3 != p:
        raise ValueError(f"the 3-D cube needs p = q^3, got p = {p}")
    return q


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
