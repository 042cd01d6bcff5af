"""Sympy forms equal the float formulas; closed forms reproduce comm_volumes.md's worked numbers."""

from __future__ import annotations

import pytest
import sympy
import torch

from autopar.cost import collective_time, compute_time, load_hardware, memory_per_rank
from autopar.cost import symbolic as S

H100 = load_hardware("h100-nvlink-ib")

# comm_volumes.md "Worked numbers": h = 4096, s = 2048, b = 8, a = 32; millions of elements per rank
# per layer. (p, megatron, sp regather, summa (grid), cube, axonn (grid), weights, floor, 2/3 floor)
B, SEQ, H, HEADS = 8, 2048, 4096, 32
T = B * SEQ
TABLE = [
    (8, 470, 587, (403, (4, 2)), 319, (277, (1, 4, 2)), 25.2, 302, 201),
    (64, 528, 661, (208, (16, 4)), 120, (112, (2, 8, 4)), 3.15, 133, 89),
    (512, 536, 670, (78, (32, 16)), 35, (33, (4, 16, 8)), 0.39, 41, 27),
]


def _m(x: float) -> float:
    return float(x) / 1e6


@pytest.mark.parametrize(("p", "mega", "sp", "summa", "cube", "axonn", "weights", "floor", "floor23"), TABLE)
def test_closed_forms_reproduce_table(p, mega, sp, summa, cube, axonn, weights, floor, floor23) -> None:
    assert round(_m(S.megatron_1d(T, H, p))) == mega
    assert round(_m(S.megatron_1d_sp(T, H, p, regather=True))) == sp
    assert round(_m(S.megatron_1d_sp(T, H, p, regather=False))) == mega  # kept: same as 1-D
    value, grid = S.best_summa(T, H, p)
    assert (round(_m(value)), grid) == summa
    assert round(_m(S.cube_3d(T, H, p))) == cube
    value, grid = S.best_axonn(T, H, p)
    assert (round(_m(value)), grid) == axonn
    decimals = len(str(weights).split(".")[1])  # the table's own rounding: 25.2, 3.15, 0.39
    assert round(_m(S.weights_per_rank(H, p)), decimals) == weights
    assert round(_m(S.floor_layer(T, H, p))) == floor
    assert round(_m(S.practical_floor(T, H, p))) == floor23


def test_table_row_and_feasibility_notes() -> None:
    rows = {p: S.comm_volume_table(B, SEQ, H, HEADS, p) for p in (8, 64, 512)}
    assert rows[8]["megatron_1d_note"] is None and rows[8]["cube_3d_note"] is None
    assert rows[64]["megatron_1d_note"] == "heads 32 % 64 != 0"
    assert rows[64]["cube_3d_note"] == "needs b % 16 == 0 (b = 8)"  # "needs b >= 16"
    assert rows[512]["cube_3d_note"] == "needs b % 64 == 0 (b = 8)"
    assert S.comm_volume_table(B, SEQ, H, HEADS, 16)["cube_3d"] is None
    # "about 21.4 TFLOP (2680 / 335 / 42 GFLOP per rank at p = 8 / 64 / 512)"
    flops = rows[8]["layer_flops"]
    assert round(flops / 1e12, 1) == 21.4
    assert [round(flops / p / 1e9) for p in (8, 64, 512)] == [2680, 335, 42]


def test_per_linear_forms_sum_to_layer_forms() -> None:
    linears = [(k * H, n * H) for _, k, n in S.GPT_LINEARS]
    assert sum(S.cube_3d_linear(T, k, n, 64) for k, n in linears) == pytest.approx(S.cube_3d(T, H, 64))
    # AxoNN (1, 4, 2) by hand: weights 3/2 * 12h^2/4, first linears' input grads and second linears'
    # outputs 2*3/4 * T*h/2 each for two linears each.
    by_hand = 1.5 * 12 * H * H / 4 + 2 * (1.5 * 2 * T * H / 2)
    assert S.axonn(T, H, (1, 4, 2)) == pytest.approx(by_hand)
    kept = S.axonn(T, H, (1, 4, 2), keep_weights=True)
    assert S.axonn(T, H, (1, 4, 2)) - kept == pytest.approx(0.5 * 12 * H * H / 4)
    with pytest.raises(ValueError, match="q\\^3"):
        S.cube_3d(T, H, 16)


def test_matmul_floor_regimes() -> None:
    # P <= d1/d2: d2*d3*(1 - 1/P)
    assert S.matmul_floor(1000, 10, 10, 4) == pytest.approx(100 * 0.75)
    # order of the dims does not matter
    assert S.matmul_floor(10, 1000, 10, 4) == S.matmul_floor(1000, 10, 10, 4)
    # the three regimes meet continuously at their boundaries
    d1, d2, d3 = 4096.0, 1024.0, 256.0
    for boundary in (d1 / d2, d1 * d2 / d3**2):
        lo, hi = S.matmul_floor(d1, d2, d3, boundary), S.matmul_floor(d1, d2, d3, boundary * (1 + 1e-9))
        assert lo == pytest.approx(hi, rel=1e-6)


def test_symbolic_forms_simplify_to_the_closed_forms() -> None:
    t, h, p, pr, pc = sympy.symbols("T h p p_r p_c", positive=True)
    assert (
        sympy.simplify(
            S.summa_2d(t, h, (pr, pc)) - 3 * h * (7 * t * (pc - 1) + 12 * h * (pr - 1)) / (pr * pc)
        )
        == 0
    )
    assert sympy.simplify(S.megatron_1d(t, h, p) - 8 * (p - 1) / p * t * h) == 0
    q = sympy.Symbol("q", positive=True)
    assert sympy.simplify(S.cube_3d(t, h, q**3) - 2 * (q - 1) / q**3 * (16 * t * h + 12 * h**2)) == 0
    gx, gy, gz = sympy.symbols("G_x G_y G_z", positive=True)
    expr = S.axonn(t, h, (gx, gy, gz))
    assert float(expr.subs({t: T, h: H, gx: 2, gy: 8, gz: 4})) == pytest.approx(S.axonn(T, H, (2, 8, 4)))


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("group", [2, 8])
def test_collective_expr_matches_float(kind: str, group: int) -> None:
    link = H100.inter_node
    elements = 3 * 2**20
    expr = S.collective_time_expr(kind)
    value = expr.subs({S.g: group, S.N: elements * 2, S.alpha: link.alpha, S.beta: link.beta})
    assert float(value) == pytest.approx(
        collective_time(kind, elements, torch.bfloat16, group, link), rel=1e-12
    )


def test_compute_and_memory_exprs_match_float() -> None:
    for flops, nbytes in ((1e12, 1e6), (1e6, 1e9)):
        value = S.compute_time_expr().subs({S.F: flops, S.B: nbytes, S.peak: 989e12, S.mem_bw: 3.35e12})
        assert float(value) == pytest.approx(compute_time(flops, nbytes, torch.bfloat16, H100))
    expr = S.memory_expr()
    syms = {s.name: s for s in expr.free_symbols}
    value = expr.subs(
        {syms["P"]: 1e9, syms["G"]: 1e9, syms["A"]: 5e8, syms["k"]: 2, syms["s"]: 4, syms["b"]: 2}
    )
    assert float(value) == pytest.approx(memory_per_rank(1e9, 1e9, 2.0, 5e8, param_itemsize=2).total)
